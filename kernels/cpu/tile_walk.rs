//! The walk the register-tiled kernels share ([`super::f32_tiles`], [`super::bf16_matmul`]):
//! an output `[m, n]` in tiles of up to [`RegisterTiles::MR`] rows by [`RegisterTiles::NR`]
//! columns, strips of `NR` columns outer (a strip of `b` stays in cache while every row tile of
//! `a` passes it) or row tiles outer (a row tile of `a` stays in L1 while it meets every strip
//! of `b`): [`Order`]. The kernels keep their tile's row count a compile-time constant (one
//! accumulator array per count, instantiated with [`by_rows`]); the walk picks the count.

/// Rows of the tall register tile: 24 accumulators of two 16-lane registers per row, two
/// registers of `b` and a broadcast.
pub const MR: usize = 12;
/// Columns of the tall register tile.
pub const NR: usize = 32;

/// A kernel that computes one register tile of its output.
pub trait RegisterTiles {
    /// Most rows of one tile (the tall tile's by default).
    const MR: usize = MR;
    /// Columns of one full tile: the width of a strip of `b` (the tall tile's by default).
    const NR: usize = NR;

    /// Computes the `rows × cols` tile whose first element is output `(r0, c0)`.
    ///
    /// # Safety
    /// As the kernel's own contract, for this tile (`1 ≤ rows ≤ MR`, `cols ≤ NR`).
    unsafe fn tile(&self, rows: usize, r0: usize, c0: usize, cols: usize);
}

/// `$kernel.$method::<ROWS>(args)` for the row count `$rows`, one of the listed literals: a
/// [`RegisterTiles::tile`] with its row count made a compile-time constant.
macro_rules! by_rows {
    ($rows:expr, $kernel:ident.$method:ident $args:tt, [$($n:literal),+]) => {
        match $rows {
            $($n => $kernel.$method::<$n> $args,)+
            rows => unreachable!("a register tile of {rows} rows"),
        }
    };
}
pub(crate) use by_rows;

/// Columns of the first strip of a walk over `b [k, n]` (row stride `ldb` elements of `T`,
/// first element at `b`) in strips of `nr` columns after which every strip starts on a 64-byte
/// cache line, so that no load of a full strip's row straddles two lines (measured on Zen 4:
/// bf16 weights 48 bytes past a line made Qwen3-30B-A3B's bf16 `blockwise_mm` at T = 512 take
/// 303 ms instead of 198–211). 0 where `b` already starts on a line, where its rows start at
/// different offsets within their lines (`ldb` not a multiple of a line), or where the output
/// is one strip wide.
/// Each output's sum is the same in whichever strip it is computed, so results do not depend
/// on where the buffers lie.
pub fn aligned_head<T>(b: *const T, ldb: usize, n: usize, nr: usize) -> usize {
    const LINE: usize = 64;
    let size = size_of::<T>();
    let offset = b as usize % LINE;
    if n <= nr || offset == 0 || !offset.is_multiple_of(size) || !(ldb * size).is_multiple_of(LINE)
    {
        return 0;
    }
    (LINE - offset) / size
}

/// The order in which [`walk`] visits an output's register tiles. Each output's sum is the
/// same in either order (its terms come from its own row of `a` and column of `b`, in k order),
/// so the order changes only which operand the caches keep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Strips of [`RegisterTiles::NR`] columns outer: a strip of `b` stays in cache while every
    /// row tile of `a` passes it, so `b` is read from memory once, a strip at a time (the
    /// kernels prefetch the next strip while they multiply the current one): for weights
    /// streamed from memory.
    StripsOuter,
    /// Row tiles outer: a tile's rows of `a` stay in L1 while they meet every strip of `b`,
    /// which the caches must then hold whole: for a `b` the caller has just written (a weight
    /// gradient's activation gradients), read from L2 by every row tile.
    RowTilesOuter,
}

/// Runs `kernel` on every tile of an `[m, n]` output, in `order`; the first strip of columns is
/// `head` columns wide when `head` is not 0 ([`aligned_head`]).
///
/// # Safety
/// Every tile of `[m, n]` must satisfy the kernel's contract; `head < K::NR`.
#[inline]
pub unsafe fn walk<K: RegisterTiles>(kernel: &K, m: usize, n: usize, head: usize, order: Order) {
    debug_assert!(head < K::NR, "a head strip narrower than NR");
    let strips = || {
        let mut c0 = 0;
        std::iter::from_fn(move || {
            (c0 < n).then(|| {
                let cols = if c0 == 0 && head > 0 { head } else { K::NR }.min(n - c0);
                c0 += cols;
                (c0 - cols, cols)
            })
        })
    };
    match order {
        Order::StripsOuter => {
            for (c0, cols) in strips() {
                for r0 in (0..m).step_by(K::MR) {
                    // SAFETY: a tile of [m, n] (the caller's contract) of at most MR rows (the
                    // rows left of m) and NR columns.
                    unsafe { kernel.tile((m - r0).min(K::MR), r0, c0, cols) };
                }
            }
        }
        Order::RowTilesOuter => {
            for r0 in (0..m).step_by(K::MR) {
                for (c0, cols) in strips() {
                    // SAFETY: as above.
                    unsafe { kernel.tile((m - r0).min(K::MR), r0, c0, cols) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_ends_where_a_cache_line_starts() {
        let line = |p: *const u8| p as usize % 64;
        let buffer = vec![0u16; 4096];
        for skip in 0..40 {
            let b = buffer[skip..].as_ptr();
            let head = aligned_head(b, 1536, 1536, NR);
            assert!(head < NR);
            // SAFETY: within the buffer.
            assert_eq!(line(unsafe { b.add(head) }.cast()), 0, "skip {skip}");
        }
        let b = buffer[3..].as_ptr();
        // Rows at differing offsets, and one-strip outputs, keep the plain walk.
        assert_eq!(aligned_head(b, 1500, 1500, NR), 0);
        assert_eq!(aligned_head(b, 1536, NR, NR), 0);
    }
}
