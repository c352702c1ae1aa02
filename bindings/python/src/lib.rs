//! `moekit._moekit`: the extension module under the Python package `moekit`. It runs any kernel
//! by its contract names on DLPack tensors ([`dlpack`]), lists the contracts the package builds
//! its typed functions from, and compares outputs computed elsewhere (an NKI kernel) against
//! the reference. The Python package (`bindings/python/python/moekit`) turns NumPy arrays and
//! PyTorch tensors into capsules and the outputs back into the caller's array type.

mod catalog;
mod dlpack;
mod errors;
mod experts;

use std::collections::BTreeMap;

use moekit::backend::Tolerance;
use moekit::experts::LocalExperts;
use moekit::kernel::{Kernel, Params, SCHEDULE_ONLY_PARAMS};
use moekit::neuron::NeuronBackend;
use moekit::threads::release_openmp_workers;
use moekit::{BackendKind, Storage, Tensor};
use moekit_tools::check::{self, CheckRow};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict};

use dlpack::{Bits, Output};
use errors::IntoPyResult;

/// Inputs as the package hands them over: name, DLPack capsule, and whether the capsule holds
/// bf16 as uint16 bits.
type CapsuleInputs<'py> = Vec<(String, Bound<'py, PyCapsule>, bool)>;

fn import_tensors(inputs: CapsuleInputs<'_>) -> PyResult<BTreeMap<String, Tensor>> {
    inputs
        .into_iter()
        .map(|(name, capsule, bf16_bits)| {
            let bits = if bf16_bits {
                Bits::Bf16AsU16
            } else {
                Bits::AsDeclared
            };
            let tensor = dlpack::import(&name, &capsule, bits)?;
            Ok((name, tensor))
        })
        .collect()
}

fn parse_params(params: Vec<(String, String)>) -> moekit::Result<Params> {
    let mut parsed = Params::default();
    for (name, value) in params {
        parsed.set(&name, &value)?;
    }
    Ok(parsed)
}

/// Runs `kernel` on `backend` with the named inputs and parameters (values as `moekit run
/// --param` takes them); returns every output by name. The GIL is released while it runs.
#[pyfunction]
fn run(
    py: Python<'_>,
    kernel: &str,
    backend: &str,
    tensors: CapsuleInputs<'_>,
    params: Vec<(String, String)>,
) -> PyResult<Vec<(&'static str, Output)>> {
    let kernel: Kernel = kernel.parse().into_py_result(py)?;
    let backend: BackendKind = backend.parse().into_py_result(py)?;
    let params = parse_params(params).into_py_result(py)?;
    let tensors = import_tensors(tensors)?;
    let outputs = py
        .detach(|| {
            release_openmp_workers();
            kernel.run(backend.create().as_ref(), &tensors, &params)
        })
        .into_py_result(py)?;
    // The inputs lent by the caller are released here, with the GIL held.
    drop(tensors);
    Ok(outputs
        .into_iter()
        .map(|(name, tensor)| (name, Output::new(tensor)))
        .collect())
}

/// One output's comparison, as `moekit check` reports it.
fn row_dict<'py>(py: Python<'py>, row: &CheckRow) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("tensor", row.tensor)?;
    dict.set_item("elements", row.elements)?;
    dict.set_item("max_abs", row.max_abs)?;
    dict.set_item("max_rel", row.max_rel)?;
    dict.set_item("failures", row.failures)?;
    dict.set_item("passed", row.pass())?;
    Ok(dict)
}

/// Compares `outputs` (computed elsewhere, e.g. by an NKI kernel) with the reference's on
/// `inputs`: returns one row per given output and the report `moekit check` prints.
#[pyfunction]
#[pyo3(signature = (kernel, inputs, outputs, params, rtol, atol))]
fn compare<'py>(
    py: Python<'py>,
    kernel: &str,
    inputs: CapsuleInputs<'py>,
    outputs: CapsuleInputs<'py>,
    params: Vec<(String, String)>,
    rtol: f64,
    atol: f64,
) -> PyResult<(Vec<Bound<'py, PyDict>>, String)> {
    let kernel: Kernel = kernel.parse().into_py_result(py)?;
    let params = parse_params(params).into_py_result(py)?;
    let tolerance = Tolerance { rtol, atol };
    let inputs = import_tensors(inputs)?;
    let outputs = import_tensors(outputs)?;
    let rows = py
        .detach(|| check::check_outputs(kernel, &inputs, &params, &outputs, tolerance))
        .into_py_result(py)?;
    drop((inputs, outputs));
    let table = check::table(
        &format!("{} (given outputs)", kernel.name()),
        &rows,
        tolerance,
    );
    let rows = rows
        .iter()
        .map(|row| row_dict(py, row))
        .collect::<PyResult<_>>()?;
    Ok((rows, table))
}

/// Where a kernel reads the input in `capsule` (consumed): the address of its first element,
/// and whether that is the caller's memory (read in place) rather than a copy. For tests and
/// diagnostics.
#[pyfunction]
fn input_address(
    name: &str,
    capsule: Bound<'_, PyCapsule>,
    bf16_bits: bool,
) -> PyResult<(usize, bool)> {
    let tensors = import_tensors(vec![(name.to_owned(), capsule, bf16_bits)])?;
    let (address, lent) = match tensors[name].storage() {
        Storage::F32(b) => (b.as_ptr() as usize, b.is_lent()),
        Storage::BF16(b) => (b.as_ptr() as usize, b.is_lent()),
        Storage::I32(b) => (b.as_ptr() as usize, b.is_lent()),
    };
    Ok((address, lent))
}

/// The `neuron` backend's documented error bound `(rtol, atol)`: `moekit.compare`'s default
/// for outputs of NKI kernels.
#[pyfunction]
fn neuron_tolerance() -> (f64, f64) {
    let Tolerance { rtol, atol } = NeuronBackend::TOLERANCE;
    (rtol, atol)
}

/// The backends this build provides, by name.
#[pyfunction]
fn backends() -> Vec<&'static str> {
    BackendKind::ALL.iter().map(|kind| kind.name()).collect()
}

#[pymodule]
fn _moekit(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("BUILD", moekit::BUILD)?;
    module.add("SCHEDULE_ONLY_PARAMS", SCHEDULE_ONLY_PARAMS.to_vec())?;
    module.add("DEFAULT_BLOCK_SIZE", LocalExperts::DEFAULT_BLOCK_SIZE)?;
    module.add_function(wrap_pyfunction!(run, module)?)?;
    module.add_function(wrap_pyfunction!(compare, module)?)?;
    module.add_function(wrap_pyfunction!(catalog::kernels, module)?)?;
    module.add_function(wrap_pyfunction!(backends, module)?)?;
    module.add_function(wrap_pyfunction!(neuron_tolerance, module)?)?;
    module.add_function(wrap_pyfunction!(input_address, module)?)?;
    module.add_class::<Output>()?;
    module.add_class::<experts::PyExperts>()?;
    module.add_class::<experts::SavedExperts>()?;
    Ok(())
}
