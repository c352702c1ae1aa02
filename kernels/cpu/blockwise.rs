//! Blockwise expert matmul with fused SwiGLU on the CPU, forward and backward.
//!
//! The forward runs the plan in runs of consecutive blocks of one expert (at most
//! [`TASK_ROWS`] real rows each, or one block), in parallel. Each run is one pair of GEMMs over
//! its real tokens (padding slots are skipped, never multiplied): `[m, H] · [H, 2I]`,
//! SiLU(gate) ⊙ up fused on the result, then `[m, I] · [I, H]`, written straight into the run's
//! rows of `down_activations [N, B, H]` (without checkpoints, of a buffer of the routed rows
//! only); the run also writes its blocks of `gate_up_activations_T [N, 2, I, B]` and screens
//! what it wrote for non-finite values while it is in cache. A skewed routing (one expert
//! holding most tokens) still keeps every thread busy, because a crowded expert spans several
//! runs.
//!
//! The backward groups each expert's real slots; its row-wise stage runs in pieces of
//! [`TASK_ROWS`] rows and the weight gradients in bands of rows. Every product runs on one
//! thread and every split depends only on the plan, so each value's summation order never
//! depends on the thread count.
//!
//! The affinity scaling and scatter-add are fused into a per-token combine that sums a token's
//! expert outputs in ascending expert order. Every product with a weight reads it as stored, in
//! either `weight_layout` ([`ExpertMatrix`]: packed panels against the matrix as laid out,
//! dot-product form against its transpose), and weight gradients are written straight into
//! their final place, in their weights' layout, uncleared beforehand.
//!
//! bf16 weights are never widened whole. With bf16 operands (bf16 tokens, or `compute_dtype`
//! bf16, which rounds every operand a kernel forms where it forms it) and a CPU with AVX-512
//! BF16, every product runs on pair dot products ([`ExpertMatrix::product_bf16`],
//! [`ExpertMatrix::transposed_product_bf16`], [`transposed_product_bf16`]: exact products, f32
//! sums), the backward's row-wise stage writing the weight gradients' operands in bf16 as it
//! rounds them; every other product widens a cache-sized panel of the weights at a time (as it
//! packs them, on AVX-512).

use std::mem::MaybeUninit;
use std::ops::Range;

use half::bf16;
use rayon::prelude::*;

use super::alloc::output_buffer;
use super::bf16_matmul::{self, matmul_bf16};
use super::element::{
    Element, all_fit, finite_output, screened_output, write_rounded, write_zeros,
};
use super::expert_matrix::ExpertMatrix;
use super::gated;
use super::matmul::{MatRef, matmul, matmul_into};
use super::permute::topk_gradient;
use super::rows::{
    PREFETCH_ROWS_AHEAD, add_bias_rows, add_scaled, bf16_rows, bias_row, clamp_rows, dot,
    gather_rows, prefetch, prefetch_floats, prefetch_row, resized, round_to_bf16, scale_rows,
};
use super::scratch::PerThread;
use super::stream::Streamer;
use super::transpose::{TILE, Tile, transpose_into};
use crate::contracts::tensors::{blockwise_mm as fwd, blockwise_mm_bwd as bwd};
use crate::contracts::{
    BlockPlan, BlockwiseDims, BlockwiseFloats, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads,
    BlockwiseMmOutputs, Clamp, WeightLayout,
};
use crate::error::Result;
use crate::tensor::{DType, Floats, Tensor};
use crate::uninit::{assume_init, assume_init_ref, uninit, write_copy, zero};

/// Fewest rows of a weight gradient's band (but for a gradient with fewer rows): each band's
/// product packs all of its `[m, n]` operand again, so thin bands of an expert with many rows
/// repeat the packing many times. Measured on the Intel Xeon with every token routed to one of
/// qwen3-moe-small's experts (m = 2048, r = 256): bands of 32 rows spent 13% of
/// `blockwise_mm_bwd` packing.
const MIN_BAND_ROWS: usize = 128;

/// Bytes of f32 results of a weight gradient computed at a time before they are rounded to the
/// output's dtype and screened: small enough to still be in L2 cache.
const ROUNDED_PIECE_BYTES: usize = 256 << 10;

/// Most rows of one expert that one task computes: a forward run stops adding blocks before
/// it would exceed this, and the backward splits experts with more into pieces of at least
/// this many rows ([`piece_rows`]; the last one shorter).
const TASK_ROWS: usize = 256;

/// Bytes of an expert's token rows `[m, H]` in f32 that a piece of the backward holds, where
/// [`TASK_ROWS`] rows take fewer: each piece repacks the expert's weights for its `d act` and
/// `d x`, and each band of a weight gradient packs its `[m, n]` operand, so at a small H
/// longer pieces pay for less packing. Measured on Zen 4 at qwen3-moe-small (H = 256), T =
/// 2048, B = 32, four runs of each build alternating: `blockwise_mm_bwd` took 19.65–20.06 ms
/// with pieces of 512 rows against 20.18–20.85 ms with 256; 1024 rows were no faster.
const PIECE_BYTES: usize = 512 << 10;

/// Rows of a piece of the backward's row-wise stage at hidden size `h` (and of a weight
/// gradient band's share of the inner dimension): [`TASK_ROWS`], or as many as fit
/// [`PIECE_BYTES`] of f32 token rows when more do. From the shape alone, so the pieces never
/// depend on the thread count.
fn piece_rows(h: usize) -> usize {
    (PIECE_BYTES / (size_of::<f32>() * h.max(1))).max(TASK_ROWS)
}

/// A forward task: consecutive blocks of the plan, either of one expert with real slots
/// (`expert: Some`) or a single block of padding only (`None`, such as the unused blocks after
/// the used ones), whose checkpoint parts are zeros.
struct BlockRun {
    expert: Option<usize>,
    /// The expert of the run's blocks (padding only included).
    block_expert: usize,
    blocks: Range<usize>,
    /// The real (non-padding) slots `n·B + j`, ascending.
    slots: Vec<usize>,
    /// The token in each real slot.
    tokens: Vec<usize>,
}

/// Cuts the plan into [`BlockRun`]s covering every block, in block order: a run of an expert
/// takes the next block of the same expert while its real rows stay within [`TASK_ROWS`].
fn block_runs(plan: BlockPlan<'_>) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for block in 0..plan.blocks() {
        let real = plan.real_slots(block).count();
        let expert = (real > 0).then(|| plan.expert(block));
        let joins = runs.last().is_some_and(|run| {
            expert.is_some() && run.expert == expert && run.slots.len() + real <= TASK_ROWS
        });
        if !joins {
            runs.push(BlockRun {
                expert,
                block_expert: plan.expert(block),
                blocks: block..block,
                slots: Vec::new(),
                tokens: Vec::new(),
            });
        }
        let run = runs.last_mut().expect("a run was pushed above");
        run.blocks.end = block + 1;
        for (slot, token) in plan.real_slots(block) {
            run.slots.push(slot);
            run.tokens.push(token);
        }
    }
    runs
}

/// Splits `buffer` (`[N, per_block]` in block order) into the runs' consecutive parts.
fn split_by_runs<'a, T>(
    buffer: &'a mut [T],
    runs: &[BlockRun],
    per_block: usize,
) -> Vec<&'a mut [T]> {
    split_into(buffer, runs.iter().map(|run| run.blocks.len() * per_block))
}

/// Splits the front of `buffer` into consecutive parts of `lens`.
fn split_into<T>(mut buffer: &mut [T], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [T]> {
    lens.into_iter()
        .map(|len| {
            let (part, rest) = std::mem::take(&mut buffer).split_at_mut(len);
            buffer = rest;
            part
        })
        .collect()
}

/// One expert's share of the plan: its real (non-padding) slots in plan order.
struct ExpertRows {
    expert: usize,
    /// Plan positions `n·B + j`.
    slots: Vec<usize>,
    /// The token in each slot.
    tokens: Vec<usize>,
}

/// Groups the plan's real slots by expert, in ascending expert id.
fn group_by_expert(plan: BlockPlan<'_>, dims: BlockwiseDims) -> Vec<ExpertRows> {
    let mut groups: Vec<ExpertRows> = (0..dims.e)
        .map(|expert| ExpertRows {
            expert,
            slots: Vec::new(),
            tokens: Vec::new(),
        })
        .collect();
    for run in block_runs(plan) {
        if let Some(expert) = run.expert {
            groups[expert].slots.extend(run.slots);
            groups[expert].tokens.extend(run.tokens);
        }
    }
    groups.retain(|g| !g.slots.is_empty());
    groups
}

/// For each token, the rows holding its expert outputs, in ascending expert order. A row is
/// named by a key `(a, b)` that the caller resolves (a plan slot, or a group and a row).
struct TokenRows {
    offsets: Vec<usize>,
    entries: Vec<(usize, usize)>,
}

impl TokenRows {
    /// `rows` yields `(token, key)` pairs in ascending expert order.
    fn new(t: usize, rows: impl IntoIterator<Item = (usize, (usize, usize))>) -> Self {
        let rows: Vec<(usize, (usize, usize))> = rows.into_iter().collect();
        let mut offsets = vec![0usize; t + 1];
        for &(token, _) in &rows {
            offsets[token + 1] += 1;
        }
        for i in 0..t {
            offsets[i + 1] += offsets[i];
        }
        let mut fill = offsets.clone();
        let mut entries = vec![(0, 0); offsets[t]];
        for (token, key) in rows {
            entries[fill[token]] = key;
            fill[token] += 1;
        }
        Self { offsets, entries }
    }

    /// Writes `out [T, H]`: each token's row is the sum over its keys, in order, of
    /// `weight(token, key) · row(key)`, added to 0.
    fn combine<'r>(
        &self,
        out: &mut [MaybeUninit<f32>],
        h: usize,
        weight: impl Fn(usize, (usize, usize)) -> f32 + Sync,
        row: impl Fn((usize, usize)) -> &'r [f32] + Sync,
    ) {
        out.par_chunks_mut(h).enumerate().for_each(|(token, out)| {
            let ahead = (token + PREFETCH_ROWS_AHEAD).min(self.offsets.len() - 2);
            for &key in &self.entries[self.offsets[ahead]..self.offsets[ahead + 1]] {
                prefetch(row(key));
            }
            let out = zero(out);
            for &key in &self.entries[self.offsets[token]..self.offsets[token + 1]] {
                add_scaled(out, weight(token, key), row(key));
            }
        });
    }
}

/// What every padding slot of each expert holds when the zero row has outputs (a bias, or a
/// clamp that moves 0): its clamped gate/up values `[E, 2I]` and its down projection `[E, H]`,
/// computed once per expert.
struct PaddingOutputs {
    gate_up: Vec<f32>,
    down: Vec<f32>,
    /// 2I and H.
    widths: (usize, usize),
}

impl PaddingOutputs {
    /// The zero row through every expert of `call`.
    fn new(call: &BlockwiseMm<'_>) -> Self {
        let (inputs, params) = (call.floats(), call.params());
        let BlockwiseDims { h, e, i, .. } = call.dims();
        let mut out = Self {
            gate_up: Vec::with_capacity(e * 2 * i),
            down: Vec::with_capacity(e * h),
            widths: (2 * i, h),
        };
        let (mut act, mut y) = (vec![0.0; i], vec![0.0; h]);
        let (mut panel, mut tile) = (Vec::new(), Vec::new());
        for expert in 0..e {
            let mut gate_up = match inputs.gate_and_up_proj_bias {
                Some(bias) => bias_row(bias, expert, 2 * i),
                None => vec![0.0; 2 * i],
            };
            clamp_rows(&mut gate_up, i, params.clamp);
            let (gate, up) = gate_up.split_at(i);
            gated::forward(params.activation_function, gate, up, &mut act);
            if call.compute_dtype() == DType::BF16 {
                round_to_bf16(&mut act, &mut []);
            }
            ExpertMatrix::of(
                inputs.down_proj_weight,
                params.weight_layout,
                expert,
                (i, h),
            )
            .product(&mut y, &act, (&mut panel, &mut tile));
            if let Some(bias) = inputs.down_proj_bias {
                add_bias_rows(&mut y, &bias_row(bias, expert, h));
            }
            out.gate_up.extend_from_slice(&gate_up);
            out.down.extend_from_slice(&y);
        }
        out
    }

    /// Expert `expert`'s `(gate_up [2I], down [H])`.
    fn of(&self, expert: usize) -> (&[f32], &[f32]) {
        let (gate_up, down) = self.widths;
        (
            &self.gate_up[expert * gate_up..(expert + 1) * gate_up],
            &self.down[expert * down..(expert + 1) * down],
        )
    }
}

/// Row T of `output`: what the padding slots add. Under POST_SCALE their affinity (row T of
/// `expert_affinities_masked`) is 0, so nothing; otherwise, when the zero row has outputs,
/// each padding slot's expert output, summed by expert in ascending order, or without
/// `is_tensor_update_accumulating` the last padding slot's in plan order (each slot stores it).
fn padding_row_output(call: &BlockwiseMm<'_>, padding: Option<&PaddingOutputs>) -> Vec<f32> {
    let BlockwiseDims { h, e, b, .. } = call.dims();
    let mut row = vec![0.0f32; h];
    let Some(padding) = padding.filter(|_| {
        !call
            .params()
            .expert_affinities_scaling_mode
            .scales_outputs()
    }) else {
        return row;
    };
    let plan = call.plan();
    if !call.params().is_tensor_update_accumulating {
        let last = (0..plan.blocks())
            .rev()
            .find(|&block| plan.real_slots(block).count() < b);
        if let Some(block) = last {
            row.copy_from_slice(padding.of(plan.expert(block)).1);
        }
        return row;
    }
    let mut slots = vec![0usize; e];
    for block in 0..plan.blocks() {
        slots[plan.expert(block)] += b - plan.real_slots(block).count();
    }
    for (expert, &count) in slots.iter().enumerate() {
        for (sum, y) in row.iter_mut().zip(padding.of(expert).1) {
            *sum += count as f32 * y;
        }
    }
    row
}

/// Writes `values` into `row`, or zeros.
fn fill(row: &mut [MaybeUninit<f32>], values: Option<&[f32]>) {
    match values {
        Some(values) => {
            write_copy(row, values);
        }
        None => {
            zero(row);
        }
    }
}

/// Per-task buffers: one per thread of the pool ([`PerThread`]), reused from one task to the
/// next.
#[derive(Default)]
struct Scratch {
    /// Token rows (forward), or a row of d output widened to f32 (backward).
    x: Vec<f32>,
    /// Token rows in bf16, each padded to an even length (forward).
    x_bf16: Vec<bf16>,
    /// A panel of bf16 weights widened to f32.
    panel: Vec<f32>,
    /// A tile of results of the bf16 dot-product kernel.
    tile: Vec<f32>,
    /// SwiGLU activations (forward).
    act: Vec<f32>,
    /// Expert outputs before affinity scaling: the forward's, where a run's real slots are
    /// not consecutive, or a row of the backward's checkpoint widened to f32.
    y: Vec<f32>,
    /// gate/up rows: the forward's products, or the backward's, from the checkpoint.
    gate_up: Vec<f32>,
    /// Gradient of the activations (backward).
    d_act: Vec<f32>,
    /// A piece of a weight gradient's results (backward).
    results: Vec<f32>,
    /// A piece's columns of a weight gradient's bf16 `a`, transposed into rows (backward).
    a_t: Vec<bf16>,
}

/// One expert's `[m, ·]` matrices that its weight gradients read; reused from one expert to the
/// next.
#[derive(Default)]
struct ExpertGrads {
    x: Vec<f32>,
    d_y: Vec<f32>,
    act: Vec<f32>,
    d_gate_up: Vec<f32>,
    /// Their bf16 copies, when the weight gradients run on pair dot products.
    bf16: BF16Grads,
}

/// The bf16 copies of [`ExpertGrads`]' matrices.
#[derive(Default)]
struct BF16Grads {
    x: Vec<bf16>,
    d_y: Vec<bf16>,
    act: Vec<bf16>,
    d_gate_up: Vec<bf16>,
}

/// How the forward's f32 expert outputs `down` (which the combine reads) hold a run's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DownLayout {
    /// `[blocks, B, H]`: every slot of the run's blocks, padding slots included: the layout of
    /// the checkpoint `down_activations`.
    Slots,
    /// `[m, H]`: the run's m real rows only, in slot order, when no checkpoint is asked for (a
    /// plan's padding slots may outnumber its real ones by far).
    Packed,
}

impl DownLayout {
    /// `down`'s elements for `run`.
    fn run_len(self, run: &BlockRun, b: usize, h: usize) -> usize {
        match self {
            Self::Slots => run.blocks.len() * b * h,
            Self::Packed => run.slots.len() * h,
        }
    }
}

/// A run's share of the forward's outputs: its rows of `down` in f32 (laid out as `layout`
/// says) and, when checkpointing, its blocks of `gate_up_t [blocks, 2I, B]` in `G` and, when
/// the checkpoint's dtype `D` is not f32, of its copy of `down` in `D`.
struct RunOutputs<'a, G, D> {
    layout: DownLayout,
    down: &'a mut [MaybeUninit<f32>],
    down_rounded: Option<&'a mut [MaybeUninit<D>]>,
    gate_up_t: Option<&'a mut [MaybeUninit<G>]>,
}

/// `scratch.gate_up [m, 2I] = x · W` for the token rows `tokens`, read as stored in `layout`,
/// each row multiplied first by its entry of `row_scales` when given (PRE_SCALE), then rounded
/// to `compute` (bf16 or f32).
fn gate_up_product(
    (inputs, layout, compute): (&BlockwiseFloats<'_>, WeightLayout, DType),
    dims: BlockwiseDims,
    (expert, tokens): (usize, &[usize]),
    row_scales: Option<&[f32]>,
    scratch: &mut Scratch,
) {
    let BlockwiseDims { h, i, .. } = dims;
    let m = tokens.len();
    let Scratch {
        x,
        x_bf16: rows,
        panel,
        tile,
        gate_up,
        ..
    } = scratch;
    let gate_up = resized(gate_up, m * 2 * i);
    let lda = h.next_multiple_of(2);
    // With bf16 weights and token rows, their products are exact in f32, so the pairwise
    // bf16 dot product gives the f32 sums at twice the f32 rate, without widening the weights.
    let matrix = ExpertMatrix::gate_up(inputs, layout, expert, (h, i));
    let pair_dots = matrix.takes_bf16_rows();
    match inputs.hidden_states {
        // Token rows stored in bf16 and not scaled: copied as they are.
        Floats::BF16(x) if pair_dots && row_scales.is_none() => {
            rows.clear();
            for &token in tokens {
                rows.extend_from_slice(&x[token * h..(token + 1) * h]);
                rows.resize(rows.len().next_multiple_of(2), bf16::ZERO);
            }
            matrix.product_bf16(gate_up, (rows, lda));
        }
        _ => {
            let x = resized(x, m * h);
            gather_rows(inputs.hidden_states, tokens, h, x);
            if let Some(scales) = row_scales {
                scale_rows(x, h, scales);
            }
            match compute {
                DType::BF16 if pair_dots => {
                    bf16_rows(rows, x, h);
                    matrix.product_bf16(gate_up, (rows, lda));
                }
                DType::BF16 => {
                    round_to_bf16(x, &mut []);
                    matrix.product(gate_up, x, (panel, tile));
                }
                DType::F32 | DType::I32 => matrix.product(gate_up, x, (panel, tile)),
            }
        }
    }
}

/// The forward's down projection `[m, I] · [I, H]` of one expert's activations
/// (`scratch.act`), which [`DownProduct::new`] rounds to the compute dtype: on bf16 pair dot
/// products where the activations are bf16 and so are the weights.
struct DownProduct<'a> {
    matrix: ExpertMatrix<'a>,
    /// Whether the activations were rounded into `scratch.x_bf16` (row stride I rounded up to
    /// even) for the pair dot products.
    pair_dots: bool,
    /// The activations' m and I.
    m: usize,
    i: usize,
}

impl<'a> DownProduct<'a> {
    /// The product of the `m` rows of activations in `scratch.act`.
    fn new(call: &BlockwiseMm<'a>, expert: usize, m: usize, scratch: &mut Scratch) -> Self {
        let BlockwiseDims { h, i, .. } = call.dims();
        let (weights, layout) = (call.floats().down_proj_weight, call.params().weight_layout);
        let matrix = ExpertMatrix::of(weights, layout, expert, (i, h));
        let bf16_compute = call.compute_dtype() == DType::BF16;
        let pair_dots = bf16_compute && matrix.takes_bf16_rows();
        let act = &mut scratch.act[..m * i];
        if pair_dots {
            bf16_rows(&mut scratch.x_bf16, act, i);
        } else if bf16_compute {
            round_to_bf16(act, &mut []);
        }
        Self {
            matrix,
            pair_dots,
            m,
            i,
        }
    }

    /// `dst [m, H]` = the activations times the weights.
    fn product(&self, dst: &mut [f32], scratch: &mut Scratch) {
        if self.pair_dots {
            let lda = self.i.next_multiple_of(2);
            self.matrix.product_bf16(dst, (&scratch.x_bf16, lda));
        } else {
            let panels = (&mut scratch.panel, &mut scratch.tile);
            self.matrix
                .product(dst, &scratch.act[..self.m * self.i], panels);
        }
    }

    /// [`Self::product`] into memory not yet written; returns `dst` as the values it now
    /// holds.
    fn product_into<'d>(
        &self,
        dst: &'d mut [MaybeUninit<f32>],
        scratch: &mut Scratch,
    ) -> &'d mut [f32] {
        if self.pair_dots {
            let dst = zero(dst);
            self.product(dst, scratch);
            dst
        } else {
            let panels = (&mut scratch.panel, &mut scratch.tile);
            self.matrix
                .product_into(dst, &scratch.act[..self.m * self.i], panels)
        }
    }
}

/// Runs one [`BlockRun`]: writes its rows of `down` (expert outputs before affinity scaling,
/// zeros in padding slots), their rounded copy, and its blocks of `gate_up_t`. Returns whether
/// every value it wrote is finite in its dtype.
fn run_forward<G: Element, D: Element>(
    call: &BlockwiseMm<'_>,
    run: &BlockRun,
    padding: Option<&PaddingOutputs>,
    out: RunOutputs<'_, G, D>,
    scratch: &mut Scratch,
) -> bool {
    let RunOutputs {
        layout,
        down,
        down_rounded,
        gate_up_t,
    } = out;
    // The checkpoints are per slot: only the slot layout of `down` goes with them.
    assert!(
        layout == DownLayout::Slots || (down_rounded.is_none() && gate_up_t.is_none()),
        "checkpoints need the slot layout of down"
    );
    let finite = run_products::<G, D>(call, run, padding, layout, (down, gate_up_t), scratch);
    match down_rounded {
        // SAFETY: `run_products` wrote the run's rows of `down` whole.
        Some(rounded) => write_rounded(rounded, unsafe { assume_init_ref(down) }) && finite,
        None => finite,
    }
}

/// [`run_forward`]'s products: the run's rows of `down` and blocks of `gate_up_t`. Returns
/// whether every value of `down` is finite in `D` and of `gate_up_t` in `G`.
fn run_products<G: Element, D: Element>(
    call: &BlockwiseMm<'_>,
    run: &BlockRun,
    padding: Option<&PaddingOutputs>,
    layout: DownLayout,
    (down, gate_up_t): (&mut [MaybeUninit<f32>], Option<&mut [MaybeUninit<G>]>),
    scratch: &mut Scratch,
) -> bool {
    let (inputs, dims) = (&call.floats(), call.dims());
    let act_fn = call.params().activation_function;
    let BlockwiseDims { h, i, b, .. } = dims;
    let m = run.tokens.len();
    // What a padding slot of this run's expert holds: zeros, or the zero row's outputs.
    let (padding_gate_up, padding_down) = match padding {
        Some(p) => {
            let (gate_up, down) = p.of(run.block_expert);
            (Some(gate_up), Some(down))
        }
        None => (None, None),
    };
    let Some(expert) = run.expert.filter(|_| m > 0) else {
        // Packed, a run of padding only has no rows of `down`.
        for row in down.chunks_exact_mut(h) {
            fill(row, padding_down);
        }
        if let Some(gate_up_t) = gate_up_t {
            let (mut band, mut streamer) = (Vec::new(), Streamer::new());
            for block_t in gate_up_t.chunks_exact_mut(2 * i * b) {
                let source = (&vec![None; b][..], &[][..]);
                transpose_block(block_t, source, padding_gate_up, (&mut band, &mut streamer));
            }
        }
        // The padding outputs are screened once, in `forward`.
        return true;
    };
    let clamp = call.params().clamp;
    let scaling = call.params().expert_affinities_scaling_mode;
    // The run's own affinities only (widening the whole tensor per run would cost more than
    // the run's rows). Exact: f32 and bf16 values embed in f64.
    let row_scales: Option<Vec<f32>> = scaling.scales_rows().then(|| {
        let affinities = inputs.expert_affinities_masked;
        run.tokens
            .iter()
            .map(|&token| affinities.get(token * dims.e + expert).unwrap_or(0.0))
            .collect()
    });
    let weight_layout = call.params().weight_layout;
    let compute = call.compute_dtype();
    gate_up_product(
        (inputs, weight_layout, compute),
        dims,
        (expert, &run.tokens),
        row_scales.as_deref(),
        scratch,
    );
    let gate_up = &mut scratch.gate_up[..m * 2 * i];
    if let Some(bias) = inputs.gate_and_up_proj_bias {
        add_bias_rows(gate_up, &bias_row(bias, expert, 2 * i));
    }
    clamp_rows(gate_up, i, clamp);
    let mut finite = all_fit::<G>(gate_up);
    let act = resized(&mut scratch.act, m * i);
    for (gu, act) in gate_up.chunks(2 * i).zip(act.chunks_mut(i)) {
        let (gate, up) = gu.split_at(i);
        gated::forward(act_fn, gate, up, act);
    }
    let down_proj = DownProduct::new(call, expert, m, scratch);

    // The run's slots relative to its first block's first slot.
    let first = run.blocks.start * b;
    let (start, end) = (run.slots[0] - first, run.slots[m - 1] - first + 1);
    // Where the run's m rows lie consecutively in `down`, if they do.
    let rows_at = match layout {
        DownLayout::Packed => Some(0),
        DownLayout::Slots => (end - start == m).then_some(start),
    };
    if let Some(start) = rows_at {
        // Consecutive real slots (padding only around them), or packed rows: the product
        // writes its rows in place.
        let (before, rows) = down.split_at_mut(start * h);
        let (rows, after) = rows.split_at_mut(m * h);
        for row in before.chunks_exact_mut(h).chain(after.chunks_exact_mut(h)) {
            fill(row, padding_down);
        }
        let rows = down_proj.product_into(rows, scratch);
        if let Some(bias) = inputs.down_proj_bias {
            add_bias_rows(rows, &bias_row(bias, expert, h));
        }
        finite &= all_fit::<D>(rows);
    } else {
        let mut y = std::mem::take(&mut scratch.y);
        down_proj.product(resized(&mut y, m * h), scratch);
        scratch.y = y;
        let y = &mut scratch.y[..m * h];
        if let Some(bias) = inputs.down_proj_bias {
            add_bias_rows(y, &bias_row(bias, expert, h));
        }
        finite &= all_fit::<D>(y);
        let mut real = run.slots.iter().map(|slot| slot - first).zip(y.chunks(h));
        let mut next = real.next();
        for (slot, row) in down.chunks_exact_mut(h).enumerate() {
            match next {
                Some((real_slot, values)) if real_slot == slot => {
                    write_copy(row, values);
                    next = real.next();
                }
                _ => fill(row, padding_down),
            }
        }
    }

    if let Some(gate_up_t) = gate_up_t {
        // Each slot's row of `gate_up`, or none for padding.
        let mut source = vec![None; run.blocks.len() * b];
        for (row, slot) in run.slots.iter().enumerate() {
            source[slot - first] = Some(row);
        }
        let (mut band, mut streamer) = (Vec::new(), Streamer::new());
        for (block_t, source) in gate_up_t.chunks_exact_mut(2 * i * b).zip(source.chunks(b)) {
            let source = (source, &scratch.gate_up[..m * 2 * i]);
            transpose_block(block_t, source, padding_gate_up, (&mut band, &mut streamer));
        }
    }
    finite
}

pub(super) fn forward(call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
    let checkpoint_dtypes = (
        call.output_dtype_of(&fwd::GATE_UP_ACTIVATIONS_T),
        call.output_dtype_of(&fwd::DOWN_ACTIVATIONS),
    );
    match checkpoint_dtypes {
        _ if !call.params().checkpoint_activation => forward_as::<f32, f32>(call),
        (DType::BF16, DType::BF16) => forward_as::<bf16, bf16>(call),
        (DType::BF16, _) => forward_as::<bf16, f32>(call),
        (_, DType::BF16) => forward_as::<f32, bf16>(call),
        _ => forward_as::<f32, f32>(call),
    }
}

/// Splits `buffer` into one part per run of `per_block` elements per block, or gives every
/// run `None` when `buffer` is not written.
fn parts_by_runs<'a, T>(
    buffer: &'a mut [T],
    runs: &[BlockRun],
    per_block: usize,
    written: bool,
) -> Vec<Option<&'a mut [T]>> {
    if written {
        split_by_runs(buffer, runs, per_block)
            .into_iter()
            .map(Some)
            .collect()
    } else {
        runs.iter().map(|_| None).collect()
    }
}

/// The forward with the checkpoints `gate_up_activations_T` in `G` and `down_activations` in
/// `D`, each rounded where it is produced.
fn forward_as<G: Element, D: Element>(call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
    let (inputs, dims) = (call.inputs(), call.dims());
    let BlockwiseDims {
        t,
        rows: output_rows,
        h,
        e,
        i,
        b,
        n,
    } = dims;
    let runs = block_runs(call.plan());
    let params = call.params();
    let checkpoint = params.checkpoint_activation;
    let padding = inputs
        .padding_has_outputs(params.clamp)
        .then(|| PaddingOutputs::new(call));

    // The expert outputs land in `down` in f32: in the checkpoint's layout `[N, B, H]` when it
    // is returned (a checkpoint in another dtype is a rounded copy), else only the real rows.
    let (gate_up_shape, down_shape) = ([n, 2, i, b], [n, b, h]);
    let (layout, mut down) = if checkpoint {
        let down = output_buffer::<f32>(fwd::DOWN_ACTIVATIONS.name, &down_shape)?;
        (DownLayout::Slots, down)
    } else {
        let rows = runs.iter().map(|run| run.slots.len()).sum();
        let down = output_buffer::<f32>(fwd::DOWN_ACTIVATIONS.name, &[rows, h])?;
        (DownLayout::Packed, down)
    };
    let rounds_down = checkpoint && D::DTYPE != DType::F32;
    // Buffers of outputs not written are empty: N = 0 blocks.
    let (checkpoint_blocks, rounded_blocks) = (
        if checkpoint { n } else { 0 },
        if rounds_down { n } else { 0 },
    );
    let mut down_rounded = output_buffer::<D>(fwd::DOWN_ACTIVATIONS.name, &[rounded_blocks, b, h])?;
    let mut gate_up_t = output_buffer::<G>(
        fwd::GATE_UP_ACTIVATIONS_T.name,
        &[checkpoint_blocks, 2, i, b],
    )?;
    let gate_up_parts = parts_by_runs(&mut gate_up_t, &runs, 2 * i * b, checkpoint);
    let down_rounded_parts = parts_by_runs(&mut down_rounded, &runs, b * h, rounds_down);
    let scratch = PerThread::<Scratch>::new();
    let fits = split_into(&mut down, runs.iter().map(|run| layout.run_len(run, b, h)))
        .into_par_iter()
        .zip(down_rounded_parts)
        .zip(gate_up_parts)
        .zip(&runs)
        .map(|(((down, down_rounded), gate_up_t), run)| {
            let out = RunOutputs {
                layout,
                down,
                down_rounded,
                gate_up_t,
            };
            scratch.with(|scratch| run_forward(call, run, padding.as_ref(), out, scratch))
        })
        .reduce(|| true, |a, b| a && b)
        && padding
            .as_ref()
            .is_none_or(|p| all_fit::<G>(&p.gate_up) && all_fit::<D>(&p.down));
    // SAFETY: the runs cover every block (and, packed, every routed row), and each run wrote
    // its part of every buffer it was given whole; the buffers it was not given are empty.
    let (down, down_rounded, gate_up_t) = unsafe {
        (
            assume_init(down),
            assume_init(down_rounded),
            assume_init(gate_up_t),
        )
    };

    // Combine in ascending expert order (runs of one expert in block order). Each real row's
    // key is (expert, its row of `down`).
    let mut packed_start = 0;
    let mut by_expert: Vec<(&BlockRun, usize)> = runs
        .iter()
        .map(|run| {
            let start = packed_start;
            packed_start += run.slots.len();
            (run, start)
        })
        .filter(|(run, _)| run.expert.is_some())
        .collect();
    by_expert.sort_by_key(|(run, _)| run.expert);
    let rows = by_expert.iter().flat_map(|&(run, packed_start)| {
        let expert = run.expert.expect("filtered to experts");
        run.tokens
            .iter()
            .zip(&run.slots)
            .enumerate()
            .map(move |(k, (&token, &slot))| {
                let row = match layout {
                    DownLayout::Slots => slot,
                    DownLayout::Packed => packed_start + k,
                };
                (token, (expert, row))
            })
    });
    let affinities = call.floats().expert_affinities_masked.to_f32();
    let mut output = output_buffer(fwd::OUTPUT.name, &[output_rows, h])?;
    let (tokens, padding_row) = output.split_at_mut(t * h);
    TokenRows::new(t, rows).combine(
        tokens,
        h,
        |token, (expert, _)| {
            if params.expert_affinities_scaling_mode.scales_outputs() {
                affinities[token * e + expert]
            } else {
                1.0
            }
        },
        |(_, row)| &down[row * h..(row + 1) * h],
    );
    if dims.has_padding_row() {
        write_copy(padding_row, &padding_row_output(call, padding.as_ref()));
    }
    // SAFETY: `combine` wrote every token's row, and the padding row, if any, is written.
    let output = finite_output(fwd::OUTPUT.name, &[output_rows, h], unsafe {
        assume_init(output)
    })?;

    // Checked after `output`, as the reference checks them. Intermediates the caller does not
    // keep are not checked: a non-finite one reaches `output`.
    let (gate_up_activations_t, down_activations) = if checkpoint {
        let gate_up_t = screened_output(
            fwd::GATE_UP_ACTIVATIONS_T.name,
            &gate_up_shape,
            gate_up_t,
            fits,
        )?;
        let down = if rounds_down {
            screened_output(fwd::DOWN_ACTIVATIONS.name, &down_shape, down_rounded, fits)?
        } else {
            screened_output(fwd::DOWN_ACTIVATIONS.name, &down_shape, down, fits)?
        };
        (Some(gate_up_t), Some(down))
    } else {
        (None, None)
    };
    Ok(BlockwiseMmOutputs {
        output,
        gate_up_activations_t,
        down_activations,
    })
}

/// Writes one block's rows, transposed and rounded to `G`, into the whole of `block_t [C, B]` (C =
/// `block_t.len() / B`, B = `source.len()`): column j is row `source[j]` of `rows [·, C]`, and
/// for padding (`None`) the row `padding [C]`, or zeros. Works in [`TILE`] × [`TILE`] tiles
/// ([`transpose_into`]), so every read is a contiguous run of up to 16 values; each band of
/// [`TILE`] rows of `block_t` is assembled in `band` and then streamed out whole
/// ([`Streamer`]), since nothing reads the checkpoint until the backward.
fn transpose_block<G: Element>(
    block_t: &mut [MaybeUninit<G>],
    (source, rows): (&[Option<usize>], &[f32]),
    padding: Option<&[f32]>,
    (band, streamer): (&mut Vec<G>, &mut Streamer),
) {
    let b = source.len();
    let c = block_t.len() / b;
    band.resize(TILE * b, G::round(0.0));
    // A tile's columns before they are rounded, when `G` is not f32.
    let mut columns = [0.0; TILE * TILE];
    for c0 in (0..c).step_by(TILE) {
        let cols = (c - c0).min(TILE);
        for j0 in (0..b).step_by(TILE) {
            let slots = &source[j0..(j0 + TILE).min(b)];
            let mut tile: [Option<&[f32]>; TILE] = [None; TILE];
            for (row, slot) in tile.iter_mut().zip(slots) {
                *row = match (*slot, padding) {
                    (Some(r), _) => Some(&rows[r * c + c0..][..cols]),
                    (None, Some(p)) => Some(&p[c0..c0 + cols]),
                    (None, None) => None,
                };
            }
            let tile = &tile[..slots.len()];
            if let Some(band) = G::as_f32_mut(band) {
                transpose_into(tile, cols, &mut band[j0..], b);
                continue;
            }
            transpose_into(tile, cols, &mut columns, TILE);
            for (out, column) in band.chunks_mut(b).zip(columns.chunks(TILE)).take(cols) {
                for (value, &v) in out[j0..j0 + slots.len()].iter_mut().zip(column) {
                    *value = G::round(v);
                }
            }
        }
        streamer.copy(&mut block_t[c0 * b..(c0 + cols) * b], &band[..cols * b]);
    }
}

/// Per-expert results that are not weight gradients: the input gradient of each row and the
/// affinity gradient of each row.
struct ExpertBackward {
    d_x: Vec<f32>,
    d_affinity: Vec<f32>,
    /// `[2I]` and `[H]`: the biases' gradients, summed over the rows in order (with `bias`).
    d_biases: Option<(Vec<f32>, Vec<f32>)>,
    /// Whether every weight gradient value it wrote is finite in the output dtype.
    weights_fit: bool,
}

/// One piece of an expert's rows in the backward's row-wise stage: its slots and tokens, and
/// the rows of the expert's matrices it writes.
struct RowPiece<'a> {
    slots: &'a [usize],
    tokens: &'a [usize],
    /// `[m, H]`: the piece's token rows as the gate/up projection saw them (multiplied by the
    /// affinity under PRE_SCALE).
    x: &'a mut [f32],
    /// `[m, H]`: d output, times the affinity under POST_SCALE.
    d_y: &'a mut [f32],
    /// `[m, I]`: act(gate) ⊙ up, recomputed from the checkpoint.
    act: &'a mut [f32],
    /// `[m, 2I]`.
    d_gate_up: &'a mut [f32],
    /// The bf16 copies of `x`, `d_y`, `act` and `d_gate_up`, when the weight gradients run on
    /// pair dot products; empty otherwise.
    bf16: [&'a mut [bf16]; 4],
    /// `[m, H]`, written whole.
    d_x: &'a mut [MaybeUninit<f32>],
    /// `[m]`.
    d_affinity: &'a mut [f32],
}

/// The row-wise backward of one piece of expert `expert`'s rows: every gradient but the
/// weights'.
fn rows_backward(
    call: &BlockwiseMmBwd<'_>,
    (affinities, checkpoint): (&[f32], Floats<'_>),
    expert: usize,
    piece: RowPiece<'_>,
    s: &mut Scratch,
) {
    let inputs = call.floats();
    let forward = inputs.forward;
    let BlockwiseDims { e, h, i, b, .. } = call.dims();
    let m = piece.tokens.len();
    let scaling = call.params().expert_affinities_scaling_mode;
    let affinity = |row: usize| affinities[piece.tokens[row] * e + expert];

    // POST_SCALE: d y = affinity · d output, d affinity = ⟨d output, y⟩, one pass over each
    // row, reading d output and the checkpoint y where they are stored (widened a row at a
    // time when bf16). Otherwise d y is d output, and the affinity's gradient comes through
    // the rows (PRE_SCALE) or is zero.
    if scaling.scales_outputs() {
        let d_output = inputs.output_hidden_states_grad;
        let rows = piece
            .d_y
            .chunks_exact_mut(h)
            .zip(piece.tokens.iter().zip(piece.slots));
        for (row, (d_y, (&token, &slot))) in rows.enumerate() {
            let ahead = row + PREFETCH_ROWS_AHEAD;
            if let (Some(&next_token), Some(&next_slot)) =
                (piece.tokens.get(ahead), piece.slots.get(ahead))
            {
                prefetch_row(d_output, next_token, h);
                prefetch_row(inputs.down_proj_act_checkpoint, next_slot, h);
                // The affinity's line too, one per token (Zen 4, `blockwise_mm_bwd` at
                // qwen3-moe-small, T = 2048, alternating calls in one process: 20.37 against
                // 20.57 ms, and 24.46 against 24.62 in a slower hour of the machine).
                prefetch(&affinities[next_token * e + expert..][..1]);
            }
            let d_out = row_f32(d_output, token, h, &mut s.x);
            let y = row_f32(inputs.down_proj_act_checkpoint, slot, h, &mut s.y);
            piece.d_affinity[row] = dot(d_out, y);
            let a = affinity(row);
            for (d, &g) in d_y.iter_mut().zip(d_out) {
                *d = g * a;
            }
        }
    } else {
        gather_rows(inputs.output_hidden_states_grad, piece.tokens, h, piece.d_y);
        piece.d_affinity.fill(0.0);
    }
    let bf16_operands = call.compute_dtype() == DType::BF16;
    let [x16, d_y16, act16, d_gate_up16] = piece.bf16;
    if bf16_operands {
        round_to_bf16(piece.d_y, d_y16);
    }
    // gate/up rows [m, 2I] from the transposed checkpoint [N, 2, I, B].
    let gate_up = resized(&mut s.gate_up, m * 2 * i);
    gather_block_columns(gate_up, checkpoint, piece.slots, b);
    let layout = call.params().weight_layout;
    // d act [m, I] = d y · Dᵀ: on the pair dot products when d y and D are both bf16 (d y's
    // copy is written when the weight gradients take them).
    let d_act = resized(&mut s.d_act, m * i);
    let down_proj = ExpertMatrix::of(forward.down_proj_weight, layout, expert, (i, h));
    if d_y16.is_empty() || !down_proj.transposed_product_bf16(d_act, d_y16) {
        down_proj.transposed_product(d_act, piece.d_y, (&mut s.panel, &mut s.tile));
    }
    // act and d gate_up [m, 2I] through SwiGLU.
    for row in 0..m {
        let (gate, up) = s.gate_up[row * 2 * i..(row + 1) * 2 * i].split_at(i);
        let (d_gate, d_up) = piece.d_gate_up[row * 2 * i..(row + 1) * 2 * i].split_at_mut(i);
        let act_fn = call.params().activation_type;
        gated::backward(
            act_fn,
            gated::Backward {
                gate,
                up,
                d_act: &s.d_act[row * i..(row + 1) * i],
                act: &mut piece.act[row * i..(row + 1) * i],
                d_gate: &mut *d_gate,
                d_up: &mut *d_up,
            },
        );
        // Nothing passes a clamp where the checkpointed value sits at its limit.
        let clamp = call.params().clamp;
        for (values, grads, limits) in [(gate, d_gate, clamp.gate), (up, d_up, clamp.up)] {
            if limits != Clamp::default() {
                for (&v, d) in values.iter().zip(grads.iter_mut()) {
                    if !limits.passes(f64::from(v)) {
                        *d = 0.0;
                    }
                }
            }
        }
    }
    if bf16_operands {
        round_to_bf16(piece.act, act16);
        round_to_bf16(piece.d_gate_up, d_gate_up16);
    }
    // d x [m, H] = d gate_up · Wᵀ, as d act.
    let gate_up_proj = ExpertMatrix::gate_up(&forward, layout, expert, (h, i));
    let panels = (&mut s.panel, &mut s.tile);
    let d_x = if d_gate_up16.is_empty() {
        gate_up_proj.transposed_product_into(piece.d_x, piece.d_gate_up, panels)
    } else {
        let d_x = zero(piece.d_x);
        if !gate_up_proj.transposed_product_bf16(d_x, d_gate_up16) {
            gate_up_proj.transposed_product(d_x, piece.d_gate_up, panels);
        }
        d_x
    };
    gather_rows(forward.hidden_states, piece.tokens, h, piece.x);
    if scaling.scales_rows() {
        // The projection saw x' = affinity · x: d affinity = ⟨d x', x⟩, d x = affinity · d x',
        // and the weight gradient reads x'.
        let rows = piece.x.chunks_exact_mut(h).zip(d_x.chunks_exact_mut(h));
        for (row, (x, d_x)) in rows.enumerate() {
            let a = affinity(row);
            piece.d_affinity[row] = dot(d_x, x);
            for (d, v) in d_x.iter_mut().zip(x.iter_mut()) {
                *d *= a;
                *v *= a;
            }
        }
    }
    if bf16_operands {
        round_to_bf16(piece.x, x16);
    }
}

/// Row `row` of `values [·, width]` in f32: where it is stored, or widened into `buffer`.
fn row_f32<'a>(
    values: Floats<'a>,
    row: usize,
    width: usize,
    buffer: &'a mut Vec<f32>,
) -> &'a [f32] {
    match values.slice(row * width..(row + 1) * width) {
        Floats::F32(stored) => stored,
        stored => {
            let buffer = resized(buffer, width);
            stored.write_f32(buffer);
            buffer
        }
    }
}

/// How many tiles further down a block [`gather_block_columns`] asks for the lines of: the
/// checkpoint comes from memory (the forward streamed it there), one line per row of a tile.
/// Measured on Zen 4, alternating calls in one process (`blockwise_mm_bwd`, qwen3-moe-small,
/// T = 2048): 20.78 against 21.08 ms and 20.50 against 20.65 with the lines of the tile 4
/// ahead, 20.79 against 21.10 with those 2 ahead; a whole block's lines asked for at once, 21.36
/// against 21.15.
const GATHER_TILES_AHEAD: usize = 4;

/// `dst [m, C]`: row r is slot `slots[r]` of the transposed checkpoint `blocks [N, C, B]` (slot
/// n·B + j is column j of block n), widened to f32. Each run of slots in one block is read in
/// [`TILE`] × [`TILE`] tiles (16 columns of up to 16 consecutive slot positions, the stored
/// rows' contiguous runs) and transposed ([`transpose_into`]): straight into `dst` where the
/// tile's slots are all of its positions, in order (a plan's tokens fill their blocks' slots
/// so), else on the stack, each slot then copying its row.
fn gather_block_columns(dst: &mut [f32], blocks: Floats<'_>, slots: &[usize], b: usize) {
    let c = dst.len() / slots.len().max(1);
    // A bf16 tile's rows, widened; and a tile's columns when not every position is a slot.
    let mut widened: Tile = [[0.0; TILE]; TILE];
    let mut columns = [0.0; TILE * TILE];
    let mut done = 0;
    for run in slots.chunk_by(|x, y| x / b == y / b) {
        let first = run[0] / b * b;
        let block = blocks.slice(first * c..(first + b) * c);
        let rows = &mut dst[done * c..(done + run.len()) * c];
        let (lo, hi) = (run[0] - first, run[run.len() - 1] - first + 1);
        let mut next = 0;
        for j0 in (lo..hi).step_by(TILE) {
            let width = (hi - j0).min(TILE);
            let count = run[next..]
                .iter()
                .take_while(|&&slot| slot - first < j0 + width)
                .count();
            if count == 0 {
                continue;
            }
            let tile_slots = &run[next..next + count];
            let in_order = (0..width).eq(tile_slots.iter().map(|&slot| slot - first - j0));
            for c0 in (0..c).step_by(TILE) {
                let cols = (c - c0).min(TILE);
                let at = |dc: usize| (c0 + dc) * b + j0..(c0 + dc) * b + j0 + width;
                let mut tile: [Option<&[f32]>; TILE] = [None; TILE];
                if let Floats::F32(values) = block {
                    for (dc, row) in tile.iter_mut().take(cols).enumerate() {
                        *row = Some(&values[at(dc)]);
                    }
                } else {
                    for (dc, row) in widened.iter_mut().take(cols).enumerate() {
                        block.slice(at(dc)).write_f32(&mut row[..width]);
                    }
                    for (row, values) in tile.iter_mut().zip(&widened).take(cols) {
                        *row = Some(&values[..width]);
                    }
                }
                let tile = &tile[..cols];
                // The same positions of the rows GATHER_TILES_AHEAD tiles further down.
                let ahead = GATHER_TILES_AHEAD * TILE;
                for dc in ahead..(c - c0).min(ahead + TILE) {
                    prefetch_floats(block.slice(at(dc)));
                }
                if in_order {
                    transpose_into(tile, width, &mut rows[next * c + c0..], c);
                    continue;
                }
                transpose_into(tile, width, &mut columns, TILE);
                for (row, &slot) in rows[next * c..].chunks_exact_mut(c).zip(tile_slots) {
                    let column = &columns[(slot - first - j0) * TILE..][..cols];
                    row[c0..c0 + cols].copy_from_slice(column);
                }
            }
            next += count;
        }
        done += run.len();
    }
}

/// `dst [r, n] = aᵀ · b` for `a [m, r]` and `b [m, n]` (both row-major), rounded to `E` and
/// written whole into memory not yet written, in [`bands`] of `dst`'s rows in parallel, so the
/// bands depend only on the shapes. Each band runs in pieces, screened (and, for bf16, rounded
/// from a scratch buffer) while they are in cache; f32 results are streamed out of a scratch
/// buffer ([`Streamer`]), or written in place where nothing streams. Returns whether every
/// result is finite in `E`.
fn transposed_product<E: Element>(
    dst: &mut [MaybeUninit<E>],
    a: MatRef<'_>,
    b: MatRef<'_>,
    (task_rows, scratch): (usize, &PerThread<Scratch>),
) -> bool {
    let (r, n) = (a.cols(), b.cols());
    let (band, piece) = bands(a.rows(), r, n, task_rows);
    dst.par_chunks_mut(band * n)
        .enumerate()
        .map(|(index, dst)| {
            scratch.with(|Scratch { results, .. }| {
                let mut fits = true;
                let mut streamer = Streamer::new();
                for (k, dst) in dst.chunks_mut(piece * n).enumerate() {
                    let start = index * band + k * piece;
                    // Both operands were just written by the row-wise stage: `b` is in the caches.
                    let (a, b) = (a.columns(start..start + dst.len() / n).t(), b.resident());
                    if !streamer.skips_caches()
                        && let Some(dst) = E::as_f32_slots(dst)
                    {
                        fits &= all_fit::<f32>(matmul_into(dst, a, b));
                        continue;
                    }
                    let results = resized(results, dst.len());
                    matmul(results, a, b, false);
                    fits &= match E::as_f32_slots(dst) {
                        // Nothing reads a weight gradient before the optimizer, after the rest of
                        // the backward: streamed out from the piece's results in cache.
                        Some(dst) => {
                            streamer.copy(dst, results);
                            all_fit::<f32>(results)
                        }
                        None => write_rounded(dst, results),
                    };
                }
                fits
            })
        })
        .reduce(|| true, |a, b| a && b)
}

/// The rows of `dst [r, n] = aᵀ · b` (inner dimension m) that one task computes (a band: one
/// per `task_rows` rows of m ([`piece_rows`]), of at least [`MIN_BAND_ROWS`] rows) and that it
/// computes at a time (a piece: [`ROUNDED_PIECE_BYTES`] of f32 results), from the shapes alone.
fn bands(m: usize, r: usize, n: usize, task_rows: usize) -> (usize, usize) {
    let band = r
        .div_ceil(m.div_ceil(task_rows))
        .max(MIN_BAND_ROWS.min(r))
        .max(1);
    let piece = (ROUNDED_PIECE_BYTES / (size_of::<f32>() * n.max(1))).clamp(1, band);
    (band, piece)
}

/// The gradient of one expert's `W [k, n]` from the rows it multiplied, `inputs [m, k]`, and
/// their products' gradients, `grads [m, n]` (each given with its row length): `dW = inputsᵀ ·
/// grads`, written in `layout` (`[k, n]`, or `[n, k]` as `gradsᵀ · inputs`) by
/// [`transposed_product`], or, given both in bf16, by [`transposed_product_bf16`], in the
/// bands of `task_rows` ([`bands`]), each task on its thread's `scratch`.
fn weight_gradient<E: Element>(
    dst: &mut [MaybeUninit<E>],
    layout: WeightLayout,
    (inputs, grads): ((Floats<'_>, usize), (Floats<'_>, usize)),
    (task_rows, scratch): (usize, &PerThread<Scratch>),
) -> bool {
    let (a, b) = match layout {
        WeightLayout::Nki => (inputs, grads),
        WeightLayout::Linear => (grads, inputs),
    };
    match (a, b) {
        ((Floats::BF16(a), r), (Floats::BF16(b), n)) => {
            transposed_product_bf16(dst, (a, r), (b, n), (task_rows, scratch))
        }
        ((a, r), (b, n)) => {
            let (a, b) = (a.to_f32(), b.to_f32());
            transposed_product(
                dst,
                row_major(&a, r),
                row_major(&b, n),
                (task_rows, scratch),
            )
        }
    }
}

/// The row-major matrix of `values` in rows of `cols`.
fn row_major(values: &[f32], cols: usize) -> MatRef<'_> {
    MatRef::row_major(values, values.len() / cols.max(1), cols)
}

/// [`transposed_product`] for bf16 `a [m, r]` and `b [m, n]` (row-major, each given with its
/// row length) on bf16 pair dot products ([`matmul_bf16`]: exact products, f32 sums, the inner
/// dimension m in pairs), each piece of `dst`'s rows from its columns of `a` transposed into
/// rows of m (padded to even). The same bands and pieces as [`transposed_product`], so the sums
/// never depend on the thread count.
fn transposed_product_bf16<E: Element>(
    dst: &mut [MaybeUninit<E>],
    (a, r): (&[bf16], usize),
    (b, n): (&[bf16], usize),
    (task_rows, scratch): (usize, &PerThread<Scratch>),
) -> bool {
    let m = a.len() / r.max(1);
    let lda = m.next_multiple_of(2);
    let (band, piece) = bands(m, r, n, task_rows);
    dst.par_chunks_mut(band * n)
        .enumerate()
        .map(|(index, dst)| {
            scratch.with(|Scratch { results, a_t, .. }| {
                let mut fits = true;
                for (k, dst) in dst.chunks_mut(piece * n).enumerate() {
                    let (start, rows) = (index * band + k * piece, dst.len() / n);
                    // The piece's columns of `a` as rows of m.
                    a_t.clear();
                    a_t.resize(rows * lda, bf16::ZERO);
                    for (j, a_row) in a.chunks_exact(r).enumerate() {
                        for (c, &v) in a_row[start..start + rows].iter().enumerate() {
                            a_t[c * lda + j] = v;
                        }
                    }
                    let results = resized(results, dst.len());
                    matmul_bf16(results, (a_t, lda), (b, n), (rows, n, m));
                    fits &= write_rounded(dst, results);
                }
                fits
            })
        })
        .reduce(|| true, |a, b| a && b)
}

/// One expert's backward. Writes `d_gate_up_weight` (`[H, 2I]`, or `[2I, H]` in the linear
/// layout) and `d_down_weight` (`[I, H]`, or `[H, I]`) in the weights' output dtypes `G` and
/// `D`; the row-wise stage runs in pieces of [`piece_rows`] rows and the weight gradients in
/// bands, in parallel.
fn expert_backward<G: Element, D: Element>(
    call: &BlockwiseMmBwd<'_>,
    shared: (&[f32], Floats<'_>),
    (group, scratch): (&ExpertRows, &PerThread<Scratch>),
    grads: &mut ExpertGrads,
    (d_gate_up_weight, d_down_weight): (&mut [MaybeUninit<G>], &mut [MaybeUninit<D>]),
) -> ExpertBackward {
    let BlockwiseDims { h, i, .. } = call.dims();
    let m = group.tokens.len();
    let rows = piece_rows(h);
    let mut d_x = uninit::<f32>(m * h);
    let mut d_affinity = vec![0.0f32; m];
    // With bf16 operands and pair dot products, the row-wise stage also writes the weight
    // gradients' operands in bf16.
    let pair_dots = call.compute_dtype() == DType::BF16 && bf16_matmul::available();
    let ExpertGrads {
        x,
        d_y,
        act,
        d_gate_up,
        bf16: copies,
    } = grads;
    let copy_rows = if pair_dots { m } else { 0 };
    for (copy, width) in [
        (&mut copies.x, h),
        (&mut copies.d_y, h),
        (&mut copies.act, i),
        (&mut copies.d_gate_up, 2 * i),
    ] {
        copy.resize(copy_rows * width, bf16::ZERO);
    }
    let copies = row_pieces(&mut copies.x, h, (m, rows))
        .zip(row_pieces(&mut copies.d_y, h, (m, rows)))
        .zip(row_pieces(&mut copies.act, i, (m, rows)))
        .zip(row_pieces(&mut copies.d_gate_up, 2 * i, (m, rows)))
        .map(|(((x, d_y), act), d_gate_up)| [x, d_y, act, d_gate_up]);
    let pieces: Vec<RowPiece<'_>> = group
        .slots
        .chunks(rows)
        .zip(group.tokens.chunks(rows))
        .zip(row_pieces(resized(x, m * h), h, (m, rows)))
        .zip(row_pieces(resized(d_y, m * h), h, (m, rows)))
        .zip(row_pieces(resized(act, m * i), i, (m, rows)))
        .zip(row_pieces(resized(d_gate_up, m * 2 * i), 2 * i, (m, rows)))
        .zip(copies)
        .zip(row_pieces(&mut d_x, h, (m, rows)))
        .zip(row_pieces(&mut d_affinity, 1, (m, rows)))
        .map(
            |((((((((slots, tokens), x), d_y), act), d_gate_up), bf16), d_x), d_affinity)| {
                RowPiece {
                    slots,
                    tokens,
                    x,
                    d_y,
                    act,
                    d_gate_up,
                    bf16,
                    d_x,
                    d_affinity,
                }
            },
        )
        .collect();
    let run_piece = |piece| {
        scratch.with(|scratch| rows_backward(call, shared, group.expert, piece, scratch));
    };
    if pieces.len() == 1 {
        pieces.into_iter().for_each(run_piece);
    } else {
        pieces.into_par_iter().for_each(run_piece);
    }
    // d D = actᵀ · d y;  d W = xᵀ · d gate_up: on the bf16 copies, or the f32 rows.
    let (grads, copies) = (&*grads, &grads.bf16);
    let operand = |values, copy, width| match pair_dots {
        true => (Floats::BF16(copy), width),
        false => (Floats::F32(values), width),
    };
    let layout = call.params().weight_layout;
    let weights_fit = weight_gradient(
        d_down_weight,
        layout,
        (
            operand(&grads.act[..m * i], &copies.act, i),
            operand(&grads.d_y[..m * h], &copies.d_y, h),
        ),
        (rows, scratch),
    ) & weight_gradient(
        d_gate_up_weight,
        layout,
        (
            operand(&grads.x[..m * h], &copies.x, h),
            operand(&grads.d_gate_up[..m * 2 * i], &copies.d_gate_up, 2 * i),
        ),
        (rows, scratch),
    );
    let d_biases = call.params().bias.then(|| {
        (
            column_sums(&grads.d_gate_up[..m * 2 * i], 2 * i),
            column_sums(&grads.d_y[..m * h], h),
        )
    });
    ExpertBackward {
        // SAFETY: the pieces cover d_x, and each piece's `rows_backward` wrote its rows whole.
        d_x: unsafe { assume_init(d_x) },
        d_affinity,
        d_biases,
        weights_fit,
    }
}

/// `buffer [m, width]` in the pieces of `rows` rows ([`piece_rows`]) the row-wise stage splits
/// an expert's m rows into; an empty `buffer` gives an empty slice for each piece.
fn row_pieces<T>(
    buffer: &mut [T],
    width: usize,
    (m, rows): (usize, usize),
) -> impl Iterator<Item = &mut [T]> {
    buffer
        .chunks_mut((rows * width).max(1))
        .chain(std::iter::repeat_with(<&mut [T]>::default))
        .take(m.div_ceil(rows))
}

/// The sums of the `width`-long rows of `rows`, element by element, in row order.
fn column_sums(rows: &[f32], width: usize) -> Vec<f32> {
    let mut sums = vec![0.0; width];
    for row in rows.chunks(width) {
        for (sum, v) in sums.iter_mut().zip(row) {
            *sum += v;
        }
    }
    sums
}

/// Every expert's backward, in parallel over experts: the weight gradients
/// `gate_up_proj_weight_grad [E, H, 2, I]` in `G` and `down_proj_weight_grad [E, I, H]` in `D`
/// (in the linear layout `[E, 2, I, H]` and `[E, H, I]`)
/// (each expert writes its own slices whole: its products, or zeros when it has no tokens;
/// nothing clears them first), and each group's other results, in group order.
fn experts_backward<G: Element, D: Element>(
    call: &BlockwiseMmBwd<'_>,
    groups: &[ExpertRows],
    shared: (&[f32], Floats<'_>),
) -> Result<(Tensor, Tensor, Vec<ExpertBackward>)> {
    let BlockwiseDims { h, e, i, .. } = call.dims();
    let mut group_of = vec![None; e];
    for (g, group) in groups.iter().enumerate() {
        group_of[group.expert] = Some(g);
    }
    let layout = call.params().weight_layout;
    let (gate_up_shape, down_shape) = (layout.gate_up_dims(e, h, i), layout.down_dims(e, h, i));
    let mut d_gate_up_weight =
        output_buffer::<G>(bwd::GATE_UP_PROJ_WEIGHT_GRAD.name, &gate_up_shape)?;
    let mut d_down_weight = output_buffer::<D>(bwd::DOWN_PROJ_WEIGHT_GRAD.name, &down_shape)?;
    let (grads, scratch) = (PerThread::<ExpertGrads>::new(), PerThread::<Scratch>::new());
    let mut results: Vec<(usize, ExpertBackward)> = d_gate_up_weight
        .par_chunks_mut(h * 2 * i)
        .zip(d_down_weight.par_chunks_mut(i * h))
        .enumerate()
        .map(|(expert, (d_gate_up, d_down))| {
            let Some(g) = group_of[expert] else {
                write_zeros(d_gate_up);
                write_zeros(d_down);
                return None;
            };
            let result = grads.with(|grads| {
                let out = (d_gate_up, d_down);
                expert_backward(call, shared, (&groups[g], &scratch), grads, out)
            });
            Some((g, result))
        })
        .flatten()
        .collect();
    // SAFETY: every expert wrote both of its slices whole (`transposed_product` writes every
    // band), and the slices cover both buffers.
    let (d_gate_up_weight, d_down_weight) =
        unsafe { (assume_init(d_gate_up_weight), assume_init(d_down_weight)) };
    results.sort_by_key(|(g, _)| *g);
    let results: Vec<ExpertBackward> = results.into_iter().map(|(_, r)| r).collect();
    let fit = results.iter().all(|r| r.weights_fit);
    Ok((
        screened_output(
            bwd::GATE_UP_PROJ_WEIGHT_GRAD.name,
            &gate_up_shape,
            d_gate_up_weight,
            fit,
        )?,
        screened_output(
            bwd::DOWN_PROJ_WEIGHT_GRAD.name,
            &down_shape,
            d_down_weight,
            fit,
        )?,
        results,
    ))
}

pub(super) fn backward(call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
    let dims = call.dims();
    let BlockwiseDims { t, h, e, i, .. } = dims;
    let groups = group_by_expert(call.plan(), dims);

    // Read once here, not once per expert (bf16 affinities are widened).
    let affinities = call.floats().forward.expert_affinities_masked.to_f32();
    let shared = (&affinities[..], call.floats().gate_up_proj_act_checkpoint_t);
    let weight_dtypes = (
        call.output_dtype_of(&bwd::GATE_UP_PROJ_WEIGHT_GRAD),
        call.output_dtype_of(&bwd::DOWN_PROJ_WEIGHT_GRAD),
    );
    let (gate_up_proj_weight_grad, down_proj_weight_grad, results) = match weight_dtypes {
        (DType::BF16, DType::BF16) => experts_backward::<bf16, bf16>(call, &groups, shared),
        (DType::BF16, _) => experts_backward::<bf16, f32>(call, &groups, shared),
        (_, DType::BF16) => experts_backward::<f32, bf16>(call, &groups, shared),
        _ => experts_backward::<f32, f32>(call, &groups, shared),
    }?;

    let rows = call.dims().rows;
    let mut d_affinities = vec![0.0f32; rows * e];
    for (group, result) in groups.iter().zip(&results) {
        for (&token, &d) in group.tokens.iter().zip(&result.d_affinity) {
            d_affinities[token * e + group.expert] = d;
        }
    }
    let mut d_hidden = output_buffer(bwd::HIDDEN_STATES_GRAD.name, &[rows, h])?;
    let (tokens, padding) = d_hidden.split_at_mut(t * h);
    let token_rows = groups.iter().enumerate().flat_map(|(g, group)| {
        group
            .tokens
            .iter()
            .enumerate()
            .map(move |(row, &token)| (token, (g, row)))
    });
    TokenRows::new(t, token_rows).combine(
        tokens,
        h,
        |_, _| 1.0,
        |(g, row)| &results[g].d_x[row * h..(row + 1) * h],
    );
    // The padding row, if any, is zero: so is its gradient.
    zero(padding);
    // SAFETY: `combine` wrote every token's row, and row T, if any, is zeroed.
    let d_hidden = unsafe { assume_init(d_hidden) };
    let d_topk_affinities = call
        .expert_ids()
        .map(|ids| topk_gradient(ids, &d_affinities, e))
        .transpose()?;
    // Each expert's bias gradients in place; zeros for experts without tokens.
    let bias_grads = call.params().bias.then(|| {
        let (mut gate_up, mut down) = (vec![0.0f32; e * 2 * i], vec![0.0f32; e * h]);
        for (group, result) in groups.iter().zip(&results) {
            if let Some((d_gate_up, d_down)) = &result.d_biases {
                let expert = group.expert;
                gate_up[expert * 2 * i..(expert + 1) * 2 * i].copy_from_slice(d_gate_up);
                down[expert * h..(expert + 1) * h].copy_from_slice(d_down);
            }
        }
        (gate_up, down)
    });
    let (gate_and_up_proj_bias_grad, down_proj_bias_grad) = match bias_grads {
        Some((gate_up, down)) => (
            Some(finite_output(
                bwd::GATE_AND_UP_PROJ_BIAS_GRAD.name,
                &[e, 2, i],
                gate_up,
            )?),
            Some(finite_output(bwd::DOWN_PROJ_BIAS_GRAD.name, &[e, h], down)?),
        ),
        None => (None, None),
    };
    Ok(BlockwiseMmGrads {
        hidden_states_grad: finite_output(bwd::HIDDEN_STATES_GRAD.name, &[rows, h], d_hidden)?,
        expert_affinities_masked_grad: finite_output(
            bwd::EXPERT_AFFINITIES_MASKED_GRAD.name,
            &[rows * e, 1],
            d_affinities,
        )?,
        gate_up_proj_weight_grad,
        down_proj_weight_grad,
        d_topk_affinities,
        gate_and_up_proj_bias_grad,
        down_proj_bias_grad,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block sizes around the tile's 16, columns with and without a partial tile, and slot
    /// sets with gaps, runs that start mid-block, and blocks skipped.
    fn cases() -> Vec<(usize, usize, Vec<usize>)> {
        vec![
            (16, 16, (0..32).collect()),
            (32, 40, vec![0, 1, 2, 5, 17, 31, 32, 33, 70, 95]),
            (8, 3, vec![3, 4, 9, 23]),
            (48, 33, (20..44).chain(50..51).chain(96..140).collect()),
            // C past GATHER_TILES_AHEAD tiles, so the gather asks for lines ahead.
            (16, 100, (3..40).collect()),
        ]
    }

    #[test]
    fn gathered_block_columns_are_the_slots_rows() {
        for (b, c, slots) in cases() {
            let blocks_needed = slots.last().unwrap() / b + 1;
            // Values bf16 holds exactly, so both dtypes gather the same ones.
            let stored: Vec<f32> = (0..blocks_needed * c * b)
                .map(|v| (v % 251) as f32 * 0.5)
                .collect();
            let stored16: Vec<bf16> = stored.iter().map(|&v| bf16::from_f32(v)).collect();
            for blocks in [Floats::F32(&stored), Floats::BF16(&stored16)] {
                let mut dst = vec![f32::NAN; slots.len() * c];
                gather_block_columns(&mut dst, blocks, &slots, b);
                for (r, &slot) in slots.iter().enumerate() {
                    let (block, j) = (slot / b, slot % b);
                    for col in 0..c {
                        let want = stored[block * c * b + col * b + j];
                        assert_eq!(
                            dst[r * c + col],
                            want,
                            "{:?}: B {b}, C {c}, slot {slot}, column {col}",
                            blocks.dtype()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn transposed_blocks_hold_each_slots_row_or_its_padding() {
        for (b, c, _) in cases() {
            let rows: Vec<f32> = (0..b * c).map(|v| v as f32 + 0.25).collect();
            let padding: Vec<f32> = (0..c).map(|v| -(v as f32)).collect();
            // Every third slot is padding; the others take rows in reverse order.
            let source: Vec<Option<usize>> =
                (0..b).map(|j| (j % 3 != 1).then_some(b - 1 - j)).collect();
            for pad in [None, Some(&padding[..])] {
                let want = |j: usize, col: usize| match (source[j], pad) {
                    (Some(r), _) => rows[r * c + col],
                    (None, Some(p)) => p[col],
                    (None, None) => 0.0,
                };
                let block_t = transposed_block::<f32>(&source, &rows, pad);
                let block_t16 = transposed_block::<bf16>(&source, &rows, pad);
                for j in 0..b {
                    for col in 0..c {
                        let at = format!("B {b}, C {c}, slot {j}, column {col}");
                        assert_eq!(block_t[col * b + j], want(j, col), "f32: {at}");
                        let rounded = bf16::from_f32(want(j, col));
                        assert_eq!(block_t16[col * b + j], rounded, "bf16: {at}");
                    }
                }
            }
        }
    }

    /// [`transpose_block`]'s `[C, B]` for `source`'s slots of `rows [·, C]`, in `G`.
    fn transposed_block<G: Element>(
        source: &[Option<usize>],
        rows: &[f32],
        padding: Option<&[f32]>,
    ) -> Vec<G> {
        let c = padding.map_or(rows.len() / source.len(), <[f32]>::len);
        let mut block_t = vec![MaybeUninit::<G>::uninit(); c * source.len()];
        let staging = (&mut Vec::new(), &mut Streamer::new());
        transpose_block(&mut block_t, (source, rows), padding, staging);
        // SAFETY: `transpose_block` writes all of `block_t`.
        unsafe { assume_init(block_t) }
    }
}
