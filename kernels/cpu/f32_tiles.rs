//! `dst [m, n] (+)= a [m, k] · b [k, n]` in f32 on AVX-512 register tiles read straight from
//! the operands, without packed copies: the products of small inner dimensions (an expert's
//! `[m, H] · [H, 2I]` at H ≤ 512, its `[m, I] · [I, H]`), where packing both operands costs
//! as much as the product.
//!
//! Each 12 × 32 tile of `dst` is 24 accumulators; every step along k loads 32 columns of one
//! row of `b` and broadcasts one element of each of the tile's 12 rows of `a`. The caller
//! chooses the [`Order`] of the tiles: column strips of `b` outer, so a strip (k · 128 bytes)
//! stays in cache while every row tile of `a` passes it, or row tiles outer, so a tile's rows of
//! `a` stay in L1 while `b` streams from L2. Each output is the sum over k in ascending order,
//! one fused multiply-add per term, starting from zero or from `dst`: the order depends only on
//! k, in either walk.

use std::mem::MaybeUninit;

use super::isa::Isa;
pub use super::tile_walk::Order;

/// Whether [`matmul`] runs here: the active level has AVX-512 F.
pub fn available() -> bool {
    Isa::Avx512.enabled()
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

/// `dst [m, n] = a · b`, or `dst += a · b` when `accumulate`, its tiles walked in `order`.
///
/// # Panics
/// If the CPU lacks AVX-512 F ([`available`]) or an operand's last element lies past its
/// buffer.
pub fn matmul(
    dst: &mut [f32],
    ops: Operands<'_>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    order: Order,
) {
    check(dst.len(), ops, (m, n, k));
    // SAFETY: checked: AVX-512 F, and every element the shapes and strides reach lies inside
    // its buffer; `dst` is initialised, as `accumulate` reads it.
    unsafe { run(dst.as_mut_ptr(), ops, (m, n, k), accumulate, order) };
}

/// `dst [m, n] = a · b` into memory not yet written; returns `dst` as the values it now holds.
/// The tiles start from zero and store every element, so nothing clears `dst` first.
///
/// # Panics
/// As [`matmul`], and if `dst` is not `m · n` long.
pub fn matmul_into<'d>(
    dst: &'d mut [MaybeUninit<f32>],
    ops: Operands<'_>,
    (m, n, k): (usize, usize, usize),
    order: Order,
) -> &'d mut [f32] {
    assert_eq!(
        Some(dst.len()),
        m.checked_mul(n),
        "destination is not [m, n]"
    );
    check(dst.len(), ops, (m, n, k));
    // SAFETY: checked as in `matmul`; without `accumulate` no tile reads `dst`.
    unsafe { run(dst.as_mut_ptr().cast(), ops, (m, n, k), false, order) };
    // SAFETY: the tiles wrote all m · n elements, which are all of `dst` (asserted);
    // `MaybeUninit<f32>` has `f32`'s layout.
    unsafe { &mut *(std::ptr::from_mut(dst) as *mut [f32]) }
}

/// Asserts what [`run`] needs: AVX-512 F, `dst_len ≥ m · n`, and every element of `a` and `b`
/// the shapes reach inside its buffer.
fn check(dst_len: usize, ops: Operands<'_>, (m, n, k): (usize, usize, usize)) {
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
        dst_len >= m * n
            && (k == 0
                || (last(m, ops.a_rows, k, ops.a_cols).is_some_and(|i| i < ops.a.len())
                    && last(k, ops.ldb, n, 1).is_some_and(|i| i < ops.b.len()))),
        "operand too short for its shape"
    );
}

/// The product on the tiles, `dst` row-major `[m, n]`.
///
/// # Safety
/// [`check`] passed for these operands and shapes; `dst` points to `m · n` writable elements,
/// initialised when `accumulate`.
unsafe fn run(
    dst: *mut f32,
    ops: Operands<'_>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    order: Order,
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded (the caller's contract).
    unsafe {
        x86::matmul(dst, ops, (m, n, k), accumulate, order);
    }
}

// Register tiles are indexed by (row, register), as in the formulas.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Operands, Order};
    use crate::cpu::tile_walk::{RegisterTiles, aligned_head, walk};

    /// # Safety
    /// The CPU must support AVX-512 F; `dst` points to `m · n` writable elements (initialised
    /// when `accumulate`) and `ops` reaches only inside its buffers for these shapes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul(
        dst: *mut f32,
        ops: Operands<'_>,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
        order: Order,
    ) {
        let product = Product {
            d: dst,
            ldd: n,
            a: ops.a.as_ptr(),
            a_rows: ops.a_rows,
            a_cols: ops.a_cols,
            b: ops.b.as_ptr(),
            ldb: ops.ldb,
            k,
            accumulate,
        };
        // SAFETY: every tile of [m, n] lies inside the buffers (the caller's contract).
        unsafe {
            walk(
                &product,
                m,
                n,
                aligned_head(ops.b.as_ptr(), ops.ldb, n),
                order,
            )
        };
    }

    /// One product's operands, as the tiles read and write them.
    struct Product {
        d: *mut f32,
        ldd: usize,
        a: *const f32,
        a_rows: usize,
        a_cols: usize,
        b: *const f32,
        ldb: usize,
        k: usize,
        accumulate: bool,
    }

    impl RegisterTiles for Product {
        unsafe fn tile<const ROWS: usize>(&self, r0: usize, c0: usize, cols: usize) {
            // SAFETY: forwarded (the walk's contract); AVX-512 F was checked by `matmul`'s
            // caller.
            unsafe { self.run::<ROWS>(r0, c0, cols) }
        }
    }

    impl Product {
        /// The `ROWS × cols` tile at output `(r0, c0)`: the sum over k of `a`'s rows times
        /// `b`'s columns, from zero or from `dst`.
        ///
        /// # Safety
        /// As [`matmul`], for this tile's `ROWS` rows and `cols` columns.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const ROWS: usize>(&self, r0: usize, c0: usize, cols: usize) {
            let d = self.d.wrapping_add(r0 * self.ldd + c0);
            // Never read when k = 0, so computed without an in-bounds promise.
            let a_rows = self.a.wrapping_add(r0 * self.a_rows);
            let b_cols = self.b.wrapping_add(c0);
            let mask = |n: usize| -> __mmask16 { if n >= 16 { !0 } else { (1u16 << n) - 1 } };
            // Masked loads and stores never touch the columns past `cols`.
            let (low, high) = (mask(cols), mask(cols.saturating_sub(16)));
            let mut acc = [[_mm512_setzero_ps(); 2]; ROWS];
            if self.accumulate {
                for r in 0..ROWS {
                    // SAFETY: row r of the tile has `cols` outputs at d + r·ldd.
                    unsafe {
                        let row = d.add(r * self.ldd);
                        acc[r][0] = _mm512_maskz_loadu_ps(low, row);
                        // With `cols` ≤ 16 the mask is empty and nothing is read there.
                        acc[r][1] = _mm512_maskz_loadu_ps(high, row.wrapping_add(16));
                    }
                }
            }
            // The next strip's rows (two lines each) into L2 while this strip's are multiplied:
            // a strip's lines lie a row apart, which the hardware prefetchers do not follow
            // (a long k with few rows reads each strip from memory once; see `matmul`).
            let next = b_cols.wrapping_add(cols);
            for p in 0..self.k {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(p * self.ldb).cast());
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(p * self.ldb + 16).cast());
                // SAFETY: row p of `b` has `cols` columns at b + p·ldb; element (r, p) of `a`
                // is at a + r·a_rows + p·a_cols for the tile's rows.
                unsafe {
                    let b = b_cols.add(p * self.ldb);
                    let b0 = _mm512_maskz_loadu_ps(low, b);
                    let b1 = _mm512_maskz_loadu_ps(high, b.wrapping_add(16));
                    let a = a_rows.add(p * self.a_cols);
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
                    let row = d.add(r * self.ldd);
                    _mm512_mask_storeu_ps(row, low, acc[r][0]);
                    if cols > 16 {
                        _mm512_mask_storeu_ps(row.add(16), high, acc[r][1]);
                    }
                }
            }
        }
    }
}
