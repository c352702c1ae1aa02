//! The `cpu` backend against the `reference` oracle: every kernel, forward and backward, f32 and
//! bf16 inputs, on random MoE layers including the contracts' edge cases; bit-identical results
//! across thread counts; and the same input-validation errors as the reference. The suite runs
//! at the instruction-set level the CPU prefers, and again at each other level it has
//! (`MOEKIT_CPU_ISA`), so every selectable path of the kernels is checked.
//!
//! Tolerance: the cpu backend accumulates in f32, the reference in f64, so values agree within
//! `1e-4 · (|reference| + max |reference of that tensor|)`; indices and counts agree exactly.

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::contracts::tensors::blockwise_mm_bwd::CHECKPOINTS;
use moekit::contracts::{ActFnType, ExpertAffinityScaleMode, RouterActFnType, WeightLayout};
use moekit::cpu::CpuBackend;
use moekit::cpu::blocking::{BLOCKING_VARIABLE, Blocking};
use moekit::cpu::isa::{ISA_VARIABLE, Isa};
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Tensor};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Layer {
    params: Params,
    /// Every input of every kernel, by contract name.
    tensors: BTreeMap<String, Tensor>,
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    t: usize,
    h: usize,
    e: usize,
    i: usize,
    k: usize,
    b: usize,
    act_fn: RouterActFnType,
    /// ACT1 (true) or ACT2.
    router_pre_norm: bool,
    norm_topk_prob: bool,
    biases: bool,
    bf16: bool,
    /// The experts' gate activation.
    activation: ActFnType,
    scaling: ExpertAffinityScaleMode,
    /// The experts' biases and clamps (a lower limit above 0, so padding slots have outputs).
    expert_extras: bool,
}

fn shape(max_t: usize) -> impl Strategy<Value = Shape> {
    (
        (1..max_t, 1usize..24, 1usize..9, 1usize..16, 1usize..12),
        prop_oneof![
            Just(RouterActFnType::Softmax),
            Just(RouterActFnType::Sigmoid)
        ],
        any::<(bool, bool, bool, bool)>(),
        (
            0..ActFnType::ALL.len(),
            0..ExpertAffinityScaleMode::ALL.len(),
            any::<bool>(),
        ),
    )
        .prop_flat_map(|(dims, act_fn, flags, experts)| {
            (Just((dims, act_fn, flags, experts)), 1..=dims.2)
        })
        .prop_map(
            |(((t, h, e, i, b), act_fn, flags, (activation, scaling, expert_extras)), k)| {
                let (router_pre_norm, norm_topk_prob, biases, bf16) = flags;
                Shape {
                    t,
                    h,
                    e,
                    i,
                    k,
                    b,
                    act_fn,
                    router_pre_norm,
                    norm_topk_prob,
                    biases,
                    bf16,
                    activation: ActFnType::ALL[activation],
                    expert_extras,
                    scaling: ExpertAffinityScaleMode::ALL[scaling],
                }
            },
        )
}

/// A full layer's tensors: router inputs, the reference's router, plan and checkpoints (so each
/// kernel is compared on identical inputs), weights and gradients.
fn layer(s: Shape, seed: u64) -> Layer {
    let Shape {
        t, h, e, i, k, b, ..
    } = s;
    let mut rng = SeededRng::new(seed);
    let mut params = Params::default();
    params.set("k", &k.to_string()).unwrap();
    params.set("act_fn", &s.act_fn.to_string()).unwrap();
    params
        .set("router_pre_norm", &s.router_pre_norm.to_string())
        .unwrap();
    params
        .set("norm_topk_prob", &s.norm_topk_prob.to_string())
        .unwrap();
    params.set("num_experts", &e.to_string()).unwrap();
    // The largest divisor of E up to 4: the expert-parallel ranks of `a2av_routing`.
    let ranks = (1..=4).rev().find(|r| e % r == 0).unwrap_or(1);
    params
        .set("expert_parallel_degree", &ranks.to_string())
        .unwrap();
    params.set("block_size", &b.to_string()).unwrap();
    params.set("checkpoint_activation", "true").unwrap();
    for name in ["activation_function", "activation_type"] {
        params.set(name, s.activation.name()).unwrap();
    }
    params
        .set("expert_affinities_scaling_mode", s.scaling.name())
        .unwrap();
    if s.expert_extras {
        for (name, limit) in [
            ("gate_clamp_lower_limit", "-0.6"),
            ("gate_clamp_upper_limit", "1.5"),
            ("up_clamp_lower_limit", "0.125"),
            ("bias", "true"),
        ] {
            params.set(name, limit).unwrap();
        }
    }
    let float = |shape: &[usize], v: &[f64]| {
        let t = f32_tensor(shape, v);
        if s.bf16 { t.to_bf16() } else { t }
    };
    let mut tensors = BTreeMap::new();
    let mut put = |name: &str, tensor: Tensor| {
        tensors.insert(name.to_owned(), tensor);
    };
    let x = rng.values(t * h, 1.0);
    put("x", float(&[t, h], &x));
    put("w", float(&[h, e], &rng.values(h * e, 1.0)));
    if s.biases {
        put("w_bias", float(&[e], &rng.values(e, 0.5)));
        put("selection_bias", float(&[e], &rng.values(e, 0.2)));
    }
    let mut padded = x.clone();
    padded.extend(vec![0.0; h]);
    put("hidden_states", float(&[t + 1, h], &padded));
    put(
        "gate_up_proj_weight",
        float(&[e, h, 2, i], &rng.values(e * h * 2 * i, 0.5)),
    );
    put(
        "down_proj_weight",
        float(&[e, i, h], &rng.values(e * i * h, 0.5)),
    );
    put("d_topk_affinities", float(&[t, k], &rng.values(t * k, 1.0)));
    put("d_router_logits", float(&[t, e], &rng.values(t * e, 1.0)));
    put("d_aux_loss", float(&[1], &[0.75]));
    if s.expert_extras {
        put(
            "gate_and_up_proj_bias",
            float(&[e, 2, i], &rng.values(e * 2 * i, 0.5)),
        );
        put("down_proj_bias", float(&[e, h], &rng.values(e * h, 0.5)));
    }
    let mut output_grad = rng.values(t * h, 1.0);
    output_grad.extend(vec![0.0; h]);
    put(
        "output_hidden_states_grad",
        float(&[t + 1, h], &output_grad),
    );
    put(
        "expert_affinities_masked_grad",
        float(&[(t + 1) * e], &rng.values((t + 1) * e, 1.0)),
    );
    // moe_tkg decodes the same tokens through the same experts, every expert held here (rank
    // 0), selective or all-expert, with or without the mask, as the seed's low bits say.
    params
        .set("is_all_expert", &seed.is_multiple_of(2).to_string())
        .unwrap();
    params
        .set("mask_unselected_experts", &(seed % 4 >= 2).to_string())
        .unwrap();
    params.set("activation_fn", s.activation.name()).unwrap();
    for (decode, prefill) in [
        ("hidden_input", "x"),
        ("expert_gate_up_weights", "gate_up_proj_weight"),
        ("expert_down_weights", "down_proj_weight"),
    ] {
        let tensor = tensors[prefill].clone();
        tensors.insert(decode.to_owned(), tensor);
    }
    if s.expert_extras {
        for (decode, prefill) in [
            ("expert_gate_up_bias", "gate_and_up_proj_bias"),
            ("expert_down_bias", "down_proj_bias"),
        ] {
            let tensor = tensors[prefill].clone();
            tensors.insert(decode.to_owned(), tensor);
        }
    }
    tensors.insert("rank_id".to_owned(), i32_tensor(&[1, 1], &[0]));
    let mut layer = Layer { params, tensors };
    // Forward outputs the later kernels consume, from the oracle.
    for kernel in [Kernel::RouterTopk, Kernel::Permute, Kernel::BlockwiseMm] {
        let reference = BackendKind::Reference.create();
        for (name, tensor) in kernel
            .run(reference.as_ref(), &layer.tensors, &layer.params)
            .unwrap()
        {
            layer.tensors.insert(name.to_owned(), tensor);
        }
    }
    for (forward, backward) in CHECKPOINTS {
        let checkpoint = layer.tensors[forward.name].clone();
        layer.tensors.insert(backward.name.to_owned(), checkpoint);
    }
    // The kernels above chained their outputs in nki-library's dtypes (bf16 in, bf16 on);
    // the comparisons read every output in f32, at the precision both backends compute in.
    layer.params.set("output_dtype", "float32").unwrap();
    layer
}

/// The input whose dtype each floating-point output takes under `output_dtype=input`, as
/// nki-library's kernels write them (moekit's own kernels follow the same rule); `None`: an
/// output that is always f32 (the aux loss).
fn dtype_source(kernel: Kernel, output: &str) -> Option<&'static str> {
    Some(match (kernel, output) {
        (Kernel::RouterTopk, _) => "x",
        (Kernel::RouterTopkBwd, "d_x") => "x",
        (Kernel::RouterTopkBwd, _) => "w",
        (Kernel::LoadBalancingLoss, _) => return None,
        (Kernel::LoadBalancingLossBwd, _) => "router_logits",
        (Kernel::Permute, _) => "topk_affinities",
        (Kernel::PermuteBwd, _) => "expert_affinities_masked_grad",
        (Kernel::BlockwiseMm, "output") => "hidden_states",
        (Kernel::BlockwiseMm, "gate_up_activations_T") => "gate_up_proj_weight",
        (Kernel::BlockwiseMm, _) => "down_proj_weight",
        (Kernel::BlockwiseMmBwd, "hidden_states_grad") => "hidden_states",
        (Kernel::BlockwiseMmBwd, "expert_affinities_masked_grad" | "d_topk_affinities") => {
            "expert_affinities_masked"
        }
        (Kernel::BlockwiseMmBwd, "gate_up_proj_weight_grad" | "gate_and_up_proj_bias_grad") => {
            "gate_up_proj_weight"
        }
        (Kernel::BlockwiseMmBwd, _) => "down_proj_weight",
        (Kernel::A2avRouting, _) => return None,
        (Kernel::MoeTkg, _) => "hidden_input",
        (Kernel::RmsNormRouterTopkTkg, "norm_output") => "router_weights",
        // Affinities are bf16 whatever the inputs; not in this suite (see `kernels`).
        (Kernel::RmsNormRouterTopkTkg, _) => return None,
        (Kernel::RmsNormRouterTopkTkgBwd, "d_hidden_states") => "hidden_states",
        (Kernel::RmsNormRouterTopkTkgBwd, "d_gamma") => "gamma",
        (Kernel::RmsNormRouterTopkTkgBwd, _) => "router_weights",
        (Kernel::MoeBlockTkg | Kernel::Topk, _) => "inp",
        (Kernel::TopkReduce, _) => "input",
        // Indices, or the input's elements moved (not in this suite, see `kernels`).
        (Kernel::FindNonzeroIndices | Kernel::IndexedFlatten, _) => return None,
    })
}

/// On `backend`, every kernel's outputs under `output_dtype=input` are its `float32` outputs
/// rounded into the dtype of the input each belongs to ([`dtype_source`]); indices stay i32.
fn outputs_take_their_inputs_dtypes(
    backend: BackendKind,
    layer: &Layer,
) -> Result<(), TestCaseError> {
    let mut nki = layer.clone();
    nki.params.set("output_dtype", "input").unwrap();
    for kernel in kernels(layer) {
        let f32_outputs = run(kernel, backend, layer);
        let nki_outputs = run(kernel, backend, &nki);
        prop_assert_eq!(f32_outputs.len(), nki_outputs.len());
        for ((name, f32_output), (_, nki_output)) in f32_outputs.into_iter().zip(nki_outputs) {
            if f32_output.dtype() == DType::I32 {
                prop_assert_eq!(&nki_output, &f32_output, "{}", name);
                continue;
            }
            prop_assert_eq!(
                f32_output.dtype(),
                DType::F32,
                "{} with output_dtype=float32",
                name
            );
            let dtype =
                dtype_source(kernel, name).map_or(DType::F32, |input| layer.tensors[input].dtype());
            prop_assert_eq!(
                f32_output.into_float_dtype(name, dtype).unwrap(),
                nki_output,
                "{}.{} on {}",
                kernel.name(),
                name,
                backend
            );
        }
    }
    Ok(())
}

/// Smallest gap between consecutive selection scores among each row's top K+1.
fn selection_margin(layer: &Layer, s: Shape) -> f64 {
    let logits = layer.tensors["router_logits"].to_f64_vec();
    let sel = layer.tensors.get("selection_bias").map(Tensor::to_f64_vec);
    logits
        .chunks(s.e)
        .map(|row| {
            // ACT1 chooses by affinity, ACT2 by logit.
            let probs: Vec<f64> = match s.act_fn {
                _ if !s.router_pre_norm => row.to_vec(),
                RouterActFnType::Softmax => {
                    let max = row.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = row.iter().map(|l| (l - max).exp()).sum();
                    row.iter().map(|l| (l - max).exp() / z).collect()
                }
                RouterActFnType::Sigmoid => row.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
            };
            let mut scores: Vec<f64> = probs
                .iter()
                .enumerate()
                .map(|(ex, p)| p + sel.as_ref().map_or(0.0, |b| b[ex]))
                .collect();
            scores.sort_by(|a, b| b.total_cmp(a));
            scores[..(s.k + 1).min(s.e)]
                .windows(2)
                .map(|w| w[0] - w[1])
                .fold(f64::INFINITY, f64::min)
        })
        .fold(f64::INFINITY, f64::min)
}

fn run(kernel: Kernel, backend: BackendKind, layer: &Layer) -> Vec<(&'static str, Tensor)> {
    kernel
        .run(backend.create().as_ref(), &layer.tensors, &layer.params)
        .unwrap_or_else(|e| panic!("{} on {backend}: {e}", kernel.name()))
}

/// The kernels `layer` runs: every one, except `moe_tkg` under a pre-scale mode, which it
/// refuses (its own tests check the refusal).
fn kernels(layer: &Layer) -> impl Iterator<Item = Kernel> + '_ {
    let pre_scale = layer.params.scaling_mode.is_some_and(|s| s.scales_rows());
    // The fused decode RMSNorm + router reads `hidden_states [T, H]`, not blockwise_mm's
    // `[T+1, H]` of the same name, and the decode block reads `router_weights` in
    // `router_mm_dtype`: they have suites of their own (proptests/rmsnorm_router_topk_tkg.rs,
    // proptests/moe_block_tkg.rs), as have the top-k over a vocabulary (proptests/topk.rs),
    // the combine after an exchange (proptests/topk_reduce.rs) and the device-side plan
    // (proptests/device_plan.rs), whose inputs the layer does not hold.
    Kernel::ALL
        .iter()
        .copied()
        .filter(move |&kernel| match kernel {
            Kernel::MoeTkg => !pre_scale,
            Kernel::RmsNormRouterTopkTkg
            | Kernel::RmsNormRouterTopkTkgBwd
            | Kernel::MoeBlockTkg
            | Kernel::Topk
            | Kernel::TopkReduce
            | Kernel::FindNonzeroIndices
            | Kernel::IndexedFlatten => false,
            _ => true,
        })
}

/// The absolute tolerance of `kernel`'s outputs on `layer`, relative to their scale: the cpu
/// backend's f32 one, but for the kernels computing in bf16 (`compute_dtype`, bf16 tokens'
/// default: the blockwise kernels and `router_topk_bwd`), whose operands may round differently
/// on the two backends ([`CpuBackend::BF16_TOLERANCE`]). `bf16_compute_is_exact_where_its_
/// operands_are` (here) and `bf16_compute_rounds_the_products_operands` (router_topk) check
/// them to the f32 tolerance on values that round alike.
fn atol(kernel: Kernel, layer: &Layer) -> f64 {
    let bf16 = |tokens: &str| layer.tensors[tokens].dtype() == DType::BF16;
    match kernel {
        Kernel::BlockwiseMm | Kernel::BlockwiseMmBwd if bf16("hidden_states") => {
            CpuBackend::BF16_TOLERANCE.atol
        }
        Kernel::RouterTopkBwd if bf16("x") => CpuBackend::BF16_TOLERANCE.atol,
        _ => CpuBackend::TOLERANCE.atol,
    }
}

fn compare(kernel: Kernel, layer: &Layer) -> Result<(), TestCaseError> {
    let cpu = run(kernel, BackendKind::Cpu, layer);
    let reference = run(kernel, BackendKind::Reference, layer);
    let atol = atol(kernel, layer);
    prop_assert_eq!(cpu.len(), reference.len());
    for ((name, got), (ref_name, want)) in cpu.iter().zip(&reference) {
        prop_assert_eq!(name, ref_name);
        prop_assert_eq!(got.shape(), want.shape(), "{}", name);
        prop_assert_eq!(got.dtype(), want.dtype(), "{}", name);
        if want.dtype() == DType::I32 {
            prop_assert_eq!(got, want, "{}.{}", kernel.name(), name);
        } else {
            let want = want.to_f64_vec();
            let what = format!("{}.{}", kernel.name(), name);
            assert_close(&what, &got.to_f64_vec(), &want, 1e-4, atol * scale(&want))?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn every_kernel_matches_the_reference(s in shape(40), seed in any::<u64>()) {
        let layer = layer(s, seed);
        prop_assume!(selection_margin(&layer, s) > 1e-4);
        for kernel in kernels(&layer) {
            compare(kernel, &layer)?;
        }
    }

    #[test]
    fn skipped_slots_match_the_reference(s in shape(40), seed in any::<u64>()) {
        // An expert-parallel receiver's routing: some slots name experts of other ranks.
        let mut layer = layer(s, seed);
        let (t, k) = (s.t, s.k);
        let mut index = layer.tensors["expert_index"].as_i32().unwrap().to_vec();
        let mut affinities = layer.tensors["topk_affinities"].to_f64_vec();
        skip_slots(&mut SeededRng::new(!seed), &mut index, &mut affinities);
        let affinities = f32_tensor(&[t, k], &affinities);
        let affinities = if s.bf16 { affinities.to_bf16() } else { affinities };
        layer.tensors.insert("expert_index".to_owned(), i32_tensor(&[t, k], &index));
        layer.tensors.insert("topk_affinities".to_owned(), affinities);
        for kernel in [Kernel::Permute, Kernel::BlockwiseMm] {
            for (name, tensor) in run(kernel, BackendKind::Reference, &layer) {
                layer.tensors.insert(name.to_owned(), tensor);
            }
        }
        for kernel in [Kernel::Permute, Kernel::PermuteBwd, Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
            compare(kernel, &layer)?;
        }
        // A skipped slot receives no affinity gradient.
        for kernel in [Kernel::PermuteBwd, Kernel::BlockwiseMmBwd] {
            let outputs = run(kernel, BackendKind::Cpu, &layer);
            let d = outputs.iter().find(|(n, _)| *n == "d_topk_affinities").unwrap().1.to_f64_vec();
            for (pair, &id) in index.iter().enumerate() {
                prop_assert!(id != moekit::contracts::SKIP || d[pair] == 0.0, "{}", kernel.name());
            }
        }
    }

    #[test]
    fn storing_blocks_matches_the_reference_at_top_1(
        s in shape(40).prop_map(|s| Shape { k: 1, ..s }),
        seed in any::<u64>(),
    ) {
        // is_tensor_update_accumulating = false: every token's row as when adding (one slot
        // each), the padding row as the last padding slot stores it.
        let accumulated = layer(s, seed);
        prop_assume!(selection_margin(&accumulated, s) > 1e-4);
        let mut stored = Layer { params: accumulated.params.clone(), tensors: accumulated.tensors.clone() };
        stored.params.set("is_tensor_update_accumulating", "false").unwrap();
        compare(Kernel::BlockwiseMm, &stored)?;
        compare(Kernel::BlockwiseMmBwd, &stored)?;
        // Row T holds one padding slot's output, not their sum: the last one's, read off the
        // checkpoint; 0 under POST_SCALE or without padding.
        let kept = run(Kernel::BlockwiseMm, BackendKind::Cpu, &stored);
        let (t, h, b) = (s.t, s.h, s.b);
        let ids = stored.tensors["token_position_to_id"].as_i32().unwrap();
        let down = kept.iter().find(|(n, _)| *n == "down_activations").unwrap().1.to_f64_vec();
        let last_padding = (0..ids.len()).rev().find(|&slot| ids[slot] as usize == t);
        let expected = match (s.scaling.scales_outputs(), last_padding) {
            (false, Some(slot)) => down[slot * h..(slot + 1) * h].to_vec(),
            _ => vec![0.0; h],
        };
        let output = kept[0].1.to_f64_vec();
        prop_assert_eq!(&output[t * h..], &expected[..], "B = {}", b);
    }

    #[test]
    fn skip_token_drops_only_the_padding_row(s in shape(40), seed in any::<u64>()) {
        skip_token_matches_the_padded_layout(&layer(s, seed))?;
    }

    #[test]
    fn rearranged_plans_match_the_reference(s in shape(40), seed in any::<u64>()) {
        let mut layer = layer(s, seed);
        rearrange_plan(&mut SeededRng::new(!seed), &mut layer, s);
        for (name, tensor) in run(Kernel::BlockwiseMm, BackendKind::Reference, &layer) {
            layer.tensors.insert(name.to_owned(), tensor);
        }
        for kernel in [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
            compare(kernel, &layer)?;
        }
    }

    #[test]
    fn linear_weights_match_the_reference(s in shape(40), seed in any::<u64>()) {
        let layer = with_linear_weights(layer(s, seed), s);
        for kernel in [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
            compare(kernel, &layer)?;
        }
        bit_identical_across_thread_counts(&layer).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn split_gate_up_weights_match_the_reference(s in shape(40), seed in any::<u64>()) {
        let layer = with_split_weights(layer(s, seed), s);
        for kernel in [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
            compare(kernel, &layer)?;
        }
        bit_identical_across_thread_counts(&layer).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn outputs_take_nki_library_dtypes(s in shape(40), seed in any::<u64>()) {
        let layer = layer(s, seed);
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            outputs_take_their_inputs_dtypes(backend, &layer)?;
        }
    }

    #[test]
    fn results_are_bit_identical_across_thread_counts(s in shape(300), seed in any::<u64>()) {
        bit_identical_across_thread_counts(&layer(s, seed)).map_err(TestCaseError::fail)?;
    }
}

/// `layer` with its experts' weights in moekit's `weight_layout=linear`: `[E, 2, I, H]` and
/// `[E, H, I]`.
fn with_linear_weights(mut layer: Layer, s: Shape) -> Layer {
    let sizes = (s.e, s.h, s.i);
    let (nki, linear) = (WeightLayout::Nki, WeightLayout::Linear);
    let tensors = &mut layer.tensors;
    let gate_up = relayout_gate_up(&tensors["gate_up_proj_weight"], sizes, nki, linear);
    let down = relayout_down(&tensors["down_proj_weight"], sizes, nki, linear);
    tensors.insert("gate_up_proj_weight".to_owned(), gate_up);
    tensors.insert("down_proj_weight".to_owned(), down);
    layer
        .params
        .set(WeightLayout::PARAM, linear.name())
        .unwrap();
    layer
}

/// `layer` with its experts' gate and up weights in two tensors (moekit's `up_proj_weight`,
/// linear layout): `gate_up_proj_weight [E, I, H]` the gate's, `up_proj_weight [E, I, H]` the
/// up's.
fn with_split_weights(layer: Layer, s: Shape) -> Layer {
    let mut layer = with_linear_weights(layer, s);
    let (gate, up) = split_gate_up(&layer.tensors["gate_up_proj_weight"]);
    layer.tensors.insert("gate_up_proj_weight".to_owned(), gate);
    layer.tensors.insert("up_proj_weight".to_owned(), up);
    layer
}

/// `layer(s, seed)` in every weight layout the blockwise kernels take, named.
fn in_every_weight_layout(s: Shape, seed: u64) -> [(&'static str, Layer); 3] {
    [
        ("nki", layer(s, seed)),
        ("linear", with_linear_weights(layer(s, seed), s)),
        (
            "linear, up_proj_weight apart",
            with_split_weights(layer(s, seed), s),
        ),
    ]
}

/// nki-library's `SkipMode(skip_token=True)` layout of `layer`'s blockwise inputs:
/// `hidden_states [T, H]`, `expert_affinities_masked [T·E, 1]`, `output_hidden_states_grad
/// [T, H]`, padding slots −1. Both blockwise kernels, on both backends, must give exactly the
/// padded layout's results without its row T.
fn skip_token_matches_the_padded_layout(layer: &Layer) -> Result<(), TestCaseError> {
    let t = layer.tensors["expert_index"].shape()[0];
    let e = layer.tensors["gate_up_proj_weight"].shape()[0];
    let mut skipping = Layer {
        params: layer.params.clone(),
        tensors: layer.tensors.clone(),
    };
    skipping.params.set("skip_token", "true").unwrap();
    // The first `keep` entries of `tensor`'s first axis.
    let leading = |tensor: &Tensor, keep: usize| -> Tensor {
        let values = tensor.to_f64_vec();
        let mut shape = tensor.shape().to_vec();
        let width = values.len() / shape[0];
        shape[0] = keep;
        let kept = f32_tensor(&shape, &values[..keep * width]);
        if tensor.dtype() == DType::BF16 {
            kept.to_bf16()
        } else {
            kept
        }
    };
    for (name, keep) in [
        ("hidden_states", t),
        ("output_hidden_states_grad", t),
        ("expert_affinities_masked", t * e),
    ] {
        let tensor = &layer.tensors[name];
        skipping
            .tensors
            .insert(name.to_owned(), leading(tensor, keep));
    }
    let ids: Vec<i32> = layer.tensors["token_position_to_id"]
        .as_i32()
        .unwrap()
        .iter()
        .map(|&id| if id as usize == t { -1 } else { id })
        .collect();
    skipping.tensors.insert(
        "token_position_to_id".to_owned(),
        i32_tensor(&[ids.len()], &ids),
    );
    for kernel in [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
        for backend in [BackendKind::Cpu, BackendKind::Reference] {
            let padded = run(kernel, backend, layer);
            let skipped = run(kernel, backend, &skipping);
            for ((name, want), (skipped_name, got)) in padded.iter().zip(&skipped) {
                prop_assert_eq!(name, skipped_name);
                let keep = match *name {
                    "output" | "hidden_states_grad" => t,
                    "expert_affinities_masked_grad" => t * e,
                    _ => want.shape()[0],
                };
                prop_assert_eq!(
                    got.shape()[0],
                    keep,
                    "{}.{} on {}",
                    kernel.name(),
                    name,
                    backend
                );
                prop_assert_eq!(&got.shape()[1..], &want.shape()[1..]);
                let width = want.to_f64_vec().len() / want.shape()[0];
                prop_assert_eq!(
                    got.to_f64_vec(),
                    want.to_f64_vec()[..keep * width].to_vec(),
                    "{}.{} on {}",
                    kernel.name(),
                    name,
                    backend
                );
            }
        }
    }
    Ok(())
}

/// Rewrites `permute`'s plan into another valid plan of the same (token, expert) pairs, as a
/// caller may build one: the blocks in random order (an expert's blocks apart, unused blocks
/// between them), each block's slots in random order (padding between real slots), and blocks
/// of padding only given to random experts.
fn rearrange_plan(rng: &mut SeededRng, layer: &mut Layer, s: Shape) {
    let positions = layer.tensors["token_position_to_id"].as_i32().unwrap();
    let blocks = layer.tensors["block_to_expert"].as_i32().unwrap();
    let (mut new_positions, mut new_blocks) = (Vec::new(), Vec::new());
    for block in rng.permutation(blocks.len()) {
        let slots = &positions[block * s.b..(block + 1) * s.b];
        new_positions.extend(rng.permutation(s.b).into_iter().map(|j| slots[j]));
        let padding_only = slots.iter().all(|&token| token as usize == s.t);
        new_blocks.push(if padding_only {
            rng.below(s.e) as i32
        } else {
            blocks[block]
        });
    }
    let n = new_blocks.len();
    layer.tensors.insert(
        "token_position_to_id".to_owned(),
        i32_tensor(&[n * s.b], &new_positions),
    );
    layer.tensors.insert(
        "block_to_expert".to_owned(),
        i32_tensor(&[n, 1], &new_blocks),
    );
}

/// Every kernel's outputs with 1, 2 and 3 threads, compared as bytes: bit-identical, so 0.0 vs
/// −0.0 or differing NaNs would count.
fn bit_identical_across_thread_counts(layer: &Layer) -> Result<(), String> {
    let cpu = BackendKind::Cpu.create();
    for kernel in kernels(layer) {
        let runs: Vec<Vec<(String, Vec<u8>)>> = [1, 2, 3]
            .into_iter()
            .map(|threads| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| kernel.run(cpu.as_ref(), &layer.tensors, &layer.params))
                    .unwrap()
                    .into_iter()
                    .map(|(n, t)| (n.to_string(), t.to_le_bytes()))
                    .collect()
            })
            .collect();
        for (threads, run) in [(2, &runs[1]), (3, &runs[2])] {
            if *run != runs[0] {
                return Err(format!("{}: 1 vs {threads} threads", kernel.name()));
            }
        }
    }
    Ok(())
}

/// Layers whose experts hold more rows than one task computes (the cpu backend splits them
/// into pieces of 256 rows and their weight gradients into bands), as a skewed routing gives.
fn crowded_experts() -> Vec<(&'static str, Shape)> {
    let base = Shape {
        t: 600,
        h: 9,
        e: 1,
        i: 5,
        k: 1,
        b: 16,
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        activation: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        expert_extras: false,
        biases: false,
        bf16: false,
    };
    vec![
        ("one expert, 600 rows", base),
        (
            "every token on both of 2 experts",
            Shape { e: 2, k: 2, ..base },
        ),
        (
            "513 rows on each of 3 experts, wide",
            Shape {
                t: 513,
                h: 33,
                e: 3,
                i: 17,
                k: 3,
                ..base
            },
        ),
    ]
}

#[test]
fn crowded_experts_match_the_reference_and_ignore_thread_counts() {
    for (name, s) in crowded_experts() {
        for (bf16, (layout, layer)) in [false, true].into_iter().flat_map(|bf16| {
            in_every_weight_layout(Shape { bf16, ..s }, 5).map(|layout| (bf16, layout))
        }) {
            let what = format!("{name} (bf16: {bf16}, weights: {layout})");
            // The router's tasks take tiles of up to 256 tokens: 600 tokens make a ragged last.
            for kernel in [
                Kernel::RouterTopk,
                Kernel::RouterTopkBwd,
                Kernel::BlockwiseMm,
                Kernel::BlockwiseMmBwd,
            ] {
                if let Err(e) = compare(kernel, &layer) {
                    panic!("{what}: {e}");
                }
            }
            if let Err(e) = bit_identical_across_thread_counts(&layer) {
                panic!("{what}: {e}");
            }
        }
    }
}

/// `layer` (ReLU, POST_SCALE, H ≤ 16, I ≤ 8, no biases or clamps) with integer tokens in
/// [−20, 20], integer weights in [−2, 2], integer output gradients in [−300, 300] and
/// affinities of 1/2 or 1, and its checkpoints recomputed. Every operand the blockwise kernels
/// form is then exact in f32 before it is rounded to bf16 (the activations below 2¹⁹, d y a
/// multiple of 1/2 below 300, the gate and up gradients multiples of 1/2 below 2²³), yet
/// most need more than bf16's 8 bits, so both backends round the same values the same way.
fn with_integer_values(mut layer: Layer, s: Shape, seed: u64) -> Layer {
    let Shape { t, h, e, i, .. } = s;
    assert!(h <= 16 && i <= 8, "the bounds above need H ≤ 16 and I ≤ 8");
    let mut rng = SeededRng::new(seed);
    let mut integers = |n: usize, bound: usize| -> Vec<f64> {
        (0..n)
            .map(|_| rng.below(2 * bound + 1) as f64 - bound as f64)
            .collect()
    };
    let float = |shape: &[usize], v: &[f64]| {
        let tensor = f32_tensor(shape, v);
        if s.bf16 { tensor.to_bf16() } else { tensor }
    };
    let mut hidden = integers(t * h, 20);
    hidden.extend(vec![0.0; h]);
    let mut output_grad = integers(t * h, 300);
    output_grad.extend(vec![0.0; h]);
    let gate_up = integers(e * h * 2 * i, 2);
    let down = integers(e * i * h, 2);
    let masked: Vec<f64> = layer.tensors["expert_affinities_masked"]
        .to_f64_vec()
        .iter()
        .enumerate()
        .map(|(at, &a)| match a {
            0.0 => 0.0,
            _ if at % 2 == 0 => 0.5,
            _ => 1.0,
        })
        .collect();
    for (name, tensor) in [
        ("hidden_states", float(&[t + 1, h], &hidden)),
        (
            "output_hidden_states_grad",
            float(&[t + 1, h], &output_grad),
        ),
        ("gate_up_proj_weight", float(&[e, h, 2, i], &gate_up)),
        ("down_proj_weight", float(&[e, i, h], &down)),
        (
            "expert_affinities_masked",
            float(&[(t + 1) * e, 1], &masked),
        ),
    ] {
        layer.tensors.insert(name.to_owned(), tensor);
    }
    // The checkpoints of these values, in nki-library's dtypes, as both backends read them.
    let mut forward = Layer {
        params: layer.params.clone(),
        tensors: layer.tensors.clone(),
    };
    forward.params.set("output_dtype", "input").unwrap();
    let reference = BackendKind::Reference.create();
    let outputs = Kernel::BlockwiseMm
        .run(reference.as_ref(), &forward.tensors, &forward.params)
        .unwrap();
    for (name, tensor) in outputs {
        layer.tensors.insert(name.to_owned(), tensor);
    }
    for (forward, backward) in CHECKPOINTS {
        let checkpoint = layer.tensors[forward.name].clone();
        layer.tensors.insert(backward.name.to_owned(), checkpoint);
    }
    layer
}

#[test]
fn bf16_compute_is_exact_where_its_operands_are() {
    let base = Shape {
        t: 40,
        h: 16,
        e: 4,
        i: 8,
        k: 2,
        b: 8,
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        activation: ActFnType::Relu,
        scaling: ExpertAffinityScaleMode::PostScale,
        expert_extras: false,
        biases: false,
        bf16: false,
    };
    let reference = BackendKind::Reference.create();
    for seed in 0..4 {
        // bf16 tokens compute in bf16 by default; f32 tokens when told to.
        for bf16 in [false, true] {
            let s = Shape { bf16, ..base };
            let layers = [
                ("nki", with_integer_values(layer(s, seed), s, seed)),
                (
                    "linear",
                    with_linear_weights(with_integer_values(layer(s, seed), s, seed), s),
                ),
                (
                    "linear, up_proj_weight apart",
                    with_split_weights(with_integer_values(layer(s, seed), s, seed), s),
                ),
            ];
            for (layout, mut layer) in layers {
                let what = format!("seed {seed}, bf16 storage: {bf16}, weights: {layout}");
                layer.params.set("compute_dtype", "bfloat16").unwrap();
                for kernel in [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd] {
                    // The cpu's own tolerance: the rounding is the same on both sides.
                    let cpu = run(kernel, BackendKind::Cpu, &layer);
                    let want = run(kernel, BackendKind::Reference, &layer);
                    for ((name, got), (_, want)) in cpu.iter().zip(&want) {
                        let want = want.to_f64_vec();
                        let close = assert_close(
                            &format!("{}.{name}", kernel.name()),
                            &got.to_f64_vec(),
                            &want,
                            1e-4,
                            1e-4 * scale(&want),
                        );
                        if let Err(e) = close {
                            panic!("{what}: {e}");
                        }
                    }
                    // The values do need rounding: in f32 the results differ.
                    let mut exact = Layer {
                        params: layer.params.clone(),
                        tensors: layer.tensors.clone(),
                    };
                    exact.params.set("compute_dtype", "float32").unwrap();
                    let f32_results = kernel
                        .run(reference.as_ref(), &exact.tensors, &exact.params)
                        .unwrap();
                    assert_ne!(
                        f32_results.into_iter().map(|(_, t)| t).collect::<Vec<_>>(),
                        want.into_iter().map(|(_, t)| t).collect::<Vec<_>>(),
                        "{what}: {} does not depend on compute_dtype",
                        kernel.name()
                    );
                }
                if let Err(e) = bit_identical_across_thread_counts(&layer) {
                    panic!("{what}: {e}");
                }
            }
        }
    }
}

#[test]
fn products_on_streamed_panels_ignore_thread_counts() {
    // H and I past the register tiles' reach and experts of more than 64 tokens, so the
    // products run on packed panels.
    let s = Shape {
        t: 200,
        h: 800,
        e: 3,
        i: 70,
        k: 2,
        b: 8,
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        activation: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        expert_extras: false,
        biases: false,
        bf16: false,
    };
    for bf16 in [false, true] {
        for (layout, layer) in in_every_weight_layout(Shape { bf16, ..s }, 7) {
            if let Err(e) = bit_identical_across_thread_counts(&layer) {
                panic!("bf16: {bf16}, weights: {layout}: {e}");
            }
        }
    }
}

#[test]
fn edge_cases_match_the_reference() {
    let base = Shape {
        t: 5,
        h: 7,
        e: 4,
        i: 3,
        k: 2,
        b: 2,
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        activation: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        expert_extras: false,
        biases: false,
        bf16: false,
    };
    let cases = [
        ("T = 1", Shape { t: 1, ..base }),
        ("E = 1", Shape { e: 1, k: 1, ..base }),
        ("K = E", Shape { k: 4, ..base }),
        ("B = 1", Shape { b: 1, ..base }),
        ("B > T·K", Shape { b: 64, ..base }),
        ("H = I = 1", Shape { h: 1, i: 1, ..base }),
        (
            "odd H and I beyond the SIMD width",
            Shape {
                h: 37,
                i: 19,
                ..base
            },
        ),
        ("many tokens", Shape { t: 257, ..base }),
        (
            "H and I past the register tiles' reach (streamed packed panels)",
            Shape {
                t: 200,
                h: 800,
                i: 70,
                e: 3,
                ..base
            },
        ),
        (
            "H past the register tiles' reach, few tokens per expert (tiles along a long k)",
            Shape {
                t: 40,
                h: 800,
                i: 70,
                e: 3,
                ..base
            },
        ),
    ];
    for (name, s) in cases {
        for bf16 in [false, true] {
            let layer = layer(Shape { bf16, ..s }, 3);
            for kernel in kernels(&layer) {
                if let Err(e) = compare(kernel, &layer) {
                    panic!("{name} (bf16: {bf16}): {e}");
                }
            }
        }
    }
}

#[test]
fn errors_are_the_reference_errors() {
    let mut layer = layer(
        Shape {
            t: 4,
            h: 3,
            e: 4,
            i: 2,
            k: 2,
            b: 2,
            act_fn: RouterActFnType::Softmax,
            router_pre_norm: true,
            norm_topk_prob: true,
            activation: ActFnType::Silu,
            scaling: ExpertAffinityScaleMode::PostScale,
            expert_extras: false,
            biases: true,
            bf16: false,
        },
        9,
    );
    let broken = |name: &str, tensor: Tensor| {
        let mut l = layer.clone();
        l.tensors.insert(name.to_owned(), tensor);
        l
    };
    let cases = [
        (
            Kernel::RouterTopk,
            broken("w", f32_tensor(&[2, 4], &[0.0; 8])),
        ),
        (
            Kernel::RouterTopk,
            broken("x", f32_tensor(&[4, 3], &[f64::NAN; 12])),
        ),
        (
            Kernel::Permute,
            broken(
                "expert_index",
                i32_tensor(&[4, 2], &[0, 0, 1, 2, 3, 1, 0, 2]),
            ),
        ),
        (
            Kernel::LoadBalancingLoss,
            broken(
                "expert_index",
                i32_tensor(&[4, 2], &[0, 9, 1, 2, 3, 1, 0, 2]),
            ),
        ),
        (
            Kernel::BlockwiseMm,
            broken("block_to_expert", i32_tensor(&[1], &[7])),
        ),
        (
            Kernel::BlockwiseMmBwd,
            broken("down_proj_act_checkpoint", f32_tensor(&[1, 1, 1], &[0.0])),
        ),
    ];
    for (kernel, l) in cases {
        let err = |backend: BackendKind| {
            kernel
                .run(backend.create().as_ref(), &l.tensors, &l.params)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err(BackendKind::Cpu),
            err(BackendKind::Reference),
            "{}",
            kernel.name()
        );
    }
    layer.params.set("k", "9").unwrap();
    let err = Kernel::RouterTopk
        .run(
            BackendKind::Cpu.create().as_ref(),
            &layer.tensors,
            &layer.params,
        )
        .unwrap_err();
    assert!(err.to_string().contains("`k`"), "{err}");
}

#[test]
fn overflowing_results_are_errors_naming_the_first_output_the_reference_checks() {
    let s = Shape {
        t: 6,
        h: 5,
        e: 3,
        i: 4,
        k: 2,
        b: 4,
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        activation: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        expert_extras: false,
        biases: false,
        bf16: false,
    };
    let mut layer = layer(s, 11);
    // Finite inputs whose SwiGLU products exceed f32.
    let huge: Vec<f64> = layer.tensors["hidden_states"]
        .to_f64_vec()
        .iter()
        .map(|x| x * 1e25)
        .collect();
    layer.tensors.insert(
        "hidden_states".to_owned(),
        f32_tensor(&[s.t + 1, s.h], &huge),
    );
    for backend in [BackendKind::Cpu, BackendKind::Reference] {
        let err = Kernel::BlockwiseMm
            .run(backend.create().as_ref(), &layer.tensors, &layer.params)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("output") && err.contains("does not fit in f32"),
            "{backend}: {err}"
        );
    }
}

#[test]
fn checkpoints_past_the_address_space_are_errors_naming_them() {
    // A valid plan of one padding block of B = 2²² slots at H = 2²³: the inputs take 200 MB,
    // `down_activations [N, B, H]` would take 2⁴⁷ bytes in f32, more than a process can map.
    let (h, slots) = (1 << 23, 1 << 22);
    let tensors: BTreeMap<String, Tensor> = [
        ("hidden_states", f32_tensor(&[2, h], &vec![0.0; 2 * h])),
        ("expert_affinities_masked", f32_tensor(&[2], &[0.0; 2])),
        (
            "gate_up_proj_weight",
            f32_tensor(&[1, h, 2, 1], &vec![0.0; 2 * h]),
        ),
        ("down_proj_weight", f32_tensor(&[1, 1, h], &vec![0.0; h])),
        ("block_to_expert", i32_tensor(&[1, 1], &[0])),
        (
            "token_position_to_id",
            i32_tensor(&[slots], &vec![1; slots]),
        ),
    ]
    .into_iter()
    .map(|(name, tensor)| (name.to_owned(), tensor))
    .collect();
    let mut params = Params::default();
    params.set("checkpoint_activation", "true").unwrap();
    for backend in [BackendKind::Cpu, BackendKind::Reference] {
        let err = Kernel::BlockwiseMm
            .run(backend.create().as_ref(), &tensors, &params)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot allocate output `down_activations`")
                && err.contains(&format!("[1, {slots}, {h}]")),
            "{backend}: {err}"
        );
    }
}

#[test]
fn the_backend_reports_its_name() {
    assert_eq!(BackendKind::Cpu.create().name(), "cpu");
    assert_eq!("cpu".parse::<BackendKind>().unwrap(), BackendKind::Cpu);
}

/// This whole suite again at every other instruction-set level this CPU has, each in a process
/// of its own with `MOEKIT_CPU_ISA` naming it: the kernels of CPUs without the wider
/// instructions, forced here (and the pair dot products where the calibration passed them
/// over), against the reference and across thread counts.
#[test]
fn every_other_instruction_set_level_passes_this_suite() {
    if let Some(requested) = std::env::var_os(ISA_VARIABLE) {
        // One of the runs started below: its kernels run at the level it was given.
        let requested = requested.to_string_lossy();
        assert_eq!(
            Some(Isa::active()),
            Isa::from_name(&requested),
            "{requested}"
        );
        return;
    }
    if std::env::var_os(BLOCKING_VARIABLE).is_some() {
        // A run of the other blocking, at this level.
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let others = Isa::ALL
        .into_iter()
        .filter(|&isa| isa <= Isa::detected() && isa != Isa::active());
    for isa in others {
        let run = std::process::Command::new(&exe)
            .env(ISA_VARIABLE, isa.name())
            .output()
            .expect("running the test binary again");
        assert!(
            run.status.success(),
            "the suite at {ISA_VARIABLE}={isa} failed:\n{}{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
}

/// This whole suite again with the blocking this CPU does not choose
/// ([`Blocking::detected`]), in a process of its own with `MOEKIT_CPU_BLOCKING` naming it:
/// the panels of the other kind of CPU, against the reference and across thread counts.
#[test]
fn the_other_blocking_passes_this_suite() {
    if let Some(requested) = std::env::var_os(BLOCKING_VARIABLE) {
        // The run started below: its products use the blocking it was given.
        let requested = requested.to_string_lossy();
        assert_eq!(
            Some(Blocking::active()),
            Blocking::from_name(&requested),
            "{requested}"
        );
        return;
    }
    if std::env::var_os(ISA_VARIABLE).is_some() {
        // A run at another level, with this CPU's blocking.
        return;
    }
    let other = Blocking::ALL
        .into_iter()
        .find(|&b| b != Blocking::active())
        .expect("two blockings");
    let exe = std::env::current_exe().expect("the test binary's path");
    let run = std::process::Command::new(&exe)
        .env(BLOCKING_VARIABLE, other.name())
        .output()
        .expect("running the test binary again");
    assert!(
        run.status.success(),
        "the suite at {BLOCKING_VARIABLE}={other} failed:\n{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
}
