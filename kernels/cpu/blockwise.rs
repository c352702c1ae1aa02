//! Blockwise expert matmul with fused SwiGLU on the CPU, forward and backward.
//!
//! All blocks of one expert run as one pair of GEMMs over the expert's real tokens (padding
//! slots are skipped, never multiplied): `[m, H] · [H, 2I]`, SiLU(gate) ⊙ up fused on the
//! result, then `[m, I] · [I, H]`. Experts run in parallel; every product runs on one thread, so
//! each value's summation order depends only on the plan, never on the thread count. The
//! affinity scaling and scatter-add are fused into a per-token combine that sums a token's
//! expert outputs in ascending expert order.

use rayon::prelude::*;

use super::matmul::{MatRef, matmul};
use super::{f32_output, sigmoid};
use crate::contracts::{
    BlockwiseDims, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads, BlockwiseMmInputs,
    BlockwiseMmOutputs,
};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};

/// One expert's share of the plan: its real (non-padding) slots in plan order.
struct ExpertRows {
    expert: usize,
    /// Plan positions `n·B + j`.
    slots: Vec<usize>,
    /// The token in each slot.
    tokens: Vec<usize>,
}

/// Groups the plan's real slots by expert, in ascending expert id.
fn group_by_expert(inputs: &BlockwiseMmInputs<'_>, dims: BlockwiseDims) -> Vec<ExpertRows> {
    let positions = inputs
        .token_position_to_id
        .as_i32()
        .expect("validated as i32");
    let blocks = inputs.block_to_expert.as_i32().expect("validated as i32");
    let mut groups: Vec<ExpertRows> = (0..dims.e)
        .map(|expert| ExpertRows {
            expert,
            slots: Vec::new(),
            tokens: Vec::new(),
        })
        .collect();
    for (block, &expert) in blocks.iter().enumerate() {
        let Some(group) = groups.get_mut(expert as usize) else {
            continue; // unused block (expert id E)
        };
        let start = block * dims.b;
        for (slot, &token) in (start..).zip(&positions[start..start + dims.b]) {
            if token >= 0 {
                group.slots.push(slot);
                group.tokens.push(token as usize);
            }
        }
    }
    groups.retain(|g| !g.slots.is_empty());
    groups
}

/// For each token, the `(group, row)` pairs holding its expert outputs, ascending by expert.
struct TokenRows {
    offsets: Vec<usize>,
    entries: Vec<(usize, usize)>,
}

impl TokenRows {
    fn new(groups: &[ExpertRows], t: usize) -> Self {
        let mut offsets = vec![0usize; t + 1];
        for group in groups {
            for &token in &group.tokens {
                offsets[token + 1] += 1;
            }
        }
        for i in 0..t {
            offsets[i + 1] += offsets[i];
        }
        let mut fill = offsets.clone();
        let mut entries = vec![(0, 0); offsets[t]];
        for (g, group) in groups.iter().enumerate() {
            for (row, &token) in group.tokens.iter().enumerate() {
                entries[fill[token]] = (g, row);
                fill[token] += 1;
            }
        }
        Self { offsets, entries }
    }

    fn of(&self, token: usize) -> &[(usize, usize)] {
        &self.entries[self.offsets[token]..self.offsets[token + 1]]
    }
}

/// An expert's `[H, 2I]` gate/up weight (or `[I, H]` down weight) as f32: borrowed when the
/// tensor is f32, widened from bf16 otherwise.
fn expert_matrix(tensor: &Tensor, expert: usize, len: usize) -> std::borrow::Cow<'_, [f32]> {
    let range = expert * len..(expert + 1) * len;
    match tensor.storage() {
        Storage::F32(v) => std::borrow::Cow::Borrowed(&v[range]),
        Storage::BF16(v) => v[range].iter().map(|x| x.to_f32()).collect(),
        Storage::I32(_) => unreachable!("validated as a float tensor"),
    }
}

/// Copies the listed rows of a `[rows, width]` float tensor into a contiguous f32 matrix.
fn gather_rows(tensor: &Tensor, rows: &[usize], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &row in rows {
        let range = row * width..(row + 1) * width;
        match tensor.storage() {
            Storage::F32(v) => out.extend_from_slice(&v[range]),
            Storage::BF16(v) => out.extend(v[range].iter().map(|x| x.to_f32())),
            Storage::I32(_) => unreachable!("validated as a float tensor"),
        }
    }
    out
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// Per-expert forward results: `gate_up [m, 2I]` before the activation and `down [m, H]`
/// before affinity scaling.
struct ExpertForward {
    gate_up: Vec<f32>,
    down: Vec<f32>,
}

fn expert_forward(
    inputs: &BlockwiseMmInputs<'_>,
    dims: BlockwiseDims,
    group: &ExpertRows,
) -> ExpertForward {
    let BlockwiseDims { h, i, .. } = dims;
    let m = group.tokens.len();
    let x = gather_rows(inputs.hidden_states, &group.tokens, h);
    let w_gate_up = expert_matrix(inputs.gate_up_proj_weight, group.expert, h * 2 * i);
    let w_down = expert_matrix(inputs.down_proj_weight, group.expert, i * h);
    let mut gate_up = vec![0.0f32; m * 2 * i];
    matmul(
        &mut gate_up,
        MatRef::row_major(&x, m, h),
        MatRef::row_major(&w_gate_up, h, 2 * i),
        false,
    );
    let mut act = vec![0.0f32; m * i];
    for (a, gu) in act.chunks_mut(i).zip(gate_up.chunks(2 * i)) {
        let (gate, up) = gu.split_at(i);
        for ((a, &g), &u) in a.iter_mut().zip(gate).zip(up) {
            *a = silu(g) * u;
        }
    }
    let mut down = vec![0.0f32; m * h];
    matmul(
        &mut down,
        MatRef::row_major(&act, m, i),
        MatRef::row_major(&w_down, i, h),
        false,
    );
    ExpertForward { gate_up, down }
}

pub(super) fn forward(call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
    let (inputs, dims) = (call.inputs(), call.dims());
    let BlockwiseDims { t, h, e, i, b, n } = dims;
    let groups = group_by_expert(&inputs, dims);
    let results: Vec<ExpertForward> = groups
        .par_iter()
        .map(|group| expert_forward(&inputs, dims, group))
        .collect();

    let affinities = inputs.expert_affinities_masked.f32_values();
    let rows = TokenRows::new(&groups, t);
    let mut output = vec![0.0f32; t * h];
    output
        .par_chunks_mut(h)
        .enumerate()
        .for_each(|(token, out)| {
            for &(g, row) in rows.of(token) {
                let a = affinities[token * e + groups[g].expert];
                for (o, y) in out.iter_mut().zip(&results[g].down[row * h..(row + 1) * h]) {
                    *o += a * y;
                }
            }
        });

    let (gate_up_activations_t, down_activations) = if call.params().checkpoint_activations {
        let mut gate_up_t = vec![0.0f32; n * 2 * i * b];
        let mut down = vec![0.0f32; n * b * h];
        for (group, result) in groups.iter().zip(&results) {
            for (row, &slot) in group.slots.iter().enumerate() {
                let (block, j) = (slot / b, slot % b);
                for (col, &v) in result.gate_up[row * 2 * i..(row + 1) * 2 * i]
                    .iter()
                    .enumerate()
                {
                    // col < I is the gate half, col ≥ I the up half: [block, col / I, col % I, j].
                    gate_up_t[((block * 2 + col / i) * i + col % i) * b + j] = v;
                }
                down[slot * h..(slot + 1) * h]
                    .copy_from_slice(&result.down[row * h..(row + 1) * h]);
            }
        }
        (
            Some(f32_output(
                "gate_up_activations_T",
                &[n, 2, i, b],
                gate_up_t,
            )?),
            Some(f32_output("down_activations", &[n, b, h], down)?),
        )
    } else {
        (None, None)
    };
    Ok(BlockwiseMmOutputs {
        output: f32_output("output", &[t, h], output)?,
        gate_up_activations_t,
        down_activations,
    })
}

/// Per-expert gradients: weight gradients, the input gradient of each row and the affinity
/// gradient of each row.
struct ExpertBackward {
    d_gate_up_weight: Vec<f32>,
    d_down_weight: Vec<f32>,
    d_x: Vec<f32>,
    d_affinity: Vec<f32>,
}

fn expert_backward(call: &BlockwiseMmBwd<'_>, group: &ExpertRows) -> ExpertBackward {
    let inputs = call.inputs();
    let forward = inputs.forward;
    let BlockwiseDims { e, h, i, b, .. } = call.dims();
    let m = group.tokens.len();
    let affinities = forward.expert_affinities_masked.f32_values();
    let d_out = inputs.output_hidden_states_grad.f32_values();
    let checkpoint = inputs.gate_up_activations_t.f32_values();
    let y = gather_rows(inputs.down_activations, &group.slots, h);

    // d y = affinity · d output; d affinity = ⟨d output, y⟩.
    let mut d_y = vec![0.0f32; m * h];
    let mut d_affinity = vec![0.0f32; m];
    for (row, &token) in group.tokens.iter().enumerate() {
        let a = affinities[token * e + group.expert];
        let d_row = &d_out[token * h..(token + 1) * h];
        let y_row = &y[row * h..(row + 1) * h];
        d_affinity[row] = d_row.iter().zip(y_row).map(|(d, y)| d * y).sum();
        for (dy, d) in d_y[row * h..(row + 1) * h].iter_mut().zip(d_row) {
            *dy = a * d;
        }
    }
    // gate/up rows from the transposed checkpoint [N, 2, I, B].
    let mut gate_up = vec![0.0f32; m * 2 * i];
    for (row, &slot) in group.slots.iter().enumerate() {
        let (block, j) = (slot / b, slot % b);
        for col in 0..2 * i {
            gate_up[row * 2 * i + col] = checkpoint[((block * 2 + col / i) * i + col % i) * b + j];
        }
    }
    let w_gate_up = expert_matrix(forward.gate_up_proj_weight, group.expert, h * 2 * i);
    let w_down = expert_matrix(forward.down_proj_weight, group.expert, i * h);

    // d act [m, I] = d y · Dᵀ.
    let mut d_act = vec![0.0f32; m * i];
    matmul(
        &mut d_act,
        MatRef::row_major(&d_y, m, h),
        MatRef::row_major(&w_down, i, h).t(),
        false,
    );
    // act and d gate_up [m, 2I] through SwiGLU.
    let mut act = vec![0.0f32; m * i];
    let mut d_gate_up = vec![0.0f32; m * 2 * i];
    for row in 0..m {
        let (gate, up) = gate_up[row * 2 * i..(row + 1) * 2 * i].split_at(i);
        let (d_gate, d_up) = d_gate_up[row * 2 * i..(row + 1) * 2 * i].split_at_mut(i);
        for col in 0..i {
            let (g, u, da) = (gate[col], up[col], d_act[row * i + col]);
            let s = sigmoid(g);
            act[row * i + col] = g * s * u;
            d_gate[col] = da * u * s * (1.0 + g * (1.0 - s));
            d_up[col] = da * g * s;
        }
    }
    // d D [I, H] = actᵀ · d y;  d W [H, 2I] = xᵀ · d gate_up;  d x [m, H] = d gate_up · Wᵀ.
    let mut d_down_weight = vec![0.0f32; i * h];
    matmul(
        &mut d_down_weight,
        MatRef::row_major(&act, m, i).t(),
        MatRef::row_major(&d_y, m, h),
        false,
    );
    let x = gather_rows(forward.hidden_states, &group.tokens, h);
    let mut d_gate_up_weight = vec![0.0f32; h * 2 * i];
    matmul(
        &mut d_gate_up_weight,
        MatRef::row_major(&x, m, h).t(),
        MatRef::row_major(&d_gate_up, m, 2 * i),
        false,
    );
    let mut d_x = vec![0.0f32; m * h];
    matmul(
        &mut d_x,
        MatRef::row_major(&d_gate_up, m, 2 * i),
        MatRef::row_major(&w_gate_up, h, 2 * i).t(),
        false,
    );
    ExpertBackward {
        d_gate_up_weight,
        d_down_weight,
        d_x,
        d_affinity,
    }
}

pub(super) fn backward(call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
    let inputs = call.inputs();
    let dims = call.dims();
    let BlockwiseDims { t, h, e, i, .. } = dims;
    let groups = group_by_expert(&inputs.forward, dims);
    let results: Vec<ExpertBackward> = groups
        .par_iter()
        .map(|group| expert_backward(call, group))
        .collect();

    let mut d_gate_up_weight = vec![0.0f32; e * h * 2 * i];
    let mut d_down_weight = vec![0.0f32; e * i * h];
    let mut d_affinities = vec![0.0f32; (t + 1) * e];
    for (group, result) in groups.iter().zip(&results) {
        let ex = group.expert;
        d_gate_up_weight[ex * h * 2 * i..(ex + 1) * h * 2 * i]
            .copy_from_slice(&result.d_gate_up_weight);
        d_down_weight[ex * i * h..(ex + 1) * i * h].copy_from_slice(&result.d_down_weight);
        for (&token, &d) in group.tokens.iter().zip(&result.d_affinity) {
            d_affinities[token * e + ex] = d;
        }
    }
    let rows = TokenRows::new(&groups, t);
    let mut d_hidden = vec![0.0f32; t * h];
    d_hidden
        .par_chunks_mut(h)
        .enumerate()
        .for_each(|(token, out)| {
            for &(g, row) in rows.of(token) {
                for (o, d) in out.iter_mut().zip(&results[g].d_x[row * h..(row + 1) * h]) {
                    *o += d;
                }
            }
        });
    let d_topk_affinities = inputs
        .expert_index
        .map(|index| {
            let ids = index.as_i32().expect("validated as i32");
            let k = index.shape()[1];
            let d = ids
                .iter()
                .enumerate()
                .map(|(pair, &id)| d_affinities[(pair / k) * e + id as usize])
                .collect();
            Tensor::from_f32([t, k], d)
        })
        .transpose()?;
    Ok(BlockwiseMmGrads {
        hidden_states_grad: f32_output("hidden_states_grad", &[t, h], d_hidden)?,
        expert_affinities_masked_grad: f32_output(
            "expert_affinities_masked_grad",
            &[(t + 1) * e],
            d_affinities,
        )?,
        gate_up_proj_weight_grad: f32_output(
            "gate_up_proj_weight_grad",
            &[e, h, 2, i],
            d_gate_up_weight,
        )?,
        down_proj_weight_grad: f32_output("down_proj_weight_grad", &[e, i, h], d_down_weight)?,
        d_topk_affinities,
    })
}
