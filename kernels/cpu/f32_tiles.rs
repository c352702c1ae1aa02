//! `dst [m, n] (+)= a [m, k] · b [k, n]` in f32 on AVX-512 register tiles read straight from
//! the operands, without packed copies: the products of small inner dimensions (an expert's
//! `[m, H] · [H, 2I]` at H ≤ 512, its `[m, I] · [I, H]`), where packing both operands costs
//! as much as the product.
//!
//! A tile holds 24 accumulators, in one of two [`TileShape`]s: 12 rows × 32 columns (two
//! registers per row) or 6 rows × 64 columns (four). Every step along k loads one row of the
//! tile's columns of `b` and broadcasts one element of each of the tile's rows of `a`. The
//! caller chooses the [`Order`] of the tiles: column strips of `b` outer, so a strip (k · 4 ·
//! columns bytes) stays in cache while every row tile of `a` passes it, or row tiles outer, so
//! a tile's rows of `a` stay in L1 while `b` streams from L2. Each output is the sum over k in
//! ascending order, one fused multiply-add per term, starting from zero or from `dst`: the
//! order depends only on k, in either walk and either shape.

use std::mem::MaybeUninit;

use super::isa::Isa;
pub use super::tile_walk::Order;

/// The register tile's rows × columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileShape {
    /// 12 rows × 32 columns: each step along k reads 128 bytes of `b` per 12 rows.
    Tall,
    /// 6 rows × 64 columns: 256 bytes of `b` per 6 rows, and half as many passes of a's rows
    /// over `b`'s strips.
    Wide,
}

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

/// `dst [m, n] = a · b`, or `dst += a · b` when `accumulate`, on tiles of `shape` walked in
/// `order`.
///
/// # Panics
/// If the CPU lacks AVX-512 F ([`available`]) or an operand's last element lies past its
/// buffer.
pub fn matmul(
    dst: &mut [f32],
    ops: Operands<'_>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    (shape, order): (TileShape, Order),
) {
    check(dst.len(), ops, (m, n, k));
    // SAFETY: checked: AVX-512 F, and every element the shapes and strides reach lies inside
    // its buffer; `dst` is initialised, as `accumulate` reads it.
    unsafe { run(dst.as_mut_ptr(), ops, (m, n, k), accumulate, (shape, order)) };
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
    walk: (TileShape, Order),
) -> &'d mut [f32] {
    assert_eq!(
        Some(dst.len()),
        m.checked_mul(n),
        "destination is not [m, n]"
    );
    check(dst.len(), ops, (m, n, k));
    // SAFETY: checked as in `matmul`; without `accumulate` no tile reads `dst`.
    unsafe { run(dst.as_mut_ptr().cast(), ops, (m, n, k), false, walk) };
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
    walk: (TileShape, Order),
) {
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded (the caller's contract).
    unsafe {
        x86::matmul(dst, ops, (m, n, k), accumulate, walk);
    }
}

// Register tiles are indexed by (row, register), as in the formulas.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Operands, Order, TileShape};
    use crate::cpu::tile_walk::{RegisterTiles, aligned_head, by_rows, walk};

    /// # Safety
    /// The CPU must support AVX-512 F; `dst` points to `m · n` writable elements (initialised
    /// when `accumulate`) and `ops` reaches only inside its buffers for these shapes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn matmul(
        dst: *mut f32,
        ops: Operands<'_>,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
        (shape, order): (TileShape, Order),
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
            match shape {
                TileShape::Tall => {
                    let head = aligned_head(ops.b.as_ptr(), ops.ldb, n, Tiles::<2>::NR);
                    walk(&Tiles::<2>(&product), m, n, head, order);
                }
                TileShape::Wide => {
                    // Whole strips from the first column, wherever `b` starts: measured on
                    // Zen 4 (qwen3-moe-small `blockwise_mm`, T = 2048, weights 16 bytes past
                    // a line), a head strip that lined the others up took 11.4–11.6 ms
                    // against 9.9–10.0 without it.
                    walk(&Tiles::<4>(&product), m, n, 0, order);
                }
            }
        }
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

    /// [`Product`]'s tiles of `REGS` registers (16 columns each) per row.
    struct Tiles<'p, const REGS: usize>(&'p Product);

    impl RegisterTiles for Tiles<'_, 2> {
        unsafe fn tile(&self, rows: usize, r0: usize, c0: usize, cols: usize) {
            // SAFETY: forwarded (the walk's contract); AVX-512 F was checked by `matmul`'s
            // caller.
            unsafe {
                by_rows!(
                    rows,
                    self.rows(r0, c0, cols),
                    [12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
                )
            }
        }
    }

    impl RegisterTiles for Tiles<'_, 4> {
        const MR: usize = 6;
        const NR: usize = 64;

        unsafe fn tile(&self, rows: usize, r0: usize, c0: usize, cols: usize) {
            // SAFETY: as for the tall tiles.
            unsafe { by_rows!(rows, self.rows(r0, c0, cols), [6, 5, 4, 3, 2, 1]) }
        }
    }

    impl<const REGS: usize> Tiles<'_, REGS> {
        /// [`Product::run`] on this shape's tiles.
        ///
        /// # Safety
        /// As [`Product::run`].
        #[inline]
        unsafe fn rows<const ROWS: usize>(&self, r0: usize, c0: usize, cols: usize) {
            // SAFETY: forwarded.
            unsafe { self.0.run::<ROWS, REGS>(r0, c0, cols) }
        }
    }

    impl Product {
        /// The `ROWS × cols` tile at output `(r0, c0)`, `cols` ≤ 16 · `REGS`: the sum over k
        /// of `a`'s rows times `b`'s columns, from zero or from `dst`.
        ///
        /// # Safety
        /// As [`matmul`], for this tile's `ROWS` rows and `cols` columns.
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn run<const ROWS: usize, const REGS: usize>(
            &self,
            r0: usize,
            c0: usize,
            cols: usize,
        ) {
            debug_assert!(cols <= 16 * REGS, "a tile wider than its registers");
            let d = self.d.wrapping_add(r0 * self.ldd + c0);
            // Never read when k = 0, so computed without an in-bounds promise.
            let a_rows = self.a.wrapping_add(r0 * self.a_rows);
            let b_cols = self.b.wrapping_add(c0);
            // Masked loads and stores never touch the columns past `cols`: register j holds
            // columns 16j.. of the tile, and its mask is empty where the tile is narrower.
            // (Plain loops: built with `std::array::from_fn`, the registers went through memory
            // and the kernel ran at less than half its speed.)
            let mut masks: [__mmask16; REGS] = [0; REGS];
            for (j, mask) in masks.iter_mut().enumerate() {
                let n = cols.saturating_sub(16 * j);
                *mask = if n >= 16 { !0 } else { (1u16 << n) - 1 };
            }
            let mut acc = [[_mm512_setzero_ps(); REGS]; ROWS];
            if self.accumulate {
                for r in 0..ROWS {
                    for j in 0..REGS {
                        // SAFETY: row r of the tile has `cols` outputs at d + r·ldd; an empty
                        // mask reads nothing.
                        acc[r][j] = unsafe {
                            _mm512_maskz_loadu_ps(masks[j], d.wrapping_add(r * self.ldd + 16 * j))
                        };
                    }
                }
            }
            // The next strip's rows (64 · REGS bytes each) into L2 while this strip's are
            // multiplied: a strip's lines lie a row apart, which the hardware prefetchers do
            // not follow (a long k with few rows reads each strip from memory once; see
            // `matmul`).
            let next = b_cols.wrapping_add(cols);
            for p in 0..self.k {
                for j in 0..REGS {
                    _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(p * self.ldb + 16 * j).cast());
                }
                // SAFETY: row p of `b` has `cols` columns at b + p·ldb (an empty mask reads
                // nothing); element (r, p) of `a` is at a + r·a_rows + p·a_cols for the tile's
                // rows.
                unsafe {
                    let b = b_cols.add(p * self.ldb);
                    let mut bv = [_mm512_setzero_ps(); REGS];
                    for j in 0..REGS {
                        bv[j] = _mm512_maskz_loadu_ps(masks[j], b.wrapping_add(16 * j));
                    }
                    let a = a_rows.add(p * self.a_cols);
                    for r in 0..ROWS {
                        let av = _mm512_set1_ps(*a.add(r * self.a_rows));
                        for j in 0..REGS {
                            acc[r][j] = _mm512_fmadd_ps(av, bv[j], acc[r][j]);
                        }
                    }
                }
            }
            for r in 0..ROWS {
                for j in 0..REGS {
                    if cols > 16 * j {
                        // SAFETY: as the loads above.
                        unsafe {
                            _mm512_mask_storeu_ps(
                                d.add(r * self.ldd + 16 * j),
                                masks[j],
                                acc[r][j],
                            );
                        }
                    }
                }
            }
        }
    }
}
