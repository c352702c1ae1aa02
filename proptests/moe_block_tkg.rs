//! `moe_block_tkg` (nki-library's decode-time MoE block: RMSNorm, router top-k, experts)
//! against an oracle of its own, written out in f64 from the contract's formulas: the norm
//! rounded to `inp`'s dtype, the router's logits, nki-library's three router pipelines (ACT1
//! dense, ACT1 renormalised, ACT2) and the experts' gated MLPs summed by each mode's
//! coefficients (selective, all-expert on a shard; NO_SCALE, POST_SCALE with the unselected
//! experts masked). Both backends, every option, the dtypes nki-library writes, bit-identity
//! across thread counts, edge cases and every input error.

#![allow(clippy::needless_range_loop)] // the oracle indexes by token, column and expert

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::contracts::ActFnType;
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

/// One call's sizes, options and values.
#[derive(Clone, Debug)]
struct Case {
    t: usize,
    h: usize,
    /// E, the router's experts.
    e: usize,
    /// E_L, the experts held here: E in selective mode, a divisor of E in all-expert mode.
    local: usize,
    i: usize,
    k: usize,
    /// `inp [B, S, H]` with this B (T = B·S), else `[T, H]`.
    batch: Option<usize>,
    inp_bf16: bool,
    weights_bf16: bool,
    /// `router_mm_dtype = bfloat16` (`router_weights` and `router_bias` bf16), else float32.
    mm_bf16: bool,
    softmax: bool,
    /// ACT1 (true) or ACT2 (SOFTMAX only: the block refuses SIGMOID there).
    pre_norm: bool,
    norm_topk: bool,
    post_scale: bool,
    all_expert: bool,
    /// The shard `rank_id` names in all-expert mode.
    rank: usize,
    activation: ActFnType,
    clamp: bool,
    router_bias: bool,
    expert_biases: bool,
    hidden_actual: Option<usize>,
    eps: f32,
    skip_logits: bool,
    x: Vec<f64>,
    gamma: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    gate_up: Vec<f64>,
    down: Vec<f64>,
    gate_up_bias: Vec<f64>,
    down_bias: Vec<f64>,
}

/// The clamp limits a clamped case sets.
const GATE_LIMITS: (f64, f64) = (-0.75, 0.5);
const UP_LIMITS: (f64, f64) = (-0.25, 0.625);

impl Case {
    fn build(
        (t, h, e, i): (usize, usize, usize, usize),
        (k, shards, activation): (usize, usize, usize),
        flags: [bool; 16],
        hidden_actual: Option<usize>,
        seed: u64,
    ) -> Self {
        let [
            batched,
            inp_bf16,
            weights_bf16,
            mm_bf16,
            softmax,
            act2,
            norm_topk,
            post_scale,
            all_expert,
            clamp,
            router_bias,
            expert_biases,
            tiny_eps,
            skip_logits,
            _,
            _,
        ] = flags;
        let mut rng = SeededRng::new(seed);
        // All-expert mode holds one of `shards` equal shards (the largest divisor of E up to
        // the draw); selective mode holds every expert.
        let shards = (1..=shards.min(e))
            .rev()
            .find(|s| e.is_multiple_of(*s))
            .unwrap_or(1);
        let (local, rank) = if all_expert {
            (e / shards, rng.next_u64() as usize % shards)
        } else {
            (e, 0)
        };
        Self {
            t,
            h,
            e,
            local,
            i,
            k,
            batch: (batched && t % 2 == 0).then_some(2),
            inp_bf16,
            weights_bf16,
            mm_bf16,
            softmax: softmax || act2,
            pre_norm: !act2,
            norm_topk,
            post_scale,
            all_expert,
            rank,
            activation: ActFnType::ALL[activation],
            clamp,
            router_bias,
            expert_biases,
            hidden_actual: hidden_actual.map(|a| a.min(h)),
            eps: if tiny_eps { 1e-6 } else { 0.25 },
            skip_logits,
            x: rng.values(t * h, 2.0),
            gamma: rng.values(h, 1.5),
            w: rng.values(h * e, 1.0),
            b: rng.values(e, 1.0),
            gate_up: rng.values(local * h * 2 * i, 0.5),
            down: rng.values(local * i * h, 0.5),
            gate_up_bias: rng.values(local * 2 * i, 0.5),
            down_bias: rng.values(local * h, 0.5),
        }
    }

    fn inp_shape(&self) -> Vec<usize> {
        match self.batch {
            Some(b) => vec![b, self.t / b, self.h],
            None => vec![self.t, self.h],
        }
    }

    /// The tensors and parameters (`output_dtype = float32`).
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let float = |shape: &[usize], v: &[f64], bf16: bool| {
            let tensor = f32_tensor(shape, v);
            if bf16 { tensor.to_bf16() } else { tensor }
        };
        let (h, e, local, i) = (self.h, self.e, self.local, self.i);
        let mut tensors = BTreeMap::new();
        let mut put = |name: &str, tensor: Tensor| {
            tensors.insert(name.to_owned(), tensor);
        };
        put("inp", float(&self.inp_shape(), &self.x, self.inp_bf16));
        put("gamma", float(&[1, h], &self.gamma, self.inp_bf16));
        put("router_weights", float(&[h, e], &self.w, self.mm_bf16));
        let wb = self.weights_bf16;
        put(
            "expert_gate_up_weights",
            float(&[local, h, 2, i], &self.gate_up, wb),
        );
        put("expert_down_weights", float(&[local, i, h], &self.down, wb));
        if self.router_bias {
            put("router_bias", float(&[1, e], &self.b, self.mm_bf16));
        }
        if self.expert_biases {
            put(
                "expert_gate_up_bias",
                float(&[local, 2, i], &self.gate_up_bias, wb),
            );
            put("expert_down_bias", float(&[local, h], &self.down_bias, wb));
        }
        if self.all_expert {
            put("rank_id", i32_tensor(&[1, 1], &[self.rank as i32]));
        }
        let mut params = Params::default();
        let mut set = |name: &str, value: &str| params.set(name, value).unwrap();
        set("top_k", &self.k.to_string());
        set("eps", &self.eps.to_string());
        set(
            "router_mm_dtype",
            if self.mm_bf16 { "bfloat16" } else { "float32" },
        );
        set(
            "router_act_fn",
            if self.softmax { "SOFTMAX" } else { "SIGMOID" },
        );
        set("router_pre_norm", &self.pre_norm.to_string());
        set("norm_topk_prob", &self.norm_topk.to_string());
        set(
            "expert_affinities_scaling_mode",
            if self.post_scale {
                "POST_SCALE"
            } else {
                "NO_SCALE"
            },
        );
        set("hidden_act_fn", self.activation.name());
        if self.clamp {
            set("gate_clamp_lower_limit", &GATE_LIMITS.0.to_string());
            set("gate_clamp_upper_limit", &GATE_LIMITS.1.to_string());
            set("up_clamp_lower_limit", &UP_LIMITS.0.to_string());
            set("up_clamp_upper_limit", &UP_LIMITS.1.to_string());
        }
        if let Some(actual) = self.hidden_actual {
            set("hidden_actual", &actual.to_string());
        }
        set("skip_router_logits", &self.skip_logits.to_string());
        set("is_all_expert", &self.all_expert.to_string());
        set("output_dtype", "float32");
        (tensors, params)
    }

    /// The relative tolerance of a backend's outputs: f32 accumulation, and, for bf16 `inp`,
    /// a norm element whose f32 value lands on the other side of a bf16 rounding boundary.
    fn rtol(&self) -> f64 {
        if self.inp_bf16 { 1e-2 } else { 1e-4 }
    }
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=9, 1usize..=24, 1usize..=12, 1usize..=12)
        .prop_flat_map(|(t, h, e, i)| {
            (
                Just((t, h, e, i)),
                (1..=e.min(8), 1usize..=4, 0..ActFnType::ALL.len()),
                proptest::array::uniform16(any::<bool>()),
                proptest::option::of(1..=h),
                any::<u64>(),
            )
        })
        .prop_map(|(dims, options, flags, actual, seed)| {
            Case::build(dims, options, flags, actual, seed)
        })
}

/// A tensor's values as stored.
fn stored(tensors: &BTreeMap<String, Tensor>, name: &str) -> Vec<f64> {
    tensors[name].to_f64_vec()
}

/// `value` rounded as the backends round the norm: to f32, then to bf16 where `bf16`.
fn rounded(values: &[f64], bf16: bool) -> Vec<f64> {
    let tensor = f32_tensor(&[values.len()], values);
    if bf16 { tensor.to_bf16() } else { tensor }.to_f64_vec()
}

/// `x [T, H]`: `inp / sqrt(Σ inp² / divisor + eps) ⊙ gamma`, rounded to `inp`'s dtype.
fn norm(c: &Case, tensors: &BTreeMap<String, Tensor>) -> Vec<f64> {
    let (inp, gamma) = (stored(tensors, "inp"), stored(tensors, "gamma"));
    let divisor = c.hidden_actual.unwrap_or(c.h) as f64;
    let mut x = vec![0.0; c.t * c.h];
    for t in 0..c.t {
        let row = &inp[t * c.h..(t + 1) * c.h];
        let mean_square = row.iter().map(|v| v * v).sum::<f64>() / divisor;
        let r = 1.0 / (mean_square + f64::from(c.eps)).sqrt();
        for h in 0..c.h {
            x[t * c.h + h] = row[h] * r * gamma[h];
        }
    }
    rounded(&x, c.inp_bf16)
}

/// `[T, E]`: `mm(x) · router_weights + router_bias`.
fn logits(c: &Case, tensors: &BTreeMap<String, Tensor>, x: &[f64]) -> Vec<f64> {
    let router_input = rounded(x, c.mm_bf16);
    let w = stored(tensors, "router_weights");
    let b = tensors
        .get("router_bias")
        .map_or_else(|| vec![0.0; c.e], Tensor::to_f64_vec);
    let mut z = vec![0.0; c.t * c.e];
    for t in 0..c.t {
        for e in 0..c.e {
            z[t * c.e + e] = b[e]
                + (0..c.h)
                    .map(|h| router_input[t * c.h + h] * w[h * c.e + e])
                    .sum::<f64>();
        }
    }
    z
}

/// The K experts of one token's logits, descending, ties to the lower id, and the gap between
/// the K-th and the next (infinite where K = E): how clearly the set is decided.
fn top_k(row: &[f64], k: usize) -> (Vec<usize>, f64) {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let gap = if k < row.len() {
        row[order[k - 1]] - row[order[k]]
    } else {
        f64::INFINITY
    };
    (order[..k].to_vec(), gap)
}

/// `[E]`: the router's affinities for one token whose experts are `chosen`, by the pipeline:
/// ACT1 the activation of every logit (renormalised over the K and zero elsewhere with
/// `norm_topk_prob`), ACT2 the softmax of the K selected logits, zero elsewhere.
fn affinities(c: &Case, row: &[f64], chosen: &[usize]) -> Vec<f64> {
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    let softmax = |values: &[f64]| {
        let max = values.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let exp: Vec<f64> = values.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = exp.iter().sum();
        exp.into_iter().map(|v| v / sum).collect::<Vec<_>>()
    };
    let mut a = vec![0.0; c.e];
    if !c.pre_norm {
        let selected: Vec<f64> = chosen.iter().map(|&e| row[e]).collect();
        for (&e, v) in chosen.iter().zip(softmax(&selected)) {
            a[e] = v;
        }
        return a;
    }
    let dense = if c.softmax {
        softmax(row)
    } else {
        row.iter().map(|&v| sigmoid(v)).collect()
    };
    if !c.norm_topk {
        return dense;
    }
    let sum: f64 = chosen.iter().map(|&e| dense[e]).sum();
    for &e in chosen {
        a[e] = dense[e] / sum;
    }
    a
}

/// `f_j(x_t) [H]`: expert j's gated MLP on one row (biases added before the clamps).
fn expert(c: &Case, tensors: &BTreeMap<String, Tensor>, j: usize, row: &[f64]) -> Vec<f64> {
    let (h, i) = (c.h, c.i);
    let gate_up = stored(tensors, "expert_gate_up_weights");
    let down = stored(tensors, "expert_down_weights");
    let bias = |name: &str, n: usize| {
        tensors
            .get(name)
            .map_or_else(|| vec![0.0; n], Tensor::to_f64_vec)
    };
    let (gate_up_bias, down_bias) = (
        bias("expert_gate_up_bias", c.local * 2 * i),
        bias("expert_down_bias", c.local * h),
    );
    let clamp = |v: f64, (lo, hi): (f64, f64)| if c.clamp { v.clamp(lo, hi) } else { v };
    let hidden: Vec<f64> = (0..i)
        .map(|col| {
            let projection = |p: usize| {
                gate_up_bias[(j * 2 + p) * i + col]
                    + (0..h)
                        .map(|r| row[r] * gate_up[((j * h + r) * 2 + p) * i + col])
                        .sum::<f64>()
            };
            let gate = clamp(projection(0), GATE_LIMITS);
            let up = clamp(projection(1), UP_LIMITS);
            activate(c.activation, gate) * up
        })
        .collect();
    (0..h)
        .map(|col| {
            down_bias[j * h + col]
                + (0..i)
                    .map(|r| hidden[r] * down[(j * i + r) * h + col])
                    .sum::<f64>()
        })
        .collect()
}

/// `out[t] [H]`: the token's experts summed by the mode's coefficients.
fn token_output(
    c: &Case,
    tensors: &BTreeMap<String, Tensor>,
    row: &[f64],
    chosen: &[usize],
    a: &[f64],
) -> Vec<f64> {
    // (local expert, coefficient) per route.
    let routes: Vec<(usize, f64)> = if c.all_expert {
        let first = c.rank * c.local;
        (0..c.local)
            .map(|j| {
                let global = first + j;
                // POST_SCALE reads the dense affinities, masked to the selected experts where
                // they are dense (ACT1 without renormalisation); elsewhere they are zero anyway.
                let selected = chosen.contains(&global);
                let coefficient = match (c.post_scale, selected) {
                    (false, _) => 1.0,
                    (true, true) => a[global],
                    (true, false) if c.pre_norm && !c.norm_topk => 0.0,
                    (true, false) => a[global],
                };
                (j, coefficient)
            })
            .collect()
    } else {
        chosen
            .iter()
            .map(|&e| (e, if c.post_scale { a[e] } else { 1.0 }))
            .collect()
    };
    let mut out = vec![0.0; c.h];
    for (j, coefficient) in routes {
        for (o, y) in out.iter_mut().zip(expert(c, tensors, j, row)) {
            *o += coefficient * y;
        }
    }
    out
}

fn run(
    backend: BackendKind,
    tensors: &BTreeMap<String, Tensor>,
    params: &Params,
) -> Result<BTreeMap<&'static str, Tensor>, Error> {
    Ok(Kernel::MoeBlockTkg
        .run(backend.create().as_ref(), tensors, params)?
        .into_iter()
        .collect())
}

/// One backend's outputs against the oracle. The experts a token goes to are decided by its
/// logits, so the oracle chooses them from the backend's own `router_logits` (checked against
/// the oracle's first) and checks `out` for the tokens whose K-th and next logits are clearly
/// apart; with `skip_router_logits` it chooses from its own logits, on the same condition.
fn check(backend: BackendKind, c: &Case) -> Result<(), TestCaseError> {
    let (tensors, params) = c.tensors();
    let out = run(backend, &tensors, &params).unwrap();
    let rtol = c.rtol();
    let x = norm(c, &tensors);
    let z = logits(c, &tensors, &x);
    prop_assert_eq!(out["out"].shape(), &[c.t, c.h]);
    let decided_by = if c.skip_logits {
        prop_assert!(!out.contains_key("router_logits"));
        z.clone()
    } else {
        let got = f32s(&out["router_logits"]);
        prop_assert_eq!(out["router_logits"].shape(), &[c.t, c.e]);
        assert_close(
            &format!("{backend} router_logits"),
            &got,
            &z,
            rtol,
            rtol * scale(&z),
        )?;
        got
    };
    let got = f32s(&out["out"]);
    let mut want = Vec::with_capacity(c.t * c.h);
    let mut decided = Vec::with_capacity(c.t);
    for t in 0..c.t {
        let row = &decided_by[t * c.e..(t + 1) * c.e];
        let (chosen, gap) = top_k(row, c.k);
        decided.push(gap > 10.0 * rtol * scale(row));
        let a = affinities(c, &z[t * c.e..(t + 1) * c.e], &chosen);
        want.extend(token_output(
            c,
            &tensors,
            &x[t * c.h..(t + 1) * c.h],
            &chosen,
            &a,
        ));
    }
    let tol = rtol * scale(&want);
    for t in (0..c.t).filter(|&t| decided[t]) {
        let rows = t * c.h..(t + 1) * c.h;
        assert_close(
            &format!("{backend} out, token {t}"),
            &got[rows.clone()],
            &want[rows],
            rtol,
            tol,
        )?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn both_backends_match_the_oracle(c in case()) {
        check(BackendKind::Reference, &c)?;
        check(BackendKind::Cpu, &c)?;
    }

    /// Under `output_dtype = input` the outputs are the float32 ones rounded to `inp`'s dtype.
    #[test]
    fn outputs_take_the_dtypes_nki_library_writes(c in case()) {
        let (tensors, mut params) = c.tensors();
        let f32_outputs = run(BackendKind::Cpu, &tensors, &params).unwrap();
        params.set("output_dtype", "input").unwrap();
        let nki_outputs = run(BackendKind::Cpu, &tensors, &params).unwrap();
        prop_assert_eq!(f32_outputs.len(), nki_outputs.len());
        let dtype = if c.inp_bf16 { DType::BF16 } else { DType::F32 };
        for (name, nki) in &nki_outputs {
            prop_assert_eq!(nki.dtype(), dtype, "{}", name);
            let mut rounded = f32_outputs[name].clone();
            if c.inp_bf16 {
                rounded = rounded.to_bf16();
            }
            prop_assert_eq!(nki, &rounded, "{}", name);
        }
    }
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(c in case()) {
        let (tensors, params) = c.tensors();
        let runs: Vec<Vec<Vec<u8>>> = [1, 2, 3]
            .into_iter()
            .map(|threads| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    run(BackendKind::Cpu, &tensors, &params)
                        .unwrap()
                        .values()
                        .map(Tensor::to_le_bytes)
                        .collect()
                })
            })
            .collect();
        prop_assert!(runs[1] == runs[0] && runs[2] == runs[0]);
    }
}

/// A case with the given sizes and modes, every other option off.
fn plain(
    (t, h, e, i, k): (usize, usize, usize, usize, usize),
    all_expert: bool,
    shards: usize,
    seed: u64,
) -> Case {
    let mut flags = [false; 16];
    flags[8] = all_expert;
    flags[7] = true; // POST_SCALE
    Case::build((t, h, e, i), (k, shards, 0), flags, None, seed)
}

#[test]
fn edge_sizes_match_the_oracle() {
    let cases = [
        // One token, one expert chosen.
        plain((1, 16, 6, 8, 1), false, 1, 1),
        // E not a multiple of 8; every expert chosen.
        plain((3, 12, 5, 4, 5), false, 1, 2),
        plain((5, 9, 13, 6, 3), false, 1, 3),
        // All-expert with one shard (every expert held) and with single-expert shards.
        plain((4, 10, 6, 5, 2), true, 1, 4),
        plain((4, 10, 6, 5, 2), true, 6, 5),
        // A token of 128 rows of H at a decode size.
        plain((1, 256, 16, 32, 4), false, 1, 6),
    ];
    for c in cases {
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            check(backend, &c).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        }
    }
}

/// With the affinities dense (ACT1, no renormalisation) and every expert held, all-expert
/// POST_SCALE with its unselected experts masked is the selective block.
#[test]
fn all_expert_on_one_shard_is_the_selective_block() {
    for seed in 0..8 {
        let selective = plain((6, 20, 7, 9, 3), false, 1, seed);
        let all = Case {
            all_expert: true,
            ..selective.clone()
        };
        let (tensors, params) = selective.tensors();
        let (all_tensors, all_params) = all.tensors();
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let a = run(backend, &tensors, &params).unwrap();
            let b = run(backend, &all_tensors, &all_params).unwrap();
            let (a, b) = (f32s(&a["out"]), f32s(&b["out"]));
            assert_close("all-expert out", &b, &a, 1e-5, 1e-5 * scale(&a)).unwrap();
        }
    }
}

/// `[B, S, H]` is `[B·S, H]` by another shape: the same outputs.
#[test]
fn batched_inp_is_its_rows() {
    let c = plain((6, 12, 5, 4, 2), false, 1, 9);
    let batched = Case {
        batch: Some(3),
        ..c.clone()
    };
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let (tensors, params) = c.tensors();
        let (batched_tensors, _) = batched.tensors();
        assert_eq!(batched_tensors["inp"].shape(), &[3, 2, 12]);
        assert_eq!(
            run(backend, &tensors, &params).unwrap(),
            run(backend, &batched_tensors, &params).unwrap()
        );
    }
}

/// Runs the block on `c` with `edit` applied on both backends; both must fail with the same
/// message, containing every one of `expected`.
fn fails(c: &Case, edit: impl Fn(&mut BTreeMap<String, Tensor>, &mut Params), expected: &[&str]) {
    let (mut tensors, mut params) = c.tensors();
    edit(&mut tensors, &mut params);
    let messages: Vec<String> = [BackendKind::Reference, BackendKind::Cpu]
        .into_iter()
        .map(|backend| match run(backend, &tensors, &params) {
            Ok(_) => panic!("{backend} accepted it; expected {expected:?}"),
            Err(e) => e.to_string(),
        })
        .collect();
    assert_eq!(messages[0], messages[1]);
    for part in expected {
        assert!(messages[0].contains(part), "{}: no `{part}`", messages[0]);
    }
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let c = plain((4, 8, 6, 4, 2), false, 1, 11);
    let all = plain((4, 8, 6, 4, 2), true, 3, 11);
    let put = |name: &'static str, tensor: Tensor| {
        move |t: &mut BTreeMap<String, Tensor>, _: &mut Params| {
            t.insert(name.to_owned(), tensor.clone());
        }
    };
    let set = |name: &'static str, value: &'static str| {
        move |_: &mut BTreeMap<String, Tensor>, p: &mut Params| p.set(name, value).unwrap()
    };
    let remove = |name: &'static str| {
        move |t: &mut BTreeMap<String, Tensor>, _: &mut Params| {
            t.remove(name);
        }
    };
    let zeros = |shape: &[usize]| f32_tensor(shape, &vec![0.0; shape.iter().product()]);
    // Refused with nki-library's reasons.
    fails(&c, put("residual", zeros(&[4, 8])), &["residual", "MXFP"]);
    fails(
        &c,
        |_, p| {
            p.set("router_pre_norm", "false").unwrap();
            p.set("router_act_fn", "SIGMOID").unwrap();
        },
        &["router_act_fn", "SIGMOID", "router_pre_norm=False"],
    );
    fails(
        &c,
        set("expert_affinities_scaling_mode", "PRE_SCALE"),
        &["expert_affinities_scaling_mode", "PRE_SCALE"],
    );
    // Required inputs, shapes and dtypes.
    for name in ["inp", "gamma", "router_weights", "expert_gate_up_weights"] {
        fails(&c, remove(name), &[name]);
    }
    fails(&c, put("inp", zeros(&[4])), &["inp", "[4]"]);
    fails(&c, put("gamma", zeros(&[1, 7])), &["gamma"]);
    fails(
        &c,
        put("router_weights", zeros(&[8, 6]).to_bf16()),
        &["router_weights", "router_mm_dtype = float32"],
    );
    fails(
        &c,
        put("router_bias", zeros(&[1, 5])),
        &["router_bias", "[1, E]"],
    );
    fails(
        &c,
        put("expert_gate_up_weights", zeros(&[6, 7, 2, 4])),
        &["expert_gate_up_weights"],
    );
    fails(
        &c,
        put("expert_down_weights", zeros(&[6, 4, 9])),
        &["expert_down_weights"],
    );
    fails(
        &c,
        put("expert_gate_up_bias", zeros(&[6, 2, 5])),
        &["expert_gate_up_bias"],
    );
    // Non-finite values, wherever they are.
    let mut nan_weights = c.down.clone();
    nan_weights[5] = f64::NAN;
    fails(
        &c,
        put("expert_down_weights", f32_tensor(&[6, 4, 8], &nan_weights)),
        &["expert_down_weights", "non-finite"],
    );
    // Which experts are held: all of them in selective mode, a shard in all-expert mode.
    fails(
        &c,
        |t, _| {
            t.insert("expert_gate_up_weights".into(), zeros(&[3, 8, 2, 4]));
            t.insert("expert_down_weights".into(), zeros(&[3, 4, 8]));
        },
        &["expert_gate_up_weights", "selective mode"],
    );
    fails(&all, remove("rank_id"), &["rank_id", "required"]);
    fails(
        &all,
        put("rank_id", i32_tensor(&[1, 1], &[3])),
        &["rank_id", "rank 3 holds no experts"],
    );
    fails(
        &all,
        |t, _| {
            t.insert("expert_gate_up_weights".into(), zeros(&[4, 8, 2, 4]));
            t.insert("expert_down_weights".into(), zeros(&[4, 4, 8]));
        },
        &["expert_gate_up_weights", "dividing E = 6"],
    );
    // Parameter values.
    fails(&c, set("top_k", "0"), &["top_k", "1..=6"]);
    fails(&c, set("top_k", "7"), &["top_k", "1..=6"]);
    fails(&c, set("hidden_actual", "9"), &["hidden_actual", "1..=8"]);
    fails(&c, set("eps", "0"), &["eps", "positive"]);
    fails(
        &c,
        |_, p| {
            p.set("gate_clamp_lower_limit", "1").unwrap();
            p.set("gate_clamp_upper_limit", "0").unwrap();
        },
        &["gate_clamp"],
    );
}

/// nki-library's defaults: one expert by SIGMOID over dense ACT1 affinities, NO_SCALE, so a
/// token's output is its one expert's, unscaled.
#[test]
fn defaults_run_one_unscaled_expert_per_token() {
    let c = Case {
        eps: 1e-6,
        ..plain((3, 16, 4, 8, 1), false, 1, 21)
    };
    let (tensors, _) = c.tensors();
    let mut params = Params::default();
    params.set("router_mm_dtype", "float32").unwrap();
    params.set("output_dtype", "float32").unwrap();
    let out = run(BackendKind::Reference, &tensors, &params).unwrap();
    let z = f32s(&out["router_logits"]);
    let x = norm(&c, &tensors);
    let got = f32s(&out["out"]);
    for t in 0..c.t {
        let (chosen, _) = top_k(&z[t * c.e..(t + 1) * c.e], 1);
        let want = expert(&c, &tensors, chosen[0], &x[t * c.h..(t + 1) * c.h]);
        let rows = t * c.h..(t + 1) * c.h;
        assert_close("out", &got[rows], &want, 1e-5, 1e-5 * scale(&want)).unwrap();
    }
}
