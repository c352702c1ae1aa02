//! Experts through `torch._grouped_mm` over token copies sorted by expert.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::Experts;
use crate::tape::Tape;

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
