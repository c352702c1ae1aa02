//! The routed experts of one MoE layer (moekit's [`LocalExperts`]: `permute`, then
//! `blockwise_mm`, and `blockwise_mm_bwd` for the backward), for `moekit.torch`'s autograd
//! function: the forward keeps the tensors it read and its checkpoints in a [`SavedExperts`],
//! which the backward takes.

use std::sync::Arc;

use moekit::contracts::{OutputDType, WeightLayout};
use moekit::experts::{Experts as _, ExpertsInputs, LocalExperts, LocalSaved};
use moekit::threads::release_openmp_workers;
use moekit::{BackendKind, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::dlpack::{self, Bits, Output};
use crate::errors::IntoPyResult;

/// The experts on one backend: `Experts(backend="cpu", block_size=64, output_dtype="input",
/// weight_layout="nki")`.
#[pyclass(module = "moekit._moekit", name = "Experts", frozen)]
pub struct PyExperts {
    experts: LocalExperts,
}

/// The tensors a forward read, owned (those lent by the caller stay alive with them).
struct ExpertsTensors {
    hidden_states: Tensor,
    expert_index: Tensor,
    topk_affinities: Tensor,
    gate_up_proj_weight: Tensor,
    down_proj_weight: Tensor,
    up_proj_weight: Option<Tensor>,
}

impl ExpertsTensors {
    fn inputs(&self) -> ExpertsInputs<'_> {
        ExpertsInputs {
            hidden_states: &self.hidden_states,
            expert_index: &self.expert_index,
            topk_affinities: &self.topk_affinities,
            gate_up_proj_weight: &self.gate_up_proj_weight,
            down_proj_weight: &self.down_proj_weight,
            up_proj_weight: self.up_proj_weight.as_ref(),
        }
    }
}

/// What a forward leaves its backward: the tensors it read, the plan and the checkpoints.
#[pyclass(module = "moekit._moekit", frozen)]
pub struct SavedExperts {
    tensors: ExpertsTensors,
    saved: LocalSaved,
}

fn import(capsule: &Bound<'_, PyCapsule>, name: &str) -> PyResult<Tensor> {
    dlpack::import(name, capsule, Bits::AsDeclared)
}

#[pymethods]
impl PyExperts {
    #[new]
    #[pyo3(signature = (backend = "cpu", block_size = LocalExperts::DEFAULT_BLOCK_SIZE, output_dtype = "input", weight_layout = "nki"))]
    fn new(
        py: Python<'_>,
        backend: &str,
        block_size: usize,
        output_dtype: &str,
        weight_layout: &str,
    ) -> PyResult<Self> {
        let kind: BackendKind = backend.parse().into_py_result(py)?;
        let output_dtype: OutputDType = output_dtype.parse().into_py_result(py)?;
        let weight_layout = WeightLayout::parse(weight_layout).into_py_result(py)?;
        if block_size == 0 {
            return Err(moekit::Error::param(
                "block_size",
                "must be at least 1, got 0",
            ))
            .into_py_result(py);
        }
        Ok(Self {
            experts: LocalExperts {
                backend: Arc::from(kind.create()),
                block_size,
                output_dtype,
                weight_layout,
            },
        })
    }

    /// `output [T, H]` of `hidden_states [T, H]` routed by `expert_index [T, K]` with
    /// `topk_affinities [T, K]` through `gate_up_proj_weight [E, H, 2, I]` and
    /// `down_proj_weight [E, I, H]` (`[E, 2, I, H]` and `[E, H, I]` in the linear layout, where
    /// with `up_proj_weight [E, I, H]` the up projection lies apart and `gate_up_proj_weight`
    /// is the gate's `[E, I, H]`; DLPack capsules, bf16 as DLPack bfloat16); with `record`,
    /// also what the backward needs.
    #[pyo3(signature = (hidden_states, expert_index, topk_affinities, gate_up_proj_weight, down_proj_weight, record, up_proj_weight = None))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        hidden_states: Bound<'_, PyCapsule>,
        expert_index: Bound<'_, PyCapsule>,
        topk_affinities: Bound<'_, PyCapsule>,
        gate_up_proj_weight: Bound<'_, PyCapsule>,
        down_proj_weight: Bound<'_, PyCapsule>,
        record: bool,
        up_proj_weight: Option<Bound<'_, PyCapsule>>,
    ) -> PyResult<(Output, Option<SavedExperts>)> {
        let tensors = ExpertsTensors {
            hidden_states: import(&hidden_states, "hidden_states")?,
            expert_index: import(&expert_index, "expert_index")?,
            topk_affinities: import(&topk_affinities, "topk_affinities")?,
            gate_up_proj_weight: import(&gate_up_proj_weight, "gate_up_proj_weight")?,
            down_proj_weight: import(&down_proj_weight, "down_proj_weight")?,
            up_proj_weight: up_proj_weight
                .map(|up| import(&up, "up_proj_weight"))
                .transpose()?,
        };
        let (output, saved) = py
            .detach(|| {
                release_openmp_workers();
                self.experts.forward(tensors.inputs(), record)
            })
            .into_py_result(py)?;
        let saved = saved.map(|saved| SavedExperts { tensors, saved });
        Ok((Output::new(output), saved))
    }

    /// The gradients for `d_output [T, H]` of the forward that left `saved`: `d_hidden_states
    /// [T, H]`, `d_topk_affinities [T, K]`, and `d_gate_up_proj_weight`, `d_down_proj_weight`
    /// shaped as their weights (`d_gate_up_proj_weight [E, 2, I, H]`, both projections', when
    /// `up_proj_weight` lay apart).
    fn backward(
        &self,
        py: Python<'_>,
        saved: &SavedExperts,
        d_output: Bound<'_, PyCapsule>,
    ) -> PyResult<Vec<(&'static str, Output)>> {
        let d_output = import(&d_output, "d_output")?;
        let grads = py
            .detach(|| {
                release_openmp_workers();
                self.experts
                    .backward(saved.tensors.inputs(), &saved.saved, &d_output)
            })
            .into_py_result(py)?;
        drop(d_output);
        Ok(vec![
            ("d_hidden_states", Output::new(grads.d_hidden_states)),
            ("d_topk_affinities", Output::new(grads.d_topk_affinities)),
            (
                "d_gate_up_proj_weight",
                Output::new(grads.d_gate_up_proj_weight),
            ),
            ("d_down_proj_weight", Output::new(grads.d_down_proj_weight)),
        ])
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.experts.block_size
    }

    #[getter]
    fn backend(&self) -> &'static str {
        self.experts.backend.name()
    }

    #[getter]
    fn weight_layout(&self) -> &'static str {
        self.experts.weight_layout.name()
    }
}
