//! Kernel contracts: tensor names, shapes, layouts and semantics, following the NKI library
//! kernels. Each kernel has an `…Inputs` struct of borrowed tensors, a validated call type
//! (`RouterTopk`, `Permute`, …) that only exists once every input has been checked, and an
//! outputs struct. Backends receive validated calls only.

/// The `output_dtype` accessors of validated call type `$call`, whose fields `inputs` (with
/// `named()`) and `output_dtype` hold its inputs and moekit's own [`OutputDType`], and whose
/// outputs `$outputs` map through `try_map`.
macro_rules! output_dtype_accessors {
    ($call:ident, $outputs:ty) => {
        impl $call<'_> {
            /// This call with moekit's own `output_dtype` ([`OutputDType`]; `input`,
            /// nki-library's choice, when not set).
            pub fn with_output_dtype(mut self, output_dtype: OutputDType) -> Self {
                self.output_dtype = output_dtype;
                self
            }

            pub fn output_dtype(&self) -> OutputDType {
                self.output_dtype
            }

            /// The dtype this call gives float output `spec`, for a backend that writes it
            /// directly: f32 where [`OutputDType::dtype_of`] leaves it open.
            pub fn output_dtype_of(
                &self,
                spec: &$crate::contracts::TensorSpec,
            ) -> $crate::tensor::DType {
                self.output_dtype
                    .dtype_of(spec, &self.inputs.named())
                    .unwrap_or($crate::tensor::DType::F32)
            }

            /// `outputs` in the dtypes this call gives them ([`OutputDType`]).
            pub fn cast_outputs(&self, outputs: $outputs) -> $crate::error::Result<$outputs> {
                let inputs = self.inputs.named();
                outputs.try_map(|spec, t| self.output_dtype.cast(spec, t, &inputs))
            }
        }
    };
}

pub mod a2av_routing;
pub mod blockwise_mm;
pub mod find_nonzero_indices;
pub mod indexed_flatten;
pub mod load_balancing_loss;
pub mod moe_block_tkg;
pub mod moe_tkg;
mod operand_dtype;
pub mod output_dtype;
pub mod permute;
pub mod plan;
pub mod rmsnorm_router_topk_tkg;
pub mod router_topk;
pub mod spec;
pub mod tensors;
pub mod topk;
pub mod topk_reduce;
pub(crate) mod validate;

pub use a2av_routing::*;
pub use blockwise_mm::*;
pub use find_nonzero_indices::*;
pub use indexed_flatten::*;
pub use load_balancing_loss::*;
pub use moe_block_tkg::*;
pub use moe_tkg::*;
pub use operand_dtype::ComputeDType;
pub use output_dtype::OutputDType;
pub use permute::*;
pub use plan::BlockPlan;
pub use rmsnorm_router_topk_tkg::*;
pub use router_topk::*;
pub use spec::{DTypeSpec, Named, TensorSpec};
pub use topk::*;
pub use topk_reduce::*;
