//! `dst [m, n] = a [m, k] · b [k, n]` with both operands stored in bf16 and f32 accumulation,
//! on AVX-512 BF16's pairwise dot product (`vdpbf16ps`: into each f32 lane, the products of
//! two bf16 pairs, at twice the f32 FMA rate).
//!
//! A product of two bf16 values is exact in f32, so each output is the f32 sum of the exact
//! products, as the widening f32 path computes it, in a different order: along k in pairs,
//! `acc + a[2p+1]·b[2p+1] + a[2p]·b[2p]` for p = 0, 1, … (each `+` rounded to nearest even).
//! The order depends only on k, never on threads. One difference: the instruction treats
//! subnormal inputs and results as zero (|x| < 2⁻¹²⁶, far below any tolerance).
//!
//! `a` is row-major with an even row stride, so the pair `a[r, 2p..2p+2]` is one 32-bit
//! broadcast. `b` is read as stored (row-major `[k, n]`, the weights' layout): each step loads
//! 32 columns of rows 2p and 2p+1 and interleaves them into pairs with one permute per 16
//! columns, reused by every row of the register tile; no packed copy of the weights is made.
//!
//! [`matmul_bf16_nt`] is the dot-product form `a · bᵀ` for `b [n, k]` as stored (the
//! backward's `d y · Dᵀ` against weights in nki's layout): both operands stream along k, so
//! their pairs line up at any k and row length, and each output sums its 16 lanes' pair sums
//! as [`matmul_nt`](super::dot::matmul_nt) sums its f32 lanes.

use std::mem::MaybeUninit;

use half::bf16;

use super::isa::Isa;

/// Whether [`matmul_bf16`] runs here: the active level has AVX-512 F, BW and BF16.
pub fn available() -> bool {
    Isa::Avx512Bf16.enabled()
}

/// `dst [m, n] = a [m, k] · b [k, n]`: `a` row-major with row stride `lda` (even, ≥ k; where k
/// is odd, the column past it zero; the last row may end there), `b` row-major with row stride
/// `ldb` ≥ n (so a product may read some columns of a wider matrix), `dst` row-major `[m, n]`.
///
/// # Panics
/// If the CPU lacks the instructions ([`available`]), `lda` is odd or below k, `ldb` is below
/// n, or a buffer is shorter than its shape.
pub fn matmul_bf16(
    dst: &mut [f32],
    a: (&[bf16], usize),
    b: (&[bf16], usize),
    shape: (usize, usize, usize),
) {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and every f32 is a valid one.
    let dst = unsafe { &mut *(std::ptr::from_mut(dst) as *mut [MaybeUninit<f32>]) };
    matmul_bf16_into(dst, a, b, shape);
}

/// [`matmul_bf16`] into memory not yet written (the tiles store every output and read none);
/// returns `dst` as the values it now holds.
///
/// # Panics
/// As [`matmul_bf16`].
pub fn matmul_bf16_into<'d>(
    dst: &'d mut [MaybeUninit<f32>],
    (a, lda): (&[bf16], usize),
    (b, ldb): (&[bf16], usize),
    (m, n, k): (usize, usize, usize),
) -> &'d mut [f32] {
    assert!(available(), "matmul_bf16 needs AVX-512 BF16");
    assert!(
        lda.is_multiple_of(2) && lda >= k,
        "lda must be even and at least k"
    );
    assert!(ldb >= n, "ldb must be at least n");
    assert!(
        strided_fits(dst.len(), m, n, n)
            && strided_fits(a.len(), m, lda, k.next_multiple_of(2))
            && strided_fits(b.len(), k, ldb, n),
        "operand too short"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the instructions were checked above; the buffers hold their shapes.
    unsafe {
        x86::matmul(dst.as_mut_ptr().cast(), (a, lda), (b, ldb), (m, n, k));
    }
    // SAFETY: the tiles wrote the first m · n elements (every element when `dst` is exactly
    // that long; a caller's longer buffer keeps its tail), and `MaybeUninit<f32>` has `f32`'s
    // layout.
    unsafe { &mut *(std::ptr::from_mut(&mut dst[..m * n]) as *mut [f32]) }
}

/// `dst [m, n] = a [m, k] · b [n, k]ᵀ` with both operands stored in bf16: exact products, f32
/// sums, along k in pairs. Each matrix is row-major with its own row stride (`ldd`, `lda`,
/// `ldb`), so a product may read or fill some columns of a wider matrix.
///
/// # Panics
/// If the CPU lacks the instructions ([`available`]), a stride is below its row's length or a
/// buffer is shorter than its shape.
pub fn matmul_bf16_nt(
    (dst, ldd): (&mut [f32], usize),
    (a, lda): (&[bf16], usize),
    (b, ldb): (&[bf16], usize),
    (m, n, k): (usize, usize, usize),
) {
    assert!(available(), "matmul_bf16_nt needs AVX-512 BF16");
    assert!(
        ldd >= n && lda >= k && ldb >= k,
        "a row stride below its row's length"
    );
    assert!(
        strided_fits(dst.len(), m, ldd, n)
            && strided_fits(a.len(), m, lda, k)
            && strided_fits(b.len(), n, ldb, k),
        "operand too short"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the instructions were checked above; the buffers hold their shapes.
    unsafe {
        x86::matmul_nt((dst, ldd), (a, lda), (b, ldb), (m, n, k));
    }
}

/// Whether `len` elements hold `rows` rows of `cols` at row stride `stride` (the last row
/// need not extend to the stride).
fn strided_fits(len: usize, rows: usize, stride: usize, cols: usize) -> bool {
    rows == 0
        || (rows - 1)
            .checked_mul(stride)
            .and_then(|start| start.checked_add(cols))
            .is_some_and(|end| len >= end)
}

// Register tiles are indexed by (row, register), as in the formulas.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use crate::cpu::dot::x86::{MR as NT_MR, NR as NT_NR, lane_sums};
    use crate::cpu::tile_walk::{Order, RegisterTiles, aligned_head, by_rows, walk};

    /// # Safety
    /// The CPU must support AVX-512 F, BW and BF16; `dst`, `a` and `b` hold `m`, `m` and `n`
    /// rows of `n`, `k` and `k` elements at their strides.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn matmul_nt(
        (dst, ldd): (&mut [f32], usize),
        (a, lda): (&[bf16], usize),
        (b, ldb): (&[bf16], usize),
        (m, n, k): (usize, usize, usize),
    ) {
        let (a, b) = (a.as_ptr().cast::<u16>(), b.as_ptr().cast::<u16>());
        let (full_m, full_n) = (m / NT_MR * NT_MR, n / NT_NR * NT_NR);
        // Columns outer: a tile of `b` rows stays in cache while every row of `a` passes it.
        for c0 in (0..full_n).step_by(NT_NR) {
            for r0 in (0..full_m).step_by(NT_MR) {
                // SAFETY: rows r0..r0+NT_MR of `a` and c0..c0+NT_NR of `b` exist.
                let acc = unsafe { nt_tile((a.add(r0 * lda), lda), (b.add(c0 * ldb), ldb), k) };
                for (i, row) in lane_sums(acc).chunks_exact(NT_NR).enumerate() {
                    dst[(r0 + i) * ldd + c0..][..NT_NR].copy_from_slice(row);
                }
            }
        }
        // The ragged right and bottom edges, one output at a time.
        for r in 0..m {
            let columns = if r < full_m { full_n..n } else { 0..n };
            for c in columns {
                // SAFETY: row r of `a` and row c of `b` exist.
                let [[acc]] =
                    unsafe { nt_tile::<1, 1>((a.add(r * lda), lda), (b.add(c * ldb), ldb), k) };
                dst[r * ldd + c] = _mm512_reduce_add_ps(acc);
            }
        }
    }

    /// The `MR × NR` accumulators of rows `a` (stride `lda`) by rows `b` (stride `ldb`): 16
    /// lanes each, every lane the sum of its pairs along k, in order; the last step loads the
    /// tail masked, with zeros past k.
    ///
    /// # Safety
    /// As [`matmul_nt`], for these rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn nt_tile<const MR: usize, const NR: usize>(
        (a, lda): (*const u16, usize),
        (b, ldb): (*const u16, usize),
        k: usize,
    ) -> [[__m512; NR]; MR] {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        for kk in (0..k).step_by(32) {
            let left = k - kk;
            let mask: __mmask32 = if left >= 32 { !0 } else { (1u32 << left) - 1 };
            // SAFETY: the masked loads read only the `left` elements of each row still in k.
            unsafe {
                let av: [__m512bh; MR] = std::array::from_fn(|i| {
                    std::mem::transmute(_mm512_maskz_loadu_epi16(mask, a.add(i * lda + kk).cast()))
                });
                for j in 0..NR {
                    let bv: __m512bh = std::mem::transmute(_mm512_maskz_loadu_epi16(
                        mask,
                        b.add(j * ldb + kk).cast(),
                    ));
                    for i in 0..MR {
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], av[i], bv);
                    }
                }
            }
        }
        acc
    }

    /// # Safety
    /// The CPU must support AVX-512 F, BW and BF16; `dst` points to `m · n` writable
    /// elements (only written), `a` holds `m` rows at stride `lda` (even, at least k, zeros
    /// past k) and `b` `k` rows of `n` at stride `ldb`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn matmul(
        dst: *mut f32,
        (a, lda): (&[bf16], usize),
        (b, ldb): (&[bf16], usize),
        (m, n, k): (usize, usize, usize),
    ) {
        let product = Product {
            d: dst,
            n,
            a: a.as_ptr().cast(),
            lda,
            b: b.as_ptr().cast(),
            ldb,
            k,
        };
        // SAFETY: every tile of [m, n] lies inside the buffers (the caller's contract).
        unsafe {
            walk(
                &product,
                m,
                n,
                aligned_head(b.as_ptr(), ldb, n, Product::NR),
                Order::StripsOuter,
            )
        };
    }

    /// One product's operands, as the tiles read and write them.
    struct Product {
        d: *mut f32,
        n: usize,
        a: *const u16,
        lda: usize,
        b: *const u16,
        ldb: usize,
        k: usize,
    }

    impl RegisterTiles for Product {
        unsafe fn tile(&self, rows: usize, r0: usize, c0: usize, cols: usize) {
            // SAFETY: forwarded (the walk's contract).
            unsafe {
                by_rows!(
                    rows,
                    self.run(r0, c0, cols),
                    [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
                )
            }
        }
    }

    impl Product {
        /// The `ROWS × cols` tile at output `(r0, c0)`.
        ///
        /// # Safety
        /// As [`RegisterTiles::tile`].
        #[inline]
        unsafe fn run<const ROWS: usize>(&self, r0: usize, c0: usize, cols: usize) {
            // SAFETY: rows r0..r0+ROWS of `a` and `dst`, columns c0..c0+cols of `b` and `dst`
            // lie inside the buffers (the walk's contract); the instructions were checked by
            // `matmul`'s caller.
            unsafe {
                let strip = Strip {
                    b: self.b.add(c0),
                    ldb: self.ldb,
                    k: self.k,
                    cols,
                    next: self.b.wrapping_add(c0 + cols),
                };
                let d = self.d.add(r0 * self.n + c0);
                tile::<ROWS>(d, self.n, self.a.add(r0 * self.lda), self.lda, strip);
            }
        }
    }

    /// Up to 32 columns of `b [k, n]` starting at `b`, and where the next strip starts (past
    /// the end of `b` after the last: it is only prefetched).
    #[derive(Clone, Copy)]
    struct Strip {
        b: *const u16,
        ldb: usize,
        k: usize,
        cols: usize,
        next: *const u16,
    }

    /// `vpermt2w` indices interleaving two 32-element rows into pairs: columns 0..16, then
    /// 16..32 (index 32 + j selects the second row's element j).
    const LOW_PAIRS: [u16; 32] = pair_indices(0);
    const HIGH_PAIRS: [u16; 32] = pair_indices(16);

    const fn pair_indices(first: u16) -> [u16; 32] {
        let mut idx = [0u16; 32];
        let mut j = 0;
        while j < 16 {
            idx[2 * j] = first + j as u16;
            idx[2 * j + 1] = 32 + first + j as u16;
            j += 1;
        }
        idx
    }

    /// `ROWS × cols` outputs at `d` (row stride `ldd`): rows of `a` (stride `lda`) times the
    /// strip, all of k.
    ///
    /// # Safety
    /// As [`matmul`], for this tile's rows and columns.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const ROWS: usize>(
        d: *mut f32,
        ldd: usize,
        a: *const u16,
        lda: usize,
        strip: Strip,
    ) {
        let Strip {
            b,
            ldb,
            k,
            cols,
            next,
        } = strip;
        // Masked loads never touch the columns past `cols`, so the strip may end the buffer.
        let load_mask: __mmask32 = if cols == 32 { !0 } else { (1u32 << cols) - 1 };
        // SAFETY: the index tables are 32 u16 = 64 bytes, one unaligned load each.
        let (low, high) = unsafe {
            (
                _mm512_loadu_si512(LOW_PAIRS.as_ptr().cast()),
                _mm512_loadu_si512(HIGH_PAIRS.as_ptr().cast()),
            )
        };
        let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
        let pairs = k.div_ceil(2);
        for p in 0..pairs {
            // The next strip's rows into L2 while this strip's are multiplied: read down the
            // weights' rows a strip at a time, a strip's lines lie a row apart (often a page
            // apart), which the hardware prefetchers do not follow.
            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(2 * p * ldb).cast());
            _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add((2 * p + 1) * ldb).cast());
            // SAFETY: rows 2p and (when k is even or p is not the last pair) 2p + 1 of `b`
            // exist; the masked loads read only `cols` columns of them. `a` rows hold `lda`
            // ≥ 2·pairs elements, so the 32-bit pair at 2p is inside the row.
            unsafe {
                let even = _mm512_maskz_loadu_epi16(load_mask, b.add(2 * p * ldb).cast());
                let odd = if 2 * p + 1 < k {
                    _mm512_maskz_loadu_epi16(load_mask, b.add((2 * p + 1) * ldb).cast())
                } else {
                    _mm512_setzero_si512()
                };
                let lo: __m512bh = std::mem::transmute(_mm512_permutex2var_epi16(even, low, odd));
                let hi: __m512bh = std::mem::transmute(_mm512_permutex2var_epi16(even, high, odd));
                for r in 0..ROWS {
                    let pair = a.add(r * lda + 2 * p).cast::<i32>().read_unaligned();
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, lo);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, hi);
                }
            }
        }
        let low_cols = cols.min(16);
        let high_cols = cols.saturating_sub(16);
        let mask = |n: usize| -> __mmask16 { if n == 16 { !0 } else { (1u16 << n) - 1 } };
        for r in 0..ROWS {
            // SAFETY: row r of the tile has `cols` outputs at d + r·ldd; the masked stores
            // write only those.
            unsafe {
                let row = d.add(r * ldd);
                _mm512_mask_storeu_ps(row, mask(low_cols), acc[r][0]);
                if high_cols > 0 {
                    _mm512_mask_storeu_ps(row.add(16), mask(high_cols), acc[r][1]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact f64 product of the bf16 operands, and the sum of its terms' magnitudes.
    fn product(
        a: &[bf16],
        lda: usize,
        b: &[bf16],
        (m, n, k): (usize, usize, usize),
    ) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0, 0.0); m * n];
        for r in 0..m {
            for c in 0..n {
                let terms = (0..k).map(|j| a[r * lda + j].to_f64() * b[j * n + c].to_f64());
                out[r * n + c] = terms.fold((0.0, 0.0), |(s, abs), x| (s + x, abs + x.abs()));
            }
        }
        out
    }

    #[test]
    fn products_match_the_exact_product_on_ragged_shapes() {
        if !available() {
            return;
        }
        let mut seed = 12345u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bf16::from_f32(((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        };
        // Every row-tile remainder, column tails below and above 16, odd and even k.
        for (m, n, k) in [
            (1usize, 1usize, 1usize),
            (13, 33, 7),
            (25, 48, 64),
            (12, 17, 2),
            (7, 100, 129),
        ] {
            let lda = k.next_multiple_of(2) + 2;
            let mut a: Vec<bf16> = (0..m * lda).map(|_| next()).collect();
            for row in a.chunks_mut(lda) {
                row[k..].fill(bf16::ZERO);
            }
            let b: Vec<bf16> = (0..k * n).map(|_| next()).collect();
            let mut dst = vec![f32::NAN; m * n];
            matmul_bf16(&mut dst, (&a, lda), (&b, n), (m, n, k));
            for (got, (want, magnitude)) in dst.iter().zip(product(&a, lda, &b, (m, n, k))) {
                // k exact products summed in f32: within k·ε of the terms' magnitudes.
                let tolerance = k as f64 * f32::EPSILON as f64 * magnitude;
                assert!(
                    (*got as f64 - want).abs() <= tolerance,
                    "{m}x{n}x{k}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn dot_product_form_matches_the_exact_product_on_ragged_shapes() {
        if !available() {
            return;
        }
        let value = |i: usize| bf16::from_f32(((i * 37 + 11) % 23) as f32 / 11.0 - 1.0);
        // Full 4 × 4 tiles with ragged edges, k below, at and past one 32-element step.
        for (m, n, k) in [(1, 1, 1), (4, 4, 32), (9, 6, 33), (5, 13, 70), (12, 8, 7)] {
            let a: Vec<bf16> = (0..m * k).map(value).collect();
            let b: Vec<bf16> = (0..n * k).map(|i| value(i * 3 + 1)).collect();
            // `product` takes `b [k, n]`: the transpose of this `b [n, k]`.
            let b_t: Vec<bf16> = (0..k * n).map(|at| b[(at % n) * k + at / n]).collect();
            let mut dst = vec![f32::NAN; m * n];
            matmul_bf16_nt((&mut dst, n), (&a, k), (&b, k), (m, n, k));
            for (got, (want, magnitude)) in dst.iter().zip(product(&a, k, &b_t, (m, n, k))) {
                let tolerance = k as f64 * f32::EPSILON as f64 * magnitude;
                assert!(
                    (*got as f64 - want).abs() <= tolerance,
                    "{m}x{n}x{k}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_where_b_lies() {
        if !available() {
            return;
        }
        // n a multiple of a cache line's 32 bf16, so every misalignment of b shifts the strips.
        let (m, n, k) = (13, 96, 20);
        let a: Vec<bf16> = (0..m * k)
            .map(|i| bf16::from_f32((i % 7) as f32 / 3.0 - 1.0))
            .collect();
        let b: Vec<bf16> = (0..k * n)
            .map(|i| bf16::from_f32(((i * 13) % 11) as f32 / 5.0 - 1.0))
            .collect();
        let mut shifted = vec![bf16::ZERO; b.len() + 32];
        let mut first: Option<Vec<f32>> = None;
        for skip in 0..32 {
            shifted[skip..skip + b.len()].copy_from_slice(&b);
            let mut dst = vec![f32::NAN; m * n];
            matmul_bf16(
                &mut dst,
                (&a, k),
                (&shifted[skip..skip + b.len()], n),
                (m, n, k),
            );
            let bits: Vec<u32> = dst.iter().map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(dst),
                Some(first) => assert_eq!(
                    bits,
                    first.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "b {skip} elements further"
                ),
            }
        }
    }

    #[test]
    fn bad_strides_and_short_buffers_panic_before_any_access() {
        if !available() {
            return;
        }
        let a = vec![bf16::ONE; 8];
        let b = vec![bf16::ONE; 8];
        let mut dst = vec![0f32; 4];
        let odd = std::panic::catch_unwind(move || {
            let mut dst = vec![0f32; 4];
            matmul_bf16(
                &mut dst,
                (&[bf16::ONE; 6], 3),
                (&[bf16::ONE; 6], 2),
                (2, 2, 3),
            );
        });
        assert!(odd.is_err());
        let short = std::panic::catch_unwind(move || {
            let mut dst = vec![0f32; 3];
            matmul_bf16(
                &mut dst,
                (&[bf16::ONE; 8], 4),
                (&[bf16::ONE; 8], 2),
                (2, 2, 4),
            );
        });
        assert!(short.is_err());
        matmul_bf16(&mut dst, (&a, 4), (&b, 2), (2, 2, 4));
        assert_eq!(dst, [4.0; 4]);
    }
}
