//! `topk` by its definition: each row's positions sorted by value (descending, the lower
//! position first between equal values, −0 equal to +0), the first K kept, then put in the
//! output's order.

use crate::contracts::{Topk, TopkDims};

/// The chosen positions `[rows, K]` in output order (see [`crate::contracts::topk`]).
pub fn topk_positions(call: &Topk<'_>) -> Vec<i32> {
    let TopkDims { rows, v, k } = call.dims();
    let values = call.values().to_f32();
    let sorted = call.params().sorted_flag;
    (0..rows)
        .flat_map(|row| {
            let row_values: Vec<f64> = values[row * v..(row + 1) * v]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            let mut order: Vec<usize> = (0..v).collect();
            if !call.is_whole_row() {
                // Finite values (checked), so `partial_cmp` orders them all.
                order.sort_by(|&a, &b| {
                    let by_value = row_values[b].partial_cmp(&row_values[a]);
                    by_value.expect("finite").then(a.cmp(&b))
                });
                order.truncate(k);
                if !sorted {
                    order.sort_unstable();
                }
            }
            order.into_iter().map(|p| p as i32)
        })
        .collect()
}
