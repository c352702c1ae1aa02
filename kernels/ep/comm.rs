//! The collective operations of a rank group.

use crate::error::{Error, Result};

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

    /// The same exchange with one owned buffer per destination in and one per source out, so
    /// an engine that can hand buffers over (shared memory) need not copy them. The default
    /// goes through [`Self::all_to_all_v`].
    fn all_to_all_v_chunks(&self, chunks: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        let counts: Vec<usize> = chunks.iter().map(Vec::len).collect();
        let (received, recv_counts) = self.all_to_all_v(&chunks.concat(), &counts)?;
        let mut offset = 0;
        Ok(recv_counts
            .iter()
            .map(|&count| {
                offset += count;
                received[offset - count..offset].to_vec()
            })
            .collect())
    }

    /// Element-wise sum of `buffer` over all ranks, into `buffer` on every rank. The sum is
    /// taken in rank order, so every rank gets bit-identical results.
    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// Checks the arguments of an all-to-all-v: one count per rank, summing to the buffer length.
pub(super) fn check_counts(rank: usize, size: usize, send: usize, counts: &[usize]) -> Result<()> {
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
            message: format!("send counts sum to {total} bytes, the send buffer holds {send}"),
        });
    }
    Ok(())
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
