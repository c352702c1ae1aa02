//! One expert's weight matrix as stored, in either [`WeightLayout`], and the products the
//! blockwise kernels take with it, each read straight from the weights (never transposed or
//! widened whole).
//!
//! The matrix is `W [k, n]` as the forward applies it, `y [m, n] = x [m, k] · W`: `[k, n]` in
//! memory under nki's layout (`[H, 2I]` per expert for gate/up, `[I, H]` for down) and
//! `[n, k]` under `linear`. A product against the matrix as stored runs on packed panels
//! ([`matmul`], or [`matmul_bf16_b`] widening bf16 a panel at a time); a product against its
//! transpose runs in dot-product form ([`matmul_nt`], [`matmul_nt_bf16`]), whose operands both
//! stream along the inner dimension. The layout decides which of `x · W` (the forward) and
//! `d y · Wᵀ` (the backward) takes which form, except that the f32 forward on `linear` weights
//! packs the transposed view into panels too ([`matmul`] on [`MatRef::t`]): on the trainer's
//! small shapes the dot-product form ran that forward about a third slower.

use std::mem::MaybeUninit;

use super::dot::matmul_nt_bf16;
use super::matmul::{MatRef, matmul, matmul_bf16_b, matmul_into};
use crate::contracts::WeightLayout;
use crate::tensor::Floats;
use crate::uninit::zero;

/// Scratch buffers of the bf16 products, reused between calls: a panel of weights widened to
/// f32, and a tile of results.
pub(super) type Panels<'s> = (&'s mut Vec<f32>, &'s mut Vec<f32>);

/// Expert `expert`'s `W [k, n]` in a weight tensor of E such matrices.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertMatrix<'a> {
    /// The expert's `k · n` elements: `[k, n]` under [`WeightLayout::Nki`], `[n, k]` under
    /// [`WeightLayout::Linear`].
    stored: Floats<'a>,
    k: usize,
    n: usize,
    layout: WeightLayout,
}

impl<'a> ExpertMatrix<'a> {
    /// Expert `expert`'s matrix of `weights`, which holds E matrices `W [k, n]` in `layout`.
    pub fn of(
        weights: Floats<'a>,
        layout: WeightLayout,
        expert: usize,
        (k, n): (usize, usize),
    ) -> Self {
        Self {
            stored: weights.slice(expert * k * n..(expert + 1) * k * n),
            k,
            n,
            layout,
        }
    }

    /// `dst [m, n] = a [m, k] · W` for row-major `a`.
    pub fn product(&self, dst: &mut [f32], a: &[f32], (panel, tile): Panels<'_>) {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / n.max(1);
        match (self.layout, self.stored) {
            (WeightLayout::Nki, Floats::F32(w)) => matmul(
                dst,
                MatRef::row_major(a, m, k),
                MatRef::row_major(w, k, n),
                false,
            ),
            (WeightLayout::Nki, Floats::BF16(w)) => {
                matmul_bf16_b(dst, MatRef::row_major(a, m, k), (w, n), panel)
            }
            (WeightLayout::Linear, Floats::F32(w)) => matmul(
                dst,
                MatRef::row_major(a, m, k),
                MatRef::row_major(w, n, k).t(),
                false,
            ),
            (WeightLayout::Linear, Floats::BF16(w)) => {
                matmul_nt_bf16(dst, a, w, (m, n, k), (panel, tile))
            }
        }
    }

    /// [`Self::product`] into memory not yet written; returns `dst` as the values it now holds.
    pub fn product_into<'d>(
        &self,
        dst: &'d mut [MaybeUninit<f32>],
        a: &[f32],
        panels: Panels<'_>,
    ) -> &'d mut [f32] {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / n.max(1);
        match (self.layout, self.stored) {
            (WeightLayout::Nki, Floats::F32(w)) => {
                matmul_into(dst, MatRef::row_major(a, m, k), MatRef::row_major(w, k, n))
            }
            (WeightLayout::Linear, Floats::F32(w)) => matmul_into(
                dst,
                MatRef::row_major(a, m, k),
                MatRef::row_major(w, n, k).t(),
            ),
            _ => {
                let dst = zero(dst);
                self.product(dst, a, panels);
                dst
            }
        }
    }

    /// [`Self::transposed_product`] into memory not yet written; returns `dst` as the values it
    /// now holds.
    pub fn transposed_product_into<'d>(
        &self,
        dst: &'d mut [MaybeUninit<f32>],
        a: &[f32],
        panels: Panels<'_>,
    ) -> &'d mut [f32] {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / k.max(1);
        match (self.layout, self.stored) {
            (WeightLayout::Nki, Floats::F32(w)) => matmul_into(
                dst,
                MatRef::row_major(a, m, n),
                MatRef::row_major(w, k, n).t(),
            ),
            (WeightLayout::Linear, Floats::F32(w)) => {
                matmul_into(dst, MatRef::row_major(a, m, n), MatRef::row_major(w, n, k))
            }
            _ => {
                let dst = zero(dst);
                self.transposed_product(dst, a, panels);
                dst
            }
        }
    }

    /// `dst [m, k] = a [m, n] · Wᵀ` for row-major `a`.
    pub fn transposed_product(&self, dst: &mut [f32], a: &[f32], (panel, tile): Panels<'_>) {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / k.max(1);
        match (self.layout, self.stored) {
            (WeightLayout::Nki, Floats::F32(w)) => matmul(
                dst,
                MatRef::row_major(a, m, n),
                MatRef::row_major(w, k, n).t(),
                false,
            ),
            (WeightLayout::Nki, Floats::BF16(w)) => {
                matmul_nt_bf16(dst, a, w, (m, k, n), (panel, tile))
            }
            (WeightLayout::Linear, Floats::F32(w)) => matmul(
                dst,
                MatRef::row_major(a, m, n),
                MatRef::row_major(w, n, k),
                false,
            ),
            (WeightLayout::Linear, Floats::BF16(w)) => {
                matmul_bf16_b(dst, MatRef::row_major(a, m, n), (w, k), panel)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;
    use crate::cpu::test_values::values;

    /// `W [k, n]` of `w` (`[k, n]` row-major) stored in `layout`, twice (experts 0 and 1, the
    /// second `w` negated), in f32 and rounded to bf16.
    fn stored(w: &[f32], (k, n): (usize, usize), layout: WeightLayout) -> (Vec<f32>, Vec<bf16>) {
        let mut out = Vec::with_capacity(2 * k * n);
        for sign in [1.0, -1.0] {
            match layout {
                WeightLayout::Nki => out.extend(w.iter().map(|v| sign * v)),
                WeightLayout::Linear => {
                    out.extend((0..n * k).map(|at| sign * w[(at % k) * n + at / k]))
                }
            }
        }
        let rounded = out.iter().map(|&v| bf16::from_f32(v)).collect();
        (out, rounded)
    }

    fn assert_close(got: &[f32], expected: &[f64], what: &str) {
        for (g, e) in got.iter().zip(expected) {
            assert!(
                (f64::from(*g) - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "{what}: {g} vs {e}"
            );
        }
    }

    #[test]
    fn both_layouts_give_the_products_of_the_same_matrix() {
        // Shapes below and above the register-tile and panel limits.
        for (m, k, n) in [(1, 1, 1), (3, 5, 7), (17, 70, 33), (40, 600, 24)] {
            let a = values(m * k, 1);
            let d = values(m * n, 2);
            let w = values(k * n, 3);
            let w_rounded: Vec<f32> = w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            for layout in WeightLayout::ALL {
                let (f32_weights, bf16_weights) = stored(&w, (k, n), layout);
                for (weights, exact, dtype) in [
                    (Floats::F32(&f32_weights), &w, "f32"),
                    (Floats::BF16(&bf16_weights), &w_rounded, "bf16"),
                ] {
                    // Expert 1 holds −W.
                    let matrix = ExpertMatrix::of(weights, layout, 1, (k, n));
                    let (mut panel, mut tile) = (Vec::new(), Vec::new());
                    let what = format!("{layout} {dtype} {m}×{k}×{n}");
                    let expected: Vec<f64> = (0..m * n)
                        .map(|at| {
                            let (r, c) = (at / n, at % n);
                            -(0..k)
                                .map(|j| f64::from(a[r * k + j]) * f64::from(exact[j * n + c]))
                                .sum::<f64>()
                        })
                        .collect();
                    let mut got = vec![f32::NAN; m * n];
                    matrix.product(&mut got, &a, (&mut panel, &mut tile));
                    assert_close(&got, &expected, &what);
                    let mut unwritten = vec![MaybeUninit::new(f32::NAN); m * n];
                    let got = matrix.product_into(&mut unwritten, &a, (&mut panel, &mut tile));
                    assert_close(got, &expected, &what);

                    let expected_t: Vec<f64> = (0..m * k)
                        .map(|at| {
                            let (r, j) = (at / k, at % k);
                            -(0..n)
                                .map(|c| f64::from(d[r * n + c]) * f64::from(exact[j * n + c]))
                                .sum::<f64>()
                        })
                        .collect();
                    let mut got = vec![f32::NAN; m * k];
                    matrix.transposed_product(&mut got, &d, (&mut panel, &mut tile));
                    assert_close(&got, &expected_t, &what);
                }
            }
        }
    }
}
