//! Safe f32 matrix products over strided views: on AVX-512 register tiles read straight from
//! the operands ([`f32_tiles`]) when the inner dimension and the output's width are small and
//! `a` is row-major (or `a` has few rows and a long inner dimension), `b`'s rows are
//! contiguous, and the CPU's [`Blocking`] gives the tiles that many rows of `a`;
//! otherwise on packed panels: the `gemm` crate's AVX-512 or AVX2+FMA microkernels under
//! [`streamed`]'s driver when `b`'s rows or columns are contiguous (`a` is read in place,
//! row-major or transposed), else the `gemm` crate's own driver (AVX-512 or AVX2+FMA chosen at
//! run time, portable fallback otherwise).
//!
//! Every call runs single-threaded: the cpu backend parallelises over experts and row tiles
//! itself, so the summation order of every output element depends only on the operands' shapes,
//! never on the thread count.

use std::mem::MaybeUninit;

use half::bf16;

use super::blocking::{Blocking, l2_cache_bytes};
use super::{f32_tiles, streamed};
use crate::uninit::zero;

/// Largest inner dimension k that [`matmul`] runs on register tiles without packing: a tile's
/// rows of `a` (up to 24 KiB) stay in L1 and a strip of `b` (up to 64 KiB, 128 KiB for the
/// wide tiles) in L2.
const TILED_MAX_K: usize = 512;
/// Widest output that [`matmul`] runs on register tiles: the tiles walk the output one strip
/// of columns at a time, which wide outputs pay for in cache and TLB misses.
///
/// Measured on Zen 4, one thread, against the `gemm` crate's packed kernels (m × k × n):
/// 256×256×256 at 96 against 54–64 GFLOP/s, 256×256×512 at 93 against 68–78, 256×128×768 at
/// 86–90 against 72–82; but 768×32×2048 at 56 against 71–85 and 128×512×1536 at 75–78
/// against 77–86, so wider outputs and longer k stay on the packed kernels.
const TILED_MAX_N: usize = 768;

/// Largest step along k, in elements, of an `a` that is not row-major (a transposed `xᵀ` in a
/// weight gradient) that [`streamed`] reads in place. Longer steps put the rows its
/// microkernels walk into few L1 sets (4 KiB apart: all in one), and the `gemm` crate's driver,
/// which packs `a`, runs faster. Measured on the Intel Xeon (Emerald Rapids class): Qwen3-30B-A3B
/// `blockwise_mm_bwd` f32 at T = 2048 (steps of 2048 and 768) 1475 ms packed against 1555–1564
/// in place; qwen3-moe-small (steps of 256) 20.0 ms in place against 21.5 packed.
const TRANSPOSED_A_MAX_STRIDE: usize = 512;

/// A read-only f32 matrix: element `(r, c)` is `data[r * row_stride + c * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
    /// Whether the caller has just written the matrix, so it is in the core's caches
    /// ([`Self::resident`]).
    resident: bool,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// If `data` holds fewer than `rows · cols` elements.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        assert!(
            rows.checked_mul(cols).is_some_and(|len| len <= data.len()),
            "matrix view reaches past its buffer"
        );
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
            resident: false,
        }
    }

    /// The view, marked as just written by the caller and so in the caches (a weight
    /// gradient's activation gradients): as `b` of a product on the register tiles, it is then
    /// read by every row tile in turn while each tile's rows of `a` stay in L1 ([`tile_order`]).
    pub fn resident(self) -> Self {
        Self {
            resident: true,
            ..self
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Columns `range` of the view.
    ///
    /// # Panics
    /// If the range reaches past the last column.
    pub fn columns(self, range: std::ops::Range<usize>) -> Self {
        assert!(range.end <= self.cols, "columns past the view");
        let offset = if range.is_empty() || self.rows == 0 {
            0
        } else {
            range.start * self.col_stride
        };
        Self {
            data: &self.data[offset..],
            cols: range.len(),
            ..self
        }
    }

    /// The transpose, as a view of the same buffer.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// `dst [m, n] = a [m, k] · b [k, n]`, or `dst += a · b` when `accumulate`; `dst` is contiguous
/// row-major.
///
/// # Panics
/// If the inner dimensions disagree or `dst` is not `m · n` long.
pub fn matmul(dst: &mut [f32], a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = product_shape(dst.len(), a, b);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return;
    }
    if tiled(a, b) {
        f32_tiles::matmul(dst, tile_operands(a, b), (m, n, k), accumulate, tiling(b));
        return;
    }
    // SAFETY: `dst` holds exactly m · n elements, borrowed mutably, so it aliases neither
    // operand.
    unsafe { packed_product(dst.as_mut_ptr(), a, b, accumulate) };
}

/// `dst [m, n] = a [m, k] · b [k, n]` into memory not yet written (`dst` contiguous row-major);
/// returns `dst` as the values it now holds. Products on the packed kernels write every element
/// without reading it first, so no clearing pass precedes them.
///
/// # Panics
/// If the inner dimensions disagree or `dst` is not `m · n` long.
pub fn matmul_into<'d>(
    dst: &'d mut [MaybeUninit<f32>],
    a: MatRef<'_>,
    b: MatRef<'_>,
) -> &'d mut [f32] {
    let (m, k, n) = product_shape(dst.len(), a, b);
    if tiled(a, b) {
        return f32_tiles::matmul_into(dst, tile_operands(a, b), (m, n, k), tiling(b));
    }
    if m == 0 || n == 0 || k == 0 {
        let dst = zero(dst);
        matmul(dst, a, b, false);
        return dst;
    }
    // SAFETY: `dst` holds exactly m · n elements, borrowed mutably, so it aliases neither
    // operand; without `accumulate` the packed kernels write the first block of the inner
    // dimension into `dst` before they read it back for the next.
    unsafe { packed_product(dst.as_mut_ptr().cast(), a, b, false) };
    // SAFETY: the product wrote all m · n elements, and `MaybeUninit<f32>` has `f32`'s layout.
    unsafe { &mut *(std::ptr::from_mut(dst) as *mut [f32]) }
}

/// `(m, k, n)` of `a [m, k] · b [k, n]` into a destination of `dst_len` elements.
///
/// # Panics
/// If the inner dimensions disagree or `dst_len` is not `m · n`.
fn product_shape(dst_len: usize, a: MatRef<'_>, b: MatRef<'_>) -> (usize, usize, usize) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    assert_eq!(b.rows, k, "inner dimensions differ");
    assert_eq!(Some(dst_len), m.checked_mul(n), "destination is not [m, n]");
    (m, k, n)
}

/// `a · b` as the register tiles read it (`b` with unit column stride: see [`tiled`]).
fn tile_operands<'a>(a: MatRef<'a>, b: MatRef<'a>) -> f32_tiles::Operands<'a> {
    f32_tiles::Operands {
        a: a.data,
        a_rows: a.row_stride,
        a_cols: a.col_stride,
        b: b.data,
        ldb: b.row_stride,
    }
}

/// Most rows of `a` that [`matmul`] runs on register tiles at any k past [`TILED_MAX_K`] and
/// any n: each strip of `b` then serves so few rows that packing it costs more than the tiles
/// lose by reading it as stored (they prefetch the next strip meanwhile). Measured on Zen 4
/// with `moekit bench` (Qwen3-30B-A3B `blockwise_mm`, f32, experts of about 32 tokens at T =
/// 512, 64 at T = 1024 and 128 at T = 2048): 235 against 285 ms at T = 512, but 982 against
/// 805 ms at T = 2048 with every m on the tiles. Short k (a weight gradient's few tokens) with
/// a wide n stays on the packed kernels: 640 against 613 ms for `blockwise_mm_bwd` at T = 512.
const TILED_LONG_K_MAX_M: usize = 64;

/// Whether [`matmul`] runs `a · b` on the register tiles: small k and n with `a` row-major, or
/// a long k with few rows of `a`, here, and as many rows of `a` as the CPU's [`Blocking`] gives
/// them.
///
/// A transposed `a` (a weight gradient's `xᵀ`, read down its columns) takes the packed kernels
/// at small k and n too. Measured on Zen 4, `dW = xᵀ · d y` at 256 × m × 256 (m = 128–256),
/// one thread, operands in cache: 104–108 against 95–100 GFLOP/s; inside `moekit-train bench
/// --config configs/qwen3_moe_small.toml` (the two paths on alternate steps of one process, 80
/// steps each, `blockwise_mm_bwd` timed per call): 23.9 against 24.5 and 25.8 against 26.8 ms.
fn tiled(a: MatRef<'_>, b: MatRef<'_>) -> bool {
    let small = a.cols <= TILED_MAX_K && b.cols <= TILED_MAX_N && a.col_stride == 1;
    let few_rows_long_k = a.rows <= TILED_LONG_K_MAX_M && a.cols > TILED_MAX_K;
    (small || few_rows_long_k)
        && b.col_stride == 1
        && f32_tiles::available()
        && Blocking::active().register_tiles_for(a.rows)
}

/// The shape and order of the register tiles of `a · b`: [`tile_order`]; tiles of the CPU's
/// [`Blocking::streamed_tile_shape`] where strips of `b` stream through them over a short
/// inner dimension (an expert's weights, k ≤ [`TILED_MAX_K`]), tall 12 × 32 tiles otherwise.
fn tiling(b: MatRef<'_>) -> (f32_tiles::TileShape, f32_tiles::Order) {
    let order = tile_order(b);
    let shape = if order == f32_tiles::Order::StripsOuter && b.rows <= TILED_MAX_K {
        Blocking::active().streamed_tile_shape()
    } else {
        f32_tiles::TileShape::Tall
    };
    (shape, order)
}

/// The order in which the register tiles walk `a · b`: row tiles outer when the caller has
/// just written `b` ([`MatRef::resident`]) and it fits in half of a core's L2 cache, so every
/// row tile reads it from L2 while the tile's own rows of `a` stay in L1; else strips of `b`
/// outer, which read it from memory once, a strip at a time, with the next strip prefetched.
///
/// Measured on Zen 4 (1 MiB L2), single-threaded with `b` in cache: 256 × 256 × 256 at 109
/// against 97 GFLOP/s, 256 × 128 × 256 at 112 against 96. Weight gradients read activation
/// gradients just written; those the tiles take (few rows of `xᵀ`, long k) walk row tiles
/// outer where `b` fits. With `b` (weights) arriving from L3 instead: 93–97 against 96
/// GFLOP/s at m = 256, 77 against 90 at m = 96, so weights keep the strips.
fn tile_order(b: MatRef<'_>) -> f32_tiles::Order {
    let reach = b.rows * b.cols * size_of::<f32>();
    if b.resident && reach <= l2_cache_bytes() / 2 {
        f32_tiles::Order::RowTilesOuter
    } else {
        f32_tiles::Order::StripsOuter
    }
}

/// `dst = a · b` (or `dst += a · b` when `accumulate`) on packed panels, single-threaded, for
/// non-empty shapes: [`streamed`] where it applies, else the `gemm` crate's driver.
///
/// Measured with `moekit bench` (Qwen3-30B-A3B `blockwise_mm`, f32, 2-core Zen 4), against the
/// `gemm` crate's driver: 80% against 77–78% of the FMA peak at T = 2048, 281–285 against
/// 300–316 ms at T = 512 and 159–166 against 180–186 ms at T = 128, where experts hold 8–32
/// tokens.
///
/// # Safety
/// `dst` must point to `a.rows · b.cols` writable elements (row-major, contiguous) that alias
/// neither operand; with `accumulate` they must be initialised.
unsafe fn packed_product(dst: *mut f32, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let b_layout = if b.col_stride == 1 {
        Some((streamed::Order::Rows, b.row_stride))
    } else if b.row_stride == 1 {
        Some((streamed::Order::Columns, b.col_stride))
    } else {
        None
    };
    let a_in_place = a.col_stride == 1 || a.col_stride < TRANSPOSED_A_MAX_STRIDE;
    if let Some((b_order, ldb)) = b_layout.filter(|_| a_in_place && streamed::available()) {
        let ops = streamed::Operands {
            a: a.data,
            a_rows: a.row_stride,
            a_cols: a.col_stride,
            b: b.data,
            ldb,
            b_order,
        };
        // SAFETY: the caller guarantees `dst`; the operands' views hold their shapes.
        unsafe { streamed::product(dst, ops, (m, n, k), accumulate) };
        return;
    }
    // SAFETY: the views' constructors checked that every (row, col) of `a` and `b` lies inside
    // its buffer; the caller guarantees `dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Rows of a bf16 `b` widened at a time by [`matmul_bf16_b`] on CPUs without [`streamed`]: 64
/// rows of n ≤ 2048 take at most 512 KiB, so the panel stays in the core's L2 while the product
/// runs.
const BF16_PANEL_ROWS: usize = 64;

/// `dst [m, n] = a · b` for `a [m, k]` and `b [k, n]` in bf16 (the weights as stored, or a
/// band of columns of bf16 tokens), row-major with row stride `ldb` ≥ n: widened as
/// [`streamed`] packs it where the CPU has AVX-512, else [`BF16_PANEL_ROWS`] rows at a time
/// into `panel`, whose products are added in order. `b` is read once and never copied whole;
/// the summation order depends only on the shapes.
///
/// On AVX2 the whole-row panels win: measured with `moekit bench` (Qwen3-30B-A3B
/// `blockwise_mm`, bf16, T = 512, 2-core Zen 3), 672–760 ms against 960–1075 ms on [`streamed`],
/// whose 64-column rows of bf16 reach the packing loop from memory.
///
/// # Panics
/// If `ldb` is below n or `b` is shorter than `[k, n]` at that stride.
pub fn matmul_bf16_b(
    dst: &mut [f32],
    a: MatRef<'_>,
    (b, ldb): (&[bf16], usize),
    panel: &mut Vec<f32>,
) {
    let (m, k) = (a.rows, a.cols);
    let n = dst.len() / m.max(1);
    assert!(
        ldb >= n
            && (k == 0
                || (k - 1)
                    .checked_mul(ldb)
                    .and_then(|len| len.checked_add(n))
                    .is_some_and(|len| len <= b.len())),
        "b is shorter than [k, n] at its row stride"
    );
    if k == 0 {
        dst.fill(0.0);
        return;
    }
    if streamed::avx512() {
        let ops = streamed::Operands {
            a: a.data,
            a_rows: a.row_stride,
            a_cols: a.col_stride,
            b,
            ldb,
            b_order: streamed::Order::Rows,
        };
        // SAFETY: `dst` holds m · n elements (n is its length over m) and, borrowed mutably,
        // aliases neither operand; b holds k rows of n at stride ldb (checked above).
        unsafe { streamed::product(dst.as_mut_ptr(), ops, (m, n, k), false) };
        return;
    }
    for k0 in (0..k).step_by(BF16_PANEL_ROWS) {
        let rows = BF16_PANEL_ROWS.min(k - k0);
        panel.clear();
        for row in k0..k0 + rows {
            panel.extend(b[row * ldb..row * ldb + n].iter().map(|x| x.to_f32()));
        }
        matmul(
            dst,
            a.columns(k0..k0 + rows),
            MatRef::row_major(panel, rows, n),
            k0 > 0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_values::values;

    /// Naive triple loop over the same views.
    fn naive(a: MatRef<'_>, b: MatRef<'_>) -> Vec<f32> {
        let mut out = vec![0.0; a.rows * b.cols];
        for r in 0..a.rows {
            for c in 0..b.cols {
                out[r * b.cols + c] = (0..a.cols)
                    .map(|j| {
                        a.data[r * a.row_stride + j * a.col_stride]
                            * b.data[j * b.row_stride + c * b.col_stride]
                    })
                    .sum();
            }
        }
        out
    }

    #[test]
    fn results_do_not_depend_on_where_b_lies() {
        // A product the register tiles take (12 rows, short k, narrow n), with n a multiple of
        // a cache line's 16 f32 so that each misalignment of b shifts the tiles' strips.
        let (m, k, n) = (12, 40, 80);
        let a = values(m * k, 5);
        let b = values(k * n, 6);
        let mut shifted = vec![0.0; b.len() + 16];
        let mut first: Option<Vec<u32>> = None;
        for skip in 0..16 {
            shifted[skip..skip + b.len()].copy_from_slice(&b);
            let mut dst = vec![f32::NAN; m * n];
            let b = MatRef::row_major(&shifted[skip..], k, n);
            matmul(&mut dst, MatRef::row_major(&a, m, k), b, false);
            let bits: Vec<u32> = dst.iter().map(|x| x.to_bits()).collect();
            match &first {
                None => first = Some(bits),
                Some(first) => assert_eq!(&bits, first, "b {skip} elements further"),
            }
        }
    }

    #[test]
    fn products_into_unwritten_memory_equal_the_overwriting_product() {
        // Packed kernels (k above TILED_MAX_K), register tiles, and an empty inner dimension;
        // the destination starts as NaN bits, which no product may read.
        for (m, k, n) in [(67, 600, 45), (9, 40, 33), (4, 0, 6)] {
            let a = values(m * k, 3);
            let b = values(k * n, 4);
            let (a, b) = (MatRef::row_major(&a, m, k), MatRef::row_major(&b, k, n));
            let mut expected = vec![0.0; m * n];
            matmul(&mut expected, a, b, false);
            let mut dst = vec![MaybeUninit::new(f32::NAN); m * n];
            let got = matmul_into(&mut dst, a, b);
            assert_eq!(got, &expected[..], "{m}×{k}×{n}");
        }
    }

    #[test]
    fn matches_naive_products_on_every_layout() {
        // Register tiles (k ≤ TILED_MAX_K, n ≤ TILED_MAX_N, contiguous rows of b) with every
        // row and column remainder, and the packed kernels (k or n above them, or b
        // transposed; a transposed with steps past TRANSPOSED_A_MAX_STRIDE: m = 600).
        for (m, k, n) in [
            (1, 1, 1),
            (600, 9, 17),
            (3, 5, 7),
            (17, 33, 9),
            (64, 19, 130),
            (25, 512, 33),
            (13, 600, 40),
            (5, 7, 800),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let (a_rows, a_cols) = (MatRef::row_major(&a, m, k), MatRef::row_major(&a, k, m).t());
            let (b_rows, b_cols) = (MatRef::row_major(&b, k, n), MatRef::row_major(&b, n, k).t());
            let views = [
                (a_rows, b_rows),
                (a_cols, b_cols),
                (a_cols, b_rows),
                (a_rows, b_cols),
            ];
            for (va, vb) in views {
                let expected = naive(va, vb);
                let mut got = vec![0.0; m * n];
                matmul(&mut got, va, vb, false);
                for (g, e) in got.iter().zip(&expected) {
                    assert!(
                        (g - e).abs() <= 1e-4 * (1.0 + e.abs()) * (k as f32).sqrt(),
                        "{g} vs {e}"
                    );
                }
                matmul(&mut got, va, vb, true);
                for (g, e) in got.iter().zip(&expected) {
                    assert!(
                        (g - 2.0 * e).abs() <= 2e-4 * (1.0 + e.abs()) * (k as f32).sqrt(),
                        "{g} vs 2·{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_a_resident_b_within_half_the_l2_walks_row_tiles_outer() {
        use f32_tiles::Order::{RowTilesOuter, StripsOuter};
        let fits = l2_cache_bytes() / 2 / size_of::<f32>();
        let values = vec![0.0f32; fits + 64];
        let b = |k: usize, n: usize| MatRef::row_major(&values, k, n);
        assert_eq!(tile_order(b(fits / 64, 64)), StripsOuter);
        assert_eq!(tile_order(b(fits / 64, 64).resident()), RowTilesOuter);
        // A view keeps its mark; past half the L2 it reads as weights do.
        assert_eq!(tile_order(b(fits / 64, 64).resident().t()), RowTilesOuter);
        assert_eq!(tile_order(b(fits / 64 + 1, 64).resident()), StripsOuter);
    }

    #[test]
    fn weights_over_a_short_k_take_the_blockings_tile_shape() {
        use f32_tiles::Order::{RowTilesOuter, StripsOuter};
        use f32_tiles::TileShape::Tall;
        let values = vec![0.0f32; (TILED_MAX_K + 1) * 64];
        let b = |k: usize| MatRef::row_major(&values, k, 64);
        assert_eq!(
            Blocking::Prefetched.streamed_tile_shape(),
            f32_tiles::TileShape::Wide
        );
        assert_eq!(Blocking::Sequential.streamed_tile_shape(), Tall);
        let streamed = Blocking::active().streamed_tile_shape();
        assert_eq!(tiling(b(TILED_MAX_K)), (streamed, StripsOuter));
        assert_eq!(tiling(b(TILED_MAX_K + 1)), (Tall, StripsOuter));
        assert_eq!(tiling(b(64).resident()), (Tall, RowTilesOuter));
    }

    #[test]
    fn register_tiles_match_naive_products_at_every_row_count() {
        // Whichever blocking this process runs, the tiles themselves: row counts past one
        // tile (where Blocking::Sequential hands products to the packed kernels), `a` row-major
        // and transposed, overwriting, accumulating, and into unwritten memory.
        if !f32_tiles::available() {
            return;
        }
        // Every row count of either shape's tiles (m = 1..=13), and columns that end in each
        // of a wide tile's four registers (40, 90, 120, 130 % 64 = 2) and a tall one's two.
        let sweep = (1..=13).flat_map(|m| [(m, 17, 90), (m, 9, 120)]);
        for (m, k, n) in [(13, 33, 40), (64, 19, 130), (100, 256, 64)]
            .into_iter()
            .chain(sweep)
        {
            let a = values(m * k, 5);
            let b = values(k * n, 6);
            let b = MatRef::row_major(&b, k, n);
            for a in [MatRef::row_major(&a, m, k), MatRef::row_major(&a, k, m).t()] {
                let expected = naive(a, b);
                let close = |got: &[f32], scale: f32| {
                    got.iter().zip(&expected).all(|(g, e)| {
                        (g - scale * e).abs() <= 1e-4 * scale * (1.0 + e.abs()) * (k as f32).sqrt()
                    })
                };
                let mut walks = Vec::new();
                for shape in [f32_tiles::TileShape::Tall, f32_tiles::TileShape::Wide] {
                    for order in [
                        f32_tiles::Order::StripsOuter,
                        f32_tiles::Order::RowTilesOuter,
                    ] {
                        let walk = (shape, order);
                        let mut dst = vec![MaybeUninit::new(f32::NAN); m * n];
                        let ops = tile_operands(a, b);
                        let got = f32_tiles::matmul_into(&mut dst, ops, (m, n, k), walk);
                        assert!(close(got, 1.0), "{m}×{k}×{n} into, {walk:?}");
                        f32_tiles::matmul(got, ops, (m, n, k), true, walk);
                        assert!(close(got, 2.0), "{m}×{k}×{n} accumulated, {walk:?}");
                        walks.push(got.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                    }
                }
                assert!(
                    walks.iter().all(|walk| *walk == walks[0]),
                    "{m}×{k}×{n}: the walks' sums differ"
                );
            }
        }
    }

    #[test]
    fn bf16_weights_match_the_product_with_their_widened_copy() {
        // Panels of 64 rows: below, at and across a panel boundary.
        for (m, k, n) in [(1, 1, 1), (3, 64, 7), (17, 65, 9), (9, 200, 33)] {
            let a = values(m * k, 1);
            let b: Vec<bf16> = values(k * n, 2)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let widened: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
            let expected = naive(
                MatRef::row_major(&a, m, k),
                MatRef::row_major(&widened, k, n),
            );
            let mut got = vec![f32::NAN; m * n];
            matmul_bf16_b(
                &mut got,
                MatRef::row_major(&a, m, k),
                (&b, n),
                &mut Vec::new(),
            );
            for (g, e) in got.iter().zip(&expected) {
                assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{g} vs {e}");
            }
            // The same b as columns 3..3 + n of rows 5 elements wider: the same product.
            let ldb = n + 5;
            let mut wide = vec![bf16::from_f32(f32::NAN); k * ldb];
            for (row, b_row) in wide.chunks_mut(ldb).zip(b.chunks(n)) {
                row[3..3 + n].copy_from_slice(b_row);
            }
            let mut strided = vec![f32::NAN; m * n];
            let band = (&wide[3..], ldb);
            matmul_bf16_b(
                &mut strided,
                MatRef::row_major(&a, m, k),
                band,
                &mut Vec::new(),
            );
            assert_eq!(strided, got, "{m}×{k}×{n} at row stride {ldb}");
        }
    }

    #[test]
    fn column_views_select_their_columns() {
        let a = values(4 * 6, 3);
        let view = MatRef::row_major(&a, 4, 6).columns(2..5);
        let identity: Vec<f32> = (0..9).map(|j| if j % 4 == 0 { 1.0 } else { 0.0 }).collect();
        let mut got = vec![0.0; 12];
        matmul(&mut got, view, MatRef::row_major(&identity, 3, 3), false);
        for r in 0..4 {
            assert_eq!(got[r * 3..r * 3 + 3], a[r * 6 + 2..r * 6 + 5]);
        }
    }

    #[test]
    fn empty_inner_dimension_zeroes_or_keeps() {
        let mut dst = vec![5.0; 6];
        matmul(
            &mut dst,
            MatRef::row_major(&[], 2, 0),
            MatRef::row_major(&[], 0, 3),
            true,
        );
        assert_eq!(dst, vec![5.0; 6]);
        matmul(
            &mut dst,
            MatRef::row_major(&[], 2, 0),
            MatRef::row_major(&[], 0, 3),
            false,
        );
        assert_eq!(dst, vec![0.0; 6]);
    }

    #[test]
    #[should_panic(expected = "reaches past its buffer")]
    fn views_past_the_buffer_are_refused() {
        MatRef::row_major(&[0.0; 5], 2, 3);
    }
}
