//! The backend abstraction: every implementation of the kernel contracts (reference, cpu and
//! neuron) implements [`Backend`]; [`crate::backends`] lists them and picks one at run time by
//! name. This module knows none of them.
//!
//! Backends receive validated calls only (see [`crate::contracts`]), so input errors are
//! reported identically whichever backend runs.

use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads,
    BlockwiseMmOutputs, LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads,
    LoadBalancingLossOutputs, Permute, PermuteBwd, PermuteGrads, PermuteOutputs, RouterTopk,
    RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs,
};
use crate::error::Result;

/// One implementation of every kernel contract, forward and backward.
pub trait Backend: Send + Sync {
    /// The name used to select this backend (`--backend NAME`).
    fn name(&self) -> &'static str;
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
}
