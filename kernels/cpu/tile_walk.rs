//! The walk the register-tiled kernels share ([`super::f32_tiles`], [`super::bf16_matmul`]):
//! an output `[m, n]` in tiles of up to [`MR`] rows by [`NR`] columns, 32-column strips
//! outer, so that a strip of `b` stays in cache while every row tile of `a` passes it. The
//! kernels keep their tile's row count a compile-time constant (one accumulator array per
//! count); the walk picks the instance.

/// Columns per register tile: two 16-lane f32 accumulators per row.
pub const NR: usize = 32;
/// Rows per register tile: 24 accumulators, 2 registers of `b` and a broadcast.
pub const MR: usize = 12;

/// A kernel that computes one register tile of its output.
pub trait RegisterTiles {
    /// Computes the `ROWS × cols` tile whose first element is output `(r0, c0)`.
    ///
    /// # Safety
    /// As the kernel's own contract, for this tile (`ROWS ≤ MR`, `cols ≤ NR`).
    unsafe fn tile<const ROWS: usize>(&self, r0: usize, c0: usize, cols: usize);
}

/// Runs `kernel` on every tile of an `[m, n]` output, strips of [`NR`] columns outer.
///
/// # Safety
/// Every tile of `[m, n]` must satisfy the kernel's contract.
#[inline]
pub unsafe fn walk(kernel: &impl RegisterTiles, m: usize, n: usize) {
    for c0 in (0..n).step_by(NR) {
        let cols = (n - c0).min(NR);
        for r0 in (0..m).step_by(MR) {
            // SAFETY: a tile of [m, n] (the caller's contract) of at most MR rows, NR columns.
            unsafe {
                match (m - r0).min(MR) {
                    12 => kernel.tile::<12>(r0, c0, cols),
                    11 => kernel.tile::<11>(r0, c0, cols),
                    10 => kernel.tile::<10>(r0, c0, cols),
                    9 => kernel.tile::<9>(r0, c0, cols),
                    8 => kernel.tile::<8>(r0, c0, cols),
                    7 => kernel.tile::<7>(r0, c0, cols),
                    6 => kernel.tile::<6>(r0, c0, cols),
                    5 => kernel.tile::<5>(r0, c0, cols),
                    4 => kernel.tile::<4>(r0, c0, cols),
                    3 => kernel.tile::<3>(r0, c0, cols),
                    2 => kernel.tile::<2>(r0, c0, cols),
                    _ => kernel.tile::<1>(r0, c0, cols),
                }
            }
        }
    }
}
