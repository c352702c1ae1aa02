//! `a · bᵀ` for row-major `a [m, k]` and `b [n, k]`: the dot-product form of a matrix product,
//! where both operands stream along k. The backward's `d y · Dᵀ` and `d gate_up · Wᵀ` have this
//! form with few rows in `a`; packed-panel GEMMs handle it poorly (they need k-major panels of
//! `b`), and transposing the weights first doubles the memory traffic.
//!
//! A register-blocked microkernel computes `MR × NR` dot products at once with `L`-lane
//! accumulators, compiled for AVX-512 or AVX2+FMA and chosen at run time, with a portable
//! fallback. The summation order of each output (lane partial sums, then lanes in order, then
//! the tail) depends only on `k` and the instruction set, never on threads.

use half::bf16;

use super::isa::Isa;

/// `dst [m, n] = a [m, k] · b [n, k]ᵀ`, or `+=` when `accumulate`.
///
/// # Panics
/// If a buffer is shorter than its shape.
pub fn matmul_nt(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    let fits =
        |len: usize, rows: usize, cols: usize| rows.checked_mul(cols).is_some_and(|n| len >= n);
    assert!(
        fits(dst.len(), m, n) && fits(a.len(), m, k) && fits(b.len(), n, k),
        "operand too short"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::Avx512.enabled() {
            // SAFETY: the active level is at most the detected one: AVX-512 F and FMA are here.
            return unsafe { x86::nt_avx512(dst, a, b, (m, n, k), accumulate) };
        }
        if Isa::Avx2.enabled() {
            // SAFETY: the active level is at most the detected one: AVX2 and FMA are here.
            return unsafe { x86::nt_avx2(dst, a, b, (m, n, k), accumulate) };
        }
    }
    nt::<8, 2, 4>(dst, a, b, (m, n, k), accumulate, |x, y, acc| acc + x * y);
}

/// Rows of a bf16 `b` widened at a time by [`matmul_nt_bf16`]: 32 rows of k ≤ 2048 take at most
/// 256 KiB, so the panel stays in the core's L2 while every row of `a` passes it.
const BF16_PANEL: usize = 32;

/// [`matmul_nt`] with `b [n, k]` stored in bf16 (the weights as stored): `dst [m, n] = a [m, k]
/// · b [n, k]ᵀ`. `b` is widened [`BF16_PANEL`] rows at a time into `panel`, so it is read once
/// and never copied whole; each output is summed exactly as [`matmul_nt`] sums it.
/// `panel` and `tile` are scratch buffers, reused between calls.
///
/// # Panics
/// If a buffer is shorter than its shape.
pub fn matmul_nt_bf16(
    dst: &mut [f32],
    a: &[f32],
    b: &[bf16],
    (m, n, k): (usize, usize, usize),
    (panel, tile): (&mut Vec<f32>, &mut Vec<f32>),
) {
    let fits =
        |len: usize, rows: usize, cols: usize| rows.checked_mul(cols).is_some_and(|n| len >= n);
    assert!(
        fits(dst.len(), m, n) && fits(a.len(), m, k) && fits(b.len(), n, k),
        "operand too short"
    );
    for c0 in (0..n).step_by(BF16_PANEL) {
        let cols = BF16_PANEL.min(n - c0);
        panel.clear();
        panel.extend(b[c0 * k..(c0 + cols) * k].iter().map(|x| x.to_f32()));
        tile.resize(m * cols, 0.0);
        matmul_nt(tile, a, panel, (m, cols, k), false);
        for (dst_row, tile_row) in dst.chunks_mut(n).zip(tile.chunks(cols)) {
            dst_row[c0..c0 + cols].copy_from_slice(tile_row);
        }
    }
}

// Register tiles are indexed by (row, column, lane), as in the formulas.
#[allow(clippy::needless_range_loop)]
#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::nt;

    /// Rows of `a` and of `b` per AVX-512 tile: 16 zmm accumulators.
    pub(in crate::cpu) const MR: usize = 4;
    pub(in crate::cpu) const NR: usize = 4;
    // `lane_sums` reduces exactly 16 accumulators.
    const _: () = assert!(MR * NR == 16);

    /// # Safety
    /// The CPU must support AVX-512F and FMA.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn nt_avx512(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
    ) {
        let full_k = k / 16 * 16;
        let (full_m, full_n) = (m / MR * MR, n / NR * NR);
        // Columns outer: a tile of `b` rows stays in cache while every row of `a` passes it.
        for c0 in (0..full_n).step_by(NR) {
            for r0 in (0..full_m).step_by(MR) {
                let mut acc = [[_mm512_setzero_ps(); NR]; MR];
                let mut kk = 0;
                while kk < full_k {
                    // SAFETY: rows r0..r0+MR of `a` and c0..c0+NR of `b` exist (full tiles) and
                    // kk + 16 ≤ k, so every 16-lane load stays inside its row.
                    unsafe {
                        let av: [__m512; MR] = std::array::from_fn(|i| {
                            _mm512_loadu_ps(a.as_ptr().add((r0 + i) * k + kk))
                        });
                        for j in 0..NR {
                            let bv = _mm512_loadu_ps(b.as_ptr().add((c0 + j) * k + kk));
                            for i in 0..MR {
                                acc[i][j] = _mm512_fmadd_ps(av[i], bv, acc[i][j]);
                            }
                        }
                    }
                    kk += 16;
                }
                let sums = lane_sums(acc);
                for i in 0..MR {
                    for j in 0..NR {
                        let mut sum = sums[i * NR + j];
                        let (a_row, b_row) = (&a[(r0 + i) * k..][..k], &b[(c0 + j) * k..][..k]);
                        for kk in full_k..k {
                            sum = a_row[kk].mul_add(b_row[kk], sum);
                        }
                        let d = &mut dst[(r0 + i) * n + c0 + j];
                        *d = if accumulate { *d + sum } else { sum };
                    }
                }
            }
        }
        // Ragged right and bottom edges through the generic kernel.
        edges(
            dst,
            a,
            b,
            (m, n, k),
            (full_m, full_n),
            accumulate,
            |d, a, b, dims, acc| nt::<16, 1, 1>(d, a, b, dims, acc, f32::mul_add),
        );
    }

    /// The sum of each accumulator's 16 lanes, `sums[i · NR + j]` for `acc[i][j]`: the 16
    /// vectors are reduced together, pairwise, so 16 sums take 45 shuffles and additions where
    /// one horizontal reduction per vector takes about 8 each. Each sum adds the lanes in a
    /// fixed tree: `(l + l⁺²) + (l⁺¹ + l⁺³)` within each quarter `l = 4q`, then quarters 0 + 1
    /// and 2 + 3, then those two.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(in crate::cpu) fn lane_sums(acc: [[__m512; NR]; MR]) -> [f32; MR * NR] {
        let v: [__m512; MR * NR] = std::array::from_fn(|x| acc[x / NR][x % NR]);
        // Per 128-bit quarter of each pair (x, y): x0+x2, y0+y2, x1+x3, y1+y3.
        let pairs: [__m512; 8] = std::array::from_fn(|p| {
            let (x, y) = (v[2 * p], v[2 * p + 1]);
            _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
        });
        // Per quarter of each group of four vectors: that quarter's sum of each of the four.
        let quads: [__m512; 4] = std::array::from_fn(|q| {
            let (x, y) = (pairs[2 * q], pairs[2 * q + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(x, y),
                _mm512_shuffle_ps::<0xEE>(x, y),
            )
        });
        // Quarters (0 + 1) and (2 + 3) of each group, two groups per vector.
        let halves: [__m512; 2] = std::array::from_fn(|h| {
            let (x, y) = (quads[2 * h], quads[2 * h + 1]);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xDD>(x, y),
            )
        });
        // Quarter g: the four totals of group g.
        let totals = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(halves[0], halves[1]),
            _mm512_shuffle_f32x4::<0xDD>(halves[0], halves[1]),
        );
        let mut sums = [0.0f32; MR * NR];
        // SAFETY: `sums` holds 16 f32, one unaligned 512-bit store.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), totals) };
        sums
    }

    /// Rows of `a` and of `b` per AVX2 tile: 12 ymm accumulators, three rows of `a` and one
    /// of `b` in the other four registers.
    const MR2: usize = 3;
    const NR2: usize = 4;

    /// The AVX2 kernel: `MR2 × NR2` tiles of 8-lane accumulators, so that twelve independent
    /// FMA chains hide the FMA latency (one dot product at a time runs at an eighth of the
    /// FMA rate). Each sum adds its lanes in order, then the k tail, exactly as the generic
    /// kernel does, so full tiles and edges sum alike.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn nt_avx2(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        accumulate: bool,
    ) {
        let full_k = k / 8 * 8;
        let (full_m, full_n) = (m / MR2 * MR2, n / NR2 * NR2);
        // Columns outer: a tile of `b` rows stays in cache while every row of `a` passes it.
        for c0 in (0..full_n).step_by(NR2) {
            for r0 in (0..full_m).step_by(MR2) {
                let mut acc = [[_mm256_setzero_ps(); NR2]; MR2];
                let mut kk = 0;
                while kk < full_k {
                    // SAFETY: rows r0..r0+MR2 of `a` and c0..c0+NR2 of `b` exist (full tiles)
                    // and kk + 8 ≤ k, so every 8-lane load stays inside its row.
                    unsafe {
                        let av: [__m256; MR2] = std::array::from_fn(|i| {
                            _mm256_loadu_ps(a.as_ptr().add((r0 + i) * k + kk))
                        });
                        for j in 0..NR2 {
                            let bv = _mm256_loadu_ps(b.as_ptr().add((c0 + j) * k + kk));
                            for i in 0..MR2 {
                                acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
                            }
                        }
                    }
                    kk += 8;
                }
                for i in 0..MR2 {
                    for j in 0..NR2 {
                        let mut lanes = [0.0f32; 8];
                        // SAFETY: `lanes` holds 8 f32, one unaligned 256-bit store.
                        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][j]) };
                        let mut sum = lanes.iter().sum::<f32>();
                        let (a_row, b_row) = (&a[(r0 + i) * k..][..k], &b[(c0 + j) * k..][..k]);
                        for kk in full_k..k {
                            sum = a_row[kk].mul_add(b_row[kk], sum);
                        }
                        let d = &mut dst[(r0 + i) * n + c0 + j];
                        *d = if accumulate { *d + sum } else { sum };
                    }
                }
            }
        }
        // Ragged right and bottom edges through the generic kernel.
        edges(
            dst,
            a,
            b,
            (m, n, k),
            (full_m, full_n),
            accumulate,
            |d, a, b, dims, acc| nt::<8, 1, 1>(d, a, b, dims, acc, f32::mul_add),
        );
    }

    /// Runs `kernel` on the rows `full_m..m` (all columns) and on the columns `full_n..n` of the
    /// first `full_m` rows.
    #[inline(always)]
    fn edges(
        dst: &mut [f32],
        a: &[f32],
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        (full_m, full_n): (usize, usize),
        accumulate: bool,
        kernel: impl Fn(&mut [f32], &[f32], &[f32], (usize, usize, usize), bool),
    ) {
        let mut tile = Vec::new();
        for r in 0..m {
            let columns = if r < full_m { full_n..n } else { 0..n };
            if columns.is_empty() {
                continue;
            }
            tile.resize(columns.len(), 0.0);
            if accumulate {
                tile.copy_from_slice(&dst[r * n + columns.start..r * n + columns.end]);
            }
            kernel(
                &mut tile,
                &a[r * k..(r + 1) * k],
                &b[columns.start * k..columns.end * k],
                (1, columns.len(), k),
                accumulate,
            );
            dst[r * n + columns.start..r * n + columns.end].copy_from_slice(&tile);
        }
    }
}

/// The blocked kernel: `L` lanes, `MR` rows of `a` by `NR` rows of `b` per tile. `fma(x, y,
/// acc)` is `acc + x·y`, fused where the instruction set has it. Inlined into each
/// `target_feature` wrapper so it is vectorised for that instruction set.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed by (row, column, lane)
fn nt<const L: usize, const MR: usize, const NR: usize>(
    dst: &mut [f32],
    a: &[f32],
    b: &[f32],
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
    fma: impl Fn(f32, f32, f32) -> f32 + Copy,
) {
    let full_k = k / L * L;
    let store = |dst: &mut f32, value: f32| {
        if accumulate {
            *dst += value;
        } else {
            *dst = value;
        }
    };
    // Lanes summed in order, then the k tail.
    let finish = |acc: &[f32; L], a_row: &[f32], b_row: &[f32]| {
        let mut sum = acc.iter().sum::<f32>();
        for kk in full_k..k {
            sum = fma(a_row[kk], b_row[kk], sum);
        }
        sum
    };
    let mut r0 = 0;
    while r0 < m {
        let mr = MR.min(m - r0);
        let mut c0 = 0;
        while c0 < n {
            let nr = NR.min(n - c0);
            if mr == MR && nr == NR {
                let mut acc = [[[0.0f32; L]; NR]; MR];
                for kk in (0..full_k).step_by(L) {
                    let a_vecs: [&[f32; L]; MR] = std::array::from_fn(|i| {
                        a[(r0 + i) * k + kk..][..L].try_into().expect("L lanes")
                    });
                    for j in 0..NR {
                        let b_vec: &[f32; L] =
                            b[(c0 + j) * k + kk..][..L].try_into().expect("L lanes");
                        for i in 0..MR {
                            for l in 0..L {
                                acc[i][j][l] = fma(a_vecs[i][l], b_vec[l], acc[i][j][l]);
                            }
                        }
                    }
                }
                for i in 0..MR {
                    for j in 0..NR {
                        let value = finish(
                            &acc[i][j],
                            &a[(r0 + i) * k..(r0 + i + 1) * k],
                            &b[(c0 + j) * k..(c0 + j + 1) * k],
                        );
                        store(&mut dst[(r0 + i) * n + c0 + j], value);
                    }
                }
            } else {
                // Edge tiles: one dot product at a time, same order of summation.
                for i in 0..mr {
                    let a_row = &a[(r0 + i) * k..(r0 + i + 1) * k];
                    for j in 0..nr {
                        let b_row = &b[(c0 + j) * k..(c0 + j + 1) * k];
                        let mut acc = [0.0f32; L];
                        for kk in (0..full_k).step_by(L) {
                            for l in 0..L {
                                acc[l] = fma(a_row[kk + l], b_row[kk + l], acc[l]);
                            }
                        }
                        store(&mut dst[(r0 + i) * n + c0 + j], finish(&acc, a_row, b_row));
                    }
                }
            }
            c0 += NR;
        }
        r0 += MR;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + seed * 13) % 23) as f32 / 11.0 - 1.0)
            .collect()
    }

    #[test]
    fn matches_naive_dot_products_on_every_edge() {
        for (m, n, k) in [
            (1, 1, 1),
            (3, 5, 7),
            (4, 4, 16),
            (5, 9, 33),
            (17, 6, 100),
            (8, 13, 2048),
        ] {
            let a = values(m * k, 1);
            let b = values(n * k, 2);
            let mut got = vec![0.0; m * n];
            matmul_nt(&mut got, &a, &b, (m, n, k), false);
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|j| f64::from(a[r * k + j]) * f64::from(b[c * k + j]))
                        .sum();
                    let g = f64::from(got[r * n + c]);
                    assert!(
                        (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                        "[{r},{c}] {g} vs {want}"
                    );
                }
            }
            let once = got.clone();
            matmul_nt(&mut got, &a, &b, (m, n, k), true);
            for (twice, once) in got.iter().zip(&once) {
                assert_eq!(*twice, 2.0 * once);
            }
        }
    }

    #[test]
    fn bf16_weights_give_the_sums_of_their_widened_copy() {
        // Panels of 32 rows: below, at and across a panel boundary.
        for (m, n, k) in [(1, 1, 1), (5, 32, 17), (7, 33, 64), (13, 70, 129)] {
            let a = values(m * k, 1);
            let b: Vec<bf16> = values(n * k, 2)
                .iter()
                .map(|&v| bf16::from_f32(v))
                .collect();
            let widened: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
            let mut want = vec![0.0; m * n];
            matmul_nt(&mut want, &a, &widened, (m, n, k), false);
            let mut got = vec![f32::NAN; m * n];
            let (mut panel, mut tile) = (Vec::new(), Vec::new());
            matmul_nt_bf16(&mut got, &a, &b, (m, n, k), (&mut panel, &mut tile));
            assert_eq!(got, want, "{m}x{n}x{k}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tiles_sum_exactly_as_one_dot_product_at_a_time() {
        if Isa::detected() < Isa::Avx2 {
            return;
        }
        // Full 3 × 4 tiles with ragged right and bottom edges, k below, at and past 8 lanes
        // with a tail, accumulating or not.
        for (m, n, k) in [(3, 4, 8), (7, 9, 13), (6, 8, 1), (10, 13, 2051), (2, 3, 40)] {
            let a = values(m * k, 5);
            let b = values(n * k, 6);
            for accumulate in [false, true] {
                let mut want = values(m * n, 7);
                nt::<8, 1, 1>(&mut want, &a, &b, (m, n, k), accumulate, f32::mul_add);
                let mut got = values(m * n, 7);
                // SAFETY: AVX2 and FMA were detected above.
                unsafe { x86::nt_avx2(&mut got, &a, &b, (m, n, k), accumulate) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{m}x{n}x{k} {accumulate}");
            }
        }
    }

    #[test]
    fn empty_k_gives_zeros() {
        let mut dst = vec![3.0; 4];
        matmul_nt(&mut dst, &[], &[], (2, 2, 0), false);
        assert_eq!(dst, vec![0.0; 4]);
    }
}
