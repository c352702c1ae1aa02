//! The element types the cpu kernels write floating-point outputs in: f32, or bf16 rounded
//! once (to nearest even) from the f32 result where it is produced, while it is in cache, so
//! that a bf16 output costs no pass of its own over memory. Results are screened on their f32
//! values against the largest magnitude the element type holds, so a result too large for bf16
//! is reported with its value, like an f32 overflow.

use std::mem::MaybeUninit;

use half::bf16;

use super::isa::Isa;
use crate::contracts::validate;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// An element type of float outputs.
pub(super) trait Element: Copy + Send + Sync + 'static {
    /// The output dtype it stores.
    const DTYPE: DType;
    /// The magnitude bits (an f32's bits without the sign) from which an f32 value does not
    /// round to a finite value of this type: f32's infinity, or the least that rounds to bf16's.
    const MAGNITUDE_LIMIT: u32;

    /// `x` rounded to nearest even.
    fn round(x: f32) -> Self;

    /// The value, widened exactly to f32.
    fn widen(self) -> f32;

    /// Index of the first infinity or NaN of `values`.
    fn first_non_finite(values: &[Self]) -> Option<usize>;

    /// An output tensor of `shape` holding `values`.
    fn tensor(shape: &[usize], values: Vec<Self>) -> Result<Tensor>;

    /// `slots` as f32 slots when this type is f32, so that f32 results are written in place
    /// rather than copied in.
    fn as_f32_slots(slots: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]>;

    /// `values` as f32 when this type is f32 ([`Self::as_f32_slots`] for values written).
    fn as_f32_mut(values: &mut [Self]) -> Option<&mut [f32]>;

    /// Writes `values` rounded ([`Self::round`]) into `dst` (of the same length); returns
    /// whether every one is finite in this type.
    fn write_rounded(dst: &mut [MaybeUninit<Self>], values: &[f32]) -> bool {
        debug_assert_eq!(dst.len(), values.len());
        for (slot, &x) in dst.iter_mut().zip(values) {
            slot.write(Self::round(x));
        }
        all_fit::<Self>(values)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    const MAGNITUDE_LIMIT: u32 = 0x7f80_0000;

    fn round(x: f32) -> Self {
        x
    }

    fn widen(self) -> f32 {
        self
    }

    fn first_non_finite(values: &[Self]) -> Option<usize> {
        validate::first_non_finite_f32(values)
    }

    fn tensor(shape: &[usize], values: Vec<Self>) -> Result<Tensor> {
        Tensor::from_f32(shape, values)
    }

    fn as_f32_slots(slots: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]> {
        Some(slots)
    }

    fn as_f32_mut(values: &mut [Self]) -> Option<&mut [f32]> {
        Some(values)
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
    /// Halfway between bf16's largest finite value (`0x7f7f`) and infinity: a tie, which rounds
    /// to the even neighbour, infinity.
    const MAGNITUDE_LIMIT: u32 = 0x7f7f_8000;

    fn round(x: f32) -> Self {
        let bits = x.to_bits();
        // Branch-free round to nearest even on the bits (vectorises); NaN stays a quiet NaN.
        // Only NaNs wrap (their bits lie above every number's), and they are replaced below.
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        let value = if x.is_nan() { 0x7fc0 } else { rounded };
        bf16::from_bits(value as u16)
    }

    fn widen(self) -> f32 {
        self.to_f32()
    }

    fn first_non_finite(values: &[Self]) -> Option<usize> {
        validate::first_non_finite_bf16(values)
    }

    fn tensor(shape: &[usize], values: Vec<Self>) -> Result<Tensor> {
        Tensor::from_bf16(shape, values)
    }

    fn as_f32_slots(_: &mut [MaybeUninit<Self>]) -> Option<&mut [MaybeUninit<f32>]> {
        None
    }

    fn as_f32_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }

    /// 16 values at a time on AVX-512 (the same rounding and screening on the bits), where
    /// the active level has it: a weight gradient of a large layer is gigabytes of them.
    fn write_rounded(dst: &mut [MaybeUninit<Self>], values: &[f32]) -> bool {
        assert_eq!(dst.len(), values.len());
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.enabled() {
            // SAFETY: the active level is at most the detected one: AVX-512 F is here; the
            // lengths are equal.
            return unsafe { x86::write_rounded_bf16(dst, values) };
        }
        for (slot, &x) in dst.iter_mut().zip(values) {
            slot.write(Self::round(x));
        }
        all_fit::<Self>(values)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use half::bf16;

    use super::Element;

    /// [`Element::write_rounded`] for bf16: `bf16::round` and `all_fit` on 16 lanes.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F; `dst` and `values` have the same length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn write_rounded_bf16(dst: &mut [MaybeUninit<bf16>], values: &[f32]) -> bool {
        let full = values.len() / 16 * 16;
        let (bias, one) = (_mm512_set1_epi32(0x7fff), _mm512_set1_epi32(1));
        let quiet_nan = _mm512_set1_epi32(0x7fc0);
        let (magnitude, limit) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(<bf16 as Element>::MAGNITUDE_LIMIT as i32),
        );
        let mut beyond: __mmask16 = 0;
        for at in (0..full).step_by(16) {
            // SAFETY: at + 16 ≤ len for both slices.
            unsafe {
                let x = _mm512_loadu_ps(values.as_ptr().add(at));
                let bits = _mm512_castps_si512(x);
                let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), one);
                let rounded =
                    _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, _mm512_add_epi32(bias, odd)));
                let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
                let rounded = _mm512_mask_mov_epi32(rounded, nan, quiet_nan);
                _mm256_storeu_si256(
                    dst.as_mut_ptr().add(at).cast(),
                    _mm512_cvtepi32_epi16(rounded),
                );
                beyond |= _mm512_cmp_epu32_mask::<_MM_CMPINT_NLT>(
                    _mm512_and_si512(bits, magnitude),
                    limit,
                );
            }
        }
        for (slot, &x) in dst[full..].iter_mut().zip(&values[full..]) {
            slot.write(<bf16 as Element>::round(x));
        }
        beyond == 0 && super::all_fit::<bf16>(&values[full..])
    }

    /// [`super::all_below`] on four registers of 16 lanes a step, the tail masked.
    ///
    /// # Safety
    /// The CPU must support AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn all_below(values: &[f32], limit: u32) -> bool {
        let (magnitude, limit) = (
            _mm512_set1_epi32(0x7fff_ffff),
            _mm512_set1_epi32(limit as i32),
        );
        let beyond = |bits: __m512i| {
            _mm512_cmp_epu32_mask::<_MM_CMPINT_NLT>(_mm512_and_si512(bits, magnitude), limit)
        };
        let mut chunks = values.chunks_exact(64);
        let mut any: __mmask16 = 0;
        for chunk in &mut chunks {
            // SAFETY: each chunk holds 64 values, four registers.
            unsafe {
                for lanes in 0..4 {
                    any |= beyond(_mm512_loadu_si512(chunk.as_ptr().add(16 * lanes).cast()));
                }
            }
        }
        for lanes in chunks.remainder().chunks(16) {
            let mask = ((1u32 << lanes.len()) - 1) as __mmask16;
            // SAFETY: the masked load reads only the chunk's `lanes.len()` values.
            any |= beyond(unsafe { _mm512_maskz_loadu_epi32(mask, lanes.as_ptr().cast()) });
        }
        any == 0
    }
}

/// Whether every value of `values` rounds to a finite `E` (for screening a task's results
/// while they are in cache): an OR of magnitude comparisons, branch-free, 64 values a step on
/// AVX-512 where the active level has it, else the portable loop, which vectorises at the
/// baseline x86-64 level (an unsigned maximum needs SSE4.1 and ran scalar).
pub(super) fn all_fit<E: Element>(values: &[f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if Isa::Avx512.enabled() {
        // SAFETY: the active level is at most the detected one: AVX-512 F is here.
        return unsafe { x86::all_below(values, E::MAGNITUDE_LIMIT) };
    }
    all_below(values, E::MAGNITUDE_LIMIT)
}

/// Whether every value's magnitude bits (its bits without the sign) are below `limit`.
fn all_below(values: &[f32], limit: u32) -> bool {
    values.iter().fold(0u32, |beyond, x| {
        beyond | u32::from(x.to_bits() & 0x7fff_ffff >= limit)
    }) == 0
}

/// Writes `values` rounded to `E` into `dst` (of the same length); returns whether every one
/// is finite in `E`.
pub(super) fn write_rounded<E: Element>(dst: &mut [MaybeUninit<E>], values: &[f32]) -> bool {
    E::write_rounded(dst, values)
}

/// Writes zeros into every slot of `dst`.
pub(super) fn write_zeros<E: Element>(dst: &mut [MaybeUninit<E>]) {
    let zero = E::round(0.0);
    for slot in dst {
        slot.write(zero);
    }
}

/// Refuses output `name` of `shape` if one of its values is an infinity or NaN: an error
/// naming the output, the position and the value.
pub(super) fn ensure_finite<E: Element>(name: &str, shape: &[usize], values: &[E]) -> Result<()> {
    match E::first_non_finite(values) {
        None => Ok(()),
        Some(index) => Err(Error::invalid(
            name,
            format!(
                "result {} at {} does not fit in {}",
                values[index].widen(),
                crate::tensor::position(shape, index),
                E::DTYPE
            ),
        )),
    }
}

/// Output `name` of `shape` holding `values`, refusing non-finite ones.
pub(super) fn finite_output<E: Element>(
    name: &str,
    shape: &[usize],
    values: Vec<E>,
) -> Result<Tensor> {
    ensure_finite(name, shape, &values)?;
    E::tensor(shape, values)
}

/// Output `name` of `shape` holding `values`, which the tasks that wrote them screened (`fits`:
/// every one was finite in `E`); searched again, for the error, only when one was not.
pub(super) fn screened_output<E: Element>(
    name: &str,
    shape: &[usize],
    values: Vec<E>,
    fits: bool,
) -> Result<Tensor> {
    if !fits {
        ensure_finite(name, shape, &values)?;
    }
    E::tensor(shape, values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uninit::{assume_init, uninit};

    #[test]
    fn bf16_rounding_matches_the_half_crate_on_every_kind_of_value() {
        let specials = [
            0.0f32,
            -0.0,
            1.0,
            -1.5,
            f32::MIN_POSITIVE,
            f32::from_bits(1),
            f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::from_bits(0x3f80_8000), // a tie, to even (down)
            f32::from_bits(0x3f81_8000), // a tie, to even (up)
            f32::from_bits(0x7f7f_7fff), // the largest that stays finite
            f32::from_bits(0x7f7f_8000), // the least that rounds to infinity
        ];
        let stride = (0..u32::MAX).step_by(65_521).map(f32::from_bits);
        for x in specials.into_iter().chain(stride) {
            let ours = <bf16 as Element>::round(x);
            let theirs = bf16::from_f32(x);
            if x.is_nan() {
                assert!(ours.is_nan(), "{x:e}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{x:e}");
            }
            let fits = all_fit::<bf16>(&[x]);
            assert_eq!(fits, ours.is_finite(), "{x:e}");
            assert_eq!(all_fit::<f32>(&[x]), x.is_finite(), "{x:e}");
        }
    }

    #[test]
    fn the_active_levels_screen_agrees_with_the_portable_loop_at_every_position() {
        // A value beyond each limit at every position of the four-register body and of every
        // length of tail, among values that fit.
        let limits = [
            <f32 as Element>::MAGNITUDE_LIMIT,
            <bf16 as Element>::MAGNITUDE_LIMIT,
        ];
        let screens = |values: &[f32]| [all_fit::<f32>(values), all_fit::<bf16>(values)];
        let beyond = [f32::NAN, f32::NEG_INFINITY, f32::from_bits(0x7f7f_8000)];
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 100, 143] {
            let fitting: Vec<f32> = (0..len).map(|v| v as f32 * -0.75 + 3.0).collect();
            assert_eq!(screens(&fitting), [true, true], "length {len}");
            for at in 0..len {
                for bad in beyond {
                    let mut values = fitting.clone();
                    values[at] = bad;
                    let expected = limits.map(|limit| all_below(&values, limit));
                    assert_eq!(screens(&values), expected, "{bad} at {at} of {len}");
                }
            }
        }
    }

    #[test]
    fn screening_tells_finite_slices_from_slices_with_any_non_finite_value() {
        let finite = [0.0, -0.0, f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e-45];
        assert!(all_fit::<f32>(&finite));
        assert!(all_fit::<f32>(&[]));
        assert!(!all_fit::<bf16>(&finite), "f32::MAX overflows bf16");
        for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for at in 0..=finite.len() {
                let mut values = finite.to_vec();
                values.insert(at, bad);
                assert!(!all_fit::<f32>(&values), "{bad} at {at}");
            }
        }
    }

    #[test]
    fn long_slices_round_and_screen_as_each_value_does() {
        // Every kind of value in the 16-lane body and in the tail, at every position.
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::from_bits(0x7f7f_8000),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            -0.0,
            f32::from_bits(1),
        ];
        let values: Vec<f32> = (0..1000u32)
            .map(|i| f32::from_bits(i.wrapping_mul(2_654_435_761)))
            .chain(specials)
            .collect();
        for len in [15, 16, 17, 100, values.len()] {
            for start in [0, 3] {
                let values = &values[start..start + len.min(values.len() - start)];
                let mut dst = uninit::<bf16>(values.len());
                let fits = write_rounded(&mut dst, values);
                // SAFETY: `write_rounded` wrote every slot.
                let got = unsafe { assume_init(dst) };
                for (g, &x) in got.iter().zip(values) {
                    let want = <bf16 as Element>::round(x);
                    assert_eq!(g.to_bits(), want.to_bits(), "{x:e}");
                }
                assert_eq!(fits, values.iter().all(|&x| all_fit::<bf16>(&[x])));
            }
        }
        let finite = vec![1.5f32; 40];
        for at in 0..finite.len() {
            let mut values = finite.clone();
            values[at] = f32::from_bits(0x7f7f_8000);
            assert!(!write_rounded(&mut uninit::<bf16>(40), &values), "{at}");
        }
        assert!(write_rounded(&mut uninit::<bf16>(40), &finite));
    }

    #[test]
    fn written_values_are_rounded_and_screened() {
        let values = [1.0f32, 1.0 + f32::EPSILON, -3.4e38, 2.5];
        let mut dst = uninit::<bf16>(values.len());
        assert!(!write_rounded(&mut dst, &values));
        // SAFETY: `write_rounded` wrote every slot.
        let rounded = unsafe { assume_init(dst) };
        let want: Vec<bf16> = values.iter().map(|&x| bf16::from_f32(x)).collect();
        assert_eq!(rounded, want);
        let err = screened_output("w_grad", &[2, 2], rounded, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`w_grad`") && err.contains("[1, 0]") && err.contains("bf16"),
            "{err}"
        );

        let mut dst = uninit::<f32>(2);
        assert!(write_rounded(&mut dst, &[1.0, -2.0]));
    }
}
