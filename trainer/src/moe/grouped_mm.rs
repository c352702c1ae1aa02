//! Experts through `torch._grouped_mm` over token copies sorted by expert
//! ([`moekit_tools::torch_moe::experts_grouped_mm`]).

use anyhow::{Result, bail};
use moekit_tools::torch_moe::{experts_grouped_mm, grouped_mm_alignment};
use tch::Tensor;

use super::Experts;
use crate::tape::Tape;

/// `torch._grouped_mm` needs every row stride to be a multiple of 16 bytes: H and I (in
/// elements of `elem_bytes`) must be multiples of 16 / `elem_bytes`.
pub fn check_alignment(hidden: usize, intermediate: usize, elem_bytes: usize) -> Result<()> {
    if let Some((name, size)) = grouped_mm_alignment(hidden, intermediate, elem_bytes) {
        bail!(
            "kernels.moe = \"grouped_mm\" needs {name} to be a multiple of {} with {}-byte \
             elements (torch._grouped_mm's 16-byte stride rule), got {size}",
            16 / elem_bytes,
            elem_bytes
        );
    }
    Ok(())
}

/// Sort the T·K token copies by expert (stable), run gate_up and down as two grouped matmuls
/// with per-expert offsets, scale by the affinities and `index_add` back to token order.
pub struct GroupedMmExperts;

impl Experts for GroupedMmExperts {
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
        let (_, h, _, i) = gate_up.size4()?;
        check_alignment(h as usize, i as usize, x.kind().elt_size_in_bytes())?;
        Ok(experts_grouped_mm(
            x,
            expert_index,
            affinities,
            gate_up,
            down,
        )?)
    }
}
