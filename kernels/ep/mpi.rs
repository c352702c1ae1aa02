//! Ranks as MPI processes (feature `mpi`, Open MPI through moekit's MPI shim,
//! `moekit-mpi-sys`), launched with `mpirun -n N ...`: the world, and communicators split from
//! it.

use std::borrow::Cow;
use std::ffi::{c_int, c_void};
use std::io::Write;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::ptr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moekit_mpi_sys as sys;

use super::comm::{
    Communicator, Received, RowChunks, RowsToSend, Selected, check_counts, check_rows,
};
use crate::error::{Error, Result};
use crate::uninit::{assume_init, uninit, write_copy};

/// This process's rank of `MPI_COMM_WORLD` ([`MpiComm::init`]), or of a communicator split
/// from one ([`MpiComm::split`]; the messages that end the job name world ranks). MPI is initialised once per process, by `init`, and
/// finalised when the last communicator is dropped. A communicator stays on the thread that
/// made it (MPI runs single-threaded, `MPI_Init`).
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
    /// The shim's handle, freed (before MPI is finalised) when the value drops.
    comm: *mut sys::moekit_mpi_comm,
    rank: usize,
    size: usize,
    /// The job's (`MPI_COMM_WORLD`'s) rank of each of this communicator's ranks, which the
    /// messages that end the job name.
    world_ranks: Vec<usize>,
    timeout: Duration,
    mpi: Rc<Initialised>,
}

/// MPI initialised in this process, finalised when the last communicator holding it drops.
struct Initialised;

impl Drop for Initialised {
    fn drop(&mut self) {
        // SAFETY: MPI was initialised by `MpiComm::init`, once per process; every communicator
        // has been freed (each holds this value) and every operation completed before its call
        // returned.
        unsafe { sys::moekit_mpi_finalize() };
    }
}

/// Environment variables MPI launchers set in the processes they start: Open MPI's `mpirun`,
/// PMIx (`prterun`, Slurm's `srun --mpi=pmix`) and MPICH's Hydra (PMI).
const LAUNCHER_VARIABLES: [&str; 3] = ["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"];

/// Exit status of a job [`MpiComm`] ends because a rank did not answer.
const UNANSWERED_EXIT: i32 = 3;

/// Exit status of a job [`MpiComm`] ends because an MPI call failed while messages were in
/// flight (the shim could not allocate a handle).
const FAILED_EXIT: i32 = 4;

impl MpiComm {
    /// How long an operation waits for the other ranks unless [`Self::with_timeout`] says
    /// otherwise (PyTorch's default for NCCL process groups).
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

    /// Initialises MPI; an error if it is already initialised in this process.
    pub fn init() -> Result<Self> {
        let failed = |message: String| Error::Collective { rank: 0, message };
        // SAFETY: no MPI call precedes it in this process (the shim checks MPI_Initialized).
        match unsafe { sys::moekit_mpi_init() } {
            0 => {}
            sys::MOEKIT_MPI_ALREADY_INITIALISED => {
                return Err(failed(
                    "MPI is already initialised in this process".to_owned(),
                ));
            }
            code => return Err(failed(format!("MPI_Init failed (MPI error {code})"))),
        }
        let mpi = Rc::new(Initialised);
        let mut comm = ptr::null_mut();
        // SAFETY: MPI is initialised; the call writes one handle.
        let code = unsafe { sys::moekit_mpi_comm_world(&mut comm) };
        if code != 0 {
            return Err(failed(format!(
                "cannot make a handle on MPI_COMM_WORLD (error {code})"
            )));
        }
        Self::of(comm, Self::DEFAULT_TIMEOUT, mpi)
            .map_err(|message| failed(format!("MPI_COMM_WORLD: {message}")))
    }

    /// The communicator of the shim's `comm` (now owned: freed on every path): its rank and
    /// size, read.
    fn of(
        comm: *mut sys::moekit_mpi_comm,
        timeout: Duration,
        mpi: Rc<Initialised>,
    ) -> std::result::Result<Self, String> {
        let mut this = Self {
            comm,
            rank: 0,
            size: 0,
            world_ranks: Vec::new(),
            timeout,
            mpi,
        };
        let (mut rank, mut size) = (0, 0);
        // SAFETY: `comm` is a live handle; both calls write one int.
        let codes = unsafe {
            [
                sys::moekit_mpi_rank(comm, &mut rank),
                sys::moekit_mpi_size(comm, &mut size),
            ]
        };
        match (codes, usize::try_from(rank), usize::try_from(size)) {
            ([0, 0], Ok(rank), Ok(size)) if rank < size => {
                (this.rank, this.size) = (rank, size);
                // The world's own numbering until `split` learns the members'.
                this.world_ranks = (0..size).collect();
                Ok(this)
            }
            _ => Err(format!(
                "cannot read this process's rank and size (MPI errors {codes:?})"
            )),
        }
    }

    /// The communicator of this one's ranks that pass the same `color`, ordered by `key` (then
    /// by their rank here): `MPI_Comm_split`, with this one's timeout. Every rank of this
    /// communicator must call it; it waits for them without a timeout (MPI's own collective),
    /// so call it where every rank is known to arrive, as after a check of the job they run.
    pub fn split(&self, color: usize, key: usize) -> Result<Self> {
        let failed = |message: String| Error::Collective {
            rank: self.rank,
            message: format!("MPI_Comm_split: {message}"),
        };
        let as_int = |what: &str, value: usize| {
            c_int::try_from(value).map_err(|_| failed(format!("{what} {value} exceeds an int")))
        };
        let (color, key) = (as_int("color", color)?, as_int("key", key)?);
        let mut comm = ptr::null_mut();
        // SAFETY: `self.comm` is a live handle; the call writes one handle on success.
        let code = unsafe { sys::moekit_mpi_comm_split(self.comm, color, key, &mut comm) };
        if code != 0 {
            return Err(failed(format!("MPI error {code}")));
        }
        let mut part = Self::of(comm, self.timeout, Rc::clone(&self.mpi)).map_err(failed)?;
        // Every member tells the others its world rank.
        let world_rank = (self.world_ranks[self.rank] as u64).to_le_bytes();
        let (received, _) =
            part.all_to_all_v(&world_rank.repeat(part.size), &vec![8; part.size])?;
        part.world_ranks = received
            .chunks_exact(8)
            .map(|bytes| u64::from_le_bytes(bytes.try_into().unwrap_or_default()) as usize)
            .collect();
        Ok(part)
    }

    /// Whether an MPI launcher (`mpirun`, `srun`, `mpiexec`) started this process, so that it
    /// has peers to meet in `MPI_Init`.
    pub fn launched() -> bool {
        LAUNCHER_VARIABLES
            .iter()
            .any(|name| std::env::var_os(name).is_some())
    }

    /// How long each operation waits for the other ranks before ending the job.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        // Updated in place: a new value would finalise MPI when this one drops.
        self.timeout = timeout;
        self
    }

    /// Aborts every process of the job with `code` (`MPI_Abort`): for a rank that fails
    /// outside a collective while the others may be waiting in one.
    pub fn abort(&self, code: i32) -> ! {
        // SAFETY: MPI is initialised while `self` lives.
        unsafe { sys::moekit_mpi_abort(code) }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // SAFETY: the handle is live, and every operation on it completed before its call
        // returned; MPI is finalised only after (`self.mpi` drops after this).
        unsafe { sys::moekit_mpi_comm_free(self.comm) };
    }
}

/// Tag of every message. Each round sends one message per ordered pair of ranks, and MPI
/// keeps the messages of a pair in order, so every round meets its own messages.
const P2P_TAG: c_int = 0x726f;

/// What a round carries.
trait Element: Copy {
    /// The shim's element kind.
    const KIND: c_int;
    /// Its name in messages, plural.
    const PLURAL: &'static str;
}

impl Element for f32 {
    const KIND: c_int = sys::F32;
    const PLURAL: &'static str = "words";
}

impl Element for u8 {
    const KIND: c_int = sys::BYTES;
    const PLURAL: &'static str = "bytes";
}

impl Element for u64 {
    const KIND: c_int = sys::U64;
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

/// What one send of a round carries, borrowed for the round.
enum Outgoing<'a, T> {
    /// Contiguous elements.
    Elements(&'a [T]),
    /// Rows of `row_words` f32 of `source`, each at its byte offset: sent where they lie.
    Rows {
        source: &'a [f32],
        byte_offsets: Vec<i64>,
        row_words: c_int,
    },
}

/// A posted operation with the rank at its other end. The memory it reads or writes must be
/// left alone until [`MpiComm::complete`] has seen it finish.
struct Pending {
    peer: usize,
    request: *mut sys::moekit_mpi_request,
}

/// Counts and displacements as MPI's `int`s.
fn counts_and_displacements(rank: usize, counts: &[usize]) -> Result<(Vec<i32>, Vec<i32>)> {
    let too_large = || too_large(rank);
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

fn too_large(rank: usize) -> Error {
    Error::Collective {
        rank,
        message: "an all-to-all chunk exceeds MPI's count limit (2^31 - 1 elements)".to_owned(),
    }
}

/// `len` elements as MPI's `int` count.
fn count(rank: usize, len: usize) -> Result<c_int> {
    c_int::try_from(len).map_err(|_| too_large(rank))
}

impl MpiComm {
    /// When an operation starting now gives up.
    fn deadline(&self) -> Deadline {
        Deadline(Instant::now().checked_add(self.timeout))
    }

    /// Ends the job with `line` on stderr (one write, so that the lines of several ranks do
    /// not interleave): MPI may hold this rank's buffers, so the call cannot return.
    fn end_job(&self, line: String, code: i32) -> ! {
        let _ = std::io::stderr().write_all(line.as_bytes());
        self.abort(code)
    }

    /// Ends the job because the ranks `silent` did not answer by the deadline: see the type's
    /// docs for why the call cannot return.
    fn unanswered(&self, silent: &[usize]) -> ! {
        let silent: Vec<String> = silent
            .iter()
            .map(|&rank| self.world_ranks[rank].to_string())
            .collect();
        let line = format!(
            "rank {} stops: rank(s) {} did not answer within {} s (stopped, hung or lost); \
             aborting the job\n",
            self.world_ranks[self.rank],
            silent.join(", "),
            self.timeout.as_secs_f64()
        );
        self.end_job(line, UNANSWERED_EXIT)
    }

    /// Checks the status `code` of the shim's `what`; a failure ends the job (operations
    /// posted before it may hold buffers).
    fn posted(&self, what: &str, code: c_int) {
        if code != 0 {
            let line = format!(
                "rank {} stops: {what} failed (MPI error {code}); aborting the job\n",
                self.world_ranks[self.rank]
            );
            self.end_job(line, FAILED_EXIT);
        }
    }

    /// `len` elements as the count of an operation about to be posted; the callers check
    /// their counts first, so a count too large here ends the job (operations posted before it
    /// may hold buffers) rather than returning.
    fn posted_count(&self, len: usize) -> c_int {
        count(self.rank, len).unwrap_or_else(|err| self.end_job(format!("{err}\n"), FAILED_EXIT))
    }

    /// Posts a receive of `slots` from `src`.
    ///
    /// # Safety
    /// `slots` must not be read, written or freed until [`Self::complete`] has returned the
    /// result.
    unsafe fn receive<T: Element>(&self, slots: &mut [MaybeUninit<T>], src: usize) -> Pending {
        let len = self.posted_count(slots.len());
        let mut request = ptr::null_mut();
        // SAFETY: `slots` holds `len` elements of `T`, whose kind is `T::KIND`; the caller leaves
        // it alone until the request completes.
        let code = unsafe {
            sys::moekit_mpi_irecv(
                self.comm,
                slots.as_mut_ptr().cast::<c_void>(),
                len,
                T::KIND,
                src as c_int,
                P2P_TAG,
                &mut request,
            )
        };
        self.posted("MPI_Irecv", code);
        Pending { peer: src, request }
    }

    /// Posts the send of `outgoing` to `dst`.
    ///
    /// # Safety
    /// The memory `outgoing` borrows must not be written or freed until [`Self::complete`]
    /// has returned the result.
    unsafe fn send<T: Element>(&self, outgoing: &Outgoing<'_, T>, dst: usize) -> Pending {
        let mut request = ptr::null_mut();
        let code = match outgoing {
            Outgoing::Elements(elements) => {
                let len = self.posted_count(elements.len());
                // SAFETY: `elements` holds `len` elements of kind `T::KIND`, left alone until the
                // request completes (the caller's contract).
                unsafe {
                    sys::moekit_mpi_isend(
                        self.comm,
                        elements.as_ptr().cast::<c_void>(),
                        len,
                        T::KIND,
                        dst as c_int,
                        P2P_TAG,
                        &mut request,
                    )
                }
            }
            Outgoing::Rows {
                source,
                byte_offsets,
                row_words,
            } => {
                let rows = self.posted_count(byte_offsets.len());
                // SAFETY: every row, `row_words` f32 from its byte offset, lies inside `source`
                // (`check_rows` found the selected rows there), which is left alone until the
                // request completes (the caller's contract); `byte_offsets` holds `rows`
                // offsets.
                unsafe {
                    sys::moekit_mpi_isend_rows(
                        self.comm,
                        source.as_ptr(),
                        rows,
                        byte_offsets.as_ptr(),
                        *row_words,
                        dst as c_int,
                        P2P_TAG,
                        &mut request,
                    )
                }
            }
        };
        self.posted("MPI_Isend", code);
        Pending { peer: dst, request }
    }

    /// Completes `pending`, receives of elements of `T` or sends; returns each one's peer with
    /// the elements it received (sends: meaningless), in the order they completed. Polls
    /// rather than blocks, so that a rank that never answers ends the job at `deadline`
    /// ([`Self::unanswered`]).
    fn complete<T: Element>(
        &self,
        mut pending: Vec<Pending>,
        deadline: Deadline,
    ) -> Vec<(usize, i64)> {
        let mut done = Vec::with_capacity(pending.len());
        // The requests still pending after a sweep, in a buffer kept across sweeps.
        let mut waiting = Vec::with_capacity(pending.len());
        loop {
            for operation in pending.drain(..) {
                let (mut finished, mut received) = (0, 0);
                // SAFETY: the request was posted and has not completed (a completed one is
                // freed by the shim and dropped here).
                let code = unsafe {
                    sys::moekit_mpi_test(operation.request, T::KIND, &mut finished, &mut received)
                };
                self.posted("MPI_Test", code);
                if finished != 0 {
                    done.push((operation.peer, received));
                } else {
                    waiting.push(operation);
                }
            }
            if waiting.is_empty() {
                return done;
            }
            if deadline.passed() {
                let silent: Vec<usize> = waiting.iter().map(|operation| operation.peer).collect();
                self.unanswered(&silent);
            }
            std::mem::swap(&mut pending, &mut waiting);
            // Lets an oversubscribed peer run (more ranks than cores).
            std::thread::yield_now();
        }
    }

    /// Receives the next message from rank `src`, whatever its length, waiting for it until
    /// `deadline`.
    fn receive_any_length(&self, src: usize, deadline: Deadline) -> Vec<f32> {
        let (message, len) = loop {
            let (mut found, mut message, mut len) = (0, ptr::null_mut(), 0);
            // SAFETY: plain out-parameters.
            let code = unsafe {
                sys::moekit_mpi_improbe(
                    self.comm,
                    src as c_int,
                    P2P_TAG,
                    sys::F32,
                    &mut found,
                    &mut message,
                    &mut len,
                )
            };
            self.posted("MPI_Improbe", code);
            if found != 0 {
                break (message, len);
            }
            if deadline.passed() {
                self.unanswered(&[src]);
            }
            std::thread::yield_now();
        };
        // A length that is not whole words is MPI's truncation error on receipt.
        let words = usize::try_from(len).unwrap_or(0);
        let mut values = uninit::<f32>(words);
        let mut request = ptr::null_mut();
        // SAFETY: `values` holds `words` f32 and lives until the request completes below;
        // `message` is the matched message, consumed here.
        let code = unsafe {
            sys::moekit_mpi_imrecv(
                values.as_mut_ptr().cast::<c_void>(),
                words as c_int,
                sys::F32,
                message,
                &mut request,
            )
        };
        self.posted("MPI_Imrecv", code);
        self.complete::<f32>(vec![Pending { peer: src, request }], deadline);
        // SAFETY: the buffer holds exactly the probed message.
        unsafe { assume_init(values) }
    }

    /// One point-to-point round, every message posted at once: a receive from each other rank
    /// into its chunk of `out` (the elements `chunks[src]`: ascending, disjoint ranges; this
    /// rank's own chunk and the elements between chunks are left alone) and each
    /// `(dst, outgoing)` of `sends`. A source that sent fewer elements than its chunk holds is
    /// an error naming it (more is MPI's truncation error).
    fn round<T: Element>(
        &self,
        out: &mut [MaybeUninit<T>],
        chunks: &[Range<usize>],
        sends: &[(usize, Outgoing<'_, T>)],
    ) -> Result<()> {
        let rank = self.rank;
        let deadline = self.deadline();
        // Every count is checked before anything is posted.
        for range in chunks {
            count(rank, range.len())?;
        }
        for (_, outgoing) in sends {
            match outgoing {
                Outgoing::Elements(elements) => count(rank, elements.len()).map(drop)?,
                Outgoing::Rows { byte_offsets, .. } => count(rank, byte_offsets.len()).map(drop)?,
            }
        }
        // Every chunk is split off before anything is posted.
        let mut rest = out;
        let mut consumed = 0;
        let mut incoming = Vec::with_capacity(chunks.len());
        for (src, range) in chunks.iter().enumerate() {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(range.start - consumed);
            let (chunk, tail) = tail.split_at_mut(range.len());
            rest = tail;
            consumed = range.end;
            if src != rank {
                incoming.push((src, chunk));
            }
        }
        let receives: Vec<Pending> = incoming
            .into_iter()
            // SAFETY: `out` stays borrowed by this call, which completes every receive below
            // before it returns.
            .map(|(src, chunk)| unsafe { self.receive(chunk, src) })
            .collect();
        let posted_sends = sends
            .iter()
            // SAFETY: `sends` stays borrowed by this call, which completes every send below
            // before it returns.
            .map(|(dst, outgoing)| unsafe { self.send(outgoing, *dst) })
            .collect();
        let received = self.complete::<T>(receives, deadline);
        self.complete::<T>(posted_sends, deadline);
        let short = received
            .into_iter()
            .filter(|&(src, got)| got != chunks[src].len() as i64)
            .min();
        match short {
            Some((src, got)) => Err(Error::Collective {
                rank: src,
                message: format!(
                    "sent {got} {} where rank {rank} expected {}",
                    T::PLURAL,
                    chunks[src].len()
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
        let (rank, size) = (self.rank, self.size);
        let (_, displacements) = counts_and_displacements(rank, send_counts)?;
        let others = || (0..size).filter(move |&peer| peer != rank);

        let counts: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let mut recv_counts = uninit::<u64>(size);
        recv_counts[rank].write(counts[rank]);
        let sends: Vec<(usize, Outgoing<'_, u64>)> = others()
            .map(|dst| (dst, Outgoing::Elements(&counts[dst..dst + 1])))
            .collect();
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
        let sends: Vec<(usize, Outgoing<'_, u8>)> = others()
            .map(|dst| (dst, Outgoing::Elements(chunk(dst))))
            .collect();
        self.round(&mut received, &chunks, &sends)?;
        // SAFETY: this rank's chunk was copied, every other one received whole.
        Ok((unsafe { assume_init(received) }, recv_counts))
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize]) -> Result<(Vec<u8>, Vec<usize>)> {
        check_counts(self.rank, self.size, send.len(), send_counts, "bytes")?;
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
        let (rank, size) = (self.rank, self.size);
        check_counts(rank, size, send.len(), send_counts, "words")?;
        let (counts, displacements) = counts_and_displacements(rank, send_counts)?;
        let chunk = |dst: usize| {
            let start = displacements[dst] as usize;
            &send[start..start + counts[dst] as usize]
        };
        let sends: Vec<(usize, Outgoing<'_, f32>)> = (0..size)
            .filter(|&dst| dst != rank)
            .map(|dst| (dst, Outgoing::Elements(chunk(dst))))
            .collect();
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
                let posted = sends
                    .iter()
                    // SAFETY: `send` stays borrowed by this call, which completes every send
                    // below before it returns.
                    .map(|(dst, outgoing)| unsafe { self.send(outgoing, *dst) })
                    .collect();
                let chunks: Vec<(Arc<Vec<f32>>, Range<usize>)> = (0..size)
                    .map(|src| {
                        let values = if src == rank {
                            chunk(rank).to_vec()
                        } else {
                            self.receive_any_length(src, deadline)
                        };
                        let len = values.len();
                        (Arc::new(values), 0..len)
                    })
                    .collect();
                self.complete::<f32>(posted, deadline);
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
        let (rank, size) = (self.rank, self.size);
        check_rows(rank, size, source.len(), width, rows, recv, out.len())?;
        let words = |rows: usize| {
            rows.checked_mul(width)
                .ok_or_else(|| too_large(rank))
                .and_then(|words| count(rank, words))
        };
        recv.counts()
            .iter()
            .try_for_each(|&rows| words(rows).map(drop))?;

        // What each other rank is sent: a range of rows as one run of words, a list of rows
        // (unless consecutive) by their byte offsets.
        let mut sends: Vec<(usize, Outgoing<'_, f32>)> = Vec::with_capacity(size);
        for dst in (0..size).filter(|&dst| dst != rank) {
            let range = match rows.selected(dst) {
                Selected::Range(range) => Some(range),
                Selected::Listed(listed) if listed.windows(2).all(|w| w[1] == w[0] + 1) => {
                    let first = listed.first().copied().unwrap_or(0);
                    Some(first..first + listed.len())
                }
                Selected::Listed(listed) => {
                    let byte_offsets = listed
                        .iter()
                        .map(|&row| i64::try_from(row * width * 4).map_err(|_| too_large(rank)))
                        .collect::<Result<Vec<i64>>>()?;
                    sends.push((
                        dst,
                        Outgoing::Rows {
                            source,
                            byte_offsets,
                            row_words: words(1)?,
                        },
                    ));
                    None
                }
            };
            if let Some(range) = range {
                words(range.len())?;
                let elements = &source[range.start * width..range.end * width];
                sends.push((dst, Outgoing::Elements(elements)));
            }
        }
        let chunks: Vec<Range<usize>> = (0..size)
            .map(|src| {
                let rows = recv.range(src);
                rows.start * width..rows.end * width
            })
            .collect();
        self.round(out, &chunks, &sends)
    }

    /// Every rank's buffer gathered (a round), then summed in rank order: bit-identical on
    /// every rank (`MPI_Allreduce`'s order is the implementation's).
    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()> {
        let (rank, size, len) = (self.rank, self.size, buffer.len());
        let mut all = uninit::<f32>(len * size);
        write_copy(&mut all[rank * len..], buffer);
        let chunks: Vec<Range<usize>> = (0..size).map(|src| src * len..(src + 1) * len).collect();
        let sends: Vec<(usize, Outgoing<'_, f32>)> = (0..size)
            .filter(|&dst| dst != rank)
            .map(|dst| (dst, Outgoing::Elements(&buffer[..])))
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
        let rank = self.rank;
        let sends: Vec<(usize, Outgoing<'_, f32>)> = (0..self.size)
            .filter(|&dst| dst != rank)
            .map(|dst| (dst, Outgoing::Elements(&[][..])))
            .collect();
        let empty: Vec<Range<usize>> = vec![0..0; self.size];
        self.round::<f32>(&mut [], &empty, &sends)
    }
}
