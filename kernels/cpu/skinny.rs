//! `dst [m, n] = a [m, k] · w [k, n]` for a few rows m: one expert's tokens of a decoding step,
//! where the product is bound by reading `w` from memory once, not by arithmetic.
//!
//! On AVX2 with FMA, `w` (f32 or bf16, row-major) goes by panels of [`x86::PANEL_ROWS`] rows,
//! and each panel by strips of [`STRIP`] columns: a strip's rows are widened in registers and
//! multiplied into accumulators held in registers (one row of `a` against 64 columns, or two
//! rows against 32), which start from the previous panel's sums in `dst`. Each panel prefetches
//! the next one, strip by strip. So a few pages of `w` are in use at a time and each is read
//! front to back, a panel is read from memory once for every pair of rows of `a` (the next pair
//! finds it in L1), and the FMAs wait on nothing but the stream. Elsewhere, and for the columns
//! past the last whole strip, blocks of [`COLUMNS`] columns go through a widened copy of each
//! row into accumulators in L1. The packed-panel products ([`super::matmul`]) would copy every
//! panel of `w` before using it, for arithmetic that few rows leave idle.
//!
//! Measured on a 2-core Zen 3 (Qwen3-30B-A3B's experts, one token, K = 8): strips swept over
//! all rows of `w` before the next strip (a page per row step) read bf16 weights at 10–13
//! GB/s; panels of 16 rows at 17; of 8 (and of 4) at 23–27, the stream bandwidth.
//!
//! Every output is summed over k in ascending order, by fused multiply-adds at the AVX2 level
//! and above (plain multiply and add below it): the result depends only on the operands and the
//! instruction-set level, not on which loop computed it.

use half::bf16;

use super::isa::Isa;
use crate::tensor::Floats;

/// Most rows a product here takes; more go to the packed-panel products.
pub const MAX_ROWS: usize = 16;

/// Columns of `w` per block of the portable loops: the accumulators of [`MAX_ROWS`] rows
/// (16 KiB) and one widened row of `w` stay in a 32 KiB L1 data cache.
const COLUMNS: usize = 256;

/// Columns of `w` per strip of the AVX2 kernel: eight 8-lane registers for a single row of `a`
/// (two 64-byte cache lines of bf16 weights per row of `w`), two strips of four for pairs.
#[cfg(target_arch = "x86_64")]
const STRIP: usize = 64;

/// How `w` is stored.
trait Stored: Copy {
    fn widen(self) -> f32;
}

impl Stored for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Stored for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift, exact for every value.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// `dst [m, n] = a [m, k] · w [k, n]`, all row-major and contiguous.
///
/// # Panics
/// If `m` exceeds [`MAX_ROWS`] or a slice's length is not its shape's.
pub fn product(dst: &mut [f32], a: &[f32], w: Floats<'_>, (m, k, n): (usize, usize, usize)) {
    assert!(
        m <= MAX_ROWS,
        "skinny::product takes at most {MAX_ROWS} rows"
    );
    assert!(
        dst.len() == m * n && a.len() == m * k && w.len() == k * n,
        "skinny::product: operands not [m, k] · [k, n] → [m, n]"
    );
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx2.enabled() {
        // SAFETY (both arms): the active level is at most the detected one, so AVX2 and FMA
        // are present; the lengths were checked above.
        match w {
            // SAFETY: as above.
            Floats::F32(w) => unsafe { x86::product(dst, a, w, (m, k, n)) },
            // SAFETY: as above.
            Floats::BF16(w) => unsafe { x86::product(dst, a, w, (m, k, n)) },
        }
        return;
    }
    match w {
        Floats::F32(w) => blocks::<_, false>(dst, a, w, (m, k, n), 0..n),
        Floats::BF16(w) => blocks::<_, false>(dst, a, w, (m, k, n), 0..n),
    }
}

/// [`product`]'s portable loops over the output columns `columns`; `FUSED`: fused
/// multiply-adds (only where the CPU has them: a software fused multiply-add is a library call
/// per element).
#[inline(always)]
fn blocks<W: Stored, const FUSED: bool>(
    dst: &mut [f32],
    a: &[f32],
    w: &[W],
    (m, k, n): (usize, usize, usize),
    columns: std::ops::Range<usize>,
) {
    let mut row = [0.0_f32; COLUMNS];
    let mut sums = [[0.0_f32; COLUMNS]; MAX_ROWS];
    for first in columns.clone().step_by(COLUMNS) {
        let width = COLUMNS.min(columns.end - first);
        for sum in &mut sums[..m] {
            sum[..width].fill(0.0);
        }
        for p in 0..k {
            let start = p * n + first;
            for (r, &v) in row[..width].iter_mut().zip(&w[start..start + width]) {
                *r = v.widen();
            }
            for (sum, a_row) in sums[..m].iter_mut().zip(a.chunks_exact(k)) {
                let x = a_row[p];
                for (s, &r) in sum[..width].iter_mut().zip(&row[..width]) {
                    *s = if FUSED { x.mul_add(r, *s) } else { *s + x * r };
                }
            }
        }
        for (sum, dst_row) in sums[..m].iter().zip(dst.chunks_exact_mut(n)) {
            dst_row[first..first + width].copy_from_slice(&sum[..width]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::{STRIP, Stored, blocks};

    /// Rows of `w` per panel: the kernel sweeps every strip of a panel before the next panel,
    /// so a few pages of `w` are in use at a time (a strip's rows lie a row of `w` apart, often
    /// a page) and a panel read for one pair of rows of `a` is in cache for the next.
    pub const PANEL_ROWS: usize = 8;

    /// Eight consecutive elements of `w`, widened to f32 lanes.
    pub trait Lanes: Stored {
        /// # Safety
        /// `p` must point to eight readable elements; the CPU must have AVX2.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Lanes for f32 {
        #[inline(always)]
        unsafe fn load8(p: *const f32) -> __m256 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_loadu_ps(p) }
        }
    }

    impl Lanes for bf16 {
        #[inline(always)]
        unsafe fn load8(p: *const bf16) -> __m256 {
            // SAFETY: the caller's contract; bf16 is 16 bits, so eight are 16 bytes.
            unsafe {
                let halves = _mm_loadu_si128(p.cast());
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16))
            }
        }
    }

    /// [`super::product`] on AVX2 with FMA: whole strips in registers, the remaining columns in
    /// [`blocks`], fused.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; the slices must hold `[m, n]`, `[m, k]` and `[k, n]`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn product<W: Lanes>(
        dst: &mut [f32],
        a: &[f32],
        w: &[W],
        (m, k, n): (usize, usize, usize),
    ) {
        let whole = n / STRIP * STRIP;
        for rows in (0..k).step_by(PANEL_ROWS) {
            let rows = rows..k.min(rows + PANEL_ROWS);
            for first in (0..whole).step_by(STRIP) {
                let half = first + STRIP / 2;
                let mut row = 0;
                // SAFETY (each call): rows `row..row + 2` (or `+ 1`) of `a` and `dst`, rows
                // `rows` of `w`, and the strip's columns of `w` and `dst`, lie inside the
                // slices; `dst`'s part was written by the previous panel unless this is the
                // first.
                while m - row >= 2 {
                    // SAFETY: as above.
                    unsafe {
                        strip::<W, 2, 4>(dst, a, w, (row, first, rows.clone()), (k, n));
                        strip::<W, 2, 4>(dst, a, w, (row, half, rows.clone()), (k, n));
                    }
                    row += 2;
                }
                if row < m {
                    // SAFETY: as above.
                    unsafe { strip::<W, 1, 8>(dst, a, w, (row, first, rows.clone()), (k, n)) };
                }
            }
        }
        if whole < n {
            blocks::<W, true>(dst, a, w, (m, k, n), whole..n);
        }
    }

    /// `dst[row..row + R, first..first + 8L] (+)= a[row..row + R, rows] · w[rows, first..first +
    /// 8L]`: the R · L accumulators (L registers of 8 lanes per row) start from zero on the
    /// first panel of rows and from `dst` on later ones.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; rows `row..row + R` of `a [m, k]` and `dst [m, n]`, rows
    /// `rows` of `w [k, n]` and columns `first..first + 8L` of `w` and `dst` must lie inside
    /// the slices.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn strip<W: Lanes, const R: usize, const L: usize>(
        dst: &mut [f32],
        a: &[f32],
        w: &[W],
        (row, first, rows): (usize, usize, std::ops::Range<usize>),
        (k, n): (usize, usize),
    ) {
        debug_assert!((row + R) * n <= dst.len() && (row + R) * k <= a.len());
        debug_assert!(rows.end <= k && (rows.end - 1) * n + first + 8 * L <= w.len());
        let mut sums = [[_mm256_setzero_ps(); L]; R];
        if rows.start > 0 {
            for (r, sums) in sums.iter_mut().enumerate() {
                let out = &dst[(row + r) * n + first..(row + r) * n + first + 8 * L];
                for (sum, chunk) in sums.iter_mut().zip(out.chunks_exact(8)) {
                    // SAFETY: `chunk` holds eight f32.
                    *sum = unsafe { _mm256_loadu_ps(chunk.as_ptr()) };
                }
            }
        }
        let (a, w) = (a.as_ptr(), w.as_ptr());
        for p in rows {
            // SAFETY: the caller's contract (a prefetch of any address is safe).
            unsafe {
                let wp = w.add(p * n + first);
                // The same columns of the next panel's row: read a panel ahead of their use.
                let ahead = wp.wrapping_add(PANEL_ROWS * n).cast::<i8>();
                // Every line the strip's bytes touch: the first at each 64 bytes from the start,
                // and the line of the last byte (a strip need not start on a line).
                let bytes = 8 * L * size_of::<W>();
                for offset in (0..bytes).step_by(64).chain([bytes - 1]) {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(offset));
                }
                let mut lanes = [_mm256_setzero_ps(); L];
                for (j, lane) in lanes.iter_mut().enumerate() {
                    *lane = W::load8(wp.add(8 * j));
                }
                for (r, sums) in sums.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*a.add((row + r) * k + p));
                    for (sum, &lane) in sums.iter_mut().zip(&lanes) {
                        *sum = _mm256_fmadd_ps(x, lane, *sum);
                    }
                }
            }
        }
        for (r, sums) in sums.iter().enumerate() {
            let out = &mut dst[(row + r) * n + first..(row + r) * n + first + 8 * L];
            for (chunk, &sum) in out.chunks_exact_mut(8).zip(sums) {
                // SAFETY: `chunk` holds eight f32.
                unsafe { _mm256_storeu_ps(chunk.as_mut_ptr(), sum) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_values::values;

    /// Every shape class (a partial block, several blocks, one row, the most rows) against
    /// the sums in f64, f32 and bf16 weights.
    #[test]
    fn products_match_f64_sums() {
        for (m, k, n) in [
            (1, 1, 1),
            (1, 37, 300),
            (3, 64, 256),
            (2, 0, 64),
            (2, 5, 64),
            (MAX_ROWS, 19, 513),
        ] {
            let a = values(m * k, 1);
            let w = values(k * n, 2);
            let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            for weights in [Floats::F32(&w), Floats::BF16(&w_bf16)] {
                let mut dst = vec![f32::NAN; m * n];
                product(&mut dst, &a, weights, (m, k, n));
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|p| {
                                f64::from(a[i * k + p]) * f64::from(weights.get(p * n + j).unwrap())
                            })
                            .sum();
                        let got = f64::from(dst[i * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "({m}, {k}, {n}) [{i}, {j}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
