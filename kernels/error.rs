//! The library's error type. Every variant names the tensor, parameter or file at fault and
//! states what was expected, so a kernel developer can fix the input without reading the code.

use std::path::PathBuf;

use crate::tensor::DType;

/// Result alias used throughout moekit.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when validating or running a kernel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor has the wrong rank or extent.
    #[error("tensor `{tensor}`: expected shape {expected}, got {actual:?}")]
    Shape {
        tensor: String,
        expected: String,
        actual: Vec<usize>,
    },
    /// A tensor has the wrong element type.
    #[error("tensor `{tensor}`: expected dtype {expected}, got {actual}")]
    DType {
        tensor: String,
        expected: String,
        actual: DType,
    },
    /// A floating-point tensor holds NaN or ±Inf.
    #[error("tensor `{tensor}`: non-finite value {value} at {position}")]
    NonFinite {
        tensor: String,
        position: String,
        value: f32,
    },
    /// A tensor's values break the contract (out-of-range ids, duplicates, non-zero padding).
    #[error("tensor `{tensor}`: {message}")]
    InvalidValue { tensor: String, message: String },
    /// A kernel parameter is missing, unknown or out of range.
    #[error("param `{param}`: {message}")]
    Param { param: String, message: String },
    /// A tensor was built from a buffer whose length does not match its shape.
    #[error("buffer of {len} elements does not match shape {shape:?} ({expected} elements)")]
    ElementCount {
        shape: Vec<usize>,
        len: usize,
        expected: usize,
    },
    /// An output the parameters ask for is too large to allocate.
    // The cause is part of the message, not a `source` (which would print it twice in a
    // chain of causes).
    #[error("cannot allocate {what}: {error}")]
    Allocation {
        what: String,
        error: std::collections::TryReserveError,
    },
    /// A tensor's shape has more elements than an address space holds, or an extent past
    /// `i64::MAX`.
    #[error(
        "shape {shape:?} is too large: more elements than fit in memory, or an extent past i64::MAX"
    )]
    ShapeOverflow { shape: Vec<usize> },
    /// A kernel input required by the contract is absent.
    #[error("missing input tensor `{0}`")]
    MissingTensor(String),
    /// A kernel name that no contract defines.
    #[error("unknown kernel `{name}`; known kernels: {known}")]
    UnknownKernel { name: String, known: String },
    /// A backend name that this build does not provide.
    #[error("unknown backend `{name}`; available backends: {known}")]
    UnknownBackend { name: String, known: String },
    /// Reading or writing a file failed.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    /// A file exists but its contents are not what the format requires.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// A collective operation of a rank group failed: bad arguments, a rank that left or timed
    /// out, or an error that another rank reported (`rank` is the rank at fault).
    #[error("rank {rank}: {message}")]
    Collective { rank: usize, message: String },
    /// An environment variable moekit reads holds a value it cannot use.
    #[error("environment variable {variable}={value}: {message}")]
    Environment {
        variable: String,
        value: String,
        message: String,
    },
    /// The Neuron runtime library cannot be opened, or lacks a function moekit calls.
    #[error("Neuron runtime library: {0}")]
    NeuronLibrary(String),
    /// A Neuron runtime call returned a status other than `NRT_SUCCESS`, or was refused because
    /// the runtime is closed. `status` is the documented name, e.g. `NRT_EXEC_OOB`.
    #[error("{call} failed with {status}: {context}")]
    NeuronStatus {
        call: &'static str,
        status: String,
        context: String,
    },
    /// A NEFF (or the manifest naming it) does not fit the kernel call: a missing or extra
    /// tensor, or a shape, dtype or size that differs from the contract's.
    #[error("{}: {message}", neff.display())]
    Neff { neff: PathBuf, message: String },
    /// A backend that does not run this kernel.
    #[error("backend `{backend}` does not run `{kernel}`: {message}")]
    Unsupported {
        backend: &'static str,
        kernel: &'static str,
        message: String,
    },
}

/// The item of `items` called `wanted`, or else the comma-separated names of all of them (for
/// an "unknown …; known: …" message).
pub fn find_named<T: Copy>(
    items: &[T],
    name: impl Fn(T) -> &'static str,
    wanted: &str,
) -> std::result::Result<T, String> {
    items
        .iter()
        .copied()
        .find(|&item| name(item) == wanted)
        .ok_or_else(|| {
            let known: Vec<&str> = items.iter().map(|&item| name(item)).collect();
            known.join(", ")
        })
}

impl Error {
    /// A [`Error::Shape`] of `tensor`: `expected` in the contract's notation, e.g. `[T, H]`.
    pub fn shape(tensor: &str, expected: impl Into<String>, actual: &[usize]) -> Self {
        Self::Shape {
            tensor: tensor.to_owned(),
            expected: expected.into(),
            actual: actual.to_vec(),
        }
    }

    /// An [`Error::InvalidValue`] of `tensor`.
    pub fn invalid(tensor: &str, message: impl Into<String>) -> Self {
        Self::InvalidValue {
            tensor: tensor.to_owned(),
            message: message.into(),
        }
    }

    /// An [`Error::Param`] of `param`.
    pub fn param(param: &str, message: impl Into<String>) -> Self {
        Self::Param {
            param: param.to_owned(),
            message: message.into(),
        }
    }
}
