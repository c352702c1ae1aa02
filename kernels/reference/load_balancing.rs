//! f64 auxiliary load-balancing loss (see [`crate::contracts::load_balancing_loss`]).

use crate::contracts::LoadBalancingDims;

/// Row-wise softmax of `logits [rows, E]`.
fn softmax_rows(logits: &[f64], e: usize) -> Vec<f64> {
    let mut probs = Vec::with_capacity(logits.len());
    for row in logits.chunks(e) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|&l| (l - max).exp()).sum();
        probs.extend(row.iter().map(|&l| (l - max).exp() / sum));
    }
    probs
}

/// Top-k assignments per (layer, expert): `[L, E]`, from `expert_index [L·T, K]`.
fn counts(expert_index: &[usize], l: usize, t: usize, e: usize, k: usize) -> Vec<usize> {
    let mut counts = vec![0; l * e];
    for (row, ids) in expert_index.chunks(k).enumerate() {
        let layer = row / t;
        for &id in ids {
            counts[layer * e + id] += 1;
        }
    }
    counts
}

/// Loss value and per-layer expert counts `[L, E]`. `logits [L·T, E]`, `expert_index [L·T, K]`.
pub fn load_balancing_forward(
    logits: &[f64],
    expert_index: &[usize],
    LoadBalancingDims { l, t, e, k }: LoadBalancingDims,
) -> (f64, Vec<usize>) {
    let rows = (l * t) as f64;
    let probs = softmax_rows(logits, e);
    let counts = counts(expert_index, l, t, e, k);
    let mut loss = 0.0;
    for expert in 0..e {
        let assigned: usize = (0..l).map(|layer| counts[layer * e + expert]).sum();
        let mean_prob: f64 = probs.iter().skip(expert).step_by(e).sum::<f64>() / rows;
        loss += assigned as f64 / rows * mean_prob;
    }
    (e as f64 * loss, counts)
}

/// `d_router_logits [L·T, E]` for a loss gradient `d_aux_loss`.
pub fn load_balancing_backward(
    logits: &[f64],
    expert_index: &[usize],
    d_aux_loss: f64,
    LoadBalancingDims { l, t, e, k }: LoadBalancingDims,
) -> Vec<f64> {
    let rows = (l * t) as f64;
    let probs = softmax_rows(logits, e);
    let counts = counts(expert_index, l, t, e, k);
    // ∂loss/∂p[n, e] = E · f[e] / (L·T), with f[e] = count_e / (L·T).
    let d_probs: Vec<f64> = (0..e)
        .map(|expert| {
            let assigned: usize = (0..l).map(|layer| counts[layer * e + expert]).sum();
            d_aux_loss * e as f64 * assigned as f64 / (rows * rows)
        })
        .collect();
    let mut d_logits = Vec::with_capacity(logits.len());
    for p in probs.chunks(e) {
        let centre: f64 = p.iter().zip(&d_probs).map(|(p, g)| p * g).sum();
        d_logits.extend(p.iter().zip(&d_probs).map(|(p, g)| p * (g - centre)));
    }
    d_logits
}
