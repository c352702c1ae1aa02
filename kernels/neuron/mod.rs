//! The Neuron runtime (libnrt) and the `neuron` backend.
//!
//! - [`runtime`]: the runtime bound through bindgen and opened at run time, behind safe types.
//! - [`status`]: `NRT_STATUS` codes by name.

pub mod runtime;
pub mod status;
mod sys;

pub use runtime::{
    Library, Model, NrtDType, Placement, Runtime, Tensor, TensorInfo, TensorSet, Usage, Version,
};
pub use status::Status;
