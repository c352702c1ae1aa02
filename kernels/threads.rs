//! libtorch's OpenMP workers and moekit's rayon workers share the machine's cores: for
//! programs that run moekit's kernels between libtorch's ops (`moekit-train`, the Python
//! package's PyTorch functions).
//!
//! After each of libtorch's parallel regions, libgomp's idle workers spin-wait for the next one
//! (by default about 300,000 spins, a few milliseconds) before they sleep. libtorch's next op
//! gains from that; a moekit kernel started meanwhile does not, because every spinning worker
//! holds a core its rayon workers need. Timed inside the trainer on 2 cores, `blockwise_mm`
//! took 18–20 ms per layer after a libtorch op and 15 ms without the spin; from Python, a
//! transformers experts call (forward and backward) 42–45 ms against 35–37.
//!
//! [`release_openmp_workers`] ends the calling thread's idle OpenMP workers (OpenMP 5.0's
//! `omp_pause_resource_all`) right before a moekit kernel; libtorch's next parallel region
//! starts new ones, which costs a thread creation per worker. As with [`crate::memory`], moekit
//! never calls it itself: the programs that host both runtimes do.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

/// `omp_pause_resource_all`'s signature; it returns 0 on success.
type PauseAll = unsafe extern "C" fn(kind: c_int) -> c_int;

/// `omp_pause_soft`: the workers end; the runtime's settings stay.
const OMP_PAUSE_SOFT: c_int = 1;

/// The OpenMP runtime's `omp_pause_resource_all` among the libraries this process loaded
/// (libtorch's libgomp), or `None` if no loaded runtime has it.
fn pause_all() -> Option<PauseAll> {
    static PAUSE_ALL: OnceLock<Option<PauseAll>> = OnceLock::new();
    *PAUSE_ALL.get_or_init(|| {
        // SAFETY: `dlsym` with `RTLD_DEFAULT` searches the loaded libraries for a
        // NUL-terminated name; it has no other effect.
        let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"omp_pause_resource_all".as_ptr()) };
        (!symbol.is_null()).then(|| {
            // SAFETY: the OpenMP 5.0 specification declares the symbol as
            // `int omp_pause_resource_all(omp_pause_resource_t kind)`, an enum passed as int.
            unsafe { std::mem::transmute::<*mut c_void, PauseAll>(symbol) }
        })
    })
}

/// Ends the idle OpenMP workers of the calling thread's pool, so that none spins while a
/// moekit kernel runs. Returns whether the runtime released them: `false` where no loaded
/// library provides OpenMP 5.0's pause (nothing to release), or when called inside a parallel
/// region (the runtime refuses; nothing changes).
pub fn release_openmp_workers() -> bool {
    match pause_all() {
        // SAFETY: the function was resolved with its specified signature; the runtime checks
        // the calling context itself (it refuses inside a parallel region).
        Some(pause) => unsafe { pause(OMP_PAUSE_SOFT) == 0 },
        None => false,
    }
}
