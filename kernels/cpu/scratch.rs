//! Scratch buffers shared by the tasks a thread runs in one parallel loop.
//!
//! rayon's `map_init` and `for_each_init` make a fresh value for every piece its splitter cuts
//! the work into, not once per thread: 22 per `blockwise_mm` call and 16 per
//! `blockwise_mm_bwd` call at the qwen3-moe-small shape (T = 2048, 2 threads), and every fresh
//! scratch grows its buffers again, clearing each growth (`cpu::rows::resized`). A
//! [`PerThread`] holds one value per thread of the pool for the loop instead, so a thread's
//! tasks reuse what its first task grew. What a scratch holds never reaches a result (every
//! task overwrites what it reads), so results do not depend on which value a task gets.

use std::sync::Mutex;

/// One `T` per thread of the current rayon pool, for the duration of one parallel loop.
pub(super) struct PerThread<T> {
    slots: Vec<Mutex<T>>,
}

impl<T: Default> PerThread<T> {
    /// One empty `T` per thread of the current pool (none are allocated until used).
    pub fn new() -> Self {
        Self {
            slots: (0..rayon::current_num_threads().max(1))
                .map(|_| Mutex::default())
                .collect(),
        }
    }

    /// Runs `f` on the calling thread's `T`. A task that a thread runs while an outer task of
    /// the same loop waits on it (work stealing inside a nested parallel loop) finds that
    /// thread's value in use and gets a fresh one, as `map_init` would give it.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        let index = rayon::current_thread_index().unwrap_or(0) % self.slots.len();
        match self.slots[index].try_lock() {
            Ok(mut value) => f(&mut value),
            Err(_) => f(&mut T::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use rayon::prelude::*;

    use super::*;

    #[test]
    fn a_threads_tasks_reuse_its_value_and_nested_tasks_do_not_wait_for_it() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let reused = AtomicUsize::new(0);
        pool.install(|| {
            let scratch = PerThread::<Vec<usize>>::new();
            (0..64).into_par_iter().for_each(|task| {
                scratch.with(|values| {
                    if !values.is_empty() {
                        reused.fetch_add(1, Ordering::Relaxed);
                    }
                    values.push(task);
                    // A nested loop, whose tasks (or other outer tasks) this thread may run
                    // while it waits: they must not wait for the value it holds.
                    (0..8)
                        .into_par_iter()
                        .for_each(|_| scratch.with(|inner| inner.push(0)));
                });
            });
        });
        // 64 tasks on 2 threads: a thread's later tasks find what its earlier ones left.
        assert!(reused.load(Ordering::Relaxed) > 0);
    }
}
