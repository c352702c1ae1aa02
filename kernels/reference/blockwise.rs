//! f64 blockwise expert matmul with a gated activation, forward and backward (see
//! [`crate::contracts::blockwise_mm`]). Plain loops over blocks, slots and matrix indices.

use crate::contracts::spec::output_named;
use crate::contracts::tensors::blockwise_mm as bm;
use crate::contracts::{
    ActFnType, BlockwiseDims, ClampLimits, ExpertAffinityScaleMode, WeightLayout,
};
use crate::error::Result;
use crate::tensor::{DType, try_filled};

/// Zeros for output `name` of `shape`, or the error naming it when they cannot be allocated.
fn zeros(name: &str, shape: &[usize]) -> Result<Vec<f64>> {
    try_filled(&output_named(name), shape, 0.0)
}

/// Borrowed f64 operands shared by forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseOperands<'a> {
    pub dims: BlockwiseDims,
    /// `[T+1, H]`.
    pub hidden_states: &'a [f64],
    /// `[(T+1)·E]`.
    pub expert_affinities_masked: &'a [f64],
    /// `[E, H, 2, I]` (`[E, 2, I, H]` with [`WeightLayout::Linear`]).
    pub gate_up_proj_weight: &'a [f64],
    /// `[E, I, H]` (`[E, H, I]` with [`WeightLayout::Linear`]).
    pub down_proj_weight: &'a [f64],
    /// The weights' layout, which their gradients take too.
    pub weight_layout: WeightLayout,
    /// `[N·B]`, T for padding.
    pub token_position_to_id: &'a [i32],
    /// `[N]`, ids in `[0, E)`.
    pub block_to_expert: &'a [i32],
    /// `[E, 2, I]`.
    pub gate_and_up_proj_bias: Option<&'a [f64]>,
    /// `[E, H]`.
    pub down_proj_bias: Option<&'a [f64]>,
}

impl BlockwiseOperands<'_> {
    /// `(block, slot, token, expert)` for every slot in plan order: those holding a real token,
    /// and with `padding` also the padding slots (token T, the zero row).
    fn slots(&self, padding: bool) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let BlockwiseDims { t, b, .. } = self.dims;
        self.block_to_expert
            .iter()
            .enumerate()
            .flat_map(move |(block, &expert)| {
                (0..b).filter_map(move |slot| {
                    let token = self.token_position_to_id[block * b + slot] as usize;
                    (padding || token < t).then_some((block, slot, token, expert as usize))
                })
            })
    }

    /// Whether the zero row has a non-zero expert output (a bias, or a clamp that moves 0).
    fn padding_has_outputs(&self, clamp: ClampLimits) -> bool {
        self.gate_and_up_proj_bias.is_some()
            || self.down_proj_bias.is_some()
            || clamp.gate.apply(0.0) != 0.0
            || clamp.up.apply(0.0) != 0.0
    }

    /// The gate/up bias of `expert`'s column `col` (`which` 0 gate, 1 up).
    fn gate_up_bias(&self, expert: usize, which: usize, col: usize) -> f64 {
        let i = self.dims.i;
        self.gate_and_up_proj_bias
            .map_or(0.0, |bias| bias[(expert * 2 + which) * i + col])
    }

    /// The offset of expert `expert`'s gate/up weight from hidden unit `j` to column `col` of
    /// projection `which` (0 gate, 1 up), in the weight and in its gradient.
    fn gate_up_at(&self, expert: usize, j: usize, which: usize, col: usize) -> usize {
        let BlockwiseDims { h, i, .. } = self.dims;
        self.weight_layout
            .gate_up_offset((h, i), expert, j, which, col)
    }

    /// The offset of expert `expert`'s down weight from intermediate unit `row` to hidden unit
    /// `j`, in the weight and in its gradient.
    fn down_at(&self, expert: usize, row: usize, j: usize) -> usize {
        let BlockwiseDims { h, i, .. } = self.dims;
        self.weight_layout.down_offset((h, i), expert, row, j)
    }

    fn gate_up(&self, expert: usize, j: usize, which: usize, col: usize) -> f64 {
        self.gate_up_proj_weight[self.gate_up_at(expert, j, which, col)]
    }

    fn down(&self, expert: usize, row: usize, j: usize) -> f64 {
        self.down_proj_weight[self.down_at(expert, row, j)]
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `(row scale, output scale)` of an assignment with `affinity` under `scaling`.
fn scales(scaling: ExpertAffinityScaleMode, affinity: f64) -> (f64, f64) {
    (
        if scaling.scales_rows() { affinity } else { 1.0 },
        if scaling.scales_outputs() {
            affinity
        } else {
            1.0
        },
    )
}

/// The gate activation `f(g)` and its derivative `f'(g)`, by their textbook formulas.
pub fn gate_activation(act_fn: ActFnType, g: f64) -> (f64, f64) {
    match act_fn {
        ActFnType::Silu => {
            let s = sigmoid(g);
            (g * s, s * (1.0 + g * (1.0 - s)))
        }
        ActFnType::Gelu => {
            let cdf = 0.5 * (1.0 + libm::erf(g / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * g * g).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (g * cdf, cdf + g * pdf)
        }
        ActFnType::GeluTanhApprox => {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (g + 0.044715 * g.powi(3))).tanh();
            let dt = (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * g * g);
            (0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * dt)
        }
        ActFnType::Swish => {
            let s = sigmoid(1.702 * g);
            (g * s, s + 1.702 * g * s * (1.0 - s))
        }
        ActFnType::Relu => {
            if g > 0.0 {
                (g, 1.0)
            } else {
                (0.0, 0.0)
            }
        }
        ActFnType::SquaredRelu => {
            let r = g.max(0.0);
            (r * r, 2.0 * r)
        }
    }
}

/// The experts' options: the gate activation, where the affinity multiplies, the clamps,
/// whether each slot adds its row into `output` or stores it (`is_tensor_update_accumulating`),
/// and the dtype of the matmul operands (`compute_dtype`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertOptions {
    pub act_fn: ActFnType,
    pub scaling: ExpertAffinityScaleMode,
    pub clamp: ClampLimits,
    /// The forward's only: the backward's gradient rows come from real slots, one per token
    /// where the forward stores.
    pub accumulating: bool,
    /// bf16: every operand the kernel forms (the scaled token rows, the activations, the
    /// output and gate/up gradients) is rounded to bf16 where it is formed
    /// ([`ComputeDType`](crate::contracts::ComputeDType)); f32: nothing is.
    pub compute_dtype: DType,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        Self {
            act_fn: ActFnType::default(),
            scaling: ExpertAffinityScaleMode::default(),
            clamp: ClampLimits::default(),
            accumulating: true,
            compute_dtype: DType::F32,
        }
    }
}

impl ExpertOptions {
    /// `x` as a matmul operand: rounded to nearest even bf16 when computing in bf16.
    fn operand(&self, x: f64) -> f64 {
        super::operand(self.compute_dtype, x)
    }
}

/// Forward results in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockwiseForward {
    /// `[T+1, H]`, row T (the padding token's) zero.
    pub output: Vec<f64>,
    /// `[N, 2, I, B]`.
    pub gate_up_activations_t: Vec<f64>,
    /// `[N, B, H]`.
    pub down_activations: Vec<f64>,
}

/// Blockwise forward with both checkpoints.
pub fn blockwise_forward(
    ops: &BlockwiseOperands<'_>,
    options: ExpertOptions,
) -> Result<BlockwiseForward> {
    let BlockwiseDims {
        t, h, e, i, b, n, ..
    } = ops.dims;
    let mut out = BlockwiseForward {
        output: zeros(bm::OUTPUT.name, &[t + 1, h])?,
        gate_up_activations_t: zeros("gate_up_activations_T", &[n, 2, i, b])?,
        down_activations: zeros("down_activations", &[n, b, h])?,
    };
    // Padding slots go through their block's expert on the zero row T, as nki-library's
    // kernels compute them; they only matter when a bias or clamp gives the zero row an
    // output.
    let padding = ops.padding_has_outputs(options.clamp);
    for (block, slot, token, expert) in ops.slots(padding) {
        let affinity = ops.expert_affinities_masked[token * e + expert];
        // PRE_SCALE multiplies the token row, POST_SCALE the down projection.
        let (row_scale, output_scale) = scales(options.scaling, affinity);
        let x: Vec<f64> = ops.hidden_states[token * h..(token + 1) * h]
            .iter()
            .map(|&v| options.operand(row_scale * v))
            .collect();
        let mut act = vec![0.0; i];
        for (col, a) in act.iter_mut().enumerate() {
            // The projection, plus its bias, clamped; the checkpoint holds these values.
            let gate: f64 = (0..h)
                .map(|j| x[j] * ops.gate_up(expert, j, 0, col))
                .sum::<f64>()
                + ops.gate_up_bias(expert, 0, col);
            let up: f64 = (0..h)
                .map(|j| x[j] * ops.gate_up(expert, j, 1, col))
                .sum::<f64>()
                + ops.gate_up_bias(expert, 1, col);
            let (gate, up) = (options.clamp.gate.apply(gate), options.clamp.up.apply(up));
            out.gate_up_activations_t[((block * 2) * i + col) * b + slot] = gate;
            out.gate_up_activations_t[((block * 2 + 1) * i + col) * b + slot] = up;
            *a = options.operand(gate_activation(options.act_fn, gate).0 * up);
        }
        for j in 0..h {
            let y: f64 = (0..i)
                .map(|row| act[row] * ops.down(expert, row, j))
                .sum::<f64>()
                + ops.down_proj_bias.map_or(0.0, |bias| bias[expert * h + j]);
            out.down_activations[(block * b + slot) * h + j] = y;
            if options.accumulating {
                out.output[token * h + j] += output_scale * y;
            } else {
                out.output[token * h + j] = output_scale * y;
            }
        }
    }
    Ok(out)
}

/// Gradients in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockwiseGrads {
    /// `[T+1, H]`, row T zero.
    pub hidden_states_grad: Vec<f64>,
    /// `[(T+1)·E]`.
    pub expert_affinities_masked_grad: Vec<f64>,
    /// `[E, H, 2, I]`, or as the weights' layout says.
    pub gate_up_proj_weight_grad: Vec<f64>,
    /// `[E, I, H]`, or as the weights' layout says.
    pub down_proj_weight_grad: Vec<f64>,
    /// `[E, 2, I]`.
    pub gate_and_up_proj_bias_grad: Vec<f64>,
    /// `[E, H]`.
    pub down_proj_bias_grad: Vec<f64>,
}

/// Blockwise backward from the forward's checkpoints `gate_up_activations_t [N, 2, I, B]` and
/// `down_activations [N, B, H]` and the output gradient `d_output [T+1, H]` (row T unread: the
/// padding slots have affinity 0).
pub fn blockwise_backward(
    ops: &BlockwiseOperands<'_>,
    gate_up_activations_t: &[f64],
    down_activations: &[f64],
    d_output: &[f64],
    options: ExpertOptions,
) -> Result<BlockwiseGrads> {
    let BlockwiseDims { t, h, e, i, b, .. } = ops.dims;
    let mut grads = BlockwiseGrads {
        hidden_states_grad: zeros("hidden_states_grad", &[t + 1, h])?,
        expert_affinities_masked_grad: zeros("expert_affinities_masked_grad", &[(t + 1) * e])?,
        gate_up_proj_weight_grad: zeros(
            "gate_up_proj_weight_grad",
            &ops.weight_layout.gate_up_dims(e, h, i),
        )?,
        down_proj_weight_grad: zeros(
            "down_proj_weight_grad",
            &ops.weight_layout.down_dims(e, h, i),
        )?,
        gate_and_up_proj_bias_grad: zeros("gate_and_up_proj_bias_grad", &[e, 2, i])?,
        down_proj_bias_grad: zeros("down_proj_bias_grad", &[e, h])?,
    };
    // Padding slots have a zero output gradient (row T of d_output is zero), so they add
    // nothing.
    for (block, slot, token, expert) in ops.slots(false) {
        let raw = &ops.hidden_states[token * h..(token + 1) * h];
        let d_out = &d_output[token * h..(token + 1) * h];
        let y = &down_activations[(block * b + slot) * h..(block * b + slot + 1) * h];
        let affinity = ops.expert_affinities_masked[token * e + expert];
        let (row_scale, output_scale) = scales(options.scaling, affinity);
        // The row the gate/up projection saw.
        let x: Vec<f64> = raw
            .iter()
            .map(|&v| options.operand(row_scale * v))
            .collect();
        // d y = output_scale · d out, the down projection's output gradient.
        let d_y: Vec<f64> = d_out
            .iter()
            .map(|&d| options.operand(output_scale * d))
            .collect();
        let d_affinity = &mut grads.expert_affinities_masked_grad[token * e + expert];
        if options.scaling.scales_outputs() {
            *d_affinity = d_out.iter().zip(y).map(|(d, y)| d * y).sum();
        }
        for (j, d) in d_y.iter().enumerate() {
            grads.down_proj_bias_grad[expert * h + j] += d;
        }
        let gate = |col: usize| gate_up_activations_t[((block * 2) * i + col) * b + slot];
        let up = |col: usize| gate_up_activations_t[((block * 2 + 1) * i + col) * b + slot];
        for row in 0..i {
            let (f, f_grad) = gate_activation(options.act_fn, gate(row));
            let act = options.operand(f * up(row));
            // d act[row] = Σ_j D[e, row, j] · d y[j]
            let mut d_act = 0.0;
            for (j, &d_y) in d_y.iter().enumerate() {
                grads.down_proj_weight_grad[ops.down_at(expert, row, j)] += act * d_y;
                d_act += ops.down(expert, row, j) * d_y;
            }
            // Through the clamps (nothing passes where a value sits at a limit) to the
            // projections and their biases.
            let gate_pass = if options.clamp.gate.passes(gate(row)) {
                1.0
            } else {
                0.0
            };
            let up_pass = if options.clamp.up.passes(up(row)) {
                1.0
            } else {
                0.0
            };
            let d_gate = options.operand(d_act * up(row) * f_grad * gate_pass);
            let d_up = options.operand(d_act * f * up_pass);
            grads.gate_and_up_proj_bias_grad[(expert * 2) * i + row] += d_gate;
            grads.gate_and_up_proj_bias_grad[(expert * 2 + 1) * i + row] += d_up;
            for j in 0..h {
                grads.gate_up_proj_weight_grad[ops.gate_up_at(expert, j, 0, row)] += x[j] * d_gate;
                grads.gate_up_proj_weight_grad[ops.gate_up_at(expert, j, 1, row)] += x[j] * d_up;
                // d x[j] (the scaled row's gradient): into the token's row, scaled back, and
                // into the affinity when it scaled the row.
                let d_x =
                    ops.gate_up(expert, j, 0, row) * d_gate + ops.gate_up(expert, j, 1, row) * d_up;
                grads.hidden_states_grad[token * h + j] += row_scale * d_x;
                if options.scaling.scales_rows() {
                    grads.expert_affinities_masked_grad[token * e + expert] += raw[j] * d_x;
                }
            }
        }
    }
    Ok(grads)
}
