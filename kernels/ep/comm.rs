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
    let size = comm.size();
    let message = match &local {
        Ok(_) => String::new(),
        Err(err) => Some(err.to_string())
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "an error without a message".to_owned()),
    };
    let bytes = message.as_bytes();
    let send: Vec<u8> = (0..size).flat_map(|_| bytes.iter().copied()).collect();
    let (received, counts) = comm.all_to_all_v(&send, &vec![bytes.len(); size])?;
    let mut offset = 0;
    for (rank, &count) in counts.iter().enumerate() {
        if count > 0 {
            let message = String::from_utf8_lossy(&received[offset..offset + count]).into_owned();
            return Err(Error::Collective { rank, message });
        }
        offset += count;
    }
    local
}

/// [`Communicator::all_to_all_v`] of f32 values (`send_counts` in elements).
pub fn all_to_all_v_f32(
    comm: &dyn Communicator,
    send: &[f32],
    send_counts: &[usize],
) -> Result<(Vec<f32>, Vec<usize>)> {
    let bytes: Vec<u8> = send.iter().flat_map(|v| v.to_le_bytes()).collect();
    let counts: Vec<usize> = send_counts.iter().map(|c| c * 4).collect();
    let (received, recv_counts) = comm.all_to_all_v(&bytes, &counts)?;
    Ok((
        received
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        recv_counts.iter().map(|c| c / 4).collect(),
    ))
}

/// [`Communicator::all_to_all_v`] of i32 values (`send_counts` in elements).
pub fn all_to_all_v_i32(
    comm: &dyn Communicator,
    send: &[i32],
    send_counts: &[usize],
) -> Result<(Vec<i32>, Vec<usize>)> {
    let bytes: Vec<u8> = send.iter().flat_map(|v| v.to_le_bytes()).collect();
    let counts: Vec<usize> = send_counts.iter().map(|c| c * 4).collect();
    let (received, recv_counts) = comm.all_to_all_v(&bytes, &counts)?;
    Ok((
        received
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        recv_counts.iter().map(|c| c / 4).collect(),
    ))
}
