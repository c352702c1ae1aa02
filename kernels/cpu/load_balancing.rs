//! The auxiliary load-balancing loss on the CPU: per-row softmax ([`softmax`], 16 lanes at a
//! time on AVX-512) in parallel over fixed row chunks, chunk partial sums combined in chunk
//! order (so the result does not depend on the thread count), f64 accumulation of the pooled
//! means.

use rayon::prelude::*;

use super::alloc::output_buffer;
use super::element::{all_fit, finite_output, screened_output};
use super::exp::softmax;
use crate::contracts::tensors::{load_balancing_loss as lb, load_balancing_loss_bwd as lbb};
use crate::contracts::{
    LoadBalancingDims, LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads,
    LoadBalancingLossOutputs,
};
use crate::error::Result;
use crate::tensor::Tensor;
use crate::uninit::{assume_init, assume_init_ref};

/// Rows per parallel chunk; fixed so the summation order is too.
const CHUNK_ROWS: usize = 256;

/// Pooled assignments per expert (`[E]`, summed over layers) and per-layer counts `[L, E]`.
fn counts(
    ids: &[i32],
    LoadBalancingDims { l, t, e, k }: LoadBalancingDims,
) -> (Vec<usize>, Vec<usize>) {
    let mut per_layer = vec![0usize; l * e];
    for (row, chunk) in ids.chunks(k).enumerate() {
        for &id in chunk {
            per_layer[(row / t) * e + id as usize] += 1;
        }
    }
    let pooled = (0..e)
        .map(|expert| (0..l).map(|layer| per_layer[layer * e + expert]).sum())
        .collect();
    (pooled, per_layer)
}

pub(super) fn forward(call: &LoadBalancingLoss<'_>) -> Result<LoadBalancingLossOutputs> {
    let inputs = call.inputs();
    let dims = call.dims();
    let LoadBalancingDims { l, t, e, .. } = dims;
    let logits = inputs.router_logits.f32_values();
    let ids = call.expert_ids();
    // Σ_n p[n, e] per chunk, then over chunks in order.
    let partial: Vec<Vec<f64>> = logits
        .par_chunks(CHUNK_ROWS * e)
        .map(|chunk| {
            let mut sums = vec![0.0f64; e];
            let mut probs = vec![0.0f32; e];
            for row in chunk.chunks(e) {
                softmax(row, &mut probs);
                for (s, &p) in sums.iter_mut().zip(&probs) {
                    *s += f64::from(p);
                }
            }
            sums
        })
        .collect();
    let mut prob_sums = vec![0.0f64; e];
    for sums in &partial {
        for (total, s) in prob_sums.iter_mut().zip(sums) {
            *total += s;
        }
    }
    let (pooled, per_layer) = counts(ids, dims);
    let rows = (l * t) as f64;
    let loss: f64 = pooled
        .iter()
        .zip(&prob_sums)
        .map(|(&c, &p)| c as f64 / rows * (p / rows))
        .sum::<f64>()
        * e as f64;
    Ok(LoadBalancingLossOutputs {
        aux_loss: finite_output(lb::AUX_LOSS.name, &[1], vec![loss as f32])?,
        expert_counts: Tensor::from_i32([l, e], per_layer.into_iter().map(|c| c as i32).collect())?,
    })
}

pub(super) fn backward(call: &LoadBalancingLossBwd<'_>) -> Result<LoadBalancingLossGrads> {
    let inputs = call.inputs();
    let dims = call.dims();
    let LoadBalancingDims { l, t, e, .. } = dims;
    let logits = inputs.router_logits.f32_values();
    let ids = call.expert_ids();
    let d_aux = f64::from(inputs.d_aux_loss.f32_values()[0]);
    let (pooled, _) = counts(ids, dims);
    let rows = (l * t) as f64;
    // ∂loss/∂p[n, e] = E · count_e / (L·T)².
    let d_probs: Vec<f32> = pooled
        .iter()
        .map(|&c| (d_aux * e as f64 * c as f64 / (rows * rows)) as f32)
        .collect();
    let mut d_logits = output_buffer(lbb::D_ROUTER_LOGITS.name, inputs.router_logits.shape())?;
    let finite = d_logits
        .par_chunks_mut(CHUNK_ROWS * e)
        .zip(logits.par_chunks(CHUNK_ROWS * e))
        .map(|(d_chunk, chunk)| {
            let mut probs = vec![0.0f32; e];
            let mut finite = true;
            for (d_row, row) in d_chunk.chunks_mut(e).zip(chunk.chunks(e)) {
                softmax(row, &mut probs);
                let centre: f32 = probs.iter().zip(&d_probs).map(|(p, g)| p * g).sum();
                for ((d, p), g) in d_row.iter_mut().zip(&probs).zip(&d_probs) {
                    d.write(p * (g - centre));
                }
                // SAFETY: every element of the row was just written.
                finite &= all_fit::<f32>(unsafe { assume_init_ref(d_row) });
            }
            finite
        })
        .reduce(|| true, |a, b| a && b);
    // SAFETY: the chunks cover the buffer, and every row of every chunk was written.
    let d_logits = unsafe { assume_init(d_logits) };
    Ok(LoadBalancingLossGrads {
        d_router_logits: screened_output(
            lbb::D_ROUTER_LOGITS.name,
            inputs.router_logits.shape(),
            d_logits,
            finite,
        )?,
    })
}
