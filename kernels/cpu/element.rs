//! The element types the cpu kernels write floating-point outputs in: f32, or bf16 rounded
//! once (to nearest even) from the f32 result where it is produced, while it is in cache, so
//! that a bf16 output costs no pass of its own over memory. Results are screened on their f32
//! values against the largest magnitude the element type holds, so a result too large for bf16
//! is reported with its value, like an f32 overflow.

use std::mem::MaybeUninit;

use half::bf16;

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
}

/// Whether every value of `values` rounds to a finite `E` (for screening a task's results
/// while they are in cache): an OR of magnitude comparisons, branch-free, which vectorises at
/// the baseline x86-64 level (an unsigned maximum needs SSE4.1 and ran scalar).
pub(super) fn all_fit<E: Element>(values: &[f32]) -> bool {
    values.iter().fold(0u32, |beyond, x| {
        beyond | u32::from(x.to_bits() & 0x7fff_ffff >= E::MAGNITUDE_LIMIT)
    }) == 0
}

/// Writes `values` rounded to `E` into `dst` (of the same length); returns whether every one
/// is finite in `E`.
pub(super) fn write_rounded<E: Element>(dst: &mut [MaybeUninit<E>], values: &[f32]) -> bool {
    debug_assert_eq!(dst.len(), values.len());
    for (slot, &x) in dst.iter_mut().zip(values) {
        slot.write(E::round(x));
    }
    all_fit::<E>(values)
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
