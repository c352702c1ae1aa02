//! Router forward and backward on the CPU. The forward's tasks each take a tile of tokens:
//! the tile's logits (a GEMM on packed panels of the weights; a decoding step's few tokens
//! stream the weights once, as stored, through [`super::skinny`]), then, while those are in
//! cache, each token's activation, top-k and renormalisation, in f32 and in log space (as the
//! contract's reference does in f64) so renormalised affinities stay exact when probabilities
//! underflow.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use half::bf16;
use rayon::prelude::*;

use super::alloc::output_buffer;
use super::bf16_matmul::{self, matmul_bf16, matmul_bf16_into};
use super::element::{
    Element, all_fit, ensure_finite, finite_output, screened_output, write_rounded,
};
use super::exp::{exp_into, log_softmax};
use super::expert_matrix::{ExpertMatrix, Panels};
use super::matmul::{MatRef, matmul, matmul_bf16_b};
use super::rows::{resized, round_to_bf16};
use super::scratch::PerThread;
use super::skinny;
use crate::contracts::spec::output;
use crate::contracts::tensors::{router_topk as rt, router_topk_bwd as rtb};
use crate::contracts::{
    RouterActFnType, RouterDims, RouterPipeline, RouterTopk, RouterTopkBwd, RouterTopkGrads,
    RouterTopkOutputs, WeightLayout,
};
use crate::error::Result;
use crate::tensor::{DType, Floats, Storage, Tensor, try_filled};
use crate::uninit::{assume_init, assume_init_ref};

/// Most rows of `d_w [H, E]` per task of the router backward: each task reads `d_logits`
/// whole, so a band spans several of the packed panels' columns.
const D_W_BAND: usize = 256;

/// Rows of `d_w [H, E]` per task: [`D_W_BAND`], or half of H (in whole 16-row runs) where H
/// holds fewer than two such bands, so that both cores share the product (qwen3-moe-small's
/// H = 256 made it one task on one core). A function of H alone; each element's sum over the
/// tokens runs in the same order in whichever band it falls.
fn d_w_band(h: usize) -> usize {
    h.div_ceil(2).next_multiple_of(16).clamp(16, D_W_BAND)
}

/// Most tokens per task of the products with the router weights. Each task packs all of the
/// weights (`[H, E]`, 1 MiB at Qwen3-30B-A3B's H = 2048, E = 128) for its tokens' products, so
/// tiles much shorter than that pay for it again and again. Measured on Zen 4 (2 threads,
/// Qwen3-30B-A3B, T = 2048): `router_topk` 7.1–7.3 ms in tiles of 64 tokens, 6.8 in 128, 6.6
/// in 256; the backward's `d_x` 8.0 ms in 64, 6.8–7.0 in 256.
const TOKEN_TILE: usize = 256;

/// Tokens per task of the products with the router weights, for T tokens: half of them, from
/// 16 to [`TOKEN_TILE`], so that a decoding step's tens of tokens still make two tasks (each
/// packs the weights, so more would cost more than they spread) while longer sequences keep
/// whole tiles. A function of T alone, so results do not depend on the thread count.
fn token_tile(t: usize) -> usize {
    t.div_ceil(2).clamp(16, TOKEN_TILE)
}

/// `ln(1 + eˣ)` without overflow.
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Log-affinities of one row of logits, written into `out`.
fn log_affinities(logits: &[f32], act_fn: RouterActFnType, out: &mut [f32]) {
    match act_fn {
        RouterActFnType::Softmax => log_softmax(logits, out),
        RouterActFnType::Sigmoid => {
            for (o, &l) in out.iter_mut().zip(logits) {
                *o = -softplus(-l);
            }
        }
    }
}

/// The selected experts' affinities from their log-affinities, renormalised (a softmax over
/// the selection) when `norm`.
fn selected_affinities(log_aff: &[f32], selected: &[i32], norm: bool, out: &mut [f32]) {
    let max = selected
        .iter()
        .map(|&e| log_aff[e as usize])
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = selected
        .iter()
        .map(|&e| (log_aff[e as usize] - max).exp())
        .sum();
    let lse = max + sum.ln();
    for (o, &e) in out.iter_mut().zip(selected) {
        let la = log_aff[e as usize];
        *o = if norm { (la - lse).exp() } else { la.exp() };
    }
}

/// The ids of the `index.len()` highest `scores`, highest first; of equal scores the lower id
/// comes first. One pass over the scores, each compared with the lowest kept so far (and
/// inserted in order when above it); `kept` is scratch of `index`'s length.
fn top_k(scores: &[f32], index: &mut [i32], kept: &mut [f32]) {
    let k = index.len();
    let mut len = 0;
    for (expert, &score) in scores.iter().enumerate() {
        if len == k && score <= kept[k - 1] {
            continue;
        }
        // Past every kept score at least as high (lower ids win ties), then shift the rest.
        let at = kept[..len].partition_point(|&s| s >= score);
        let end = len.min(k - 1);
        kept.copy_within(at..end, at + 1);
        index.copy_within(at..end, at + 1);
        kept[at] = score;
        index[at] = expert as i32;
        len = (len + 1).min(k);
    }
}

/// The product that gives a tile of tokens their logits `x [T, H] · w [H, E]`, chosen once per
/// call from the operands' dtypes and T.
enum LogitsProduct<'a> {
    /// x and w both stored in bf16 (and H even, so token rows hold whole pairs): AVX-512 BF16
    /// pair dot products, exact products with f32 sums, nothing widened.
    PairDots { x: &'a [bf16], w: &'a [bf16] },
    /// A decoding step's few tokens: the weights streamed as stored, a pair of tokens per task
    /// (each output is the same whichever rows share a call).
    Skinny { x: Cow<'a, [f32]>, w: Floats<'a> },
    /// Packed panels of the weights against tiles of [`token_tile`] tokens (bf16 tokens
    /// widened a tile at a time, by the task that reads them).
    Panels { x: Floats<'a>, w: ExpertMatrix<'a> },
}

impl<'a> LogitsProduct<'a> {
    fn new(x: &'a Tensor, w: &'a Tensor, (t, h, e): (usize, usize, usize)) -> Self {
        match (x.storage(), w.storage()) {
            (Storage::BF16(x), Storage::BF16(w)) if h % 2 == 0 && bf16_matmul::available() => {
                Self::PairDots { x, w }
            }
            _ => {
                let stored = w.floats().expect("the contract checked w's dtype");
                if t <= skinny::MAX_ROWS {
                    Self::Skinny {
                        x: x.f32_values(),
                        w: stored,
                    }
                } else {
                    Self::Panels {
                        x: x.floats().expect("the contract checked x's dtype"),
                        w: ExpertMatrix::of(stored, WeightLayout::Nki, 0, (h, e)),
                    }
                }
            }
        }
    }

    /// Tokens per parallel task, for T tokens: a function of T alone, so results do not
    /// depend on the thread count.
    fn tile(&self, t: usize) -> usize {
        match self {
            Self::Skinny { .. } => 2,
            Self::PairDots { .. } | Self::Panels { .. } => token_tile(t),
        }
    }

    /// `out [m, E]`: the logits of tokens `first..first + m`, without the bias; `widened`
    /// is scratch for bf16 tokens.
    fn logits(
        &self,
        out: &mut [f32],
        first: usize,
        (h, e): (usize, usize),
        (panels, widened): (Panels<'_>, &mut Vec<f32>),
    ) {
        let m = out.len() / e;
        let rows = first * h..(first + m) * h;
        match self {
            Self::PairDots { x, w } => matmul_bf16(out, (&x[rows], h), (w, e), (m, e, h)),
            Self::Skinny { x, w } => skinny::product(out, &x[rows], *w, (m, h, e)),
            Self::Panels {
                x: Floats::F32(x),
                w,
            } => w.product(out, &x[rows], panels),
            Self::Panels {
                x: Floats::BF16(x),
                w,
            } => {
                widened.clear();
                widened.extend(x[rows].iter().map(|v| v.to_f32()));
                w.product(out, widened, panels);
            }
        }
    }
}

/// Per-task scratch of the forward's rows: `[E]` log-affinities, their exponentials (the
/// activations) and selection scores, and the `[K]` scores kept by [`top_k`].
#[derive(Default)]
struct RowScratch {
    log_aff: Vec<f32>,
    probs: Vec<f32>,
    scores: Vec<f32>,
    kept: Vec<f32>,
}

/// Per-thread scratch of the forward's tasks: the rows', the weights' packed panels, and the
/// tile's tokens widened to f32 where they are bf16.
#[derive(Default)]
struct TaskScratch {
    rows: RowScratch,
    panel: Vec<f32>,
    panel_tile: Vec<f32>,
    widened: Vec<f32>,
}

/// What the forward does with each row of logits: activation, selection, affinities.
struct Routing<'a> {
    pipeline: RouterPipeline,
    /// `[E]`, added to the scores the selection compares (not to the affinities).
    selection_bias: Option<&'a [f32]>,
}

impl Routing<'_> {
    /// One token: its `[E]` logits `row` give its `[K]` `index` and `affinities` and its `[E]`
    /// `scattered` affinities (dense for ACT1 without renormalisation, else the K selected).
    fn route(
        &self,
        row: &[f32],
        (index, affinities, scattered): (&mut [i32], &mut [f32], &mut [f32]),
        scratch: &mut RowScratch,
    ) {
        let e = row.len();
        let RowScratch {
            log_aff,
            probs,
            scores,
            kept,
        } = scratch;
        for buffer in [&mut *log_aff, &mut *probs, &mut *scores] {
            buffer.resize(e, 0.0);
        }
        kept.resize(index.len(), 0.0);
        let pipeline = self.pipeline;
        log_affinities(row, pipeline.act_fn, log_aff);
        let dense = pipeline.dense_affinities();
        if pipeline.router_pre_norm || dense {
            exp_into(log_aff, probs);
        }
        // ACT1 chooses by affinity, ACT2 by logit; selection_bias shifts either.
        let chosen_by: &[f32] = if pipeline.router_pre_norm { probs } else { row };
        let scores: &[f32] = match self.selection_bias {
            None => chosen_by,
            Some(bias) => {
                for ((s, &c), &b) in scores.iter_mut().zip(chosen_by).zip(bias) {
                    *s = c + b;
                }
                scores
            }
        };
        top_k(scores, index, kept);
        selected_affinities(log_aff, index, pipeline.renormalises(), affinities);
        if dense {
            scattered.copy_from_slice(probs);
        } else {
            for (&expert, &a) in index.iter().zip(affinities.iter()) {
                scattered[expert as usize] = a;
            }
        }
    }
}

pub(super) fn forward(call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
    let inputs = call.inputs();
    let pipeline = call.params().pipeline;
    let RouterDims { t, h, e, k } = call.dims();
    let bias = inputs.w_bias.map(Tensor::f32_values);
    let selection_bias = inputs.selection_bias.map(Tensor::f32_values);
    let routing = Routing {
        pipeline,
        selection_bias: selection_bias.as_deref(),
    };
    let x = pipeline.x_hbm_layout.tokens_major(inputs.x)?;
    let product = LogitsProduct::new(&x, inputs.w, (t, h, e));

    // `[T, E]` outgrows the inputs (`[T, H]` and `[H, E]`) when H is small: allocated checked.
    let mut logits = try_filled(&output(&rt::ROUTER_LOGITS), &[t, e], 0.0f32)?;
    let mut expert_index = try_filled(&output(&rt::EXPERT_INDEX), &[t, k], 0i32)?;
    let mut topk = try_filled(&output(&rt::TOPK_AFFINITIES), &[t, k], 0.0f32)?;
    let mut scattered = try_filled(&output(&rt::EXPERT_AFFINITIES), &[t, e], 0.0f32)?;
    // Each task routes its tokens while their logits are still in cache.
    let tile = product.tile(t);
    let scratch = PerThread::<TaskScratch>::new();
    logits
        .par_chunks_mut(tile * e)
        .zip(expert_index.par_chunks_mut(tile * k))
        .zip(topk.par_chunks_mut(tile * k))
        .zip(scattered.par_chunks_mut(tile * e))
        .enumerate()
        .for_each(|(task, (((logits, index), aff), scattered))| {
            scratch.with(|s| {
                let panels = (&mut s.panel, &mut s.panel_tile);
                product.logits(logits, task * tile, (h, e), (panels, &mut s.widened));
                if let Some(bias) = &bias {
                    for row in logits.chunks_mut(e) {
                        for (l, b) in row.iter_mut().zip(bias.iter()) {
                            *l += b;
                        }
                    }
                }
                for (((row, index), aff), scattered) in logits
                    .chunks(e)
                    .zip(index.chunks_mut(k))
                    .zip(aff.chunks_mut(k))
                    .zip(scattered.chunks_mut(e))
                {
                    routing.route(row, (index, aff, scattered), &mut s.rows);
                }
            })
        });
    ensure_finite(rt::ROUTER_LOGITS.name, &[t, e], &logits)?;
    Ok(RouterTopkOutputs {
        router_logits: Tensor::from_f32([t, e], logits)?,
        expert_index: Tensor::from_i32([t, k], expert_index)?,
        topk_affinities: Tensor::from_f32([t, k], topk)?,
        expert_affinities: Tensor::from_f32([t, e], scattered)?,
    })
}

pub(super) fn backward(call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads> {
    let inputs = call.inputs();
    let pipeline = call.params().pipeline;
    let norm = pipeline.renormalises();
    let RouterDims { t, h, e, k } = call.dims();
    let logits = inputs.router_logits.f32_values();
    let expert_index = call.expert_ids();
    let d_topk = inputs.d_topk_affinities.f32_values();
    let d_extra = inputs.d_router_logits.map(Tensor::f32_values);
    let bf16_operands = call.compute_dtype() == DType::BF16;

    // d logits [T, E], row by row; rounded to bf16 where it is formed when the products take
    // bf16 operands.
    let mut d_logits = vec![0.0f32; t * e];
    d_logits.par_chunks_mut(e).enumerate().for_each_init(
        || (vec![0.0f32; e], vec![0.0f32; e], vec![0.0f32; k]),
        |(log_aff, probs, aff), (token, d_row)| {
            let row = &logits[token * e..(token + 1) * e];
            let selected = &expert_index[token * k..(token + 1) * k];
            let d_aff = &d_topk[token * k..(token + 1) * k];
            log_affinities(row, pipeline.act_fn, log_aff);
            selected_affinities(log_aff, selected, norm, aff);
            let centre: f32 = if norm {
                d_aff.iter().zip(aff.iter()).map(|(d, a)| d * a).sum()
            } else {
                0.0
            };
            // d_row first holds the gradient w.r.t. the log-affinities.
            d_row.fill(0.0);
            for ((&expert, &d), &a) in selected.iter().zip(d_aff).zip(aff.iter()) {
                d_row[expert as usize] = (d - centre) * a;
            }
            match pipeline.act_fn {
                RouterActFnType::Softmax if pipeline.router_pre_norm => {
                    let total: f32 = d_row.iter().sum();
                    exp_into(log_aff, probs);
                    for (dl, &p) in d_row.iter_mut().zip(probs.iter()) {
                        *dl -= p * total;
                    }
                }
                // ACT2's softmax over the K selected logits: its log-affinities are the
                // logits up to a shift, which the renormalisation's centring removed.
                RouterActFnType::Softmax => {}
                RouterActFnType::Sigmoid => {
                    for (dl, &l) in d_row.iter_mut().zip(row) {
                        *dl *= (-softplus(l)).exp();
                    }
                }
            }
            if let Some(extra) = &d_extra {
                for (dl, d) in d_row.iter_mut().zip(&extra[token * e..(token + 1) * e]) {
                    *dl += d;
                }
            }
            if bf16_operands {
                round_to_bf16(d_row, &mut []);
            }
        },
    );
    let x = pipeline.x_hbm_layout.tokens_major(inputs.x)?;
    let x = x.floats().expect("the contract checked x's dtype");
    let w = inputs.w.floats().expect("the contract checked w's dtype");
    // d_x is written in its output dtype, each tile rounded while in cache (a cast afterwards
    // would stream the whole `[T, H]` again).
    let operands = (&d_logits[..], (x, w), bf16_operands);
    let (d_x, d_w) = match call.output_dtype_of(&rtb::D_X) {
        DType::BF16 => gradients::<bf16>(operands, (t, h, e))?,
        DType::F32 | DType::I32 => gradients::<f32>(operands, (t, h, e))?,
    };
    // d_w_bias [E] = Σ_t d_logits, in token order.
    let mut d_w_bias = vec![0.0f32; e];
    for row in d_logits.chunks(e) {
        for (db, d) in d_w_bias.iter_mut().zip(row) {
            *db += d;
        }
    }
    Ok(RouterTopkGrads {
        d_x: pipeline.x_hbm_layout.from_tokens_major(d_x)?,
        d_w,
        d_w_bias: finite_output(rtb::D_W_BIAS.name, &[e], d_w_bias)?,
    })
}

/// `d_x [T, H] = d_logits · wᵀ` (tokens-major, in `E`) and `d_w [H, E] = xᵀ · d_logits` (f32)
/// for `d_logits [T, E]`, `x [T, H]` and `w [H, E]`: with bf16 operands (`d_logits` already
/// rounded) on the pair dot products where the CPU has them, else on the f32 kernels (bf16
/// operands widened exactly).
fn gradients<E: Element>(
    (d_logits, (x, w), bf16_operands): (&[f32], (Floats<'_>, Floats<'_>), bool),
    (t, h, e): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let ((d_x, d_x_fits), (d_w, d_w_fits)) = if bf16_operands {
        let (x, w) = (x.to_bf16(), w.to_bf16());
        if bf16_matmul::available() {
            pair_dot_products::<E>(d_logits, (&x, &w), (t, h, e))?
        } else {
            // The same exact products of bf16 values, widened to f32.
            f32_products::<E>(d_logits, (Floats::BF16(&x), Floats::BF16(&w)), (t, h, e))?
        }
    } else {
        f32_products::<E>(d_logits, (x, w), (t, h, e))?
    };
    Ok((
        screened_output(rtb::D_X.name, &[t, h], d_x, d_x_fits)?,
        screened_output(rtb::D_W.name, &[h, e], d_w, d_w_fits)?,
    ))
}

/// `d_x` (in `E`) and `d_w` (f32), each with whether all of its values are finite.
type Products<E> = ((Vec<E>, bool), (Vec<f32>, bool));

/// Writes one tile of `d_x` in `E` from `product`, which fills f32 rows: in place when `E` is
/// f32, else through `results`, rounded while they are in cache. Returns whether every value
/// is finite in `E`.
fn write_tile<E: Element>(
    d_x: &mut [MaybeUninit<E>],
    results: &mut Vec<f32>,
    product: impl FnOnce(&mut [MaybeUninit<f32>]) -> &[f32],
) -> bool {
    match E::as_f32_slots(d_x) {
        Some(d_x) => all_fit::<f32>(product(d_x)),
        None => {
            let len = d_x.len();
            results.clear();
            results.reserve(len);
            let values = product(&mut results.spare_capacity_mut()[..len]);
            write_rounded(d_x, values)
        }
    }
}

/// The backward's products on the f32 kernels (see [`gradients`]).
fn f32_products<E: Element>(
    d_logits: &[f32],
    (x, w): (Floats<'_>, Floats<'_>),
    (t, h, e): (usize, usize, usize),
) -> Result<Products<E>> {
    // d_x in token tiles on packed panels of wᵀ; bf16 weights widened first (`[H, E]`, small
    // beside the product).
    let w = w.to_f32();
    let w = ExpertMatrix::of(Floats::F32(&w), WeightLayout::Nki, 0, (h, e));
    let mut d_x = output_buffer::<E>(rtb::D_X.name, &[t, h])?;
    let tile = token_tile(t);
    let d_x_fits = d_x
        .par_chunks_mut(tile * h)
        .zip(d_logits.par_chunks(tile * e))
        .map_init(
            || (Vec::new(), Vec::new(), Vec::new()),
            |(panel, tile, results), (d_x, d_logits)| {
                write_tile(d_x, results, |d_x| {
                    w.transposed_product_into(d_x, d_logits, (panel, tile))
                })
            },
        )
        .reduce(|| true, |a, b| a && b);
    // d_w as its transpose d_logitsᵀ · x on packed panels of x (the whole token reduction
    // inside one product; d_logitsᵀ read in place, `cpu::matmul` deciding how), in bands of
    // `d_w_band` rows of d_w; bf16 tokens widened as they are packed.
    let d_logits_t = MatRef::row_major(d_logits, t, e).t();
    let mut d_w = output_buffer(rtb::D_W.name, &[h, e])?;
    let band_rows = d_w_band(h);
    let d_w_fits = d_w
        .par_chunks_mut(band_rows * e)
        .enumerate()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(d_w_t, panel), (band, d_w)| {
                let rows = band * band_rows..band * band_rows + d_w.len() / e;
                let d_w_t = resized(d_w_t, e * rows.len());
                // d_wᵀ [E, rows] = d_logitsᵀ · x [T, rows].
                match x {
                    Floats::F32(x) => matmul(
                        d_w_t,
                        d_logits_t,
                        MatRef::row_major(x, t, h).columns(rows),
                        false,
                    ),
                    Floats::BF16(x) => {
                        matmul_bf16_b(d_w_t, d_logits_t, (&x[rows.start..], h), panel)
                    }
                }
                all_fit::<f32>(transpose_band(d_w, d_w_t, e))
            },
        )
        .reduce(|| true, |a, b| a && b);
    // SAFETY: the tiles and bands cover both buffers, and each wrote its part whole.
    Ok(unsafe { ((assume_init(d_x), d_x_fits), (assume_init(d_w), d_w_fits)) })
}

/// [`f32_products`] on bf16 pair dot products (exact products, f32 sums, the inner dimension
/// in pairs), for `d_logits` already rounded to bf16 and bf16 `x` and `w`: at twice the f32
/// rate where the CPU has them ([`bf16_matmul::available`]).
fn pair_dot_products<E: Element>(
    d_logits: &[f32],
    (x, w): (&[bf16], &[bf16]),
    (t, h, e): (usize, usize, usize),
) -> Result<Products<E>> {
    // d_logits [T, E] and wᵀ [E, H] in bf16 (exact: d_logits holds bf16 values), each row
    // padded to an even length with zeros as the pairs need; wᵀ is small beside the product.
    let lde = e.next_multiple_of(2);
    let mut d_logits16 = vec![bf16::ZERO; t * lde];
    d_logits16
        .par_chunks_mut(lde)
        .zip(d_logits.par_chunks(e))
        .for_each(|(dst, src)| {
            for (d, &v) in dst.iter_mut().zip(src) {
                *d = bf16::round(v);
            }
        });
    let w_t = transposed(w, e, h);
    // d_x [T, H] = d_logits · wᵀ in token tiles.
    let mut d_x = output_buffer::<E>(rtb::D_X.name, &[t, h])?;
    let tile = token_tile(t);
    let d_x_fits = d_x
        .par_chunks_mut(tile * h)
        .zip(d_logits16.par_chunks(tile * lde))
        .map_init(Vec::new, |results, (d_x, d_logits)| {
            let rows = d_x.len() / h;
            write_tile(d_x, results, |d_x| {
                matmul_bf16_into(d_x, (d_logits, lde), (&w_t, h), (rows, h, e))
            })
        })
        .reduce(|| true, |a, b| a && b);
    // d_w as its transpose d_logitsᵀ [E, T] · x [T, H], in bands of `d_w_band` columns of x;
    // d_logitsᵀ's rows padded to an even length too.
    let lda = t.next_multiple_of(2);
    let d_logits_t = transposed(&d_logits16, lde, lda);
    let mut d_w = output_buffer(rtb::D_W.name, &[h, e])?;
    let band_rows = d_w_band(h);
    let d_w_fits = d_w
        .par_chunks_mut(band_rows * e)
        .enumerate()
        .map_init(Vec::new, |d_w_t, (band, d_w)| {
            let (first, width) = (band * band_rows, d_w.len() / e);
            let d_w_t = resized(d_w_t, e * width);
            matmul_bf16(d_w_t, (&d_logits_t, lda), (&x[first..], h), (e, width, t));
            all_fit::<f32>(transpose_band(d_w, d_w_t, e))
        })
        .reduce(|| true, |a, b| a && b);
    // SAFETY: the tiles and bands cover both buffers, and each wrote its part whole.
    Ok(unsafe { ((assume_init(d_x), d_x_fits), (assume_init(d_w), d_w_fits)) })
}

/// The transpose of row-major `values [rows, cols]`: `[cols, ld]`, each row padded past `rows`
/// with zeros (`T::default()`) to the row stride `ld` ≥ rows; in parallel over its rows.
fn transposed<T: Copy + Default + Send + Sync>(values: &[T], cols: usize, ld: usize) -> Vec<T> {
    let mut out = vec![T::default(); cols * ld];
    out.par_chunks_mut(ld.max(1))
        .enumerate()
        .for_each(|(col, out)| {
            for (v, row) in out.iter_mut().zip(values.chunks_exact(cols)) {
                *v = row[col];
            }
        });
    out
}

/// Writes a band of `d_w [rows, E]` whole from its transpose `d_w_t [E, rows]`; returns it.
fn transpose_band<'d>(d_w: &'d mut [MaybeUninit<f32>], d_w_t: &[f32], e: usize) -> &'d [f32] {
    let rows = d_w.len() / e.max(1);
    for (r, d_w_row) in d_w.chunks_mut(e).enumerate() {
        for (expert, d) in d_w_row.iter_mut().enumerate() {
            d.write(d_w_t[expert * rows + r]);
        }
    }
    // SAFETY: every element was written above.
    unsafe { assume_init_ref(d_w) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// K passes of argmax over the experts not yet chosen: the first highest score each time.
    fn k_passes(scores: &[f32], k: usize) -> Vec<i32> {
        let mut chosen: Vec<i32> = Vec::new();
        for _ in 0..k {
            let best = (0..scores.len())
                .filter(|&e| !chosen.contains(&(e as i32)))
                .reduce(|best, e| if scores[e] > scores[best] { e } else { best })
                .unwrap();
            chosen.push(best as i32);
        }
        chosen
    }

    #[test]
    fn one_pass_selection_equals_k_passes_of_argmax_with_ties() {
        // Scores from a few values (many ties), every k from 1 to E, ascending and
        // descending runs among them.
        for e in [1, 2, 5, 8, 17, 64] {
            for seed in 0..6 {
                let scores: Vec<f32> = (0..e)
                    .map(|i| ((i * 7 + seed * 5) % (seed + 2)) as f32 - 1.5)
                    .collect();
                for k in 1..=e {
                    let (mut index, mut kept) = (vec![-1; k], vec![0.0; k]);
                    top_k(&scores, &mut index, &mut kept);
                    assert_eq!(index, k_passes(&scores, k), "{scores:?}, k = {k}");
                }
            }
        }
    }
}
