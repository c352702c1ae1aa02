//! `dst [m, n] (+)= a [m, k] · b [k, n]` in f32 on AVX-512 register tiles read straight from
//! the operands, without packed copies: the products of small inner dimensions (an expert's
//! `[m, H] · [H, 2I]` at H ≤ 512, its `[m, I] · [I, H]`), where packing both operands costs
//! as much as the product.
//!
//! Each 12 × 32 tile of `dst` is 24 accumulators; every step along k loads 32 columns of one
//! row of `b` and broadcasts one element of each of the tile's 12 rows of `a`. Column strips of
//! `b` are the outer loop, so a strip (k · 128 bytes) stays in cache while every row tile of
//! `a` passes it. Each output is the sum over k in ascending order, one fused multiply-add per
//! term, starting from zero or from `dst`: the order depends only on k.

/// Whether this CPU runs [`matmul`] (AVX-512 F).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The operands of one product: `a(r, p) = a[r · a_rows + p · a_cols]`, `b(p, c) =
/// b[p · ldb + c]` (unit column stride), `dst(r, c) = dst[r · n + c]`.
#[derive(Clone, Copy, Debug)]
pub struct Operands<'a> {
    pub a: &'a [f32],
    pub a_rows: usize,
    pub a_cols: usize,
    pub b: &'a [f32],
    pub ldb: usize,
}

/// `dst [m, n] = a · b`, or `dst += a · b` when `accumulate`.
///
/// # Panics
/// If the CPU lacks AVX-512 F ([`available`]) or an operand's last element lies past its
/// buffer.
pub fn matmul(
    dst: &mut [f32],
    ops: Operands<'_>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    assert!(available(), "f32_tiles::matmul needs AVX-512 F");
    if m == 0 || n == 0 {
        return;
    }
    let last = |rows: usize, row_stride: usize, cols: usize, col_stride: usize| {
        (rows - 1)
            .checked_mul(row_stride)
            .zip((cols - 1).checked_mul(col_stride))
            .and_then(|(r, c)| r.checked_add(c))
    };
    assert!(
        dst.len() >= m * n
            && (k == 0
                || (last(m, ops.a_rows, k, ops.a_cols).is_some_and(|i| i < ops.a.len())
                    && last(k, ops.ldb, n, 1).is_some_and(|i| i < ops.b.len()))),
        "operand too short for its shape"
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512 F was checked above; every element the shapes and strides reach lies
    // inside its buffer (checked above).
    unsafe {
        x86::matmul(dst, ops, (m, n, k), accumulate);
    }
}

// Register tiles are indexed by (row, register), as in the formulas.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Operands;

    /// Columns per register tile: two 16-lane accumulators per row.
    const NR: usize = 32;
    /// Rows per register tile: 24 accumulators, 2 registers of `b` and a broadcast.
    const MR: usize = 12;

    /// # Safety
    /// The CPU must support AVX-512 F; `dst` holds `m · n` elements and `ops` reaches only
    /// inside its buffers for these shapes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul(
        dst: &mut [f32],
        ops: Operands<'_>,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
    ) {
        for c0 in (0..n).step_by(NR) {
            let cols = (n - c0).min(NR);
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(MR);
                // SAFETY: rows r0..r0+rows of `a` and `dst`, columns c0..c0+cols of `b` and
                // `dst` lie inside the buffers (the caller's contract).
                unsafe {
                    let tile = Tile {
                        d: dst.as_mut_ptr().add(r0 * n + c0),
                        ldd: n,
                        // Never read when k = 0, so computed without an in-bounds promise.
                        a: ops.a.as_ptr().wrapping_add(r0 * ops.a_rows),
                        a_rows: ops.a_rows,
                        a_cols: ops.a_cols,
                        b: ops.b.as_ptr().wrapping_add(c0),
                        ldb: ops.ldb,
                        k,
                        cols,
                        accumulate,
                    };
                    match rows {
                        12 => tile.run::<12>(),
                        11 => tile.run::<11>(),
                        10 => tile.run::<10>(),
                        9 => tile.run::<9>(),
                        8 => tile.run::<8>(),
                        7 => tile.run::<7>(),
                        6 => tile.run::<6>(),
                        5 => tile.run::<5>(),
                        4 => tile.run::<4>(),
                        3 => tile.run::<3>(),
                        2 => tile.run::<2>(),
                        _ => tile.run::<1>(),
                    }
                }
                r0 += rows;
            }
        }
    }

    /// Up to `MR` rows by up to 32 columns of `dst`, with the rows of `a` and the columns of
    /// `b` they need.
    struct Tile {
        d: *mut f32,
        ldd: usize,
        a: *const f32,
        a_rows: usize,
        a_cols: usize,
        b: *const f32,
        ldb: usize,
        k: usize,
        cols: usize,
        accumulate: bool,
    }

    impl Tile {
        /// # Safety
        /// As [`matmul`], for this tile's `ROWS` rows and `cols` columns.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const ROWS: usize>(&self) {
            let mask = |n: usize| -> __mmask16 { if n >= 16 { !0 } else { (1u16 << n) - 1 } };
            // Masked loads and stores never touch the columns past `cols`.
            let (low, high) = (mask(self.cols), mask(self.cols.saturating_sub(16)));
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            if self.accumulate {
                for r in 0..ROWS {
                    // SAFETY: row r of the tile has `cols` outputs at d + r·ldd.
                    unsafe {
                        let row = self.d.add(r * self.ldd);
                        acc[r][0] = _mm512_maskz_loadu_ps(low, row);
                        // With `cols` ≤ 16 the mask is empty and nothing is read there.
                        acc[r][1] = _mm512_maskz_loadu_ps(high, row.wrapping_add(16));
                    }
                }
            }
            for p in 0..self.k {
                // SAFETY: row p of `b` has `cols` columns at b + p·ldb; element (r, p) of `a`
                // is at a + r·a_rows + p·a_cols for the tile's rows.
                unsafe {
                    let b = self.b.add(p * self.ldb);
                    let b0 = _mm512_maskz_loadu_ps(low, b);
                    let b1 = _mm512_maskz_loadu_ps(high, b.wrapping_add(16));
                    let a = self.a.add(p * self.a_cols);
                    for r in 0..ROWS {
                        let av = _mm512_set1_ps(*a.add(r * self.a_rows));
                        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
                    }
                }
            }
            for r in 0..ROWS {
                // SAFETY: as the loads above.
                unsafe {
                    let row = self.d.add(r * self.ldd);
                    _mm512_mask_storeu_ps(row, low, acc[r][0]);
                    if self.cols > 16 {
                        _mm512_mask_storeu_ps(row.add(16), high, acc[r][1]);
                    }
                }
            }
        }
    }
}
