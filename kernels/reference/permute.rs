//! Reference block plan (see [`crate::contracts::permute`]).

use crate::contracts::spec::output;
use crate::contracts::tensors::permute as pm;
use crate::contracts::{PermuteDims, SKIP};
use crate::error::Result;
use crate::tensor::try_filled as filled;

/// The block plan of `permute`, before conversion to tensors.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockPlan {
    /// `[E]`.
    pub expert_counts: Vec<usize>,
    /// `[N·B]`, T (or −1 with `skip_token`) for padding.
    pub token_position_to_id: Vec<i32>,
    /// `[N]`, E−1 for the unused blocks after the used ones.
    pub block_to_expert: Vec<i32>,
    /// `[(T+1)·E]` (`[T·E]` with `skip_token`).
    pub expert_affinities_masked: Vec<f64>,
    pub num_used_blocks: usize,
}

/// Builds the plan for `expert_index [T, K]` (valid, distinct ids per row, or SKIP) and
/// `topk_affinities [T, K]`.
pub fn permute(
    expert_index: &[i32],
    topk_affinities: &[f64],
    dims: PermuteDims,
) -> Result<BlockPlan> {
    let PermuteDims { t, k, e, b, n, .. } = dims;
    let rows = dims.rows();
    let mut masked = filled(&output(&pm::EXPERT_AFFINITIES_MASKED), &[rows * e], 0.0)?;
    for (pair, (&id, &a)) in expert_index.iter().zip(topk_affinities).enumerate() {
        if id != SKIP {
            masked[(pair / k) * e + id as usize] = a;
        }
    }
    let mut plan = BlockPlan {
        expert_counts: vec![0; e],
        token_position_to_id: filled(
            &output(&pm::TOKEN_POSITION_TO_ID),
            &[n * b],
            dims.padding_id(),
        )?,
        block_to_expert: filled(&output(&pm::BLOCK_TO_EXPERT), &[n], e as i32 - 1)?,
        expert_affinities_masked: masked,
        num_used_blocks: 0,
    };
    let mut block = 0;
    for expert in 0..e {
        let tokens: Vec<i32> = (0..t)
            .filter(|&token| expert_index[token * k..(token + 1) * k].contains(&(expert as i32)))
            .map(|token| token as i32)
            .collect();
        plan.expert_counts[expert] = tokens.len();
        for chunk in tokens.chunks(b) {
            plan.block_to_expert[block] = expert as i32;
            plan.token_position_to_id[block * b..block * b + chunk.len()].copy_from_slice(chunk);
            block += 1;
        }
    }
    plan.num_used_blocks = block;
    Ok(plan)
}

/// `d_topk_affinities [T, K]` from an affinity gradient in the masked `[(T+1)·E]` layout (0 in
/// skipped slots).
pub fn permute_backward(expert_index: &[i32], d_masked: &[f64], k: usize, e: usize) -> Vec<f64> {
    expert_index
        .iter()
        .enumerate()
        .map(|(pair, &id)| match id {
            SKIP => 0.0,
            id => d_masked[(pair / k) * e + id as usize],
        })
        .collect()
}
