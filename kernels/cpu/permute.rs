//! The block plan on the CPU: one counting pass over `expert_index`, then each expert's tokens
//! written in ascending token order straight into their blocks. O(T·K + N·B).

use crate::contracts::spec::output;
use crate::contracts::tensors::permute as pm;
use crate::contracts::{Permute, PermuteBwd, PermuteDims, PermuteGrads, PermuteOutputs, SKIP};
use crate::error::Result;
use crate::tensor::{Tensor, try_filled as filled};

pub(super) fn forward(call: &Permute<'_>) -> Result<PermuteOutputs> {
    let inputs = call.inputs();
    let dims = call.dims();
    let PermuteDims { k, e, b, n, .. } = dims;
    let rows = dims.rows();
    let ids = call.expert_ids();
    let affinities = inputs.topk_affinities.f32_values();

    let mut counts = filled(&output(&pm::EXPERT_COUNTS), &[e], 0usize)?;
    for &id in ids.iter().filter(|&&id| id != SKIP) {
        counts[id as usize] += 1;
    }
    // First slot of each expert: its blocks follow the previous experts' blocks.
    let mut next_slot = filled(&output(&pm::EXPERT_COUNTS), &[e], 0usize)?;
    // Unused blocks, after the used ones, go through the last expert (nki-library's layout).
    let mut block_to_expert = filled(&output(&pm::BLOCK_TO_EXPERT), &[n], e as i32 - 1)?;
    let mut used = 0;
    for (expert, &count) in counts.iter().enumerate() {
        next_slot[expert] = used * b;
        let blocks = count.div_ceil(b);
        block_to_expert[used..used + blocks].fill(expert as i32);
        used += blocks;
    }
    let mut positions = filled(
        &output(&pm::TOKEN_POSITION_TO_ID),
        &[n * b],
        dims.padding_id(),
    )?;
    let mut masked = filled(&output(&pm::EXPERT_AFFINITIES_MASKED), &[rows * e], 0.0f32)?;
    for (pair, (&id, &a)) in ids.iter().zip(affinities.iter()).enumerate() {
        if id == SKIP {
            continue;
        }
        let (token, expert) = (pair / k, id as usize);
        positions[next_slot[expert]] = token as i32;
        next_slot[expert] += 1;
        masked[token * e + expert] = a;
    }
    Ok(PermuteOutputs {
        expert_counts: Tensor::from_i32([e], counts.iter().map(|&c| c as i32).collect())?,
        token_position_to_id: Tensor::from_i32([n * b], positions)?,
        block_to_expert: Tensor::from_i32([n, 1], block_to_expert)?,
        // Copies of the validated (finite) affinities, and zeros: finite without a check.
        expert_affinities_masked: Tensor::from_f32([rows * e, 1], masked)?,
        num_used_blocks: Tensor::from_i32([1], vec![used as i32])?,
    })
}

/// `d_topk_affinities [T, K]` from a masked `[(T+1)·E]` affinity gradient and the validated
/// ids of `expert_index [T, K]`: entry `t·E + expert_index[t, k]`, 0 in skipped slots.
pub(super) fn topk_gradient(
    (ids, k): (&[i32], usize),
    masked_grad: &[f32],
    e: usize,
) -> Result<Tensor> {
    let t = ids.len() / k;
    let d = ids
        .iter()
        .enumerate()
        .map(|(pair, &id)| match id {
            SKIP => 0.0,
            id => masked_grad[(pair / k) * e + id as usize],
        })
        .collect();
    Tensor::from_f32([t, k], d)
}

pub(super) fn backward(call: &PermuteBwd<'_>) -> Result<PermuteGrads> {
    let inputs = call.inputs();
    let (_, _, e) = call.dims();
    let grad = inputs.expert_affinities_masked_grad.f32_values();
    Ok(PermuteGrads {
        d_topk_affinities: topk_gradient((call.expert_ids(), call.dims().1), &grad, e)?,
    })
}
