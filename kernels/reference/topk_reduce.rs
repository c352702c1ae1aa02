//! `topk_reduce` by its definition: each token's gathered rows summed in f64.

use crate::contracts::{TopkReduce, TopkReduceDims};

/// `output [T, H]`, rounded once to f32.
pub fn topk_reduce(call: &TopkReduce<'_>) -> Vec<f32> {
    let TopkReduceDims { h, t, .. } = call.dims();
    let input = call.values();
    let mut output = Vec::with_capacity(t * h);
    for token in 0..t {
        for col in 0..h {
            let sum: f64 = (call.rows_of(token).iter())
                .map(|&row| f64::from(input[row * (h + 2) + col].to_f32()))
                .sum();
            output.push(sum as f32);
        }
    }
    output
}
