//! SwiGLU on rows of gate and up values, forward and backward, 16 lanes at a time on AVX-512
//! (scalar elsewhere).
//!
//! `act = silu(g) · u` with `silu(g) = g · σ(g)`, and for a gradient `d act`:
//! `d g = d act · u · σ(g) · (1 + g · (1 − σ(g)))`, `d u = d act · g · σ(g)`.
//!
//! On AVX-512, `σ(g) = 1 / (1 + e^−g)` uses the vector exponential of [`super::exp`]. Every
//! element, tail included, goes through the same instructions, so the results depend only on
//! the values.

use super::isa::Isa;

/// `act[c] = silu(gate[c]) · up[c]` for equal-length slices.
///
/// # Panics
/// If the lengths differ.
pub fn forward(gate: &[f32], up: &[f32], act: &mut [f32]) {
    assert!(
        gate.len() == up.len() && up.len() == act.len(),
        "swiglu::forward: slices of different lengths"
    );
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one, so AVX-512 F is present; the
        // slices have equal lengths (checked above).
        unsafe { x86::forward(gate, up, act) };
        return;
    }
    for ((a, &g), &u) in act.iter_mut().zip(gate).zip(up) {
        *a = g * sigmoid(g) * u;
    }
}

/// The activation and the gradients of one row: from `gate`, `up` and `d_act`, writes `act`,
/// `d_gate` and `d_up` (all of one length).
pub struct Backward<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub d_act: &'a [f32],
    pub act: &'a mut [f32],
    pub d_gate: &'a mut [f32],
    pub d_up: &'a mut [f32],
}

impl Backward<'_> {
    /// # Panics
    /// If the slices' lengths differ.
    pub fn assert_equal_lengths(&self) {
        let len = self.gate.len();
        assert!(
            [
                self.up.len(),
                self.d_act.len(),
                self.act.len(),
                self.d_gate.len(),
                self.d_up.len()
            ]
            .iter()
            .all(|&l| l == len),
            "gated activation backward: slices of different lengths"
        );
    }
}

/// Runs [`Backward`].
///
/// # Panics
/// If the lengths differ.
pub fn backward(row: Backward<'_>) {
    row.assert_equal_lengths();
    let len = row.gate.len();
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one, so AVX-512 F is present; the
        // slices have equal lengths (checked above).
        unsafe { x86::backward(row) };
        return;
    }
    for c in 0..len {
        let (g, u, da) = (row.gate[c], row.up[c], row.d_act[c]);
        let sg = sigmoid(g);
        row.act[c] = g * sg * u;
        row.d_gate[c] = da * u * sg * (1.0 + g * (1.0 - sg));
        row.d_up[c] = da * g * sg;
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::Backward;
    use crate::cpu::exp::x86::{exp, mask};

    /// σ(x) per lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn sigmoid(x: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        // Beyond ±100 e^−x is 0 or +∞, which give σ = 1 or 0 exactly.
        let exp = exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_div_ps(one, _mm512_add_ps(one, exp))
    }

    /// # Safety
    /// AVX-512 F must be present; the slices have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn forward(gate: &[f32], up: &[f32], act: &mut [f32]) {
        for c in (0..gate.len()).step_by(16) {
            let m = mask(gate.len() - c);
            // SAFETY: the masked lanes lie inside the slices from c on; lanes past the end are
            // neither read nor written.
            unsafe {
                let g = _mm512_maskz_loadu_ps(m, gate.as_ptr().add(c));
                let u = _mm512_maskz_loadu_ps(m, up.as_ptr().add(c));
                let a = _mm512_mul_ps(_mm512_mul_ps(g, sigmoid(g)), u);
                _mm512_mask_storeu_ps(act.as_mut_ptr().add(c), m, a);
            }
        }
    }

    /// # Safety
    /// AVX-512 F must be present; the slices have equal lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn backward(row: Backward<'_>) {
        let one = _mm512_set1_ps(1.0);
        for c in (0..row.gate.len()).step_by(16) {
            let m = mask(row.gate.len() - c);
            // SAFETY: as in `forward`.
            unsafe {
                let g = _mm512_maskz_loadu_ps(m, row.gate.as_ptr().add(c));
                let u = _mm512_maskz_loadu_ps(m, row.up.as_ptr().add(c));
                let da = _mm512_maskz_loadu_ps(m, row.d_act.as_ptr().add(c));
                let sg = sigmoid(g);
                let g_sg = _mm512_mul_ps(g, sg);
                let act = _mm512_mul_ps(g_sg, u);
                // d g = d act · u · σ · (1 + g · (1 − σ))
                let slope = _mm512_add_ps(one, _mm512_mul_ps(g, _mm512_sub_ps(one, sg)));
                let d_gate = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(da, u), sg), slope);
                let d_up = _mm512_mul_ps(da, g_sg);
                _mm512_mask_storeu_ps(row.act.as_mut_ptr().add(c), m, act);
                _mm512_mask_storeu_ps(row.d_gate.as_mut_ptr().add(c), m, d_gate);
                _mm512_mask_storeu_ps(row.d_up.as_mut_ptr().add(c), m, d_up);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// σ, silu · u and the gradients in f64.
    fn exact(g: f32, u: f32, da: f32) -> [f64; 3] {
        let (g, u, da) = (f64::from(g), f64::from(u), f64::from(da));
        let sg = 1.0 / (1.0 + (-g).exp());
        [
            g * sg * u,
            da * u * sg * (1.0 + g * (1.0 - sg)),
            da * g * sg,
        ]
    }

    #[test]
    fn matches_f64_on_the_whole_range_and_every_tail() {
        // Gates from −120 to 120 (saturated σ at both ends), lengths with every tail below 16.
        for len in [1usize, 15, 16, 17, 40, 333] {
            let gate: Vec<f32> = (0..len)
                .map(|c| (c as f32 / len as f32 - 0.5) * 240.0 + (c % 7) as f32 * 0.01)
                .collect();
            let up: Vec<f32> = (0..len).map(|c| (c % 5) as f32 * 0.5 - 1.0).collect();
            let d_act: Vec<f32> = (0..len).map(|c| (c % 3) as f32 - 0.75).collect();
            let mut act = vec![f32::NAN; len];
            forward(&gate, &up, &mut act);
            let (mut act_b, mut d_gate, mut d_up) = (
                vec![f32::NAN; len],
                vec![f32::NAN; len],
                vec![f32::NAN; len],
            );
            backward(Backward {
                gate: &gate,
                up: &up,
                d_act: &d_act,
                act: &mut act_b,
                d_gate: &mut d_gate,
                d_up: &mut d_up,
            });
            for c in 0..len {
                let want = exact(gate[c], up[c], d_act[c]);
                let got = [act[c], d_gate[c], d_up[c]];
                for (got, want) in got.iter().zip(want) {
                    let got = f64::from(*got);
                    assert!(
                        (got - want).abs() <= 1e-6 * (1.0 + want.abs()),
                        "len {len}, gate {}: {got} vs {want}",
                        gate[c]
                    );
                }
                assert_eq!(
                    act[c].to_bits(),
                    act_b[c].to_bits(),
                    "forward and backward agree"
                );
            }
        }
    }

    #[test]
    fn different_lengths_panic() {
        let result = std::panic::catch_unwind(|| forward(&[1.0; 3], &[1.0; 3], &mut [0.0; 2]));
        assert!(result.is_err());
    }
}
