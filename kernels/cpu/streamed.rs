//! `dst [m, n] (+)= a [m, k] · b [k, n]` in f32 for products whose `b` is read from memory once
//! (an expert's weights, used by the expert's own tokens only): the `gemm` crate's AVX-512
//! microkernels (64 × 6 register tiles of `dstᵀ`) or, without AVX-512, its AVX2+FMA ones
//! (16 × 6), driven by a loop of our own that streams `b` in under the arithmetic.
//!
//! `b` is stored in f32 or bf16 ([`Element`]), row-major or as its transpose ([`Order`]), and
//! packed one panel at a time, widened (and transposed) to f32 in strips of one register tile's
//! columns (64 or 16), contiguous per row of `b`. The panels' shape, whether the next panel is
//! prefetched into L2 while the microkernels run the current one against `a` (six rows of `a`
//! per call), and in which order strips and row tiles meet are the process's [`Blocking`],
//! chosen for the CPU at hand. (The `gemm` crate's own driver packs each panel straight from
//! memory with the arithmetic waiting on it: 13% of the cycles of Qwen3-30B-A3B's f32
//! `blockwise_mm` at T = 2048 on a 2-core Zen 4; on a 2-core Zen 3 without AVX-512, its AVX2
//! driver spends most of the product waiting on `b`'s rows.)
//!
//! Each output is summed over k in ascending order within a panel's rows, panels in ascending
//! order of k: the order depends only on the shapes, the instruction set and the blocking.

use half::bf16;

use super::blocking::Blocking;
use super::isa::Isa;

/// Whether [`product`] runs on AVX-512 F here, whose 64-column panels stream bf16 weights
/// in faster than whole-row panels widened ahead of the product do (not so on AVX2: see
/// `matmul::matmul_bf16_b`).
pub fn avx512() -> bool {
    Isa::Avx512.enabled()
}

/// Whether [`product`] runs here: the active level has AVX-512 F, or AVX2 and FMA.
pub fn available() -> bool {
    Isa::Avx2.enabled()
}

/// How `b` is stored: f32, or bf16 widened exactly as it is packed.
pub trait Element: Copy + Sync {
    /// Writes `src` as f32 into `dst` (of the same length).
    fn widen_into(dst: &mut [f32], src: &[Self]) {
        for (d, x) in dst.iter_mut().zip(src) {
            *d = x.widen();
        }
    }

    /// Eight values as f32: one 256-bit register's worth, inlined into the packing loops (a
    /// slice copy there costs a `memcpy` call per row of a strip).
    #[inline(always)]
    fn widen8(src: &[Self; 8]) -> [f32; 8] {
        src.map(Self::widen)
    }

    /// The value as f32, exactly.
    fn widen(self) -> f32;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        // bf16 is the top half of an f32: widening is a shift, exact for every value.
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// How `b [k, n]` lies in its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// `b(p, c) = b[p · ldb + c]`: row-major.
    Rows,
    /// `b(p, c) = b[c · ldb + p]`: stored as its transpose `[n, k]` (a weight `W [n, k]` in
    /// `d y · Wᵀ`), transposed as it is packed.
    Columns,
}

/// The operands of one product: `a(r, p) = a[r · a_rows + p · a_cols]` (read where it lies,
/// row-major or transposed: the microkernels broadcast its elements), and `b` in `b_order` with
/// `ldb` elements between its stored rows.
#[derive(Clone, Copy, Debug)]
pub struct Operands<'a, B> {
    pub a: &'a [f32],
    pub a_rows: usize,
    pub a_cols: usize,
    pub b: &'a [B],
    pub ldb: usize,
    pub b_order: Order,
}

/// `dst [m, n] = a · b`, or `dst += a · b` when `accumulate`; `dst` row-major, contiguous;
/// on the panels of the process's [`Blocking::active`].
///
/// # Safety
/// `dst` must point to `m · n` writable elements that alias neither operand, initialised when
/// `accumulate` (otherwise each is written before it is read).
///
/// # Panics
/// If the CPU lacks both AVX-512 F and AVX2+FMA ([`available`]) or an operand's last element
/// lies past its buffer.
pub unsafe fn product<B: Element>(
    dst: *mut f32,
    ops: Operands<'_, B>,
    shape: (usize, usize, usize),
    accumulate: bool,
) {
    // SAFETY: the caller's guarantees.
    unsafe { product_with(Blocking::active(), dst, ops, shape, accumulate) }
}

/// [`product`] on the panels of `blocking`.
///
/// # Safety
/// As for [`product`].
unsafe fn product_with<B: Element>(
    blocking: Blocking,
    dst: *mut f32,
    ops: Operands<'_, B>,
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    let reaches =
        |len: usize, (rows, row_stride): (usize, usize), (cols, col_stride): (usize, usize)| {
            rows == 0
                || cols == 0
                || (rows - 1)
                    .checked_mul(row_stride)
                    .zip((cols - 1).checked_mul(col_stride))
                    .and_then(|(r, c)| r.checked_add(c))
                    .is_some_and(|last| last < len)
        };
    let (b_rows, b_cols) = match ops.b_order {
        Order::Rows => (k, n),
        Order::Columns => (n, k),
    };
    assert!(
        reaches(ops.a.len(), (m, ops.a_rows), (k, ops.a_cols))
            && reaches(ops.b.len(), (b_rows, ops.ldb), (b_cols, 1)),
        "operand too short for its shape"
    );
    assert!(
        available(),
        "streamed::product needs AVX-512 F or AVX2 and FMA"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            // SAFETY: the caller guarantees m · n writable elements at `dst`.
            unsafe { std::ptr::write_bytes(dst, 0, m * n) };
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the chosen microkernels' instruction set is at most the active level, which is at
    // most the detected one; both operands hold their shapes (checked above), and the caller
    // guarantees `dst`.
    unsafe {
        if avx512() {
            x86::product::<x86::Avx512, B>(blocking, dst, ops, (m, n, k), accumulate);
        } else {
            x86::product::<x86::Avx2, B>(blocking, dst, ops, (m, n, k), accumulate);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::cell::RefCell;

    use gemm_f32::microkernel::{avx512f, fma};

    use super::{Blocking, Element, Operands, Order};

    /// Bytes per cache line.
    const LINE: usize = 64;

    /// One instruction set's microkernels: `MR × NR` register tiles of `dstᵀ`, `MR` a multiple
    /// of the f32 lanes of one register.
    pub trait Microkernels {
        const MR: usize;
        const NR: usize;

        /// `dstᵀ`'s `cols × rows` tile (`cols ≤ MR`, `1 ≤ rows ≤ NR`) over `kc` rows of the
        /// packed `panel`: `dst(r, c) (+)= Σ_p a(r, p) · panel(p, c)`, with `dst`'s rows
        /// `dst_rs` apart and `a(r, p)` at `a + r · a_strides.0 + p · a_strides.1`; `alpha_status` 1 adds
        /// to `dst`, 0 overwrites it.
        ///
        /// # Safety
        /// The CPU supports the instruction set; the pointers cover the tile as described.
        #[allow(clippy::too_many_arguments)]
        unsafe fn tile(
            cols: usize,
            rows: usize,
            kc: usize,
            dst: *mut f32,
            panel: *const f32,
            a: *const f32,
            dst_rs: isize,
            a_strides: (isize, isize),
            alpha_status: u8,
        );
    }

    /// AVX-512 F: 64 × 6 tiles.
    pub struct Avx512;
    /// AVX2 and FMA: 16 × 6 tiles.
    pub struct Avx2;

    macro_rules! microkernels {
        ($isa:ty, $kernels:ident, $lanes:expr) => {
            impl Microkernels for $isa {
                const MR: usize = $kernels::f32::MR_DIV_N * $lanes;
                const NR: usize = $kernels::f32::NR;

                unsafe fn tile(
                    cols: usize,
                    rows: usize,
                    kc: usize,
                    dst: *mut f32,
                    panel: *const f32,
                    a: *const f32,
                    dst_rs: isize,
                    (a_rows, a_cols): (isize, isize),
                    alpha_status: u8,
                ) {
                    // SAFETY: the caller guarantees the instruction set and the pointers.
                    unsafe {
                        $kernels::f32::UKR[cols.div_ceil($lanes) - 1][rows - 1](
                            cols,
                            rows,
                            kc,
                            dst,
                            panel,
                            a,
                            dst_rs,
                            1,
                            Self::MR as isize,
                            a_cols,
                            a_rows,
                            1.0,
                            1.0,
                            alpha_status,
                            false,
                            false,
                            false,
                            std::ptr::null(),
                        )
                    }
                }
            }
        };
    }
    microkernels!(Avx512, avx512f, 16);
    microkernels!(Avx2, fma, 8);

    thread_local! {
        /// The thread's packed-panel buffer, grown to the largest panel it has packed.
        static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }

    /// A packed panel: strips of `I::MR` columns, each `kc`
    /// rows of `I::MR` values (row r of strip s at `(s · kc + r) · I::MR`), zeros past the
    /// panel's columns; starts on a cache line.
    struct Panel<'a> {
        values: &'a mut [f32],
        kc: usize,
    }

    impl<'a> Panel<'a> {
        /// A panel of up to `capacity` values (its strips' rows) in `buffer`.
        fn new(buffer: &'a mut Vec<f32>, capacity: usize) -> Self {
            let len = capacity + LINE / 4;
            if buffer.len() < len {
                buffer.resize(len, 0.0);
            }
            let start = buffer.as_ptr().align_offset(LINE).min(LINE / 4);
            Self {
                values: &mut buffer[start..start + capacity],
                kc: 0,
            }
        }

        /// Packs `block` of `b`, widened to f32, in strips of `I::MR` columns.
        fn pack<I: Microkernels, B: Element>(&mut self, ops: Operands<'_, B>, block: Block) {
            self.kc = block.kc;
            match ops.b_order {
                Order::Rows => self.pack_rows::<I, B>(ops, block),
                // SAFETY: every level that runs these microkernels has AVX.
                Order::Columns => unsafe { self.pack_columns::<I, B>(ops, block) },
            }
        }

        /// [`Self::pack`] from row-major `b`: each row of the block is a run of `cols` values,
        /// copied (widened) 8 at a time.
        fn pack_rows<I: Microkernels, B: Element>(&mut self, ops: Operands<'_, B>, block: Block) {
            for r in 0..block.kc {
                let src = &ops.b[(block.k0 + r) * ops.ldb + block.c0..][..block.cols];
                for (strip, src) in src.chunks(I::MR).enumerate() {
                    let row = &mut self.values[(strip * block.kc + r) * I::MR..][..I::MR];
                    let full = src.len() / 8 * 8;
                    for (dst, src) in row.chunks_exact_mut(8).zip(src[..full].chunks_exact(8)) {
                        let src: &[B; 8] = src.try_into().expect("chunks of 8");
                        dst.copy_from_slice(&B::widen8(src));
                    }
                    B::widen_into(&mut row[full..src.len()], &src[full..]);
                    row[src.len()..].fill(0.0);
                }
            }
        }

        /// [`Self::pack`] from `b` stored as its transpose: each column of the block is a run
        /// of `kc` values, transposed 8 × 8 at a time in registers.
        ///
        /// # Safety
        /// The CPU supports AVX.
        #[target_feature(enable = "avx")]
        unsafe fn pack_columns<I: Microkernels, B: Element>(
            &mut self,
            ops: Operands<'_, B>,
            block: Block,
        ) {
            let (kc, full_k) = (block.kc, block.kc / 8 * 8);
            let strips = block.cols.div_ceil(I::MR);
            for strip in 0..strips {
                let strip_values = &mut self.values[strip * kc * I::MR..][..kc * I::MR];
                let cols = I::MR.min(block.cols - strip * I::MR);
                let column = |j: usize| {
                    let c = block.c0 + strip * I::MR + j;
                    &ops.b[c * ops.ldb + block.k0..][..kc]
                };
                let full_cols = cols / 8 * 8;
                for j0 in (0..full_cols).step_by(8) {
                    let sources: [&[B]; 8] = std::array::from_fn(|q| column(j0 + q));
                    for r0 in (0..full_k).step_by(8) {
                        let mut tile = [[0.0f32; 8]; 8];
                        for (row, src) in tile.iter_mut().zip(&sources) {
                            *row = B::widen8(src[r0..r0 + 8].try_into().expect("8 values"));
                        }
                        let rows = transpose8(&tile);
                        for (dr, row) in rows.iter().enumerate() {
                            strip_values[(r0 + dr) * I::MR + j0..][..8].copy_from_slice(row);
                        }
                    }
                    for r in full_k..kc {
                        for (q, src) in sources.iter().enumerate() {
                            strip_values[r * I::MR + j0 + q] = src[r].widen();
                        }
                    }
                }
                for j in full_cols..I::MR {
                    if j < cols {
                        let src = column(j);
                        for r in 0..kc {
                            strip_values[r * I::MR + j] = src[r].widen();
                        }
                    } else {
                        for r in 0..kc {
                            strip_values[r * I::MR + j] = 0.0;
                        }
                    }
                }
            }
        }

        /// The start of strip `strip`.
        fn strip<I: Microkernels>(&self, strip: usize) -> *const f32 {
            self.values[strip * self.kc * I::MR..].as_ptr()
        }
    }

    /// One panel's place: rows `k0..k0 + kc` and columns `c0..c0 + cols` of `b`
    /// (`cols` at most the geometry's).
    #[derive(Clone, Copy)]
    struct Block {
        k0: usize,
        kc: usize,
        c0: usize,
        cols: usize,
    }

    /// Rows of `b`'s buffer that hold `block`: its rows of `b`, or, stored transposed, its
    /// columns.
    fn stored_rows<B>(ops: Operands<'_, B>, block: Block) -> usize {
        match ops.b_order {
            Order::Rows => block.kc,
            Order::Columns => block.cols,
        }
    }

    /// Prefetches the stored rows `rows` (of [`stored_rows`]) of `block` into L2.
    fn prefetch<B>(ops: Operands<'_, B>, block: Block, rows: std::ops::Range<usize>) {
        for r in rows {
            let row = match ops.b_order {
                Order::Rows => &ops.b[(block.k0 + r) * ops.ldb + block.c0..][..block.cols],
                Order::Columns => &ops.b[(block.c0 + r) * ops.ldb + block.k0..][..block.kc],
            };
            let start = row.as_ptr() as usize;
            let end = start + std::mem::size_of_val(row);
            for line in (start & !(LINE - 1)..end).step_by(LINE) {
                // SAFETY: a prefetch never faults and reads nothing into the program; the
                // address lies inside (or on the line of) `ops.b`.
                unsafe { _mm_prefetch::<_MM_HINT_T1>(line as *const i8) };
            }
        }
    }

    /// The transpose of an 8 × 8 tile: `out[r][q] = tile[q][r]`.
    #[inline]
    #[target_feature(enable = "avx")]
    fn transpose8(tile: &[[f32; 8]; 8]) -> [[f32; 8]; 8] {
        // SAFETY: each load reads one row of 8 f32 of `tile`.
        let r: [__m256; 8] = std::array::from_fn(|q| unsafe { _mm256_loadu_ps(tile[q].as_ptr()) });
        // Pairs of rows interleaved, then quads, then the 128-bit halves exchanged.
        let t: [__m256; 8] = std::array::from_fn(|x| {
            let (p, q) = (r[x & !1], r[(x & !1) + 1]);
            if x % 2 == 0 {
                _mm256_unpacklo_ps(p, q)
            } else {
                _mm256_unpackhi_ps(p, q)
            }
        });
        let u: [__m256; 8] = std::array::from_fn(|x| {
            let base = x / 4 * 4;
            let (p, q) = (t[base + (x % 4) / 2], t[base + (x % 4) / 2 + 2]);
            if x % 2 == 0 {
                _mm256_shuffle_ps::<0x44>(p, q)
            } else {
                _mm256_shuffle_ps::<0xEE>(p, q)
            }
        });
        let mut out = [[0.0f32; 8]; 8];
        for (x, row) in out.iter_mut().enumerate() {
            let (p, q) = (u[x % 4], u[x % 4 + 4]);
            let v = if x < 4 {
                _mm256_permute2f128_ps::<0x20>(p, q)
            } else {
                _mm256_permute2f128_ps::<0x31>(p, q)
            };
            // SAFETY: `row` holds 8 f32, one unaligned 256-bit store.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr(), v) };
        }
        out
    }

    /// # Safety
    /// `I`'s instruction set available; the operands hold their shapes; `dst` as for
    /// [`super::product`].
    pub(super) unsafe fn product<I: Microkernels, B: Element>(
        blocking: Blocking,
        dst: *mut f32,
        ops: Operands<'_, B>,
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
    ) {
        let g = blocking.geometry(ops.b_order == Order::Columns, (m, n, k), I::MR);
        let (kcap, pcols) = (g.kc, g.cols);
        let blocks: Vec<Block> = (0..k)
            .step_by(kcap)
            .flat_map(|k0| {
                (0..n).step_by(pcols).map(move |c0| Block {
                    k0,
                    kc: kcap.min(k - k0),
                    c0,
                    cols: pcols.min(n - c0),
                })
            })
            .collect();
        let tiles = m.div_ceil(I::NR);
        PANEL.with_borrow_mut(|buffer| {
            let mut panel = Panel::new(buffer, kcap.min(k) * pcols.min(n).next_multiple_of(I::MR));
            if g.prefetch {
                prefetch(ops, blocks[0], 0..stored_rows(ops, blocks[0]));
            }
            for (index, &block) in blocks.iter().enumerate() {
                panel.pack::<I, B>(ops, block);
                let next = blocks.get(index + 1).copied().filter(|_| g.prefetch);
                let strips = block.cols.div_ceil(I::MR);
                let calls = tiles * strips;
                let share = next.map_or(0, |next| stored_rows(ops, next).div_ceil(calls));
                // The first block of k overwrites `dst` unless accumulating; the others add.
                let alpha_status = u8::from(accumulate || block.k0 > 0);
                for call in 0..calls {
                    let (tile, strip) = if g.strips_outer {
                        (call % tiles, call / tiles)
                    } else {
                        (call / strips, call % strips)
                    };
                    if let Some(next) = next {
                        let rows = stored_rows(ops, next);
                        let first = (call * share).min(rows);
                        prefetch(ops, next, first..(first + share).min(rows));
                    }
                    let (r0, rows) = (tile * I::NR, I::NR.min(m - tile * I::NR));
                    let c0 = strip * I::MR;
                    // SAFETY: the microkernel computes the `cols × rows` tile of `dstᵀ` at
                    // (block.c0 + c0, r0) over the panel's kc rows: it reads the strip (kc
                    // rows of MR values), `a`'s rows r0..r0 + rows at columns k0..k0 + kc
                    // (inside `a`, checked by the caller), and writes `dst` at rows r0..,
                    // columns block.c0 + c0.. (inside its m · n elements), reading them
                    // first only with `alpha_status` 1.
                    unsafe {
                        I::tile(
                            I::MR.min(block.cols - c0),
                            rows,
                            block.kc,
                            dst.add(r0 * n + block.c0 + c0),
                            panel.strip::<I>(strip),
                            ops.a.as_ptr().add(r0 * ops.a_rows + block.k0 * ops.a_cols),
                            n as isize,
                            (ops.a_rows as isize, ops.a_cols as isize),
                            alpha_status,
                        );
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::test_values::values;

    /// `b [k, n]` with `ldb` between its stored rows, stored in `order`, from `row_major`.
    fn stored<T: Copy + Default>(
        row_major: &[T],
        (k, n): (usize, usize),
        order: Order,
        ldb: usize,
    ) -> Vec<T> {
        let (rows, cols) = match order {
            Order::Rows => (k, n),
            Order::Columns => (n, k),
        };
        let mut out = vec![T::default(); rows * ldb];
        for r in 0..rows {
            for c in 0..cols {
                let (p, j) = if order == Order::Rows { (r, c) } else { (c, r) };
                out[r * ldb + c] = row_major[p * n + j];
            }
        }
        out
    }

    #[test]
    fn products_match_the_naive_product_on_ragged_shapes_in_every_blocking_and_order() {
        if !available() {
            return;
        }
        // Partial panels (n % 64, n < 16) and 8 × 8 transposes, partial row tiles (m % 6),
        // several panels of k (k > 512) and of columns (wide panels past their bytes), more
        // than 64 rows of `a`, strided rows of both operands, `a` transposed, and an empty
        // inner dimension.
        for (m, n, k) in [
            (1, 1, 1),
            (5, 13, 9),
            (7, 70, 513),
            (13, 64, 1100),
            (6, 136, 40),
            (70, 700, 300),
            (50, 5, 7),
            (3, 4, 0),
        ] {
            let lda = k + 3;
            let a = values(m * lda, 1);
            let mut a_t = vec![f32::NAN; k * (m + 2)];
            for r in 0..m {
                for p in 0..k {
                    a_t[p * (m + 2) + r] = a[r * lda + p];
                }
            }
            let b = values(k * n, 2);
            let naive: Vec<f32> = (0..m * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    (0..k).map(|p| a[r * lda + p] * b[p * n + c]).sum()
                })
                .collect();
            let close = |got: f32, want: f32| {
                (got - want).abs() <= 1e-4 * (1.0 + want.abs()) * (k as f32).sqrt()
            };
            for (blocking, order) in Blocking::ALL
                .into_iter()
                .flat_map(|blocking| [(blocking, Order::Rows), (blocking, Order::Columns)])
            {
                let ldb = if order == Order::Rows { n + 5 } else { k + 3 };
                let b = stored(&b, (k, n), order, ldb);
                // `a` row-major, and stored as its transpose `[k, m]` (rows m + 2 apart).
                for (a, a_rows, a_cols) in [(&a, lda, 1), (&a_t, 1, m + 2)] {
                    let ops = Operands {
                        a,
                        a_rows,
                        a_cols,
                        b: &b,
                        ldb,
                        b_order: order,
                    };
                    let what = format!("{blocking} {order:?} a_cols {a_cols} {m}×{n}×{k}");
                    let mut dst = vec![f32::NAN; m * n];
                    // SAFETY: `dst` holds m · n elements and aliases neither operand.
                    unsafe { product_with(blocking, dst.as_mut_ptr(), ops, (m, n, k), false) };
                    for (g, e) in dst.iter().zip(&naive) {
                        assert!(close(*g, *e), "{what}: {g} vs {e}");
                    }
                    // SAFETY: as above; `dst` is initialised.
                    unsafe { product_with(blocking, dst.as_mut_ptr(), ops, (m, n, k), true) };
                    for (g, e) in dst.iter().zip(&naive) {
                        assert!(close(*g, 2.0 * e), "{what} accumulated: {g} vs {}", 2.0 * e);
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_operands_give_the_product_of_their_widened_copy_in_every_blocking_and_order() {
        if !available() {
            return;
        }
        let (m, n, k) = (11, 100, 600);
        let a = values(m * k, 5);
        let b: Vec<bf16> = values(k * n, 6)
            .iter()
            .map(|&x| bf16::from_f32(x / 3.0))
            .collect();
        for blocking in Blocking::ALL {
            for (order, ldb) in [(Order::Rows, n), (Order::Columns, k)] {
                let b = stored(&b, (k, n), order, ldb);
                let widened: Vec<f32> = b.iter().map(|x| x.to_f32()).collect();
                let (mut want, mut got) = (vec![0.0; m * n], vec![0.0; m * n]);
                let ops = Operands {
                    a: &a,
                    a_rows: k,
                    a_cols: 1,
                    b: &widened,
                    ldb,
                    b_order: order,
                };
                // SAFETY: both destinations hold m · n elements and alias no operand.
                unsafe {
                    product_with(blocking, want.as_mut_ptr(), ops, (m, n, k), false);
                    let ops = Operands {
                        a: &a,
                        a_rows: k,
                        a_cols: 1,
                        b: &b,
                        ldb,
                        b_order: order,
                    };
                    product_with(blocking, got.as_mut_ptr(), ops, (m, n, k), false);
                }
                assert_eq!(got, want, "{blocking} {order:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "operand too short")]
    fn short_operands_panic_before_any_access() {
        let (a, b) = (vec![1.0; 10], vec![1.0f32; 10]);
        let mut dst = vec![0.0; 4];
        let ops = Operands {
            a: &a,
            a_rows: 5,
            a_cols: 1,
            b: &b,
            ldb: 2,
            b_order: Order::Rows,
        };
        // SAFETY: `dst` holds 2 · 2 elements; the call panics on `b` (6 rows of stride 2).
        unsafe { product(dst.as_mut_ptr(), ops, (2, 2, 6), false) };
    }
}
