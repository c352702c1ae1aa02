//! Hugging Face's eager experts: one expert at a time over the tokens that chose it
//! ([`moekit_tools::torch_moe::experts_loop`]).

use anyhow::Result;
use moekit_tools::torch_moe::{experts_loop, fused_projections};
use tch::Tensor;

use super::Experts;
use crate::tape::Tape;

/// The per-expert loop of Hugging Face's eager `Qwen3MoeSparseMoeBlock`, in libtorch ops.
pub struct TorchLoopExperts;

impl Experts for TorchLoopExperts {
    fn needs_graph_cuts(&self) -> bool {
        false
    }

    fn forward(
        &self,
        x: &Tensor,
        expert_index: &Tensor,
        affinities: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        _tape: &mut Tape,
    ) -> Result<Tensor> {
        let experts = gate_up.size()[0];
        let projections = fused_projections(gate_up, down);
        Ok(experts_loop(
            x,
            expert_index,
            affinities,
            experts,
            projections,
        )?)
    }
}
