//! Cases for `Communicator::all_to_all_v_rows` and what each rank must receive (shared by the
//! `LocalComm` and the MPI tests).

use std::mem::MaybeUninit;

use moekit::ep::{Communicator, RowsToSend};

use super::SeededRng;

/// Every rank's source rows and what it sends every other rank.
#[derive(Clone, Debug)]
pub struct RowsCase {
    pub r: usize,
    pub width: usize,
    /// Rows in each rank's source.
    pub rows: usize,
    /// `selections[src][dst]`: the rows src sends dst, in order. With `consecutive`, each
    /// source's selections are consecutive ranges back to back from row 0.
    pub selections: Vec<Vec<Vec<usize>>>,
    pub consecutive: bool,
}

/// What a receive buffer holds before the exchange: a rank's own chunk must keep it.
pub const UNTOUCHED: f32 = -7.5;

impl RowsCase {
    /// A random case for R ranks: gathered selections mix empty, consecutive, repeated and
    /// unordered rows; consecutive ones have random counts.
    pub fn new(r: usize, seed: u64, consecutive: bool) -> Self {
        let mut rng = SeededRng::new(seed);
        let width = 1 + rng.below(5);
        let rows = 1 + rng.below(9);
        let selections = (0..r)
            .map(|_| {
                if consecutive {
                    let mut start = 0;
                    (0..r)
                        .map(|_| {
                            let count = rng.below(rows - start + 1).min(4);
                            start += count;
                            (start - count..start).collect()
                        })
                        .collect()
                } else {
                    (0..r)
                        .map(|_| match rng.below(3) {
                            0 => Vec::new(),
                            1 => {
                                let first = rng.below(rows);
                                (first..rows.min(first + 1 + rng.below(4))).collect()
                            }
                            _ => (0..1 + rng.below(6)).map(|_| rng.below(rows)).collect(),
                        })
                        .collect()
                }
            })
            .collect();
        Self {
            r,
            width,
            rows,
            selections,
            consecutive,
        }
    }

    /// Word `col` of row `row` of rank `src`'s source.
    fn value(&self, src: usize, row: usize, col: usize) -> f32 {
        (src * 10_000 + row * 10 + col) as f32 + 0.25
    }

    /// Rank `rank`'s source, `[rows, width]`.
    pub fn source(&self, rank: usize) -> Vec<f32> {
        (0..self.rows)
            .flat_map(|row| (0..self.width).map(move |col| self.value(rank, row, col)))
            .collect()
    }

    /// The chunks rank `rank` must receive, one per source in rank order; its own chunk keeps
    /// [`UNTOUCHED`].
    pub fn expected(&self, rank: usize) -> Vec<Vec<f32>> {
        (0..self.r)
            .map(|src| {
                self.selections[src][rank]
                    .iter()
                    .flat_map(|&row| {
                        (0..self.width).map(move |col| match src == rank {
                            true => UNTOUCHED,
                            false => self.value(src, row, col),
                        })
                    })
                    .collect()
            })
            .collect()
    }

    /// Runs the exchange on `comm` (every rank of the group calls it): the chunks received.
    pub fn run(&self, comm: &dyn Communicator) -> moekit::Result<Vec<Vec<f32>>> {
        let rank = comm.rank();
        let counts: Vec<usize> = self.selections[rank].iter().map(Vec::len).collect();
        let rows = if self.consecutive {
            RowsToSend::Consecutive(&counts)
        } else {
            RowsToSend::Gathered(&self.selections[rank])
        };
        let recv_rows: Vec<usize> = (0..self.r)
            .map(|src| self.selections[src][rank].len())
            .collect();
        let total = recv_rows.iter().sum::<usize>() * self.width;
        let mut out = vec![MaybeUninit::new(UNTOUCHED); total];
        comm.all_to_all_v_rows(&self.source(rank), self.width, rows, &recv_rows, &mut out)?;
        // SAFETY: every element was initialised before the exchange.
        let mut values = out.into_iter().map(|v| unsafe { v.assume_init() });
        Ok(recv_rows
            .iter()
            .map(|&rows| values.by_ref().take(rows * self.width).collect())
            .collect())
    }
}
