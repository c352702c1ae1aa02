//! `topk` on the cpu backend: each row split into chunks of [`CHUNK`] positions, one task per
//! chunk keeping its K best candidates above a rising floor (one comparison per element once
//! the floor has risen), then each row's candidates merged.
//!
//! A candidate is one `u64` key ordering as the contract orders (value descending, then
//! position ascending): the value mapped to an order-preserving `u32` in the high half, the
//! position's complement in the low half. Keys are distinct, so the K largest are one set
//! whatever the chunking and the thread count.

use rayon::prelude::*;

use crate::contracts::{Topk, TopkDims, TopkOutputs};
use crate::error::Result;
use crate::tensor::Floats;

/// Positions per task: a decoding step's one row of a vocabulary (~150k) makes ten tasks.
const CHUNK: usize = 16_384;

/// Candidates a chunk collects beyond K before it cuts back to the K best.
const SLACK: usize = 512;

/// The order-preserving key of `value` at `position`.
fn key(value: f32, position: usize) -> u64 {
    // −0 and +0 are equal values: both map as +0.
    let bits = (value + 0.0).to_bits();
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(ordered) << 32) | u64::from(!(position as u32))
}

fn position(key: u64) -> i32 {
    !(key as u32) as i32
}

/// Keeps the `k` largest keys offered.
struct Best {
    k: usize,
    keys: Vec<u64>,
    /// Every key kept exceeds it once `k` have been kept (finite values' keys exceed 0).
    floor: u64,
}

impl Best {
    fn new(k: usize) -> Self {
        Self {
            k,
            keys: Vec::with_capacity(k + SLACK.max(k)),
            floor: 0,
        }
    }

    fn offer(&mut self, key: u64) {
        if key > self.floor {
            self.keys.push(key);
            if self.keys.len() == self.keys.capacity() {
                self.cut();
            }
        }
    }

    /// Keeps the `k` largest and raises the floor to the smallest of them.
    fn cut(&mut self) {
        if self.keys.len() > self.k {
            self.keys
                .select_nth_unstable_by(self.k - 1, |a, b| b.cmp(a));
            self.keys.truncate(self.k);
            self.floor = self.keys.iter().copied().min().unwrap_or(0);
        }
    }

    fn into_keys(mut self) -> Vec<u64> {
        self.cut();
        self.keys
    }
}

/// The best `k` keys of positions `positions` of `row`.
fn chunk_best(row: Floats<'_>, positions: std::ops::Range<usize>, k: usize) -> Vec<u64> {
    let mut best = Best::new(k);
    let first = positions.start;
    match row {
        Floats::F32(v) => {
            for (p, &x) in v[positions].iter().enumerate() {
                best.offer(key(x, first + p));
            }
        }
        Floats::BF16(v) => {
            for (p, x) in v[positions].iter().enumerate() {
                best.offer(key(x.to_f32(), first + p));
            }
        }
    }
    best.into_keys()
}

pub(super) fn forward(call: &Topk<'_>) -> Result<TopkOutputs> {
    let TopkDims { rows, v, k } = call.dims();
    if call.is_whole_row() {
        let positions = (0..rows).flat_map(|_| 0..v as i32).collect();
        return call.outputs_at(positions);
    }
    let values = call.values();
    let chunks = v.div_ceil(CHUNK);
    let candidates: Vec<Vec<u64>> = (0..rows * chunks)
        .into_par_iter()
        .map(|task| {
            let (row, chunk) = (task / chunks, task % chunks);
            let first = chunk * CHUNK;
            chunk_best(
                values_of_row(values, row, v),
                first..v.min(first + CHUNK),
                k,
            )
        })
        .collect();
    let sorted = call.params().sorted_flag;
    let positions: Vec<i32> = candidates
        .par_chunks(chunks)
        .flat_map_iter(|row| {
            let mut keys: Vec<u64> = row.concat();
            if keys.len() > k {
                keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
                keys.truncate(k);
            }
            if sorted {
                keys.sort_unstable_by(|a, b| b.cmp(a));
                keys.into_iter().map(position).collect()
            } else {
                let mut positions: Vec<i32> = keys.into_iter().map(position).collect();
                positions.sort_unstable();
                positions
            }
        })
        .collect();
    call.outputs_at(positions)
}

/// Row `row` of `[rows, V]` values.
fn values_of_row(values: Floats<'_>, row: usize, v: usize) -> Floats<'_> {
    match values {
        Floats::F32(all) => Floats::F32(&all[row * v..(row + 1) * v]),
        Floats::BF16(all) => Floats::BF16(&all[row * v..(row + 1) * v]),
    }
}
