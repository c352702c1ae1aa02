//! `moe_tkg` (decode-time experts) against an oracle of its own: every token through every
//! expert held here as dense f64 matrices, weighted by a coefficient matrix `[T, E_L]` built
//! straight from the mode's definition. Both backends, every option (selective and all-expert,
//! NO_SCALE and POST_SCALE, eager affinities, `rank_id`, the mask, biases, clamps, every
//! activation, f32 and bf16), bit-identity across thread counts, the cpu backend's pieces and
//! waves on crowded experts, and every input error.

#![allow(clippy::needless_range_loop)] // the oracle indexes by token, expert and column

mod common;

use std::collections::BTreeMap;
use std::ops::Range;

use common::*;
use moekit::contracts::{ActFnType, ExpertAffinityScaleMode};
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, Error, Tensor};
use proptest::prelude::*;

/// One decoding step's tensors and options.
#[derive(Clone, Debug)]
struct Case {
    t: usize,
    h: usize,
    i: usize,
    /// E_L, experts held here.
    local: usize,
    /// Ranks: E = E_L · ranks.
    ranks: usize,
    k: usize,
    rank: usize,
    all_expert: bool,
    post_scale: bool,
    mask: bool,
    eager: bool,
    biases: bool,
    clamp: bool,
    bf16: bool,
    activation: ActFnType,
    x: Vec<f64>,
    gate_up: Vec<f64>,
    down: Vec<f64>,
    affinities: Vec<f64>,
    index: Vec<i32>,
    eager_affinities: Vec<f64>,
    gate_up_bias: Vec<f64>,
    down_bias: Vec<f64>,
}

impl Case {
    fn e(&self) -> usize {
        self.local * self.ranks
    }

    /// The case's tensors by contract name, f32 or bf16, and its parameters.
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let (t, h, i, e, k, local) = (self.t, self.h, self.i, self.e(), self.k, self.local);
        let float = |shape: &[usize], v: &[f64]| {
            let tensor = f32_tensor(shape, v);
            if self.bf16 { tensor.to_bf16() } else { tensor }
        };
        let mut tensors = BTreeMap::new();
        let mut put = |name: &str, tensor: Tensor| {
            tensors.insert(name.to_owned(), tensor);
        };
        put("hidden_input", float(&[t, h], &self.x));
        put(
            "expert_gate_up_weights",
            float(&[local, h, 2, i], &self.gate_up),
        );
        put("expert_down_weights", float(&[local, i, h], &self.down));
        put("expert_affinities", float(&[t, e], &self.affinities));
        put("expert_index", i32_tensor(&[t, k], &self.index));
        put("rank_id", i32_tensor(&[1, 1], &[self.rank as i32]));
        if self.eager {
            put(
                "expert_affinities_eager",
                float(&[t, k], &self.eager_affinities),
            );
        }
        if self.biases {
            put(
                "expert_gate_up_bias",
                float(&[local, 2, i], &self.gate_up_bias),
            );
            put("expert_down_bias", float(&[local, h], &self.down_bias));
        }
        let mut params = Params::default();
        let scaling = if self.post_scale {
            ExpertAffinityScaleMode::PostScale
        } else {
            ExpertAffinityScaleMode::NoScale
        };
        let mut set = |name: &str, value: &str| params.set(name, value).unwrap();
        set("is_all_expert", &self.all_expert.to_string());
        set("expert_affinities_scaling_mode", scaling.name());
        set("activation_fn", self.activation.name());
        set("mask_unselected_experts", &self.mask.to_string());
        set("output_dtype", "float32");
        if self.clamp {
            set("gate_clamp_lower_limit", "-0.75");
            set("gate_clamp_upper_limit", "0.5");
            set("up_clamp_lower_limit", "-0.25");
            set("up_clamp_upper_limit", "0.625");
        }
        (tensors, params)
    }

    /// The case's float inputs as the kernels read them: rounded to bf16 where stored so.
    fn stored(&self, values: &[f64]) -> Vec<f64> {
        let tensor = f32_tensor(&[values.len()], values);
        if self.bf16 {
            tensor.to_bf16().to_f64_vec()
        } else {
            tensor.to_f64_vec()
        }
    }
}

fn case() -> impl Strategy<Value = Case> {
    case_with(1..10, 1..20, 1..10)
}

/// Cases of `tokens` T, H in `hidden`, I in `intermediate`, every option drawn.
fn case_with(
    tokens: Range<usize>,
    hidden: Range<usize>,
    intermediate: Range<usize>,
) -> impl Strategy<Value = Case> {
    (
        (tokens, hidden, intermediate, 1usize..6, 1usize..4),
        (any::<[bool; 8]>(), 0..ActFnType::ALL.len()),
        any::<u64>(),
    )
        .prop_flat_map(|(dims, flags, seed)| {
            let (_, _, _, local, ranks) = dims;
            (
                Just((dims, flags, seed)),
                1..=(local * ranks).min(6),
                0..ranks,
            )
        })
        .prop_map(|((dims, (flags, activation), seed), k, rank)| {
            let (t, h, i, local, ranks) = dims;
            let [
                all_expert,
                post_scale,
                mask,
                eager,
                biases,
                clamp,
                bf16,
                repeats,
            ] = flags;
            let e = local * ranks;
            let mut rng = SeededRng::new(seed);
            // Selective ids index the experts held here, all-expert ids are global; with
            // `repeats` a row may name an expert twice (the kernel sums it twice, or the mask
            // counts it twice).
            let pool = if all_expert { e } else { local };
            let index: Vec<i32> = if repeats {
                (0..t * k).map(|_| rng.below(pool) as i32).collect()
            } else {
                (0..t)
                    .flat_map(|_| {
                        let mut ids = rng.permutation(pool);
                        ids.resize(k, 0);
                        ids
                    })
                    .map(|id| id as i32)
                    .collect()
            };
            // The router's sparse affinities: non-zero at the selected experts only (global
            // columns; a selective id j reads column j).
            let mut affinities = vec![0.0; t * e];
            let picked = rng.values(t * k, 1.0);
            for slot in 0..t * k {
                affinities[slot / k * e + index[slot] as usize] = picked[slot].abs();
            }
            Case {
                t,
                h,
                i,
                local,
                ranks,
                k,
                rank,
                all_expert,
                post_scale,
                mask,
                eager: eager && !all_expert,
                biases,
                clamp,
                bf16,
                activation: ActFnType::ALL[activation],
                x: rng.values(t * h, 1.0),
                gate_up: rng.values(local * h * 2 * i, 0.5),
                down: rng.values(local * i * h, 0.5),
                affinities,
                index,
                eager_affinities: rng.values(t * k, 1.0),
                gate_up_bias: rng.values(local * 2 * i, 0.5),
                down_bias: rng.values(local * h, 0.5),
            }
        })
}

/// `[T, E_L]`: how much of expert j's output token t receives, from the mode's definition.
fn coefficients(c: &Case) -> Vec<Vec<f64>> {
    let (e, k) = (c.e(), c.k);
    let affinities = c.stored(&c.affinities);
    let eager = c.stored(&c.eager_affinities);
    (0..c.t)
        .map(|t| {
            let ids = &c.index[t * k..(t + 1) * k];
            (0..c.local)
                .map(|j| {
                    if !c.all_expert {
                        // Once per slot naming j.
                        (0..k)
                            .filter(|&slot| ids[slot] as usize == j)
                            .map(|slot| match (c.post_scale, c.eager) {
                                (false, _) => 1.0,
                                (true, true) => eager[t * k + slot],
                                (true, false) => affinities[t * e + j],
                            })
                            .sum()
                    } else if !c.post_scale {
                        1.0
                    } else {
                        let global = c.rank * c.local + j;
                        let times = ids.iter().filter(|&&id| id as usize == global).count();
                        let mask = if c.mask { times as f64 } else { 1.0 };
                        affinities[t * e + global] * mask
                    }
                })
                .collect()
        })
        .collect()
}

/// `output [T, H]`: `Σ_j coefficient[t][j] · f_j(x_t)`, every expert's output computed for every
/// token as dense f64 matrix products.
fn oracle(c: &Case) -> Vec<f64> {
    let (t, h, i) = (c.t, c.h, c.i);
    let (x, gate_up, down) = (c.stored(&c.x), c.stored(&c.gate_up), c.stored(&c.down));
    let (gate_up_bias, down_bias) = (c.stored(&c.gate_up_bias), c.stored(&c.down_bias));
    let clamp = |v: f64, lo: f64, hi: f64| if c.clamp { v.clamp(lo, hi) } else { v };
    let coefficients = coefficients(c);
    let mut output = vec![0.0; t * h];
    for j in 0..c.local {
        for token in 0..t {
            let row = &x[token * h..(token + 1) * h];
            let mut hidden = vec![0.0; i];
            for col in 0..i {
                let mut projections = [0.0; 2];
                for (proj, p) in projections.iter_mut().enumerate() {
                    *p = (0..h)
                        .map(|r| row[r] * gate_up[((j * h + r) * 2 + proj) * i + col])
                        .sum::<f64>();
                    if c.biases {
                        *p += gate_up_bias[(j * 2 + proj) * i + col];
                    }
                }
                let gate = clamp(projections[0], -0.75, 0.5);
                let up = clamp(projections[1], -0.25, 0.625);
                hidden[col] = activate(c.activation, gate) * up;
            }
            for col in 0..h {
                let mut y: f64 = (0..i)
                    .map(|r| hidden[r] * down[(j * i + r) * h + col])
                    .sum();
                if c.biases {
                    y += down_bias[j * h + col];
                }
                output[token * h + col] += coefficients[token][j] * y;
            }
        }
    }
    output
}

fn run(backend: BackendKind, c: &Case) -> Result<Tensor, Error> {
    let (tensors, params) = c.tensors();
    let mut outputs = Kernel::MoeTkg.run(backend.create().as_ref(), &tensors, &params)?;
    assert_eq!(outputs.len(), 1);
    let (name, output) = outputs.pop().unwrap();
    assert_eq!(name, "output");
    Ok(output)
}

/// Output bytes with 1, 2 and 3 threads, equal.
fn bit_identical_across_thread_counts(c: &Case) {
    let runs: Vec<Vec<u8>> = [1, 2, 3]
        .into_iter()
        .map(|threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| run(BackendKind::Cpu, c).unwrap().to_le_bytes())
        })
        .collect();
    assert!(runs[1] == runs[0] && runs[2] == runs[0], "{c:?}");
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn both_backends_match_the_dense_oracle(c in case()) {
        let want = oracle(&c);
        let reference = run(BackendKind::Reference, &c).unwrap();
        prop_assert_eq!(reference.shape(), &[c.t, c.h]);
        // f64, rounded once to f32.
        assert_close("reference", &reference.to_f64_vec(), &want, 1e-6, 1e-6 * scale(&want))?;
        let cpu = run(BackendKind::Cpu, &c).unwrap();
        assert_close("cpu", &cpu.to_f64_vec(), &want, 1e-4, 1e-4 * scale(&want))?;
    }

    #[test]
    fn outputs_take_hidden_inputs_dtype(c in case()) {
        let (tensors, mut params) = c.tensors();
        params.set("output_dtype", "input").unwrap();
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let f32_output = run(backend, &c).unwrap();
            let (_, nki) = Kernel::MoeTkg
                .run(backend.create().as_ref(), &tensors, &params)
                .unwrap()
                .pop()
                .unwrap();
            let dtype = tensors["hidden_input"].dtype();
            prop_assert_eq!(f32_output.into_float_dtype("output", dtype).unwrap(), nki);
        }
    }
}

proptest! {
    #![proptest_config(config(32))]

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(c in case()) {
        bit_identical_across_thread_counts(&c);
    }

    /// Widths past the cpu backend's 64-column register strips, over several panels of 8 rows,
    /// with odd row counts and a partial last strip.
    #[test]
    fn wide_experts_match_the_dense_oracle(c in case_with(1..6, 60..140, 30..70)) {
        let want = oracle(&c);
        let cpu = run(BackendKind::Cpu, &c).unwrap();
        assert_close("cpu", &cpu.to_f64_vec(), &want, 1e-4, 1e-4 * scale(&want))?;
        bit_identical_across_thread_counts(&c);
    }
}

/// A case with every option at its simplest: T tokens, selective, NO_SCALE, f32.
fn plain(t: usize, h: usize, i: usize, local: usize, k: usize, seed: u64) -> Case {
    let mut rng = SeededRng::new(seed);
    let index: Vec<i32> = (0..t * k).map(|slot| (slot % local) as i32).collect();
    let mut affinities = vec![0.0; t * local];
    for slot in 0..t * k {
        affinities[slot / k * local + index[slot] as usize] = 0.5;
    }
    Case {
        t,
        h,
        i,
        local,
        ranks: 1,
        k,
        rank: 0,
        all_expert: false,
        post_scale: false,
        mask: false,
        eager: false,
        biases: false,
        clamp: false,
        bf16: false,
        activation: ActFnType::Silu,
        x: rng.values(t * h, 1.0),
        gate_up: rng.values(local * h * 2 * i, 0.5),
        down: rng.values(local * i * h, 0.5),
        affinities,
        index,
        eager_affinities: rng.values(t * k, 1.0),
        gate_up_bias: rng.values(local * 2 * i, 0.5),
        down_bias: rng.values(local * h, 0.5),
    }
}

/// All-expert steps whose experts have more routes than one cpu task computes (64), and whose
/// expert outputs exceed one wave's buffer (16 MiB): 600 tokens × 4 experts × H = 2048 in f32.
#[test]
fn crowded_experts_and_several_waves_match_the_oracle() {
    for (t, h, bf16) in [(150, 24, false), (600, 2048, false), (130, 40, true)] {
        let c = Case {
            all_expert: true,
            post_scale: true,
            bf16,
            ..plain(t, h, 3, 4, 2, 7)
        };
        let c = Case {
            affinities: SeededRng::new(8).values(t * 4, 1.0),
            ..c
        };
        let want = oracle(&c);
        let cpu = run(BackendKind::Cpu, &c).unwrap();
        assert_close("cpu", &cpu.to_f64_vec(), &want, 1e-4, 1e-4 * scale(&want)).unwrap();
        bit_identical_across_thread_counts(&c);
    }
}

/// Decode's edge cases: one token, one expert per token, one expert held (all-expert with a
/// single local shard), E not a multiple of 8; and widths past the cpu kernels' strips.
#[test]
fn edge_sizes_match_the_oracle() {
    let cases = [
        ("T = 1", plain(1, 16, 8, 4, 2, 1)),
        ("K = 1", plain(5, 16, 8, 4, 1, 2)),
        (
            "all-expert, one expert held",
            Case {
                all_expert: true,
                ..plain(3, 16, 8, 1, 1, 3)
            },
        ),
        ("E = 13", plain(4, 8, 4, 13, 3, 4)),
        // The cpu backend's register strips (64 columns) over panels of rows, and the
        // columns past the last strip.
        ("H = 96, I = 40", plain(6, 96, 40, 3, 2, 5)),
        (
            "H = 96, I = 40, bf16",
            Case {
                bf16: true,
                ..plain(6, 96, 40, 3, 2, 6)
            },
        ),
        (
            "H = 130, I = 70, all-expert",
            Case {
                all_expert: true,
                ..plain(3, 130, 70, 2, 1, 7)
            },
        ),
    ];
    for (name, c) in cases {
        let want = oracle(&c);
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let got = run(backend, &c).unwrap();
            assert_close(name, &got.to_f64_vec(), &want, 1e-4, 1e-4 * scale(&want)).unwrap();
        }
        bit_identical_across_thread_counts(&c);
    }
}

/// Runs `c` with `edit` applied to its tensors and parameters on both backends; both must fail
/// with the same message, containing every one of `expected`.
fn fails(c: &Case, edit: impl Fn(&mut BTreeMap<String, Tensor>, &mut Params), expected: &[&str]) {
    let (mut tensors, mut params) = c.tensors();
    edit(&mut tensors, &mut params);
    let messages: Vec<String> = [BackendKind::Reference, BackendKind::Cpu]
        .into_iter()
        .map(
            |backend| match Kernel::MoeTkg.run(backend.create().as_ref(), &tensors, &params) {
                Ok(_) => panic!("{backend} accepted it; expected {expected:?}"),
                Err(e) => e.to_string(),
            },
        )
        .collect();
    assert_eq!(messages[0], messages[1]);
    for part in expected {
        assert!(messages[0].contains(part), "{}: no `{part}`", messages[0]);
    }
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let c = plain(3, 8, 4, 4, 2, 5);
    let all_expert_scaled = Case {
        all_expert: true,
        post_scale: true,
        ranks: 2,
        affinities: vec![0.25; 3 * 8],
        index: vec![0, 5, 1, 7, 2, 6],
        ..c.clone()
    };
    let put = |name: &str, tensor: Tensor| {
        let name = name.to_owned();
        move |tensors: &mut BTreeMap<String, Tensor>, _: &mut Params| {
            tensors.insert(name.clone(), tensor.clone());
        }
    };
    let param = |name: &'static str, value: &'static str| {
        move |_: &mut BTreeMap<String, Tensor>, params: &mut Params| {
            params.set(name, value).unwrap();
        }
    };
    fails(
        &c,
        param("expert_affinities_scaling_mode", "PRE_SCALE"),
        &["expert_affinities_scaling_mode", "pre-scale"],
    );
    fails(
        &c,
        param("expert_affinities_scaling_mode", "PRE_SCALE_DELAYED"),
        &["expert_affinities_scaling_mode", "context-encoding"],
    );
    fails(
        &c,
        |_, params| params.is_all_expert = None,
        &["is_all_expert", "required"],
    );
    fails(
        &c,
        |tensors, _| {
            tensors.remove("expert_index");
        },
        &["expert_index"],
    );
    fails(
        &c,
        put("expert_index", i32_tensor(&[3, 2], &[0, 1, 2, 4, 0, 0])),
        &[
            "expert_index",
            "expert id 4",
            "[1, 1]",
            "[0, 4)",
            "selective",
        ],
    );
    fails(
        &c,
        put("expert_index", i32_tensor(&[3, 2], &[0, 1, 2, -1, 0, 0])),
        &["expert_index", "expert id -1"],
    );
    fails(
        &c,
        put("hidden_input", f32_tensor(&[3, 7], &[0.0; 21])),
        &["expert_gate_up_weights", "[E_L, H, 2, I]"],
    );
    fails(
        &c,
        put("expert_down_weights", f32_tensor(&[4, 5, 8], &[0.0; 160])),
        &["expert_down_weights", "[E_L, I, H]"],
    );
    fails(
        &c,
        put("expert_affinities", f32_tensor(&[3, 3], &[0.0; 9])),
        &["expert_affinities", "E ≥ E_L = 4"],
    );
    fails(
        &c,
        put("expert_affinities", f32_tensor(&[2, 4], &[0.0; 8])),
        &["expert_affinities", "[T, E]"],
    );
    fails(
        &c,
        put("hidden_input", f32_tensor(&[3, 8], &[f64::NAN; 24])),
        &["hidden_input", "non-finite"],
    );
    fails(
        &c,
        put("expert_gate_up_bias", f32_tensor(&[4, 2, 5], &[0.0; 40])),
        &["expert_gate_up_bias", "[E_L, 2, I]"],
    );
    fails(
        &c,
        put("expert_down_bias", f32_tensor(&[4, 9], &[0.0; 36])),
        &["expert_down_bias", "[E_L, H]"],
    );
    fails(
        &c,
        put("expert_affinities_eager", f32_tensor(&[3, 1], &[0.0; 3])),
        &["expert_affinities_eager", "[T, K]"],
    );
    fails(
        &c,
        put("hidden_input", i32_tensor(&[3, 8], &[0; 24])),
        &["hidden_input", "f32 or bf16"],
    );
    fails(
        &c,
        |_, params| {
            params.set("gate_clamp_lower_limit", "2").unwrap();
            params.set("gate_clamp_upper_limit", "1").unwrap();
        },
        &["gate_clamp_lower_limit", "above gate_clamp_upper_limit"],
    );
    // All-expert: rank_id required under POST_SCALE, within the ranks E / E_L makes; global ids;
    // no eager affinities.
    fails(
        &all_expert_scaled,
        |tensors, _| {
            tensors.remove("rank_id");
        },
        &["rank_id", "required for all-expert mode"],
    );
    fails(
        &all_expert_scaled,
        put("rank_id", i32_tensor(&[1, 1], &[2])),
        &["rank_id", "rank 2 holds no experts", "E = 8", "2 rank(s)"],
    );
    fails(
        &all_expert_scaled,
        put("rank_id", i32_tensor(&[1], &[0])),
        &["rank_id", "[1, 1]"],
    );
    fails(
        &all_expert_scaled,
        put("expert_index", i32_tensor(&[3, 2], &[0, 8, 1, 7, 2, 6])),
        &["expert_index", "expert id 8", "[0, 8)", "global"],
    );
    fails(
        &all_expert_scaled,
        put("expert_affinities_eager", f32_tensor(&[3, 2], &[0.5; 6])),
        &["expert_affinities_eager", "is_all_expert=true"],
    );
}

/// What is refused under one mode is accepted where that mode ignores it: `rank_id` is not
/// needed by all-expert NO_SCALE nor by the selective mode.
#[test]
fn rank_id_is_only_needed_by_all_expert_post_scale() {
    for (all_expert, post_scale) in [(true, false), (false, true), (false, false)] {
        let c = Case {
            all_expert,
            post_scale,
            ..plain(2, 8, 4, 3, 2, 9)
        };
        let (mut tensors, params) = c.tensors();
        tensors.remove("rank_id");
        let got = Kernel::MoeTkg
            .run(BackendKind::Reference.create().as_ref(), &tensors, &params)
            .unwrap();
        let want = oracle(&c);
        assert_close(
            "output",
            &got[0].1.to_f64_vec(),
            &want,
            1e-6,
            1e-6 * scale(&want),
        )
        .unwrap();
    }
}
