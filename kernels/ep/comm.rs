//! The collective operations of a rank group.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::uninit::write_copy;

/// What a variable all-to-all of f32 words ([`Communicator::all_to_all_v_words`]) delivered:
/// one chunk per source rank, read where the engine left it (an engine over shared memory
/// hands over the senders' buffers; one over a network receives into a single buffer).
#[derive(Clone, Debug)]
pub struct Received(Chunks);

#[derive(Clone, Debug)]
enum Chunks {
    /// One receive buffer; source `src`'s chunk is `values[offsets[src]..offsets[src + 1]]`.
    Contiguous {
        values: Vec<f32>,
        offsets: Vec<usize>,
    },
    /// Per source rank: the buffer holding its chunk and the chunk's range in it.
    Shared(Vec<(Arc<Vec<f32>>, Range<usize>)>),
}

impl Received {
    /// Chunks that are ranges of shared buffers, one per source rank in rank order.
    pub fn from_chunks(chunks: Vec<(Arc<Vec<f32>>, Range<usize>)>) -> Self {
        Self(Chunks::Shared(chunks))
    }

    /// Chunks laid out back to back in one buffer, `counts[src]` words from each source.
    pub fn contiguous(values: Vec<f32>, counts: &[usize]) -> Self {
        let offsets = std::iter::once(0)
            .chain(counts.iter().scan(0, |end, &count| {
                *end += count;
                Some(*end)
            }))
            .collect();
        Self(Chunks::Contiguous { values, offsets })
    }

    /// R, the number of source ranks.
    pub fn len(&self) -> usize {
        match &self.0 {
            Chunks::Contiguous { offsets, .. } => offsets.len() - 1,
            Chunks::Shared(chunks) => chunks.len(),
        }
    }

    /// Whether there are no sources (never, for a group of at least one rank).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The words received from `src`.
    pub fn chunk(&self, src: usize) -> &[f32] {
        match &self.0 {
            Chunks::Contiguous { values, offsets } => &values[offsets[src]..offsets[src + 1]],
            Chunks::Shared(chunks) => &chunks[src].0[chunks[src].1.clone()],
        }
    }

    /// The words received from each source, in rank order.
    pub fn counts(&self) -> Vec<usize> {
        (0..self.len()).map(|src| self.chunk(src).len()).collect()
    }

    /// Every source's words back to back, in rank order: the receive buffer itself when the
    /// engine received into one buffer, otherwise one copy.
    pub fn into_values(self) -> Vec<f32> {
        match self.0 {
            Chunks::Contiguous { values, .. } => values,
            Chunks::Shared(chunks) => {
                let total = chunks.iter().map(|(_, range)| range.len()).sum();
                let mut values = Vec::with_capacity(total);
                for (buffer, range) in &chunks {
                    values.extend_from_slice(&buffer[range.clone()]);
                }
                values
            }
        }
    }
}

/// Consecutive rows for each rank in a `[_, width]` buffer: what a rank is sent from a source
/// in chunks, or where each source's rows land in the receive buffer of
/// [`Communicator::all_to_all_v_rows`].
#[derive(Clone, Copy, Debug)]
pub enum RowChunks<'a> {
    /// `counts[r]` rows for rank r, back to back from row 0 (`Σ counts` rows in all).
    Packed(&'a [usize]),
    /// `counts[r]` rows for rank r from row `r·stride` on (`R·stride` rows in all; the rows
    /// past each chunk belong to none): nki-library's `[EP·T, H]` layout of `permute_a2av`
    /// with `stride` T.
    Strided { counts: &'a [usize], stride: usize },
}

impl RowChunks<'_> {
    /// R, the number of ranks.
    pub fn len(&self) -> usize {
        self.counts().len()
    }

    /// Whether there are no ranks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows per rank.
    pub fn counts(&self) -> &[usize] {
        match self {
            Self::Packed(counts) | Self::Strided { counts, .. } => counts,
        }
    }

    /// The rows of rank `r`'s chunk.
    pub fn range(&self, r: usize) -> Range<usize> {
        let start = match self {
            Self::Packed(counts) => counts[..r].iter().sum(),
            Self::Strided { stride, .. } => r * stride,
        };
        start..start + self.counts()[r]
    }

    /// The rows the buffer spans.
    pub fn rows(&self) -> usize {
        match self {
            Self::Packed(counts) => counts.iter().sum(),
            Self::Strided { counts, stride } => counts.len() * stride,
        }
    }

    /// A count larger than the stride, as `(rank, count)`.
    fn overflowing_chunk(&self) -> Option<(usize, usize)> {
        match self {
            Self::Packed(_) => None,
            Self::Strided { counts, stride } => counts
                .iter()
                .copied()
                .enumerate()
                .find(|&(_, count)| count > *stride),
        }
    }
}

/// Which rows of a `[_, width]` source each rank is sent by
/// [`Communicator::all_to_all_v_rows`].
#[derive(Clone, Copy, Debug)]
pub enum RowsToSend<'a> {
    /// `rows[r]`: the rows sent to rank r, in send order (a row may go to several ranks).
    Gathered(&'a [Vec<usize>]),
    /// Each rank's chunk of consecutive rows.
    Chunks(RowChunks<'a>),
}

/// The rows one destination is sent: listed, or a range of consecutive rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Selected<'a> {
    Listed(&'a [usize]),
    Range(Range<usize>),
}

impl Selected<'_> {
    /// The number of rows selected.
    pub(super) fn count(&self) -> usize {
        match self {
            Self::Listed(rows) => rows.len(),
            Self::Range(range) => range.len(),
        }
    }

    /// Calls `f` on the selected rows of `source` (`[_, width]`) in order: each listed row,
    /// or a whole range at once.
    pub(super) fn for_each_slice(&self, source: &[f32], width: usize, mut f: impl FnMut(&[f32])) {
        match self {
            Self::Listed(rows) => {
                for &row in *rows {
                    f(&source[row * width..(row + 1) * width]);
                }
            }
            Self::Range(range) => f(&source[range.start * width..range.end * width]),
        }
    }
}

impl RowsToSend<'_> {
    /// R, the number of destinations.
    pub fn len(&self) -> usize {
        match self {
            Self::Gathered(rows) => rows.len(),
            Self::Chunks(chunks) => chunks.len(),
        }
    }

    /// Whether there are no destinations.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of rows sent to `dst`.
    pub fn count(&self, dst: usize) -> usize {
        self.selected(dst).count()
    }

    /// The rows sent to `dst`.
    pub(super) fn selected(&self, dst: usize) -> Selected<'_> {
        match self {
            Self::Gathered(rows) => Selected::Listed(&rows[dst]),
            Self::Chunks(chunks) => Selected::Range(chunks.range(dst)),
        }
    }
}

/// One rank of a group of `size()` ranks that exchange data collectively.
///
/// Every rank of the group must make the same sequence of collective calls; a rank whose
/// input is invalid must still take part (see [`agree`]), or the others fail with a timeout or
/// a "left the group" error rather than hang.
pub trait Communicator {
    /// This rank, in `0..size()`.
    fn rank(&self) -> usize;

    /// R, the number of ranks.
    fn size(&self) -> usize;

    /// Variable all-to-all of bytes. `send` holds the chunks for ranks `0..R` back to back,
    /// `send_counts[r]` bytes for rank r. Returns the bytes received from ranks `0..R`, back to
    /// back in rank order, and `recv_counts` (counts travel first, then the payload).
    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize]) -> Result<(Vec<u8>, Vec<usize>)>;

    /// Variable all-to-all of 4-byte words: f32 values, with i32 ids travelling bit-cast.
    /// `send` holds the chunks for ranks `0..R` back to back, `send_counts[r]` words for rank
    /// r. An owned buffer is handed over, so an engine over shared memory need not copy it; a
    /// borrowed one is sent from where it lies by an engine that can (MPI) and copied once by
    /// one that cannot.
    ///
    /// `recv_counts`: the words each source sends, when every rank already knows them (from an
    /// earlier exchange); the engine may then skip its own count exchange. They must be the
    /// sources' `send_counts`: an engine that checks reports a mismatch as an error, MPI
    /// aborts the job on a truncated message.
    ///
    /// The default goes through [`Self::all_to_all_v`] and copies the received bytes once.
    fn all_to_all_v_words(
        &self,
        send: Cow<'_, [f32]>,
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> Result<Received> {
        let counts: Vec<usize> = send_counts.iter().map(|c| c * 4).collect();
        let (received, byte_counts) = self.all_to_all_v(bytemuck::cast_slice(&send), &counts)?;
        drop(send);
        let counts: Vec<usize> = byte_counts.iter().map(|c| c / 4).collect();
        check_known_counts(self.rank(), &counts, recv_counts)?;
        let mut values = Vec::with_capacity(received.len() / 4);
        extend_from_bytes(&mut values, &received);
        Ok(Received::contiguous(values, &counts))
    }

    /// Variable all-to-all of rows taken from where they lie: each other rank r is sent the
    /// rows `rows` selects for it from `source` (`[_, width]` f32, row-major), in that order,
    /// and this rank receives each other source's rows into its chunk of `out` (`recv`: packed
    /// back to back in rank order, or at fixed strides; `recv.rows() · width` words). Every
    /// count must be known on both sides, as with `recv_counts` of
    /// [`Self::all_to_all_v_words`].
    ///
    /// A rank's rows to itself are not exchanged: its own chunk of `out` is left as it was,
    /// for the caller, which can fill it while it reads those rows anyway; so are the rows of
    /// a strided `out` past each chunk. On error `out` may be partly written.
    ///
    /// The default packs the rows per destination (one copy), hands the buffer to
    /// [`Self::all_to_all_v_words`] and copies what arrives into `out`; an engine that can
    /// send rows from where they lie and receive straight into `out` (MPI) skips both copies.
    fn all_to_all_v_rows(
        &self,
        source: &[f32],
        width: usize,
        rows: RowsToSend<'_>,
        recv: RowChunks<'_>,
        out: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let (rank, size) = (self.rank(), self.size());
        check_rows(rank, size, source.len(), width, rows, recv, out.len())?;
        let remote = |peer: usize| peer != rank;
        let total: usize = (0..size)
            .filter(|&dst| remote(dst))
            .map(|dst| rows.count(dst))
            .sum();
        let mut send = Vec::with_capacity(total * width);
        let mut send_counts = Vec::with_capacity(size);
        for dst in 0..size {
            let start = send.len();
            if remote(dst) {
                rows.selected(dst)
                    .for_each_slice(source, width, |slice| send.extend_from_slice(slice));
            }
            send_counts.push(send.len() - start);
        }
        let recv_counts: Vec<usize> = (0..size)
            .map(|src| match remote(src) {
                true => recv.counts()[src] * width,
                false => 0,
            })
            .collect();
        let received =
            self.all_to_all_v_words(Cow::Owned(send), &send_counts, Some(&recv_counts))?;
        for src in (0..size).filter(|&src| remote(src)) {
            let range = recv.range(src);
            write_copy(
                &mut out[range.start * width..range.end * width],
                received.chunk(src),
            );
        }
        Ok(())
    }

    /// Element-wise sum of `buffer` over all ranks, into `buffer` on every rank. The sum is
    /// taken in rank order, so every rank gets bit-identical results.
    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// Checks the arguments of an all-to-all-v: one count per rank, summing to the buffer length
/// (`send` elements; `unit` names them).
pub(super) fn check_counts(
    rank: usize,
    size: usize,
    send: usize,
    counts: &[usize],
    unit: &str,
) -> Result<()> {
    if counts.len() != size {
        return Err(Error::Collective {
            rank,
            message: format!(
                "all_to_all_v needs one send count per rank ({size}), got {}",
                counts.len()
            ),
        });
    }
    let total: usize = counts.iter().sum();
    if total != send {
        return Err(Error::Collective {
            rank,
            message: format!("send counts sum to {total} {unit}, the send buffer holds {send}"),
        });
    }
    Ok(())
}

/// Checks the arguments of an all-to-all-v of rows: a whole number of rows of `width` words
/// in the source, one selection and one receive count per rank, selected rows inside the
/// source, no receive chunk past its stride, and an `out` of `recv.rows() · width` words.
pub(super) fn check_rows(
    rank: usize,
    size: usize,
    source: usize,
    width: usize,
    rows: RowsToSend<'_>,
    recv: RowChunks<'_>,
    out: usize,
) -> Result<()> {
    let fail = |message: String| Err(Error::Collective { rank, message });
    if width == 0 || !source.is_multiple_of(width) {
        return fail(format!(
            "all_to_all_v_rows needs a source of whole rows, got {source} words in rows of {width}"
        ));
    }
    if rows.len() != size || recv.len() != size {
        return fail(format!(
            "all_to_all_v_rows needs one row selection and one receive count per rank ({size}), \
             got {} and {}",
            rows.len(),
            recv.len()
        ));
    }
    if let Some((src, count)) = recv.overflowing_chunk() {
        return fail(format!(
            "all_to_all_v_rows receives {count} rows from rank {src} into chunks of {} rows",
            recv.rows() / size
        ));
    }
    let expected = recv.rows() * width;
    if out != expected {
        return fail(format!(
            "all_to_all_v_rows receives {expected} words ({} rows of {width}), the receive \
             buffer holds {out}",
            recv.rows()
        ));
    }
    let available = source / width;
    let out_of_range = match rows {
        RowsToSend::Gathered(listed) => listed
            .iter()
            .flatten()
            .copied()
            .find(|&row| row >= available),
        RowsToSend::Chunks(chunks) => (0..size)
            .map(|dst| chunks.range(dst).end)
            .find(|&end| end > available)
            .map(|end| end - 1),
    };
    match out_of_range {
        Some(row) => fail(format!(
            "all_to_all_v_rows selects row {row} of a source of {available} rows"
        )),
        None => Ok(()),
    }
}

/// Checks the counts an exchange received against the ones the caller said it expects.
pub(super) fn check_known_counts(
    rank: usize,
    received: &[usize],
    expected: Option<&[usize]>,
) -> Result<()> {
    match expected {
        Some(expected) if expected != received => Err(Error::Collective {
            rank,
            message: format!(
                "expected {expected:?} words from the ranks of the group, received {received:?}"
            ),
        }),
        _ => Ok(()),
    }
}

/// Every rank learns whether any rank's `local` result is an error, before anything is
/// exchanged: all ranks return the first failing rank's error (as [`Error::Collective`]
/// naming that rank), or all return their own `Ok`.
pub fn agree<T>(comm: &dyn Communicator, local: Result<T>) -> Result<T> {
    let (local, _) = agree_with_values(comm, local.map(|value| (value, Vec::new())))?;
    Ok(local)
}

/// [`agree`], also sharing a few integers from every rank (its sizes, say) in the same
/// exchange: returns this rank's value and every rank's integers, in rank order.
pub fn agree_with_values<T>(
    comm: &dyn Communicator,
    local: Result<(T, Vec<i64>)>,
) -> Result<(T, Vec<Vec<i64>>)> {
    let size = comm.size();
    // One message per rank: `0` then its integers, or `1` then its error message.
    let message: Vec<u8> = match &local {
        Ok((_, values)) => std::iter::once(0u8)
            .chain(bytemuck::cast_slice::<i64, u8>(values).iter().copied())
            .collect(),
        Err(err) => {
            let text = err.to_string();
            std::iter::once(1u8).chain(text.into_bytes()).collect()
        }
    };
    let send: Vec<u8> = (0..size).flat_map(|_| message.iter().copied()).collect();
    let (received, counts) = comm.all_to_all_v(&send, &vec![message.len(); size])?;
    let mut values = Vec::with_capacity(size);
    let mut offset = 0;
    for (rank, &count) in counts.iter().enumerate() {
        let message = &received[offset..offset + count];
        offset += count;
        match message.split_first() {
            Some((0, ints)) => values.push(
                ints.chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect(),
            ),
            Some((_, text)) => {
                return Err(Error::Collective {
                    rank,
                    message: String::from_utf8_lossy(text).into_owned(),
                });
            }
            None => {
                return Err(Error::Collective {
                    rank,
                    message: "sent no agreement message".to_owned(),
                });
            }
        }
    }
    local.map(|(value, _)| (value, values))
}

/// Appends the values whose little-endian bytes are `bytes` (a whole number of values) to
/// `values`: one copy, whatever the alignment of `bytes`.
pub(super) fn extend_from_bytes<T: bytemuck::Pod>(values: &mut Vec<T>, bytes: &[u8]) {
    let start = values.len();
    values.resize(start + bytes.len() / std::mem::size_of::<T>(), T::zeroed());
    bytemuck::cast_slice_mut::<T, u8>(&mut values[start..]).copy_from_slice(bytes);
}

/// [`Communicator::all_to_all_v`] of plain values (`f32`, `i32`, …; `send_counts` and the
/// returned counts in elements).
pub fn all_to_all_v_values<T: bytemuck::Pod>(
    comm: &dyn Communicator,
    send: &[T],
    send_counts: &[usize],
) -> Result<(Vec<T>, Vec<usize>)> {
    let size = std::mem::size_of::<T>();
    let counts: Vec<usize> = send_counts.iter().map(|c| c * size).collect();
    let (received, recv_counts) = comm.all_to_all_v(bytemuck::cast_slice(send), &counts)?;
    let mut values = Vec::with_capacity(received.len() / size);
    extend_from_bytes(&mut values, &received);
    Ok((values, recv_counts.iter().map(|c| c / size).collect()))
}

/// The status words that open every chunk of an exchange which also carries the agreement
/// (see [`read_status`]): `0, n, v_1 … v_n` for a rank whose input is valid (its n sizes), `1, L, text…` for one that failed (its error message, L UTF-8 bytes in
/// ⌈L/4⌉ words). Words are f32 bit patterns.
pub(super) fn status_words(local: std::result::Result<&[u32], &Error>) -> Vec<f32> {
    let word = f32::from_bits;
    match local {
        Ok(values) => [word(0), word(values.len() as u32)]
            .into_iter()
            .chain(values.iter().map(|&v| word(v)))
            .collect(),
        Err(err) => {
            let text = err.to_string().into_bytes();
            let mut words = vec![word(1), word(text.len() as u32)];
            for bytes in text.chunks(4) {
                let mut padded = [0u8; 4];
                padded[..bytes.len()].copy_from_slice(bytes);
                words.push(word(u32::from_le_bytes(padded)));
            }
            words
        }
    }
}

/// Reads the status words at the start of every source's chunk ([`status_words`]). Returns
/// every source's integers and where its payload starts, or, on every rank alike, the first
/// failing source's error as [`Error::Collective`] naming that rank.
pub(super) fn read_status(received: &Received) -> Result<Vec<(Vec<u32>, usize)>> {
    let bits = |w: &f32| w.to_bits();
    (0..received.len())
        .map(|src| {
            let chunk = received.chunk(src);
            let malformed = || Error::Collective {
                rank: src,
                message: "sent a chunk without its status words".to_owned(),
            };
            let (&status, rest) = chunk.split_first().ok_or_else(malformed)?;
            let (&len, rest) = rest.split_first().ok_or_else(malformed)?;
            let len = bits(&len) as usize;
            match bits(&status) {
                0 => {
                    let values = rest.get(..len).ok_or_else(malformed)?;
                    Ok((values.iter().map(bits).collect(), 2 + len))
                }
                _ => {
                    let words = rest.get(..len.div_ceil(4)).ok_or_else(malformed)?;
                    let mut text: Vec<u8> =
                        words.iter().flat_map(|w| bits(w).to_le_bytes()).collect();
                    text.truncate(len);
                    Err(Error::Collective {
                        rank: src,
                        message: String::from_utf8_lossy(&text).into_owned(),
                    })
                }
            }
        })
        .collect()
}
