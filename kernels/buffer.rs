//! The element buffer of a tensor: a vector moekit owns, or memory another library lends for
//! reading (a libtorch tensor's storage, see `moekit::torch::lend_to_moekit`), so that a
//! kernel reads a caller's weights where they lie instead of a copy.

use std::any::Any;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Elements of type `T`, read as a slice (`Deref<Target = [T]>`).
pub struct Buffer<T> {
    repr: Repr<T>,
}

enum Repr<T> {
    Owned(Vec<T>),
    /// `len` elements from `start`, kept alive by `owner` and not written while any buffer
    /// that lends them exists (the contract of [`Buffer::lent`]).
    Lent {
        start: *const T,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    },
}

impl<T> Buffer<T> {
    /// Lent memory: the `len` elements from `start`, which `owner` keeps alive.
    ///
    /// # Safety
    ///
    /// `start` must point at `len` initialised, aligned elements of `T` (any pointer when
    /// `len` is 0) that stay valid while `owner` lives, and nothing may write to them while
    /// this buffer or any clone of it exists.
    pub unsafe fn lent(start: *const T, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        if len == 0 {
            return Vec::new().into();
        }
        Self {
            repr: Repr::Lent { start, len, owner },
        }
    }

    /// Whether the elements are lent by another library rather than owned.
    pub fn is_lent(&self) -> bool {
        matches!(self.repr, Repr::Lent { .. })
    }

    /// Keeps the first `len` elements (all of them if there are fewer), without copying.
    pub fn truncate(&mut self, len: usize) {
        match &mut self.repr {
            Repr::Owned(values) => values.truncate(len),
            Repr::Lent { len: lent, .. } => *lent = (*lent).min(len),
        }
    }
}

impl<T: Clone> Buffer<T> {
    /// The elements as a vector: an owned buffer's own, moved without a copy (so memory handed
    /// on from there, to libtorch say, is the memory the kernel wrote); a lent one's, copied.
    pub fn into_vec(self) -> Vec<T> {
        match self.repr {
            Repr::Owned(values) => values,
            Repr::Lent { .. } => self[..].to_vec(),
        }
    }
}

impl<T> From<Vec<T>> for Buffer<T> {
    fn from(values: Vec<T>) -> Self {
        Self {
            repr: Repr::Owned(values),
        }
    }
}

impl<T> Deref for Buffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.repr {
            Repr::Owned(values) => values,
            // SAFETY: `lent`'s contract: `len` initialised elements from a non-empty, aligned
            // `start`, alive while `owner` (held here) lives and unwritten meanwhile.
            Repr::Lent { start, len, .. } => unsafe { std::slice::from_raw_parts(*start, *len) },
        }
    }
}

// SAFETY: a lent buffer is only ever read, and its owner (`Send + Sync`) keeps the memory
// alive; an owned one is a `Vec<T>`. So sharing or sending one is as sound as for `Vec<T>`.
unsafe impl<T: Send + Sync> Send for Buffer<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Buffer<T> {}

impl<T: Clone> Clone for Buffer<T> {
    /// An owned buffer is copied; a lent one is lent again by the same owner.
    fn clone(&self) -> Self {
        match &self.repr {
            Repr::Owned(values) => values.clone().into(),
            Repr::Lent { start, len, owner } => Self {
                repr: Repr::Lent {
                    start: *start,
                    len: *len,
                    owner: Arc::clone(owner),
                },
            },
        }
    }
}

impl<T: PartialEq> PartialEq for Buffer<T> {
    /// Equal elements, whoever holds them.
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl<T: fmt::Debug> fmt::Debug for Buffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self[..].fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_memory_reads_as_the_lender_holds_it_while_the_owner_lives() {
        let values: Arc<Vec<f32>> = Arc::new((0..10).map(|i| i as f32 * 0.5).collect());
        let owner: Arc<dyn Any + Send + Sync> = values.clone();
        // SAFETY: `values` holds 10 f32 that `owner` keeps alive and nobody writes.
        let lent = unsafe { Buffer::lent(values.as_ptr(), values.len(), owner) };
        drop(values);
        assert!(lent.is_lent());
        let copy = lent.clone();
        drop(lent);
        assert!(copy.is_lent());
        assert_eq!(
            copy,
            Buffer::from((0..10).map(|i| i as f32 * 0.5).collect::<Vec<_>>())
        );
        assert_eq!(format!("{copy:?}"), format!("{:?}", &copy[..]));
    }

    #[test]
    fn an_owned_buffer_gives_up_its_vector_and_a_lent_one_a_copy() {
        let values: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let start = values.as_ptr();
        let owned = Buffer::from(values).into_vec();
        assert_eq!(owned.as_ptr(), start, "moved, not copied");
        let shared: Arc<Vec<f32>> = Arc::new(owned);
        let owner: Arc<dyn Any + Send + Sync> = shared.clone();
        // SAFETY: `shared` holds 8 f32 that `owner` keeps alive and nobody writes.
        let lent = unsafe { Buffer::lent(shared.as_ptr(), shared.len(), owner) };
        let copy = lent.into_vec();
        assert_ne!(
            copy.as_ptr(),
            shared.as_ptr(),
            "copied out of the lender's memory"
        );
        assert_eq!(copy, *shared);
    }

    #[test]
    fn truncating_keeps_the_leading_elements_of_owned_and_lent_buffers() {
        let values: Arc<Vec<i32>> = Arc::new((0..6).collect());
        let owner: Arc<dyn Any + Send + Sync> = values.clone();
        // SAFETY: `values` holds 6 i32 that `owner` keeps alive and nobody writes.
        let mut lent = unsafe { Buffer::lent(values.as_ptr(), values.len(), owner) };
        let mut owned = Buffer::from(values.to_vec());
        for buffer in [&mut lent, &mut owned] {
            buffer.truncate(9);
            assert_eq!(buffer[..], [0, 1, 2, 3, 4, 5]);
            buffer.truncate(4);
            assert_eq!(buffer[..], [0, 1, 2, 3]);
        }
        assert!(lent.is_lent() && !owned.is_lent());
    }

    #[test]
    fn an_empty_loan_is_an_owned_empty_buffer() {
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(());
        // SAFETY: no element is lent.
        let empty = unsafe { Buffer::<f32>::lent(std::ptr::null(), 0, owner) };
        assert!(!empty.is_lent());
        assert!(empty.is_empty());
    }
}
