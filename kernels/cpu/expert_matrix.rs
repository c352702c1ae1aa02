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
//!
//! Under `linear` the gate/up matrix may come in two tensors (moekit's `up_proj_weight`:
//! torchtitan's `w1` and `w3`): its stored rows `[2I, H]` are then the gate's `[I, H]` and the
//! up's `[I, H]`, each read where it lies. A product against it runs as one product per half,
//! whose columns (the forward) or sums (the backward) then meet in the result.

use std::cell::RefCell;
use std::mem::MaybeUninit;

use half::bf16;

use super::bf16_matmul::{self, matmul_bf16, matmul_bf16_nt};
use super::dot::matmul_nt_bf16;
use super::matmul::{MatRef, matmul, matmul_bf16_b, matmul_into};
use super::rows::resized;
use crate::contracts::{BlockwiseFloats, WeightLayout};
use crate::tensor::Floats;
use crate::uninit::zero;

/// Scratch buffers of the bf16 products, reused between calls: a panel of weights widened to
/// f32, and a tile of results.
pub(super) type Panels<'s> = (&'s mut Vec<f32>, &'s mut Vec<f32>);

thread_local! {
    /// A half of a product against a matrix stored in two tensors, reused between calls.
    static HALF: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Expert `expert`'s `W [k, n]` in a weight tensor of E such matrices.
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertMatrix<'a> {
    /// The expert's `k · n` elements: `[k, n]` under [`WeightLayout::Nki`], `[n, k]` under
    /// [`WeightLayout::Linear`]; with `lower`, the first `n / 2` rows `[n / 2, k]` only.
    stored: Floats<'a>,
    /// Under [`WeightLayout::Linear`] only: the last `n / 2` stored rows, held apart.
    lower: Option<Floats<'a>>,
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
            lower: None,
            k,
            n,
            layout,
        }
    }

    /// Expert `expert`'s gate/up matrix `W [H, 2I]` of a blockwise call's weights in `layout`:
    /// `gate_up_proj_weight`'s, or the gate's rows there and the up's in `up_proj_weight`.
    pub fn gate_up(
        floats: &BlockwiseFloats<'a>,
        layout: WeightLayout,
        expert: usize,
        (h, i): (usize, usize),
    ) -> Self {
        let Some(up) = floats.up_proj_weight else {
            return Self::of(floats.gate_up_proj_weight, layout, expert, (h, 2 * i));
        };
        let rows = expert * i * h..(expert + 1) * i * h;
        Self {
            stored: floats.gate_up_proj_weight.slice(rows.clone()),
            lower: Some(up.slice(rows)),
            k: h,
            n: 2 * i,
            layout,
        }
    }

    /// Whether [`Self::product_bf16`] runs here: the matrix is bf16 and the CPU has the pair
    /// dot products.
    pub fn takes_bf16_rows(&self) -> bool {
        matches!(self.stored, Floats::BF16(_)) && bf16_matmul::available()
    }

    /// `dst [m, n] = a [m, k] · W` on bf16 pair dot products, for bf16 rows `a` at row stride
    /// `lda` (even, the column past an odd k zero), where [`Self::takes_bf16_rows`]: against
    /// the matrix as stored (nki's layout) or in dot-product form against its transpose
    /// (`linear`, each half of split rows filling its columns).
    ///
    /// # Panics
    /// Where it does not take them.
    pub fn product_bf16(&self, dst: &mut [f32], (a, lda): (&[bf16], usize)) {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / n.max(1);
        match (self.layout, self.stored, self.lower) {
            (WeightLayout::Nki, Floats::BF16(w), None) => {
                matmul_bf16(dst, (a, lda), (w, n), (m, n, k))
            }
            (WeightLayout::Linear, Floats::BF16(w), None) => {
                matmul_bf16_nt((dst, n), (a, lda), (w, k), (m, n, k))
            }
            (WeightLayout::Linear, Floats::BF16(gate), Some(Floats::BF16(up))) => {
                let half = n / 2;
                matmul_bf16_nt((&mut *dst, n), (a, lda), (gate, k), (m, half, k));
                matmul_bf16_nt((&mut dst[half..], n), (a, lda), (up, k), (m, half, k));
            }
            _ => panic!("product_bf16 of a matrix that does not take bf16 rows"),
        }
    }

    /// `dst [m, k] = a [m, n] · Wᵀ` on bf16 pair dot products for bf16 rows `a [m, n]`, where
    /// the matrix is bf16 and the CPU has them: in dot-product form against the matrix as
    /// stored (nki's layout), or against its transpose as stored (`linear`, where n, or each
    /// half of split rows, is even, as the pairs need). Returns whether it ran (nothing is
    /// written otherwise).
    pub fn transposed_product_bf16(&self, dst: &mut [f32], a: &[bf16]) -> bool {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / k.max(1);
        if !self.takes_bf16_rows() {
            return false;
        }
        match (self.layout, self.stored, self.lower) {
            (WeightLayout::Nki, Floats::BF16(w), None) => {
                matmul_bf16_nt((dst, k), (a, n), (w, n), (m, k, n));
            }
            (WeightLayout::Linear, Floats::BF16(w), None) if n.is_multiple_of(2) => {
                matmul_bf16(dst, (a, n), (w, k), (m, k, n));
            }
            (WeightLayout::Linear, Floats::BF16(gate), Some(Floats::BF16(up)))
                if (n / 2).is_multiple_of(2) =>
            {
                // `a`'s first n / 2 columns against the gate's rows, plus the rest against the
                // up's.
                let half = n / 2;
                matmul_bf16(dst, (a, n), (gate, k), (m, k, half));
                HALF.with_borrow_mut(|sum| {
                    let sum = resized(sum, m * k);
                    matmul_bf16(sum, (&a[half..], n), (up, k), (m, k, half));
                    for (d, v) in dst.iter_mut().zip(sum.iter()) {
                        *d += v;
                    }
                });
            }
            _ => return false,
        }
        true
    }

    /// The matrices of the two halves of the stored rows, when they lie apart.
    fn halves(&self) -> Option<[Self; 2]> {
        let lower = self.lower?;
        let upper = Self {
            lower: None,
            n: self.n / 2,
            ..*self
        };
        Some([
            upper,
            Self {
                stored: lower,
                ..upper
            },
        ])
    }

    /// `dst [m, n] = a [m, k] · W` for row-major `a`.
    pub fn product(&self, dst: &mut [f32], a: &[f32], (panel, tile): Panels<'_>) {
        let (k, n) = (self.k, self.n);
        let m = dst.len() / n.max(1);
        if let Some(halves) = self.halves() {
            // Each half's product fills its columns of `dst`.
            let width = n / 2;
            HALF.with_borrow_mut(|half| {
                let half = resized(half, m * width);
                for (matrix, first) in halves.iter().zip([0, width]) {
                    matrix.product(half, a, (&mut *panel, &mut *tile));
                    for (dst, row) in dst.chunks_exact_mut(n).zip(half.chunks_exact(width)) {
                        dst[first..first + width].copy_from_slice(row);
                    }
                }
            });
            return;
        }
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
        match (self.layout, self.stored, self.lower) {
            (WeightLayout::Nki, Floats::F32(w), None) => {
                matmul_into(dst, MatRef::row_major(a, m, k), MatRef::row_major(w, k, n))
            }
            (WeightLayout::Linear, Floats::F32(w), None) => matmul_into(
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
        match (self.layout, self.stored, self.lower) {
            (WeightLayout::Nki, Floats::F32(w), None) => matmul_into(
                dst,
                MatRef::row_major(a, m, n),
                MatRef::row_major(w, k, n).t(),
            ),
            (WeightLayout::Linear, Floats::F32(w), None) => {
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
        if let Some([upper, lower]) = self.halves() {
            // `a`'s first n / 2 columns against the upper rows, plus the rest against the lower.
            let a = MatRef::row_major(a, m, n);
            let (left, right) = (a.columns(0..n / 2), a.columns(n / 2..n));
            match (upper.stored, lower.stored) {
                (Floats::BF16(upper), Floats::BF16(lower)) => {
                    matmul_bf16_b(dst, left, (upper, k), panel);
                    HALF.with_borrow_mut(|half| {
                        let half = resized(half, m * k);
                        matmul_bf16_b(half, right, (lower, k), panel);
                        for (d, v) in dst.iter_mut().zip(half.iter()) {
                            *d += v;
                        }
                    });
                }
                // f32 (the contract gives both halves one dtype), read in place.
                (upper, lower) => {
                    let (upper, lower) = (upper.to_f32(), lower.to_f32());
                    matmul(dst, left, MatRef::row_major(&upper, n / 2, k), false);
                    matmul(dst, right, MatRef::row_major(&lower, n / 2, k), true);
                }
            }
            return;
        }
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
