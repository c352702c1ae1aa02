//! `ExpertParallelMoe`: an MoE layer whose experts are sharded over the ranks of a
//! communicator, composed of the kernels on any backend.
//!
//! ```text
//! forward:  router_topk (replicated router) → dispatch → permute → blockwise_mm → combine
//! backward: combine_bwd → blockwise_mm_bwd → dispatch_bwd → router_topk_bwd, with the router
//!           weight's gradient summed over the ranks (all-reduce)
//! ```
//! Each rank brings its own tokens `x [T, H]`, the replicated router `w [H, E]` and its local
//! experts `gate_up_proj_weight [E/R, H, 2, I]` and `down_proj_weight [E/R, I, H]` (rank r holds
//! experts `[r·E/R, (r+1)·E/R)`). A rank may receive no rows; its expert gradients are then 0.
//!
//! Whatever the inputs' dtype, every kernel runs with `output_dtype=float32`, so the layer's
//! outputs, checkpoints and gradients are f32.
//!
//! [`ShardedExperts`] is the expert half alone (dispatch … combine and back), for callers that
//! route the tokens themselves.

use std::time::{Duration, Instant};

use super::comm::Communicator;
use super::exchange::{DispatchParams, Dispatched, combine, combine_bwd, dispatch, dispatch_bwd};
use crate::backend::Backend;
use crate::contracts::{
    BlockwiseMm, BlockwiseMmBwd, BlockwiseMmBwdInputs, BlockwiseMmBwdParams, BlockwiseMmInputs,
    BlockwiseMmParams, OutputDType, Permute, PermuteInputs, PermuteOutputs, PermuteParams,
    RouterPipeline, RouterTopk, RouterTopkBwd, RouterTopkBwdInputs, RouterTopkBwdParams,
    RouterTopkInputs, RouterTopkOutputs, RouterTopkParams, XHbmLayout,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Parameters of [`ExpertParallelMoe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpParams {
    /// E, experts over all ranks (a multiple of R).
    pub num_experts: usize,
    /// K, experts per token.
    pub k: usize,
    /// The router's activation pipeline; `x` is `[T, H]` (`x_hbm_layout` must be 1).
    pub router: RouterPipeline,
    /// B of the local block plan.
    pub block_size: usize,
}

/// One rank's inputs.
#[derive(Clone, Copy, Debug)]
pub struct EpInputs<'a> {
    /// `[T, H]`.
    pub x: &'a Tensor,
    /// `[H, E]`, the same on every rank.
    pub w: &'a Tensor,
    /// `[E/R, H, 2, I]`, this rank's experts.
    pub gate_up_proj_weight: &'a Tensor,
    /// `[E/R, I, H]`.
    pub down_proj_weight: &'a Tensor,
}

/// What the backward needs from the forward.
#[derive(Clone, Debug)]
pub struct EpSaved {
    routed: RouterTopkOutputs,
    experts: ExpertsSaved,
}

/// One rank's gradients.
#[derive(Clone, Debug, PartialEq)]
pub struct EpGrads {
    /// `[T, H]` f32.
    pub d_x: Tensor,
    /// `[H, E]` f32, summed over all ranks (identical on every rank).
    pub d_w: Tensor,
    /// `[E/R, H, 2, I]` f32, this rank's experts.
    pub d_gate_up_proj_weight: Tensor,
    /// `[E/R, I, H]` f32.
    pub d_down_proj_weight: Tensor,
}

/// The layer on one rank: run `forward` then `backward` on every rank of `comm`.
pub struct ExpertParallelMoe<'a> {
    pub backend: &'a dyn Backend,
    pub comm: &'a dyn Communicator,
    pub params: EpParams,
}

impl ExpertParallelMoe<'_> {
    fn experts(&self) -> ShardedExperts<'_> {
        ShardedExperts {
            backend: self.backend,
            comm: self.comm,
            num_experts: self.params.num_experts,
            block_size: self.params.block_size,
        }
    }

    /// `output [T, H]` f32 and what the backward needs.
    pub fn forward(&self, inputs: EpInputs<'_>) -> Result<(Tensor, EpSaved)> {
        let p = self.params;
        if p.router.x_hbm_layout != XHbmLayout::TH {
            return Err(Error::param(
                "x_hbm_layout",
                "the expert-parallel layer takes x [T, H] (x_hbm_layout = 1)",
            ));
        }
        let routed = RouterTopk::new(
            RouterTopkInputs {
                x: inputs.x,
                w: inputs.w,
                w_bias: None,
                selection_bias: None,
            },
            RouterTopkParams {
                k: p.k,
                pipeline: p.router,
            },
        )
        .and_then(|call| {
            self.backend
                .router_topk(&call.with_output_dtype(OutputDType::Float32))
        });
        // A router error on one rank must stop every rank before the exchange.
        let routed = super::comm::agree(self.comm, routed)?;
        let (output, experts) = self.experts().forward(experts_inputs(inputs, &routed))?;
        Ok((output, EpSaved { routed, experts }))
    }

    /// Gradients of every input for `d_output [T, H]`.
    pub fn backward(
        &self,
        inputs: EpInputs<'_>,
        saved: &EpSaved,
        d_output: &Tensor,
    ) -> Result<EpGrads> {
        let p = self.params;
        let experts = self.experts().backward(
            experts_inputs(inputs, &saved.routed),
            &saved.experts,
            d_output,
        )?;
        let router = RouterTopkBwd::new(
            RouterTopkBwdInputs {
                x: inputs.x,
                w: inputs.w,
                router_logits: &saved.routed.router_logits,
                expert_index: &saved.routed.expert_index,
                d_topk_affinities: &experts.d_topk_affinities,
                d_router_logits: None,
            },
            RouterTopkBwdParams { pipeline: p.router },
        )
        .and_then(|call| {
            self.backend
                .router_topk_bwd(&call.with_output_dtype(OutputDType::Float32))
        });
        let router = super::comm::agree(self.comm, router)?;
        let mut d_w = router.d_w.f32_values().into_owned();
        self.comm.all_reduce_sum(&mut d_w)?;
        let d_x: Vec<f32> = router
            .d_x
            .f32_values()
            .iter()
            .zip(experts.d_x.f32_values().iter())
            .map(|(a, b)| a + b)
            .collect();
        Ok(EpGrads {
            d_x: Tensor::from_f32(inputs.x.shape(), d_x)?,
            d_w: Tensor::from_f32(inputs.w.shape(), d_w)?,
            d_gate_up_proj_weight: experts.d_gate_up_proj_weight,
            d_down_proj_weight: experts.d_down_proj_weight,
        })
    }
}

fn experts_inputs<'a>(inputs: EpInputs<'a>, routed: &'a RouterTopkOutputs) -> ExpertsInputs<'a> {
    ExpertsInputs {
        x: inputs.x,
        expert_index: &routed.expert_index,
        topk_affinities: &routed.topk_affinities,
        gate_up_proj_weight: inputs.gate_up_proj_weight,
        down_proj_weight: inputs.down_proj_weight,
    }
}

/// The expert half of the layer, for callers that route themselves (a trainer whose router
/// lives in its own autograd): dispatch → permute → blockwise_mm → combine, and back.
pub struct ShardedExperts<'a> {
    pub backend: &'a dyn Backend,
    pub comm: &'a dyn Communicator,
    /// E, experts over all ranks (a multiple of R).
    pub num_experts: usize,
    /// B of the local block plan.
    pub block_size: usize,
}

/// One rank's inputs to [`ShardedExperts`].
#[derive(Clone, Copy, Debug)]
pub struct ExpertsInputs<'a> {
    /// `[T, H]`.
    pub x: &'a Tensor,
    /// `[T, K]` i32, global expert ids.
    pub expert_index: &'a Tensor,
    /// `[T, K]`.
    pub topk_affinities: &'a Tensor,
    /// `[E/R, H, 2, I]`, this rank's experts.
    pub gate_up_proj_weight: &'a Tensor,
    /// `[E/R, I, H]`.
    pub down_proj_weight: &'a Tensor,
}

/// What [`ShardedExperts::backward`] needs from the forward.
#[derive(Clone, Debug)]
pub struct ExpertsSaved {
    dispatched: Dispatched,
    /// The local plan and checkpoints, when this rank received rows.
    local: Option<LocalExperts>,
    /// Wall time of the forward's dispatch and combine (waiting for other ranks included).
    exchange_time: Duration,
}

impl ExpertsSaved {
    /// Wall time the forward spent in dispatch and combine, waiting for other ranks included.
    pub fn exchange_time(&self) -> Duration {
        self.exchange_time
    }
}

#[derive(Clone, Debug)]
struct LocalExperts {
    /// `[R·S+1, H]`, the received rows in dispatch's layout plus the padding row.
    hidden_states: Tensor,
    plan: PermuteOutputs,
    gate_up_activations_t: Tensor,
    down_activations: Tensor,
}

/// One rank's gradients of [`ShardedExperts`].
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsGrads {
    /// `[T, H]` f32, through the experts only.
    pub d_x: Tensor,
    /// `[T, K]` f32.
    pub d_topk_affinities: Tensor,
    /// `[E/R, H, 2, I]` f32, this rank's experts, from every rank's tokens.
    pub d_gate_up_proj_weight: Tensor,
    /// `[E/R, I, H]` f32.
    pub d_down_proj_weight: Tensor,
    /// Wall time of the backward's exchanges (combine's and dispatch's backward), waiting for
    /// other ranks included.
    pub exchange_time: Duration,
}

impl ShardedExperts<'_> {
    /// `output [T, H]` f32: each token's rows through the experts of whichever ranks own them,
    /// weighted and summed back on this rank.
    pub fn forward(&self, inputs: ExpertsInputs<'_>) -> Result<(Tensor, ExpertsSaved)> {
        let start = Instant::now();
        let dispatched = dispatch(
            self.comm,
            inputs.x,
            inputs.expert_index,
            inputs.topk_affinities,
            DispatchParams {
                num_experts: self.num_experts,
            },
        )?;
        let mut exchange_time = start.elapsed();
        let local = super::comm::agree(self.comm, self.local_forward(inputs, &dispatched))?;
        let h = inputs.x.shape()[1];
        // `[R·S, H]`, dispatch's layout.
        let rows = dispatched.hidden_states.shape()[0];
        let expert_output = match &local {
            Some((output, _)) => output.clone(),
            None => Tensor::from_f32([rows, h], vec![0.0; rows * h])?,
        };
        let start = Instant::now();
        let output = combine(self.comm, &dispatched.route, &expert_output)?;
        exchange_time += start.elapsed();
        Ok((
            output,
            ExpertsSaved {
                dispatched,
                local: local.map(|(_, experts)| experts),
                exchange_time,
            },
        ))
    }

    /// This rank's experts on the rows it received (none when it received none).
    fn local_forward(
        &self,
        inputs: ExpertsInputs<'_>,
        dispatched: &Dispatched,
    ) -> Result<Option<(Tensor, LocalExperts)>> {
        let h = dispatched.hidden_states.shape()[1];
        let local_experts = self.num_experts / self.comm.size();
        if inputs.gate_up_proj_weight.shape().first() != Some(&local_experts) {
            return Err(Error::shape(
                "gate_up_proj_weight",
                format!("[E/R, H, 2, I] = [{local_experts}, {h}, 2, _]"),
                inputs.gate_up_proj_weight.shape(),
            ));
        }
        if dispatched.received_rows() == 0 {
            return Ok(None);
        }
        let hidden_states = with_padding_row(&dispatched.hidden_states)?;
        let plan = self.backend.permute(
            &Permute::new(
                PermuteInputs {
                    expert_index: &dispatched.expert_index,
                    topk_affinities: &dispatched.topk_affinities,
                },
                PermuteParams::new(local_experts, self.block_size),
            )?
            .with_output_dtype(OutputDType::Float32),
        )?;
        let out = self.backend.blockwise_mm(
            &BlockwiseMm::new(
                forward_inputs(&hidden_states, &plan, inputs),
                BlockwiseMmParams {
                    checkpoint_activation: true,
                    ..BlockwiseMmParams::default()
                },
            )?
            .with_output_dtype(OutputDType::Float32),
        )?;
        let (Some(gate_up_activations_t), Some(down_activations)) =
            (out.gate_up_activations_t, out.down_activations)
        else {
            return Err(Error::invalid(
                "blockwise_mm",
                "the backend returned no checkpoints",
            ));
        };
        Ok(Some((
            out.output
                .into_leading_rows("output", dispatched.hidden_states.shape()[0])?,
            LocalExperts {
                hidden_states,
                plan,
                gate_up_activations_t,
                down_activations,
            },
        )))
    }

    /// Gradients of `x`, the affinities and this rank's experts for `d_output [T, H]`.
    pub fn backward(
        &self,
        inputs: ExpertsInputs<'_>,
        saved: &ExpertsSaved,
        d_output: &Tensor,
    ) -> Result<ExpertsGrads> {
        let route = &saved.dispatched.route;
        let start = Instant::now();
        let d_expert_output = combine_bwd(self.comm, route, d_output)?;
        let mut exchange_time = start.elapsed();
        let local = super::comm::agree(
            self.comm,
            self.local_backward(inputs, saved, &d_expert_output),
        )?;
        let (d_rows, d_row_affinities, d_gate_up, d_down) = local;
        let start = Instant::now();
        let (d_x, d_topk_affinities) = dispatch_bwd(
            self.comm,
            route,
            inputs.expert_index,
            DispatchParams {
                num_experts: self.num_experts,
            },
            &d_rows,
            &d_row_affinities,
        )?;
        exchange_time += start.elapsed();
        Ok(ExpertsGrads {
            d_x,
            d_topk_affinities,
            d_gate_up_proj_weight: d_gate_up,
            d_down_proj_weight: d_down,
            exchange_time,
        })
    }

    /// `blockwise_mm_bwd` on the received rows: `(d rows [R·S, H], d row affinities [R·S, K],
    /// d gate_up, d down)` in dispatch's layout; zeros when this rank received no rows.
    fn local_backward(
        &self,
        inputs: ExpertsInputs<'_>,
        saved: &ExpertsSaved,
        d_expert_output: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let dispatched = &saved.dispatched;
        let zeros = |shape: &[usize]| Tensor::from_f32(shape, vec![0.0; shape.iter().product()]);
        let Some(local) = &saved.local else {
            return Ok((
                zeros(dispatched.hidden_states.shape())?,
                zeros(dispatched.expert_index.shape())?,
                zeros(inputs.gate_up_proj_weight.shape())?,
                zeros(inputs.down_proj_weight.shape())?,
            ));
        };
        let grads = self.backend.blockwise_mm_bwd(
            &BlockwiseMmBwd::new(
                BlockwiseMmBwdInputs {
                    forward: forward_inputs(&local.hidden_states, &local.plan, inputs),
                    gate_up_proj_act_checkpoint_t: &local.gate_up_activations_t,
                    down_proj_act_checkpoint: &local.down_activations,
                    output_hidden_states_grad: &with_padding_row(d_expert_output)?,
                    expert_index: Some(&dispatched.expert_index),
                },
                BlockwiseMmBwdParams::default(),
            )?
            .with_output_dtype(OutputDType::Float32),
        )?;
        let d_affinities = grads.d_topk_affinities.ok_or_else(|| {
            Error::invalid(
                "blockwise_mm_bwd",
                "the backend returned no d_topk_affinities",
            )
        })?;
        let rows = d_expert_output.shape()[0];
        Ok((
            grads
                .hidden_states_grad
                .into_leading_rows("hidden_states_grad", rows)?,
            d_affinities,
            grads.gate_up_proj_weight_grad,
            grads.down_proj_weight_grad,
        ))
    }
}

/// `rows [M, H]` as f32 followed by a zero row: the `[M+1, H]` layout of the blockwise kernels,
/// whose row M is the padding token's.
fn with_padding_row(rows: &Tensor) -> Result<Tensor> {
    let (m, h) = (rows.shape()[0], rows.shape()[1]);
    let mut padded = rows.f32_values().into_owned();
    padded.extend(std::iter::repeat_n(0.0, h));
    Tensor::from_f32([m + 1, h], padded)
}

fn forward_inputs<'a>(
    hidden_states: &'a Tensor,
    plan: &'a PermuteOutputs,
    inputs: ExpertsInputs<'a>,
) -> BlockwiseMmInputs<'a> {
    BlockwiseMmInputs {
        hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: inputs.gate_up_proj_weight,
        down_proj_weight: inputs.down_proj_weight,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
    }
}
