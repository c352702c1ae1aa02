//! Process-wide memory policy for programs that run moekit's kernels.
//!
//! MoE layers allocate tens to thousands of megabytes per call (checkpoints, weight gradients,
//! exchange buffers). glibc serves every allocation above its mmap threshold (at most 32 MiB)
//! with a fresh `mmap` and returns it to the OS on `free`, so each call faults in and zeroes
//! every page of its outputs again: on a 2-core machine that is a quarter of a layer's time and
//! more than half of an expert-parallel exchange's. [`retain_freed_buffers`] makes freed
//! memory stay in the process for the next call instead.
//!
//! Libraries should not change an allocator's policy behind their host's back, so moekit never
//! calls this itself: the `moekit` and `moekit-train` binaries and the benchmarks do, first
//! thing in `main`.

/// Serve large allocations from the heap and keep freed memory for reuse rather than returning
/// it to the OS (glibc: `M_MMAP_THRESHOLD` raised to its largest value, 2 GiB; trimming off
/// (`M_TRIM_THRESHOLD` −1), since one backward's outputs alone exceed 2 GiB at
/// Qwen3-30B-A3B sizes; 64 MiB `M_TOP_PAD`). Returns whether the allocator accepted the policy; `false` on platforms
/// other than Linux with glibc, where it does nothing.
///
/// The process's resident memory then stays near its peak between calls, as with a caching
/// allocator (PyTorch's on GPUs), rather than dropping after each one.
pub fn retain_freed_buffers() -> bool {
    imp::retain_freed_buffers()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod imp {
    /// The weight gradients of one Qwen3-30B-A3B layer are 1.6 GB in f32: every buffer below
    /// glibc's largest threshold comes from the heap.
    const LARGEST: libc::c_int = libc::c_int::MAX;
    /// glibc reads −1 as "never trim the heap".
    const NEVER: libc::c_int = -1;
    const TOP_PAD: libc::c_int = 64 << 20;

    pub fn retain_freed_buffers() -> bool {
        // SAFETY: mallopt only changes glibc's allocation thresholds; it is safe to call at any
        // time, from any thread, and rejects values it does not support (returning 0).
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, LARGEST) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, NEVER) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod imp {
    pub fn retain_freed_buffers() -> bool {
        false
    }
}
