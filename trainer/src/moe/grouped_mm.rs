//! Experts through `torch._grouped_mm` over token copies sorted by expert.

use anyhow::{Result, ensure};
use tch::{Kind, Tensor};

use super::Experts;
use crate::tape::Tape;

/// `torch._grouped_mm` needs every row stride to be a multiple of 16 bytes: H and I (in
/// elements of `elem_bytes`) must be multiples of 16 / `elem_bytes`.
pub fn check_alignment(hidden: usize, intermediate: usize, elem_bytes: usize) -> Result<()> {
    for (name, size) in [
        ("hidden_size", hidden),
        ("moe_intermediate_size", intermediate),
    ] {
        ensure!(
            (size * elem_bytes).is_multiple_of(16),
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
        let (experts, h, _, i) = gate_up.size4()?;
        check_alignment(h as usize, i as usize, x.kind().elt_size_in_bytes())?;
        let k = expert_index.size()[1];
        let flat = expert_index.flatten(0, 1);
        let order = flat.argsort_stable(true, 0, false);
        let offsets = flat.bincount(None::<Tensor>, experts).cumsum(0, Kind::Int);
        let token = order.floor_divide_scalar(k);
        let xs = x.index_select(0, &token);
        let projected = xs.f_internal_grouped_mm(
            &gate_up.reshape([experts, h, 2 * i]),
            Some(&offsets),
            None::<&Tensor>,
            None::<Kind>,
        )?;
        let act = projected.narrow(-1, 0, i).silu() * projected.narrow(-1, i, i);
        let y = act.f_internal_grouped_mm(down, Some(&offsets), None::<&Tensor>, None::<Kind>)?;
        let weight = affinities
            .flatten(0, 1)
            .index_select(0, &order)
            .unsqueeze(-1);
        Ok(x.zeros_like().f_index_add(0, &token, &(y * weight))?)
    }
}
