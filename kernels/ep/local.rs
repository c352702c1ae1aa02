//! R ranks as threads of one process, exchanging through shared memory.

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::comm::{
    Communicator, Received, RowChunks, RowsToSend, Selected, check_counts, check_known_counts,
    check_rows,
};
use crate::error::{Error, Result};
use crate::tensor::try_capacity;
use crate::uninit::write_copy;

/// How long a rank waits for the others at a collective before the group is declared broken.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// One rank of an in-process group made by [`LocalComm::group`]; move each into its own
/// thread. A rank that is dropped, or that waits longer than the group's timeout, breaks the
/// group: every rank's pending and later collectives return an error instead of hanging.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

struct Shared {
    size: usize,
    timeout: Duration,
    state: Mutex<State>,
    arrived: Condvar,
}

/// What one rank leaves for another in an exchange.
#[derive(Clone, Default)]
enum Parcel {
    #[default]
    Empty,
    Bytes(Vec<u8>),
    /// A range of the sender's word buffer, shared by all its destinations.
    Words(Arc<Vec<f32>>, Range<usize>),
    /// Rows of the sender's source, read where they lie.
    Rows(Arc<RowsOffer>),
}

/// Rows one rank offers another in [`Communicator::all_to_all_v_rows`]: a view of the
/// offering rank's source and the rows selected for the receiver.
struct RowsOffer {
    source: *const f32,
    len: usize,
    width: usize,
    rows: OfferedRows,
}

/// [`Selected`] rows, owned by the offer.
enum OfferedRows {
    Listed(Vec<usize>),
    Range(Range<usize>),
}

// SAFETY: an offer is a read-only view, and the offering rank keeps its source borrowed, and
// so unchanged and alive, until it holds the only reference to the offer
// (`LocalComm::withdraw`): every reader reads through its own reference.
unsafe impl Send for RowsOffer {}
// SAFETY: as for `Send`: shared references only read.
unsafe impl Sync for RowsOffer {}

impl RowsOffer {
    fn new(source: &[f32], width: usize, selected: Selected<'_>) -> Self {
        let rows = match selected {
            Selected::Listed(rows) => OfferedRows::Listed(rows.to_vec()),
            Selected::Range(range) => OfferedRows::Range(range),
        };
        Self {
            source: source.as_ptr(),
            len: source.len(),
            width,
            rows,
        }
    }

    /// The offered rows.
    fn selected(&self) -> Selected<'_> {
        match &self.rows {
            OfferedRows::Listed(rows) => Selected::Listed(rows),
            OfferedRows::Range(range) => Selected::Range(range.clone()),
        }
    }

    /// Copies the offered rows into `out` back to back (`count · width` words).
    fn copy_into(&self, out: &mut [MaybeUninit<f32>]) {
        // SAFETY: the offering rank's source outlives this reference (see `Send`), and
        // `source`/`len` are those of a slice.
        let source = unsafe { std::slice::from_raw_parts(self.source, self.len) };
        let mut offset = 0;
        self.selected().for_each_slice(source, self.width, |rows| {
            write_copy(&mut out[offset..offset + rows.len()], rows);
            offset += rows.len();
        });
    }
}

struct State {
    /// `mailbox[src · R + dst]`: what `src` sent to `dst` in the current exchange.
    mailbox: Vec<Parcel>,
    /// Ranks waiting at the barrier of the current generation.
    waiting: usize,
    generation: u64,
    /// Why the group can no longer make progress, and the rank at fault.
    broken: Option<(usize, String)>,
}

impl LocalComm {
    /// A group of `size` ranks (at least 1) with the default timeout (120 s).
    pub fn group(size: usize) -> Result<Vec<LocalComm>> {
        Self::group_with_timeout(size, DEFAULT_TIMEOUT)
    }

    /// A group of `size` ranks whose collectives give up after waiting `timeout` for the
    /// others.
    pub fn group_with_timeout(size: usize, timeout: Duration) -> Result<Vec<LocalComm>> {
        if size == 0 {
            return Err(Error::param(
                "ranks",
                "a group needs at least 1 rank, got 0",
            ));
        }
        // One mailbox slot per (sender, receiver) pair.
        let mut mailbox = try_capacity("LocalComm's mailbox", &[size, size])
            .map_err(|err| Error::param("ranks", format!("{size} ranks are too many: {err}")))?;
        mailbox.resize(size * size, Parcel::Empty);
        let shared = Arc::new(Shared {
            size,
            timeout,
            state: Mutex::new(State {
                mailbox,
                waiting: 0,
                generation: 0,
                broken: None,
            }),
            arrived: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| LocalComm {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect())
    }

    /// Leaves `outgoing[dst]` for every rank and takes what every rank left for this one.
    fn exchange(&self, outgoing: Vec<Parcel>) -> Result<Vec<Parcel>> {
        let size = self.shared.size;
        // Parcels change hands under the lock; nothing is copied.
        let mut state = self.lock();
        for (dst, parcel) in outgoing.into_iter().enumerate() {
            state.mailbox[self.rank * size + dst] = parcel;
        }
        let mut state = self.barrier_locked(state)?;
        let incoming = (0..size)
            .map(|src| std::mem::take(&mut state.mailbox[src * size + self.rank]))
            .collect();
        // Nobody writes the next exchange before everybody has taken this one.
        drop(self.barrier_locked(state)?);
        Ok(incoming)
    }

    /// Takes back this rank's `offers` that no rank took from the mailbox (an exchange that
    /// failed), then waits until every rank that took one has dropped it: only then may the
    /// source they view be released. Readers finish or unwind (dropping their reference) in
    /// bounded time, so this wait has no timeout.
    fn withdraw(&self, offers: &[Option<Arc<RowsOffer>>]) {
        let size = self.shared.size;
        let mut state = self.lock();
        for (dst, offer) in offers.iter().enumerate() {
            let slot = &mut state.mailbox[self.rank * size + dst];
            if let (Parcel::Rows(left), Some(offer)) = (&*slot, offer)
                && Arc::ptr_eq(left, offer)
            {
                *slot = Parcel::Empty;
            }
        }
        while offers
            .iter()
            .flatten()
            .any(|offer| Arc::strong_count(offer) > 1)
        {
            // Polled as well as notified: a reader that unwinds drops its reference without
            // notifying.
            state = self
                .shared
                .arrived
                .wait_timeout(state, Duration::from_millis(1))
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// The ranks called different collectives at the same step.
    fn mixed_exchange(&self) -> Error {
        Error::Collective {
            rank: self.rank,
            message: "the ranks of the group called different all-to-alls at the same step"
                .to_owned(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock cannot have left the mailbox half
        // written in a way later collectives read: the group is marked broken on its drop.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until every rank has arrived (taking `state` in and handing it back).
    fn barrier_locked<'a>(
        &'a self,
        mut state: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>> {
        if let Some((rank, message)) = &state.broken {
            return Err(Error::Collective {
                rank: *rank,
                message: message.clone(),
            });
        }
        let generation = state.generation;
        state.waiting += 1;
        if state.waiting == self.shared.size {
            state.waiting = 0;
            state.generation += 1;
            self.shared.arrived.notify_all();
            return Ok(state);
        }
        let deadline = Instant::now() + self.shared.timeout;
        loop {
            let now = Instant::now();
            if state.generation != generation {
                return Ok(state);
            }
            if let Some((rank, message)) = &state.broken {
                return Err(Error::Collective {
                    rank: *rank,
                    message: message.clone(),
                });
            }
            if now >= deadline {
                let message = format!(
                    "waited {:?} at a collective for the other ranks of the group",
                    self.shared.timeout
                );
                state.broken = Some((self.rank, message.clone()));
                self.shared.arrived.notify_all();
                return Err(Error::Collective {
                    rank: self.rank,
                    message,
                });
            }
            state = self
                .shared
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize]) -> Result<(Vec<u8>, Vec<usize>)> {
        check_counts(
            self.rank,
            self.shared.size,
            send.len(),
            send_counts,
            "bytes",
        )?;
        let mut offset = 0;
        let outgoing = send_counts
            .iter()
            .map(|&count| {
                offset += count;
                Parcel::Bytes(send[offset - count..offset].to_vec())
            })
            .collect();
        let incoming = self
            .exchange(outgoing)?
            .into_iter()
            .map(|parcel| match parcel {
                Parcel::Bytes(bytes) => Ok(bytes),
                _ => Err(self.mixed_exchange()),
            })
            .collect::<Result<Vec<_>>>()?;
        let counts = incoming.iter().map(Vec::len).collect();
        let received = incoming.concat();
        Ok((received, counts))
    }

    fn all_to_all_v_words(
        &self,
        send: Cow<'_, [f32]>,
        send_counts: &[usize],
        recv_counts: Option<&[usize]>,
    ) -> Result<Received> {
        check_counts(
            self.rank,
            self.shared.size,
            send.len(),
            send_counts,
            "words",
        )?;
        let send = Arc::new(send.into_owned());
        let mut offset = 0;
        let outgoing = send_counts
            .iter()
            .map(|&count| {
                offset += count;
                Parcel::Words(Arc::clone(&send), offset - count..offset)
            })
            .collect();
        drop(send);
        let chunks = self
            .exchange(outgoing)?
            .into_iter()
            .map(|parcel| match parcel {
                Parcel::Words(buffer, range) => Ok((buffer, range)),
                _ => Err(self.mixed_exchange()),
            })
            .collect::<Result<Vec<_>>>()?;
        let received = Received::from_chunks(chunks);
        check_known_counts(self.rank, &received.counts(), recv_counts)?;
        Ok(received)
    }

    /// Each rank offers views of its source; every receiver copies the rows meant for it
    /// straight from the senders' sources into `out` (one copy), and a sender returns only
    /// once every receiver is done with its offers.
    fn all_to_all_v_rows(
        &self,
        source: &[f32],
        width: usize,
        rows: RowsToSend<'_>,
        recv: RowChunks<'_>,
        out: &mut [MaybeUninit<f32>],
    ) -> Result<()> {
        let (rank, size) = (self.rank, self.shared.size);
        check_rows(rank, size, source.len(), width, rows, recv, out.len())?;
        let offers: Vec<Option<Arc<RowsOffer>>> = (0..size)
            .map(|dst| {
                (dst != rank).then(|| Arc::new(RowsOffer::new(source, width, rows.selected(dst))))
            })
            .collect();
        let outgoing = offers
            .iter()
            .map(|offer| {
                offer
                    .as_ref()
                    .map_or(Parcel::Empty, |o| Parcel::Rows(Arc::clone(o)))
            })
            .collect();
        let received = self.exchange(outgoing).and_then(|incoming| {
            for (src, parcel) in incoming.into_iter().enumerate() {
                let range = recv.range(src);
                let chunk = &mut out[range.start * width..range.end * width];
                match parcel {
                    Parcel::Empty if src == rank => {}
                    Parcel::Rows(offer) if offer.selected().count() == range.len() => {
                        offer.copy_into(chunk);
                    }
                    Parcel::Rows(offer) => {
                        return Err(Error::Collective {
                            rank: src,
                            message: format!(
                                "sent {} rows where rank {rank} expected {}",
                                offer.selected().count(),
                                range.len()
                            ),
                        });
                    }
                    _ => return Err(self.mixed_exchange()),
                }
            }
            Ok(())
        });
        // This rank's references to the others' offers are gone: wake senders waiting on them.
        self.shared.arrived.notify_all();
        self.withdraw(&offers);
        received
    }

    fn all_reduce_sum(&self, buffer: &mut [f32]) -> Result<()> {
        let size = self.shared.size;
        let bytes: &[u8] = bytemuck::cast_slice(buffer);
        let send = bytes.repeat(size);
        let expected = bytes.len();
        let (received, counts) = self.all_to_all_v(&send, &vec![expected; size])?;
        if counts.iter().any(|&c| c != expected) {
            return Err(Error::Collective {
                rank: self.rank,
                message: format!(
                    "all_reduce_sum of {} values met buffers of {:?} bytes on the other ranks",
                    buffer.len(),
                    counts
                ),
            });
        }
        let mut all = Vec::with_capacity(buffer.len() * size);
        super::comm::extend_from_bytes(&mut all, &received);
        buffer.fill(0.0);
        for chunk in all.chunks_exact(buffer.len().max(1)).take(size) {
            for (sum, v) in buffer.iter_mut().zip(chunk) {
                *sum += v;
            }
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        drop(self.barrier_locked(self.lock())?);
        Ok(())
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut state = self.lock();
        if state.broken.is_none() && self.shared.size > 1 {
            state.broken = Some((self.rank, "left the group".to_owned()));
        }
        self.shared.arrived.notify_all();
    }
}
