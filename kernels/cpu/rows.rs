//! Row-wise stages the expert kernels share: gathering token rows, adding a bias row, clamping
//! gate/up rows, scaling rows, dot products of rows; each a plain loop over f32 rows whose
//! result depends only on the values.

use half::bf16;

use super::element::Element;
use crate::contracts::{Clamp, ClampLimits};
use crate::tensor::Floats;

/// Expert `expert`'s `len` values of a bias stored `[E, len]` (f32 or bf16), as f32.
pub(super) fn bias_row(bias: Floats<'_>, expert: usize, len: usize) -> Vec<f32> {
    bias.slice(expert * len..(expert + 1) * len)
        .to_f32()
        .into_owned()
}

/// Adds `bias` to every `bias.len()`-long row of `rows`.
pub(super) fn add_bias_rows(rows: &mut [f32], bias: &[f32]) {
    for row in rows.chunks_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// Clamps the gate half and the up half of every `[2I]` row (I = `i`) of `rows`.
pub(super) fn clamp_rows(rows: &mut [f32], i: usize, clamp: ClampLimits) {
    if clamp == ClampLimits::default() {
        return;
    }
    let limit = |v: f32, c: Clamp| {
        let v = c.lower.map_or(v, |lo| v.max(lo));
        c.upper.map_or(v, |hi| v.min(hi))
    };
    for row in rows.chunks_mut(2 * i) {
        let (gate, up) = row.split_at_mut(i);
        gate.iter_mut().for_each(|v| *v = limit(*v, clamp.gate));
        up.iter_mut().for_each(|v| *v = limit(*v, clamp.up));
    }
}

/// Multiplies each `width`-long row of `rows` by its entry of `scales`.
pub(super) fn scale_rows(rows: &mut [f32], width: usize, scales: &[f32]) {
    for (row, &scale) in rows.chunks_mut(width).zip(scales) {
        for v in row {
            *v *= scale;
        }
    }
}

/// Copies the listed rows of a `[rows, width]` float tensor into `dst` as a contiguous f32
/// matrix `[rows.len(), width]`.
pub(super) fn gather_rows(values: Floats<'_>, rows: &[usize], width: usize, dst: &mut [f32]) {
    for (&row, dst) in rows.iter().zip(dst.chunks_exact_mut(width)) {
        values.slice(row * width..(row + 1) * width).write_f32(dst);
    }
}

/// `buffer` resized to `len` elements, as a slice to overwrite.
pub(super) fn resized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    buffer
}

/// Rounds every value to the nearest bf16 (ties to even), kept in f32 (a matmul operand under
/// `compute_dtype` bf16), and, when `copy` is not empty (it is then as long), into `copy`.
pub(super) fn round_to_bf16(values: &mut [f32], copy: &mut [bf16]) {
    if copy.is_empty() {
        for v in values {
            *v = bf16::round(*v).to_f32();
        }
    } else {
        for (v, c) in values.iter_mut().zip(copy) {
            *c = bf16::round(*v);
            *v = c.to_f32();
        }
    }
}

/// `rows [·, width]` rounded to bf16 into `dst`, each row padded with a zero to an even
/// length (the row stride [`matmul_bf16`](super::bf16_matmul::matmul_bf16) takes).
pub(super) fn bf16_rows(dst: &mut Vec<bf16>, rows: &[f32], width: usize) {
    dst.clear();
    for row in rows.chunks_exact(width.max(1)) {
        dst.extend(row.iter().map(|&v| bf16::round(v)));
        dst.resize(dst.len().next_multiple_of(2), bf16::ZERO);
    }
}

/// Accumulators of a row sum: enough independent chains to keep the adders busy.
pub(super) const LANES: usize = 16;

/// `Σ_j a[j]·b[j]`, over [`LANES`] interleaved partial sums added in lane order, then the tail.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let whole = a.len() / LANES * LANES;
    let mut lanes = [0.0f32; LANES];
    for (a, b) in a[..whole]
        .chunks_exact(LANES)
        .zip(b[..whole].chunks_exact(LANES))
    {
        // Plain multiply and add: `mul_add` is a library call where the build does not
        // assume FMA.
        for lane in 0..LANES {
            lanes[lane] += a[lane] * b[lane];
        }
    }
    let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(a, b)| a * b).sum();
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_dot_equals_the_sum_of_products_for_every_tail_length() {
        for n in [0, 1, LANES - 1, LANES, LANES + 3, 5 * LANES + 7] {
            let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.5).collect();
            // Small integers and halves: every partial sum is exact in f32.
            let want: f32 = a.iter().zip(&b).map(|(a, b)| a * b).sum();
            assert_eq!(dot(&a, &b), want, "n = {n}");
        }
    }
}
