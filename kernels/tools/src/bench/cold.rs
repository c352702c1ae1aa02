//! Cold caches for timed calls. Before each, a buffer twice the size of the last-level cache is
//! written, so the call reads its operands from memory, as a model step does: its layers'
//! weights together far exceed any cache (Qwen3-30B-A3B's experts are 48 layers of 2.4 GB in
//! f32). Without it, a decode step's selected experts (150 MB at T = 1) stay in a 480 MiB L3
//! between repetitions, and the time measures the cache, not the step.

use std::hint::black_box;
use std::sync::{Mutex, OnceLock, PoisonError};

use rayon::prelude::*;

use crate::machine::last_level_cache_bytes;

/// The fewest bytes written, where the caches are unknown or small.
pub const MIN_BYTES: u64 = 64 << 20;

/// Elements each task writes.
const CHUNK: usize = 1 << 16;

/// The eviction buffer, allocated on first use, and the value last written.
static BUFFER: OnceLock<Mutex<(Vec<u64>, u64)>> = OnceLock::new();

/// The bytes [`evict`] writes: twice the last-level cache, at least [`MIN_BYTES`].
pub fn eviction_bytes() -> u64 {
    last_level_cache_bytes().map_or(MIN_BYTES, |bytes| (2 * bytes).max(MIN_BYTES))
}

/// Writes the eviction buffer through, on every thread of the current pool (each core's
/// private caches too).
pub fn evict() {
    let buffer = BUFFER.get_or_init(|| {
        let len = usize::try_from(eviction_bytes() / 8).unwrap_or(usize::MAX / 8);
        Mutex::new((vec![0; len], 0))
    });
    let mut guard = buffer.lock().unwrap_or_else(PoisonError::into_inner);
    let (values, stamp) = &mut *guard;
    *stamp += 1;
    let stamp = *stamp;
    values
        .par_chunks_mut(CHUNK)
        .for_each(|chunk| chunk.fill(stamp));
    black_box(values);
}
