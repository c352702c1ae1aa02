//! Zeroed f32 buffers for large outputs, backed by transparent huge pages where the OS offers
//! them. A weight gradient of a large MoE layer is gigabytes of fresh memory per call; faulting
//! it in 4 KiB pages costs more than the arithmetic that fills it.

/// Below this size the page-fault cost is negligible and the advice is not worth a syscall.
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// A zeroed `len`-element buffer; large ones are advised to use huge pages before first touch.
/// The zeroing is the allocator's (fresh pages from the OS come zeroed), so the pages are
/// faulted in by whichever threads first write them, in parallel.
pub fn zeroed(len: usize) -> Vec<f32> {
    let mut buffer = vec![0.0f32; len];
    let bytes = len * std::mem::size_of::<f32>();
    if bytes >= HUGE_PAGE_MIN_BYTES {
        advise_huge_pages(buffer.as_mut_ptr().cast(), bytes);
    }
    buffer
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: *mut u8, bytes: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    // Only whole huge pages inside the allocation are advised.
    let begin = (start as usize).next_multiple_of(HUGE_PAGE);
    let end = (start as usize + bytes) / HUGE_PAGE * HUGE_PAGE;
    if end > begin {
        // SAFETY: [begin, end) lies inside the buffer just allocated and owned by the caller;
        // MADV_HUGEPAGE only changes how the kernel backs those pages, never their contents
        // (zeroed pages stay zero). A refusal (no THP support) is harmless and ignored.
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

    #[test]
    fn buffers_are_zeroed_and_sized_below_and_above_the_threshold() {
        for len in [0, 1, 1000, (HUGE_PAGE_MIN_BYTES / 4) + 12345] {
            let buffer = zeroed(len);
            assert_eq!(buffer.len(), len);
            assert!(buffer.iter().all(|&v| v == 0.0));
        }
    }
}
