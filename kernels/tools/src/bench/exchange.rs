//! Expert-parallel exchange benchmark: `dispatch` + `combine` against the communicator's raw
//! variable all-to-all of the same bytes, in the same run, on the same ranks.
//!
//! Each iteration starts at a barrier; rank 0's wall time of the operation is recorded and the
//! median reported. Raw transfer: the send rows with their expert ids and affinities
//! (`(H + 2K) · 4` bytes per row) to their ranks, then `H · 4` bytes per row back: exactly
//! what dispatch and combine move.

use std::time::Instant;

use moekit::ep::{Communicator, DispatchParams, combine, dispatch};
use moekit::error::Result;
use moekit::random::SplitMix64;
use moekit::tensor::{Tensor, try_capacity};

use super::median;
use crate::layer::MoeShape;

/// One measured configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ExchangeRow {
    pub ranks: usize,
    /// Tokens per rank.
    pub tokens: usize,
    /// Median ms of dispatch + combine.
    pub exchange_ms: f64,
    /// Median ms of the raw all-to-all of the same bytes.
    pub raw_ms: f64,
    /// Bytes this rank sent and received in one dispatch + combine.
    pub bytes: usize,
}

impl ExchangeRow {
    /// Time added over the raw transfer, in percent.
    pub fn overhead_pct(&self) -> f64 {
        100.0 * (self.exchange_ms / self.raw_ms - 1.0)
    }
}

/// Deterministic inputs of one rank: `x [T, H]`, `expert_index [T, K]` (uniform, distinct
/// per row), `topk_affinities [T, K]`.
fn inputs(rank: usize, t: usize, shape: MoeShape) -> Result<(Tensor, Tensor, Tensor)> {
    let mut rng = SplitMix64::new(rank as u64 + 1);
    let mut x = try_capacity("benchmark input `x`", &[t, shape.h])?;
    x.extend((0..t * shape.h).map(|_| rng.uniform(-1.0, 1.0) as f32));
    let mut ids = try_capacity("benchmark input `expert_index`", &[t, shape.k])?;
    for _ in 0..t {
        let mut row: Vec<i32> = Vec::with_capacity(shape.k);
        while row.len() < shape.k {
            let id = rng.below(shape.e) as i32;
            if !row.contains(&id) {
                row.push(id);
            }
        }
        ids.extend(row);
    }
    Ok((
        Tensor::from_f32([t, shape.h], x)?,
        Tensor::from_i32([t, shape.k], ids)?,
        Tensor::from_f32([t, shape.k], vec![1.0 / shape.k as f32; t * shape.k])?,
    ))
}

/// Measures dispatch + combine and the raw all-to-all on every rank of `comm` (call on all);
/// the returned row holds rank 0's timings.
pub fn run(
    comm: &dyn Communicator,
    shape: MoeShape,
    tokens: usize,
    iterations: usize,
) -> Result<ExchangeRow> {
    let (x, index, affinities) = inputs(comm.rank(), tokens, shape)?;
    let params = DispatchParams {
        num_experts: shape.e,
    };
    let plan = dispatch(comm, &x, &index, &affinities, params)?;
    let send_counts: Vec<usize> = plan
        .route
        .send_counts
        .as_i32()
        .unwrap_or_default()
        .iter()
        .map(|&c| c as usize)
        .collect();
    let recv_counts: Vec<usize> = plan
        .route
        .recv_counts
        .as_i32()
        .unwrap_or_default()
        .iter()
        .map(|&c| c as usize)
        .collect();
    let row_out = (shape.h + 2 * shape.k) * 4;
    let row_back = shape.h * 4;
    let out_counts: Vec<usize> = send_counts.iter().map(|c| c * row_out).collect();
    let back_counts: Vec<usize> = recv_counts.iter().map(|c| c * row_back).collect();
    let out_bytes = vec![1u8; out_counts.iter().sum()];
    let back_bytes = vec![2u8; back_counts.iter().sum()];

    let (mut exchange, mut raw) = (Vec::new(), Vec::new());
    for _ in 0..iterations {
        comm.barrier()?;
        let start = Instant::now();
        let dispatched = dispatch(comm, &x, &index, &affinities, params)?;
        let output = combine(comm, &dispatched.route, &dispatched.hidden_states)?;
        exchange.push(start.elapsed().as_secs_f64() * 1e3);
        drop(output);
        comm.barrier()?;
        let start = Instant::now();
        let (received, _) = comm.all_to_all_v(&out_bytes, &out_counts)?;
        let (returned, _) = comm.all_to_all_v(&back_bytes, &back_counts)?;
        raw.push(start.elapsed().as_secs_f64() * 1e3);
        drop((received, returned));
    }
    let sent: usize = out_counts.iter().sum::<usize>() + back_counts.iter().sum::<usize>();
    let received =
        recv_counts.iter().sum::<usize>() * row_out + send_counts.iter().sum::<usize>() * row_back;
    Ok(ExchangeRow {
        ranks: comm.size(),
        tokens,
        exchange_ms: median(exchange),
        raw_ms: median(raw),
        bytes: sent + received,
    })
}

/// The table `moekit ep-bench` prints.
pub fn table(engine: &str, shape: MoeShape, rows: &[ExchangeRow]) -> String {
    let mut out = format!(
        "expert-parallel exchange, {} (H={}, E={}, K={}), {engine}\n{:>5} {:>7} {:>14} {:>10} {:>10} {:>10}\n",
        shape.name,
        shape.h,
        shape.e,
        shape.k,
        "R",
        "T/rank",
        "dispatch+comb",
        "raw a2av",
        "overhead",
        "MB/rank"
    );
    for row in rows {
        out.push_str(&format!(
            "{:>5} {:>7} {:>11.2} ms {:>7.2} ms {:>9.1}% {:>10.1}\n",
            row.ranks,
            row.tokens,
            row.exchange_ms,
            row.raw_ms,
            row.overhead_pct(),
            row.bytes as f64 / 1e6
        ));
    }
    out
}
