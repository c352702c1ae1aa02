//! Copies into memory that nothing reads again soon, with non-temporal stores: whole cache
//! lines go to memory without first being read into the caches, which halves the memory
//! traffic of writing them and evicts nothing. Two outputs qualify: the forward's checkpoint
//! `gate_up_activations_T`, which only the backward reads, after the rest of the model's
//! forward, and the weight gradients, which only the optimizer reads, after the rest of the
//! backward. The copy moves the values unchanged on every level: 64-byte stores on AVX-512,
//! 32-byte ones on AVX2, plain stores on the portable level and for the partial lines at either
//! end of a copy.
//!
//! Measured on Zen 4 with `moekit bench` at qwen3-moe-small (T = 2048, B = 32), calls
//! alternating in one process (the first left out): `blockwise_mm` took 10.79 ms with the
//! checkpoint streamed against 11.23 ms, `blockwise_mm_bwd` 19.53 against 19.93 ms with the
//! weight gradients streamed; at Qwen3-30B-A3B the forward was unchanged (855.9 against 857.8
//! ms at T = 2048) and the backward 611.4 against 622.0 ms at T = 512 (BENCHMARKS.md).

use std::mem::MaybeUninit;

use super::isa::Isa;

/// The non-temporal stores of one task, ordered before its results are used: dropping the
/// value fences them (`sfence`), as the stores require before any other access to the memory
/// they write, so a task holds one while it copies and drops it when it is done.
pub(super) struct Streamer {
    /// The widest level the copies use.
    level: Isa,
}

impl Streamer {
    pub(super) fn new() -> Self {
        let level = [Isa::Avx512, Isa::Avx2]
            .into_iter()
            .find(|level| cfg!(target_arch = "x86_64") && level.enabled())
            .unwrap_or(Isa::Portable);
        Self { level }
    }

    /// Whether the copies skip the caches: whether a result is better computed in a scratch
    /// buffer and streamed out than written in place.
    pub(super) fn skips_caches(&self) -> bool {
        self.level != Isa::Portable
    }

    /// Copies `src` into `dst`, which are equally long.
    ///
    /// # Panics
    /// If the lengths differ.
    pub(super) fn copy<T: Copy>(&mut self, dst: &mut [MaybeUninit<T>], src: &[T]) {
        assert_eq!(
            dst.len(),
            src.len(),
            "a streamed copy between unequal slices"
        );
        let (to, from, bytes) = (
            dst.as_mut_ptr().cast(),
            src.as_ptr().cast(),
            size_of_val(src),
        );
        match self.level {
            // SAFETY: the level is enabled (checked in `new`); both ranges hold `bytes` bytes
            // and do not overlap (`dst` is borrowed mutably).
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::copy_avx512(to, from, bytes) },
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::copy_avx2(to, from, bytes) },
            _ => {
                for (d, &s) in dst.iter_mut().zip(src) {
                    d.write(s);
                }
            }
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        if self.skips_caches() {
            // SAFETY: SSE is part of x86-64.
            unsafe { std::arch::x86_64::_mm_sfence() };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const LINE: usize = 64;

    /// The parts of a copy of `bytes` bytes to `dst`: the bytes before `dst`'s first line
    /// boundary, and the whole lines after them (the rest is the tail).
    fn parts(dst: *mut u8, bytes: usize) -> (usize, usize) {
        let head = dst.align_offset(LINE).min(bytes);
        (head, (bytes - head) / LINE)
    }

    /// Copies `bytes` bytes from `src` to `dst`: plain copies up to `dst`'s first line boundary
    /// and after its last, `line` for each whole line between them (given the line's offset).
    ///
    /// # Safety
    /// `src` and `dst` hold `bytes` bytes each and do not overlap; `line` writes the 64 bytes
    /// at `dst + at` from those at `src + at`.
    #[inline(always)]
    unsafe fn copy_with(dst: *mut u8, src: *const u8, bytes: usize, mut line: impl FnMut(usize)) {
        let (head, lines) = parts(dst, bytes);
        let tail = head + lines * LINE;
        // SAFETY: every offset stays below `bytes` (the caller's contract).
        unsafe {
            std::ptr::copy_nonoverlapping(src, dst, head);
            std::ptr::copy_nonoverlapping(src.add(tail), dst.add(tail), bytes - tail);
        }
        for l in 0..lines {
            line(head + l * LINE);
        }
    }

    /// [`copy_with`] one 64-byte non-temporal store per line.
    ///
    /// # Safety
    /// AVX-512 F must be present; `src` and `dst` hold `bytes` bytes each and do not overlap.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn copy_avx512(dst: *mut u8, src: *const u8, bytes: usize) {
        // SAFETY: `at` is a line of both ranges, on a line boundary of `dst`.
        unsafe {
            copy_with(dst, src, bytes, |at| {
                let line = _mm512_loadu_si512(src.add(at).cast());
                _mm512_stream_si512(dst.add(at).cast(), line);
            })
        }
    }

    /// [`copy_with`] two 32-byte non-temporal stores per line.
    ///
    /// # Safety
    /// AVX2 must be present; `src` and `dst` hold `bytes` bytes each and do not overlap.
    #[target_feature(enable = "avx2")]
    pub unsafe fn copy_avx2(dst: *mut u8, src: *const u8, bytes: usize) {
        // SAFETY: as in `copy_avx512`; both halves of a line are 32-byte aligned.
        unsafe {
            copy_with(dst, src, bytes, |at| {
                for half in [at, at + LINE / 2] {
                    let values = _mm256_loadu_si256(src.add(half).cast());
                    _mm256_stream_si256(dst.add(half).cast(), values);
                }
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::uninit::{assume_init, uninit};

    /// Checks `source[..len]` copied at `level` into `buffer[offset..]` of a buffer otherwise
    /// zero.
    fn check_copy<T: Copy + Default + PartialEq + std::fmt::Debug>(
        level: Isa,
        source: &[T],
        (offset, len): (usize, usize),
    ) {
        let mut buffer = uninit::<T>(offset + len + 40);
        Streamer { level }.copy(&mut buffer[offset..offset + len], &source[..len]);
        let (before, rest) = buffer.split_at_mut(offset);
        for v in before.iter_mut().chain(&mut rest[len..]) {
            v.write(T::default());
        }
        let mut expected = vec![T::default(); buffer.len()];
        expected[offset..offset + len].copy_from_slice(&source[..len]);
        // SAFETY: the copy wrote `offset..offset + len`, the loop the rest.
        let written = unsafe { assume_init(buffer) };
        assert_eq!(written, expected, "{level}, offset {offset}, length {len}");
    }

    #[test]
    fn copies_hold_the_source_at_every_offset_and_length_on_every_level_here() {
        // Offsets put the destination at every position in a line (for 2-byte elements, every
        // even one); the lengths give copies shorter than a line, of whole lines, and with
        // both ends partial.
        let floats: Vec<f32> = (0..600).map(|v| v as f32 * 0.5 - 7.0).collect();
        let halves: Vec<bf16> = floats.iter().map(|&v| bf16::from_f32(v)).collect();
        let levels = [Isa::Portable, Isa::Avx2, Isa::Avx512];
        for level in levels.into_iter().filter(|&level| level <= Isa::detected()) {
            for offset in 0..32 {
                for len in [0, 1, 15, 16, 17, 31, 32, 33, 64, 100, 583] {
                    check_copy(level, &floats, (offset, len));
                    check_copy(level, &halves, (offset, len));
                }
            }
        }
    }
}
