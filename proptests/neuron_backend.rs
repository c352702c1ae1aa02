//! The `neuron` backend end to end on the fake runtime (`ffi/fake/fake_nrt.c`): manifest lookup,
//! NEFF loading, binding by contract name, execution and read-back for `router_topk`, `moe_tkg`,
//! `blockwise_mm` and `blockwise_mm_bwd`, the decode kernels, and `topk`, `topk_reduce`,
//! `find_nonzero_indices` and `indexed_flatten`, compared with the reference backend; and every
//! mismatch between a call and a NEFF reported as a clear error before anything runs.
//!
//! The fake computes in f64 from the stored inputs and rounds router logits to f32 before the
//! activation, as hardware does (router cases cover bias and selection-bias inputs); values agree with the reference within `1e-5` relative to the
//! tensor's scale, and expert choices exactly (random inputs make near-ties vanishingly rare).
//! Indices, counts and copied elements (`topk`'s values, `indexed_flatten`'s array) agree
//! exactly.

mod common;

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex, MutexGuard};

use common::*;
use half::bf16;
use moekit::backend::{Device, KernelCall, PlannedCall, Tolerance};
use moekit::contracts::*;
use moekit::cpu::CpuBackend;
use moekit::ep::{LocalComm, ShardedExperts};
use moekit::experts::{Experts, ExpertsInputs, ExpertsSizes, LocalExperts};
use moekit::fallback::FallbackBackend;
use moekit::kernel::Kernel;
use moekit::neuron::backend::manifest_entry;
use moekit::neuron::manifest::Manifest;
use moekit::neuron::{NeuronBackend, NeuronConfig};
use moekit::{Backend, BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

const FAKE: &str = moekit_nrt_fake::LIBRARY;

/// One runtime per process: every test that runs the backend takes this lock.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A fresh folder for one test's manifest and NEFFs.
fn workdir(name: &str) -> PathBuf {
    scratch_dir("neuron_backend", name)
}

/// Writes `neffs` (file name, stand-in text) and a manifest registering them with `entries`
/// (the TOML of each `[[kernel]]` table after its `neff` line); returns a backend on the fake.
fn backend_with(dir: &Path, neffs: &[(&str, String, String)]) -> NeuronBackend {
    let mut manifest = String::new();
    for (file, neff, entry) in neffs {
        std::fs::write(dir.join(file), neff).unwrap();
        manifest.push_str(&format!("[[kernel]]\nneff = \"{file}\"\n{entry}\n"));
    }
    std::fs::write(dir.join("kernels.toml"), manifest).unwrap();
    NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: dir.join("kernels.toml"),
    })
}

fn decl(usage: &str, name: &str, dtype: &str, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("{usage} {name} {dtype} {}\n", dims.join(" "))
}

/// The stand-in NEFF of a router_topk call with these inputs.
fn router_neff(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    k: usize,
    params: RouterTopkParams,
    with_topk: bool,
) -> String {
    let p = params.pipeline;
    let t = match p.x_hbm_layout {
        XHbmLayout::TH => x.shape()[0],
        XHbmLayout::HT => x.shape()[1],
    };
    let e = w.shape()[1];
    let mut neff = format!(
        "moekit-fake-neff 1\nkernel router_topk\nparam act_fn {}\nparam router_pre_norm {}\n\
         param norm_topk_prob {}\nparam x_hbm_layout {}\n",
        p.act_fn,
        u8::from(p.router_pre_norm),
        u8::from(p.norm_topk_prob),
        p.x_hbm_layout
    );
    neff += &decl("input", "x", &x.dtype().to_string(), x.shape());
    neff += &decl("input", "w", &w.dtype().to_string(), w.shape());
    if let Some(bias) = bias {
        neff += &decl("input", "w_bias", &bias.dtype().to_string(), bias.shape());
    }
    neff += &decl("output", "router_logits", "f32", &[t, e]);
    neff += &decl("output", "expert_index", "i32", &[t, k]);
    neff += &decl("output", "expert_affinities", "f32", &[t, e]);
    if with_topk {
        neff += &decl("output", "topk_affinities", "f32", &[t, k]);
    }
    neff
}

fn router_entry(t: usize, h: usize, e: usize, params: RouterTopkParams) -> String {
    let p = params.pipeline;
    format!(
        "name = \"router_topk\"\nt = {t}\nh = {h}\ne = {e}\nk = {}\nact_fn = \"{}\"\n\
         router_pre_norm = {}\nnorm_topk_prob = {}\nx_hbm_layout = {}\n",
        params.k, p.act_fn, p.router_pre_norm, p.norm_topk_prob, p.x_hbm_layout
    )
}

#[derive(Clone, Debug)]
struct RouterCase {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    pipeline: RouterPipeline,
    bias: bool,
    bf16: bool,
    with_topk: bool,
    selection: bool,
    seed: u64,
}

fn router_case() -> impl Strategy<Value = RouterCase> {
    (
        1usize..12,
        1usize..20,
        1usize..10,
        any::<(bool, bool, bool, bool, bool, bool)>(),
        any::<(bool, bool, u64)>(),
    )
        .prop_flat_map(|(t, h, e, flags, more)| (Just((t, h, e, flags, more)), 1..=e))
        .prop_map(
            |(
                (
                    t,
                    h,
                    e,
                    (sigmoid, norm_topk_prob, bias, bf16, with_topk, selection),
                    (act2, h_t, seed),
                ),
                k,
            )| {
                RouterCase {
                    t,
                    h,
                    e,
                    k,
                    pipeline: RouterPipeline {
                        act_fn: if sigmoid {
                            RouterActFnType::Sigmoid
                        } else {
                            RouterActFnType::Softmax
                        },
                        router_pre_norm: !act2,
                        norm_topk_prob,
                        x_hbm_layout: if h_t { XHbmLayout::HT } else { XHbmLayout::TH },
                    },
                    bias,
                    bf16,
                    with_topk,
                    selection,
                    seed,
                }
            },
        )
}

fn maybe_bf16(tensor: Tensor, bf16: bool) -> Tensor {
    if bf16 { tensor.to_bf16() } else { tensor }
}

proptest! {
    #![proptest_config(config(24))]

    #[test]
    fn router_topk_on_the_fake_runtime_matches_the_reference(case in router_case()) {
        let _guard = exclusive();
        let mut rng = SeededRng::new(case.seed);
        let (t, h, e, k) = (case.t, case.h, case.e, case.k);
        let x = f32_tensor(&[t, h], &rng.values(t * h, 1.0));
        let x = case.pipeline.x_hbm_layout.from_tokens_major(x).unwrap();
        let x = maybe_bf16(x, case.bf16);
        let w = maybe_bf16(f32_tensor(&[h, e], &rng.values(h * e, 1.0)), case.bf16);
        let bias = case.bias.then(|| f32_tensor(&[e], &rng.values(e, 0.5)));
        // Aux-loss-free balancing's bias: it moves the choice only.
        let selection = case.selection.then(|| f32_tensor(&[e], &rng.values(e, 0.2)));
        let params = RouterTopkParams { k, pipeline: case.pipeline };
        let mut neff = router_neff(&x, &w, bias.as_ref(), k, params, case.with_topk);
        if selection.is_some() {
            neff += &decl("input", "selection_bias", "f32", &[e]);
        }
        let dir = workdir("router");
        let backend = backend_with(&dir, &[("router.neff", neff, router_entry(t, h, e, params))]);
        let inputs = RouterTopkInputs { x: &x, w: &w, w_bias: bias.as_ref(), selection_bias: selection.as_ref() };
        let call = RouterTopk::new(inputs, params).unwrap();
        let f32_call = call.with_output_dtype(OutputDType::Float32);
        let got = backend.router_topk(&f32_call).unwrap();
        let want = BackendKind::Reference.create().router_topk(&f32_call).unwrap();
        prop_assert_eq!(got.expert_index.as_i32(), want.expert_index.as_i32());
        // nki-library's dtypes: the logits and affinities in x's.
        let nki = backend.router_topk(&call).unwrap();
        for (name, g, w, n) in [
            ("router_logits", &got.router_logits, &want.router_logits, &nki.router_logits),
            ("topk_affinities", &got.topk_affinities, &want.topk_affinities, &nki.topk_affinities),
            ("expert_affinities", &got.expert_affinities, &want.expert_affinities, &nki.expert_affinities),
        ] {
            prop_assert_eq!(g.shape(), w.shape(), "{}", name);
            let expected = f32s(w);
            assert_close(name, &f32s(g), &expected, 1e-5, 1e-5 * scale(&expected))?;
            prop_assert_eq!(&g.clone().into_float_dtype(name, x.dtype()).unwrap(), n, "{}", name);
        }
    }

    #[test]
    fn blockwise_mm_on_the_fake_runtime_matches_the_reference(
        (t, h, e, i, k, b) in (1usize..10, 1usize..12, 1usize..6, 1usize..10, 1usize..4, 1usize..6),
        seed in any::<u64>(),
        checkpoint in any::<bool>(),
        (activation, scaling) in (0..ActFnType::ALL.len(), 0..ExpertAffinityScaleMode::ALL.len()),
        extras in any::<bool>(),
        (skip_token, store) in (any::<bool>(), any::<bool>()),
    ) {
        let (activation, scaling) = (ActFnType::ALL[activation], ExpertAffinityScaleMode::ALL[scaling]);
        let _guard = exclusive();
        let k = k.min(e);
        // SkipMode(skip_token) and, where no token has two slots, is_tensor_update_accumulating
        // = false.
        let skip_dma = SkipMode { skip_token };
        let accumulating = !(store && k == 1);
        let rows = if skip_token { t } else { t + 1 };
        let mut rng = SeededRng::new(seed);
        let reference = BackendKind::Reference.create();
        let x = f32_tensor(&[t, h], &rng.values(t * h, 1.0));
        let w = f32_tensor(&[h, e], &rng.values(h * e, 1.0));
        let routed = reference.router_topk(&RouterTopk::new(
            RouterTopkInputs { x: &x, w: &w, w_bias: None, selection_bias: None },
            RouterTopkParams { k, pipeline: RouterPipeline::QWEN3_MOE },
        ).unwrap()).unwrap();
        let plan = reference.permute(&Permute::new(
            PermuteInputs { expert_index: &routed.expert_index, topk_affinities: &routed.topk_affinities },
            PermuteParams { skip_dma, ..PermuteParams::new(e, b) },
        ).unwrap()).unwrap();
        let mut padded = f32s(&x);
        padded.resize(rows * h, 0.0);
        let hidden_states = f32_tensor(&[rows, h], &padded);
        let gate_up = f32_tensor(&[e, h, 2, i], &rng.values(e * h * 2 * i, 0.5));
        let down = f32_tensor(&[e, i, h], &rng.values(e * i * h, 0.5));
        // With `extras`: both biases and clamps on both projections (the up's lower limit above
        // 0, so padding slots have outputs).
        let gate_up_bias = f32_tensor(&[e, 2, i], &rng.values(e * 2 * i, 0.5));
        let down_bias = f32_tensor(&[e, h], &rng.values(e * h, 0.5));
        let clamp = match extras {
            true => ClampLimits {
                gate: Clamp { lower: Some(-0.6), upper: Some(1.5) },
                up: Clamp { lower: Some(0.125), upper: None },
            },
            false => ClampLimits::default(),
        };
        let inputs = BlockwiseMmInputs {
            hidden_states: &hidden_states,
            expert_affinities_masked: &plan.expert_affinities_masked,
            gate_up_proj_weight: &gate_up,
            down_proj_weight: &down,
            token_position_to_id: &plan.token_position_to_id,
            block_to_expert: &plan.block_to_expert,
            gate_and_up_proj_bias: extras.then_some(&gate_up_bias),
            down_proj_bias: extras.then_some(&down_bias),
            up_proj_weight: None,
        };
        let params = BlockwiseMmParams {
            checkpoint_activation: checkpoint,
            activation_function: activation,
            expert_affinities_scaling_mode: scaling,
            clamp,
            skip_dma,
            is_tensor_update_accumulating: accumulating,
            weight_layout: WeightLayout::Nki,
            compute_dtype: None,
        };
        let call = BlockwiseMm::new(inputs, params).unwrap();
        let n = call.dims().n;
        let mut neff = format!(
            "moekit-fake-neff 1\nkernel blockwise_mm\nparam activation_function {activation}\n\
             param expert_affinities_scaling_mode {scaling}\nparam skip_token {}\n",
            u8::from(skip_token)
        );
        for (name, tensor) in [
            ("hidden_states", &hidden_states),
            ("expert_affinities_masked", &plan.expert_affinities_masked),
            ("gate_up_proj_weight", &gate_up),
            ("down_proj_weight", &down),
            ("token_position_to_id", &plan.token_position_to_id),
            ("block_to_expert", &plan.block_to_expert),
        ] {
            neff += &decl("input", name, &tensor.dtype().to_string(), tensor.shape());
        }
        // The clamp limits as nki-library's forward names them, for the NEFF and its entry.
        let limits = [
            ("gate_clamp_lower_limit", clamp.gate.lower),
            ("gate_clamp_upper_limit", clamp.gate.upper),
            ("up_clamp_lower_limit", clamp.up.lower),
            ("up_clamp_upper_limit", clamp.up.upper),
        ];
        let mut limit_keys = String::new();
        for (name, limit) in limits {
            if let Some(limit) = limit {
                neff += &format!("param {name} {limit}\n");
                limit_keys += &format!("{name} = {limit}\n");
            }
        }
        let forward_limits = neff.clone();
        if extras {
            neff += &decl("input", "gate_and_up_proj_bias", "f32", &[e, 2, i]);
            neff += &decl("input", "down_proj_bias", "f32", &[e, h]);
        }
        neff += &format!("param is_tensor_update_accumulating {}\n", u8::from(accumulating));
        neff += &decl("output", "output", "f32", &[rows, h]);
        if checkpoint {
            neff += &decl("output", "gate_up_activations_T", "f32", &[n, 2, i, b]);
            neff += &decl("output", "down_activations", "bf16", &[n, b, h]);
        }
        let entry = format!(
            "name = \"blockwise_mm\"\nt = {t}\nh = {h}\ne = {e}\ni = {i}\nblock_size = {b}\nnum_blocks = {n}\ncheckpoint_activation = {checkpoint}\nactivation_function = \"{activation}\"\n\
             expert_affinities_scaling_mode = \"{scaling}\"\ngate_and_up_proj_bias = {extras}\ndown_proj_bias = {extras}\n{limit_keys}\
             skip_token = {skip_token}\nis_tensor_update_accumulating = {accumulating}\n"
        );
        // The backward's NEFF: the forward's inputs but the biases, its checkpoints and the
        // output gradient, the clamps under the backward's names; with `bias`, the biases'
        // gradients.
        let mut bwd_neff = forward_limits
            .replace("kernel blockwise_mm\n", "kernel blockwise_mm_bwd\n")
            .replace("param gate_clamp", "param non_linear_clamp")
            .replace("param up_clamp", "param linear_clamp");
        bwd_neff += &decl("input", "gate_up_proj_act_checkpoint_T", "f32", &[n, 2, i, b]);
        bwd_neff += &decl("input", "down_proj_act_checkpoint", "f32", &[n, b, h]);
        bwd_neff += &decl("input", "output_hidden_states_grad", "f32", &[rows, h]);
        bwd_neff += &decl("output", "hidden_states_grad", "f32", &[rows, h]);
        bwd_neff += &decl("output", "expert_affinities_masked_grad", "f32", &[rows * e, 1]);
        bwd_neff += &decl("output", "gate_up_proj_weight_grad", "f32", &[e, h, 2, i]);
        bwd_neff += &decl("output", "down_proj_weight_grad", "f32", &[e, i, h]);
        if extras {
            bwd_neff += &decl("output", "gate_and_up_proj_bias_grad", "f32", &[e, 2, i]);
            bwd_neff += &decl("output", "down_proj_bias_grad", "bf16", &[e, h]);
        }
        let bwd_limit_keys = limit_keys
            .replace("gate_clamp", "non_linear_clamp")
            .replace("up_clamp", "linear_clamp");
        let bwd_entry = format!(
            "name = \"blockwise_mm_bwd\"\nt = {t}\nnum_blocks = {n}\nactivation_type = \"{activation}\"\n\
             expert_affinities_scaling_mode = \"{scaling}\"\nbias = {extras}\n{bwd_limit_keys}\
             skip_token = {skip_token}\nis_tensor_update_accumulating = {accumulating}\n"
        );
        let dir = workdir("blockwise");
        let backend = backend_with(
            &dir,
            &[("blockwise.neff", neff, entry), ("blockwise_bwd.neff", bwd_neff, bwd_entry)],
        );
        let got = backend.blockwise_mm(&call).unwrap();
        let want = reference.blockwise_mm(&call).unwrap();
        let expected = f32s(&want.output);
        assert_close("output", &f32s(&got.output), &expected, 1e-5, 1e-5 * scale(&expected))?;
        if checkpoint {
            // down_activations come back from a bf16 NEFF output: bf16 rounding (2⁻⁸ relative).
            for (name, got, want, rtol) in [
                ("gate_up_activations_T", &got.gate_up_activations_t, &want.gate_up_activations_t, 1e-5),
                ("down_activations", &got.down_activations, &want.down_activations, 4e-3),
            ] {
                let (got, want) = (got.as_ref().unwrap(), want.as_ref().unwrap());
                prop_assert_eq!(got.shape(), want.shape(), "{}", name);
                let expected = f32s(want);
                assert_close(name, &f32s(got), &expected, rtol, rtol * scale(&expected))?;
            }
            let mut d_output = rng.values(t * h, 1.0);
            d_output.resize(rows * h, 0.0);
            let d_output = f32_tensor(&[rows, h], &d_output);
            let bwd = BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: inputs,
                gate_up_proj_act_checkpoint_t: want.gate_up_activations_t.as_ref().unwrap(),
                down_proj_act_checkpoint: want.down_activations.as_ref().unwrap(),
                output_hidden_states_grad: &d_output,
                expert_index: Some(&routed.expert_index),
            },
            BlockwiseMmBwdParams {
                activation_type: activation,
                expert_affinities_scaling_mode: scaling,
                clamp,
                bias: extras,
                skip_dma,
                is_tensor_update_accumulating: accumulating,
                weight_layout: WeightLayout::Nki,
                compute_dtype: None,
            },
            ).unwrap();
            let got = backend.blockwise_mm_bwd(&bwd).unwrap();
            let want = reference.blockwise_mm_bwd(&bwd).unwrap();
            for (name, got, want) in [
                ("hidden_states_grad", &got.hidden_states_grad, &want.hidden_states_grad),
                ("expert_affinities_masked_grad", &got.expert_affinities_masked_grad, &want.expert_affinities_masked_grad),
                ("gate_up_proj_weight_grad", &got.gate_up_proj_weight_grad, &want.gate_up_proj_weight_grad),
                ("down_proj_weight_grad", &got.down_proj_weight_grad, &want.down_proj_weight_grad),
                ("d_topk_affinities", got.d_topk_affinities.as_ref().unwrap(), want.d_topk_affinities.as_ref().unwrap()),
            ] {
                prop_assert_eq!(got.shape(), want.shape(), "{}", name);
                let expected = f32s(want);
                assert_close(name, &f32s(got), &expected, 1e-5, 1e-5 * scale(&expected))?;
            }
            prop_assert_eq!(got.gate_and_up_proj_bias_grad.is_some(), extras);
            if extras {
                // down_proj_bias_grad comes back from a bf16 NEFF output, as f32 (the call's
                // dtypes): bf16 rounding.
                for (name, got, want, rtol) in [
                    ("gate_and_up_proj_bias_grad", &got.gate_and_up_proj_bias_grad, &want.gate_and_up_proj_bias_grad, 1e-5),
                    ("down_proj_bias_grad", &got.down_proj_bias_grad, &want.down_proj_bias_grad, 4e-3),
                ] {
                    let (got, want) = (got.as_ref().unwrap(), want.as_ref().unwrap());
                    prop_assert_eq!(got.dtype(), moekit::DType::F32, "{}", name);
                    let expected = want.to_f64_vec();
                    assert_close(name, &got.to_f64_vec(), &expected, rtol, rtol * scale(&expected))?;
                }
            }
        } else {
            prop_assert!(got.gate_up_activations_t.is_none() && got.down_activations.is_none());
        }
    }
}

/// A small router call, its params and the NEFF text the fake runs for it.
struct SmallRouter {
    x: Tensor,
    w: Tensor,
    bias: Tensor,
    params: RouterTopkParams,
}

impl SmallRouter {
    /// The validated call, with `w_bias` if asked.
    fn call(&self, with_bias: bool) -> Result<RouterTopk<'_>, Error> {
        RouterTopk::new(
            RouterTopkInputs {
                x: &self.x,
                w: &self.w,
                w_bias: with_bias.then_some(&self.bias),
                selection_bias: None,
            },
            self.params,
        )
    }
}

/// One token routed to expert 0 of 2: a permute call, which the neuron backend does not run.
struct OneSlot {
    index: Tensor,
    affinities: Tensor,
}

impl OneSlot {
    fn new() -> Self {
        Self {
            index: i32_tensor(&[1, 1], &[0]),
            affinities: f32_tensor(&[1, 1], &[1.0]),
        }
    }

    fn permute(&self) -> Permute<'_> {
        Permute::new(
            PermuteInputs {
                expert_index: &self.index,
                topk_affinities: &self.affinities,
            },
            PermuteParams::new(2, 1),
        )
        .unwrap()
    }
}

fn small_router() -> SmallRouter {
    let mut rng = SeededRng::new(7);
    SmallRouter {
        x: f32_tensor(&[4, 6], &rng.values(24, 1.0)),
        w: f32_tensor(&[6, 5], &rng.values(30, 1.0)),
        bias: f32_tensor(&[5], &rng.values(5, 0.5)),
        params: RouterTopkParams {
            k: 2,
            pipeline: RouterPipeline::QWEN3_MOE,
        },
    }
}

/// Runs the small router call (with `w_bias` if asked) on a backend whose only NEFF is `neff`.
fn run_small(
    name: &str,
    neff: String,
    entry: Option<String>,
    with_bias: bool,
) -> Result<RouterTopkOutputs, Error> {
    let r = small_router();
    let dir = workdir(name);
    let entry = entry.unwrap_or_else(|| router_entry(4, 6, 5, r.params));
    let backend = backend_with(&dir, &[("router.neff", neff, entry)]);
    backend.router_topk(&r.call(with_bias)?)
}

fn expect_neff_error(result: Result<RouterTopkOutputs, Error>, needles: &[&str]) {
    let err = result.expect_err("the call is refused");
    let message = err.to_string();
    assert!(matches!(err, Error::Neff { .. }), "{message}");
    for needle in needles {
        assert!(message.contains(needle), "`{needle}` not in: {message}");
    }
}

#[test]
fn a_neff_whose_dtype_differs_from_the_call_is_refused_before_running() {
    let _guard = exclusive();
    let r = small_router();
    let neff = router_neff(&r.x.to_bf16(), &r.w, None, 2, r.params, true);
    expect_neff_error(
        run_small("dtype", neff, None, false),
        &["router.neff", "input `x`", "bf16", "f32"],
    );
}

#[test]
fn a_neff_whose_shape_differs_from_the_call_is_refused_before_running() {
    let _guard = exclusive();
    let r = small_router();
    let x3 = f32_tensor(&[3, 6], &[0.0; 18]);
    let neff = router_neff(&x3, &r.w, None, 2, r.params, true);
    // An entry without `t` matches any token count, so the NEFF's own shapes must catch it.
    let entry = "name = \"router_topk\"\nh = 6\ne = 5\n".to_owned();
    expect_neff_error(
        run_small("shape", neff, Some(entry), false),
        &["input `x`", "[3, 6]", "[4, 6]"],
    );
}

#[test]
fn inputs_and_outputs_outside_the_contract_or_missing_are_refused() {
    let _guard = exclusive();
    let r = small_router();
    let base = router_neff(&r.x, &r.w, None, 2, r.params, true);
    let extra_input = base.replace("input w f32 6 5\n", "input w f32 6 5\ninput scale f32 5\n");
    expect_neff_error(
        run_small("extra-input", extra_input, None, false),
        &["input `scale`", "not a router_topk input"],
    );
    // The call gives a bias the NEFF does not take: it would silently be ignored.
    expect_neff_error(
        run_small("ignored-bias", base.clone(), None, true),
        &["`w_bias`", "does not take"],
    );
    // The NEFF takes a bias the call does not give.
    let with_bias = router_neff(&r.x, &r.w, Some(&r.bias), 2, r.params, true);
    expect_neff_error(
        run_small("missing-bias", with_bias, None, false),
        &["needs input `w_bias`"],
    );
    let no_logits = base.replace("output router_logits f32 4 5\n", "");
    let err = run_small("no-logits", no_logits, None, false)
        .err()
        .unwrap();
    // The fake itself refuses a router_topk NEFF without router_logits at load time.
    assert!(err.to_string().contains("NRT_INVALID"), "{err}");
    let wrong_index = base.replace("output expert_index i32 4 2", "output expert_index f32 4 2");
    expect_neff_error(
        run_small("index-dtype", wrong_index, None, false),
        &["output `expert_index`", "i32"],
    );
}

#[test]
fn a_bias_run_and_a_run_without_topk_affinities_match_the_reference() {
    let _guard = exclusive();
    let r = small_router();
    let neff = router_neff(&r.x, &r.w, Some(&r.bias), 2, r.params, false);
    let got = run_small("bias", neff, None, true).unwrap();
    let call = r.call(true).unwrap();
    let want = BackendKind::Reference.create().router_topk(&call).unwrap();
    assert_eq!(got.expert_index.as_i32(), want.expert_index.as_i32());
    let expected = f32s(&want.topk_affinities);
    assert_close(
        "topk_affinities",
        &f32s(&got.topk_affinities),
        &expected,
        1e-5,
        1e-6,
    )
    .unwrap();
}

#[test]
fn manifest_lookup_failures_name_the_manifest_and_what_it_registers() {
    let _guard = exclusive();
    let r = small_router();
    let neff = router_neff(&r.x, &r.w, None, 2, r.params, true);
    let other = RouterTopkParams { k: 3, ..r.params };
    let err = run_small(
        "no-entry",
        neff.clone(),
        Some(router_entry(4, 6, 5, other)),
        false,
    )
    .err()
    .unwrap();
    let message = err.to_string();
    assert!(message.contains("kernels.toml"), "{message}");
    assert!(
        message.contains("no NEFF for router_topk with t=4 h=6 e=5 k=2"),
        "{message}"
    );
    assert!(message.contains("k=3"), "{message}");

    let bad_key = format!("{}\nheads = 4\n", router_entry(4, 6, 5, r.params));
    let err = run_small("bad-key", neff.clone(), Some(bad_key), false)
        .err()
        .unwrap();
    assert!(err.to_string().contains("unknown key `heads`"), "{err}");
    let bad_kernel = "name = \"permute\"\n".to_owned();
    let err = run_small("bad-kernel", neff, Some(bad_kernel), false)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("does not run this kernel"),
        "{err}"
    );
}

#[test]
fn a_missing_manifest_library_or_neff_and_unsupported_kernels_are_clear_errors() {
    let _guard = exclusive();
    let r = small_router();
    let call = r.call(false).unwrap();
    let dir = workdir("missing");
    let no_manifest = NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: dir.join("absent.toml"),
    });
    let err = no_manifest.router_topk(&call).unwrap_err();
    assert!(err.to_string().contains("absent.toml"), "{err}");

    std::fs::write(
        dir.join("kernels.toml"),
        format!(
            "[[kernel]]\nneff = \"gone.neff\"\n{}",
            router_entry(4, 6, 5, r.params)
        ),
    )
    .unwrap();
    let no_library = NeuronBackend::new(NeuronConfig {
        library: Some(dir.join("libnrt.so.1")),
        manifest: dir.join("kernels.toml"),
    });
    let err = no_library.router_topk(&call).unwrap_err();
    assert!(matches!(err, Error::NeuronLibrary(_)), "{err}");
    assert!(err.to_string().contains("libnrt.so.1"), "{err}");

    let no_neff = NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: dir.join("kernels.toml"),
    });
    let err = no_neff.router_topk(&call).unwrap_err();
    assert!(err.to_string().contains("gone.neff"), "{err}");

    let one_slot = OneSlot::new();
    let permute = one_slot.permute();
    let err = no_neff.permute(&permute).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(
        err.to_string().contains("router_topk, blockwise_mm"),
        "{err}"
    );

    // One runtime per process: the backends above close theirs.
    drop((no_library, no_neff));

    // A NEFF registered without clamp limits was compiled without clamps: a clamped call does
    // not match it, and the error names the limit; with the limit in the entry it matches (and
    // then fails on the missing NEFF file).
    let hidden = f32_tensor(&[2, 1], &[0.5, 0.0]);
    let masked = f32_tensor(&[4, 1], &[1.0, 0.0, 0.0, 0.0]);
    let gate_up = f32_tensor(&[2, 1, 2, 1], &[0.1; 4]);
    let down = f32_tensor(&[2, 1, 1], &[0.2; 2]);
    let positions = i32_tensor(&[2], &[0, 1]);
    let blocks = i32_tensor(&[2, 1], &[0, 1]);
    let inputs = BlockwiseMmInputs {
        hidden_states: &hidden,
        expert_affinities_masked: &masked,
        gate_up_proj_weight: &gate_up,
        down_proj_weight: &down,
        token_position_to_id: &positions,
        block_to_expert: &blocks,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
        up_proj_weight: None,
    };
    let clamped = BlockwiseMmParams {
        clamp: ClampLimits {
            gate: Clamp {
                lower: None,
                upper: Some(1.5),
            },
            ..ClampLimits::default()
        },
        ..BlockwiseMmParams::default()
    };
    let call = BlockwiseMm::new(inputs, clamped).unwrap();
    let entry = "[[kernel]]\nname = \"blockwise_mm\"\nneff = \"clamped.neff\"\n";
    // The error of `call` on a backend whose manifest `manifest` holds `text`.
    let run_call = |call: &BlockwiseMm<'_>, manifest: &str, text: String| {
        std::fs::write(dir.join(manifest), text).unwrap();
        let backend = NeuronBackend::new(NeuronConfig {
            library: Some(PathBuf::from(FAKE)),
            manifest: dir.join(manifest),
        });
        backend.blockwise_mm(call).unwrap_err().to_string()
    };
    let run = |manifest: &str, text: String| run_call(&call, manifest, text);
    let err = run("unclamped.toml", entry.to_owned());
    assert!(
        err.contains("no NEFF for blockwise_mm") && err.contains("gate_clamp_upper_limit=1.5"),
        "{err}"
    );
    let err = run(
        "clamped.toml",
        format!("{entry}gate_clamp_upper_limit = 1.5\n"),
    );
    assert!(err.contains("clamped.neff"), "{err}");
    let err = run(
        "bad-limit.toml",
        format!("{entry}gate_clamp_upper_limit = \"high\"\n"),
    );
    assert!(
        err.contains("`gate_clamp_upper_limit` must be a number or \"none\""),
        "{err}"
    );
    // `"none"` says what leaving the key out says: compiled without that clamp.
    let err = run(
        "none.toml",
        format!("{entry}gate_clamp_upper_limit = \"none\"\n"),
    );
    assert!(err.contains("no NEFF for blockwise_mm"), "{err}");

    // Likewise `skip_token` and `is_tensor_update_accumulating`: an entry that leaves them out
    // was compiled with nki-library's defaults (false, true), whose tensors are other shapes.
    let skip_hidden = f32_tensor(&[1, 1], &[0.5]);
    let skip_masked = f32_tensor(&[2, 1], &[1.0, 0.0]);
    let skip_positions = i32_tensor(&[2], &[0, -1]);
    let skipping = BlockwiseMm::new(
        BlockwiseMmInputs {
            hidden_states: &skip_hidden,
            expert_affinities_masked: &skip_masked,
            token_position_to_id: &skip_positions,
            ..inputs
        },
        BlockwiseMmParams {
            skip_dma: SkipMode { skip_token: true },
            is_tensor_update_accumulating: false,
            ..BlockwiseMmParams::default()
        },
    )
    .unwrap();
    let run_skipping = |manifest: &str, text: String| run_call(&skipping, manifest, text);
    let err = run_skipping("padded.toml", entry.to_owned());
    assert!(
        err.contains("no NEFF for blockwise_mm")
            && err.contains("skip_token=true")
            && err.contains("is_tensor_update_accumulating=false"),
        "{err}"
    );
    let err = run_skipping(
        "skipping.toml",
        format!("{entry}skip_token = true\nis_tensor_update_accumulating = false\n"),
    );
    assert!(err.contains("clamped.neff"), "{err}");

    // nki-library's kernels take their own weight layout only: moekit's `linear` is refused
    // before any manifest lookup, naming the parameter and the layout they take.
    let linear_gate_up = f32_tensor(&[2, 2, 1, 1], &[0.1; 4]);
    let linear = BlockwiseMm::new(
        BlockwiseMmInputs {
            gate_up_proj_weight: &linear_gate_up,
            ..inputs
        },
        BlockwiseMmParams {
            weight_layout: WeightLayout::Linear,
            ..BlockwiseMmParams::default()
        },
    )
    .unwrap();
    let err = run_call(&linear, "linear.toml", entry.to_owned());
    assert!(
        err.contains("weight_layout") && err.contains("`linear`") && err.contains("[E, H, 2, I]"),
        "{err}"
    );
}

#[test]
fn a_bias_key_picks_the_neff_that_takes_the_bias() {
    let _guard = exclusive();
    let r = small_router();
    let dir = workdir("bias-key");
    let plain = router_neff(&r.x, &r.w, None, 2, r.params, true);
    let with_bias = router_neff(&r.x, &r.w, Some(&r.bias), 2, r.params, true);
    let entry = router_entry(4, 6, 5, r.params);
    let backend = backend_with(
        &dir,
        &[
            ("plain.neff", plain, format!("{entry}w_bias = false\n")),
            ("biased.neff", with_bias, format!("{entry}w_bias = true\n")),
        ],
    );
    let reference = BackendKind::Reference.create();
    for bias in [None, Some(&r.bias)] {
        let inputs = RouterTopkInputs {
            x: &r.x,
            w: &r.w,
            w_bias: bias,
            selection_bias: None,
        };
        let call = RouterTopk::new(inputs, r.params).unwrap();
        let got = backend.router_topk(&call).unwrap();
        let want = reference.router_topk(&call).unwrap();
        let expected = f32s(&want.router_logits);
        assert_close(
            "router_logits",
            &f32s(&got.router_logits),
            &expected,
            1e-5,
            1e-6,
        )
        .unwrap();
    }
}

#[test]
fn backends_state_their_kernels_tolerance_device_shapes_and_repeat_timing() {
    let _guard = exclusive();
    let r = small_router();
    let dir = workdir("capabilities");
    let neff = router_neff(&r.x, &r.w, None, 2, r.params, false);
    let entry = router_entry(4, 6, 5, r.params);
    let neuron = backend_with(&dir, &[("router.neff", neff, entry)]);
    let call = r.call(false).unwrap();
    let one_slot = OneSlot::new();
    let permute = one_slot.permute();

    // neuron: the kernels its manifest registers, at the shapes it registers, timed on the
    // device, against documented limits.
    for &kernel in Kernel::ALL {
        assert_eq!(
            neuron.supports(kernel).unwrap(),
            kernel == Kernel::RouterTopk,
            "{}",
            kernel.name()
        );
    }
    assert_eq!(neuron.tolerance(DType::F32), NeuronBackend::TOLERANCE);
    assert!(
        matches!(neuron.device(), Device::Accelerator(limits) if limits.name.contains("NeuronCore")),
        "{:?}",
        neuron.device()
    );
    let fixed = neuron.fixed_shapes().unwrap().expect("compiled shapes");
    assert_eq!(fixed.declared_in, dir.join("kernels.toml"));
    let [shape] = fixed.shapes.as_slice() else {
        panic!("one entry, one shape: {fixed:?}");
    };
    assert_eq!(shape.kernel, Kernel::RouterTopk);
    assert_eq!(
        (shape.sizes.t, shape.sizes.h, shape.sizes.e, shape.sizes.k),
        (4, 6, 5, 2)
    );
    assert_eq!(shape.params.k, Some(2));
    assert!(
        shape.source.starts_with("kernel entry 1 ("),
        "{}",
        shape.source
    );
    assert!(
        shape
            .warnings
            .iter()
            .any(|w| w.contains("H a multiple of 128")),
        "{:?}",
        shape.warnings
    );
    let mean = neuron
        .time_repeated(KernelCall::RouterTopk(&call), 3)
        .unwrap();
    assert!(mean.is_some(), "the device times repeats itself");
    let err = neuron
        .time_repeated(KernelCall::Permute(&permute), 3)
        .unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    let missing = NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: dir.join("absent.toml"),
    });
    let err = missing.supports(Kernel::RouterTopk).unwrap_err();
    assert!(err.to_string().contains("absent.toml"), "{err}");

    // The host backends: every kernel at any shape, timed by the caller's clock.
    for (kind, tolerances) in [
        (BackendKind::Reference, [Tolerance::EXACT; 2]),
        (
            BackendKind::Cpu,
            [CpuBackend::TOLERANCE, CpuBackend::BF16_TOLERANCE],
        ),
    ] {
        let backend = kind.create();
        for &kernel in Kernel::ALL {
            assert!(
                backend.supports(kernel).unwrap(),
                "{kind}: {}",
                kernel.name()
            );
        }
        for (dtype, tolerance) in [DType::F32, DType::BF16].into_iter().zip(tolerances) {
            assert_eq!(backend.tolerance(dtype), tolerance, "{kind} {dtype}");
        }
        assert_eq!(backend.device(), Device::Host, "{kind}");
        assert_eq!(backend.fixed_shapes().unwrap(), None, "{kind}");
        let timed = backend.time_repeated(KernelCall::RouterTopk(&call), 3);
        assert_eq!(timed.unwrap(), None, "{kind}");
    }
}

#[test]
fn a_fallback_backend_runs_each_kernel_on_the_primary_where_it_has_it_else_on_the_fallback() {
    let _guard = exclusive();
    let r = small_router();
    let dir = workdir("fallback");
    let neff = router_neff(&r.x, &r.w, None, 2, r.params, false);
    let entry = router_entry(4, 6, 5, r.params);
    let neuron = || backend_with(&dir, &[("router.neff", neff.clone(), entry.clone())]);
    let call = r.call(false).unwrap();
    // (One runtime per process: the primary alone runs, and closes, first.)
    let on_neuron = neuron().router_topk(&call).unwrap();
    let backend = FallbackBackend::new(Box::new(neuron()), BackendKind::Cpu.create()).unwrap();

    // Every kernel runs somewhere; the backend is the primary as far as tools see it, with the
    // looser tolerance.
    for &kernel in Kernel::ALL {
        assert!(backend.supports(kernel).unwrap(), "{}", kernel.name());
    }
    assert_eq!(backend.name(), NeuronBackend::NAME);
    assert_eq!(backend.tolerance(DType::BF16), NeuronBackend::TOLERANCE);
    assert!(matches!(backend.device(), Device::Accelerator(_)));
    assert!(backend.fixed_shapes().unwrap().is_some());

    // router_topk runs on the device (which times its repeats itself), with the primary's
    // results; permute on cpu (timed by the wall clock), with cpu's.
    assert!(
        backend
            .time_repeated(KernelCall::RouterTopk(&call), 3)
            .unwrap()
            .is_some()
    );
    assert_eq!(backend.router_topk(&call).unwrap(), on_neuron);
    let one_slot = OneSlot::new();
    let permute = one_slot.permute();
    assert!(
        backend
            .time_repeated(KernelCall::Permute(&permute), 3)
            .unwrap()
            .is_none()
    );
    assert_eq!(
        backend.permute(&permute).unwrap(),
        CpuBackend.permute(&permute).unwrap()
    );

    // A kernel the primary runs, but not this call (its NEFF takes no bias), is the primary's
    // error: nothing falls back silently.
    let err = backend.router_topk(&r.call(true).unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("router.neff") && err.to_string().contains("w_bias"),
        "{err}"
    );
}

/// The stand-in NEFF of a planned call (every float f32, as the experts' f32 inputs).
fn planned_neff(call: &PlannedCall) -> String {
    let (dims, activation, scaling, skip, checkpoint) = match call {
        PlannedCall::BlockwiseMm { dims, params } => (
            dims,
            params.activation_function,
            params.expert_affinities_scaling_mode,
            params.skip_dma.skip_token,
            params.checkpoint_activation,
        ),
        PlannedCall::BlockwiseMmBwd { dims, params } => (
            dims,
            params.activation_type,
            params.expert_affinities_scaling_mode,
            params.skip_dma.skip_token,
            true,
        ),
    };
    let stand_in = moekit_nrt_fake::Blockwise {
        t: dims.t,
        h: dims.h,
        e: dims.e,
        i: dims.i,
        b: dims.b,
        n: dims.n,
        activation: activation.name(),
        scaling: scaling.name(),
        skip_token: skip,
        checkpoint,
    };
    match call {
        PlannedCall::BlockwiseMm { .. } => stand_in.forward_neff(),
        PlannedCall::BlockwiseMmBwd { .. } => stand_in.backward_neff(),
    }
}

/// Writes the manifest [`manifest_entry`] makes for `calls`, and a stand-in NEFF for each
/// under the file name it gives; returns the manifest's path.
fn manifest_for(dir: &Path, calls: &[PlannedCall]) -> PathBuf {
    let mut manifest = String::new();
    for call in calls {
        let entry = manifest_entry(call);
        let neff = entry
            .lines()
            .find_map(|line| line.strip_prefix("neff = "))
            .unwrap()
            .trim_matches('"')
            .to_owned();
        std::fs::write(dir.join(neff), planned_neff(call)).unwrap();
        manifest += &entry;
        manifest += "\n";
    }
    std::fs::write(dir.join("kernels.toml"), manifest).unwrap();
    dir.join("kernels.toml")
}

/// The experts of a layer on `neuron` (the manifest at `manifest`) with the plan on cpu.
fn neuron_experts(manifest: &Path, block_size: usize) -> LocalExperts {
    let neuron = NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: manifest.to_path_buf(),
    });
    let backend = FallbackBackend::new(Box::new(neuron), BackendKind::Cpu.create()).unwrap();
    LocalExperts {
        backend: Arc::new(backend),
        block_size,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    }
}

/// Random routed tokens and weights of `sizes`, and an output gradient.
fn experts_tensors(sizes: ExpertsSizes, seed: u64) -> [Tensor; 6] {
    let ExpertsSizes { t, h, e, k, i } = sizes;
    let mut rng = SeededRng::new(seed);
    let index = expert_index(&mut rng, Routing::Random, t, e, k);
    [
        f32_tensor(&[t, h], &rng.values(t * h, 1.0)),
        i32_tensor(&[t, k], &index),
        f32_tensor(&[t, k], &rng.values(t * k, 1.0)),
        f32_tensor(&[e, h, 2, i], &rng.values(e * h * 2 * i, 0.5)),
        f32_tensor(&[e, i, h], &rng.values(e * i * h, 0.5)),
        f32_tensor(&[t, h], &rng.values(t * h, 1.0)),
    ]
}

fn inputs_of(tensors: &[Tensor; 6]) -> ExpertsInputs<'_> {
    ExpertsInputs {
        hidden_states: &tensors[0],
        expert_index: &tensors[1],
        topk_affinities: &tensors[2],
        gate_up_proj_weight: &tensors[3],
        down_proj_weight: &tensors[4],
        up_proj_weight: None,
    }
}

#[test]
fn experts_prepare_the_neffs_their_planned_calls_name_and_run_on_them() {
    let _guard = exclusive();
    let dir = workdir("planned_calls");
    let sizes = ExpertsSizes {
        t: 12,
        h: 8,
        e: 4,
        k: 2,
        i: 6,
    };
    let block_size = 4;
    let cpu = LocalExperts {
        backend: Arc::from(BackendKind::Cpu.create()),
        block_size,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    };
    let mut calls = cpu.planned_calls(sizes, true).unwrap();
    calls.extend(cpu.planned_calls(sizes, false).unwrap());
    assert_eq!(
        calls.iter().map(PlannedCall::kernel).collect::<Vec<_>>(),
        [
            Kernel::BlockwiseMm,
            Kernel::BlockwiseMmBwd,
            Kernel::BlockwiseMm
        ]
    );

    // With the backward registered at other sizes only, preparing a recorded forward names
    // what is missing, as does a forward without checkpoints (registered with them only).
    let other_sizes = cpu
        .planned_calls(ExpertsSizes { t: 5, ..sizes }, true)
        .unwrap();
    let manifest = manifest_for(&dir, &[calls[0], other_sizes[1]]);
    let experts = neuron_experts(&manifest, block_size);
    let err = experts.prepare(sizes, true).unwrap_err().to_string();
    assert!(
        err.contains("kernels.toml") && err.contains("no NEFF for blockwise_mm_bwd with t=12"),
        "{err}"
    );
    let err = experts.prepare(sizes, false).unwrap_err().to_string();
    assert!(err.contains("checkpoint_activation=false"), "{err}");
    drop(experts);

    // With every entry, the experts prepare, and a forward and backward run on the NEFFs
    // (the fake's f64) and agree with cpu's.
    let manifest = manifest_for(&dir, &calls);
    let experts = neuron_experts(&manifest, block_size);
    experts.prepare(sizes, true).unwrap();
    experts.prepare(sizes, false).unwrap();
    let tensors = experts_tensors(sizes, 7);
    let (output, saved) = experts.forward(inputs_of(&tensors), true).unwrap();
    let grads = experts
        .backward(inputs_of(&tensors), &saved.unwrap(), &tensors[5])
        .unwrap();
    let (want_output, want_saved) = cpu.forward(inputs_of(&tensors), true).unwrap();
    let want = cpu
        .backward(inputs_of(&tensors), &want_saved.unwrap(), &tensors[5])
        .unwrap();
    for (name, got, want) in [
        ("output", &output, &want_output),
        (
            "d_hidden_states",
            &grads.d_hidden_states,
            &want.d_hidden_states,
        ),
        (
            "d_topk_affinities",
            &grads.d_topk_affinities,
            &want.d_topk_affinities,
        ),
        (
            "d_gate_up",
            &grads.d_gate_up_proj_weight,
            &want.d_gate_up_proj_weight,
        ),
        (
            "d_down",
            &grads.d_down_proj_weight,
            &want.d_down_proj_weight,
        ),
    ] {
        assert_close(name, &f32s(got), &f32s(want), 1e-4, 1e-4).unwrap();
    }

    // A call of other sizes goes to the device too, which has no NEFF for it: the manifest's
    // error, not a silent fallback.
    let other = experts_tensors(ExpertsSizes { t: 5, ..sizes }, 8);
    let err = experts.forward(inputs_of(&other), false).unwrap_err();
    assert!(
        err.to_string().contains("no NEFF for blockwise_mm"),
        "{err}"
    );
}

#[test]
fn sharded_experts_plan_the_calls_of_dispatchs_layout() {
    let _guard = exclusive();
    let dir = workdir("sharded_planned_calls");
    let (ranks, block_size) = (2, 4);
    let sizes = ExpertsSizes {
        t: 6,
        h: 8,
        e: 4,
        k: 2,
        i: 6,
    };
    // Rank r's routed tokens and its half of the experts' weights.
    let global = experts_tensors(sizes, 11);
    let local = ShardedExperts::local_sizes(sizes, ranks).unwrap();
    assert_eq!((local.t, local.e), (12, 2));
    let planner = LocalExperts {
        backend: Arc::from(BackendKind::Cpu.create()),
        block_size,
        output_dtype: OutputDType::Float32,
        weight_layout: WeightLayout::Nki,
    };
    let manifest = manifest_for(&dir, &planner.planned_calls(local, true).unwrap());
    let backend = neuron_experts(&manifest, block_size).backend;
    let outputs = std::thread::scope(|scope| {
        let handles: Vec<_> = LocalComm::group(ranks)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (backend, global) = (Arc::clone(&backend), &global);
                scope.spawn(move || {
                    let experts = ShardedExperts {
                        backend,
                        comm: Rc::new(comm),
                        num_experts: sizes.e,
                        block_size,
                    };
                    assert_eq!(experts.planned_calls(sizes, true).unwrap().len(), 2);
                    experts.prepare(sizes, true).unwrap();
                    let share = sizes.e / ranks;
                    let weights = [3, 4].map(|w| {
                        let rows = global[w].shape()[0] / ranks;
                        let values = f32s(&global[w]);
                        let per_expert = values.len() / sizes.e;
                        let mut shape = global[w].shape().to_vec();
                        shape[0] = rows;
                        f32_tensor(
                            &shape,
                            &values[rank * share * per_expert..(rank + 1) * share * per_expert],
                        )
                    });
                    let inputs = ExpertsInputs {
                        gate_up_proj_weight: &weights[0],
                        down_proj_weight: &weights[1],
                        ..inputs_of(global)
                    };
                    let (output, saved) = experts.forward(inputs, true).unwrap();
                    experts
                        .backward(inputs, &saved.unwrap(), &global[5])
                        .unwrap();
                    f32s(&output)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // Every rank sent the same tokens: each gets the whole layer's output, cpu's.
    let cpu = LocalExperts {
        backend: Arc::from(BackendKind::Cpu.create()),
        block_size,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    };
    let (want, _) = cpu.forward(inputs_of(&global), false).unwrap();
    for output in outputs {
        assert_close("output", &output, &f32s(&want), 1e-4, 1e-4).unwrap();
    }
}

#[test]
fn a_manifest_entry_reads_back_as_the_entry_its_call_finds() {
    let dims = BlockwiseDims {
        t: 512,
        rows: 512,
        h: 2048,
        e: 128,
        i: 768,
        b: 128,
        n: 160,
    };
    let clamp = ClampLimits {
        gate: Clamp {
            lower: None,
            upper: Some(7.0),
        },
        up: Clamp {
            lower: Some(-1e20),
            upper: Some(0.25),
        },
    };
    let forward = BlockwiseMmParams {
        clamp,
        activation_function: ActFnType::Gelu,
        skip_dma: SkipMode { skip_token: true },
        ..BlockwiseMmParams::default()
    };
    let calls = [
        PlannedCall::BlockwiseMm {
            dims,
            params: forward,
        },
        PlannedCall::BlockwiseMmBwd {
            dims,
            params: forward.backward(false),
        },
    ];
    let dir = workdir("manifest_entry");
    let text: Vec<String> = calls.iter().map(manifest_entry).collect();
    std::fs::write(dir.join("kernels.toml"), text.join("\n")).unwrap();
    let manifest = Manifest::read(&dir.join("kernels.toml")).unwrap();
    assert_eq!(manifest.entries.len(), 2);
    let neffs: Vec<&Path> = manifest.entries.iter().map(|e| e.neff.as_path()).collect();
    assert_eq!(
        neffs,
        [
            dir.join("blockwise_mm_t512_h2048_e128_i768_b128_n160.neff"),
            dir.join("blockwise_mm_bwd_t512_h2048_e128_i768_b128_n160.neff"),
        ]
    );
    // Each entry is its call's: the limits, set or not, read back as the call's, and a call
    // with another limit finds neither.
    let (fwd, bwd) = (&manifest.entries[0], &manifest.entries[1]);
    assert_eq!(fwd.params["gate_clamp_upper_limit"].to_string(), "7");
    assert_eq!(
        bwd.params["linear_clamp_lower_limit"].to_string(),
        "-100000000000000000000"
    );
    assert!(!fwd.params.contains_key("gate_clamp_lower_limit"));
    let other = PlannedCall::BlockwiseMm {
        dims,
        params: BlockwiseMmParams {
            clamp: ClampLimits::default(),
            ..forward
        },
    };
    let other_manifest = dir.join("other.toml");
    std::fs::write(&other_manifest, manifest_entry(&other)).unwrap();
    let other = Manifest::read(&other_manifest).unwrap();
    assert_ne!(other.entries[0].params, fwd.params);
}

/// One `moe_tkg` call's tensors and options, for a stand-in NEFF and the manifest entry of it.
struct TkgCase {
    /// T, H, E (all ranks), E_L (held here), K, I.
    sizes: [usize; 6],
    all_expert: bool,
    post_scale: bool,
    mask: bool,
    biases: bool,
    eager: bool,
    clamp: bool,
    bf16: bool,
    rank: i32,
}

impl TkgCase {
    /// The call's inputs by contract name, and its parameters.
    fn tensors(&self, seed: u64) -> (Vec<(&'static str, Tensor)>, MoeTkgParams) {
        let [t, h, e, local, k, i] = self.sizes;
        let mut rng = SeededRng::new(seed);
        let float =
            |shape: &[usize], values: Vec<f64>| maybe_bf16(f32_tensor(shape, &values), self.bf16);
        let pool = if self.all_expert { e } else { local };
        let index: Vec<i32> = (0..t * k).map(|_| rng.below(pool) as i32).collect();
        let mut tensors = vec![
            ("hidden_input", float(&[t, h], rng.values(t * h, 1.0))),
            (
                "expert_gate_up_weights",
                float(&[local, h, 2, i], rng.values(local * h * 2 * i, 0.5)),
            ),
            (
                "expert_down_weights",
                float(&[local, i, h], rng.values(local * i * h, 0.5)),
            ),
            ("expert_affinities", float(&[t, e], rng.values(t * e, 1.0))),
            ("expert_index", i32_tensor(&[t, k], &index)),
            ("rank_id", i32_tensor(&[1, 1], &[self.rank])),
        ];
        if self.biases {
            tensors.push((
                "expert_gate_up_bias",
                float(&[local, 2, i], rng.values(local * 2 * i, 0.5)),
            ));
            tensors.push((
                "expert_down_bias",
                float(&[local, h], rng.values(local * h, 0.5)),
            ));
        }
        if self.eager {
            tensors.push((
                "expert_affinities_eager",
                float(&[t, k], rng.values(t * k, 1.0)),
            ));
        }
        let clamp = Clamp {
            lower: Some(-0.5),
            upper: Some(0.75),
        };
        let params = MoeTkgParams {
            expert_affinities_scaling_mode: if self.post_scale {
                ExpertAffinityScaleMode::PostScale
            } else {
                ExpertAffinityScaleMode::NoScale
            },
            activation_fn: ActFnType::Gelu,
            clamp: if self.clamp {
                ClampLimits {
                    gate: clamp,
                    up: clamp,
                }
            } else {
                ClampLimits::default()
            },
            mask_unselected_experts: self.mask,
            ..MoeTkgParams::new(self.all_expert)
        };
        (tensors, params)
    }

    /// The stand-in NEFF: the inputs the backend binds (`rank_id` for all-expert POST_SCALE
    /// only), `output [T, H]`.
    fn neff(&self, tensors: &[(&'static str, Tensor)], params: &MoeTkgParams) -> String {
        let [t, h, ..] = self.sizes;
        let mut neff = format!(
            "moekit-fake-neff 1\nkernel moe_tkg\nparam is_all_expert {}\nparam activation_fn {}\n\
             param expert_affinities_scaling_mode {}\nparam mask_unselected_experts {}\n",
            u8::from(self.all_expert),
            params.activation_fn,
            params.expert_affinities_scaling_mode,
            u8::from(self.mask)
        );
        if self.clamp {
            for name in [
                "gate_clamp_lower_limit",
                "gate_clamp_upper_limit",
                "up_clamp_lower_limit",
                "up_clamp_upper_limit",
            ] {
                let limit = if name.contains("lower") {
                    "-0.5"
                } else {
                    "0.75"
                };
                neff += &format!("param {name} {limit}\n");
            }
        }
        let takes_rank = self.all_expert && self.post_scale;
        for (name, tensor) in tensors {
            if *name != "rank_id" || takes_rank {
                neff += &decl("input", name, &tensor.dtype().to_string(), tensor.shape());
            }
        }
        neff + &decl("output", "output", "f32", &[t, h])
    }

    /// A backend on the fake whose manifest registers this case's stand-in NEFF, in a fresh
    /// folder `name`.
    fn backend(
        &self,
        name: &str,
        tensors: &[(&'static str, Tensor)],
        params: &MoeTkgParams,
    ) -> NeuronBackend {
        let neff = self.neff(tensors, params);
        backend_with(
            &workdir(name),
            &[("moe_tkg.neff", neff, self.entry(params))],
        )
    }

    /// The manifest entry's keys.
    fn entry(&self, params: &MoeTkgParams) -> String {
        let [t, h, e, local, k, i] = self.sizes;
        let mut entry = format!(
            "name = \"moe_tkg\"\nt = {t}\nh = {h}\ne = {e}\ne_local = {local}\nk = {k}\ni = {i}\n\
             is_all_expert = {}\nexpert_affinities_scaling_mode = \"{}\"\nactivation_fn = \"{}\"\n\
             mask_unselected_experts = {}\nexpert_gate_up_bias = {}\nexpert_down_bias = {}\n\
             expert_affinities_eager = {}\n",
            self.all_expert,
            params.expert_affinities_scaling_mode,
            params.activation_fn,
            self.mask,
            self.biases,
            self.biases,
            self.eager
        );
        if self.clamp {
            entry += "gate_clamp_lower_limit = -0.5\ngate_clamp_upper_limit = 0.75\n\
                      up_clamp_lower_limit = -0.5\nup_clamp_upper_limit = 0.75\n";
        }
        entry
    }
}

/// A lookup of `tensors` by contract name.
fn named<'a>(tensors: &'a [(&'static str, Tensor)]) -> impl Fn(&TensorSpec) -> Option<&'a Tensor> {
    move |spec| {
        tensors
            .iter()
            .find(|(name, _)| *name == spec.name)
            .map(|(_, tensor)| tensor)
    }
}

/// `moe_tkg` runs the NEFF its manifest entry registers for the call's sizes and options, in
/// either mode: the same output as the reference; `moekit check`'s shapes read the entry back.
#[test]
fn moe_tkg_runs_its_neff_and_matches_the_reference() {
    let _guard = exclusive();
    let cases = [
        TkgCase {
            sizes: [3, 16, 6, 6, 2, 8],
            all_expert: false,
            post_scale: true,
            mask: false,
            biases: true,
            eager: false,
            clamp: true,
            bf16: false,
            rank: 0,
        },
        TkgCase {
            sizes: [2, 8, 6, 3, 2, 4],
            all_expert: true,
            post_scale: true,
            mask: true,
            biases: false,
            eager: false,
            clamp: false,
            bf16: true,
            rank: 1,
        },
        TkgCase {
            sizes: [4, 8, 5, 5, 3, 4],
            all_expert: false,
            post_scale: true,
            mask: false,
            biases: false,
            eager: true,
            clamp: false,
            bf16: false,
            rank: 0,
        },
        TkgCase {
            sizes: [1, 8, 2, 2, 1, 4],
            all_expert: true,
            post_scale: false,
            mask: false,
            biases: true,
            eager: false,
            clamp: true,
            bf16: false,
            rank: 0,
        },
    ];
    let reference = BackendKind::Reference.create();
    for (n, case) in cases.iter().enumerate() {
        let (tensors, params) = case.tensors(n as u64);
        let neuron = case.backend(&format!("moe_tkg_{n}"), &tensors, &params);
        assert!(neuron.supports(Kernel::MoeTkg).unwrap());
        let call = MoeTkg::new(MoeTkgInputs::from_named(named(&tensors)).unwrap(), params)
            .unwrap()
            .with_output_dtype(OutputDType::Float32);
        let got = neuron.moe_tkg(&call).unwrap().output;
        let want = reference.moe_tkg(&call).unwrap().output;
        let expected = f32s(&want);
        assert_close(
            "output",
            &f32s(&got),
            &expected,
            1e-5,
            1e-5 * scale(&expected),
        )
        .unwrap();
        let timed = neuron.time_repeated(KernelCall::MoeTkg(&call), 2).unwrap();
        assert!(timed.is_some());

        let [t, h, e, local, k, i] = case.sizes;
        if local < e {
            // `moekit check` feeds NEFFs whole layers: a shard of the experts it cannot.
            let err = neuron.fixed_shapes().unwrap_err().to_string();
            assert!(err.contains("e_local is not e = 6"), "{err}");
            continue;
        }
        let shapes = neuron.fixed_shapes().unwrap().unwrap().shapes;
        assert_eq!(shapes[0].kernel, Kernel::MoeTkg);
        assert_eq!((shapes[0].sizes.t, shapes[0].sizes.h), (t, h));
        assert_eq!(
            (shapes[0].sizes.e, shapes[0].sizes.k, shapes[0].sizes.i),
            (e, k, i)
        );
        assert_eq!(shapes[0].params.is_all_expert, Some(case.all_expert));
        assert_eq!(
            shapes[0].params.scaling_mode,
            Some(params.expert_affinities_scaling_mode)
        );
    }
    // A call whose options the entry does not register is an error naming the manifest.
    let case = &cases[0];
    let (tensors, params) = case.tensors(9);
    let neuron = case.backend("moe_tkg_no_entry", &tensors, &params);
    let other = MoeTkgParams {
        activation_fn: ActFnType::Silu,
        ..params
    };
    let call = MoeTkg::new(MoeTkgInputs::from_named(named(&tensors)).unwrap(), other).unwrap();
    let err = neuron.moe_tkg(&call).unwrap_err().to_string();
    assert!(
        err.contains("kernels.toml") && err.contains("activation_fn"),
        "{err}"
    );
}

/// One `rmsnorm_router_topk_tkg` call for the fake runtime.
struct FusedRouterCase {
    /// T, H, E, K.
    sizes: [usize; 4],
    /// `hidden_states [B, S, H]` with this B, else `[T, H]`.
    batch: Option<usize>,
    /// `router_mm_dtype = bfloat16` (bf16 weights and inputs).
    bf16: bool,
    softmax: bool,
    eager: bool,
    bias: bool,
    /// `eps` and `hidden_actual` other than their defaults.
    custom_norm: bool,
}

impl FusedRouterCase {
    fn tensors(&self, seed: u64) -> (Vec<(&'static str, Tensor)>, RmsNormRouterTopkTkgParams) {
        let [t, h, e, k] = self.sizes;
        let mut rng = SeededRng::new(seed);
        let float =
            |shape: &[usize], values: Vec<f64>| maybe_bf16(f32_tensor(shape, &values), self.bf16);
        let hidden_shape = match self.batch {
            Some(b) => vec![b, t / b, h],
            None => vec![t, h],
        };
        let mut tensors = vec![
            (
                "hidden_states",
                float(&hidden_shape, rng.values(t * h, 2.0)),
            ),
            ("gamma", float(&[1, h], rng.values(h, 1.5))),
            ("router_weights", float(&[h, e], rng.values(h * e, 1.0))),
        ];
        if self.bias {
            tensors.push(("router_bias", float(&[1, e], rng.values(e, 1.0))));
        }
        let default = RmsNormRouterTopkTkgParams::default();
        let params = RmsNormRouterTopkTkgParams {
            top_k: k,
            shared: RmsNormRouterParams {
                eps: if self.custom_norm {
                    0.25
                } else {
                    default.shared.eps
                },
                hidden_actual: self.custom_norm.then_some(h - 3),
                router_mm_dtype: if self.bf16 {
                    RouterMmDType::BFLOAT16
                } else {
                    RouterMmDType::FLOAT32
                },
                router_act_fn: if self.softmax {
                    RouterActFnType::Softmax
                } else {
                    RouterActFnType::Sigmoid
                },
                store_eager_affi_only: self.eager,
            },
            ..default
        };
        (tensors, params)
    }

    /// The stand-in NEFF and its manifest entry; the entry leaves out what it leaves at
    /// nki-library's defaults.
    fn neff_and_entry(
        &self,
        tensors: &[(&'static str, Tensor)],
        params: &RmsNormRouterTopkTkgParams,
    ) -> (String, String) {
        let [t, h, e, k] = self.sizes;
        let shared = params.shared;
        let mut neff = format!(
            "moekit-fake-neff 1\nkernel rmsnorm_router_topk_tkg\nparam router_act_fn {}\n\
             param store_eager_affi_only {}\n",
            shared.router_act_fn,
            u8::from(self.eager)
        );
        let mut entry = format!(
            "name = \"rmsnorm_router_topk_tkg\"\nt = {t}\nh = {h}\ne = {e}\ntop_k = {k}\n\
             router_bias = {}\n",
            self.bias
        );
        if self.softmax {
            entry += "router_act_fn = \"SOFTMAX\"\n";
        }
        if self.eager {
            entry += "store_eager_affi_only = true\n";
        }
        if !self.bf16 {
            entry += "router_mm_dtype = \"float32\"\n";
        }
        if let Some(actual) = shared.hidden_actual {
            neff += &format!("param eps {}\nparam hidden_actual {actual}\n", shared.eps);
            entry += &format!("eps = {}\nhidden_actual = {actual}\n", shared.eps);
        }
        for (name, tensor) in tensors {
            neff += &decl("input", name, &tensor.dtype().to_string(), tensor.shape());
        }
        let dtype = if self.bf16 { "bf16" } else { "f32" };
        neff += &decl("output", "norm_output", dtype, &[t, h]);
        neff += &decl("output", "expert_index", "i32", &[t, k]);
        let width = if self.eager { k } else { e };
        neff += &decl("output", "expert_affinities", "bf16", &[t, width]);
        (neff, entry)
    }
}

/// `rmsnorm_router_topk_tkg` runs the NEFF its manifest entry registers for the call's sizes
/// and options: the reference's outputs; `moekit check`'s shapes read the entry back, and an
/// entry that leaves a parameter out runs only calls with nki-library's default.
#[test]
fn rmsnorm_router_topk_tkg_runs_its_neff_and_matches_the_reference() {
    let _guard = exclusive();
    let cases = [
        FusedRouterCase {
            sizes: [4, 16, 6, 2],
            batch: None,
            bf16: false,
            softmax: true,
            eager: false,
            bias: true,
            custom_norm: false,
        },
        FusedRouterCase {
            sizes: [6, 24, 13, 4],
            batch: Some(2),
            bf16: true,
            softmax: false,
            eager: true,
            bias: false,
            custom_norm: true,
        },
        FusedRouterCase {
            sizes: [1, 8, 3, 3],
            batch: None,
            bf16: false,
            softmax: false,
            eager: false,
            bias: false,
            custom_norm: true,
        },
    ];
    let reference = BackendKind::Reference.create();
    for (n, case) in cases.iter().enumerate() {
        let (tensors, params) = case.tensors(n as u64);
        let (neff, entry) = case.neff_and_entry(&tensors, &params);
        let name = format!("rmsnorm_router_topk_tkg_{n}");
        let neuron = backend_with(&workdir(&name), &[("fused.neff", neff, entry)]);
        assert!(neuron.supports(Kernel::RmsNormRouterTopkTkg).unwrap());
        let inputs = RmsNormRouterTopkTkgInputs::from_named(named(&tensors)).unwrap();
        let call = RmsNormRouterTopkTkg::new(inputs, params)
            .unwrap()
            .with_output_dtype(OutputDType::Float32);
        let got = neuron.rmsnorm_router_topk_tkg(&call).unwrap();
        let want = reference.rmsnorm_router_topk_tkg(&call).unwrap();
        assert_eq!(got.expert_index, want.expert_index, "case {n}");
        // The fake writes norm_output in router_mm_dtype, as nki-library's kernel does.
        let norm = f32s(&want.norm_output);
        let tol = if case.bf16 { 4e-3 } else { 1e-6 };
        assert_close("norm_output", &f32s(&got.norm_output), &norm, tol, tol).unwrap();
        // The fake writes bf16 affinities, as nki-library's kernel does.
        let affinities = f32s(&want.expert_affinities);
        assert_close(
            "expert_affinities",
            &f32s(&got.expert_affinities),
            &affinities,
            1e-2,
            1e-2,
        )
        .unwrap();
        let timed = neuron
            .time_repeated(KernelCall::RmsNormRouterTopkTkg(&call), 2)
            .unwrap();
        assert!(timed.is_some());

        let shapes = neuron.fixed_shapes().unwrap().unwrap().shapes;
        let [t, h, e, k] = case.sizes;
        assert_eq!(shapes[0].kernel, Kernel::RmsNormRouterTopkTkg);
        let sizes = shapes[0].sizes;
        assert_eq!((sizes.t, sizes.h, sizes.e, sizes.k), (t, h, e, k));
        assert_eq!(shapes[0].params.rmsnorm_router(), params.shared, "case {n}");
        // H not a multiple of 128, T not of 128: nki-library's limits, named.
        assert!(shapes[0].warnings.iter().any(|w| w.contains("`h`")));
    }
    // The first entry leaves eps, hidden_actual, store_eager_affi_only out: compiled with the
    // defaults, so a call with another eps finds no NEFF.
    let case = &cases[0];
    let (tensors, params) = case.tensors(9);
    let (neff, entry) = case.neff_and_entry(&tensors, &params);
    let neuron = backend_with(
        &workdir("rmsnorm_router_topk_tkg_no_entry"),
        &[("fused.neff", neff, entry)],
    );
    let mut other = params;
    other.shared.eps = 1e-5;
    let inputs = RmsNormRouterTopkTkgInputs::from_named(named(&tensors)).unwrap();
    let call = RmsNormRouterTopkTkg::new(inputs, other).unwrap();
    let err = neuron
        .rmsnorm_router_topk_tkg(&call)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("kernels.toml") && err.contains("eps=0.00001"),
        "{err}"
    );
    // moekit's own backward has no NEFF: the backend says so.
    assert!(!neuron.supports(Kernel::RmsNormRouterTopkTkgBwd).unwrap());
}

/// One `moe_block_tkg` option set for the fake runtime.
struct BlockCase {
    /// T, H, E, E_L, I, K.
    sizes: [usize; 6],
    /// `inp [B, S, H]` with this B, else `[T, H]`.
    batch: Option<usize>,
    /// Every float tensor bf16 (and `router_mm_dtype = bfloat16`).
    bf16: bool,
    params: MoeBlockTkgParams,
    /// The router and expert biases.
    biases: bool,
    /// All-expert mode's shard.
    rank: usize,
}

impl BlockCase {
    fn tensors(&self, seed: u64) -> Vec<(&'static str, Tensor)> {
        let [t, h, e, local, i, _] = self.sizes;
        let mut rng = SeededRng::new(seed);
        let mut float = |shape: &[usize], scale: f64| {
            let n = shape.iter().product();
            maybe_bf16(f32_tensor(shape, &rng.values(n, scale)), self.bf16)
        };
        let inp_shape = match self.batch {
            Some(b) => vec![b, t / b, h],
            None => vec![t, h],
        };
        let mut tensors = vec![
            ("inp", float(&inp_shape, 2.0)),
            ("gamma", float(&[1, h], 1.5)),
            ("router_weights", float(&[h, e], 1.0)),
            ("expert_gate_up_weights", float(&[local, h, 2, i], 0.5)),
            ("expert_down_weights", float(&[local, i, h], 0.5)),
        ];
        if self.biases {
            tensors.push(("router_bias", float(&[1, e], 1.0)));
            tensors.push(("expert_gate_up_bias", float(&[local, 2, i], 0.5)));
            tensors.push(("expert_down_bias", float(&[local, h], 0.5)));
        }
        if self.params.is_all_expert {
            let rank = Tensor::from_i32([1, 1], vec![self.rank as i32]).unwrap();
            tensors.push(("rank_id", rank));
        }
        tensors
    }

    /// The stand-in NEFF and its manifest entry; the entry leaves out what is at
    /// nki-library's defaults.
    fn neff_and_entry(&self, tensors: &[(&'static str, Tensor)]) -> (String, String) {
        let [t, h, e, local, i, k] = self.sizes;
        let p = self.params;
        let default = MoeBlockTkgParams::default();
        let mut neff = format!(
            "moekit-fake-neff 1\nkernel moe_block_tkg\nparam top_k {k}\nparam router_act_fn {}\n\
             param router_pre_norm {}\nparam norm_topk_prob {}\n\
             param expert_affinities_scaling_mode {}\nparam hidden_act_fn {}\nparam is_all_expert {}\n\
             param eps {}\n",
            p.router_act_fn,
            u8::from(p.router_pre_norm),
            u8::from(p.norm_topk_prob),
            p.expert_affinities_scaling_mode,
            p.hidden_act_fn,
            u8::from(p.is_all_expert),
            p.eps,
        );
        let mut entry = format!(
            "name = \"moe_block_tkg\"\nt = {t}\nh = {h}\ne = {e}\ne_local = {local}\ni = {i}\n\
             top_k = {k}\nrouter_bias = {b}\nexpert_gate_up_bias = {b}\nexpert_down_bias = {b}\n",
            b = self.biases
        );
        let mut set = |key: &str, value: String, is_default: bool| {
            if !is_default {
                entry += &format!("{key} = {value}\n");
            }
        };
        let quoted = |v: &dyn std::fmt::Display| format!("\"{v}\"");
        set("eps", p.eps.to_string(), p.eps == default.eps);
        set(
            "router_act_fn",
            quoted(&p.router_act_fn),
            p.router_act_fn == default.router_act_fn,
        );
        set(
            "router_pre_norm",
            p.router_pre_norm.to_string(),
            p.router_pre_norm == default.router_pre_norm,
        );
        set(
            "norm_topk_prob",
            p.norm_topk_prob.to_string(),
            p.norm_topk_prob == default.norm_topk_prob,
        );
        set(
            "expert_affinities_scaling_mode",
            quoted(&p.expert_affinities_scaling_mode),
            p.expert_affinities_scaling_mode == default.expert_affinities_scaling_mode,
        );
        set(
            "hidden_act_fn",
            quoted(&p.hidden_act_fn),
            p.hidden_act_fn == default.hidden_act_fn,
        );
        set(
            "is_all_expert",
            p.is_all_expert.to_string(),
            p.is_all_expert == default.is_all_expert,
        );
        set(
            "skip_router_logits",
            p.skip_router_logits.to_string(),
            p.skip_router_logits == default.skip_router_logits,
        );
        set(
            "router_mm_dtype",
            quoted(&p.router_mm_dtype),
            p.router_mm_dtype == default.router_mm_dtype,
        );
        if let Some(actual) = p.hidden_actual {
            neff += &format!("param hidden_actual {actual}\n");
            entry += &format!("hidden_actual = {actual}\n");
        }
        for (name, tensor) in tensors {
            if *name == "rank_id" && !p.is_all_expert {
                continue;
            }
            neff += &decl("input", name, &tensor.dtype().to_string(), tensor.shape());
        }
        let dtype = if self.bf16 { "bf16" } else { "f32" };
        neff += &decl("output", "out", dtype, &[t, h]);
        if !p.skip_router_logits {
            neff += &decl("output", "router_logits", dtype, &[t, e]);
        }
        (neff, entry)
    }
}

/// `moe_block_tkg` runs the NEFF its manifest entry registers for the call's sizes and
/// options: the reference's outputs; `moekit check`'s shapes read the entry back (every expert
/// held), and an entry that leaves a parameter out runs only calls with nki-library's default.
#[test]
fn moe_block_tkg_runs_its_neff_and_matches_the_reference() {
    let _guard = exclusive();
    let default = MoeBlockTkgParams::default();
    let cases = [
        // Qwen3-MoE's router (SOFTMAX, renormalised), POST_SCALE, biases, f32 operands.
        BlockCase {
            sizes: [4, 16, 6, 6, 8, 2],
            batch: None,
            bf16: false,
            params: MoeBlockTkgParams {
                top_k: 2,
                router_act_fn: RouterActFnType::Softmax,
                norm_topk_prob: true,
                expert_affinities_scaling_mode: ExpertAffinityScaleMode::PostScale,
                router_mm_dtype: RouterMmDType::FLOAT32,
                ..default
            },
            biases: true,
            rank: 0,
        },
        // nki-library's defaults (SIGMOID ACT1 dense) in all-expert mode on shard 1 of 2,
        // POST_SCALE with the unselected experts masked, GELU, bf16, no router logits.
        BlockCase {
            sizes: [6, 24, 8, 4, 5, 3],
            batch: Some(2),
            bf16: true,
            params: MoeBlockTkgParams {
                top_k: 3,
                expert_affinities_scaling_mode: ExpertAffinityScaleMode::PostScale,
                hidden_act_fn: ActFnType::Gelu,
                is_all_expert: true,
                skip_router_logits: true,
                ..default
            },
            biases: false,
            rank: 1,
        },
        // ACT2 SOFTMAX over every expert, NO_SCALE, one token, eps and hidden_actual.
        BlockCase {
            sizes: [1, 8, 3, 3, 4, 3],
            batch: None,
            bf16: false,
            params: MoeBlockTkgParams {
                top_k: 3,
                router_act_fn: RouterActFnType::Softmax,
                router_pre_norm: false,
                eps: 0.25,
                hidden_actual: Some(5),
                router_mm_dtype: RouterMmDType::FLOAT32,
                ..default
            },
            biases: false,
            rank: 0,
        },
    ];
    let reference = BackendKind::Reference.create();
    for (n, case) in cases.iter().enumerate() {
        let tensors = case.tensors(n as u64);
        let (neff, entry) = case.neff_and_entry(&tensors);
        let name = format!("moe_block_tkg_{n}");
        let neuron = backend_with(&workdir(&name), &[("block.neff", neff, entry)]);
        assert!(neuron.supports(Kernel::MoeBlockTkg).unwrap());
        let inputs = MoeBlockTkgInputs::from_named(named(&tensors)).unwrap();
        let call = MoeBlockTkg::new(inputs, case.params)
            .unwrap()
            .with_output_dtype(OutputDType::Float32);
        let got = neuron.moe_block_tkg(&call).unwrap();
        let want = reference.moe_block_tkg(&call).unwrap();
        let tol = if case.bf16 { 1e-2 } else { 1e-5 };
        let out = f32s(&want.out);
        assert_close("out", &f32s(&got.out), &out, tol, tol * scale(&out)).unwrap();
        assert_eq!(got.router_logits.is_none(), case.params.skip_router_logits);
        if let (Some(got), Some(want)) = (&got.router_logits, &want.router_logits) {
            let want = f32s(want);
            assert_close("router_logits", &f32s(got), &want, tol, tol * scale(&want)).unwrap();
        }
        let timed = neuron
            .time_repeated(KernelCall::MoeBlockTkg(&call), 2)
            .unwrap();
        assert!(timed.is_some());

        // `moekit check` holds every expert: an all-expert shard is named as the reason.
        let [t, h, e, local, i, k] = case.sizes;
        if local != e {
            let err = neuron.fixed_shapes().unwrap_err().to_string();
            assert!(err.contains("every expert held"), "{err}");
            continue;
        }
        let shapes = neuron.fixed_shapes().unwrap().unwrap().shapes;
        assert_eq!(shapes[0].kernel, Kernel::MoeBlockTkg);
        let sizes = shapes[0].sizes;
        assert_eq!(
            (sizes.t, sizes.h, sizes.e, sizes.i, sizes.k),
            (t, h, e, i, k)
        );
        assert_eq!(shapes[0].params.moe_block(), case.params, "case {n}");
        assert!(shapes[0].warnings.iter().any(|w| w.contains("`h`")));
    }
    // The first entry leaves skip_router_logits and is_all_expert out: compiled with the
    // defaults, so a call without the router logits finds no NEFF.
    let case = &cases[0];
    let tensors = case.tensors(9);
    let (neff, entry) = case.neff_and_entry(&tensors);
    let neuron = backend_with(
        &workdir("moe_block_tkg_no_entry"),
        &[("block.neff", neff, entry)],
    );
    let inputs = MoeBlockTkgInputs::from_named(named(&tensors)).unwrap();
    let other = MoeBlockTkgParams {
        skip_router_logits: true,
        ..case.params
    };
    let call = MoeBlockTkg::new(inputs, other).unwrap();
    let err = neuron.moe_block_tkg(&call).unwrap_err().to_string();
    assert!(
        err.contains("kernels.toml") && err.contains("skip_router_logits=true"),
        "{err}"
    );
}

/// The stand-in NEFF of a `topk` call on `inp` (values in `inp`'s dtype, as nki-library writes
/// them), and its manifest entry (`method` left out: compiled with ROTATIONAL).
fn topk_neff_and_entry(inp: &Tensor, params: TopkParams) -> (String, String) {
    let shape = inp.shape();
    let (v, rows) = (
        shape[shape.len() - 1],
        shape[..shape.len() - 1].iter().product::<usize>(),
    );
    let mut out = shape.to_vec();
    out[shape.len() - 1] = params.k;
    let dtype = inp.dtype().to_string();
    let neff = format!(
        "moekit-fake-neff 1\nkernel topk\nparam sorted_flag {}\n",
        u8::from(params.sorted_flag)
    ) + &decl("input", "inp", &dtype, shape)
        + &decl("output", "topk_values", &dtype, &out)
        + &decl("output", "topk_indices", "i32", &out);
    let entry = format!(
        "name = \"topk\"\nrows = {rows}\nv = {v}\nk = {}\nsorted_flag = {}\n",
        params.k, params.sorted_flag
    );
    (neff, entry)
}

/// `topk_reduce`'s `input [rows, H+2]` bf16: row r holds `values[r]` and carries `ids[r]`.
fn exchanged(ids: &[i32], values: &[f64], h: usize) -> Tensor {
    let mut data = Vec::with_capacity(ids.len() * (h + 2));
    for (row, &id) in ids.iter().enumerate() {
        data.extend(
            values[row * h..(row + 1) * h]
                .iter()
                .map(|&v| bf16::from_f64(v)),
        );
        data.extend(token_id_columns(id));
    }
    Tensor::from_bf16([ids.len(), h + 2], data).unwrap()
}

/// The stand-in NEFF of a `topk_reduce` call and its manifest entry (`token_base_index` left
/// out where it is nki-library's default, 1).
fn topk_reduce_neff_and_entry(
    rows: usize,
    h: usize,
    params: TopkReduceParams,
    output_dtype: &str,
) -> (String, String) {
    let TopkReduceParams {
        t,
        k,
        token_base_index: base,
    } = params;
    let neff = format!(
        "moekit-fake-neff 1\nkernel topk_reduce\nparam K {k}\nparam token_base_index {base}\n"
    ) + &decl("input", "input", "bf16", &[rows, h + 2])
        + &decl("output", "output", output_dtype, &[t, h]);
    let mut entry =
        format!("name = \"topk_reduce\"\nt = {t}\nh = {h}\nk = {k}\ntk_padded = {rows}\n");
    if base != TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX {
        entry += &format!("token_base_index = {base}\n");
    }
    (neff, entry)
}

/// A tensor of `shape` from `values` in dtype 0 (f32), 1 (bf16) or 2 (i32, the values times 4
/// truncated).
fn any_dtype(shape: &[usize], values: &[f64], dtype: usize) -> Tensor {
    match dtype {
        0 => f32_tensor(shape, values),
        1 => f32_tensor(shape, values).to_bf16(),
        _ => i32_tensor(
            shape,
            &values.iter().map(|&v| (v * 4.0) as i32).collect::<Vec<_>>(),
        ),
    }
}

proptest! {
    #![proptest_config(config(24))]

    /// `topk` runs its NEFF: the reference's values (copied, in `inp`'s dtype) and positions,
    /// exactly, ties (frequent with coarse values) going by position on both sides.
    #[test]
    fn topk_on_the_fake_runtime_matches_the_reference(
        leading in prop::collection::vec(1usize..4, 1..3),
        (v, pick) in (1usize..40, any::<usize>()),
        (sorted_flag, bf16_inp, coarse) in any::<(bool, bool, bool)>(),
        seed in any::<u64>(),
    ) {
        let _guard = exclusive();
        let k = 1 + pick % v;
        let mut rng = SeededRng::new(seed);
        let mut shape = leading;
        shape.push(v);
        let values: Vec<f64> = rng
            .values(shape.iter().product(), 2.0)
            .into_iter()
            .map(|x| if coarse { (x * 4.0).floor() / 4.0 } else { x })
            .collect();
        let inp = maybe_bf16(f32_tensor(&shape, &values), bf16_inp);
        let params = TopkParams { sorted_flag, ..TopkParams::new(k) };
        let (neff, entry) = topk_neff_and_entry(&inp, params);
        let backend = backend_with(&workdir("topk"), &[("topk.neff", neff, entry)]);
        let call = Topk::new(TopkInputs { inp: &inp }, params).unwrap();
        let want = BackendKind::Reference.create().topk(&call).unwrap();
        prop_assert_eq!(backend.topk(&call).unwrap(), want);
        prop_assert!(backend.time_repeated(KernelCall::Topk(&call), 2).unwrap().is_some());
    }

    /// `topk_reduce` runs its NEFF: each token's first K rows by its id from `token_base_index`
    /// (1 to K+1 rows a token, padding and other tokens' rows shuffled in), summed as the
    /// reference sums them.
    #[test]
    fn topk_reduce_on_the_fake_runtime_matches_the_reference(
        (t, h, k) in (1usize..6, 1usize..8, 1usize..4),
        (base, extra) in (prop::sample::select(vec![0, 1, 1000]), 0usize..6),
        bf16_output in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let _guard = exclusive();
        let mut rng = SeededRng::new(seed);
        let mut ids = Vec::new();
        for token in 0..t {
            let rows = 1 + rng.below(k + 1);
            ids.extend(std::iter::repeat_n(base + token as i32, rows));
        }
        for _ in 0..extra {
            let past = base + (t + rng.below(3)) as i32;
            ids.push(if rng.below(2) == 0 { -1 } else { past });
        }
        for i in (1..ids.len()).rev() {
            let j = rng.below(i + 1);
            ids.swap(i, j);
        }
        let input = exchanged(&ids, &rng.values(ids.len() * h, 1.0), h);
        let params = TopkReduceParams { token_base_index: base, ..TopkReduceParams::new(t, k) };
        let output_dtype = if bf16_output { "bf16" } else { "f32" };
        let (neff, entry) = topk_reduce_neff_and_entry(ids.len(), h, params, output_dtype);
        let backend = backend_with(&workdir("topk_reduce"), &[("reduce.neff", neff, entry)]);
        let call = TopkReduce::new(TopkReduceInputs { input: &input }, params).unwrap();
        let f32_call = call.clone().with_output_dtype(OutputDType::Float32);
        let got = backend.topk_reduce(&f32_call).unwrap();
        let want = BackendKind::Reference.create().topk_reduce(&f32_call).unwrap();
        // A bf16 NEFF output is rounded once to bf16 (2⁻⁸ relative).
        let tol = if bf16_output { 4e-3 } else { 1e-6 };
        let expected = f32s(&want.output);
        assert_close("output", &f32s(&got.output), &expected, tol, tol * scale(&expected))?;
        // nki-library's dtype: input's, bf16.
        prop_assert_eq!(backend.topk_reduce(&call).unwrap().output.dtype(), DType::BF16);
        prop_assert!(backend.time_repeated(KernelCall::TopkReduce(&call), 2).unwrap().is_some());
    }

    /// `find_nonzero_indices` runs its NEFF: every column's nonzero rows and counts, exactly as
    /// the reference's, over f32, bf16 or i32 (−0 among the zeros), every column or the
    /// `n_cols` from `col_start_id`, with or without a `chunk_size` compiled in.
    #[test]
    fn find_nonzero_indices_on_the_fake_runtime_matches_the_reference(
        (t, c_full, dtype) in (1usize..12, 1usize..7, 0usize..3),
        (window, chunked, picks) in (any::<bool>(), any::<bool>(), any::<(usize, usize)>()),
        seed in any::<u64>(),
    ) {
        let _guard = exclusive();
        let mut rng = SeededRng::new(seed);
        let values: Vec<f64> = rng.values(t * c_full, 2.0);
        let values: Vec<f64> = values
            .into_iter()
            .map(|x| match rng.below(4) {
                0 => 0.0,
                1 => -0.0,
                _ => x,
            })
            .collect();
        let input = any_dtype(&[t, c_full], &values, dtype);
        let n_cols = 1 + picks.0 % c_full;
        let start = i32_tensor(&[1], &[(picks.1 % (c_full - n_cols + 1)) as i32]);
        let chunk = (1..=t).filter(|d| t % d == 0).nth(picks.1 % 3).unwrap_or(t);
        let searched = if window { n_cols } else { c_full };
        let mut neff = String::from("moekit-fake-neff 1\nkernel find_nonzero_indices\n");
        let mut entry = format!("name = \"find_nonzero_indices\"\nt = {t}\nc_full = {c_full}\n");
        if chunked {
            neff += &format!("param chunk_size {chunk}\n");
        }
        neff += &decl("input", "input_tensor", &input.dtype().to_string(), &[t, c_full]);
        if window {
            neff += &decl("input", "col_start_id", "i32", &[1]);
            entry += &format!("n_cols = {n_cols}\ncol_start_id = true\n");
        }
        neff += &decl("output", "indices", "i32", &[searched, t]);
        neff += &decl("output", "nonzero_counts", "i32", &[searched]);
        let backend = backend_with(&workdir("find_nonzero"), &[("nonzero.neff", neff, entry)]);
        let call = FindNonzeroIndices::new(
            FindNonzeroIndicesInputs { input_tensor: &input, col_start_id: window.then_some(&start) },
            FindNonzeroIndicesParams {
                n_cols: window.then_some(n_cols),
                chunk_size: chunked.then_some(chunk),
            },
        ).unwrap();
        let want = BackendKind::Reference.create().find_nonzero_indices(&call).unwrap();
        prop_assert_eq!(backend.find_nonzero_indices(&call).unwrap(), want);
        let timed = backend.time_repeated(KernelCall::FindNonzeroIndices(&call), 2).unwrap();
        prop_assert!(timed.is_some());
    }

    /// `indexed_flatten` runs its NEFF: the reference's `flattened_array`, exactly and in
    /// `input_tensor`'s dtype, with offsets before, past and overlapping the output, with or
    /// without `row_offsets_start`, and nki-library's or another `padding_val`.
    #[test]
    fn indexed_flatten_on_the_fake_runtime_matches_the_reference(
        (e, blocks, f_len, out_blocks) in (1usize..5, 1usize..4, 1usize..4, 1usize..8),
        (dtype, offsets_start, padding_val) in (0usize..3, any::<bool>(), prop::sample::select(vec![-1, 0, 7])),
        seed in any::<u64>(),
    ) {
        let _guard = exclusive();
        let mut rng = SeededRng::new(seed);
        let (t, output_len) = (blocks * f_len, out_blocks * f_len);
        let input = any_dtype(&[e, t], &rng.values(e * t, 8.0), dtype);
        // Offsets from −1 to past the output; with `row_offsets_start`, E of N entries.
        let extra = if offsets_start { rng.below(3) } else { 0 };
        let first = rng.below(extra + 1);
        let offsets: Vec<i32> = (0..e + extra).map(|_| rng.below(out_blocks + 3) as i32 - 1).collect();
        let row_offsets = i32_tensor(&[e + extra], &offsets);
        let start = i32_tensor(&[1], &[first as i32]);
        let dtype_name = input.dtype().to_string();
        let mut neff = format!(
            "moekit-fake-neff 1\nkernel indexed_flatten\nparam f_len {f_len}\nparam padding_val {padding_val}\n"
        );
        neff += &decl("input", "input_tensor", &dtype_name, &[e, t]);
        neff += &decl("input", "row_offsets", "i32", &[e + extra]);
        if offsets_start {
            neff += &decl("input", "row_offsets_start", "i32", &[1]);
        }
        neff += &decl("output", "flattened_array", &dtype_name, &[output_len]);
        let mut entry = format!(
            "name = \"indexed_flatten\"\ne = {e}\nt = {t}\nn = {}\nf_len = {f_len}\n\
             output_len = {output_len}\nrow_offsets_start = {offsets_start}\n",
            e + extra
        );
        if padding_val != IndexedFlattenParams::DEFAULT_PADDING_VAL {
            entry += &format!("padding_val = {padding_val}\n");
        }
        let backend = backend_with(&workdir("indexed_flatten"), &[("flatten.neff", neff, entry)]);
        let call = IndexedFlatten::new(
            IndexedFlattenInputs {
                input_tensor: &input,
                row_offsets: &row_offsets,
                row_offsets_start: offsets_start.then_some(&start),
            },
            IndexedFlattenParams { f_len, output_len, padding_val },
        ).unwrap();
        let want = BackendKind::Reference.create().indexed_flatten(&call).unwrap();
        let got = backend.indexed_flatten(&call).unwrap();
        prop_assert_eq!(got.flattened_array.dtype(), input.dtype());
        prop_assert_eq!(got, want);
        let timed = backend.time_repeated(KernelCall::IndexedFlatten(&call), 2).unwrap();
        prop_assert!(timed.is_some());
    }
}

/// Small calls of the four plan and selection kernels, for the manifest tests below.
struct PlanKernels {
    inp: Tensor,
    /// `topk_reduce`'s input for token_base_index 0 and 1, indexed by the base.
    reduce_input: [Tensor; 2],
    affinities: Tensor,
    start: Tensor,
    lists: Tensor,
    row_offsets: Tensor,
}

impl PlanKernels {
    fn new() -> Self {
        let mut rng = SeededRng::new(3);
        Self {
            inp: f32_tensor(&[2, 5], &rng.values(10, 1.0)),
            // Tokens 1 and 0, one row each, then padding; ids from base 0 and from base 1.
            reduce_input: {
                let values = rng.values(6, 1.0);
                [0, 1].map(|base| exchanged(&[base + 1, base, -1], &values, 2))
            },
            affinities: f32_tensor(
                &[4, 3],
                &[0.5, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0],
            ),
            start: i32_tensor(&[1], &[1]),
            lists: i32_tensor(&[2, 4], &[0, 3, -1, -1, 1, -1, -1, -1]),
            row_offsets: i32_tensor(&[2], &[0, 2]),
        }
    }

    fn topk(&self, sorted_flag: bool) -> Topk<'_> {
        let params = TopkParams {
            sorted_flag,
            ..TopkParams::new(2)
        };
        Topk::new(TopkInputs { inp: &self.inp }, params).unwrap()
    }

    fn topk_reduce(&self, token_base_index: i32) -> TopkReduce<'_> {
        let params = TopkReduceParams {
            token_base_index,
            ..TopkReduceParams::new(2, 2)
        };
        TopkReduce::new(
            TopkReduceInputs {
                input: &self.reduce_input[usize::try_from(token_base_index).unwrap()],
            },
            params,
        )
        .unwrap()
    }

    fn find_nonzero_indices(&self, window: bool) -> FindNonzeroIndices<'_> {
        FindNonzeroIndices::new(
            FindNonzeroIndicesInputs {
                input_tensor: &self.affinities,
                col_start_id: window.then_some(&self.start),
            },
            FindNonzeroIndicesParams {
                n_cols: window.then_some(2),
                chunk_size: None,
            },
        )
        .unwrap()
    }

    fn indexed_flatten(&self, padding_val: i32) -> IndexedFlatten<'_> {
        IndexedFlatten::new(
            IndexedFlattenInputs {
                input_tensor: &self.lists,
                row_offsets: &self.row_offsets,
                row_offsets_start: None,
            },
            IndexedFlattenParams {
                f_len: 2,
                output_len: 8,
                padding_val,
            },
        )
        .unwrap()
    }
}

/// Each kernel's call finds the entry whose keys are its own (an entry that leaves a key out
/// was compiled with nki-library's default); a call whose parameters differ from every entry is
/// an error naming the call's keys and every entry's.
#[test]
fn plan_and_selection_kernels_run_the_entry_their_keys_select() {
    let _guard = exclusive();
    let dir = workdir("plan_kernels_keys");
    let calls = PlanKernels::new();
    let reduce = topk_reduce_neff_and_entry(3, 2, TopkReduceParams::new(2, 2), "f32");
    let nonzero = String::from("moekit-fake-neff 1\nkernel find_nonzero_indices\n")
        + &decl("input", "input_tensor", "f32", &[4, 3])
        + &decl("output", "indices", "i32", &[3, 4])
        + &decl("output", "nonzero_counts", "i32", &[3]);
    let flatten = String::from("moekit-fake-neff 1\nkernel indexed_flatten\nparam f_len 2\n")
        + &decl("input", "input_tensor", "i32", &[2, 4])
        + &decl("input", "row_offsets", "i32", &[2])
        + &decl("output", "flattened_array", "i32", &[8]);
    let (topk_neff, topk_entry) = topk_neff_and_entry(&calls.inp, TopkParams::new(2));
    // Entries that leave sorted_flag, token_base_index, col_start_id and n_cols, and
    // padding_val out: compiled with true, 1, every column and −1.
    let backend = backend_with(
        &dir,
        &[
            (
                "topk.neff",
                topk_neff,
                topk_entry.replace("sorted_flag = true\n", ""),
            ),
            ("reduce.neff", reduce.0, reduce.1),
            (
                "nonzero.neff",
                nonzero,
                "name = \"find_nonzero_indices\"\nt = 4\nc_full = 3\n".to_owned(),
            ),
            (
                "flatten.neff",
                flatten,
                "name = \"indexed_flatten\"\ne = 2\nt = 4\nf_len = 2\noutput_len = 8\n".to_owned(),
            ),
        ],
    );
    let reference = BackendKind::Reference.create();
    for kernel in [
        Kernel::Topk,
        Kernel::TopkReduce,
        Kernel::FindNonzeroIndices,
        Kernel::IndexedFlatten,
    ] {
        assert!(backend.supports(kernel).unwrap(), "{}", kernel.name());
    }
    // The defaults run...
    let call = calls.topk(true);
    assert_eq!(backend.topk(&call).unwrap(), reference.topk(&call).unwrap());
    let call = calls.topk_reduce(1);
    let (got, want) = (
        backend.topk_reduce(&call).unwrap(),
        reference.topk_reduce(&call).unwrap(),
    );
    assert_eq!(got.output, want.output);
    let call = calls.find_nonzero_indices(false);
    assert_eq!(
        backend.find_nonzero_indices(&call).unwrap(),
        reference.find_nonzero_indices(&call).unwrap()
    );
    let call = calls.indexed_flatten(-1);
    assert_eq!(
        backend.indexed_flatten(&call).unwrap(),
        reference.indexed_flatten(&call).unwrap()
    );
    // ...and other values find no entry: the error names the call's keys and the entries'.
    let expect = |err: Error, needles: &[&str]| {
        let message = err.to_string();
        assert!(matches!(err, Error::Neff { .. }), "{message}");
        for needle in needles.iter().chain(&["kernels.toml"]) {
            assert!(message.contains(needle), "`{needle}` not in: {message}");
        }
    };
    expect(
        backend.topk(&calls.topk(false)).unwrap_err(),
        &[
            "no NEFF for topk with rows=2 v=5 k=2 sorted_flag=false method=ROTATIONAL",
            "topk.neff (k=2 rows=2 v=5)",
        ],
    );
    expect(
        backend.topk_reduce(&calls.topk_reduce(0)).unwrap_err(),
        &[
            "no NEFF for topk_reduce with t=2 h=2 k=2 tk_padded=3 token_base_index=0",
            "reduce.neff (h=2 k=2 t=2 tk_padded=3)",
        ],
    );
    expect(
        backend
            .find_nonzero_indices(&calls.find_nonzero_indices(true))
            .unwrap_err(),
        &[
            "no NEFF for find_nonzero_indices with t=4 c_full=3 n_cols=2 col_start_id=true",
            "nonzero.neff (c_full=3 t=4)",
        ],
    );
    expect(
        backend
            .indexed_flatten(&calls.indexed_flatten(0))
            .unwrap_err(),
        &[
            "no NEFF for indexed_flatten with e=2 t=4 n=2 f_len=2 output_len=8 padding_val=0 \
             row_offsets_start=false",
            "flatten.neff (e=2 f_len=2 output_len=8 t=4)",
        ],
    );
    // A NEFF that writes the copied array in another dtype than input_tensor's is refused
    // before it runs.
    drop(backend);
    let float_flatten = String::from("moekit-fake-neff 1\nkernel copy\n")
        + &decl("input", "input_tensor", "i32", &[2, 4])
        + &decl("input", "row_offsets", "i32", &[2])
        + &decl("output", "flattened_array", "f32", &[8]);
    let backend = backend_with(
        &workdir("plan_kernels_copy_dtype"),
        &[(
            "flatten.neff",
            float_flatten,
            "name = \"indexed_flatten\"\n".to_owned(),
        )],
    );
    let err = backend
        .indexed_flatten(&calls.indexed_flatten(-1))
        .unwrap_err();
    assert!(matches!(err, Error::Neff { .. }), "{err}");
    let message = err.to_string();
    for needle in [
        "flatten.neff: output `flattened_array`: the NEFF produces f32",
        "i32 (the dtype of the input it copies)",
    ] {
        assert!(message.contains(needle), "`{needle}` not in: {message}");
    }
}

/// A manifest of `entries` (kernel name, then keys) on NEFF files that need not exist: what
/// `moekit check` reads for its fixed shapes.
fn shapes_of(name: &str, entries: &[&str]) -> moekit::Result<moekit::backend::FixedShapes> {
    let dir = workdir(name);
    let manifest: String = entries
        .iter()
        .enumerate()
        .map(|(n, keys)| format!("[[kernel]]\nneff = \"{n}.neff\"\nname = {keys}\n"))
        .collect();
    std::fs::write(dir.join("kernels.toml"), manifest).unwrap();
    let backend = NeuronBackend::new(NeuronConfig {
        library: Some(PathBuf::from(FAKE)),
        manifest: dir.join("kernels.toml"),
    });
    Ok(backend.fixed_shapes()?.expect("compiled shapes"))
}

/// `moekit check` runs each plan and selection kernel's entry on a layer it can build: the
/// entry's sizes and parameters read back, nki-library's limits the shapes break as warnings,
/// and an entry no check layer feeds is an error naming the key.
#[test]
fn plan_and_selection_entries_give_check_their_shapes_and_nki_librarys_limits() {
    let fixed = shapes_of(
        "plan_kernel_shapes",
        &[
            "\"topk\"\nrows = 3\nv = 20\nk = 4\nsorted_flag = false\nmethod = \"SCANNING\"",
            "\"topk_reduce\"\nt = 1\nh = 5\nk = 9\ntk_padded = 9\ntoken_base_index = 0",
            "\"find_nonzero_indices\"\nt = 12\nc_full = 3",
            "\"find_nonzero_indices\"\nt = 256\nc_full = 6\nn_cols = 4\ncol_start_id = true",
            "\"indexed_flatten\"\ne = 4\nt = 12\nf_len = 4\noutput_len = 20\npadding_val = 0",
            "\"topk_reduce\"\nt = 64\nh = 2048\nk = 8\ntk_padded = 512",
            "\"indexed_flatten\"\ne = 4\nt = 64\nn = 4\nf_len = 4\noutput_len = 256",
            "\"topk\"\nrows = 1\nv = 16777217\nk = 1",
            "\"topk_reduce\"\nt = 2\nh = 2\nk = 2\ntk_padded = 4",
        ],
    )
    .unwrap();
    let shapes = &fixed.shapes;
    let kernels: Vec<Kernel> = shapes.iter().map(|shape| shape.kernel).collect();
    assert_eq!(
        kernels,
        [
            Kernel::Topk,
            Kernel::TopkReduce,
            Kernel::FindNonzeroIndices,
            Kernel::FindNonzeroIndices,
            Kernel::IndexedFlatten,
            Kernel::TopkReduce,
            Kernel::IndexedFlatten,
            Kernel::Topk,
            Kernel::TopkReduce,
        ]
    );
    let sizes = |n: usize| {
        let s = shapes[n].sizes;
        [s.t, s.h, s.e, s.k, s.i, s.b]
    };
    // topk: the router logits [rows, v] of a layer routed to the entry's k.
    assert_eq!(sizes(0), [3, 1, 20, 4, 1, 1]);
    let params = &shapes[0].params;
    assert_eq!(
        (params.k, params.sorted_flag, params.method),
        (Some(4), Some(false), Some(TopkMethod::Scanning))
    );
    assert_eq!(shapes[7].params.sorted_flag, Some(true));
    assert_eq!(shapes[7].params.method, Some(TopkMethod::Rotational));
    // topk_reduce: T·K exchanged rows of K experts in blocks of one, the entry's base.
    assert_eq!(sizes(1), [1, 5, 9, 9, 1, 1]);
    let params = &shapes[1].params;
    assert_eq!(
        (
            params.token_count,
            params.rows_per_token,
            params.token_base_index
        ),
        (Some(1), Some(9), Some(0))
    );
    assert_eq!(shapes[5].params.token_base_index, None);
    // find_nonzero_indices: the routed affinities of c_full experts, every column or n_cols.
    assert_eq!(sizes(2), [12, 1, 3, 1, 1, 1]);
    assert_eq!(shapes[2].params.n_cols, None);
    assert_eq!(sizes(3), [256, 1, 6, 1, 1, 1]);
    assert_eq!(shapes[3].params.n_cols, Some(4));
    // indexed_flatten: e experts' token lists in blocks of f_len, the entry's output_len.
    assert_eq!(sizes(4), [12, 1, 4, 1, 1, 4]);
    let params = &shapes[4].params;
    assert_eq!(
        (params.f_len, params.output_len, params.padding_val),
        (Some(4), Some(20), Some(0))
    );

    // nki-library's limits, each named with its value; shapes within them warn of nothing.
    let warnings = |n: usize| shapes[n].warnings.join("\n");
    for (n, needles) in [
        (0, &[][..]),
        (
            1,
            &[
                "`t` = 1: nki-library's topk_reduce needs 1 < T ≤ 128 on Trainium2",
                "`k` = 9: nki-library's topk_reduce needs K ≤ 8",
                "`h` = 5: nki-library's topk_reduce needs H even",
            ][..],
        ),
        (
            2,
            &[
                "`t` = 12: nki-library's find_nonzero_indices needs T a multiple of 128",
                "`n_cols` = 3 (by default): nki-library's find_nonzero_indices needs the columns \
                 searched (n_cols, or C_full) even",
            ][..],
        ),
        (3, &[][..]),
        (
            4,
            &[
                "`output_len` = 20: nki-library's indexed_flatten needs output_len a multiple of 128",
                "`t` / `f_len` = 3: nki-library's indexed_flatten needs T / f_len (each row's \
                 blocks) a multiple of 16",
            ][..],
        ),
        (5, &[][..]),
        (6, &[][..]),
        (
            7,
            &["`v` = 16777217: nki-library's topk needs V ≤ 2^24"][..],
        ),
        (
            8,
            &["`tk_padded` = 4: nki-library's topk_reduce needs 8 ≤ TK_padded ≤ 16384"][..],
        ),
    ] {
        let text = warnings(n);
        assert_eq!(shapes[n].warnings.len(), needles.len(), "entry {n}: {text}");
        for needle in needles {
            assert!(
                text.contains(needle),
                "entry {n}: `{needle}` not in:\n{text}"
            );
        }
    }

    // Entries whose inputs no check layer builds: an error naming the entry and the key.
    for (name, entry, needle) in [
        (
            "padded_rows",
            "\"topk_reduce\"\nt = 4\nh = 2\nk = 2\ntk_padded = 16",
            "tk_padded = 16 is not t·k = 4·2",
        ),
        (
            "window_without_start",
            "\"find_nonzero_indices\"\nt = 4\nc_full = 6\nn_cols = 2",
            "`n_cols` = 2 is not c_full = 6",
        ),
        (
            "start_without_window",
            "\"find_nonzero_indices\"\nt = 4\nc_full = 6\ncol_start_id = true",
            "`check` needs `n_cols`",
        ),
        (
            "offsets_start",
            "\"indexed_flatten\"\ne = 2\nt = 4\nf_len = 2\noutput_len = 8\nrow_offsets_start = true",
            "row_offsets_start = true",
        ),
        (
            "longer_offsets",
            "\"indexed_flatten\"\ne = 2\nt = 4\nn = 3\nf_len = 2\noutput_len = 8",
            "n = 3 is not e = 2",
        ),
        (
            "no_output_len",
            "\"indexed_flatten\"\ne = 2\nt = 4\nf_len = 2",
            "`check` needs `output_len`",
        ),
    ] {
        let err = shapes_of(name, &[entry]).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, Error::Format { .. }), "{message}");
        assert!(
            message.contains("kernel entry 1") && message.contains(needle),
            "{name}: `{needle}` not in: {message}"
        );
    }
}
