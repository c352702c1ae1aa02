//! The exponential, 16 lanes at a time on AVX-512, and the row softmax and log-softmax built on
//! it.
//!
//! `e^x = 2^n · p(r)` with `n = round(x · log₂e)`, `r = x − n · ln 2` (ln 2 split in two parts)
//! and `p` the degree-6 Taylor polynomial of `e^r` on |r| ≤ ln 2 / 2 (relative error below
//! 2⁻²³), scaled by `2^n` with `vscalefps`. Arguments are clamped to ±100 first, so `r` stays
//! finite and results saturate (to +∞ above, to e^−100 ≈ 3.7·10⁻⁴⁴ below). Every element, tail
//! included, goes through the same instructions, so results depend only on the values.

use super::isa::Isa;

/// `out = softmax(row)`: `e^(x − max) / Σ e^(x − max)`, for equal-length, non-empty slices.
///
/// # Panics
/// If the lengths differ.
pub fn softmax(row: &[f32], out: &mut [f32]) {
    assert_eq!(row.len(), out.len(), "softmax: slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one, so AVX-512 F is present; the
        // slices have equal lengths (checked above).
        unsafe { x86::softmax(row, out) };
        return;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &l) in out.iter_mut().zip(row) {
        *o = (l - max).exp();
        sum += *o;
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

/// `out = row − ln Σ e^row` (computed as `max + ln Σ e^(x − max)`), for equal-length, non-empty
/// slices.
///
/// # Panics
/// If the lengths differ.
pub fn log_softmax(row: &[f32], out: &mut [f32]) {
    assert_eq!(
        row.len(),
        out.len(),
        "log_softmax: slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: as in `softmax`.
        unsafe { x86::log_softmax(row, out) };
        return;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    for (o, &l) in out.iter_mut().zip(row) {
        *o = l - lse;
    }
}

/// `out[i] = e^x[i]`, for equal-length slices.
///
/// # Panics
/// If the lengths differ.
pub fn exp_into(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "exp_into: slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: as in `softmax`.
        unsafe { x86::exp_into(x, out) };
        return;
    }
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v.exp();
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    /// e^x per lane (see the module docs).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub fn exp(x: __m512) -> __m512 {
        let x = _mm512_min_ps(
            _mm512_max_ps(x, _mm512_set1_ps(-100.0)),
            _mm512_set1_ps(100.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 = 0.693359375 − 2.12194440e−4, the first part exact in a few bits.
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    /// Lanes `0..len` of a 16-lane mask.
    pub fn mask(len: usize) -> __mmask16 {
        if len >= 16 { !0 } else { (1u16 << len) - 1 }
    }

    /// The largest element of a non-empty slice.
    #[target_feature(enable = "avx512f")]
    fn max(row: &[f32]) -> f32 {
        let len = row.len();
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for c in (0..len).step_by(16) {
            // SAFETY: the masked lanes lie inside `row` from c on; lanes past the end are
            // not read.
            let x = unsafe { _mm512_maskz_loadu_ps(mask(len - c), row.as_ptr().add(c)) };
            max = _mm512_mask_max_ps(max, mask(len - c), max, x);
        }
        _mm512_reduce_max_ps(max)
    }

    /// # Safety
    /// AVX-512 F must be present; the slices have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn log_softmax(row: &[f32], out: &mut [f32]) {
        let len = row.len();
        let max = max(row);
        let shift = _mm512_set1_ps(max);
        let mut sum = _mm512_setzero_ps();
        for c in (0..len).step_by(16) {
            let m = mask(len - c);
            // SAFETY: the masked lanes lie inside `row` from c on.
            let x = unsafe { _mm512_maskz_loadu_ps(m, row.as_ptr().add(c)) };
            sum = _mm512_mask_add_ps(sum, m, sum, exp(_mm512_sub_ps(x, shift)));
        }
        let lse = _mm512_set1_ps(max + _mm512_reduce_add_ps(sum).ln());
        for c in (0..len).step_by(16) {
            let m = mask(len - c);
            // SAFETY: the masked lanes lie inside both slices (equal lengths) from c on.
            unsafe {
                let x = _mm512_maskz_loadu_ps(m, row.as_ptr().add(c));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, _mm512_sub_ps(x, lse));
            }
        }
    }

    /// # Safety
    /// AVX-512 F must be present; the slices have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_into(x: &[f32], out: &mut [f32]) {
        let len = x.len();
        for c in (0..len).step_by(16) {
            let m = mask(len - c);
            // SAFETY: the masked lanes lie inside both slices (equal lengths) from c on.
            unsafe {
                let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(c));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, exp(v));
            }
        }
    }

    /// # Safety
    /// AVX-512 F must be present; the slices have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn softmax(row: &[f32], out: &mut [f32]) {
        let len = row.len();
        let max = _mm512_set1_ps(max(row));
        let mut sum = _mm512_setzero_ps();
        for c in (0..len).step_by(16) {
            let m = mask(len - c);
            // SAFETY: the masked lanes lie inside both slices (equal lengths) from c on; lanes
            // past the end are neither read nor written (here and below).
            unsafe {
                let e = exp(_mm512_sub_ps(
                    _mm512_maskz_loadu_ps(m, row.as_ptr().add(c)),
                    max,
                ));
                sum = _mm512_mask_add_ps(sum, m, sum, e);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, e);
            }
        }
        let sum = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
        for c in (0..len).step_by(16) {
            let m = mask(len - c);
            // SAFETY: as above.
            unsafe {
                let e = _mm512_maskz_loadu_ps(m, out.as_ptr().add(c));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, _mm512_div_ps(e, sum));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_matches_f64_on_every_tail_and_wide_ranges() {
        for len in [1, 5, 16, 17, 40, 128, 129] {
            for spread in [0.1f32, 10.0, 300.0] {
                let row: Vec<f32> = (0..len)
                    .map(|i| ((i * 37 % 23) as f32 / 11.0 - 1.0) * spread)
                    .collect();
                let max = row
                    .iter()
                    .copied()
                    .fold(f64::NEG_INFINITY, |m, x| m.max(f64::from(x)));
                let exact: Vec<f64> = row.iter().map(|&x| (f64::from(x) - max).exp()).collect();
                let total: f64 = exact.iter().sum();
                let mut out = vec![f32::NAN; len];
                softmax(&row, &mut out);
                for ((o, e), &x) in out.iter().zip(&exact).zip(&row) {
                    let want = e / total;
                    // f32 rounds x − max by up to 2⁻²⁴ of it, which e^(x − max) scales by.
                    let bound = (1e-6 + (f64::from(x) - max).abs() * 2f64.powi(-24)) * want;
                    assert!(
                        (f64::from(*o) - want).abs() <= bound + 1e-30,
                        "len {len}, spread {spread}: {o} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn log_softmax_and_exp_match_f64_on_every_tail_and_wide_ranges() {
        for len in [1, 5, 16, 17, 40, 128, 129] {
            for spread in [0.1f32, 10.0, 80.0] {
                let row: Vec<f32> = (0..len)
                    .map(|i| ((i * 37 % 23) as f32 / 11.0 - 1.0) * spread)
                    .collect();
                let wide: Vec<f64> = row.iter().map(|&x| f64::from(x)).collect();
                let max = wide.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let lse = max + wide.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                let mut out = vec![f32::NAN; len];
                log_softmax(&row, &mut out);
                for (o, x) in out.iter().zip(&wide) {
                    // Rounding x − lse in f32, and lse's own error (a few ulps of its size).
                    let bound = (x.abs() + lse.abs()) * 2f64.powi(-22) + 1e-6;
                    assert!(
                        (f64::from(*o) - (x - lse)).abs() <= bound,
                        "log_softmax, len {len}, spread {spread}: {o} vs {}",
                        x - lse
                    );
                }
                exp_into(&row, &mut out);
                for (o, x) in out.iter().zip(&wide) {
                    let want = x.exp();
                    assert!(
                        (f64::from(*o) - want).abs() <= 2e-7 * want,
                        "exp, len {len}, spread {spread}: {o} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn different_lengths_panic() {
        softmax(&[1.0, 2.0], &mut [0.0]);
    }
}
