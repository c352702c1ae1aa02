//! f64 router forward and backward (see [`crate::contracts::router_topk`] for the contract).
//!
//! Affinities are computed from log-affinities (`log softmax` or `log sigmoid`), so the
//! renormalised top-k values stay exact even when the selected probabilities underflow.

use crate::contracts::{Activation, RouterTopkBwdParams, RouterTopkParams};

/// Forward results in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterForward {
    /// `[T, E]`.
    pub logits: Vec<f64>,
    /// `[T, K]`.
    pub expert_index: Vec<usize>,
    /// `[T, K]`.
    pub topk_affinities: Vec<f64>,
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
fn log_affinities(logits: &[f64], activation: Activation) -> Vec<f64> {
    match activation {
        Activation::Softmax => {
            let lse = log_sum_exp(logits.iter().copied());
            logits.iter().map(|&l| l - lse).collect()
        }
        Activation::Sigmoid => logits.iter().map(|&l| -softplus(-l)).collect(),
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

/// Router forward. `x [T, H]`, `w [H, E]`, optional `bias [E]` and `selection_bias [E]`.
pub fn router_forward(
    x: &[f64],
    w: &[f64],
    bias: Option<&[f64]>,
    selection_bias: Option<&[f64]>,
    (t, h, e): (usize, usize, usize),
    params: RouterTopkParams,
) -> RouterForward {
    let k = params.top_k;
    let mut out = RouterForward {
        logits: vec![0.0; t * e],
        expert_index: Vec::with_capacity(t * k),
        topk_affinities: Vec::with_capacity(t * k),
    };
    for token in 0..t {
        let row = &mut out.logits[token * e..(token + 1) * e];
        for (expert, logit) in row.iter_mut().enumerate() {
            let dot: f64 = (0..h).map(|j| x[token * h + j] * w[j * e + expert]).sum();
            *logit = dot + bias.map_or(0.0, |b| b[expert]);
        }
        let log_aff = log_affinities(row, params.activation);
        let scores: Vec<f64> = log_aff
            .iter()
            .enumerate()
            .map(|(expert, la)| la.exp() + selection_bias.map_or(0.0, |b| b[expert]))
            .collect();
        let selected = top_k(&scores, k);
        out.topk_affinities.extend(selected_affinities(
            &log_aff,
            &selected,
            params.norm_topk_prob,
        ));
        out.expert_index.extend(selected);
    }
    out
}

/// Router gradients in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterGrads {
    /// `[T, H]`.
    pub d_x: Vec<f64>,
    /// `[H, E]`.
    pub d_w: Vec<f64>,
    /// `[E]`.
    pub d_bias: Vec<f64>,
}

/// Router backward: `d_topk_affinities [T, K]` (and `d_router_logits [T, E]`) through the
/// affinities, activation and logits GEMM to `x`, `w` and `bias`.
#[allow(clippy::too_many_arguments)] // the backward consumes eight distinct tensors
pub fn router_backward(
    x: &[f64],
    w: &[f64],
    router_logits: &[f64],
    expert_index: &[usize],
    d_topk_affinities: &[f64],
    d_router_logits: Option<&[f64]>,
    (t, h, e, k): (usize, usize, usize, usize),
    params: RouterTopkBwdParams,
) -> RouterGrads {
    let RouterTopkBwdParams {
        activation,
        norm_topk_prob,
    } = params;
    let mut d_logits = vec![0.0; t * e];
    for token in 0..t {
        let logits = &router_logits[token * e..(token + 1) * e];
        let selected = &expert_index[token * k..(token + 1) * k];
        let d_aff = &d_topk_affinities[token * k..(token + 1) * k];
        let log_aff = log_affinities(logits, activation);
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
        match activation {
            Activation::Softmax => {
                let total: f64 = d_log_aff.iter().sum();
                for ((dl, &dla), &la) in row.iter_mut().zip(&d_log_aff).zip(&log_aff) {
                    *dl = dla - la.exp() * total;
                }
            }
            Activation::Sigmoid => {
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
    }
    let mut grads = RouterGrads {
        d_x: vec![0.0; t * h],
        d_w: vec![0.0; h * e],
        d_bias: vec![0.0; e],
    };
    for token in 0..t {
        for expert in 0..e {
            let dl = d_logits[token * e + expert];
            grads.d_bias[expert] += dl;
            for j in 0..h {
                grads.d_x[token * h + j] += dl * w[j * e + expert];
                grads.d_w[j * e + expert] += x[token * h + j] * dl;
            }
        }
    }
    grads
}
