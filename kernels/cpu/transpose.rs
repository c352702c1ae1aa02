//! 16 × 16 tiles of f32 transposed in registers on AVX-512 (plain loops elsewhere): how the
//! blockwise kernels move values between token rows `[m, 2I]` and the checkpoint
//! `gate_up_activations_T [N, 2, I, B]`, whose rows run along a block's slots. A transpose
//! only moves values, so every path gives the same tile.

use super::isa::Isa;

/// Rows and columns of a [`Tile`].
pub const TILE: usize = 16;

/// A 16 × 16 tile of f32, row-major.
pub type Tile = [[f32; TILE]; TILE];

/// Transposes `tile` in place.
pub fn transpose(tile: &mut Tile) {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one, so AVX-512 F is present.
        unsafe { x86::transpose(tile) };
        return;
    }
    let original = *tile;
    for (r, row) in tile.iter_mut().enumerate() {
        for (value, column) in row.iter_mut().zip(&original) {
            *value = column[r];
        }
    }
}

/// `values` (at most [`TILE`] of them, widened by `widen`) into the front of `row`. A full row
/// is one fixed-size move, which compiles to a vector load and store where a slice copy of
/// unknown length calls `memmove`.
#[inline(always)]
pub fn load_row<T: Copy>(row: &mut [f32; TILE], values: &[T], widen: impl Fn(T) -> f32) {
    match <&[T; TILE]>::try_from(values) {
        Ok(full) => *row = full.map(widen),
        Err(_) => {
            for (value, &v) in row.iter_mut().zip(values) {
                *value = widen(v);
            }
        }
    }
}

/// The front of `row`, narrowed by `narrow`, into the whole of `out` (at most [`TILE`] values),
/// as one fixed-size move when `out` is a full row ([`load_row`]'s converse).
#[inline(always)]
pub fn store_row<T>(out: &mut [T], row: &[f32; TILE], narrow: impl Fn(f32) -> T) {
    match <&mut [T; TILE]>::try_from(&mut *out) {
        Ok(full) => {
            for (value, &v) in full.iter_mut().zip(row) {
                *value = narrow(v);
            }
        }
        Err(_) => {
            for (value, &v) in out.iter_mut().zip(row) {
                *value = narrow(v);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{TILE, Tile};

    /// Four rounds of two-source shuffles: pairs of elements, then of pairs, then of 128-bit
    /// lanes twice, each round interleaving rows a distance apart that doubles.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose(tile: &mut Tile) {
        let mut r = [_mm512_setzero_ps(); TILE];
        for (row, values) in r.iter_mut().zip(tile.iter()) {
            // SAFETY: each row of the tile holds 16 f32.
            *row = unsafe { _mm512_loadu_ps(values.as_ptr()) };
        }
        let mut t = [_mm512_setzero_ps(); TILE];
        for p in 0..TILE / 2 {
            t[2 * p] = _mm512_unpacklo_ps(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_ps(r[2 * p], r[2 * p + 1]);
        }
        let pd = _mm512_castps_pd;
        for g in (0..TILE).step_by(4) {
            r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[g]), pd(t[g + 2])));
            r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[g]), pd(t[g + 2])));
            r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[g + 1]), pd(t[g + 3])));
            r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[g + 1]), pd(t[g + 3])));
        }
        for half in [0, TILE / 2] {
            for j in half..half + 4 {
                t[j] = _mm512_shuffle_f32x4::<0x88>(r[j], r[j + 4]);
                t[j + 4] = _mm512_shuffle_f32x4::<0xdd>(r[j], r[j + 4]);
            }
        }
        for j in 0..TILE / 2 {
            r[j] = _mm512_shuffle_f32x4::<0x88>(t[j], t[j + 8]);
            r[j + 8] = _mm512_shuffle_f32x4::<0xdd>(t[j], t[j + 8]);
        }
        for (row, values) in r.iter().zip(tile.iter_mut()) {
            // SAFETY: each row of the tile holds 16 f32.
            unsafe { _mm512_storeu_ps(values.as_mut_ptr(), *row) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_rows_and_columns() {
        let original: Tile =
            std::array::from_fn(|r| std::array::from_fn(|c| (r * TILE + c) as f32 - 100.5));
        let mut tile = original;
        transpose(&mut tile);
        for (r, row) in tile.iter().enumerate() {
            for (c, &value) in row.iter().enumerate() {
                assert_eq!(
                    value,
                    original[c][r],
                    "({r}, {c}) at level {}",
                    Isa::active()
                );
            }
        }
    }

    #[test]
    fn rows_move_whole_or_in_part_and_leave_the_rest() {
        let values: Vec<f32> = (0..TILE).map(|v| v as f32 + 0.25).collect();
        for len in [TILE, TILE - 1, 3, 0] {
            let mut row = [-1.0; TILE];
            load_row(&mut row, &values[..len], |v| 2.0 * v);
            for (j, &got) in row.iter().enumerate() {
                let want = if j < len { 2.0 * values[j] } else { -1.0 };
                assert_eq!(got, want, "load_row of {len}: [{j}]");
            }
            let mut out = vec![0.0f64; len];
            store_row(&mut out, &row, f64::from);
            let want: Vec<f64> = row[..len].iter().map(|&v| f64::from(v)).collect();
            assert_eq!(out, want, "store_row of {len}");
        }
    }
}
