//! `topk_reduce` on the cpu backend: tokens in parallel, each token's rows (in row order)
//! summed in f32 over its row of `output`.

use rayon::prelude::*;

use crate::contracts::{TopkReduce, TopkReduceDims};

/// `output [T, H]` in f32.
pub(super) fn forward(call: &TopkReduce<'_>) -> Vec<f32> {
    let TopkReduceDims { h, t, .. } = call.dims();
    let input = call.values();
    let mut output = vec![0.0f32; t * h];
    if h == 0 {
        return output;
    }
    output
        .par_chunks_mut(h)
        .enumerate()
        .for_each(|(token, out)| {
            for &row in call.rows_of(token) {
                let values = &input[row * (h + 2)..row * (h + 2) + h];
                for (o, v) in out.iter_mut().zip(values) {
                    *o += v.to_f32();
                }
            }
        });
    output
}
