//! Buffers for large outputs, backed by transparent huge pages where the OS offers them. A
//! weight gradient of a large MoE layer is gigabytes of memory per call; faulting it in 4 KiB
//! pages costs more than the arithmetic that fills it.
//!
//! [`output_buffer`]s are not cleared when allocated: the kernels write every element, and the
//! task that computes a part clears whatever of it must read as zero
//! ([`crate::uninit::zero`]). A cleared allocation would cost a pass over the whole buffer by
//! the calling thread, because the process keeps freed memory for reuse (`moekit::memory`),
//! and reused memory is cleared by `calloc` itself.
//!
//! That holds for the weight gradients too: each expert's products write its slices whole
//! (`cpu::matmul::matmul_into`), and an expert without tokens zeroes its own.

use std::mem::MaybeUninit;

use crate::error::Result;
use crate::uninit::try_uninit;

/// Below this size the page-fault cost is negligible and the advice is not worth a syscall.
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// A buffer for output `name` of `shape`, to be written whole; large ones are advised to use
/// huge pages before first touch. An error names the output when it cannot be allocated.
pub fn output_buffer<T>(name: &str, shape: &[usize]) -> Result<Vec<MaybeUninit<T>>> {
    let mut buffer = try_uninit(name, shape)?;
    advise_if_large(buffer.as_mut_ptr().cast(), size_of_val(buffer.as_slice()));
    Ok(buffer)
}

/// Advises huge pages for a buffer of `bytes` from `start` when it is large enough.
fn advise_if_large(start: *mut u8, bytes: usize) {
    if bytes >= HUGE_PAGE_MIN_BYTES {
        advise_huge_pages(start, bytes);
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: *mut u8, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    // Only whole huge pages inside the allocation are advised.
    let begin = (start as usize).next_multiple_of(HUGE_PAGE);
    let end = (start as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > begin {
        // SAFETY: [begin, end) lies inside the buffer just allocated and owned by the caller;
        // MADV_HUGEPAGE only changes how the kernel backs those pages, never their contents.
        // A refusal (no THP support) is harmless and ignored.
        unsafe {
            libc::madvise(begin as *mut libc::c_void, end - begin, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_start: *mut u8, _bytes: usize) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uninit::{assume_init, zero};

    #[test]
    fn buffers_are_sized_and_hold_what_is_written_below_and_above_the_threshold() {
        for len in [0, 1, 1000, (HUGE_PAGE_MIN_BYTES / 4) + 12345] {
            let mut buffer = output_buffer::<f32>("x", &[len]).unwrap();
            assert_eq!(buffer.len(), len);
            zero(&mut buffer)
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = i as f32);
            // SAFETY: `zero` wrote every element.
            let values = unsafe { assume_init(buffer) };
            assert!(values.iter().enumerate().all(|(i, &v)| v == i as f32));
        }
    }

    #[test]
    fn outputs_past_the_address_space_are_errors_naming_them() {
        for shape in [[1 << 40, 1 << 10], [1 << 40, 1 << 40]] {
            let err = output_buffer::<f32>("down_activations", &shape)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("output `down_activations`") && err.contains(&format!("{shape:?}")),
                "{err}"
            );
        }
    }
}
