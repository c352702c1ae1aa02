//! Blockwise expert matmul with fused SwiGLU on the CPU, forward and backward.
//!
//! All blocks of one expert run as one pair of GEMMs over the expert's real tokens (padding
//! slots are skipped, never multiplied): `[m, H] · [H, 2I]`, SiLU(gate) ⊙ up fused on the
//! result, then `[m, I] · [I, H]`. Experts run in parallel, and an expert with more than
//! [`TASK_ROWS`] tokens is split into pieces of rows (and its weight gradients into bands of
//! rows), so a skewed routing still keeps every thread busy. Every product runs on one thread
//! and the split depends only on the plan, so each value's summation order never depends on the
//! thread count.
//!
//! The affinity scaling and scatter-add are fused into a per-token combine that sums a token's
//! expert outputs in ascending expert order. The backward's products against transposed weights
//! run in dot-product form ([`matmul_nt`]) on the weights as stored, and weight gradients are
//! written straight into their final place.
//!
//! bf16 weights are never widened whole: `[m, H] · [H, 2I]` with bf16 tokens runs on AVX-512
//! BF16 pair dot products ([`matmul_bf16`], exact products, f32 sums), and every other product
//! widens a cache-sized panel of the weights at a time.

use std::mem::MaybeUninit;

use half::bf16;
use rayon::prelude::*;

use super::alloc::{output_buffer, zeroed};
use super::bf16_matmul::{self, matmul_bf16};
use super::dot::{matmul_nt, matmul_nt_bf16};
use super::f32_output;
use super::matmul::{MatRef, matmul, matmul_bf16_b};
use super::permute::topk_gradient;
use super::swiglu;
use crate::contracts::{
    BlockwiseDims, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads, BlockwiseMmInputs,
    BlockwiseMmOutputs,
};
use crate::error::Result;
use crate::tensor::{Storage, Tensor};
use crate::uninit::{assume_init, write_copy, zero};

/// Most rows of one expert that one task computes; experts with more are split into pieces
/// of this many rows (the last one shorter).
const TASK_ROWS: usize = 256;

/// One expert's share of the plan: its real (non-padding) slots in plan order.
struct ExpertRows {
    expert: usize,
    /// Plan positions `n·B + j`.
    slots: Vec<usize>,
    /// The token in each slot.
    tokens: Vec<usize>,
}

impl ExpertRows {
    /// The rows as consecutive pieces of at most [`TASK_ROWS`] rows, in order.
    fn split(self) -> Vec<ExpertRows> {
        if self.slots.len() <= TASK_ROWS {
            return vec![self];
        }
        self.slots
            .chunks(TASK_ROWS)
            .zip(self.tokens.chunks(TASK_ROWS))
            .map(|(slots, tokens)| ExpertRows {
                expert: self.expert,
                slots: slots.to_vec(),
                tokens: tokens.to_vec(),
            })
            .collect()
    }
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

    /// Writes `out [T, H]`: each token's row is the sum over its `(group, row)` pairs, in
    /// order, of `weight(token, group) · rows_of(group)[row]`, added to 0.
    fn combine<'r>(
        &self,
        out: &mut [MaybeUninit<f32>],
        h: usize,
        weight: impl Fn(usize, usize) -> f32 + Sync,
        rows_of: impl Fn(usize) -> &'r [f32] + Sync,
    ) {
        out.par_chunks_mut(h).enumerate().for_each(|(token, out)| {
            let out = zero(out);
            for &(g, row) in &self.entries[self.offsets[token]..self.offsets[token + 1]] {
                let w = weight(token, g);
                for (o, v) in out.iter_mut().zip(&rows_of(g)[row * h..(row + 1) * h]) {
                    *o += w * v;
                }
            }
        });
    }
}

/// `dst [m, n] = a · w` for `a [m, k]` and expert `expert`'s weight `w [k, n]` (its `k · n`
/// contiguous elements of `weights`), read as stored: f32 directly, bf16 widened a cache-sized
/// panel at a time into `panel`.
fn weight_product(
    dst: &mut [f32],
    a: MatRef<'_>,
    weights: &Tensor,
    expert: usize,
    (k, n): (usize, usize),
    panel: &mut Vec<f32>,
) {
    let range = expert * k * n..(expert + 1) * k * n;
    match weights.storage() {
        Storage::F32(w) => matmul(dst, a, MatRef::row_major(&w[range], k, n), false),
        Storage::BF16(w) => matmul_bf16_b(dst, a, &w[range], panel),
        Storage::I32(_) => unreachable!("validated as a float tensor"),
    }
}

/// `dst [m, n] = a [m, k] · wᵀ` for expert `expert`'s weight `w [n, k]` (its `n · k` contiguous
/// elements of `weights`), read as stored: f32 directly, bf16 widened a cache-sized panel at a
/// time (`scratch`: the panel and a tile of results).
fn weight_nt(
    dst: &mut [f32],
    a: &[f32],
    weights: &Tensor,
    expert: usize,
    (m, n, k): (usize, usize, usize),
    scratch: (&mut Vec<f32>, &mut Vec<f32>),
) {
    let range = expert * n * k..(expert + 1) * n * k;
    match weights.storage() {
        Storage::F32(w) => matmul_nt(dst, a, &w[range], (m, n, k), false),
        Storage::BF16(w) => matmul_nt_bf16(dst, a, &w[range], (m, n, k), scratch),
        Storage::I32(_) => unreachable!("validated as a float tensor"),
    }
}

/// Copies the listed rows of a `[rows, width]` float tensor into `dst` as a contiguous f32
/// matrix `[rows.len(), width]`.
fn gather_rows(tensor: &Tensor, rows: &[usize], width: usize, dst: &mut [f32]) {
    for (&row, dst) in rows.iter().zip(dst.chunks_exact_mut(width)) {
        let range = row * width..(row + 1) * width;
        match tensor.storage() {
            Storage::F32(v) => dst.copy_from_slice(&v[range]),
            Storage::BF16(v) => {
                for (d, x) in dst.iter_mut().zip(&v[range]) {
                    *d = x.to_f32();
                }
            }
            Storage::I32(_) => unreachable!("validated as a float tensor"),
        }
    }
}

/// `buffer` resized to `len` elements, as a slice to overwrite.
fn resized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    buffer
}

/// Per-task buffers, reused from one task to the next.
#[derive(Default)]
struct Scratch {
    /// Token rows (forward).
    x: Vec<f32>,
    /// Token rows in bf16, each padded to an even length (forward).
    x_bf16: Vec<bf16>,
    /// A panel of bf16 weights widened to f32.
    panel: Vec<f32>,
    /// A tile of results of the bf16 dot-product kernel.
    tile: Vec<f32>,
    /// SwiGLU activations (forward).
    act: Vec<f32>,
    /// Expert outputs before affinity scaling, from the checkpoint (backward).
    y: Vec<f32>,
    /// gate/up rows from the checkpoint (backward).
    gate_up: Vec<f32>,
    /// Gradient of the activations (backward).
    d_act: Vec<f32>,
}

/// One expert's `[m, ·]` matrices that its weight gradients read, and the row-wise stage's
/// buffers when it runs in one piece; reused from one expert to the next.
#[derive(Default)]
struct ExpertGrads {
    x: Vec<f32>,
    d_y: Vec<f32>,
    act: Vec<f32>,
    d_gate_up: Vec<f32>,
    rows: Scratch,
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
    scratch: &mut Scratch,
) -> ExpertForward {
    let BlockwiseDims { h, i, .. } = dims;
    let m = group.tokens.len();
    let mut gate_up = vec![0.0f32; m * 2 * i];
    match (
        inputs.hidden_states.storage(),
        inputs.gate_up_proj_weight.storage(),
    ) {
        // Both operands stored in bf16: their products are exact in f32, so the pairwise bf16
        // dot product gives the f32 sums at twice the f32 rate, without widening the weights.
        (Storage::BF16(x), Storage::BF16(w)) if bf16_matmul::available() => {
            let lda = h.next_multiple_of(2);
            let rows = &mut scratch.x_bf16;
            rows.clear();
            for &token in &group.tokens {
                rows.extend_from_slice(&x[token * h..(token + 1) * h]);
                rows.resize(rows.len().next_multiple_of(2), bf16::ZERO);
            }
            let w = &w[group.expert * h * 2 * i..(group.expert + 1) * h * 2 * i];
            matmul_bf16(&mut gate_up, rows, lda, w, (m, 2 * i, h));
        }
        _ => {
            let x = resized(&mut scratch.x, m * h);
            gather_rows(inputs.hidden_states, &group.tokens, h, x);
            weight_product(
                &mut gate_up,
                MatRef::row_major(&scratch.x, m, h),
                inputs.gate_up_proj_weight,
                group.expert,
                (h, 2 * i),
                &mut scratch.panel,
            );
        }
    }
    let act = resized(&mut scratch.act, m * i);
    for (gu, act) in gate_up.chunks(2 * i).zip(act.chunks_mut(i)) {
        let (gate, up) = gu.split_at(i);
        swiglu::forward(gate, up, act);
    }
    let mut down = vec![0.0f32; m * h];
    weight_product(
        &mut down,
        MatRef::row_major(act, m, i),
        inputs.down_proj_weight,
        group.expert,
        (i, h),
        &mut scratch.panel,
    );
    ExpertForward { gate_up, down }
}

pub(super) fn forward(call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
    let (inputs, dims) = (call.inputs(), call.dims());
    let BlockwiseDims { t, h, e, i, b, n } = dims;
    let groups: Vec<ExpertRows> = group_by_expert(&inputs, dims)
        .into_iter()
        .flat_map(ExpertRows::split)
        .collect();
    let results: Vec<ExpertForward> = groups
        .par_iter()
        .map_init(Scratch::default, |scratch, group| {
            expert_forward(&inputs, dims, group, scratch)
        })
        .collect();

    let affinities = inputs.expert_affinities_masked.f32_values();
    let mut output = output_buffer(t * h);
    TokenRows::new(&groups, t).combine(
        &mut output,
        h,
        |token, g| affinities[token * e + groups[g].expert],
        |g| &results[g].down,
    );
    // SAFETY: `combine` wrote every token's row.
    let output = unsafe { assume_init(output) };

    let (gate_up_activations_t, down_activations) = if call.params().checkpoint_activations {
        let (gate_up_t, down) = checkpoints(&groups, &results, dims);
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

/// The forward's checkpoints in the plan's layout: `gate_up_activations_T [N, 2, I, B]` (each
/// block's `[B, 2I]` rows transposed to `[2I, B]`) and `down_activations [N, B, H]`; zeros in
/// padding slots and unused blocks. Blocks are filled in parallel.
fn checkpoints(
    groups: &[ExpertRows],
    results: &[ExpertForward],
    dims: BlockwiseDims,
) -> (Vec<f32>, Vec<f32>) {
    let BlockwiseDims { h, i, b, n, .. } = dims;
    // Where each slot's row lives: (group, row), or none for padding.
    let mut source = vec![None; n * b];
    for (g, group) in groups.iter().enumerate() {
        for (row, &slot) in group.slots.iter().enumerate() {
            source[slot] = Some((g, row));
        }
    }
    let mut gate_up_t = output_buffer(n * 2 * i * b);
    let mut down = output_buffer(n * b * h);
    gate_up_t
        .par_chunks_mut(2 * i * b)
        .zip(down.par_chunks_mut(b * h))
        .zip(source.par_chunks(b))
        .for_each(|((gate_up_t, down), source)| {
            transpose_block(gate_up_t, source, |g, row| {
                &results[g].gate_up[row * 2 * i..(row + 1) * 2 * i]
            });
            for (src, down) in source.iter().zip(down.chunks_exact_mut(h)) {
                match *src {
                    Some((g, row)) => write_copy(down, &results[g].down[row * h..(row + 1) * h]),
                    None => {
                        zero(down);
                    }
                }
            }
        });
    // SAFETY: the N blocks cover both buffers; `transpose_block` wrote each block's
    // `[2I, B]` whole, and each slot's row of `down` was copied or zeroed.
    unsafe { (assume_init(gate_up_t), assume_init(down)) }
}

/// Writes one block's rows, transposed, into the whole of `block_t [C, B]` (C =
/// `block_t.len() / B`, B = `source.len()`): column j is the row `row_of(g, r)` for
/// `source[j] = Some((g, r))`, zeros for padding. Works in 16 × 16 tiles gathered on the
/// stack, so every read and write is a contiguous run of up to 16 values.
fn transpose_block<'r>(
    block_t: &mut [MaybeUninit<f32>],
    source: &[Option<(usize, usize)>],
    row_of: impl Fn(usize, usize) -> &'r [f32],
) {
    const TILE: usize = 16;
    let b = source.len();
    let c = block_t.len() / b;
    let mut tile = [[0.0f32; TILE]; TILE];
    for j0 in (0..b).step_by(TILE) {
        let slots = &source[j0..(j0 + TILE).min(b)];
        for c0 in (0..c).step_by(TILE) {
            let cols = (c - c0).min(TILE);
            for (tile_row, src) in tile.iter_mut().zip(slots) {
                match *src {
                    Some((g, r)) => tile_row[..cols].copy_from_slice(&row_of(g, r)[c0..c0 + cols]),
                    None => tile_row[..cols].fill(0.0),
                }
            }
            for (dc, out) in block_t[c0 * b..].chunks_mut(b).take(cols).enumerate() {
                for (dj, value) in out[j0..j0 + slots.len()].iter_mut().enumerate() {
                    value.write(tile[dj][dc]);
                }
            }
        }
    }
}

/// Per-expert results that are not weight gradients: the input gradient of each row and the
/// affinity gradient of each row.
struct ExpertBackward {
    d_x: Vec<f32>,
    d_affinity: Vec<f32>,
}

/// One piece of an expert's rows in the backward's row-wise stage: its slots and tokens, and
/// the rows of the expert's matrices it writes.
struct RowPiece<'a> {
    slots: &'a [usize],
    tokens: &'a [usize],
    /// `[m, H]`: the piece's token rows.
    x: &'a mut [f32],
    /// `[m, H]`: affinity · d output.
    d_y: &'a mut [f32],
    /// `[m, I]`: SiLU(gate) ⊙ up, recomputed from the checkpoint.
    act: &'a mut [f32],
    /// `[m, 2I]`.
    d_gate_up: &'a mut [f32],
    /// `[m, H]`.
    d_x: &'a mut [f32],
    /// `[m]`.
    d_affinity: &'a mut [f32],
}

/// The row-wise backward of one piece of expert `expert`'s rows: every gradient but the
/// weights'.
fn rows_backward(
    call: &BlockwiseMmBwd<'_>,
    (affinities, checkpoint): (&[f32], &[f32]),
    expert: usize,
    piece: RowPiece<'_>,
    s: &mut Scratch,
) {
    let inputs = call.inputs();
    let forward = inputs.forward;
    let BlockwiseDims { e, h, i, b, .. } = call.dims();
    let m = piece.tokens.len();

    // d y = affinity · d output; d affinity = ⟨d output, y⟩.
    let y = resized(&mut s.y, m * h);
    gather_rows(inputs.down_activations, piece.slots, h, y);
    gather_rows(inputs.output_hidden_states_grad, piece.tokens, h, piece.d_y);
    for (row, &token) in piece.tokens.iter().enumerate() {
        let a = affinities[token * e + expert];
        let d_y = &mut piece.d_y[row * h..(row + 1) * h];
        piece.d_affinity[row] = d_y
            .iter()
            .zip(&y[row * h..(row + 1) * h])
            .map(|(d, y)| d * y)
            .sum();
        for d in d_y.iter_mut() {
            *d *= a;
        }
    }
    // gate/up rows from the transposed checkpoint [N, 2, I, B]: slot n·B + j's column c
    // (gate, then up) is at (n·2I + c)·B + j.
    let gate_up = resized(&mut s.gate_up, m * 2 * i);
    for (&slot, row) in piece.slots.iter().zip(gate_up.chunks_exact_mut(2 * i)) {
        let (block, j) = (slot / b, slot % b);
        let column = &checkpoint[block * 2 * i * b + j..];
        for (c, value) in row.iter_mut().enumerate() {
            *value = column[c * b];
        }
    }
    // d act [m, I] = d y · Dᵀ.
    let d_act = resized(&mut s.d_act, m * i);
    weight_nt(
        d_act,
        piece.d_y,
        forward.down_proj_weight,
        expert,
        (m, i, h),
        (&mut s.panel, &mut s.tile),
    );
    // act and d gate_up [m, 2I] through SwiGLU.
    for row in 0..m {
        let (gate, up) = s.gate_up[row * 2 * i..(row + 1) * 2 * i].split_at(i);
        let (d_gate, d_up) = piece.d_gate_up[row * 2 * i..(row + 1) * 2 * i].split_at_mut(i);
        swiglu::backward(swiglu::Backward {
            gate,
            up,
            d_act: &s.d_act[row * i..(row + 1) * i],
            act: &mut piece.act[row * i..(row + 1) * i],
            d_gate,
            d_up,
        });
    }
    // d x [m, H] = d gate_up · Wᵀ.
    weight_nt(
        piece.d_x,
        piece.d_gate_up,
        forward.gate_up_proj_weight,
        expert,
        (m, h, 2 * i),
        (&mut s.panel, &mut s.tile),
    );
    gather_rows(forward.hidden_states, piece.tokens, h, piece.x);
}

/// `dst [r, n] = aᵀ · b` for `a [m, r]` and `b [m, n]` (both row-major), computed in bands of
/// `dst`'s rows in parallel: one band per [`TASK_ROWS`] rows of the inner dimension m, so the
/// bands depend only on the shapes.
fn transposed_product(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>) {
    let (r, n) = (a.cols(), b.cols());
    let band = r.div_ceil(a.rows().div_ceil(TASK_ROWS)).max(1);
    dst.par_chunks_mut(band * n)
        .enumerate()
        .for_each(|(index, dst)| {
            let rows = index * band..(index * band + band).min(r);
            matmul(dst, a.columns(rows).t(), b, false);
        });
}

/// One expert's backward. Writes `d_gate_up_weight [H, 2I]` and `d_down_weight [I, H]`; the
/// row-wise stage runs in pieces of [`TASK_ROWS`] rows and the weight gradients in bands, in
/// parallel.
fn expert_backward(
    call: &BlockwiseMmBwd<'_>,
    shared: (&[f32], &[f32]),
    group: &ExpertRows,
    grads: &mut ExpertGrads,
    d_gate_up_weight: &mut [f32],
    d_down_weight: &mut [f32],
) -> ExpertBackward {
    let BlockwiseDims { h, i, .. } = call.dims();
    let m = group.tokens.len();
    let mut d_x = vec![0.0f32; m * h];
    let mut d_affinity = vec![0.0f32; m];
    let pieces: Vec<RowPiece<'_>> = group
        .slots
        .chunks(TASK_ROWS)
        .zip(group.tokens.chunks(TASK_ROWS))
        .zip(resized(&mut grads.x, m * h).chunks_mut(TASK_ROWS * h))
        .zip(resized(&mut grads.d_y, m * h).chunks_mut(TASK_ROWS * h))
        .zip(resized(&mut grads.act, m * i).chunks_mut(TASK_ROWS * i))
        .zip(resized(&mut grads.d_gate_up, m * 2 * i).chunks_mut(TASK_ROWS * 2 * i))
        .zip(d_x.chunks_mut(TASK_ROWS * h))
        .zip(d_affinity.chunks_mut(TASK_ROWS))
        .map(
            |(((((((slots, tokens), x), d_y), act), d_gate_up), d_x), d_affinity)| RowPiece {
                slots,
                tokens,
                x,
                d_y,
                act,
                d_gate_up,
                d_x,
                d_affinity,
            },
        )
        .collect();
    if pieces.len() == 1 {
        for piece in pieces {
            rows_backward(call, shared, group.expert, piece, &mut grads.rows);
        }
    } else {
        pieces
            .into_par_iter()
            .for_each_init(Scratch::default, |scratch, piece| {
                rows_backward(call, shared, group.expert, piece, scratch);
            });
    }
    // d D [I, H] = actᵀ · d y;  d W [H, 2I] = xᵀ · d gate_up.
    transposed_product(
        d_down_weight,
        MatRef::row_major(&grads.act, m, i),
        MatRef::row_major(&grads.d_y, m, h),
    );
    transposed_product(
        d_gate_up_weight,
        MatRef::row_major(&grads.x, m, h),
        MatRef::row_major(&grads.d_gate_up, m, 2 * i),
    );
    ExpertBackward { d_x, d_affinity }
}

pub(super) fn backward(call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
    let inputs = call.inputs();
    let dims = call.dims();
    let BlockwiseDims { t, h, e, i, .. } = dims;
    let groups = group_by_expert(&inputs.forward, dims);
    let mut group_of = vec![None; e];
    for (g, group) in groups.iter().enumerate() {
        group_of[group.expert] = Some(g);
    }

    // Read once here, not once per expert (bf16 inputs are widened).
    let affinities = inputs.forward.expert_affinities_masked.f32_values();
    let checkpoint = inputs.gate_up_activations_t.f32_values();
    // Each expert overwrites its own slices of the weight gradients; experts without tokens
    // keep zeros.
    let mut d_gate_up_weight = zeroed(e * h * 2 * i);
    let mut d_down_weight = zeroed(e * i * h);
    let mut results: Vec<(usize, ExpertBackward)> = d_gate_up_weight
        .par_chunks_mut(h * 2 * i)
        .zip(d_down_weight.par_chunks_mut(i * h))
        .enumerate()
        .filter_map(|(expert, chunks)| group_of[expert].map(|g| (g, chunks)))
        .map_init(ExpertGrads::default, |grads, (g, (d_gate_up, d_down))| {
            let shared = (&affinities[..], &checkpoint[..]);
            let result = expert_backward(call, shared, &groups[g], grads, d_gate_up, d_down);
            (g, result)
        })
        .collect();
    results.sort_by_key(|(g, _)| *g);
    let results: Vec<ExpertBackward> = results.into_iter().map(|(_, r)| r).collect();

    let mut d_affinities = vec![0.0f32; (t + 1) * e];
    for (group, result) in groups.iter().zip(&results) {
        for (&token, &d) in group.tokens.iter().zip(&result.d_affinity) {
            d_affinities[token * e + group.expert] = d;
        }
    }
    let mut d_hidden = output_buffer(t * h);
    TokenRows::new(&groups, t).combine(&mut d_hidden, h, |_, _| 1.0, |g| &results[g].d_x);
    // SAFETY: `combine` wrote every token's row.
    let d_hidden = unsafe { assume_init(d_hidden) };
    let d_topk_affinities = inputs
        .expert_index
        .map(|index| topk_gradient(index, &d_affinities, e))
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
