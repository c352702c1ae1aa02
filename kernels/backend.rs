//! The backend abstraction: every implementation of the kernel contracts (reference, cpu and
//! neuron) implements [`Backend`]; [`crate::backends`] lists them and picks one at run time by
//! name. This module knows none of them.
//!
//! Backends receive validated calls only (see [`crate::contracts`]), so input errors are
//! reported identically whichever backend runs.
//!
//! Besides the kernels, a backend says what tools need to know of it, so that no tool names a
//! backend: which kernels it runs ([`Backend::supports`]), how close to the f64 reference its
//! results are ([`Tolerance`]), where it computes ([`Device`]), how it times a repeated call
//! where it can ([`Backend::time_repeated`]) and, for compiled kernels, the shapes it runs
//! ([`FixedShapes`]) and whether it has what a caller's planned calls need, ahead of running
//! them ([`Backend::prepare`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseDims, BlockwiseMm, BlockwiseMmBwd,
    BlockwiseMmBwdParams, BlockwiseMmGrads, BlockwiseMmOutputs, BlockwiseMmParams,
    FindNonzeroIndices, FindNonzeroIndicesOutputs, IndexedFlatten, IndexedFlattenOutputs,
    LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads, LoadBalancingLossOutputs,
    MoeBlockTkg, MoeBlockTkgOutputs, MoeTkg, MoeTkgOutputs, Permute, PermuteBwd, PermuteGrads,
    PermuteOutputs, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd, RmsNormRouterTopkTkgGrads,
    RmsNormRouterTopkTkgOutputs, RouterTopk, RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs,
    Topk, TopkOutputs, TopkReduce, TopkReduceOutputs, WeightLayout,
};
use crate::error::Result;
use crate::kernel::{Kernel, Params};
use crate::tensor::DType;

/// One implementation of every kernel contract, forward and backward.
pub trait Backend: Send + Sync {
    /// The name used to select this backend (`--backend NAME`).
    fn name(&self) -> &'static str;

    /// Whether this backend runs `kernel` (a call of any other is an
    /// [`Error::Unsupported`](crate::Error::Unsupported)). Every kernel, unless the backend
    /// runs compiled kernels only where it has them.
    fn supports(&self, _kernel: Kernel) -> Result<bool> {
        Ok(true)
    }

    /// How far this backend's results may be from the f64 reference's (its documented error
    /// bound) for float inputs in `dtype`.
    fn tolerance(&self, dtype: DType) -> Tolerance;

    /// Where this backend computes.
    fn device(&self) -> Device {
        Device::Host
    }

    /// The mean time of one of `repeats` back-to-back executions of `call`, where the backend
    /// times its device itself; `None` where the wall time around calls is the measure (the
    /// host backends).
    fn time_repeated(&self, _call: KernelCall<'_, '_>, _repeats: u32) -> Result<Option<Duration>> {
        Ok(None)
    }

    /// The shapes this backend runs kernels at, where it runs fixed shapes only (compiled
    /// kernels); `None` where it takes any shape.
    fn fixed_shapes(&self) -> Result<Option<FixedShapes>> {
        Ok(None)
    }

    /// Readies the backend for `calls` before any of them runs, or says which it cannot run:
    /// a backend of compiled kernels finds and loads each call's kernel, so that a missing one
    /// is an error before a job starts rather than in its middle. Nothing to do on the hosts.
    fn prepare(&self, _calls: &[PlannedCall]) -> Result<()> {
        Ok(())
    }

    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs>;
    fn router_topk_bwd(&self, call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads>;
    fn load_balancing_loss(&self, call: &LoadBalancingLoss<'_>)
    -> Result<LoadBalancingLossOutputs>;
    fn load_balancing_loss_bwd(
        &self,
        call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads>;
    fn permute(&self, call: &Permute<'_>) -> Result<PermuteOutputs>;
    fn permute_bwd(&self, call: &PermuteBwd<'_>) -> Result<PermuteGrads>;
    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs>;
    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads>;
    fn a2av_routing(&self, call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs>;
    fn moe_tkg(&self, call: &MoeTkg<'_>) -> Result<MoeTkgOutputs>;
    fn rmsnorm_router_topk_tkg(
        &self,
        call: &RmsNormRouterTopkTkg<'_>,
    ) -> Result<RmsNormRouterTopkTkgOutputs>;
    fn rmsnorm_router_topk_tkg_bwd(
        &self,
        call: &RmsNormRouterTopkTkgBwd<'_>,
    ) -> Result<RmsNormRouterTopkTkgGrads>;
    fn moe_block_tkg(&self, call: &MoeBlockTkg<'_>) -> Result<MoeBlockTkgOutputs>;
    fn topk(&self, call: &Topk<'_>) -> Result<TopkOutputs>;
    fn topk_reduce(&self, call: &TopkReduce<'_>) -> Result<TopkReduceOutputs>;
    fn find_nonzero_indices(
        &self,
        call: &FindNonzeroIndices<'_>,
    ) -> Result<FindNonzeroIndicesOutputs>;
    fn indexed_flatten(&self, call: &IndexedFlatten<'_>) -> Result<IndexedFlattenOutputs>;
}

/// The agreement with the f64 reference a backend documents: an element passes when
/// `|got − want| ≤ atol · max(1, max |want|) + rtol · |want|` (integer outputs only when equal).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
}

impl Tolerance {
    /// Equal to the last bit.
    pub const EXACT: Tolerance = Tolerance {
        rtol: 0.0,
        atol: 0.0,
    };
}

/// Where a backend computes, and so what its throughput is measured against.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Device {
    /// This machine's cores: the limits are measured on it.
    Host,
    /// An accelerator, with the limits its documentation states (not measured from the host).
    Accelerator(AcceleratorLimits),
}

/// An accelerator's documented limits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AcceleratorLimits {
    /// What computes, e.g. `one Trainium2 NeuronCore-v3`.
    pub name: &'static str,
    /// The dtype of the peak, e.g. `bf16`.
    pub peak_dtype: &'static str,
    /// Dense matrix-multiply peak, GFLOP/s.
    pub peak_gflops: f64,
    /// Memory bandwidth available to it, GB/s.
    pub memory_gbps: f64,
}

/// A validated call of any kernel, for what a backend or a tool does with every kernel alike
/// (timing).
#[derive(Clone, Copy)]
pub enum KernelCall<'c, 'a> {
    RouterTopk(&'c RouterTopk<'a>),
    RouterTopkBwd(&'c RouterTopkBwd<'a>),
    LoadBalancingLoss(&'c LoadBalancingLoss<'a>),
    LoadBalancingLossBwd(&'c LoadBalancingLossBwd<'a>),
    Permute(&'c Permute<'a>),
    PermuteBwd(&'c PermuteBwd<'a>),
    BlockwiseMm(&'c BlockwiseMm<'a>),
    BlockwiseMmBwd(&'c BlockwiseMmBwd<'a>),
    A2avRouting(&'c A2avRouting<'a>),
    MoeTkg(&'c MoeTkg<'a>),
    RmsNormRouterTopkTkg(&'c RmsNormRouterTopkTkg<'a>),
    RmsNormRouterTopkTkgBwd(&'c RmsNormRouterTopkTkgBwd<'a>),
    MoeBlockTkg(&'c MoeBlockTkg<'a>),
    Topk(&'c Topk<'a>),
    TopkReduce(&'c TopkReduce<'a>),
    FindNonzeroIndices(&'c FindNonzeroIndices<'a>),
    IndexedFlatten(&'c IndexedFlatten<'a>),
}

impl KernelCall<'_, '_> {
    /// The kernel this calls.
    pub fn kernel(self) -> Kernel {
        match self {
            KernelCall::RouterTopk(_) => Kernel::RouterTopk,
            KernelCall::RouterTopkBwd(_) => Kernel::RouterTopkBwd,
            KernelCall::LoadBalancingLoss(_) => Kernel::LoadBalancingLoss,
            KernelCall::LoadBalancingLossBwd(_) => Kernel::LoadBalancingLossBwd,
            KernelCall::Permute(_) => Kernel::Permute,
            KernelCall::PermuteBwd(_) => Kernel::PermuteBwd,
            KernelCall::BlockwiseMm(_) => Kernel::BlockwiseMm,
            KernelCall::BlockwiseMmBwd(_) => Kernel::BlockwiseMmBwd,
            KernelCall::A2avRouting(_) => Kernel::A2avRouting,
            KernelCall::MoeTkg(_) => Kernel::MoeTkg,
            KernelCall::RmsNormRouterTopkTkg(_) => Kernel::RmsNormRouterTopkTkg,
            KernelCall::RmsNormRouterTopkTkgBwd(_) => Kernel::RmsNormRouterTopkTkgBwd,
            KernelCall::MoeBlockTkg(_) => Kernel::MoeBlockTkg,
            KernelCall::Topk(_) => Kernel::Topk,
            KernelCall::TopkReduce(_) => Kernel::TopkReduce,
            KernelCall::FindNonzeroIndices(_) => Kernel::FindNonzeroIndices,
            KernelCall::IndexedFlatten(_) => Kernel::IndexedFlatten,
        }
    }

    /// Runs the call on `backend` and drops its outputs (what a wall-clock timing measures).
    pub fn run_discarding(self, backend: &dyn Backend) -> Result<()> {
        match self {
            KernelCall::RouterTopk(call) => backend.router_topk(call).map(drop),
            KernelCall::RouterTopkBwd(call) => backend.router_topk_bwd(call).map(drop),
            KernelCall::LoadBalancingLoss(call) => backend.load_balancing_loss(call).map(drop),
            KernelCall::LoadBalancingLossBwd(call) => {
                backend.load_balancing_loss_bwd(call).map(drop)
            }
            KernelCall::Permute(call) => backend.permute(call).map(drop),
            KernelCall::PermuteBwd(call) => backend.permute_bwd(call).map(drop),
            KernelCall::BlockwiseMm(call) => backend.blockwise_mm(call).map(drop),
            KernelCall::BlockwiseMmBwd(call) => backend.blockwise_mm_bwd(call).map(drop),
            KernelCall::A2avRouting(call) => backend.a2av_routing(call).map(drop),
            KernelCall::MoeTkg(call) => backend.moe_tkg(call).map(drop),
            KernelCall::RmsNormRouterTopkTkg(call) => {
                backend.rmsnorm_router_topk_tkg(call).map(drop)
            }
            KernelCall::RmsNormRouterTopkTkgBwd(call) => {
                backend.rmsnorm_router_topk_tkg_bwd(call).map(drop)
            }
            KernelCall::MoeBlockTkg(call) => backend.moe_block_tkg(call).map(drop),
            KernelCall::Topk(call) => backend.topk(call).map(drop),
            KernelCall::TopkReduce(call) => backend.topk_reduce(call).map(drop),
            KernelCall::FindNonzeroIndices(call) => backend.find_nonzero_indices(call).map(drop),
            KernelCall::IndexedFlatten(call) => backend.indexed_flatten(call).map(drop),
        }
    }
}

/// A kernel call known ahead by its sizes and parameters, before its tensors exist (moekit's
/// own): what a caller such as [`crate::experts::Experts`] will run, for
/// [`Backend::prepare`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PlannedCall {
    /// `blockwise_mm` without the optional biases.
    BlockwiseMm {
        dims: BlockwiseDims,
        params: BlockwiseMmParams,
    },
    BlockwiseMmBwd {
        dims: BlockwiseDims,
        params: BlockwiseMmBwdParams,
    },
}

impl PlannedCall {
    pub fn kernel(&self) -> Kernel {
        match self {
            PlannedCall::BlockwiseMm { .. } => Kernel::BlockwiseMm,
            PlannedCall::BlockwiseMmBwd { .. } => Kernel::BlockwiseMmBwd,
        }
    }

    /// The layout of the weights the call reads.
    pub fn weight_layout(&self) -> WeightLayout {
        match self {
            PlannedCall::BlockwiseMm { params, .. } => params.weight_layout,
            PlannedCall::BlockwiseMmBwd { params, .. } => params.weight_layout,
        }
    }
}

/// The shapes a backend of compiled kernels runs, and where they are declared.
#[derive(Clone, Debug, PartialEq)]
pub struct FixedShapes {
    /// The file that declares them (the neuron backend's manifest).
    pub declared_in: PathBuf,
    pub shapes: Vec<FixedShape>,
}

/// One compiled kernel's shape: the MoE layer a call of it must come from, and its parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct FixedShape {
    pub kernel: Kernel,
    pub sizes: LayerSizes,
    pub params: Params,
    /// What declares it, for messages, e.g. `kernel entry 2 (blockwise.neff)`.
    pub source: String,
    /// Why the device's own kernel library would refuse this shape, one sentence each (the
    /// host still runs it).
    pub warnings: Vec<String>,
}

/// The sizes of one MoE layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSizes {
    /// T, tokens.
    pub t: usize,
    /// H, hidden size.
    pub h: usize,
    /// E, experts.
    pub e: usize,
    /// K, experts per token.
    pub k: usize,
    /// I, expert intermediate size.
    pub i: usize,
    /// B, block size.
    pub b: usize,
}
