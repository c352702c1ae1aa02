//! R ranks as MPI processes (feature `mpi`, Open MPI through the `mpi` crate), launched with
//! `mpirun -n R ...`.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;

use mpi::datatype::{Buffer, Equivalence, Partition, PartitionMut, UserDatatype, View};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Source};
use mpi::{Address, Tag};

use super::comm::{
    Communicator, Received, RowChunks, RowsToSend, Selected, check_counts, check_rows,
};
use crate::error::{Error, Result};
use crate::uninit::{assume_init, uninit, write_copy};

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

/// Tag of the point-to-point messages of the word and row exchanges (collectives travel in
/// their own context, apart from them). Each exchange sends one message per pair of ranks, and
/// MPI keeps the messages of a pair in order, so every exchange meets its own messages.
const P2P_TAG: Tag = 0x726f;

/// A receive slot MPI fills: `T`'s datatype over memory that needs no initialisation first
/// (a receive buffer is written whole before it is read, so zero-filling it would be a pass
/// over the memory for nothing).
#[repr(transparent)]
struct Slot<T>(MaybeUninit<T>);

// SAFETY: `Slot<T>` is `repr(transparent)` over `MaybeUninit<T>`, which has `T`'s size and
// layout, so `T`'s datatype describes it exactly.
unsafe impl<T: Equivalence> Equivalence for Slot<T> {
    type Out = T::Out;
    fn equivalent_datatype() -> Self::Out {
        T::equivalent_datatype()
    }
}

/// `slots` as MPI receive slots.
fn as_slots<T>(slots: &mut [MaybeUninit<T>]) -> &mut [Slot<T>] {
    // SAFETY: `Slot<T>` is `repr(transparent)` over `MaybeUninit<T>`: same layout, and any
    // contents are valid for both.
    unsafe { &mut *(slots as *mut [MaybeUninit<T>] as *mut [Slot<T>]) }
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
    /// `MPI_Alltoallv` of bytes, preceded by an `MPI_Alltoall` of the counts.
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let (rank, size) = (self.rank(), self.size());
        let (counts, displacements) = counts_and_displacements(rank, send_counts)?;
        let mut recv_counts = vec![0i32; size];
        self.world
            .all_to_all_into(&counts[..], &mut recv_counts[..]);
        let recv_usize: Vec<usize> = recv_counts.iter().map(|&c| c as usize).collect();
        let (recv_counts, recv_displacements) = counts_and_displacements(rank, &recv_usize)?;
        let total: usize = recv_usize.iter().sum();
        // Buffers of at least one element: two empty slices can share a dangling address,
        // which Open MPI rejects as an aliased (in-place) send and receive buffer.
        let mut received = uninit::<u8>(total.max(1));
        let placeholder = [0u8];
        let send = if send.is_empty() {
            &placeholder[..]
        } else {
            send
        };
        {
            let send = Partition::new(send, &counts[..], &displacements[..]);
            let mut recv = PartitionMut::new(
                as_slots(&mut received),
                &recv_counts[..],
                &recv_displacements[..],
            );
            self.world.all_to_all_varcount_into(&send, &mut recv);
        }
        received.truncate(total);
        // SAFETY: `MPI_Alltoallv` wrote every one of the `total` bytes: each source sends
        // exactly the count it announced in the `MPI_Alltoall`.
        Ok((unsafe { assume_init(received) }, recv_usize))
    }
}

impl MpiComm {
    /// One point-to-point round, every message posted at once: a receive from each other rank
    /// into its chunk of `out` (the words `chunks[src]`: ascending, disjoint ranges; this
    /// rank's own chunk and the words between chunks are left alone) and each `(dst, buffer)`
    /// of `sends`. A source that sent fewer words than its chunk holds is an error naming it
    /// (more is MPI's truncation error).
    fn round<S: Buffer + ?Sized>(
        &self,
        out: &mut [MaybeUninit<f32>],
        chunks: &[Range<usize>],
        sends: &[(usize, &S)],
    ) -> Result<()> {
        let rank = self.rank();
        let mut rest = as_slots(out);
        let mut consumed = 0;
        let chunks: Vec<_> = chunks
            .iter()
            .map(|range| {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - consumed);
                let (chunk, tail) = tail.split_at_mut(range.len());
                rest = tail;
                consumed = range.end;
                chunk
            })
            .collect();
        let mut short = None;
        mpi::request::scope(|scope| {
            let receives: Vec<_> = chunks
                .into_iter()
                .enumerate()
                .filter(|&(src, _)| src != rank)
                .map(|(src, chunk)| {
                    let from = self.world.process_at_rank(src as i32);
                    let expected = chunk.len();
                    let request = from.immediate_receive_into_with_tag(scope, chunk, P2P_TAG);
                    (src, expected, request)
                })
                .collect();
            let sends: Vec<_> = sends
                .iter()
                .map(|&(dst, buffer)| {
                    let to = self.world.process_at_rank(dst as i32);
                    to.immediate_send_with_tag(scope, buffer, P2P_TAG)
                })
                .collect();
            for (src, expected, request) in receives {
                let got = request.wait().count(f32::equivalent_datatype()) as usize;
                if got != expected && short.is_none() {
                    short = Some((src, got, expected));
                }
            }
            for request in sends {
                request.wait();
            }
        });
        match short {
            Some((src, got, expected)) => Err(Error::Collective {
                rank: src,
                message: format!("sent {got} words where rank {rank} expected {expected}"),
            }),
            None => Ok(()),
        }
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
        self.all_to_all_v_bytes(send, send_counts)
    }

    /// Point to point, every message posted at once (one round, where `MPI_Alltoallv` takes
    /// R - 1 steps and, without known counts, an `MPI_Alltoall` of the counts first): with
    /// known counts each source's chunk is received straight into one buffer and its length
    /// checked; without them each is probed for its length first. This rank's own chunk is
    /// copied.
    fn all_to_all_v_words(
        &self,
        send: Cow<'_, [f32]>,
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> Result<Received> {
        let (rank, size) = (self.rank(), self.size());
        check_counts(rank, size, send.len(), send_counts, "words")?;
        let (counts, displacements) = counts_and_displacements(rank, send_counts)?;
        let chunk = |dst: usize| {
            let start = displacements[dst] as usize;
            &send[start..start + counts[dst] as usize]
        };
        let float = f32::equivalent_datatype();
        match recv_counts {
            Some(known) => {
                if known.len() != size {
                    return Err(Error::Collective {
                        rank,
                        message: format!(
                            "all_to_all_v needs one receive count per rank ({size}), got {}",
                            known.len()
                        ),
                    });
                }
                counts_and_displacements(rank, known)?;
                let mut received = uninit::<f32>(known.iter().sum());
                // A mismatch of this rank's counts to itself is reported after the round, in
                // which the other ranks expect this rank's messages.
                let own_matches = known[rank] == send_counts[rank];
                if own_matches {
                    let own_start: usize = known[..rank].iter().sum();
                    write_copy(&mut received[own_start..], chunk(rank));
                }
                let sends: Vec<(usize, &[f32])> = (0..size)
                    .filter(|&dst| dst != rank)
                    .map(|dst| (dst, chunk(dst)))
                    .collect();
                let chunks = RowChunks::Packed(known);
                let chunks: Vec<Range<usize>> = (0..size).map(|src| chunks.range(src)).collect();
                self.round(&mut received, &chunks, &sends)?;
                if !own_matches {
                    return Err(Error::Collective {
                        rank,
                        message: format!(
                            "expects {} words from itself but sends itself {}",
                            known[rank], send_counts[rank]
                        ),
                    });
                }
                // SAFETY: this rank's chunk was copied, every other one received whole.
                let values = unsafe { assume_init(received) };
                Ok(Received::contiguous(values, known))
            }
            None => {
                let mut chunks: Vec<(Arc<Vec<f32>>, Range<usize>)> = Vec::with_capacity(size);
                mpi::request::scope(|scope| {
                    let sends: Vec<_> = (0..size)
                        .filter(|&dst| dst != rank)
                        .map(|dst| {
                            let to = self.world.process_at_rank(dst as i32);
                            to.immediate_send_with_tag(scope, chunk(dst), P2P_TAG)
                        })
                        .collect();
                    for src in 0..size {
                        let values = if src == rank {
                            chunk(rank).to_vec()
                        } else {
                            let from = self.world.process_at_rank(src as i32);
                            let (message, status) = from.matched_probe_with_tag(P2P_TAG);
                            let mut values = uninit::<f32>(status.count(float) as usize);
                            message.matched_receive_into(as_slots(&mut values));
                            // SAFETY: the buffer holds exactly the probed message.
                            unsafe { assume_init(values) }
                        };
                        let len = values.len();
                        chunks.push((Arc::new(values), 0..len));
                    }
                    for request in sends {
                        request.wait();
                    }
                });
                Ok(Received::from_chunks(chunks))
            }
        }
    }

    /// Point to point: one message per pair of other ranks (empty ones included, so every
    /// receive is matched), rows sent from where they lie through a derived datatype over
    /// `source` (Open MPI's shared-memory transport copies them straight into the receiver's
    /// buffer) and received straight into `out`, each source's word count checked on arrival.
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
        let too_large = || Error::Collective {
            rank,
            message: "an all-to-all chunk exceeds MPI's count limit (2^31 - 1 elements)".to_owned(),
        };
        let words = |rows: usize| {
            rows.checked_mul(width)
                .and_then(|words| i32::try_from(words).ok())
                .ok_or_else(too_large)
        };
        recv.counts()
            .iter()
            .try_for_each(|&rows| words(rows).map(drop))?;

        // What each other rank is sent: a datatype over `source` from a starting word.
        let float = f32::equivalent_datatype();
        let mut outgoing: Vec<(usize, UserDatatype, usize)> = Vec::with_capacity(size);
        for dst in (0..size).filter(|&dst| dst != rank) {
            let contiguous = |range: Range<usize>| {
                Ok((
                    UserDatatype::contiguous(words(range.len())?, &float),
                    range.start * width,
                ))
            };
            let (datatype, start) = match rows.selected(dst) {
                Selected::Range(range) => contiguous(range)?,
                Selected::Listed(listed) if listed.windows(2).all(|w| w[1] == w[0] + 1) => {
                    let first = listed.first().copied().unwrap_or(0);
                    contiguous(first..first + listed.len())?
                }
                Selected::Listed(listed) => {
                    i32::try_from(listed.len()).map_err(|_| too_large())?;
                    let displacements = listed
                        .iter()
                        .map(|&row| Address::try_from(row * width * 4).map_err(|_| too_large()))
                        .collect::<Result<Vec<Address>>>()?;
                    let datatype = UserDatatype::heterogeneous_indexed_block(
                        words(1)?,
                        &displacements,
                        &float,
                    );
                    (datatype, 0)
                }
            };
            outgoing.push((dst, datatype, start));
        }
        let views: Vec<_> = outgoing
            .iter()
            .map(|(dst, datatype, start)| {
                // SAFETY: every datatype covers only selected rows, which `check_rows` found
                // inside `source`, counted from `start`: a range's words from its first, a
                // list's by byte displacements from word 0.
                let view = unsafe { View::with_count_and_datatype(&source[*start..], 1, datatype) };
                (*dst, view)
            })
            .collect();

        let chunks: Vec<Range<usize>> = (0..size)
            .map(|src| {
                let rows = recv.range(src);
                rows.start * width..rows.end * width
            })
            .collect();
        let sends: Vec<(usize, &View<'_, '_, UserDatatype, [f32]>)> =
            views.iter().map(|(dst, view)| (*dst, view)).collect();
        self.round(out, &chunks, &sends)
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
