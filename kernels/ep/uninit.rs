//! Receive buffers that are written whole before they are read: allocated without clearing
//! them first (clearing would be a pass over tens of megabytes for nothing).

use std::mem::{ManuallyDrop, MaybeUninit};

/// `len` values to be written.
pub(super) fn uninit<T>(len: usize) -> Vec<MaybeUninit<T>> {
    let mut buffer = Vec::with_capacity(len);
    // SAFETY: the capacity is `len`, and `MaybeUninit` needs no initialisation.
    unsafe { buffer.set_len(len) };
    buffer
}

/// The values of a buffer whose every element has been written.
///
/// # Safety
/// Every element of `buffer` must be initialised.
pub(super) unsafe fn assume_init<T>(buffer: Vec<MaybeUninit<T>>) -> Vec<T> {
    let mut buffer = ManuallyDrop::new(buffer);
    let (ptr, len, capacity) = (buffer.as_mut_ptr(), buffer.len(), buffer.capacity());
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, so the allocation is a valid `Vec<T>`
    // allocation of the same capacity, and the caller guarantees its elements are initialised.
    unsafe { Vec::from_raw_parts(ptr.cast::<T>(), len, capacity) }
}

/// Writes `values` into the first `values.len()` slots of `slots`.
pub(super) fn write_copy<T: Copy>(slots: &mut [MaybeUninit<T>], values: &[T]) {
    for (slot, &value) in slots[..values.len()].iter_mut().zip(values) {
        slot.write(value);
    }
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
}
