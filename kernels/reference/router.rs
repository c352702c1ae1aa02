//! f64 router forward and backward (see [`crate::contracts::router_topk`] for the contract).
//!
//! Affinities are computed from log-affinities (`log softmax` or `log sigmoid`), so the
//! renormalised top-k values stay exact even when the selected probabilities underflow.

use crate::contracts::spec::output;
use crate::contracts::tensors::router_topk as rt;
use crate::contracts::{RouterActFnType, RouterPipeline};
use crate::error::Result;
use crate::tensor::{DType, try_capacity, try_filled};

/// Forward results in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterForward {
    /// `[T, E]`.
    pub logits: Vec<f64>,
    /// `[T, K]`.
    pub expert_index: Vec<usize>,
    /// `[T, K]`.
    pub topk_affinities: Vec<f64>,
    /// `[T, E]`: every expert's affinity (ACT1 without renormalisation) or the selected ones
    /// scattered.
    pub expert_affinities: Vec<f64>,
}

/// `ln(1 + eˣ)` without overflow.
fn softplus(x: f64) -> f64 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

fn log_sum_exp(values: impl Iterator<Item = f64> + Clone) -> f64 {
    let max = values.clone().fold(f64::NEG_INFINITY, f64::max);
    max + values.map(|v| (v - max).exp()).sum::<f64>().ln()
}

/// Log-affinity of every expert for one row of logits.
fn log_affinities(logits: &[f64], act_fn: RouterActFnType) -> Vec<f64> {
    match act_fn {
        RouterActFnType::Softmax => {
            let lse = log_sum_exp(logits.iter().copied());
            logits.iter().map(|&l| l - lse).collect()
        }
        RouterActFnType::Sigmoid => logits.iter().map(|&l| -softplus(-l)).collect(),
    }
}

/// Indices of the `k` largest scores, descending; equal scores go to the lower index.
fn top_k(scores: &[f64], k: usize) -> Vec<usize> {
    let mut chosen: Vec<usize> = Vec::with_capacity(k);
    for _ in 0..k {
        let mut best: Option<usize> = None;
        for (e, &s) in scores.iter().enumerate() {
            if !chosen.contains(&e) && best.is_none_or(|b| s > scores[b]) {
                best = Some(e);
            }
        }
        chosen.extend(best);
    }
    chosen
}

/// The selected experts' affinities: probabilities, or probabilities renormalised over the
/// selection (a softmax over the selected log-affinities).
fn selected_affinities(log_aff: &[f64], selected: &[usize], norm_topk_prob: bool) -> Vec<f64> {
    let lse = log_sum_exp(selected.iter().map(|&e| log_aff[e]));
    selected
        .iter()
        .map(|&e| {
            if norm_topk_prob {
                (log_aff[e] - lse).exp()
            } else {
                log_aff[e].exp()
            }
        })
        .collect()
}

/// Router forward. `x [T, H]` (already in that layout), `w [H, E]`, optional `w_bias [E]` and
/// `selection_bias [E]`; K experts per token through `pipeline`.
pub fn router_forward(
    x: &[f64],
    w: &[f64],
    w_bias: Option<&[f64]>,
    selection_bias: Option<&[f64]>,
    (t, h, e, k): (usize, usize, usize, usize),
    pipeline: RouterPipeline,
) -> Result<RouterForward> {
    // `[T, E]` outgrows the inputs when H is small: allocated checked.
    let mut out = RouterForward {
        logits: try_filled(&output(&rt::ROUTER_LOGITS), &[t, e], 0.0)?,
        expert_index: try_capacity(&output(&rt::EXPERT_INDEX), &[t, k])?,
        topk_affinities: try_capacity(&output(&rt::TOPK_AFFINITIES), &[t, k])?,
        expert_affinities: try_filled(&output(&rt::EXPERT_AFFINITIES), &[t, e], 0.0)?,
    };
    for token in 0..t {
        let row = &mut out.logits[token * e..(token + 1) * e];
        for (expert, logit) in row.iter_mut().enumerate() {
            let dot: f64 = (0..h).map(|j| x[token * h + j] * w[j * e + expert]).sum();
            *logit = dot + w_bias.map_or(0.0, |b| b[expert]);
        }
        let log_aff = log_affinities(row, pipeline.act_fn);
        // ACT1 chooses by affinity, ACT2 by logit; selection_bias shifts either.
        let scores: Vec<f64> = (0..e)
            .map(|expert| {
                let score = if pipeline.router_pre_norm {
                    log_aff[expert].exp()
                } else {
                    row[expert]
                };
                score + selection_bias.map_or(0.0, |b| b[expert])
            })
            .collect();
        let selected = top_k(&scores, k);
        let affinities = selected_affinities(&log_aff, &selected, pipeline.renormalises());
        let dense = &mut out.expert_affinities[token * e..(token + 1) * e];
        if pipeline.dense_affinities() {
            for (a, la) in dense.iter_mut().zip(&log_aff) {
                *a = la.exp();
            }
        } else {
            for (&expert, &a) in selected.iter().zip(&affinities) {
                dense[expert] = a;
            }
        }
        out.topk_affinities.extend(affinities);
        out.expert_index.extend(selected);
    }
    Ok(out)
}

/// Router gradients in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterGrads {
    /// `[T, H]`.
    pub d_x: Vec<f64>,
    /// `[H, E]`.
    pub d_w: Vec<f64>,
    /// `[E]`.
    pub d_w_bias: Vec<f64>,
}

/// Router backward: `d_topk_affinities [T, K]` (and `d_router_logits [T, E]`) through the
/// affinities, activation and logits GEMM to `x [T, H]` (in that layout), `w` and `w_bias`.
/// Computing in bf16 (`compute_dtype`), `d_logits` is rounded where it is formed and `x` and
/// `w` are read rounded.
#[allow(clippy::too_many_arguments)] // the backward consumes eight distinct tensors
pub fn router_backward(
    x: &[f64],
    w: &[f64],
    router_logits: &[f64],
    expert_index: &[usize],
    d_topk_affinities: &[f64],
    d_router_logits: Option<&[f64]>,
    (t, h, e, k): (usize, usize, usize, usize),
    (pipeline, compute_dtype): (RouterPipeline, DType),
) -> RouterGrads {
    let operand = |v: f64| super::operand(compute_dtype, v);
    let (act_fn, norm_topk_prob) = (pipeline.act_fn, pipeline.renormalises());
    let mut d_logits = vec![0.0; t * e];
    for token in 0..t {
        let logits = &router_logits[token * e..(token + 1) * e];
        let selected = &expert_index[token * k..(token + 1) * k];
        let d_aff = &d_topk_affinities[token * k..(token + 1) * k];
        let log_aff = log_affinities(logits, act_fn);
        let aff = selected_affinities(&log_aff, selected, norm_topk_prob);
        // Gradient w.r.t. the log-affinities of the selected experts.
        let mut d_log_aff = vec![0.0; e];
        let centre: f64 = if norm_topk_prob {
            d_aff.iter().zip(&aff).map(|(d, a)| d * a).sum()
        } else {
            0.0
        };
        for ((&expert, &d), &a) in selected.iter().zip(d_aff).zip(&aff) {
            d_log_aff[expert] = (d - centre) * a;
        }
        let row = &mut d_logits[token * e..(token + 1) * e];
        match act_fn {
            RouterActFnType::Softmax if pipeline.router_pre_norm => {
                let total: f64 = d_log_aff.iter().sum();
                for ((dl, &dla), &la) in row.iter_mut().zip(&d_log_aff).zip(&log_aff) {
                    *dl = dla - la.exp() * total;
                }
            }
            // ACT2's softmax over the K selected logits: its log-affinities are the logits
            // up to a shift, which the renormalisation's centring already removed.
            RouterActFnType::Softmax => row.copy_from_slice(&d_log_aff),
            RouterActFnType::Sigmoid => {
                // d log σ(l) / dl = 1 − σ(l) = σ(−l).
                for ((dl, &dla), &l) in row.iter_mut().zip(&d_log_aff).zip(logits) {
                    *dl = dla * (-softplus(l)).exp();
                }
            }
        }
        if let Some(extra) = d_router_logits {
            for (dl, &d) in row.iter_mut().zip(&extra[token * e..(token + 1) * e]) {
                *dl += d;
            }
        }
        for dl in row.iter_mut() {
            *dl = operand(*dl);
        }
    }
    let mut grads = RouterGrads {
        d_x: vec![0.0; t * h],
        d_w: vec![0.0; h * e],
        d_w_bias: vec![0.0; e],
    };
    for token in 0..t {
        for expert in 0..e {
            let dl = d_logits[token * e + expert];
            grads.d_w_bias[expert] += dl;
            for j in 0..h {
                grads.d_x[token * h + j] += dl * operand(w[j * e + expert]);
                grads.d_w[j * e + expert] += operand(x[token * h + j]) * dl;
            }
        }
    }
    grads
}
