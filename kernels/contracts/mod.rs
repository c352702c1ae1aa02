//! Kernel contracts: tensor names, shapes, layouts and semantics, following the NKI library
//! kernels. Each kernel has an `…Inputs` struct of borrowed tensors, a validated call type
//! (`RouterTopk`, `Permute`, …) that only exists once every input has been checked, and an
//! outputs struct. Backends receive validated calls only.

pub mod a2av_routing;
pub mod blockwise_mm;
pub mod load_balancing_loss;
pub mod output_dtype;
pub mod permute;
pub mod plan;
pub mod router_topk;
pub mod spec;
pub mod tensors;
pub(crate) mod validate;

pub use a2av_routing::*;
pub use blockwise_mm::*;
pub use load_balancing_loss::*;
pub use output_dtype::OutputDType;
pub use permute::*;
pub use plan::BlockPlan;
pub use router_topk::*;
pub use spec::{DTypeSpec, Named, TensorSpec};
