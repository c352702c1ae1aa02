//! libtorch failing to allocate memory, as an error rather than a panic.
//!
//! tch's infallible methods panic on a C++ exception, so libtorch's `DefaultCPUAllocator:
//! can't allocate memory` unwinds as a panic. [`catch`] returns
//! that panic as an error naming the bytes asked for and lets every other panic unwind on;
//! [`quiet_allocation_panics`] keeps the panic hook from printing it as a panic first.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};

use anyhow::{Result, anyhow};

use crate::footprint::gib;

/// What libtorch's CPU allocator says when an allocation fails (host memory: the limits the
/// error names are the host's).
const ALLOCATION_FAILURE: &str = "can't allocate memory";

/// Installs a panic hook that stays silent for libtorch's allocation failures (which
/// [`catch`] reports as errors) and hands every other panic to the hook installed before.
pub fn quiet_allocation_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if allocation_failure(info.payload()).is_none() {
            previous(info);
        }
    }));
}

/// Runs `f`; a libtorch allocation failure inside it becomes an error naming the bytes
/// libtorch asked for. Other panics unwind on.
pub fn catch<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(payload) => match allocation_failure(payload.as_ref()) {
            Some(failure) => Err(anyhow!(failure)),
            None => resume_unwind(payload),
        },
    }
}

/// The error for a panic that is a libtorch allocation failure, or `None`.
fn allocation_failure(payload: &(dyn Any + Send)) -> Option<String> {
    let text = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())?;
    text.contains(ALLOCATION_FAILURE).then(|| {
        // "… you tried to allocate 68719476736 bytes. Error code 12 …"
        let asked = text
            .split("tried to allocate ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|bytes| bytes.parse::<u128>().ok());
        let asked = match asked {
            Some(bytes) => format!("{} ({bytes} bytes)", gib(bytes)),
            None => "memory".to_owned(),
        };
        format!(
            "libtorch could not allocate {asked}: the work needs more memory than this \
                 process may use (physical memory, the cgroup's memory.max, ulimit -v); give it \
                 fewer tokens at once"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_failures_are_recognised_and_sized() {
        let panic = "called `Result::unwrap()` on an `Err` value: Torch(\"[enforce fail at \
                     alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you \
                     tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)\")"
            .to_owned();
        let failure = allocation_failure(&panic).unwrap();
        assert!(
            failure.starts_with("libtorch could not allocate 64.0 GiB (68719476736 bytes):"),
            "{failure}"
        );
        assert_eq!(allocation_failure(&"CUDA out of memory."), None);
        assert_eq!(allocation_failure(&"index out of bounds".to_owned()), None);
        assert_eq!(allocation_failure(&7u32), None);
    }

    /// libtorch's own failure: 128 TiB of f32 is more than an x86-64 process's whole address
    /// space, so no machine grants it, whatever its overcommit policy.
    #[test]
    fn a_real_libtorch_allocation_failure_is_an_error() {
        let err = catch(|| {
            let huge = tch::Tensor::empty([1i64 << 45], (tch::Kind::Float, tch::Device::Cpu));
            Ok(huge.numel())
        })
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("libtorch could not allocate 131072.0 GiB (140737488355328 bytes):"),
            "{err}"
        );
    }

    #[test]
    fn catch_turns_only_allocation_failures_into_errors() {
        let err = catch::<()>(|| panic!("DefaultCPUAllocator: can't allocate memory")).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("libtorch could not allocate memory:")
        );
        assert_eq!(catch(|| Ok(3)).unwrap(), 3);
        let other = catch_unwind(|| catch::<()>(|| panic!("something else")));
        assert!(other.is_err());
    }
}
