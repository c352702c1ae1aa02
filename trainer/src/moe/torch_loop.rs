//! Hugging Face's eager experts: one expert at a time over the tokens that chose it.

use anyhow::Result;
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
        let (experts, h, _, i) = gate_up.size4()?;
        // Experts that at least one token chose (one host sync, as in Hugging Face).
        let chosen = expert_index.flatten(0, 1).bincount(None::<Tensor>, experts);
        let chosen = Vec::<i64>::try_from(chosen.nonzero().flatten(0, 1))?;
        let mut out = x.zeros_like();
        for expert in chosen {
            let hit = expert_index.eq(expert).nonzero(); // [n, 2]: (token, slot)
            let (token, slot) = (hit.select(1, 0), hit.select(1, 1));
            let xs = x.index_select(0, &token);
            let projected = xs
                .matmul(&gate_up.get(expert).reshape([h, 2 * i]))
                .reshape([-1, 2, i]);
            let act = projected.select(1, 0).silu() * projected.select(1, 1);
            let weight = affinities
                .index(&[Some(token.shallow_clone()), Some(slot)])
                .unsqueeze(-1);
            let y = act.matmul(&down.get(expert)) * weight;
            out = out.f_index_add(0, &token, &y)?;
        }
        Ok(out)
    }
}
