//! Buffers that are written whole before they are read (exchange receive buffers, kernel
//! outputs): allocated without clearing them first, since clearing would be a pass over tens
//! of megabytes for nothing, made by one thread. Where zeros are part of the result, the task
//! that writes a part clears it in place ([`zero`]), in parallel and while it is in cache.

use std::mem::{ManuallyDrop, MaybeUninit};

/// `len` values to be written.
pub(crate) fn uninit<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut buffer = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`, and `MaybeUninit` needs no initialisation.
    unsafe { buffer.set_len(len) };
    buffer
}

/// The `shape.iter().product()` values of output `name`, to be written; an error naming it when
/// they cannot be allocated ([`crate::tensor::try_capacity`]).
pub(crate) fn try_uninit<T>(
    name: &str,
    shape: &[usize],
) -> crate::error::Result<Vec<MaybeUninit<T>>> {
    let what = crate::contracts::spec::output_named(name);
    let mut buffer = crate::tensor::try_capacity(&what, shape)?;
    // The count did not overflow: the capacity for it was reserved.
    let len = shape.iter().product();
    // SAFETY: the capacity is at least `len`, and `MaybeUninit` needs no initialisation.
    unsafe { buffer.set_len(len) };
    Ok(buffer)
}

/// The values of a buffer whose every element has been written.
///
/// # Safety
/// Every element of `buffer` must be initialised.
pub(crate) unsafe fn assume_init<T>(buffer: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut buffer = ManuallyDrop::new(buffer);
    let (ptr, len, capacity) = (buffer.as_mut_ptr(), buffer.len(), buffer.capacity());
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, so the allocation is a valid `Vec<T>`
    // allocation of the same capacity, and the caller guarantees its elements are initialised.
    unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, capacity) }
}

/// The values of slots that have all been written.
///
/// # Safety
/// Every element of `slots` must be initialised.
pub(crate) unsafe fn assume_init_ref(slots: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and the caller guarantees every slot is
    // initialised.
    unsafe { &*(std::ptr::from_ref(slots) as *const [f32]) }
}

/// Writes `values` into the first `values.len()` slots of `slots`.
pub(crate) fn write_copy<T: Copy>(slots: &mut [MaybeUninit<T>], values: &[T]) {
    for (slot, &value) in slots[..values.len()].iter_mut().zip(values) {
        slot.write(value);
    }
}

/// Writes zeros into every slot of `slots`; returns them as the values they now hold.
pub(crate) fn zero(slots: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    for slot in slots.iter_mut() {
        slot.write(0.0);
    }
    // SAFETY: every slot was just written, and `MaybeUninit<f32>` has `f32`'s layout.
    unsafe { &mut *(std::ptr::from_mut(slots) as *mut [f32]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_buffers_keep_their_values() {
        let mut buffer = uninit::<f32>(5);
        write_copy(&mut buffer[..2], &[0.0, 0.5]);
        write_copy(&mut buffer[2..], &[1.0, 1.5, 2.0]);
        // SAFETY: every element was just written.
        let values = unsafe { assume_init(buffer) };
        assert_eq!(values, [0.0, 0.5, 1.0, 1.5, 2.0]);
    }

    #[test]
    fn zeroed_slots_read_as_zeros_and_take_writes() {
        let mut buffer = uninit::<f32>(37);
        let values = zero(&mut buffer[3..]);
        assert!(values.iter().all(|v| v.to_bits() == 0));
        values[0] = 2.5;
        write_copy(&mut buffer[..3], &[1.0; 3]);
        // SAFETY: slots 0..3 were written by `write_copy`, the rest by `zero`.
        let values = unsafe { assume_init(buffer) };
        assert_eq!(values[..4], [1.0, 1.0, 1.0, 2.5]);
        assert!(values[4..].iter().all(|&v| v == 0.0));
    }
}
