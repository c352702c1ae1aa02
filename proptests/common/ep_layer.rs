//! The expert-parallel layer's test data and its oracle, the single-rank layer holding every
//! expert (shared by the `LocalComm` and the MPI tests).

use std::rc::Rc;
use std::sync::Arc;

use moekit::contracts::{
    BlockwiseMm, BlockwiseMmBwd, BlockwiseMmBwdInputs, BlockwiseMmBwdParams, BlockwiseMmInputs,
    BlockwiseMmParams, Permute, PermuteInputs, PermuteParams, RouterPipeline, RouterTopk,
    RouterTopkBwd, RouterTopkBwdInputs, RouterTopkBwdParams, RouterTopkInputs, RouterTopkParams,
};
use moekit::ep::{Communicator, EpGrads, EpInputs, EpParams, ExpertParallelMoe};
use moekit::{BackendKind, Tensor};

use super::{SeededRng, f32_tensor};

/// One expert-parallel layer: R ranks with `local` experts each and `tokens[r]` tokens.
#[derive(Clone, Debug)]
pub struct EpCase {
    pub r: usize,
    /// Experts per rank.
    pub local: usize,
    pub k: usize,
    pub h: usize,
    pub i: usize,
    pub b: usize,
    /// Tokens on each rank.
    pub tokens: Vec<usize>,
    /// Steer every token to rank 0's experts (the other ranks receive nothing).
    pub one_rank: bool,
    pub norm_topk_prob: bool,
    pub seed: u64,
}

impl EpCase {
    /// Qwen3-MoE's router, with or without renormalisation.
    pub fn router(&self) -> RouterPipeline {
        RouterPipeline {
            norm_topk_prob: self.norm_topk_prob,
            ..RouterPipeline::QWEN3_MOE
        }
    }
}

/// Every rank's tokens and the full weights.
pub struct EpData {
    pub x: Vec<Tensor>,
    pub w: Tensor,
    /// `[E, H, 2, I]` and `[E, I, H]`, all experts.
    pub gate_up: Vec<f64>,
    pub down: Vec<f64>,
    pub d_output: Vec<Tensor>,
}

pub fn ep_data(c: &EpCase) -> EpData {
    let mut rng = SeededRng::new(c.seed);
    let e = c.r * c.local;
    let mut w = rng.values(c.h * e, 1.0);
    if c.one_rank {
        // Rank 0's experts win every top-k by a wide margin.
        for row in w.chunks_mut(e) {
            for (expert, v) in row.iter_mut().enumerate() {
                *v = if expert < c.local {
                    4.0 + *v
                } else {
                    -4.0 + *v
                };
            }
        }
    }
    EpData {
        x: c.tokens
            .iter()
            .map(|&t| f32_tensor(&[t, c.h], &rng.values(t * c.h, 1.0)))
            .collect(),
        w: f32_tensor(&[c.h, e], &w),
        gate_up: rng.values(e * c.h * 2 * c.i, 0.5),
        down: rng.values(e * c.i * c.h, 0.5),
        d_output: c
            .tokens
            .iter()
            .map(|&t| f32_tensor(&[t, c.h], &rng.values(t * c.h, 1.0)))
            .collect(),
    }
}

/// The layer on one rank holding every expert (the oracle): output, d_x, d_w, d_gate_up,
/// d_down for one rank's tokens.
pub fn single_rank(c: &EpCase, data: &EpData, rank: usize) -> [Vec<f64>; 5] {
    let backend = BackendKind::Reference.create();
    let e = c.r * c.local;
    let (t, h, i) = (c.tokens[rank], c.h, c.i);
    let x = &data.x[rank];
    let routed = backend
        .router_topk(
            &RouterTopk::new(
                RouterTopkInputs {
                    x,
                    w: &data.w,
                    w_bias: None,
                    selection_bias: None,
                },
                RouterTopkParams {
                    k: c.k,
                    pipeline: c.router(),
                },
            )
            .unwrap(),
        )
        .unwrap();
    let plan = backend
        .permute(
            &Permute::new(
                PermuteInputs {
                    expert_index: &routed.expert_index,
                    topk_affinities: &routed.topk_affinities,
                },
                PermuteParams::new(e, c.b),
            )
            .unwrap(),
        )
        .unwrap();
    let mut padded = x.to_f64_vec();
    padded.extend(vec![0.0; h]);
    let hidden_states = f32_tensor(&[t + 1, h], &padded);
    let gate_up = f32_tensor(&[e, h, 2, i], &data.gate_up);
    let down = f32_tensor(&[e, i, h], &data.down);
    let inputs = BlockwiseMmInputs {
        hidden_states: &hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: &gate_up,
        down_proj_weight: &down,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
        up_proj_weight: None,
    };
    // The blockwise kernels' `[T+1, H]` output gradient: the rank's, then the padding row.
    let mut d_output = data.d_output[rank].to_f64_vec();
    d_output.extend(vec![0.0; h]);
    let d_output = f32_tensor(&[t + 1, h], &d_output);
    let out = backend
        .blockwise_mm(
            &BlockwiseMm::new(
                inputs,
                BlockwiseMmParams {
                    checkpoint_activation: true,
                    ..BlockwiseMmParams::default()
                },
            )
            .unwrap(),
        )
        .unwrap();
    let grads = backend
        .blockwise_mm_bwd(
            &BlockwiseMmBwd::new(
                BlockwiseMmBwdInputs {
                    forward: inputs,
                    gate_up_proj_act_checkpoint_t: out.gate_up_activations_t.as_ref().unwrap(),
                    down_proj_act_checkpoint: out.down_activations.as_ref().unwrap(),
                    output_hidden_states_grad: &d_output,
                    expert_index: Some(&routed.expert_index),
                },
                BlockwiseMmBwdParams::default(),
            )
            .unwrap(),
        )
        .unwrap();
    let router = backend
        .router_topk_bwd(
            &RouterTopkBwd::new(
                RouterTopkBwdInputs {
                    x,
                    w: &data.w,
                    router_logits: &routed.router_logits,
                    expert_index: &routed.expert_index,
                    d_topk_affinities: grads.d_topk_affinities.as_ref().unwrap(),
                    d_router_logits: None,
                },
                RouterTopkBwdParams {
                    pipeline: c.router(),
                    compute_dtype: None,
                },
            )
            .unwrap(),
        )
        .unwrap();
    let d_x: Vec<f64> = router
        .d_x
        .to_f64_vec()
        .iter()
        .zip(grads.hidden_states_grad.to_f64_vec())
        .map(|(a, b)| a + b)
        .collect();
    // Row T of `output [T+1, H]` is the padding token's.
    let mut output = out.output.to_f64_vec();
    output.truncate(t * h);
    [
        output,
        d_x,
        router.d_w.to_f64_vec(),
        grads.gate_up_proj_weight_grad.to_f64_vec(),
        grads.down_proj_weight_grad.to_f64_vec(),
    ]
}

/// The expert-parallel layer, forward then backward, on rank `comm.rank()` of `comm` (call on
/// every rank), with that rank's slice of the experts.
pub fn run_rank(
    comm: Rc<dyn Communicator>,
    c: &EpCase,
    data: &EpData,
    backend: BackendKind,
) -> moekit::Result<(Tensor, EpGrads)> {
    let rank = comm.rank();
    let (h, i) = (c.h, c.i);
    let (per_gate_up, per_down) = (c.local * h * 2 * i, c.local * i * h);
    let gate_up = f32_tensor(
        &[c.local, h, 2, i],
        &data.gate_up[rank * per_gate_up..(rank + 1) * per_gate_up],
    );
    let down = f32_tensor(
        &[c.local, i, h],
        &data.down[rank * per_down..(rank + 1) * per_down],
    );
    let layer = ExpertParallelMoe {
        backend: Arc::from(backend.create()),
        comm,
        params: EpParams {
            num_experts: c.r * c.local,
            k: c.k,
            router: c.router(),
            block_size: c.b,
        },
    };
    let inputs = EpInputs {
        x: &data.x[rank],
        w: &data.w,
        gate_up_proj_weight: &gate_up,
        down_proj_weight: &down,
    };
    let (output, saved) = layer.forward(inputs)?;
    let grads = layer.backward(inputs, &saved, &data.d_output[rank])?;
    Ok((output, grads))
}
