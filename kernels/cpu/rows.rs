//! Row-wise stages the expert kernels share: gathering token rows, adding a bias row, clamping
//! gate/up rows, scaling rows, dot products of rows and adding scaled rows; each a loop over
//! f32 rows whose result depends only on the values: the dot product and the scaled sum run 16
//! lanes at a time on AVX-512 with the portable loop's multiply and add per term, so every level
//! gives the same bits. Passes over scattered rows fetch the rows ahead of the one they read.

use half::bf16;

use super::element::Element;
use super::isa::Isa;
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
/// matrix `[rows.len(), width]`, each row's next but one fetched into L2 ([`prefetch`]) while
/// it copies.
pub(super) fn gather_rows(values: Floats<'_>, rows: &[usize], width: usize, dst: &mut [f32]) {
    for (r, (&row, dst)) in rows.iter().zip(dst.chunks_exact_mut(width)).enumerate() {
        if let Some(&ahead) = rows.get(r + PREFETCH_ROWS_AHEAD) {
            prefetch_row(values, ahead, width);
        }
        values.slice(row * width..(row + 1) * width).write_f32(dst);
    }
}

/// How many rows ahead of the one it reads a row-wise pass over scattered rows (token rows
/// gathered by index) fetches: far enough for the lines to arrive before they are read.
pub(super) const PREFETCH_ROWS_AHEAD: usize = 2;

/// [`prefetch`]es row `row` of a `[rows, width]` float tensor.
pub(super) fn prefetch_row(values: Floats<'_>, row: usize, width: usize) {
    prefetch_floats(values.slice(row * width..(row + 1) * width));
}

/// [`prefetch`]es the lines of `values`, in either dtype.
pub(super) fn prefetch_floats(values: Floats<'_>) {
    match values {
        Floats::F32(values) => prefetch(values),
        Floats::BF16(values) => prefetch(values),
    }
}

/// Asks for every cache line of `values` in L2, without waiting for them: for scattered rows,
/// whose first lines the hardware prefetchers do not foresee. L2 rather than L1: the rows ahead
/// of a combine at Qwen3-30B-A3B's H are 128 KB, four times an L1. A hint only; no effect on
/// results. Measured on Zen 4, alternating calls in one process: into L2 rather than L1,
/// `blockwise_mm` at qwen3-moe-small took 11.36 against 11.56 ms, and 249.2 against 250.9 ms
/// at Qwen3-30B-A3B (T = 512); `blockwise_mm_bwd` at qwen3-moe-small 21.00 against 21.21.
pub(super) fn prefetch<T>(values: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        const LINE: usize = 64;
        let bytes = std::mem::size_of_val(values);
        let start = values.as_ptr().cast::<i8>();
        for offset in (0..bytes).step_by(LINE) {
            // SAFETY: a prefetch never faults; the address lies inside `values`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(offset)) };
        }
    }
}

/// The first `len` elements of the scratch buffer `buffer`, as a slice to overwrite. The
/// buffer grows to hold them but never shrinks, so a task that reuses it for a shorter and then
/// a longer length clears nothing (`Vec::resize` would clear what it grows back into); what
/// lies past `len` is left over from earlier uses, which is why callers read the slice, never
/// the buffer whole.
pub(super) fn resized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
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
/// On AVX-512 the partial sums are one register, with the same multiply and add per term, so
/// the result does not depend on the level.
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let whole = a.len().min(b.len()) / LANES * LANES;
    #[cfg(target_arch = "x86_64")]
    let lanes = if Isa::Avx512.enabled() {
        // SAFETY: AVX-512 F is enabled; both slices hold at least `whole` elements.
        unsafe { x86::lane_sums(&a[..whole], &b[..whole]) }
    } else {
        lane_sums(&a[..whole], &b[..whole])
    };
    #[cfg(not(target_arch = "x86_64"))]
    let lanes = lane_sums(&a[..whole], &b[..whole]);
    let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(a, b)| a * b).sum();
    lanes.iter().sum::<f32>() + tail
}

/// The [`LANES`] partial sums of [`dot`] over slices of a whole number of lanes.
fn lane_sums(a: &[f32], b: &[f32]) -> [f32; LANES] {
    let mut lanes = [0.0f32; LANES];
    for (a, b) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
        // Plain multiply and add: `mul_add` is a library call where the build does not
        // assume FMA.
        for lane in 0..LANES {
            lanes[lane] += a[lane] * b[lane];
        }
    }
    lanes
}

/// `out[j] += w · v[j]` (a multiply, then an add, as on every level) over the shorter length.
pub(super) fn add_scaled(out: &mut [f32], w: f32, v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: AVX-512 F is enabled.
        unsafe { x86::add_scaled(out, w, v) };
        return;
    }
    for (o, v) in out.iter_mut().zip(v) {
        *o += w * v;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::LANES;
    use crate::cpu::exp::x86::mask;

    /// [`super::lane_sums`] in one register.
    ///
    /// # Safety
    /// AVX-512 F must be present; `a` and `b` have equal lengths, a multiple of [`LANES`].
    #[target_feature(enable = "avx512f")]
    pub unsafe fn lane_sums(a: &[f32], b: &[f32]) -> [f32; LANES] {
        let mut acc = _mm512_setzero_ps();
        for (a, b) in a.chunks_exact(LANES).zip(b.chunks_exact(LANES)) {
            // SAFETY: each chunk holds 16 elements.
            unsafe {
                let product =
                    _mm512_mul_ps(_mm512_loadu_ps(a.as_ptr()), _mm512_loadu_ps(b.as_ptr()));
                acc = _mm512_add_ps(acc, product);
            }
        }
        let mut lanes = [0.0f32; LANES];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes
    }

    /// [`super::add_scaled`], 16 lanes at a time.
    ///
    /// # Safety
    /// AVX-512 F must be present.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn add_scaled(out: &mut [f32], w: f32, v: &[f32]) {
        let len = out.len().min(v.len());
        let w = _mm512_set1_ps(w);
        for c in (0..len).step_by(LANES) {
            let m = mask(len - c);
            // SAFETY: the masked lanes lie inside both slices from c on; lanes past the end
            // are neither read nor written.
            unsafe {
                let o = _mm512_maskz_loadu_ps(m, out.as_ptr().add(c));
                let x = _mm512_maskz_loadu_ps(m, v.as_ptr().add(c));
                let sum = _mm512_add_ps(o, _mm512_mul_ps(w, x));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(c), m, sum);
            }
        }
    }
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

    /// Values whose products and sums round: any change of arithmetic or order shows.
    fn inexact(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 + seed) * 0.37).sin() * 3.1)
            .collect()
    }

    #[test]
    fn dot_gives_the_portable_loops_bits_at_the_active_level() {
        for n in [0, 5, LANES, LANES + 3, 16 * LANES + 9] {
            let (a, b) = (inexact(n, 0.5), inexact(n, 2.0));
            let whole = n / LANES * LANES;
            let tail: f32 = a[whole..].iter().zip(&b[whole..]).map(|(a, b)| a * b).sum();
            let want = lane_sums(&a[..whole], &b[..whole]).iter().sum::<f32>() + tail;
            assert_eq!(
                dot(&a, &b).to_bits(),
                want.to_bits(),
                "n = {n} at level {}",
                Isa::active()
            );
        }
    }

    #[test]
    fn add_scaled_adds_each_product_to_its_value() {
        for n in [0, 1, LANES - 1, LANES, 3 * LANES + 5] {
            let (start, v) = (inexact(n, 1.0), inexact(n, 7.0));
            let mut out = start.clone();
            add_scaled(&mut out, 0.3, &v);
            for (j, ((&got, &o), &x)) in out.iter().zip(&start).zip(&v).enumerate() {
                assert_eq!(got.to_bits(), (o + 0.3 * x).to_bits(), "[{j}] of {n}");
            }
        }
    }
}
