//! The kernel catalog as Python data: the contracts the package's typed functions, their
//! signatures and docstrings are built from, read off the same declarations as `moekit list`.

use moekit::contracts::TensorSpec;
use moekit::kernel::{Kernel, ParamUse};
use pyo3::prelude::*;
use pyo3::types::PyDict;

fn tensor_dict<'py>(py: Python<'py>, spec: &TensorSpec) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("name", spec.name)?;
    dict.set_item("shape", spec.shape)?;
    dict.set_item("dtype", spec.dtype.to_string())?;
    dict.set_item("required", spec.required)?;
    Ok(dict)
}

/// Every kernel's contract: `name`, `summary`, `inputs` and `outputs` (each `name`, `shape`,
/// `dtype`, `required`) and `params` (each `name`, `required`, `default`, `values`).
#[pyfunction]
pub fn kernels(py: Python<'_>) -> PyResult<Vec<Bound<'_, PyDict>>> {
    Kernel::ALL
        .iter()
        .map(|kernel| {
            let spec = kernel.spec();
            let dict = PyDict::new(py);
            dict.set_item("name", spec.name)?;
            dict.set_item("summary", spec.summary)?;
            let tensors = |specs: &[TensorSpec]| {
                specs
                    .iter()
                    .map(|spec| tensor_dict(py, spec))
                    .collect::<PyResult<Vec<_>>>()
            };
            dict.set_item("inputs", tensors(spec.inputs)?)?;
            dict.set_item("outputs", tensors(spec.outputs)?)?;
            let params = spec
                .params
                .iter()
                .map(|&(param, usage)| {
                    let dict = PyDict::new(py);
                    dict.set_item("name", param.name())?;
                    dict.set_item("required", usage == ParamUse::Required)?;
                    dict.set_item("default", param.default_value(*kernel))?;
                    dict.set_item("values", param.values())?;
                    Ok(dict)
                })
                .collect::<PyResult<Vec<_>>>()?;
            dict.set_item("params", params)?;
            Ok(dict)
        })
        .collect()
}
