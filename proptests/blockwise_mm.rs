//! `blockwise_mm` against the dense "every token through every expert, weighted by its masked
//! affinity" formulation, its checkpoints against per-slot recomputation, its backward against
//! central finite differences for every input and weight, each with every nki-library gate
//! activation (`ActFnType`), and every plan-violation error.

#![allow(clippy::needless_range_loop)] // test oracles index by expert, token and slot

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::contracts::{
    ActFnType, BlockwiseDims, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmBwdInputs,
    BlockwiseMmBwdParams, BlockwiseMmInputs, BlockwiseMmOutputs, BlockwiseMmParams, Clamp,
    ClampLimits, ComputeDType, ExpertAffinityScaleMode, OutputDType, Permute, PermuteInputs,
    PermuteParams, WeightLayout,
};
use moekit::kernel::{Kernel, Params};
use moekit::reference::ReferenceBackend;
use moekit::reference::blockwise::{
    BlockwiseOperands, ExpertOptions, blockwise_backward, blockwise_forward,
};
use moekit::{Backend, DType, Tensor};
use proptest::prelude::*;

/// A routed problem: weights, tokens and the plan `permute` made for them.
#[derive(Clone, Debug)]
struct Case {
    dims: BlockwiseDims,
    k: usize,
    bf16: bool,
    act_fn: ActFnType,
    scaling: ExpertAffinityScaleMode,
    /// `[T+1, H]`, row T zero.
    x: Vec<f64>,
    /// `[T, K]`.
    index: Vec<i32>,
    /// `[(T+1)·E]`.
    masked: Vec<f64>,
    /// `[E, H, 2, I]`.
    gate_up: Vec<f64>,
    /// `[E, I, H]`.
    down: Vec<f64>,
    positions: Vec<i32>,
    blocks: Vec<i32>,
    /// `[E, 2, I]`.
    gate_up_bias: Option<Vec<f64>>,
    /// `[E, H]`.
    down_bias: Option<Vec<f64>>,
    clamp: ClampLimits,
}

/// Sizes, routing and storage of a generated case.
#[derive(Clone, Copy, Debug)]
struct Shape {
    t: usize,
    h: usize,
    e: usize,
    i: usize,
    b: usize,
    k: usize,
    routing: Routing,
    bf16: bool,
    act_fn: ActFnType,
    scaling: ExpertAffinityScaleMode,
    /// Draw biases and clamp limits too.
    extras: bool,
}

/// Clamp limits drawn from `rng`: absent, or one of a few values, some of which move 0 (a
/// positive lower limit), the lower never above the upper.
fn draw_clamp(rng: &mut SeededRng) -> Clamp {
    let lower = [None, Some(-0.6f32), Some(0.125)][rng.below(3)];
    let upper = [None, Some(0.75f32), Some(1.5)][rng.below(3)];
    Clamp { lower, upper }
}

fn build_case(s: Shape, seed: u64) -> Case {
    let Shape {
        t,
        h,
        e,
        i,
        b,
        k,
        routing,
        bf16,
        act_fn,
        scaling,
        extras,
    } = s;
    let mut rng = SeededRng::new(seed);
    let clamp = if extras {
        ClampLimits {
            gate: draw_clamp(&mut rng),
            up: draw_clamp(&mut rng),
        }
    } else {
        ClampLimits::default()
    };
    // Values on the bf16 grid when testing bf16 inputs, so the oracle sees them exactly.
    let mut values = |n: usize, scale: f64| {
        let v = rng.values(n, scale);
        if bf16 {
            f32_tensor(&[n], &v).to_bf16().to_f64_vec()
        } else {
            v
        }
    };
    let mut x = values(t * h, 1.5);
    x.extend(vec![0.0; h]);
    let gate_up = values(e * h * 2 * i, 1.0);
    let down = values(e * i * h, 1.0);
    let gate_up_bias = extras.then(|| values(e * 2 * i, 0.5));
    let down_bias = extras.then(|| values(e * h, 0.5));
    let affinities = values(t * k, 1.0);
    let index = expert_index(&mut rng, routing, t, e, k);
    let plan = ReferenceBackend
        .permute(
            &Permute::new(
                PermuteInputs {
                    expert_index: &i32_tensor(&[t, k], &index),
                    topk_affinities: &f32_tensor(&[t, k], &affinities),
                },
                PermuteParams::new(e, b),
            )
            .unwrap(),
        )
        .unwrap();
    let blocks = plan.block_to_expert.as_i32().unwrap().to_vec();
    Case {
        dims: BlockwiseDims {
            t,
            rows: t + 1,
            h,
            e,
            i,
            b,
            n: blocks.len(),
        },
        k,
        bf16,
        act_fn,
        scaling,
        x,
        index,
        masked: f32s(&plan.expert_affinities_masked),
        gate_up,
        down,
        positions: plan.token_position_to_id.as_i32().unwrap().to_vec(),
        blocks,
        gate_up_bias,
        down_bias,
        clamp,
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..8, 1usize..10, 1usize..6, 1usize..8, 1usize..12),
        routing(),
        any::<bool>(),
        (
            any::<u64>(),
            0..ActFnType::ALL.len(),
            0..ExpertAffinityScaleMode::ALL.len(),
            any::<bool>(),
        ),
    )
        .prop_flat_map(|(dims, routing, bf16, seed)| {
            (Just((dims, routing, bf16, seed)), 1..=dims.2)
        })
        .prop_map(
            |(((t, h, e, i, b), routing, bf16, (seed, act_fn, scaling, extras)), k)| {
                build_case(
                    Shape {
                        t,
                        h,
                        e,
                        i,
                        b,
                        k,
                        routing,
                        bf16,
                        act_fn: ActFnType::ALL[act_fn],
                        scaling: ExpertAffinityScaleMode::ALL[scaling],
                        extras,
                    },
                    seed,
                )
            },
        )
}

/// The case's float inputs as tensors (bf16 when the case says so) and its plan.
struct Tensors {
    x: Tensor,
    masked: Tensor,
    gate_up: Tensor,
    down: Tensor,
    /// moekit's `up_proj_weight`, when the gate and up weights lie apart.
    up: Option<Tensor>,
    positions: Tensor,
    blocks: Tensor,
    gate_up_bias: Option<Tensor>,
    down_bias: Option<Tensor>,
    act_fn: ActFnType,
    scaling: ExpertAffinityScaleMode,
    clamp: ClampLimits,
    weight_layout: WeightLayout,
    /// `compute_dtype` (`None`: the default, `hidden_states`' dtype).
    compute_dtype: Option<ComputeDType>,
}

impl Tensors {
    fn new(c: &Case) -> Self {
        let BlockwiseDims { t, h, e, i, .. } = c.dims;
        let float = |shape: &[usize], v: &[f64]| {
            let t = f32_tensor(shape, v);
            if c.bf16 { t.to_bf16() } else { t }
        };
        Self {
            x: float(&[t + 1, h], &c.x),
            masked: float(&[(t + 1) * e, 1], &c.masked),
            gate_up: float(&[e, h, 2, i], &c.gate_up),
            down: float(&[e, i, h], &c.down),
            up: None,
            positions: i32_tensor(&[c.positions.len()], &c.positions),
            blocks: i32_tensor(&[c.blocks.len(), 1], &c.blocks),
            gate_up_bias: c.gate_up_bias.as_ref().map(|b| float(&[e, 2, i], b)),
            down_bias: c.down_bias.as_ref().map(|b| float(&[e, h], b)),
            act_fn: c.act_fn,
            scaling: c.scaling,
            clamp: c.clamp,
            weight_layout: WeightLayout::Nki,
            compute_dtype: None,
        }
    }

    fn inputs(&self) -> BlockwiseMmInputs<'_> {
        BlockwiseMmInputs {
            hidden_states: &self.x,
            expert_affinities_masked: &self.masked,
            gate_up_proj_weight: &self.gate_up,
            down_proj_weight: &self.down,
            token_position_to_id: &self.positions,
            block_to_expert: &self.blocks,
            gate_and_up_proj_bias: self.gate_up_bias.as_ref(),
            down_proj_bias: self.down_bias.as_ref(),
            up_proj_weight: self.up.as_ref(),
        }
    }

    /// The backward's parameters for these tensors' activation, scaling, clamps, biases and
    /// weight layout.
    fn backward_params(&self) -> BlockwiseMmBwdParams {
        BlockwiseMmBwdParams {
            activation_type: self.act_fn,
            expert_affinities_scaling_mode: self.scaling,
            clamp: self.clamp,
            bias: self.gate_up_bias.is_some(),
            weight_layout: self.weight_layout,
            compute_dtype: self.compute_dtype,
            ..BlockwiseMmBwdParams::default()
        }
    }

    /// Validates the inputs as a forward call would.
    fn check(&self) -> moekit::Result<()> {
        let params = BlockwiseMmParams {
            weight_layout: self.weight_layout,
            ..BlockwiseMmParams::default()
        };
        BlockwiseMm::new(self.inputs(), params).map(|_| ())
    }

    /// The forward's outputs, all f32 (`output_dtype=float32`), for comparing with f64
    /// oracles.
    fn forward(&self, checkpoint_activation: bool) -> moekit::Result<BlockwiseMmOutputs> {
        self.forward_as(checkpoint_activation, OutputDType::Float32)
    }

    fn forward_as(
        &self,
        checkpoint_activation: bool,
        output_dtype: OutputDType,
    ) -> moekit::Result<BlockwiseMmOutputs> {
        let call = BlockwiseMm::new(
            self.inputs(),
            BlockwiseMmParams {
                checkpoint_activation,
                activation_function: self.act_fn,
                expert_affinities_scaling_mode: self.scaling,
                clamp: self.clamp,
                weight_layout: self.weight_layout,
                compute_dtype: self.compute_dtype,
                ..BlockwiseMmParams::default()
            },
        )?;
        ReferenceBackend.blockwise_mm(&call.with_output_dtype(output_dtype))
    }
}

fn silu(v: f64) -> f64 {
    activate(ActFnType::Silu, v)
}

/// `v` limited to `[lower, upper]` (either may be absent).
fn clip(v: f64, limits: Clamp) -> f64 {
    let v = limits.lower.map_or(v, |lo| v.max(f64::from(lo)));
    limits.upper.map_or(v, |hi| v.min(f64::from(hi)))
}

/// Expert `e` applied to token `t` the textbook way: `(gate [I], up [I], y [H])`, gate and up
/// with their biases and clamped (as the checkpoint holds them), y with its bias.
fn expert(c: &Case, token: usize, ex: usize) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let BlockwiseDims { h, i, e, .. } = c.dims;
    // PRE_SCALE: the expert sees the token's row times its affinity.
    let scale = if c.scaling.scales_rows() {
        c.masked[token * e + ex]
    } else {
        1.0
    };
    // bf16 tokens compute in bf16 (`compute_dtype`'s default): the scaled rows and the
    // activations are rounded to bf16 where they are formed.
    let operand = |v: f64| if c.bf16 { round_bf16(v) } else { v };
    let x: Vec<f64> = c.x[token * h..(token + 1) * h]
        .iter()
        .map(|v| operand(scale * v))
        .collect();
    let w = |j: usize, which: usize, col: usize| c.gate_up[((ex * h + j) * 2 + which) * i + col];
    let bias = |which: usize, col: usize| {
        c.gate_up_bias
            .as_ref()
            .map_or(0.0, |b| b[(ex * 2 + which) * i + col])
    };
    let projection = |which: usize, col: usize, limits: Clamp| {
        let sum: f64 = (0..h).rev().map(|j| x[j] * w(j, which, col)).sum();
        clip(sum + bias(which, col), limits)
    };
    let gate: Vec<f64> = (0..i).map(|col| projection(0, col, c.clamp.gate)).collect();
    let up: Vec<f64> = (0..i).map(|col| projection(1, col, c.clamp.up)).collect();
    let y = (0..h)
        .map(|j| {
            let product: f64 = (0..i)
                .map(|r| {
                    operand(activate(c.act_fn, gate[r]) * up[r]) * c.down[(ex * i + r) * h + j]
                })
                .sum();
            product + c.down_bias.as_ref().map_or(0.0, |b| b[ex * h + j])
        })
        .collect();
    (gate, up, y)
}

impl Case {
    fn options(&self) -> ExpertOptions {
        ExpertOptions {
            act_fn: self.act_fn,
            scaling: self.scaling,
            clamp: self.clamp,
            compute_dtype: if self.bf16 { DType::BF16 } else { DType::F32 },
            ..ExpertOptions::default()
        }
    }
}

fn operands(c: &Case) -> BlockwiseOperands<'_> {
    BlockwiseOperands {
        dims: c.dims,
        hidden_states: &c.x,
        expert_affinities_masked: &c.masked,
        gate_up_proj_weight: &c.gate_up,
        down_proj_weight: &c.down,
        weight_layout: WeightLayout::Nki,
        token_position_to_id: &c.positions,
        block_to_expert: &c.blocks,
        gate_and_up_proj_bias: c.gate_up_bias.as_deref(),
        down_proj_bias: c.down_bias.as_deref(),
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn forward_matches_the_dense_formulation(c in case()) {
        check_forward(&c)?;
    }

    #[test]
    fn checkpoints_hold_pre_activation_projections_and_unscaled_down_outputs(c in case()) {
        check_checkpoints(&c)?;
    }

    #[test]
    fn backward_matches_finite_differences(c in case(), seed in any::<u64>()) {
        check_finite_differences(&c, seed)?;
    }

    #[test]
    fn kernel_backward_from_its_own_checkpoints(c in case(), seed in any::<u64>()) {
        check_kernel_backward(&c, seed)?;
    }

    #[test]
    fn linear_weights_give_the_nki_layouts_results(c in case(), seed in any::<u64>()) {
        check_linear_layout(&c, seed)?;
    }
}

/// `weight_layout=linear` (moekit's own): the same weights stored `[E, 2, I, H]` and
/// `[E, H, I]` give bit-identical outputs and checkpoints, and the same weight gradients in
/// that layout.
fn check_linear_layout(c: &Case, seed: u64) -> Result<(), TestCaseError> {
    let BlockwiseDims { t, h, e, i, .. } = c.dims;
    let sizes = (e, h, i);
    let nki = Tensors::new(c);
    let linear = Tensors {
        gate_up: relayout_gate_up(&nki.gate_up, sizes, WeightLayout::Nki, WeightLayout::Linear),
        down: relayout_down(&nki.down, sizes, WeightLayout::Nki, WeightLayout::Linear),
        weight_layout: WeightLayout::Linear,
        ..Tensors::new(c)
    };
    let forward = nki.forward(true).unwrap();
    prop_assert_eq!(&linear.forward(true).unwrap(), &forward);
    let d_out = f32_tensor(&[t + 1, h], &output_gradient(t, h, seed));
    let index = i32_tensor(&[t, c.k], &c.index);
    let backward = |tensors: &Tensors| {
        let call = BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: tensors.inputs(),
                gate_up_proj_act_checkpoint_t: forward.gate_up_activations_t.as_ref().unwrap(),
                down_proj_act_checkpoint: forward.down_activations.as_ref().unwrap(),
                output_hidden_states_grad: &d_out,
                expert_index: Some(&index),
            },
            tensors.backward_params(),
        )
        .unwrap();
        ReferenceBackend.blockwise_mm_bwd(&call).unwrap()
    };
    let want = backward(&nki);
    let mut got = backward(&linear);
    prop_assert_eq!(
        got.gate_up_proj_weight_grad.shape(),
        &WeightLayout::Linear.gate_up_dims(e, h, i)
    );
    prop_assert_eq!(
        got.down_proj_weight_grad.shape(),
        &WeightLayout::Linear.down_dims(e, h, i)
    );
    got.gate_up_proj_weight_grad = relayout_gate_up(
        &got.gate_up_proj_weight_grad,
        sizes,
        WeightLayout::Linear,
        WeightLayout::Nki,
    );
    got.down_proj_weight_grad = relayout_down(
        &got.down_proj_weight_grad,
        sizes,
        WeightLayout::Linear,
        WeightLayout::Nki,
    );
    prop_assert_eq!(got, want);
    // The gate and up weights apart (`up_proj_weight`) are the same matrices: the same
    // outputs, and the gradient stacked as under linear.
    let (gate, up) = split_gate_up(&linear.gate_up);
    let stacked = backward(&linear);
    let split = Tensors {
        gate_up: gate,
        up: Some(up),
        ..linear
    };
    prop_assert_eq!(&split.forward(true).unwrap(), &forward);
    prop_assert_eq!(backward(&split), stacked);
    // Weights in the other layout's shape are an error naming the tensor and the layout.
    let swapped = Tensors {
        weight_layout: WeightLayout::Linear,
        ..Tensors::new(c)
    };
    // (`[E, H, 2, I]` reads as `[E, 2, I, H]` only when H = I = 2.)
    if (h, i) != (2, 2) {
        let message = swapped.forward(false).unwrap_err().to_string();
        prop_assert!(
            message.contains("gate_up_proj_weight") && message.contains("[E, 2, I, H]"),
            "{}",
            message
        );
    }
    Ok(())
}

fn check_forward(c: &Case) -> Result<(), TestCaseError> {
    let BlockwiseDims { t, h, e, .. } = c.dims;
    // `[T+1, H]`: the padding row T stays zero.
    let mut dense = vec![0.0; (t + 1) * h];
    for token in 0..t {
        for ex in 0..e {
            // Only the experts the token chose; POST_SCALE weights them by the affinity.
            if !c.index[token * c.k..(token + 1) * c.k].contains(&(ex as i32)) {
                continue;
            }
            let weight = if c.scaling.scales_outputs() {
                c.masked[token * e + ex]
            } else {
                1.0
            };
            let (_, _, y) = expert(c, token, ex);
            for j in 0..h {
                dense[token * h + j] += weight * y[j];
            }
        }
    }
    // Row T: each padding slot's expert output on the zero row (non-zero with a bias or a
    // clamp that moves 0), weighted by row T's zero affinity under POST_SCALE.
    for (position, &token) in c.positions.iter().enumerate() {
        if token as usize == t && !c.scaling.scales_outputs() {
            let (_, _, y) = expert(c, t, c.blocks[position / c.dims.b] as usize);
            for j in 0..h {
                dense[t * h + j] += y[j];
            }
        }
    }
    let out = Tensors::new(c).forward(false).unwrap();
    prop_assert!(out.gate_up_activations_t.is_none() && out.down_activations.is_none());
    if c.bf16 {
        // bf16 storage gives exactly the result of f32 storage holding the same values,
        // computed in bf16.
        let as_f32 = Case {
            bf16: false,
            ..c.clone()
        };
        let mut stored_f32 = Tensors::new(&as_f32);
        stored_f32.compute_dtype = Some(ComputeDType::BFLOAT16);
        prop_assert_eq!(&out, &stored_f32.forward(false).unwrap());
    }
    assert_close(
        "output",
        &f32s(&out.output),
        &dense,
        1e-6,
        1e-6 * scale(&dense),
    )?;
    Ok(())
}

fn check_checkpoints(c: &Case) -> Result<(), TestCaseError> {
    let BlockwiseDims { t, h, i, b, n, .. } = c.dims;
    let tensors = Tensors::new(c);
    let out = tensors.forward(true).unwrap();
    // nki-library's dtypes: the output in hidden_states', the checkpoints in their weights'.
    let nki = tensors.forward_as(true, OutputDType::Input).unwrap();
    let in_dtype = |t: &Option<Tensor>, dtype| t.clone().unwrap().into_float_dtype("", dtype);
    prop_assert_eq!(
        Some(in_dtype(&out.gate_up_activations_t, tensors.gate_up.dtype()).unwrap()),
        nki.gate_up_activations_t
    );
    prop_assert_eq!(
        Some(in_dtype(&out.down_activations, tensors.down.dtype()).unwrap()),
        nki.down_activations
    );
    prop_assert_eq!(
        out.output
            .clone()
            .into_float_dtype("", tensors.x.dtype())
            .unwrap(),
        nki.output
    );
    let gate_up_t = f32s(out.gate_up_activations_t.as_ref().unwrap());
    let down = f32s(out.down_activations.as_ref().unwrap());
    prop_assert_eq!(
        out.gate_up_activations_t.as_ref().unwrap().shape(),
        &[n, 2, i, b]
    );
    prop_assert_eq!(out.down_activations.as_ref().unwrap().shape(), &[n, b, h]);
    let mut expected_gu = vec![0.0; n * 2 * i * b];
    let mut expected_down = vec![0.0; n * b * h];
    for block in 0..n {
        for slot in 0..b {
            // Padding slots (token T) go through their block's expert on the zero row T.
            let token = c.positions[block * b + slot] as usize;
            prop_assert!(token <= t);
            let (gate, up, y) = expert(c, token, c.blocks[block] as usize);
            for col in 0..i {
                expected_gu[((block * 2) * i + col) * b + slot] = gate[col];
                expected_gu[((block * 2 + 1) * i + col) * b + slot] = up[col];
            }
            expected_down[(block * b + slot) * h..(block * b + slot + 1) * h].copy_from_slice(&y);
        }
    }
    assert_close(
        "gate_up_activations_T",
        &gate_up_t,
        &expected_gu,
        1e-6,
        1e-6 * scale(&expected_gu),
    )?;
    assert_close(
        "down_activations",
        &down,
        &expected_down,
        1e-6,
        1e-6 * scale(&expected_down),
    )?;
    Ok(())
}

/// How close any real (non-padding) slot's gate or up projection comes to a point where the
/// expert is not differentiable (a clamp limit, measured on the unclamped projection, or for
/// ReLU the clamped gate's 0), relative to `1 + the largest |projection|`: a step of size s in
/// any one input, weight, bias or (PRE_SCALE) affinity moves a projection by at most about s
/// times that. Central differences across a kink measure neither side's slope.
fn relative_distance_to_nearest_kink(c: &Case) -> f64 {
    let BlockwiseDims { t, i, b, .. } = c.dims;
    let unclamped = ExpertOptions {
        clamp: ClampLimits::default(),
        ..c.options()
    };
    // `gate_up_activations_T [N, 2, I, B]` before clamping.
    let projections = blockwise_forward(&operands(c), unclamped)
        .unwrap()
        .gate_up_activations_t;
    let limit_distance = |v: f64, limits: Clamp| {
        [limits.lower, limits.upper]
            .into_iter()
            .flatten()
            .map(|limit| (v - f64::from(limit)).abs())
            .fold(f64::INFINITY, f64::min)
    };
    let mut nearest = f64::INFINITY;
    let mut largest = 0f64;
    for (position, &token) in c.positions.iter().enumerate() {
        if token as usize == t {
            continue;
        }
        let (block, slot) = (position / b, position % b);
        for col in 0..i {
            let gate = projections[((block * 2) * i + col) * b + slot];
            let up = projections[((block * 2 + 1) * i + col) * b + slot];
            largest = largest.max(gate.abs()).max(up.abs());
            nearest = nearest
                .min(limit_distance(gate, c.clamp.gate))
                .min(limit_distance(up, c.clamp.up));
            if c.act_fn == ActFnType::Relu {
                nearest = nearest.min(clip(gate, c.clamp.gate).abs());
            }
        }
    }
    nearest / (1.0 + largest)
}

fn check_finite_differences(c: &Case, seed: u64) -> Result<(), TestCaseError> {
    let BlockwiseDims { t, h, e, .. } = c.dims;
    let d_out = output_gradient(t, h, seed);
    let ops = operands(c);
    // Rounded operands make the loss a step function: differences measure the f32 formulas.
    let c = &Case {
        bf16: false,
        ..c.clone()
    };
    let fwd = blockwise_forward(&ops, c.options()).unwrap();
    prop_assume!(relative_distance_to_nearest_kink(c) > 10.0 * FD_STEP);
    let grads = blockwise_backward(
        &ops,
        &fwd.gate_up_activations_t,
        &fwd.down_activations,
        &d_out,
        c.options(),
    )
    .unwrap();
    let loss = |ops: BlockwiseOperands<'_>| {
        dot(
            &d_out,
            &blockwise_forward(&ops, c.options()).unwrap().output,
        )
    };

    let fd_x = finite_differences(&c.x, FD_STEP, |x| {
        loss(BlockwiseOperands {
            hidden_states: x,
            ..ops
        })
    });
    assert_close(
        "hidden_states_grad",
        &grads.hidden_states_grad,
        &fd_x,
        FD_TOL,
        FD_TOL,
    )?;
    prop_assert!(
        fd_x[t * h..]
            .iter()
            .chain(&grads.hidden_states_grad[t * h..])
            .all(|&g| g == 0.0),
        "padding row must not matter"
    );
    let fd_a = finite_differences(&c.masked, FD_STEP, |a| {
        loss(BlockwiseOperands {
            expert_affinities_masked: a,
            ..ops
        })
    });
    assert_close(
        "expert_affinities_masked_grad",
        &grads.expert_affinities_masked_grad,
        &fd_a,
        FD_TOL,
        FD_TOL,
    )?;
    let fd_gu = finite_differences(&c.gate_up, FD_STEP, |w| {
        loss(BlockwiseOperands {
            gate_up_proj_weight: w,
            ..ops
        })
    });
    assert_close(
        "gate_up_proj_weight_grad",
        &grads.gate_up_proj_weight_grad,
        &fd_gu,
        FD_TOL,
        FD_TOL,
    )?;
    let fd_d = finite_differences(&c.down, FD_STEP, |w| {
        loss(BlockwiseOperands {
            down_proj_weight: w,
            ..ops
        })
    });
    assert_close(
        "down_proj_weight_grad",
        &grads.down_proj_weight_grad,
        &fd_d,
        FD_TOL,
        FD_TOL,
    )?;
    if let Some(bias) = &c.gate_up_bias {
        let fd = finite_differences(bias, FD_STEP, |b| {
            loss(BlockwiseOperands {
                gate_and_up_proj_bias: Some(b),
                ..ops
            })
        });
        let got = &grads.gate_and_up_proj_bias_grad;
        assert_close("gate_and_up_proj_bias_grad", got, &fd, FD_TOL, FD_TOL)?;
    }
    if let Some(bias) = &c.down_bias {
        let fd = finite_differences(bias, FD_STEP, |b| {
            loss(BlockwiseOperands {
                down_proj_bias: Some(b),
                ..ops
            })
        });
        let got = &grads.down_proj_bias_grad;
        assert_close("down_proj_bias_grad", got, &fd, FD_TOL, FD_TOL)?;
    }
    prop_assert!(
        grads.expert_affinities_masked_grad[t * e..]
            .iter()
            .all(|&g| g == 0.0)
    );
    // Through the scatter of permute: perturb the [T, K] affinities the plan was built from.
    let topk: Vec<f64> = gather_topk(c, &c.masked);
    let scatter = |topk: &[f64]| {
        let mut masked = vec![0.0; (t + 1) * e];
        for (pair, &id) in c.index.iter().enumerate() {
            masked[(pair / c.k) * e + id as usize] = topk[pair];
        }
        masked
    };
    let fd_topk = finite_differences(&topk, FD_STEP, |a| {
        loss(BlockwiseOperands {
            expert_affinities_masked: &scatter(a),
            ..ops
        })
    });
    assert_close(
        "d_topk_affinities",
        &gather_topk(c, &grads.expert_affinities_masked_grad),
        &fd_topk,
        FD_TOL,
        FD_TOL,
    )?;
    Ok(())
}

fn check_kernel_backward(c: &Case, seed: u64) -> Result<(), TestCaseError> {
    let BlockwiseDims { t, h, e, i, .. } = c.dims;
    let tensors = Tensors::new(c);
    let fwd = tensors.forward(true).unwrap();
    let d_out = f32_tensor(&[t + 1, h], &output_gradient(t, h, seed));
    let index = i32_tensor(&[t, c.k], &c.index);
    let call = BlockwiseMmBwd::new(
        BlockwiseMmBwdInputs {
            forward: tensors.inputs(),
            gate_up_proj_act_checkpoint_t: fwd.gate_up_activations_t.as_ref().unwrap(),
            down_proj_act_checkpoint: fwd.down_activations.as_ref().unwrap(),
            output_hidden_states_grad: &d_out,
            expert_index: Some(&index),
        },
        tensors.backward_params(),
    )
    .unwrap();
    let g = ReferenceBackend
        .blockwise_mm_bwd(&call.with_output_dtype(OutputDType::Float32))
        .unwrap();
    // nki-library's dtypes: each gradient in its input's, the bias gradients in their
    // weights', d_topk_affinities in the affinities'.
    let nki = ReferenceBackend.blockwise_mm_bwd(&call).unwrap();
    // `moekit run` binds every input by its nki-library name and returns the same gradients.
    let mut named: BTreeMap<String, Tensor> = [
        ("hidden_states", &tensors.x),
        ("expert_affinities_masked", &tensors.masked),
        ("gate_up_proj_weight", &tensors.gate_up),
        ("down_proj_weight", &tensors.down),
        ("token_position_to_id", &tensors.positions),
        ("block_to_expert", &tensors.blocks),
        (
            "gate_up_proj_act_checkpoint_T",
            fwd.gate_up_activations_t.as_ref().unwrap(),
        ),
        (
            "down_proj_act_checkpoint",
            fwd.down_activations.as_ref().unwrap(),
        ),
        ("output_hidden_states_grad", &d_out),
        ("expert_index", &index),
    ]
    .into_iter()
    .map(|(name, tensor)| (name.to_owned(), tensor.clone()))
    .collect();
    for (name, bias) in [
        ("gate_and_up_proj_bias", &tensors.gate_up_bias),
        ("down_proj_bias", &tensors.down_bias),
    ] {
        if let Some(bias) = bias {
            named.insert(name.to_owned(), bias.clone());
        }
    }
    let mut params = Params::default();
    params.set("activation_type", c.act_fn.name()).unwrap();
    params
        .set("expert_affinities_scaling_mode", c.scaling.name())
        .unwrap();
    params
        .set("bias", &c.gate_up_bias.is_some().to_string())
        .unwrap();
    for (name, limit) in [
        ("non_linear_clamp_lower_limit", c.clamp.gate.lower),
        ("non_linear_clamp_upper_limit", c.clamp.gate.upper),
        ("linear_clamp_lower_limit", c.clamp.up.lower),
        ("linear_clamp_upper_limit", c.clamp.up.upper),
    ] {
        if let Some(limit) = limit {
            params.set(name, &limit.to_string()).unwrap();
        }
    }
    let by_name = Kernel::BlockwiseMmBwd
        .run(&ReferenceBackend, &named, &params)
        .unwrap();
    let typed: Vec<(&str, Tensor)> = nki
        .clone()
        .into_named()
        .into_iter()
        .map(|(spec, t)| (spec.name, t))
        .collect();
    prop_assert_eq!(by_name, typed);
    let rounded =
        |grad: &Tensor, like: &Tensor| grad.clone().into_float_dtype("", like.dtype()).unwrap();
    prop_assert_eq!(
        &rounded(&g.hidden_states_grad, &tensors.x),
        &nki.hidden_states_grad
    );
    prop_assert_eq!(
        &rounded(&g.expert_affinities_masked_grad, &tensors.masked),
        &nki.expert_affinities_masked_grad
    );
    prop_assert_eq!(
        &rounded(&g.gate_up_proj_weight_grad, &tensors.gate_up),
        &nki.gate_up_proj_weight_grad
    );
    prop_assert_eq!(
        &rounded(&g.down_proj_weight_grad, &tensors.down),
        &nki.down_proj_weight_grad
    );
    let optional = |grad: &Option<Tensor>, like: &Tensor| grad.as_ref().map(|g| rounded(g, like));
    prop_assert_eq!(
        optional(&g.d_topk_affinities, &tensors.masked),
        nki.d_topk_affinities
    );
    prop_assert_eq!(
        optional(&g.gate_and_up_proj_bias_grad, &tensors.gate_up),
        nki.gate_and_up_proj_bias_grad
    );
    prop_assert_eq!(
        optional(&g.down_proj_bias_grad, &tensors.down),
        nki.down_proj_bias_grad
    );
    prop_assert_eq!(g.hidden_states_grad.shape(), &[t + 1, h]);
    prop_assert_eq!(g.expert_affinities_masked_grad.shape(), &[(t + 1) * e, 1]);
    prop_assert_eq!(g.gate_up_proj_weight_grad.shape(), &[e, h, 2, i]);
    prop_assert_eq!(g.down_proj_weight_grad.shape(), &[e, i, h]);

    // f64 gradients from the kernel's own f32 checkpoints: the kernel's differ only by its
    // f32 outputs (and under bf16 compute the operands round from the same values).
    let ops = operands(c);
    let exact = blockwise_backward(
        &ops,
        &f32s(fwd.gate_up_activations_t.as_ref().unwrap()),
        &f32s(fwd.down_activations.as_ref().unwrap()),
        &d_out.to_f64_vec(),
        c.options(),
    )
    .unwrap();
    for (name, got, want) in [
        (
            "hidden_states_grad",
            &g.hidden_states_grad,
            &exact.hidden_states_grad,
        ),
        (
            "expert_affinities_masked_grad",
            &g.expert_affinities_masked_grad,
            &exact.expert_affinities_masked_grad,
        ),
        (
            "gate_up_proj_weight_grad",
            &g.gate_up_proj_weight_grad,
            &exact.gate_up_proj_weight_grad,
        ),
        (
            "down_proj_weight_grad",
            &g.down_proj_weight_grad,
            &exact.down_proj_weight_grad,
        ),
    ] {
        assert_close(name, &f32s(got), want, 1e-5, 1e-5 * scale(want))?;
    }
    // The biases' gradients exactly when `bias` asks for them.
    prop_assert_eq!(
        g.gate_and_up_proj_bias_grad.is_some(),
        c.gate_up_bias.is_some()
    );
    prop_assert_eq!(g.down_proj_bias_grad.is_some(), c.down_bias.is_some());
    for (name, got, want) in [
        (
            "gate_and_up_proj_bias_grad",
            &g.gate_and_up_proj_bias_grad,
            &exact.gate_and_up_proj_bias_grad,
        ),
        (
            "down_proj_bias_grad",
            &g.down_proj_bias_grad,
            &exact.down_proj_bias_grad,
        ),
    ] {
        if let Some(got) = got {
            assert_close(name, &f32s(got), want, 1e-5, 1e-5 * scale(want))?;
        }
    }
    // d_topk_affinities: the affinity gradient of each (token, k) pair, whose finite-difference
    // check is in `check_finite_differences`.
    let d_topk = f32s(
        g.d_topk_affinities
            .as_ref()
            .expect("expert_index was given"),
    );
    let exact_topk = gather_topk(c, &exact.expert_affinities_masked_grad);
    assert_close(
        "d_topk_affinities",
        &d_topk,
        &exact_topk,
        1e-5,
        1e-5 * scale(&exact_topk),
    )?;
    Ok(())
}

/// A random `output_hidden_states_grad [T+1, H]`, its padding row T zero.
fn output_gradient(t: usize, h: usize, seed: u64) -> Vec<f64> {
    let mut d_out = SeededRng::new(seed).values(t * h, 1.0);
    d_out.extend(vec![0.0; h]);
    d_out
}

/// Entries `t·E + expert_index[t, k]` of a masked `[(T+1)·E]` tensor, as `[T, K]`.
fn gather_topk(c: &Case, masked: &[f64]) -> Vec<f64> {
    let e = c.dims.e;
    c.index
        .iter()
        .enumerate()
        .map(|(pair, &id)| masked[(pair / c.k) * e + id as usize])
        .collect()
}

/// The contract's named edge cases, each through every forward and backward check.
#[test]
fn edge_cases() {
    let shape = |t, e, k, b, routing| Shape {
        t,
        h: 3,
        e,
        i: 2,
        b,
        k,
        routing,
        bf16: false,
        act_fn: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        extras: false,
    };
    let cases = [
        ("T = 1", shape(1, 3, 2, 2, Routing::Random)),
        ("E = 1", shape(4, 1, 1, 2, Routing::Random)),
        ("K = E", shape(3, 4, 4, 2, Routing::Random)),
        (
            "experts with zero tokens",
            shape(3, 5, 1, 2, Routing::Sparse),
        ),
        (
            "all tokens on one expert",
            shape(5, 4, 1, 2, Routing::Concentrated),
        ),
        ("B = 1", shape(4, 3, 2, 1, Routing::Random)),
        ("B > T·K", shape(2, 3, 2, 7, Routing::Random)),
        (
            "H = I = 1",
            Shape {
                h: 1,
                i: 1,
                ..shape(3, 2, 1, 2, Routing::Random)
            },
        ),
        (
            "H and I beyond a SIMD width",
            Shape {
                h: 19,
                i: 11,
                ..shape(3, 3, 2, 2, Routing::Random)
            },
        ),
    ];
    for (name, shape) in cases {
        // Every activation with and without bf16, the scaling modes in turn.
        let options = [false, true]
            .into_iter()
            .flat_map(|bf16| ActFnType::ALL.map(|act_fn| (bf16, act_fn)));
        for (n, (bf16, act_fn)) in options.enumerate() {
            let scaling = ExpertAffinityScaleMode::ALL[n % ExpertAffinityScaleMode::ALL.len()];
            let extras = n % 3 == 0;
            let c = build_case(
                Shape {
                    bf16,
                    act_fn,
                    scaling,
                    extras,
                    ..shape
                },
                7,
            );
            // A projection at a kink (ReLU's 0, a clamp limit) makes the finite differences
            // meaningless: skipped then.
            let finite_differences = match check_finite_differences(&c, 11) {
                Err(TestCaseError::Reject(_)) => Ok(()),
                result => result,
            };
            let all = check_forward(&c)
                .and_then(|_| check_checkpoints(&c))
                .and(finite_differences)
                .and_then(|_| check_kernel_backward(&c, 13));
            if let Err(e) = all {
                panic!("{name} (bf16: {bf16}, {act_fn}, {scaling}, extras: {extras}): {e}");
            }
        }
    }
    // The routings really are the named edge cases.
    let counts = |c: &Case| -> Vec<usize> {
        (0..c.dims.e)
            .map(|ex| c.index.iter().filter(|&&id| id as usize == ex).count())
            .collect()
    };
    assert!(counts(&build_case(cases[3].1, 7)).contains(&0));
    assert_eq!(counts(&build_case(cases[4].1, 7))[0], 5);
}

#[test]
fn one_token_one_expert_by_hand() {
    // T = H = I = E = K = B = 1: output = a · d · silu(x·g) · (x·u).
    let (x, g, u, d, a) = (0.75f64, -0.5, 1.25, 2.0, 0.5);
    let hidden = f32_tensor(&[2, 1], &[x, 0.0]);
    let masked = f32_tensor(&[2], &[a, 0.0]);
    let gate_up = f32_tensor(&[1, 1, 2, 1], &[g, u]);
    let down = f32_tensor(&[1, 1, 1], &[d]);
    let positions = i32_tensor(&[1], &[0]);
    let blocks = i32_tensor(&[1], &[0]);
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
    let out = ReferenceBackend
        .blockwise_mm(&BlockwiseMm::new(inputs, BlockwiseMmParams::default()).unwrap())
        .unwrap();
    assert_eq!(out.output.dtype(), moekit::DType::F32, "f32 in, f32 out");
    let expected = a * d * silu(x * g) * (x * u);
    assert!((f32s(&out.output)[0] - expected).abs() < 1e-7);
}

/// A small valid problem (T = 3, H = 2, E = 3, I = 2, B = 2) to break one rule at a time.
fn valid() -> Tensors {
    // Token 0 → experts 0, 2; token 1 → expert 0; token 2 → expert 1.
    let mut masked = vec![0.0; 4 * 3];
    masked[0] = 0.6;
    masked[2] = 0.4;
    masked[3] = 1.0;
    masked[2 * 3 + 1] = 1.0;
    Tensors {
        x: f32_tensor(&[4, 2], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.0, 0.0]),
        masked: f32_tensor(&[12, 1], &masked),
        gate_up: f32_tensor(&[3, 2, 2, 2], &[0.1; 24]),
        down: f32_tensor(&[3, 2, 2], &[0.2; 12]),
        up: None,
        // Padding is T = 3; the unused block 3 goes through expert E−1 = 2.
        positions: i32_tensor(&[8], &[0, 1, 2, 3, 0, 3, 3, 3]),
        blocks: i32_tensor(&[4, 1], &[0, 1, 2, 2]),
        gate_up_bias: None,
        down_bias: None,
        act_fn: ActFnType::Silu,
        scaling: ExpertAffinityScaleMode::PostScale,
        clamp: ClampLimits::default(),
        weight_layout: WeightLayout::Nki,
        compute_dtype: None,
    }
}

fn expect_err(result: moekit::Result<()>, needles: &[&str]) {
    let message = result.expect_err("expected an error").to_string();
    for needle in needles {
        assert!(message.contains(needle), "`{message}` lacks `{needle}`");
    }
}

#[test]
fn plan_violations_are_clear_errors() {
    valid().check().unwrap();
    let with = |f: &dyn Fn(&mut Tensors)| {
        let mut v = valid();
        f(&mut v);
        v.check()
    };
    expect_err(
        with(&|v| v.x = f32_tensor(&[4, 2], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.0, 1.0])),
        &["hidden_states", "row T = 3", "padding"],
    );
    expect_err(
        with(&|v| {
            let mut m = v.masked.to_f64_vec();
            m[10] = 0.5;
            v.masked = f32_tensor(&[12], &m);
        }),
        &["expert_affinities_masked", "row T = 3"],
    );
    // E is not an expert id: unused blocks go through expert E−1.
    expect_err(
        with(&|v| v.blocks = i32_tensor(&[4, 1], &[0, 1, 2, 3])),
        &["block_to_expert", "block 3", "expert id 3", "[0, 3)"],
    );
    expect_err(
        with(&|v| v.blocks = i32_tensor(&[4, 1], &[0, 1, -2, 2])),
        &["block_to_expert", "-2"],
    );
    // Padding is T; −1 (neuronx-distributed's host convention) is not a token id.
    expect_err(
        with(&|v| v.positions = i32_tensor(&[8], &[0, 1, 2, -1, 0, 3, 3, 3])),
        &[
            "token_position_to_id",
            "position 3",
            "token id -1",
            "outside [0, 3)",
            "T = 3 is the padding row",
        ],
    );
    expect_err(
        with(&|v| v.positions = i32_tensor(&[8], &[0, 1, 2, 3, 0, 3, 4, 3])),
        &["position 6", "token id 4", "outside [0, 3)"],
    );
    expect_err(
        with(&|v| v.positions = i32_tensor(&[8], &[0, 1, 2, 3, 0, 3, 3, 0])),
        &["token 0 appears twice for expert 2", "position 7"],
    );
    expect_err(
        with(&|v| v.positions = i32_tensor(&[8], &[0, 0, 2, 3, 0, 3, 3, 3])),
        &["token 0 appears twice for expert 0"],
    );
    expect_err(
        with(&|v| v.positions = i32_tensor(&[8], &[0, 3, 2, 3, 0, 3, 3, 3])),
        &["token 1", "expert 0", "no slot"],
    );
    expect_err(
        with(&|v| v.positions = i32_tensor(&[7], &[0, 1, 2, 3, 0, 3, 3])),
        &["token_position_to_id", "[N·B]", "N = 4"],
    );
    expect_err(
        with(&|v| v.blocks = i32_tensor(&[0, 1], &[])),
        &["block_to_expert", "[N, 1]", "N ≥ 1"],
    );
    expect_err(
        with(&|v| v.blocks = i32_tensor(&[2, 2], &[0, 1, 2, 2])),
        &["block_to_expert", "[N, 1]", "[2, 2]"],
    );
    expect_err(
        with(&|v| v.blocks = f32_tensor(&[4, 1], &[0.0, 1.0, 2.0, 2.0])),
        &["block_to_expert", "i32"],
    );
    // weight_layout=linear reads `[E, 2, I, H]` and `[E, H, I]`.
    let linear = |f: &dyn Fn(&mut Tensors)| {
        with(&|v| {
            v.weight_layout = WeightLayout::Linear;
            f(v);
        })
    };
    linear(&|_| ()).unwrap();
    expect_err(
        linear(&|v| v.gate_up = f32_tensor(&[3, 2, 2, 3], &[0.1; 36])),
        &["gate_up_proj_weight", "[E, 2, I, H]", "[3, 2, 2, 3]"],
    );
    // I = 3: down_proj_weight must be [E, H, I] = [3, 2, 3], not nki's [3, 3, 2].
    let wider = |down: &[usize]| {
        let down = f32_tensor(down, &[0.2; 18]);
        linear(&move |v| {
            v.gate_up = f32_tensor(&[3, 2, 3, 2], &[0.1; 36]);
            v.down = down.clone();
        })
    };
    wider(&[3, 2, 3]).unwrap();
    expect_err(
        wider(&[3, 3, 2]),
        &["down_proj_weight", "[E, H, I]", "[3, 3, 2]"],
    );
    // up_proj_weight: the gate's `[E, I, H]` in gate_up_proj_weight, the up's apart, one
    // dtype, under weight_layout=linear only.
    let split = |gate: &[usize], up: Tensor| {
        let gate = f32_tensor(gate, &[0.1; 12]);
        linear(&move |v| {
            v.gate_up = gate.clone();
            v.up = Some(up.clone());
        })
    };
    split(&[3, 2, 2], f32_tensor(&[3, 2, 2], &[0.1; 12])).unwrap();
    expect_err(
        split(&[3, 2, 2], f32_tensor(&[3, 1, 2], &[0.1; 6])),
        &["up_proj_weight", "[E, I, H]", "[3, 1, 2]"],
    );
    expect_err(
        split(&[3, 2, 2], f32_tensor(&[3, 2, 2], &[0.1; 12]).to_bf16()),
        &["up_proj_weight", "bf16"],
    );
    expect_err(
        split(&[3, 4, 1], f32_tensor(&[3, 4, 1], &[0.1; 12])),
        &["gate_up_proj_weight", "[E, I, H]", "[3, 4, 1]"],
    );
    expect_err(
        with(&|v| {
            v.gate_up = f32_tensor(&[3, 2, 2], &[0.1; 12]);
            v.up = Some(f32_tensor(&[3, 2, 2], &[0.1; 12]));
        }),
        &["up_proj_weight", "linear", "nki"],
    );
    // nki-library's test generator makes block_to_expert [N]: accepted as well.
    with(&|v| v.blocks = i32_tensor(&[4], &[0, 1, 2, 2])).unwrap();
    // Padding-only blocks may sit anywhere (the generator's split padding puts some on
    // expert (E−1)/2, between the used blocks).
    with(&|v| {
        v.positions = i32_tensor(&[10], &[0, 1, 3, 3, 2, 3, 0, 3, 3, 3]);
        v.blocks = i32_tensor(&[5, 1], &[0, 1, 1, 2, 2]);
    })
    .unwrap();
    expect_err(
        with(&|v| v.masked = f32_tensor(&[3, 4], &[0.0; 12])),
        &["expert_affinities_masked", "[(T+1)·E]"],
    );
    expect_err(
        with(&|v| v.masked = f32_tensor(&[8], &[0.0; 8])),
        &["expert_affinities_masked", "[12]"],
    );
    expect_err(
        with(&|v| v.gate_up = f32_tensor(&[3, 2, 1, 4], &[0.1; 24])),
        &["gate_up_proj_weight", "[E, H, 2, I]"],
    );
    expect_err(
        with(&|v| v.down = f32_tensor(&[3, 2, 3], &[0.1; 18])),
        &["down_proj_weight", "[E, I, H]", "[3, 2, 2]"],
    );
    expect_err(
        with(&|v| v.down = i32_tensor(&[3, 2, 2], &[0; 12])),
        &["down_proj_weight", "f32 or bf16", "i32"],
    );
    expect_err(
        with(&|v| v.positions = f32_tensor(&[8], &[0.0; 8])),
        &["token_position_to_id", "i32"],
    );
    expect_err(
        with(&|v| {
            let mut w = v.gate_up.to_f64_vec();
            w[5] = f64::NAN;
            v.gate_up = f32_tensor(&[3, 2, 2, 2], &w);
        }),
        &["gate_up_proj_weight", "non-finite", "[0, 1, 0, 1]"],
    );
    expect_err(
        with(&|v| v.x = f32_tensor(&[1, 2], &[0.0; 2])),
        &["hidden_states", "T+1 ≥ 2"],
    );
    // The flat layout [(T+1)·E] is accepted beside NKI's [(T+1)·E, 1].
    with(&|v| v.masked = f32_tensor(&[12], &v.masked.to_f64_vec())).unwrap();
}

#[test]
fn block_size_and_schedule_parameters_as_nki_library_passes_them() {
    let v = valid();
    let tensors: BTreeMap<String, Tensor> = [
        ("hidden_states", &v.x),
        ("expert_affinities_masked", &v.masked),
        ("gate_up_proj_weight", &v.gate_up),
        ("down_proj_weight", &v.down),
        ("token_position_to_id", &v.positions),
        ("block_to_expert", &v.blocks),
    ]
    .into_iter()
    .map(|(name, tensor)| (name.to_owned(), tensor.clone()))
    .collect();
    let run = |settings: &[(&str, &str)]| {
        let mut params = Params::default();
        for (name, value) in settings {
            params.set(name, value)?;
        }
        Kernel::BlockwiseMm.run(&ReferenceBackend, &tensors, &params)
    };
    let plain = run(&[]).unwrap();
    // The plan's B, and parameters that only choose nki-library's on-chip schedule.
    let nki = [
        ("block_size", "2"),
        ("block_sharding_strategy", "PING_PONG"),
        ("skip_weight", "true"),
    ];
    assert_eq!(run(&nki).unwrap(), plain);
    // `compute_dtype`: f32 tokens compute in f32 unless told otherwise; bf16 rounds the rows
    // and activations.
    assert_eq!(run(&[("compute_dtype", "float32")]).unwrap(), plain);
    assert_ne!(run(&[("compute_dtype", "bfloat16")]).unwrap(), plain);
    for bad in ["float16", "int8"] {
        expect_err(
            run(&[("compute_dtype", bad)]).map(|_| ()),
            &["compute_dtype", "bfloat16 or float32"],
        );
    }
    // Token 0 has two slots: storing instead of adding would lose one.
    expect_err(
        run(&[("is_tensor_update_accumulating", "false")]).map(|_| ()),
        &[
            "is_tensor_update_accumulating",
            "token 0 has slots for experts 0 and 2",
        ],
    );
    expect_err(
        run(&[("skip_token", "yes")]).map(|_| ()),
        &["skip_token", "true or false"],
    );
    // SkipMode(skip_token=True): no padding row, −1 in padding slots.
    let mut skipping = tensors.clone();
    skipping.insert(
        "hidden_states".to_owned(),
        f32_tensor(&[3, 2], &v.x.to_f64_vec()[..6]),
    );
    skipping.insert(
        "expert_affinities_masked".to_owned(),
        f32_tensor(&[9, 1], &v.masked.to_f64_vec()[..9]),
    );
    let skip_run = |tensors: &BTreeMap<String, Tensor>| {
        let mut params = Params::default();
        params.set("skip_token", "true").unwrap();
        Kernel::BlockwiseMm.run(&ReferenceBackend, tensors, &params)
    };
    expect_err(
        skip_run(&skipping).map(|_| ()),
        &[
            "token_position_to_id",
            "position 3 holds token id 3",
            "−1 is padding with skip_token",
        ],
    );
    skipping.insert(
        "token_position_to_id".to_owned(),
        i32_tensor(&[8], &[0, 1, 2, -1, 0, -1, -1, -1]),
    );
    let skipped = skip_run(&skipping).unwrap();
    assert_eq!(skipped[0].0, "output");
    assert_eq!(skipped[0].1.shape(), &[3, 2]);
    assert_eq!(skipped[0].1.to_f64_vec(), plain[0].1.to_f64_vec()[..6]);
    expect_err(
        run(&[("block_size", "4")]).map(|_| ()),
        &["block_size", "is 4", "B = 2", "N = 4"],
    );
    expect_err(
        run(&[("expert_affinities_scaling_mode", "post_scale")]).map(|_| ()),
        &["expert_affinities_scaling_mode", "NO_SCALE, POST_SCALE"],
    );
}

#[test]
fn backward_rejects_bad_checkpoints_and_gradients() {
    let v = valid();
    let inputs = v.inputs();
    let gu = f32_tensor(&[4, 2, 2, 2], &[0.0; 32]);
    let down = f32_tensor(&[4, 2, 2], &[0.0; 16]);
    let grad = f32_tensor(&[4, 2], &[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
    let bwd = |gu: &Tensor, down: &Tensor, grad: &Tensor, index: Option<&Tensor>| {
        BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: inputs,
                gate_up_proj_act_checkpoint_t: gu,
                down_proj_act_checkpoint: down,
                output_hidden_states_grad: grad,
                expert_index: index,
            },
            BlockwiseMmBwdParams::default(),
        )
        .map(|_| ())
    };
    bwd(&gu, &down, &grad, None).unwrap();
    expect_err(
        bwd(&f32_tensor(&[4, 2, 2, 1], &[0.0; 16]), &down, &grad, None),
        &["gate_up_proj_act_checkpoint_T", "[N, 2, I, B]"],
    );
    expect_err(
        bwd(&gu, &f32_tensor(&[4, 2, 3], &[0.0; 24]), &grad, None),
        &["down_proj_act_checkpoint", "[N, B, H]"],
    );
    // NKI's [T+1, H], not [T, H]; its padding row zero, as the forward's output's is.
    expect_err(
        bwd(&gu, &down, &f32_tensor(&[3, 2], &[0.0; 6]), None),
        &["output_hidden_states_grad", "[T+1, H]", "[4, 2]"],
    );
    expect_err(
        bwd(
            &gu,
            &down,
            &f32_tensor(&[4, 2], &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5]),
            None,
        ),
        &["output_hidden_states_grad", "row T = 3", "column 1"],
    );
    expect_err(
        bwd(
            &gu,
            &down,
            &f32_tensor(&[4, 2], &[0.0, 0.0, f64::INFINITY, 0.0, 0.0, 0.0, 0.0, 0.0]),
            None,
        ),
        &["output_hidden_states_grad", "non-finite"],
    );
    // The plan routes token 0 → experts 0, 2; token 1 → 0; token 2 → 1. An index with
    // one expert per token taken from the plan agrees with it; one claiming token 1 chose
    // expert 1 does not.
    bwd(&gu, &down, &grad, Some(&i32_tensor(&[3, 1], &[0, 0, 1]))).unwrap();
    expect_err(
        bwd(&gu, &down, &grad, Some(&i32_tensor(&[3, 1], &[0, 1, 0]))),
        &["expert_index", "token 1 chose expert 1", "no slot"],
    );
    expect_err(
        bwd(&gu, &down, &grad, Some(&i32_tensor(&[3, 1], &[0, 5, 1]))),
        &["expert_index", "expert id 5"],
    );
}
