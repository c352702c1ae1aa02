//! # moekit
//!
//! Mixture-of-Experts kernels whose tensor contracts follow the AWS Neuron NKI library kernels
//! (`router_topk`, the MoE blockwise matmul and its backward), so the same tensors can be fed to
//! an NKI kernel on Trainium2 and to moekit and compared.
//!
//! Units: T tokens, H hidden size, E experts, K top-k, I expert intermediate size, B block size,
//! N blocks, L layers. Layouts are row-major and written outermost first, e.g. `[E, H, 2, I]`.
//!
//! - [`contracts`]: names, shapes, semantics and validation of every kernel.
//! - [`backend`]: the [`Backend`] trait and run-time backend selection.
//! - [`reference`]: the f64 oracle backend.
//! - [`kernel`]: the kernel catalog and running any kernel by name on named tensors.
//! - [`golden`]: named-tensor files (safetensors) for comparing against other implementations.

pub mod backend;
pub mod contracts;
pub mod error;
pub mod golden;
pub mod kernel;
pub mod reference;
pub mod tensor;

pub use backend::{Backend, BackendKind};
pub use error::{Error, Result};
pub use tensor::{DType, Storage, Tensor};
