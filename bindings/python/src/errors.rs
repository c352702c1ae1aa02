//! moekit's errors as Python exceptions of the package's own classes (`moekit.errors`):
//! `ContractError` (also a `ValueError`) for input that breaks a kernel's contract — a wrong
//! shape, dtype, value, parameter, a missing tensor, an unknown kernel or backend —,
//! `AllocationError` (also a `MemoryError`) for outputs too large to allocate, and `Error` for
//! the rest (files, the Neuron runtime, a backend that does not run a kernel). Every message is
//! the Rust error's, naming the tensor, parameter or file.

use moekit::Error;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// The class in `moekit.errors` that `error` is raised as.
fn class_name(error: &Error) -> &'static str {
    match error {
        Error::Shape { .. }
        | Error::DType { .. }
        | Error::NonFinite { .. }
        | Error::InvalidValue { .. }
        | Error::Param { .. }
        | Error::ElementCount { .. }
        | Error::ShapeOverflow { .. }
        | Error::MissingTensor(_)
        | Error::UnknownKernel { .. }
        | Error::UnknownBackend { .. } => "ContractError",
        Error::Allocation { .. } => "AllocationError",
        _ => "Error",
    }
}

/// `error` as the Python exception of its class.
pub fn to_py_err(py: Python<'_>, error: Error) -> PyErr {
    let class = py
        .import("moekit.errors")
        .and_then(|module| module.getattr(class_name(&error)))
        .and_then(|class| Ok(class.cast_into::<PyType>()?));
    match class {
        Ok(class) => PyErr::from_type(class, error.to_string()),
        Err(import_error) => import_error,
    }
}

/// moekit results as Python results.
pub trait IntoPyResult<T> {
    fn into_py_result(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for moekit::Result<T> {
    fn into_py_result(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|error| to_py_err(py, error))
    }
}
