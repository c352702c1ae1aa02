//! Router forward and backward on the CPU: the logits GEMM in fixed row tiles (a decoding
//! step's few tokens stream the weights once, as stored, through [`super::skinny`]), then the
//! activation, top-k and renormalisation per row, in f32 and in log space (as the contract's
//! reference does in f64) so renormalised affinities stay exact when probabilities underflow.

use rayon::prelude::*;

use super::ROW_TILE;
use super::bf16_matmul::{self, matmul_bf16};
use super::element::{ensure_finite, finite_output};
use super::expert_matrix::ExpertMatrix;
use super::matmul::{MatRef, matmul};
use super::skinny;
use crate::contracts::spec::output;
use crate::contracts::tensors::{router_topk as rt, router_topk_bwd as rtb};
use crate::contracts::{
    RouterActFnType, RouterDims, RouterTopk, RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs,
    WeightLayout,
};
use crate::error::Result;
use crate::tensor::{Storage, Tensor, try_filled};

/// Rows of `d_w [H, E]` per task of the router backward: each task reads `d_logits` whole, so
/// a band spans several of the packed panels' columns.
const D_W_BAND: usize = 256;

/// Tokens per task of the products with the router weights, for T tokens: half of them, from
/// 16 to [`ROW_TILE`], so that a decoding step's tens of tokens still make two tasks (each
/// packs the weights, so more would cost more than they spread) while longer sequences keep
/// whole row tiles. A function of T alone, so results do not depend on the thread count.
fn token_tile(t: usize) -> usize {
    t.div_ceil(2).clamp(16, ROW_TILE)
}

/// `ln(1 + eˣ)` without overflow.
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Log-affinities of one row of logits, written into `out`.
fn log_affinities(logits: &[f32], act_fn: RouterActFnType, out: &mut [f32]) {
    match act_fn {
        RouterActFnType::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
            let lse = max + sum.ln();
            for (o, &l) in out.iter_mut().zip(logits) {
                *o = l - lse;
            }
        }
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

/// `[T, E]` logits: `x [T, H] · w [H, E] (+ bias)`, in tiles of [`token_tile`] tokens, or of
/// pairs streaming w through [`skinny`] for a decoding step's few. With x and w both stored in
/// bf16 (and H even, so token rows hold whole pairs) the products run on AVX-512 BF16 pair dot
/// products: exact products, f32 sums, nothing widened.
fn logits(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&[f32]>,
    (t, h, e): (usize, usize, usize),
) -> Result<Vec<f32>> {
    // `[T, E]` outgrows the inputs (`[T, H]` and `[H, E]`) when H is small: allocated checked.
    let mut logits = try_filled(&output(&rt::ROUTER_LOGITS), &[t, e], 0.0f32)?;
    let tile = token_tile(t);
    match (x.storage(), w.storage()) {
        (Storage::BF16(x), Storage::BF16(w)) if h % 2 == 0 && bf16_matmul::available() => {
            logits
                .par_chunks_mut(tile * e)
                .zip(x.par_chunks(tile * h))
                .for_each(|(out, x)| matmul_bf16(out, x, h, w, (out.len() / e, e, h)));
        }
        _ => {
            let stored = w.floats().expect("the contract checked w's dtype");
            let x = x.f32_values();
            if t <= skinny::MAX_ROWS {
                // A decoding step's few tokens: the weights streamed as stored, a pair of
                // tokens per task (each output is the same whichever rows share a call).
                logits
                    .par_chunks_mut(2 * e)
                    .zip(x.par_chunks(2 * h))
                    .for_each(|(out, x)| skinny::product(out, x, stored, (x.len() / h, h, e)));
            } else {
                let w = ExpertMatrix::of(stored, WeightLayout::Nki, 0, (h, e));
                logits
                    .par_chunks_mut(tile * e)
                    .zip(x.par_chunks(tile * h))
                    .for_each_init(
                        || (Vec::new(), Vec::new()),
                        |(panel, tile), (out, x)| w.product(out, x, (panel, tile)),
                    );
            }
        }
    }
    if let Some(bias) = bias {
        for row in logits.chunks_mut(e) {
            for (l, b) in row.iter_mut().zip(bias) {
                *l += b;
            }
        }
    }
    Ok(logits)
}

pub(super) fn forward(call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
    let inputs = call.inputs();
    let pipeline = call.params().pipeline;
    let RouterDims { t, h, e, k } = call.dims();
    let bias = inputs.w_bias.map(Tensor::f32_values);
    let selection_bias = inputs.selection_bias.map(Tensor::f32_values);
    let x = pipeline.x_hbm_layout.tokens_major(inputs.x)?;
    let logits = logits(&x, inputs.w, bias.as_deref(), (t, h, e))?;
    ensure_finite(rt::ROUTER_LOGITS.name, &[t, e], &logits)?;

    let mut expert_index = try_filled(&output(&rt::EXPERT_INDEX), &[t, k], 0i32)?;
    let mut topk = try_filled(&output(&rt::TOPK_AFFINITIES), &[t, k], 0.0f32)?;
    let mut scattered = try_filled(&output(&rt::EXPERT_AFFINITIES), &[t, e], 0.0f32)?;
    expert_index
        .par_chunks_mut(k)
        .zip(topk.par_chunks_mut(k))
        .zip(scattered.par_chunks_mut(e))
        .zip(logits.par_chunks(e))
        .for_each_init(
            || (vec![0.0f32; e], vec![0.0f32; e], vec![0.0f32; k]),
            |(log_aff, scores, best), (((index, aff), scattered), row)| {
                log_affinities(row, pipeline.act_fn, log_aff);
                // ACT1 chooses by affinity, ACT2 by logit; selection_bias shifts either.
                for (expert, s) in scores.iter_mut().enumerate() {
                    let score = if pipeline.router_pre_norm {
                        log_aff[expert].exp()
                    } else {
                        row[expert]
                    };
                    *s = score + selection_bias.as_ref().map_or(0.0, |b| b[expert]);
                }
                top_k(scores, index, best);
                selected_affinities(log_aff, index, pipeline.renormalises(), aff);
                if pipeline.dense_affinities() {
                    for (a, la) in scattered.iter_mut().zip(log_aff.iter()) {
                        *a = la.exp();
                    }
                } else {
                    for (&expert, &a) in index.iter().zip(aff.iter()) {
                        scattered[expert as usize] = a;
                    }
                }
            },
        );
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

    // d logits [T, E], row by row.
    let mut d_logits = vec![0.0f32; t * e];
    d_logits.par_chunks_mut(e).enumerate().for_each_init(
        || (vec![0.0f32; e], vec![0.0f32; k]),
        |(log_aff, aff), (token, d_row)| {
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
                    for (dl, &la) in d_row.iter_mut().zip(log_aff.iter()) {
                        *dl -= la.exp() * total;
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
        },
    );

    let x = pipeline.x_hbm_layout.tokens_major(inputs.x)?;
    let x = x.f32_values();
    // d_x [T, H] = d_logits · wᵀ, in row tiles, reading w as stored.
    let stored = inputs.w.floats().expect("the contract checked w's dtype");
    let w = ExpertMatrix::of(stored, WeightLayout::Nki, 0, (h, e));
    let mut d_x = try_filled(&output(&rtb::D_X), &[t, h], 0.0f32)?;
    let tile = token_tile(t);
    d_x.par_chunks_mut(tile * h)
        .zip(d_logits.par_chunks(tile * e))
        .for_each_init(
            || (Vec::new(), Vec::new()),
            |(panel, tile), (d_x, d_logits)| w.transposed_product(d_x, d_logits, (panel, tile)),
        );
    // d_w [H, E] = xᵀ · d_logits, as its transpose d_logitsᵀ · x on packed panels of x (the
    // whole token reduction inside one product), in bands of D_W_BAND rows of d_w.
    let mut d_logits_t = vec![0.0f32; e * t];
    for (token, row) in d_logits.chunks(e).enumerate() {
        for (expert, &d) in row.iter().enumerate() {
            d_logits_t[expert * t + token] = d;
        }
    }
    let d_logits_t = MatRef::row_major(&d_logits_t, e, t);
    let mut d_w = try_filled(&output(&rtb::D_W), &[h, e], 0.0f32)?;
    let x = MatRef::row_major(&x, t, h);
    d_w.par_chunks_mut(D_W_BAND * e)
        .enumerate()
        .for_each_init(Vec::new, |d_w_t, (band, d_w)| {
            let rows = band * D_W_BAND..band * D_W_BAND + d_w.len() / e;
            let width = rows.len();
            d_w_t.resize(e * width, 0.0);
            // d_wᵀ [E, rows] = d_logitsᵀ · x [T, rows].
            matmul(d_w_t, d_logits_t, x.columns(rows), false);
            for (r, d_w_row) in d_w.chunks_mut(e).enumerate() {
                for (expert, d) in d_w_row.iter_mut().enumerate() {
                    *d = d_w_t[expert * width + r];
                }
            }
        });
    // d_w_bias [E] = Σ_t d_logits, in token order.
    let mut d_w_bias = vec![0.0f32; e];
    for row in d_logits.chunks(e) {
        for (db, d) in d_w_bias.iter_mut().zip(row) {
            *db += d;
        }
    }
    Ok(RouterTopkGrads {
        d_x: pipeline.x_hbm_layout.from_tokens_major(finite_output(
            rtb::D_X.name,
            &[t, h],
            d_x,
        )?)?,
        d_w: finite_output(rtb::D_W.name, &[h, e], d_w)?,
        d_w_bias: finite_output(rtb::D_W_BIAS.name, &[e], d_w_bias)?,
    })
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
