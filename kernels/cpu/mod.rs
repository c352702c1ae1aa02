//! The `cpu` backend: the kernel contracts, forward and backward, tuned for multi-core x86 and
//! ARM CPUs. f32 or bf16 storage, f32 sums (the blockwise kernels' operands in their
//! `compute_dtype`); packed-panel GEMMs (`matmul`) with run-time
//! SIMD dispatch by instruction-set level ([`isa`], [`calibrate`]); rayon parallelism over
//! experts and fixed row tiles. Every reduction has an order fixed by the shapes and the plan
//! alone, so outputs are bit-identical whatever the number of threads.

mod a2av_routing;
mod alloc;
mod bf16_matmul;
pub mod blocking;
mod blockwise;
pub mod calibrate;
mod device_plan;
mod dot;
mod element;
mod exp;
mod expert_matrix;
mod f32_tiles;
mod gated;
pub mod isa;
mod load_balancing;
mod matmul;
mod moe_tkg;
mod permute;
mod rmsnorm;
mod router;
mod rows;
mod scratch;
mod skinny;
mod stream;
mod streamed;
mod swiglu;
mod tile_walk;
mod topk;
mod topk_reduce;
mod transpose;

/// Deterministic operands for the product kernels' unit tests.
#[cfg(test)]
mod test_values {
    /// `n` values in [−1, 1] in steps of 1/8, varied by `seed`.
    pub fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + seed * 13) % 17) as f32 / 8.0 - 1.0)
            .collect()
    }
}

use crate::backend::{Backend, Tolerance};
use crate::composed;
use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads,
    BlockwiseMmOutputs, FindNonzeroIndices, FindNonzeroIndicesOutputs, FlattenSource,
    IndexedFlatten, IndexedFlattenOutputs, LoadBalancingLoss, LoadBalancingLossBwd,
    LoadBalancingLossGrads, LoadBalancingLossOutputs, MoeBlockTkg, MoeBlockTkgOutputs, MoeTkg,
    MoeTkgOutputs, Permute, PermuteBwd, PermuteGrads, PermuteOutputs, RmsNormRouterTopkTkg,
    RmsNormRouterTopkTkgBwd, RmsNormRouterTopkTkgGrads, RmsNormRouterTopkTkgOutputs, RouterTopk,
    RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs, Topk, TopkOutputs, TopkReduce,
    TopkReduceDims, TopkReduceOutputs,
};
use crate::error::Result;
use crate::tensor::{DType, Storage, Tensor};
use blocking::Blocking;
use isa::Isa;

/// Refuses settings from the environment that the kernels cannot use (each kernel's first
/// step).
fn check_environment() -> Result<()> {
    Isa::selected()?;
    Blocking::selected()?;
    Ok(())
}

/// Rows per parallel task in row-tiled products; fixed so results do not depend on threads.
const ROW_TILE: usize = 64;

/// The CPU backend. Uses the current rayon thread pool, the SIMD kernels of the level
/// [`Isa::selected`] names, and the panels of [`Blocking::selected`].
///
/// Every kernel fails with [`Error::Environment`](crate::Error::Environment) while
/// [`isa::ISA_VARIABLE`] or [`blocking::BLOCKING_VARIABLE`] holds a value it cannot use.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl CpuBackend {
    /// The name that selects it.
    pub const NAME: &'static str = "cpu";

    /// Its error bound with f32 inputs: it accumulates in f32 where the reference uses f64.
    pub const TOLERANCE: Tolerance = Tolerance {
        rtol: 1e-4,
        atol: 1e-4,
    };

    /// Its error bound with bf16 inputs, whose blockwise kernels compute in bf16
    /// (`compute_dtype`): an operand the kernel forms next to a bf16 rounding boundary may
    /// round one way from the cpu's f32 value and the other from the reference's f64 one,
    /// moving the sums it enters by one bf16 step (2⁻⁸) of one term.
    pub const BF16_TOLERANCE: Tolerance = Tolerance {
        rtol: 1e-4,
        atol: 1.0 / 128.0,
    };
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn tolerance(&self, dtype: DType) -> Tolerance {
        match dtype {
            DType::BF16 => Self::BF16_TOLERANCE,
            DType::F32 | DType::I32 => Self::TOLERANCE,
        }
    }

    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
        check_environment()?;
        call.cast_outputs(router::forward(call)?)
    }

    fn router_topk_bwd(&self, call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads> {
        check_environment()?;
        call.cast_outputs(router::backward(call)?)
    }

    fn load_balancing_loss(
        &self,
        call: &LoadBalancingLoss<'_>,
    ) -> Result<LoadBalancingLossOutputs> {
        check_environment()?;
        load_balancing::forward(call)
    }

    fn load_balancing_loss_bwd(
        &self,
        call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads> {
        check_environment()?;
        call.cast_outputs(load_balancing::backward(call)?)
    }

    fn permute(&self, call: &Permute<'_>) -> Result<PermuteOutputs> {
        check_environment()?;
        call.cast_outputs(permute::forward(call)?)
    }

    fn permute_bwd(&self, call: &PermuteBwd<'_>) -> Result<PermuteGrads> {
        check_environment()?;
        call.cast_outputs(permute::backward(call)?)
    }

    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
        check_environment()?;
        call.cast_outputs(blockwise::forward(call)?)
    }

    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
        check_environment()?;
        call.cast_outputs(blockwise::backward(call)?)
    }

    fn a2av_routing(&self, call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs> {
        check_environment()?;
        a2av_routing::forward(call)
    }

    fn moe_tkg(&self, call: &MoeTkg<'_>) -> Result<MoeTkgOutputs> {
        check_environment()?;
        call.cast_outputs(moe_tkg::forward(call)?)
    }

    fn rmsnorm_router_topk_tkg(
        &self,
        call: &RmsNormRouterTopkTkg<'_>,
    ) -> Result<RmsNormRouterTopkTkgOutputs> {
        check_environment()?;
        composed::rmsnorm_router_topk_tkg(self, self, call)
    }

    fn rmsnorm_router_topk_tkg_bwd(
        &self,
        call: &RmsNormRouterTopkTkgBwd<'_>,
    ) -> Result<RmsNormRouterTopkTkgGrads> {
        check_environment()?;
        composed::rmsnorm_router_topk_tkg_bwd(self, self, call)
    }

    fn moe_block_tkg(&self, call: &MoeBlockTkg<'_>) -> Result<MoeBlockTkgOutputs> {
        check_environment()?;
        composed::moe_block_tkg(self, self, call)
    }

    fn topk(&self, call: &Topk<'_>) -> Result<TopkOutputs> {
        check_environment()?;
        topk::forward(call)
    }

    fn topk_reduce(&self, call: &TopkReduce<'_>) -> Result<TopkReduceOutputs> {
        check_environment()?;
        let TopkReduceDims { t, h, .. } = call.dims();
        call.cast_outputs(TopkReduceOutputs {
            output: Tensor::from_f32([t, h], topk_reduce::forward(call))?,
        })
    }

    fn find_nonzero_indices(
        &self,
        call: &FindNonzeroIndices<'_>,
    ) -> Result<FindNonzeroIndicesOutputs> {
        call.outputs_from(device_plan::nonzero_rows(call))
    }

    fn indexed_flatten(&self, call: &IndexedFlatten<'_>) -> Result<IndexedFlattenOutputs> {
        let flattened = match call.source() {
            FlattenSource::F32(input, pad) => {
                Storage::F32(device_plan::flattened(call, input, pad)?.into())
            }
            FlattenSource::BF16(input, pad) => {
                Storage::BF16(device_plan::flattened(call, input, pad)?.into())
            }
            FlattenSource::I32(input, pad) => {
                Storage::I32(device_plan::flattened(call, input, pad)?.into())
            }
        };
        call.outputs_from(flattened)
    }
}
