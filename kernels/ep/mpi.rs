//! R ranks as MPI processes (feature `mpi`, Open MPI through the `mpi` crate), launched with
//! `mpirun -n R ...`.

use std::borrow::Cow;
use std::io::Write;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mpi::datatype::{Buffer, Equivalence, UserDatatype, View};
use mpi::environment::Universe;
use mpi::point_to_point::{Message, Status};
use mpi::request::{Request, Scope};
use mpi::topology::{Process, SimpleCommunicator};
use mpi::traits::{Communicator as _, Destination, Source};
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
///
/// Every operation travels point to point and is polled, never waited on blindly: a rank that
/// does not answer within the [timeout](Self::with_timeout) (stopped, hung, or its host lost)
/// ends the job, with a message naming it, instead of holding the others forever. MPI still
/// holds the waiting rank's buffers then, so the call cannot return: it prints the message and
/// `MPI_Abort`s, which stops every rank, the silent ones included.
pub struct MpiComm {
    world: SimpleCommunicator,
    timeout: Duration,
    // Declared after `world`, so MPI is finalised after the communicator is released.
    _universe: Universe,
}

/// Environment variables MPI launchers set in the processes they start: Open MPI's `mpirun`,
/// PMIx (`prterun`, Slurm's `srun --mpi=pmix`) and MPICH's Hydra (PMI).
const LAUNCHER_VARIABLES: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"];

/// Exit status of a job [`MpiComm`] ends because a rank did not answer.
const UNANSWERED_EXIT: i32 = 3;

impl MpiComm {
    /// How long an operation waits for the other ranks unless [`Self::with_timeout`] says
    /// otherwise (PyTorch's default for NCCL process groups).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

    /// Initialises MPI; an error if it is already initialised in this process.
    pub fn init() -> Result<Self> {
        let universe = mpi::initialize().ok_or_else(|| Error::Collective {
            rank: 0,
            message: "MPI is already initialised in this process".to_owned(),
        })?;
        Ok(Self {
            world: universe.world(),
            timeout: Self::DEFAULT_TIMEOUT,
            _universe: universe,
        })
    }

    /// Whether an MPI launcher (`mpirun`, `srun`, `mpiexec`) started this process, so that it
    /// has peers to meet in `MPI_Init`.
    pub fn launched() -> bool {
        LAUNCHER_VARIABLES
            .iter()
            .any(|name| std::env::var_os(name).is_some())
    }

    /// How long each operation waits for the other ranks before ending the job.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }
}

impl MpiComm {
    /// Aborts every process of the job with `code` (`MPI_Abort`): for a rank that fails
    /// outside a collective while the others may be waiting in one.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }
}

/// Tag of every message. Each round sends one message per ordered pair of ranks, and MPI
/// keeps the messages of a pair in order, so every round meets its own messages.
const P2P_TAG: Tag = 0x726f;

/// What a round carries.
trait Element: Equivalence {
    /// Its name in messages, plural.
    const PLURAL: &'static str;
}

impl Element for f32 {
    const PLURAL: &'static str = "words";
}

impl Element for u8 {
    const PLURAL: &'static str = "bytes";
}

impl Element for u64 {
    const PLURAL: &'static str = "counts";
}

/// When the operation under way gives up on the ranks that have not answered (`None`: a
/// timeout too long to represent, never).
#[derive(Clone, Copy)]
struct Deadline(Option<Instant>);

impl Deadline {
    fn passed(self) -> bool {
        self.0.is_some_and(|at| Instant::now() >= at)
    }
}

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
    /// When an operation starting now gives up.
    fn deadline(&self) -> Deadline {
        Deadline(Instant::now().checked_add(self.timeout))
    }

    /// Ends the job because the ranks `silent` did not answer by the deadline: see the type's
    /// docs for why the call cannot return.
    fn unanswered(&self, silent: &[usize]) -> ! {
        let silent: Vec<String> = silent.iter().map(usize::to_string).collect();
        let line = format!(
            "rank {} stops: rank(s) {} did not answer within {} s (stopped, hung or lost); \
             aborting the job\n",
            self.rank(),
            silent.join(", "),
            self.timeout.as_secs_f64()
        );
        // One write, so that the lines of several ranks do not interleave.
        let _ = std::io::stderr().write_all(line.as_bytes());
        self.world.abort(UNANSWERED_EXIT)
    }

    /// Completes `requests`, each paired with the rank at its other end; returns each one's
    /// status with that rank, in the order they completed. Polls rather than blocks, so that a
    /// rank that never answers ends the job at `deadline` ([`Self::unanswered`]).
    fn complete<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        mut pending: Vec<(usize, Request<'a, D, S>)>,
        deadline: Deadline,
    ) -> Vec<(usize, Status)> {
        let mut done = Vec::with_capacity(pending.len());
        // The requests still pending after a sweep, in a buffer kept across sweeps.
        let mut waiting = Vec::with_capacity(pending.len());
        loop {
            for (rank, request) in pending.drain(..) {
                match request.test() {
                    Ok(status) => done.push((rank, status)),
                    Err(request) => waiting.push((rank, request)),
                }
            }
            if waiting.is_empty() {
                return done;
            }
            if deadline.passed() {
                let silent: Vec<usize> = waiting.iter().map(|&(rank, _)| rank).collect();
                self.unanswered(&silent);
            }
            std::mem::swap(&mut pending, &mut waiting);
            // Lets an oversubscribed peer run (more ranks than cores).
            std::thread::yield_now();
        }
    }

    /// Matches the next message from `from` (rank `src`), waiting for it until `deadline`.
    fn probe(&self, from: &Process<'_>, src: usize, deadline: Deadline) -> (Message, Status) {
        loop {
            if let Some(matched) = from.immediate_matched_probe_with_tag(P2P_TAG) {
                return matched;
            }
            if deadline.passed() {
                self.unanswered(&[src]);
            }
            std::thread::yield_now();
        }
    }

    /// One point-to-point round, every message posted at once: a receive from each other rank
    /// into its chunk of `out` (the elements `chunks[src]`: ascending, disjoint ranges; this
    /// rank's own chunk and the elements between chunks are left alone) and each
    /// `(dst, buffer)` of `sends`. A source that sent fewer elements than its chunk holds is an
    /// error naming it (more is MPI's truncation error).
    fn round<T: Element, S: Buffer + ?Sized>(
        &self,
        out: &mut [MaybeUninit<T>],
        chunks: &[Range<usize>],
        sends: &[(usize, &S)],
    ) -> Result<()> {
        let rank = self.rank();
        let deadline = self.deadline();
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
        let expected: Vec<usize> = chunks.iter().map(|chunk| chunk.len()).collect();
        let received = mpi::request::scope(|scope| {
            let receives: Vec<_> = chunks
                .into_iter()
                .enumerate()
                .filter(|&(src, _)| src != rank)
                .map(|(src, chunk)| {
                    let from = self.world.process_at_rank(src as i32);
                    (
                        src,
                        from.immediate_receive_into_with_tag(scope, chunk, P2P_TAG),
                    )
                })
                .collect();
            let sends: Vec<_> = sends
                .iter()
                .map(|&(dst, buffer)| {
                    let to = self.world.process_at_rank(dst as i32);
                    (dst, to.immediate_send_with_tag(scope, buffer, P2P_TAG))
                })
                .collect();
            let received = self.complete(receives, deadline);
            self.complete(sends, deadline);
            received
        });
        let short = received
            .into_iter()
            .map(|(src, status)| (src, status.count(T::equivalent_datatype()) as usize))
            .filter(|&(src, got)| got != expected[src])
            .min();
        match short {
            Some((src, got)) => Err(Error::Collective {
                rank: src,
                message: format!(
                    "sent {got} {} where rank {rank} expected {}",
                    T::PLURAL,
                    expected[src]
                ),
            }),
            None => Ok(()),
        }
    }

    /// Variable all-to-all of bytes: a round of the counts (one `u64` to each rank), then one
    /// of the bytes.
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let (rank, size) = (self.rank(), self.size());
        let (_, displacements) = counts_and_displacements(rank, send_counts)?;
        let others = || (0..size).filter(move |&peer| peer != rank);

        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let mut recv_counts = uninit::<u64>(size);
        recv_counts[rank].write(counts[rank]);
        let sends: Vec<(usize, &[u64])> =
            others().map(|dst| (dst, &counts[dst..dst + 1])).collect();
        let slots: Vec<Range<usize>> = (0..size).map(|src| src..src + 1).collect();
        self.round(&mut recv_counts, &slots, &sends)?;
        // SAFETY: this rank's count was written, every other one received.
        let recv_counts: Vec<usize> = unsafe { assume_init(recv_counts) }
            .into_iter()
            .map(|c| usize::try_from(c).unwrap_or(usize::MAX))
            .collect();
        counts_and_displacements(rank, &recv_counts)?;

        let chunks = RowChunks::Packed(&recv_counts);
        let chunks: Vec<Range<usize>> = (0..size).map(|src| chunks.range(src)).collect();
        let mut received = uninit::<u8>(chunks[size - 1].end);
        let chunk = |dst: usize| {
            let start = displacements[dst] as usize;
            &send[start..start + send_counts[dst]]
        };
        write_copy(&mut received[chunks[rank].clone()], chunk(rank));
        let sends: Vec<(usize, &[u8])> = others().map(|dst| (dst, chunk(dst))).collect();
        self.round(&mut received, &chunks, &sends)?;
        // SAFETY: this rank's chunk was copied, every other one received whole.
        Ok((unsafe { assume_init(received) }, recv_counts))
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
                let deadline = self.deadline();
                let mut chunks: Vec<(Arc<Vec<f32>>, Range<usize>)> = Vec::with_capacity(size);
                mpi::request::scope(|scope| {
                    let sends: Vec<_> = (0..size)
                        .filter(|&dst| dst != rank)
                        .map(|dst| {
                            let to = self.world.process_at_rank(dst as i32);
                            (dst, to.immediate_send_with_tag(scope, chunk(dst), P2P_TAG))
                        })
                        .collect();
                    for src in 0..size {
                        let values = if src == rank {
                            chunk(rank).to_vec()
                        } else {
                            let from = self.world.process_at_rank(src as i32);
                            let (message, status) = self.probe(&from, src, deadline);
                            let mut values = uninit::<f32>(status.count(float) as usize);
                            mpi::request::scope(|receiving| {
                                let request = message.immediate_matched_receive_into(
                                    receiving,
                                    as_slots(&mut values),
                                );
                                self.complete(vec![(src, request)], deadline);
                            });
                            // SAFETY: the buffer holds exactly the probed message.
                            unsafe { assume_init(values) }
                        };
                        let len = values.len();
                        chunks.push((Arc::new(values), 0..len));
                    }
                    self.complete(sends, deadline);
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

    /// Every rank's buffer gathered (a round), then summed in rank order: bit-identical on
    /// every rank (`MPI_Allreduce`'s order is the implementation's).
    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()> {
        let (rank, size, len) = (self.rank(), self.size(), buffer.len());
        let mut all = uninit::<f32>(len * size);
        write_copy(&mut all[rank * len..], buffer);
        let chunks: Vec<Range<usize>> = (0..size).map(|src| src * len..(src + 1) * len).collect();
        let sends: Vec<(usize, &[f32])> = (0..size)
            .filter(|&dst| dst != rank)
            .map(|dst| (dst, &buffer[..]))
            .collect();
        self.round(&mut all, &chunks, &sends)?;
        // SAFETY: this rank's chunk was copied, every other one received whole.
        let all = unsafe { assume_init(all) };
        buffer.fill(0.0);
        for chunk in all.chunks_exact(len.max(1)) {
            for (sum, v) in buffer.iter_mut().zip(chunk) {
                *sum += v;
            }
        }
        Ok(())
    }

    /// A round of empty messages: every rank has reached it once each has heard from all.
    fn barrier(&self) -> Result<()> {
        let rank = self.rank();
        let sends: Vec<(usize, &[f32])> = (0..self.size())
            .filter(|&dst| dst != rank)
            .map(|dst| (dst, &[][..]))
            .collect();
        let empty: Vec<Range<usize>> = vec![0..0; self.size()];
        self.round::<f32, _>(&mut [], &empty, &sends)
    }
}
