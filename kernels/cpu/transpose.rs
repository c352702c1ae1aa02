//! 16 × 16 tiles of f32 transposed on their way between buffers: how the blockwise kernels
//! move values between token rows `[m, 2I]` and the checkpoint `gate_up_activations_T [N, 2,
//! I, B]`, whose rows run along a block's slots. On AVX-512 a tile is loaded, transposed and
//! stored without leaving the registers (plain loops elsewhere). A transpose only moves values,
//! so every path gives the same tile.

use super::isa::Isa;

/// Rows and columns of a [`Tile`].
pub const TILE: usize = 16;

/// A 16 × 16 tile of f32, row-major.
pub type Tile = [[f32; TILE]; TILE];

/// Writes the transpose of up to [`TILE`] rows of f32 into `dst`: value `c` of row `r` goes
/// to `dst[c · stride + r]`, for every `r < rows.len()` and `c < cols`, and a row given as
/// `None` reads as zeros. Each row is read, and each column written, as one run; on AVX-512 the
/// tile never leaves the registers.
///
/// # Panics
/// If there are more than [`TILE`] rows or columns, a row holds fewer than `cols` values, the
/// columns' runs overlap (`stride` below the number of rows, with two columns or more), or
/// `dst` ends before the last column's run.
pub fn transpose_into(rows: &[Option<&[f32]>], cols: usize, dst: &mut [f32], stride: usize) {
    let n = rows.len();
    assert!(
        n <= TILE && cols <= TILE,
        "a tile holds at most 16 × 16 values"
    );
    assert!(
        rows.iter().flatten().all(|row| row.len() >= cols),
        "a tile row holds fewer than its {cols} columns"
    );
    if n == 0 || cols == 0 {
        return;
    }
    assert!(
        cols == 1 || stride >= n,
        "the transposed tile's columns overlap"
    );
    assert!(
        (cols - 1) * stride + n <= dst.len(),
        "the transposed tile reaches past its destination"
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one, so AVX-512 F is present; the
        // rows and `dst` hold the tile (checked above).
        unsafe { x86::transpose_into(rows, cols, dst, stride) };
        return;
    }
    transpose_into_portable(rows, cols, dst, stride);
}

/// [`transpose_into`] in plain loops, for the checked arguments.
fn transpose_into_portable(rows: &[Option<&[f32]>], cols: usize, dst: &mut [f32], stride: usize) {
    if rows.is_empty() {
        return;
    }
    for c in 0..cols {
        for (value, row) in dst[c * stride..][..rows.len()].iter_mut().zip(rows) {
            *value = row.map_or(0.0, |row| row[c]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::TILE;

    /// [`super::transpose_into`]: rows loaded under a mask of their `cols` values (zeros past
    /// them, and for missing rows), columns stored under a mask of the rows.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; 1 ≤ `rows.len()` ≤ [`TILE`] and 1 ≤ `cols` ≤ [`TILE`];
    /// every row holds `cols` values, and `dst` holds `(cols − 1) · stride + rows.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose_into(
        rows: &[Option<&[f32]>],
        cols: usize,
        dst: &mut [f32],
        stride: usize,
    ) {
        let mask = |n: usize| ((1u32 << n) - 1) as __mmask16;
        let mut r = [_mm512_setzero_ps(); TILE];
        for (values, row) in r.iter_mut().zip(rows) {
            if let Some(row) = row {
                // SAFETY: the row holds `cols` values; the mask reads no others.
                *values = unsafe { _mm512_maskz_loadu_ps(mask(cols), row.as_ptr()) };
            }
        }
        transpose(&mut r);
        let rows_mask = mask(rows.len());
        for (c, column) in r.iter().take(cols).enumerate() {
            // SAFETY: column c's run of `rows.len()` values lies inside `dst` (the caller's
            // guarantee); the mask writes no others.
            unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr().add(c * stride), rows_mask, *column) };
        }
    }

    /// Transposes the 16 × 16 tile held in `r` (row i in `r[i]`): four rounds of two-source
    /// shuffles, of pairs of elements, then of pairs, then of 128-bit lanes twice, each round
    /// interleaving rows a distance apart that doubles.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose(r: &mut [__m512; TILE]) {
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`transpose_into`]'s signature.
    type TransposeInto = fn(&[Option<&[f32]>], usize, &mut [f32], usize);

    /// The active level's path, and the portable loops whatever the level.
    #[test]
    fn columns_take_the_rows_values_and_nothing_else_is_written() {
        let paths: [(&str, TransposeInto); 2] = [
            (Isa::active().name(), transpose_into),
            ("portable", transpose_into_portable),
        ];
        for (level, transpose) in paths {
            written_as_transposed(level, transpose);
        }
    }

    fn written_as_transposed(level: &str, transpose: TransposeInto) {
        for n in [0, 1, 5, TILE] {
            for cols in [0, 1, 7, TILE] {
                let stride = n + 3;
                // Row 2 is missing (zeros); the others are exactly `cols` long, each in a
                // buffer of its own, so a read past them would leave it.
                let values: Vec<Vec<f32>> = (0..n)
                    .map(|r| (0..cols).map(|c| (r * TILE + c) as f32 - 100.5).collect())
                    .collect();
                let rows: Vec<Option<&[f32]>> =
                    (0..n).map(|r| (r != 2).then(|| &values[r][..])).collect();
                // Exactly as long as the last column's run needs.
                let len = if n == 0 || cols == 0 {
                    0
                } else {
                    (cols - 1) * stride + n
                };
                let mut dst = vec![f32::NAN; len];
                transpose(&rows, cols, &mut dst, stride);
                for (i, &got) in dst.iter().enumerate() {
                    let (c, r) = (i / stride, i % stride);
                    let want = match rows.get(r) {
                        _ if c >= cols => None,
                        Some(Some(row)) => Some(row[c]),
                        Some(None) => Some(0.0),
                        None => None,
                    };
                    match want {
                        Some(want) => {
                            assert_eq!(got, want, "{n} rows, {cols} columns: ({r}, {c}), {level}")
                        }
                        None => assert!(
                            got.is_nan(),
                            "{n} rows, {cols} columns: [{i}] written, {level}"
                        ),
                    }
                }
            }
        }
    }
}
