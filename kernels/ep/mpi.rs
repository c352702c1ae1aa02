//! R ranks as MPI processes (feature `mpi`, Open MPI through the `mpi` crate), launched with
//! `mpirun -n R ...`.

use std::borrow::Cow;

use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives};

use super::comm::{Communicator, Received, check_counts};
use crate::error::{Error, Result};

/// This process's rank of `MPI_COMM_WORLD`. MPI is initialised by [`MpiComm::init`] and
/// finalised when the value is dropped; one per process.
///
/// MPI reports its own failures by aborting the job (`MPI_ERRORS_ARE_FATAL`), so `mpirun`
/// exits non-zero with MPI's message; moekit's errors reach every rank before anything but
/// the ranks' verdicts is exchanged ([`agree`](super::agree), or the status words that open
/// the exchange kernels' first exchange).
pub struct MpiComm {
    world: SimpleCommunicator,
    // Declared after `world`, so MPI is finalised after the communicator is released.
    _universe: Universe,
}

impl MpiComm {
    /// Initialises MPI; an error if it is already initialised in this process.
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| Error::Collective {
            rank: 0,
            message: "MPI is already initialised in this process".to_owned(),
        })?;
        Ok(Self {
            world: universe.world(),
            _universe: universe,
        })
    }
}

impl MpiComm {
    /// Aborts every process of the job with `code` (`MPI_Abort`): for a rank that fails
    /// outside a collective while the others may be waiting in one.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

/// Counts and displacements as MPI's `int`s.
fn counts_and_displacements(rank: usize, counts: &[usize]) -> Result<(Vec<i32>, Vec<i32>)> {
    let too_large = || Error::Collective {
        rank,
        message: "an all-to-all chunk exceeds MPI's count limit (2^31 - 1 elements)".to_owned(),
    };
    let counts = counts
        .iter()
        .map(|&c| i32::try_from(c).map_err(|_| too_large()))
        .collect::<Result<Vec<i32>>>()?;
    let mut displacements = Vec::with_capacity(counts.len());
    let mut offset = 0i32;
    for &c in &counts {
        displacements.push(offset);
        offset = offset.checked_add(c).ok_or_else(too_large)?;
    }
    Ok((counts, displacements))
}

impl MpiComm {
    /// `MPI_Alltoallv` of `T`s (counts in elements), preceded by an `MPI_Alltoall` of the
    /// counts unless the caller knows what each source sends.
    fn all_to_all_v_of<T: Equivalence + Default + Clone>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> Result<(Vec<T>, Vec<usize>)> {
        let (rank, size) = (self.rank(), self.size());
        let (counts, displacements) = counts_and_displacements(rank, send_counts)?;
        let recv_usize = match recv_counts {
            Some(known) if known.len() == size => known.to_vec(),
            Some(known) => {
                return Err(Error::Collective {
                    rank,
                    message: format!(
                        "all_to_all_v needs one receive count per rank ({size}), got {}",
                        known.len()
                    ),
                });
            }
            None => {
                let mut recv_counts = vec![0i32; size];
                self.world
                    .all_to_all_into(&counts[..], &mut recv_counts[..]);
                recv_counts.iter().map(|&c| c as usize).collect()
            }
        };
        let (recv_counts, recv_displacements) = counts_and_displacements(rank, &recv_usize)?;
        let total: usize = recv_usize.iter().sum();
        // Buffers of at least one element: two empty slices can share a dangling address,
        // which Open MPI rejects as an aliased (in-place) send and receive buffer.
        let mut received = vec![T::default(); total.max(1)];
        let placeholder = [T::default()];
        let send = if send.is_empty() {
            &placeholder[..]
        } else {
            send
        };
        {
            let send = Partition::new(send, &counts[..], &displacements[..]);
            let mut recv =
                PartitionMut::new(&mut received[..], &recv_counts[..], &recv_displacements[..]);
            self.world.all_to_all_varcount_into(&send, &mut recv);
        }
        received.truncate(total);
        Ok((received, recv_usize))
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize]) -> Result<(Vec<u8>, Vec<usize>)> {
        check_counts(self.rank(), self.size(), send.len(), send_counts, "bytes")?;
        self.all_to_all_v_of(send, send_counts, None)
    }

    fn all_to_all_v_words(
        &self,
        send: Cow<'_, [f32]>,
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> Result<Received> {
        check_counts(self.rank(), self.size(), send.len(), send_counts, "words")?;
        let (values, counts) = self.all_to_all_v_of(&send, send_counts, recv_counts)?;
        Ok(Received::contiguous(values, &counts))
    }

    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()> {
        // Gathered, then summed in rank order: bit-identical on every rank (MPI_Allreduce's
        // order is the implementation's).
        let size = self.size();
        if buffer.is_empty() {
            return self.barrier();
        }
        let mut all = vec![0f32; buffer.len() * size];
        self.world.all_gather_into(&buffer[..], &mut all[..]);
        buffer.fill(0.0);
        for chunk in all.chunks_exact(buffer.len().max(1)).take(size) {
            for (sum, v) in buffer.iter_mut().zip(chunk) {
                *sum += v;
            }
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.world.barrier();
        Ok(())
    }
}
