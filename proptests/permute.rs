//! `permute` invariants on random routings (including zero-token experts, all tokens on one
//! expert, B = 1, B > T·K, skipped slots and `n_block_per_iter` > 1) in nki-library's plan
//! convention (padding T, unused blocks on E−1, `block_to_expert [N, 1]`, N from its
//! `get_n_blocks`; −1 and no affinity row T with `skip_token`), tightness of the static block bound, `permute_bwd` as the exact adjoint of
//! the affinity scatter, and error paths.

#![allow(clippy::needless_range_loop)] // test oracles index by expert, token and slot

mod common;

use common::*;
use moekit::contracts::{
    BlockwiseMm, BlockwiseMmInputs, BlockwiseMmParams, OutputDType, Permute, PermuteBwd,
    PermuteBwdInputs, PermuteBwdParams, PermuteInputs, PermuteOutputs, PermuteParams, SKIP,
    SkipMode, static_block_count,
};
use moekit::reference::ReferenceBackend;
use moekit::{Backend, BackendKind, Tensor};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    t: usize,
    e: usize,
    k: usize,
    b: usize,
    n_block_per_iter: usize,
    index: Vec<i32>,
    affinities: Vec<f64>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..12,
        1usize..9,
        routing(),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_flat_map(|(t, e, r, seed, skips)| {
            (Just((t, e, r, seed, skips)), 1..=e, 1usize..20, 1usize..4)
        })
        .prop_map(|((t, e, routing, seed, skips), k, b, n_block_per_iter)| {
            let mut rng = SeededRng::new(seed);
            let mut index = expert_index(&mut rng, routing, t, e, k);
            let mut affinities = rng.values(t * k, 1.0);
            if skips {
                // An expert-parallel receiver's view: some slots hold experts of other ranks.
                skip_slots(&mut rng, &mut index, &mut affinities);
            }
            Case {
                t,
                e,
                k,
                b,
                n_block_per_iter,
                index,
                affinities,
            }
        })
}

fn run(index: &Tensor, affinities: &Tensor, e: usize, b: usize) -> moekit::Result<PermuteOutputs> {
    run_with(index, affinities, PermuteParams::new(e, b))
}

fn run_with(
    index: &Tensor,
    affinities: &Tensor,
    params: PermuteParams,
) -> moekit::Result<PermuteOutputs> {
    let call = Permute::new(
        PermuteInputs {
            expert_index: index,
            topk_affinities: affinities,
        },
        params,
    )?;
    // Every output f32, to compare with the f64 oracles (`proptests/cpu.rs` checks the
    // nki-library dtypes).
    ReferenceBackend.permute(&call.with_output_dtype(OutputDType::Float32))
}

fn run_case(c: &Case) -> PermuteOutputs {
    run_with(
        &i32_tensor(&[c.t, c.k], &c.index),
        &f32_tensor(&[c.t, c.k], &c.affinities),
        PermuteParams {
            n_block_per_iter: c.n_block_per_iter,
            ..PermuteParams::new(c.e, c.b)
        },
    )
    .unwrap()
}

/// nki-library's `get_n_blocks`, in floating point as it computes it:
/// `ceil((T·K − (E−1)) / B) + E − 1`, then `n_block_per_iter · ceil(N / n_block_per_iter)`.
fn nki_block_count(assignments: usize, e: usize, b: usize, n_block_per_iter: usize) -> usize {
    let n = ((assignments as f64 - (e as f64 - 1.0)) / b as f64).ceil() + e as f64 - 1.0;
    (n_block_per_iter as f64 * (n / n_block_per_iter as f64).ceil()) as usize
}

/// Checks every documented property of the plan against the routing it came from.
fn check_plan(c: &Case, out: &PermuteOutputs) -> Result<(), TestCaseError> {
    let (t, e, k, b) = (c.t, c.e, c.k, c.b);
    let counts = out.expert_counts.as_i32().unwrap();
    let positions = out.token_position_to_id.as_i32().unwrap();
    let blocks = out.block_to_expert.as_i32().unwrap();
    let used = out.num_used_blocks.as_i32().unwrap()[0] as usize;
    let n = blocks.len();

    prop_assert_eq!(n, nki_block_count(t * k, e, b, c.n_block_per_iter));
    prop_assert_eq!(n % c.n_block_per_iter, 0);
    prop_assert_eq!(out.block_to_expert.shape(), &[n, 1]);
    prop_assert_eq!(positions.len(), n * b);
    let assigned = c.index.iter().filter(|&&id| id != SKIP).count();
    prop_assert_eq!(counts.iter().sum::<i32>() as usize, assigned);
    let expected_used: usize = counts.iter().map(|&c| (c as usize).div_ceil(b)).sum();
    prop_assert_eq!(used, expected_used);
    prop_assert!(used <= n, "static bound {} below used blocks {}", n, used);

    // Blocks ordered by expert id; the unused blocks follow the used ones, on expert E−1, and
    // hold only padding (token id T).
    prop_assert!(
        blocks.windows(2).all(|w| w[0] <= w[1]),
        "blocks not sorted: {:?}",
        blocks
    );
    prop_assert!(blocks[..used].iter().all(|&x| (x as usize) < e));
    prop_assert!(blocks[used..].iter().all(|&x| x as usize == e - 1));
    prop_assert!(positions[used * b..].iter().all(|&p| p as usize == t));

    for expert in 0..e {
        // The expert's slots, in order, across its contiguous used blocks.
        let slots: Vec<i32> = blocks[..used]
            .iter()
            .enumerate()
            .filter(|&(_, &x)| x as usize == expert)
            .flat_map(|(block, _)| positions[block * b..(block + 1) * b].iter().copied())
            .collect();
        let tokens: Vec<i32> = (0..t as i32)
            .filter(|&tok| {
                c.index[tok as usize * k..(tok as usize + 1) * k].contains(&(expert as i32))
            })
            .collect();
        prop_assert_eq!(counts[expert] as usize, tokens.len());
        prop_assert_eq!(
            slots.len(),
            tokens.len().div_ceil(b) * b,
            "expert {} blocks",
            expert
        );
        // Tokens ascending first, then padding only at the tail of the last block.
        prop_assert_eq!(&slots[..tokens.len()], &tokens[..]);
        prop_assert!(slots[tokens.len()..].iter().all(|&p| p as usize == t));
    }

    let masked = f32s(&out.expert_affinities_masked);
    prop_assert_eq!(out.expert_affinities_masked.shape(), &[(t + 1) * e, 1]);
    let mut expected = vec![0.0; (t + 1) * e];
    for (pair, &id) in c.index.iter().enumerate().filter(|&(_, &id)| id != SKIP) {
        expected[(pair / k) * e + id as usize] = c.affinities[pair];
    }
    prop_assert_eq!(masked, expected);
    Ok(())
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn plan_satisfies_every_invariant(c in case()) {
        let out = run_case(&c);
        check_plan(&c, &out)?;
        // bf16 affinities give the same plan, with the affinities they hold.
        let bf16 = f32_tensor(&[c.t, c.k], &c.affinities).to_bf16();
        let c_bf16 = Case { affinities: bf16.to_f64_vec(), ..c.clone() };
        let from_bf16 = run_with(
            &i32_tensor(&[c.t, c.k], &c.index),
            &bf16,
            PermuteParams { n_block_per_iter: c.n_block_per_iter, ..PermuteParams::new(c.e, c.b) },
        )
        .unwrap();
        check_plan(&c_bf16, &from_bf16)?;
    }

    #[test]
    fn permute_bwd_is_the_adjoint_of_the_affinity_scatter(c in case(), seed in any::<u64>()) {
        // ⟨scatter(a), g⟩ = ⟨a, permute_bwd(g)⟩ for every a and g.
        let out = run_case(&c);
        let mut rng = SeededRng::new(seed);
        let g = rng.values((c.t + 1) * c.e, 1.0);
        let index = i32_tensor(&[c.t, c.k], &c.index);
        for shape in [vec![(c.t + 1) * c.e], vec![(c.t + 1) * c.e, 1]] {
            let g_tensor = f32_tensor(&shape, &g);
            let d = ReferenceBackend.permute_bwd(&PermuteBwd::new(PermuteBwdInputs {
                expert_index: &index,
                expert_affinities_masked_grad: &g_tensor,
            }, PermuteBwdParams::new(c.e)).unwrap()).unwrap().d_topk_affinities;
            prop_assert_eq!(d.shape(), &[c.t, c.k]);
            let lhs = dot(&f32s(&out.expert_affinities_masked), &g);
            let rhs = dot(&c.affinities, &f32s(&d));
            prop_assert!((lhs - rhs).abs() <= 1e-12 * (1.0 + lhs.abs()), "{} vs {}", lhs, rhs);
        }
    }

    #[test]
    fn skip_token_plans_pad_with_minus_one_and_drop_row_t(c in case(), seed in any::<u64>()) {
        // SkipMode(skip_token=True): the padded plan with −1 for T and no affinity row T, on
        // both backends; permute_bwd reads the gradient without row T.
        let padded = run_case(&c);
        let index = i32_tensor(&[c.t, c.k], &c.index);
        let affinities = f32_tensor(&[c.t, c.k], &c.affinities);
        let skip_dma = SkipMode { skip_token: true };
        let params = PermuteParams {
            n_block_per_iter: c.n_block_per_iter,
            skip_dma,
            ..PermuteParams::new(c.e, c.b)
        };
        let call = Permute::new(
            PermuteInputs { expert_index: &index, topk_affinities: &affinities },
            params,
        ).unwrap().with_output_dtype(OutputDType::Float32);
        let expected_ids: Vec<i32> = padded.token_position_to_id.as_i32().unwrap().iter()
            .map(|&id| if id as usize == c.t { -1 } else { id })
            .collect();
        let masked = f32s(&padded.expert_affinities_masked);
        for backend in [BackendKind::Cpu, BackendKind::Reference] {
            let out = backend.create().permute(&call).unwrap();
            prop_assert_eq!(out.token_position_to_id.as_i32().unwrap(), &expected_ids[..]);
            prop_assert_eq!(&out.block_to_expert, &padded.block_to_expert);
            prop_assert_eq!(&out.expert_counts, &padded.expert_counts);
            prop_assert_eq!(&out.num_used_blocks, &padded.num_used_blocks);
            prop_assert_eq!(out.expert_affinities_masked.shape(), &[c.t * c.e, 1]);
            prop_assert_eq!(f32s(&out.expert_affinities_masked), masked[..c.t * c.e].to_vec());
        }
        let g = SeededRng::new(seed).values((c.t + 1) * c.e, 1.0);
        let bwd = |g: &[f64], params| {
            let g = f32_tensor(&[g.len(), 1], g);
            let call = PermuteBwd::new(
                PermuteBwdInputs { expert_index: &index, expert_affinities_masked_grad: &g },
                params,
            )?;
            ReferenceBackend.permute_bwd(&call.with_output_dtype(OutputDType::Float32))
        };
        let want = bwd(&g, PermuteBwdParams::new(c.e)).unwrap();
        let skipping = PermuteBwdParams { skip_dma, ..PermuteBwdParams::new(c.e) };
        prop_assert_eq!(bwd(&g[..c.t * c.e], skipping).unwrap(), want);
        prop_assert!(bwd(&g, skipping).is_err(), "a gradient with row T under skip_token");
    }

    #[test]
    fn static_bound_is_reached_by_the_worst_routing(
        (e, t) in (1usize..10).prop_flat_map(|e| (Just(e), e..40)),
        b in 1usize..12,
    ) {
        // K = 1, T ≥ E; tokens 0..E−1 go one each to experts 1..E−1, the rest to expert 0: the
        // routing that needs the most blocks.
        let index: Vec<i32> = (0..t).map(|tok| if tok < e - 1 { tok as i32 + 1 } else { 0 }).collect();
        let out = run(&i32_tensor(&[t, 1], &index), &f32_tensor(&[t, 1], &vec![0.5; t]), e, b).unwrap();
        prop_assert_eq!(out.num_used_blocks.as_i32().unwrap()[0] as usize, out.block_to_expert.numel());
    }
}

/// The plan nki-library's test generator (`generate_token_position_to_id_and_experts`) makes
/// for a routing and a block count N: `(token_position_to_id [N·B], block_to_expert [N])`.
/// Each expert gets `ceil(count / B)` blocks; the N − Σ padding blocks go to expert E−1, or,
/// with `split_padding`, half (rounded down) to expert (E−1)/2 and the rest to E−1; experts'
/// blocks follow in expert order, each expert's tokens ascending from its first slot, every
/// other slot T.
fn nki_generator_plan(c: &Case, n: usize, split_padding: bool) -> (Vec<i32>, Vec<i32>) {
    let (t, e, k, b) = (c.t, c.e, c.k, c.b);
    let tokens_of = |expert: usize| -> Vec<usize> {
        (0..t)
            .filter(|&tok| c.index[tok * k..(tok + 1) * k].contains(&(expert as i32)))
            .collect()
    };
    let mut blocks_per_expert: Vec<usize> =
        (0..e).map(|x| tokens_of(x).len().div_ceil(b)).collect();
    let padding = n - blocks_per_expert.iter().sum::<usize>();
    if split_padding {
        blocks_per_expert[(e - 1) / 2] += padding / 2;
        blocks_per_expert[e - 1] += padding - padding / 2;
    } else {
        blocks_per_expert[e - 1] += padding;
    }
    let mut positions = vec![t as i32; n * b];
    let mut block_to_expert = Vec::new();
    for expert in 0..e {
        let first = block_to_expert.len() * b;
        for (rank, token) in tokens_of(expert).into_iter().enumerate() {
            positions[first + rank] = token as i32;
        }
        block_to_expert.extend(std::iter::repeat_n(
            expert as i32,
            blocks_per_expert[expert],
        ));
    }
    (positions, block_to_expert)
}

proptest! {
    #![proptest_config(config(1024))]

    #[test]
    fn plan_is_the_one_nki_librarys_test_generator_makes(c in case()) {
        let n = nki_block_count(c.t * c.k, c.e, c.b, c.n_block_per_iter);
        let (positions, blocks) = nki_generator_plan(&c, n, false);
        let params = PermuteParams { n_block_per_iter: c.n_block_per_iter, ..PermuteParams::new(c.e, c.b) };
        let index = i32_tensor(&[c.t, c.k], &c.index);
        let affinities = f32_tensor(&[c.t, c.k], &c.affinities);
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let out = backend
                .create()
                .permute(&Permute::new(
                    PermuteInputs { expert_index: &index, topk_affinities: &affinities },
                    params,
                ).unwrap())
                .unwrap();
            prop_assert_eq!(out.token_position_to_id.as_i32().unwrap(), &positions[..], "{}", backend);
            prop_assert_eq!(out.block_to_expert.as_i32().unwrap(), &blocks[..], "{}", backend);
        }
    }

    #[test]
    fn a_generator_plan_with_split_padding_gives_the_same_experts_output(
        c in case(),
        seed in any::<u64>(),
        (h, i) in (1usize..6, 1usize..6),
    ) {
        // Padding blocks between the used ones (on expert (E−1)/2) change nothing: every
        // backend's output is bit-identical to the one of permute's own plan.
        let (t, e) = (c.t, c.e);
        let n = nki_block_count(t * c.k, e, c.b, c.n_block_per_iter);
        let (positions, blocks) = nki_generator_plan(&c, n, true);
        let plan = run_case(&c);
        let mut rng = SeededRng::new(seed);
        let mut x = rng.values(t * h, 1.0);
        x.extend(vec![0.0; h]);
        let x = f32_tensor(&[t + 1, h], &x);
        let gate_up = f32_tensor(&[e, h, 2, i], &rng.values(e * h * 2 * i, 1.0));
        let down = f32_tensor(&[e, i, h], &rng.values(e * i * h, 1.0));
        let generator_positions = i32_tensor(&[n * c.b], &positions);
        let generator_blocks = i32_tensor(&[n], &blocks);
        let plans = [
            (&generator_positions, &generator_blocks),
            (&plan.token_position_to_id, &plan.block_to_expert),
        ];
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let backend = backend.create();
            let outputs: Vec<Tensor> = plans
                .iter()
                .map(|&(positions, blocks)| {
                    let inputs = BlockwiseMmInputs {
                        hidden_states: &x,
                        expert_affinities_masked: &plan.expert_affinities_masked,
                        gate_up_proj_weight: &gate_up,
                        down_proj_weight: &down,
                        token_position_to_id: positions,
                        block_to_expert: blocks,
                        gate_and_up_proj_bias: None,
                        down_proj_bias: None,
                        up_proj_weight: None,
                    };
                    let call = BlockwiseMm::new(inputs, BlockwiseMmParams::default()).unwrap();
                    backend.blockwise_mm(&call).unwrap().output
                })
                .collect();
            prop_assert_eq!(&outputs[0], &outputs[1], "{}", backend.name());
        }
    }
}

proptest! {
    #![proptest_config(config(4096))]

    #[test]
    fn static_block_count_is_nki_librarys_get_n_blocks(
        assignments in 1usize..5000,
        e in 1usize..600,
        b in 1usize..1100,
        n_block_per_iter in 1usize..5,
    ) {
        prop_assert_eq!(
            static_block_count(assignments, e, b, n_block_per_iter),
            Some(nki_block_count(assignments, e, b, n_block_per_iter))
        );
    }
}

#[test]
fn static_block_count_at_the_edges() {
    // ceil((T·K − (E−1)) / B) + (E−1), no cap at T·K, including T·K < E−1.
    assert_eq!(static_block_count(16, 4, 4, 1), Some(3 + 4)); // ceil(13/4) + 3
    assert_eq!(static_block_count(2, 8, 4, 1), Some(6)); // ceil(−5/4) + 7
    assert_eq!(static_block_count(2, 8, 4, 4), Some(8));
    assert_eq!(static_block_count(1, 1, 1, 1), Some(1));
    assert_eq!(static_block_count(1, 1, 128, 1), Some(1));
    assert_eq!(static_block_count(2048 * 8, 128, 512, 1), Some(32 + 127));
    assert_eq!(static_block_count(2048 * 8, 128, 512, 2), Some(160));
    // Extreme arguments give a count or None, never an overflow.
    assert_eq!(static_block_count(usize::MAX, 1, usize::MAX, 1), Some(1));
    assert_eq!(static_block_count(usize::MAX, 2, 1, 1), Some(usize::MAX));
    assert_eq!(static_block_count(usize::MAX, 2, 1, 2), None);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let index = i32_tensor(&[2, 2], &[0, 1, 2, 3]);
    let aff = f32_tensor(&[2, 2], &[0.5; 4]);
    let check = |index: &Tensor, aff: &Tensor, e: usize, b: usize, needles: &[&str]| {
        let message = run(index, aff, e, b).unwrap_err().to_string();
        for needle in needles {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`");
        }
    };
    check(&index, &aff, 0, 4, &["num_experts", "at least 1"]);
    check(&index, &aff, 4, 0, &["block_size", "at least 1"]);
    let params = PermuteParams {
        n_block_per_iter: 0,
        ..PermuteParams::new(4, 4)
    };
    let message = run_with(&index, &aff, params).unwrap_err().to_string();
    assert!(
        message.contains("n_block_per_iter") && message.contains("at least 1"),
        "{message}"
    );
    check(
        &index,
        &aff,
        3,
        4,
        &["expert_index", "expert id 3", "[1, 1]", "[0, 3)"],
    );
    check(
        &i32_tensor(&[2, 2], &[0, 1, 2, 2]),
        &aff,
        4,
        4,
        &["twice", "row [1]"],
    );
    check(
        &i32_tensor(&[1, 3], &[0, 1, 2]),
        &f32_tensor(&[1, 3], &[0.1; 3]),
        2,
        4,
        &["expert id 2", "outside [0, 2) (or -1 to skip the slot)"],
    );
    check(
        &i32_tensor(&[2, 2], &[0, -2, 2, 3]),
        &aff,
        4,
        4,
        &["expert id -2"],
    );
    check(
        &i32_tensor(&[2, 2], &[0, -1, 2, 3]),
        &aff,
        4,
        4,
        &["topk_affinities", "slot [0, 1] is skipped", "must hold 0"],
    );
    // K may exceed E when the extra slots are skipped (an expert-parallel receiver).
    let skipped = run(
        &i32_tensor(&[1, 3], &[1, -1, 0]),
        &f32_tensor(&[1, 3], &[0.25, 0.0, 0.5]),
        2,
        4,
    )
    .unwrap();
    assert_eq!(skipped.expert_counts.as_i32().unwrap(), [1, 1]);
    check(
        &index,
        &f32_tensor(&[2, 3], &[0.5; 6]),
        4,
        4,
        &["topk_affinities", "[T, K]"],
    );
    check(
        &index,
        &f32_tensor(&[2, 2], &[0.5, f64::NAN, 0.5, 0.5]),
        4,
        4,
        &["topk_affinities", "non-finite"],
    );
    check(
        &f32_tensor(&[2, 2], &[0.0; 4]),
        &aff,
        4,
        4,
        &["expert_index", "i32", "f32"],
    );
    check(
        &i32_tensor(&[0, 2], &[]),
        &f32_tensor(&[0, 2], &[]),
        4,
        4,
        &["T (tokens)"],
    );
    check(&index, &aff, 1 << 40, 4, &["num_experts", "fit in i32"]);
    check(&index, &aff, 4, 1 << 40, &["block_size", "fit in i32"]);
    check(&index, &aff, 4, usize::MAX, &["block_size", "fit in i32"]);
    let bwd = |grad: &Tensor, e: usize| {
        PermuteBwd::new(
            PermuteBwdInputs {
                expert_index: &index,
                expert_affinities_masked_grad: grad,
            },
            PermuteBwdParams::new(e),
        )
        .map(|_| ())
    };
    // T = 2, E = 4 needs 12 entries: a gradient laid out for another E is refused.
    bwd(&f32_tensor(&[12], &[0.0; 12]), 4).unwrap();
    let err = bwd(&f32_tensor(&[9], &[0.0; 9]), 4).unwrap_err();
    assert!(
        err.to_string().contains("expert_affinities_masked_grad")
            && err.to_string().contains("[12]"),
        "{err}"
    );
    let err = bwd(&f32_tensor(&[12], &[0.0; 12]), 3).unwrap_err();
    assert!(err.to_string().contains("expert id 3"), "{err}");
    let err = bwd(&f32_tensor(&[12], &[0.0; 12]), 0).unwrap_err();
    assert!(err.to_string().contains("num_experts"), "{err}");
}
