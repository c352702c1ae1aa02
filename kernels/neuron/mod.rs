//! The Neuron runtime (libnrt) and the `neuron` backend.
//!
//! - [`runtime`]: the runtime bound through bindgen and opened at run time, behind safe types.
//! - [`backend`]: [`NeuronBackend`], the kernel contracts executed as NEFFs.
//! - [`manifest`]: `kernels.toml`, which NEFF runs which kernel call.
//! - [`limits`]: nki-library's hardware limits on a manifest entry's shapes.
//! - [`status`]: `NRT_STATUS` codes by name.

pub mod backend;
pub mod limits;
pub mod manifest;
pub mod runtime;
mod shapes;
pub mod status;

/// The raw bindings ([`moekit_nrt_sys`]), used only by [`runtime`].
use moekit_nrt_sys as sys;

pub use backend::{NeuronBackend, NeuronConfig};
pub use runtime::{
    Library, Model, NrtDType, Placement, Runtime, Tensor, TensorInfo, TensorSet, Usage, Version,
};
pub use status::Status;
