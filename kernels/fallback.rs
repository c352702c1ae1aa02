//! [`FallbackBackend`]: a backend that runs each kernel on a primary backend where it runs it,
//! else on a fallback (moekit's own combinator): the `neuron` backend's compiled kernels, say,
//! with the block plan (`permute`, which nki-library ships no kernel for) on `cpu`.

use std::time::Duration;

use crate::backend::{Backend, Device, FixedShapes, KernelCall, PlannedCall, Tolerance};
use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads,
    BlockwiseMmOutputs, FindNonzeroIndices, FindNonzeroIndicesOutputs, IndexedFlatten,
    IndexedFlattenOutputs, LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads,
    LoadBalancingLossOutputs, MoeBlockTkg, MoeBlockTkgOutputs, MoeTkg, MoeTkgOutputs, Permute,
    PermuteBwd, PermuteGrads, PermuteOutputs, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd,
    RmsNormRouterTopkTkgGrads, RmsNormRouterTopkTkgOutputs, RouterTopk, RouterTopkBwd,
    RouterTopkGrads, RouterTopkOutputs, Topk, TopkOutputs, TopkReduce, TopkReduceOutputs,
};
use crate::error::Result;
use crate::kernel::Kernel;
use crate::tensor::DType;

/// Each kernel on `primary` where [`Backend::supports`] says it runs it, else on `fallback`;
/// which backend runs which kernel is decided once, when it is made.
///
/// It takes `primary`'s name, device and fixed shapes (the backend a user chose), and the
/// looser of the two tolerances.
pub struct FallbackBackend {
    primary: Box<dyn Backend>,
    fallback: Box<dyn Backend>,
    /// The kernels `primary` runs.
    on_primary: Vec<Kernel>,
}

impl FallbackBackend {
    /// An error where `primary` cannot say which kernels it runs (a neuron backend whose
    /// manifest cannot be read).
    pub fn new(primary: Box<dyn Backend>, fallback: Box<dyn Backend>) -> Result<Self> {
        let mut on_primary = Vec::new();
        for &kernel in Kernel::ALL {
            if primary.supports(kernel)? {
                on_primary.push(kernel);
            }
        }
        Ok(Self {
            primary,
            fallback,
            on_primary,
        })
    }

    /// The backend that runs `kernel`.
    fn runner(&self, kernel: Kernel) -> &dyn Backend {
        if self.on_primary.contains(&kernel) {
            self.primary.as_ref()
        } else {
            self.fallback.as_ref()
        }
    }
}

impl Backend for FallbackBackend {
    fn name(&self) -> &'static str {
        self.primary.name()
    }

    fn supports(&self, kernel: Kernel) -> Result<bool> {
        self.runner(kernel).supports(kernel)
    }

    fn tolerance(&self, dtype: DType) -> Tolerance {
        let (a, b) = (
            self.primary.tolerance(dtype),
            self.fallback.tolerance(dtype),
        );
        Tolerance {
            rtol: a.rtol.max(b.rtol),
            atol: a.atol.max(b.atol),
        }
    }

    fn device(&self) -> Device {
        self.primary.device()
    }

    fn time_repeated(&self, call: KernelCall<'_, '_>, repeats: u32) -> Result<Option<Duration>> {
        self.runner(call.kernel()).time_repeated(call, repeats)
    }

    fn fixed_shapes(&self) -> Result<Option<FixedShapes>> {
        self.primary.fixed_shapes()
    }

    /// Each call prepared by the backend that will run it.
    fn prepare(&self, calls: &[PlannedCall]) -> Result<()> {
        let (on_primary, on_fallback): (Vec<PlannedCall>, Vec<PlannedCall>) = calls
            .iter()
            .partition(|call| self.on_primary.contains(&call.kernel()));
        self.primary.prepare(&on_primary)?;
        self.fallback.prepare(&on_fallback)
    }

    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
        self.runner(Kernel::RouterTopk).router_topk(call)
    }

    fn router_topk_bwd(&self, call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads> {
        self.runner(Kernel::RouterTopkBwd).router_topk_bwd(call)
    }

    fn load_balancing_loss(
        &self,
        call: &LoadBalancingLoss<'_>,
    ) -> Result<LoadBalancingLossOutputs> {
        self.runner(Kernel::LoadBalancingLoss)
            .load_balancing_loss(call)
    }

    fn load_balancing_loss_bwd(
        &self,
        call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads> {
        self.runner(Kernel::LoadBalancingLossBwd)
            .load_balancing_loss_bwd(call)
    }

    fn permute(&self, call: &Permute<'_>) -> Result<PermuteOutputs> {
        self.runner(Kernel::Permute).permute(call)
    }

    fn permute_bwd(&self, call: &PermuteBwd<'_>) -> Result<PermuteGrads> {
        self.runner(Kernel::PermuteBwd).permute_bwd(call)
    }

    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
        self.runner(Kernel::BlockwiseMm).blockwise_mm(call)
    }

    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
        self.runner(Kernel::BlockwiseMmBwd).blockwise_mm_bwd(call)
    }

    fn a2av_routing(&self, call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs> {
        self.runner(Kernel::A2avRouting).a2av_routing(call)
    }

    fn moe_tkg(&self, call: &MoeTkg<'_>) -> Result<MoeTkgOutputs> {
        self.runner(Kernel::MoeTkg).moe_tkg(call)
    }

    fn rmsnorm_router_topk_tkg(
        &self,
        call: &RmsNormRouterTopkTkg<'_>,
    ) -> Result<RmsNormRouterTopkTkgOutputs> {
        self.runner(Kernel::RmsNormRouterTopkTkg)
            .rmsnorm_router_topk_tkg(call)
    }

    fn rmsnorm_router_topk_tkg_bwd(
        &self,
        call: &RmsNormRouterTopkTkgBwd<'_>,
    ) -> Result<RmsNormRouterTopkTkgGrads> {
        self.runner(Kernel::RmsNormRouterTopkTkgBwd)
            .rmsnorm_router_topk_tkg_bwd(call)
    }

    fn moe_block_tkg(&self, call: &MoeBlockTkg<'_>) -> Result<MoeBlockTkgOutputs> {
        self.runner(Kernel::MoeBlockTkg).moe_block_tkg(call)
    }

    fn topk(&self, call: &Topk<'_>) -> Result<TopkOutputs> {
        self.runner(Kernel::Topk).topk(call)
    }

    fn topk_reduce(&self, call: &TopkReduce<'_>) -> Result<TopkReduceOutputs> {
        self.runner(Kernel::TopkReduce).topk_reduce(call)
    }

    fn find_nonzero_indices(
        &self,
        call: &FindNonzeroIndices<'_>,
    ) -> Result<FindNonzeroIndicesOutputs> {
        self.runner(Kernel::FindNonzeroIndices)
            .find_nonzero_indices(call)
    }

    fn indexed_flatten(&self, call: &IndexedFlatten<'_>) -> Result<IndexedFlattenOutputs> {
        self.runner(Kernel::IndexedFlatten).indexed_flatten(call)
    }
}
