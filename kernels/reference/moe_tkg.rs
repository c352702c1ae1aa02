//! f64 decode-time experts (see [`crate::contracts::moe_tkg`]): each token through each of its
//! routes' experts, one at a time, subscript for subscript as the formulas read.

use super::blockwise::gate_activation;
use crate::contracts::{ActFnType, ClampLimits, MoeTkgDims, TkgRouting};

/// Borrowed f64 operands of one `moe_tkg` call.
#[derive(Clone, Copy, Debug)]
pub struct TkgOperands<'a> {
    pub dims: MoeTkgDims,
    /// `[T, H]`.
    pub hidden_input: &'a [f64],
    /// `[E_L, H, 2, I]`.
    pub expert_gate_up_weights: &'a [f64],
    /// `[E_L, I, H]`.
    pub expert_down_weights: &'a [f64],
    /// `[E_L, 2, I]`.
    pub expert_gate_up_bias: Option<&'a [f64]>,
    /// `[E_L, H]`.
    pub expert_down_bias: Option<&'a [f64]>,
    pub activation_fn: ActFnType,
    pub clamp: ClampLimits,
}

/// `f_e(x)`: expert `e`'s output `[H]` for the token row `x [H]`.
pub fn expert_output(ops: &TkgOperands<'_>, e: usize, x: &[f64]) -> Vec<f64> {
    let MoeTkgDims { h, i, .. } = ops.dims;
    let gate_up = |row: usize, proj: usize, j: usize| {
        ops.expert_gate_up_weights[((e * h + row) * 2 + proj) * i + j]
    };
    let bias = |proj: usize, j: usize| {
        ops.expert_gate_up_bias
            .map_or(0.0, |b| b[(e * 2 + proj) * i + j])
    };
    let act: Vec<f64> = (0..i)
        .map(|j| {
            let gate = (0..h).map(|row| x[row] * gate_up(row, 0, j)).sum::<f64>() + bias(0, j);
            let up = (0..h).map(|row| x[row] * gate_up(row, 1, j)).sum::<f64>() + bias(1, j);
            let (activated, _) = gate_activation(ops.activation_fn, ops.clamp.gate.apply(gate));
            activated * ops.clamp.up.apply(up)
        })
        .collect();
    (0..h)
        .map(|col| {
            let down: f64 = (0..i)
                .map(|j| act[j] * ops.expert_down_weights[(e * i + j) * h + col])
                .sum();
            down + ops.expert_down_bias.map_or(0.0, |b| b[e * h + col])
        })
        .collect()
}

/// `output [T, H]`: each token's routes' expert outputs, weighted, summed.
pub fn moe_tkg_forward(ops: &TkgOperands<'_>, routing: &TkgRouting) -> Vec<f64> {
    let MoeTkgDims { t, h, .. } = ops.dims;
    let mut output = vec![0.0; t * h];
    for (token, row) in output.chunks_mut(h.max(1)).enumerate().take(t) {
        let x = &ops.hidden_input[token * h..(token + 1) * h];
        for route in token * routing.per_token..(token + 1) * routing.per_token {
            let weight = routing.weights[route];
            if weight == 0.0 {
                continue;
            }
            let y = expert_output(ops, routing.experts[route], x);
            for (out, y) in row.iter_mut().zip(y) {
                *out += weight * y;
            }
        }
    }
    output
}
