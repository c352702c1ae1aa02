//! Cases for `Communicator::all_to_all_v_rows` and what each rank must receive (shared by the
//! `LocalComm` and the MPI tests).

use std::mem::MaybeUninit;

use moekit::ep::{Communicator, RowChunks, RowsToSend};

use super::SeededRng;

/// Every rank's source rows and what it sends every other rank.
#[derive(Clone, Debug)]
pub struct RowsCase {
    pub r: usize,
    pub width: usize,
    /// Rows in each rank's source.
    pub rows: usize,
    /// `selections[src][dst]`: the rows src sends dst, in order. With `consecutive`, each
    /// source's selections are consecutive ranges: back to back from row 0, or with
    /// `send_stride` S at rows `dst·S…`.
    pub selections: Vec<Vec<Vec<usize>>>,
    pub consecutive: bool,
    pub send_stride: Option<usize>,
    /// Each source's rows land back to back, or with S at rows `src·S…` (the rows between
    /// the chunks keep [`UNTOUCHED`]).
    pub recv_stride: Option<usize>,
}

/// What a receive buffer holds before the exchange: a rank's own chunk must keep it.
pub const UNTOUCHED: f32 = -7.5;

impl RowsCase {
    /// A random case for R ranks: gathered selections mix empty, consecutive, repeated and
    /// unordered rows; consecutive ones have random counts.
    pub fn new(r: usize, seed: u64, consecutive: bool) -> Self {
        let mut rng = SeededRng::new(seed);
        let width = 1 + rng.below(5);
        let mut rows = 1 + rng.below(9);
        // Strided chunks hold at most 4 rows, and up to 2 more rows past them.
        let send_stride = (consecutive && rng.below(2) == 0).then(|| 4 + rng.below(3));
        if let Some(stride) = send_stride {
            rows = r * stride;
        }
        let selections: Vec<Vec<Vec<usize>>> = (0..r)
            .map(|_| {
                if consecutive {
                    let mut start = 0;
                    (0..r)
                        .map(|dst| {
                            if let Some(stride) = send_stride {
                                start = dst * stride;
                            }
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
        let largest = selections.iter().flatten().map(Vec::len).max().unwrap_or(0);
        let recv_stride = (rng.below(2) == 0).then(|| largest + rng.below(3));
        Self {
            r,
            width,
            rows,
            selections,
            consecutive,
            send_stride,
            recv_stride,
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

    /// What rank `rank`'s receive buffer must hold, one chunk per source in rank order, then
    /// (strided) the rows past each source's: every other source's selected rows; its own
    /// chunk and the rows past the chunks keep [`UNTOUCHED`].
    pub fn expected(&self, rank: usize) -> Vec<Vec<f32>> {
        let mut chunks: Vec<Vec<f32>> = (0..self.r)
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
            .collect();
        if let Some(stride) = self.recv_stride {
            chunks.extend((0..self.r).map(|src| {
                let past = stride - self.selections[src][rank].len();
                vec![UNTOUCHED; past * self.width]
            }));
        }
        chunks
    }

    /// Runs the exchange on `comm` (every rank of the group calls it): the receive buffer as
    /// [`Self::expected`] lays it out.
    pub fn run(&self, comm: &dyn Communicator) -> moekit::Result<Vec<Vec<f32>>> {
        let rank = comm.rank();
        let counts: Vec<usize> = self.selections[rank].iter().map(Vec::len).collect();
        let rows = match (self.consecutive, self.send_stride) {
            (false, _) => RowsToSend::Gathered(&self.selections[rank]),
            (true, None) => RowsToSend::Chunks(RowChunks::Packed(&counts)),
            (true, Some(stride)) => RowsToSend::Chunks(RowChunks::Strided {
                counts: &counts,
                stride,
            }),
        };
        let recv_rows: Vec<usize> = (0..self.r)
            .map(|src| self.selections[src][rank].len())
            .collect();
        let recv = match self.recv_stride {
            None => RowChunks::Packed(&recv_rows),
            Some(stride) => RowChunks::Strided {
                counts: &recv_rows,
                stride,
            },
        };
        let mut out = vec![MaybeUninit::new(UNTOUCHED); recv.rows() * self.width];
        comm.all_to_all_v_rows(&self.source(rank), self.width, rows, recv, &mut out)?;
        // SAFETY: every element was initialised before the exchange.
        let values: Vec<f32> = out
            .into_iter()
            .map(|v| unsafe { v.assume_init() })
            .collect();
        let word = |row: usize| row * self.width;
        let mut chunks: Vec<Vec<f32>> = (0..self.r)
            .map(|src| values[word(recv.range(src).start)..word(recv.range(src).end)].to_vec())
            .collect();
        if self.recv_stride.is_some() {
            chunks.extend((0..self.r).map(|src| {
                let chunk = recv.range(src);
                values[word(chunk.end)..word(chunk.start + recv.rows() / self.r)].to_vec()
            }));
        }
        Ok(chunks)
    }
}
