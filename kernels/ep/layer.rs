//! `ExpertParallelMoe`: an MoE layer whose experts are sharded over the ranks of a
//! communicator, composed of the kernels on any backend.
//!
//! ```text
//! forward:  router_topk (replicated router) → dispatch → local experts → combine
//! backward: combine_bwd → local experts' backward → dispatch_bwd → router_topk_bwd, with the
//!           router weight's gradient summed over the ranks (all-reduce)
//! ```
//! The local experts are [`LocalExperts`](crate::experts::LocalExperts), the one composition of `permute`, `blockwise_mm`
//! and `blockwise_mm_bwd`, on the rows dispatch delivered.
//! Each rank brings its own tokens `x [T, H]`, the replicated router `w [H, E]` and its local
//! experts `gate_up_proj_weight [E/R, H, 2, I]` and `down_proj_weight [E/R, I, H]` (rank r holds
//! experts `[r·E/R, (r+1)·E/R)`). A rank may receive no rows; its expert gradients are then 0.
//!
//! Whatever the inputs' dtype, every kernel runs with `output_dtype=float32`, so the layer's
//! outputs, checkpoints and gradients are f32.
//!
//! [`ShardedExperts`] is the expert half alone (dispatch … combine and back), for callers that
//! route the tokens themselves.

use std::rc::Rc;
use std::sync::Arc;

use super::comm::Communicator;
use super::exchange::{
    DispatchParams, Dispatched, Route, check_sharding, combine, combine_bwd, dispatch, dispatch_bwd,
};
use crate::backend::{Backend, PlannedCall};
use crate::contracts::{
    OutputDType, RouterPipeline, RouterTopk, RouterTopkBwd, RouterTopkBwdInputs,
    RouterTopkBwdParams, RouterTopkInputs, RouterTopkOutputs, RouterTopkParams, WeightLayout,
    XHbmLayout,
};
use crate::error::{Error, Result};
use crate::experts::{
    Experts, ExpertsGrads, ExpertsInputs, ExpertsSizes, LocalExperts, LocalSaved,
};
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
#[derive(Debug)]
pub struct EpSaved {
    routed: RouterTopkOutputs,
    experts: ShardedSaved,
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
pub struct ExpertParallelMoe {
    pub backend: Arc<dyn Backend>,
    pub comm: Rc<dyn Communicator>,
    pub params: EpParams,
}

impl ExpertParallelMoe {
    fn experts(&self) -> ShardedExperts {
        ShardedExperts {
            backend: Arc::clone(&self.backend),
            comm: Rc::clone(&self.comm),
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
        let routed = super::comm::agree(self.comm.as_ref(), routed)?;
        let (output, experts) = self
            .experts()
            .forward(experts_inputs(inputs, &routed), true)?;
        let experts = experts.ok_or_else(|| Error::invalid("dispatch", "no record was kept"))?;
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
            RouterTopkBwdParams {
                pipeline: p.router,
                compute_dtype: None,
            },
        )
        .and_then(|call| {
            self.backend
                .router_topk_bwd(&call.with_output_dtype(OutputDType::Float32))
        });
        let router = super::comm::agree(self.comm.as_ref(), router)?;
        let mut d_w = router.d_w.f32_values().into_owned();
        self.comm.all_reduce_sum(&mut d_w)?;
        let d_x: Vec<f32> = router
            .d_x
            .f32_values()
            .iter()
            .zip(experts.d_hidden_states.f32_values().iter())
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
        hidden_states: inputs.x,
        expert_index: &routed.expert_index,
        topk_affinities: &routed.topk_affinities,
        gate_up_proj_weight: inputs.gate_up_proj_weight,
        down_proj_weight: inputs.down_proj_weight,
        up_proj_weight: None,
    }
}

/// The expert half of the layer, for callers that route themselves (a trainer whose router
/// lives in its own autograd): dispatch → this rank's [`LocalExperts`] → combine, and back.
///
/// Its [`ExpertsInputs`] are this rank's tokens with global expert ids in `[0, E)` and this
/// rank's experts `gate_up_proj_weight [E/R, H, 2, I]`, `down_proj_weight [E/R, I, H]`. Every
/// kernel runs with `output_dtype=float32`: the output and the gradients are f32. Every rank
/// calls `forward` and `backward` of the same layer at the same point (they are collectives).
#[derive(Clone)]
pub struct ShardedExperts {
    pub backend: Arc<dyn Backend>,
    /// This rank's group.
    pub comm: Rc<dyn Communicator>,
    /// E, experts over all ranks (a multiple of R).
    pub num_experts: usize,
    /// B of the local block plan.
    pub block_size: usize,
}

/// What [`ShardedExperts::backward`] needs from the forward.
#[derive(Debug)]
pub struct ShardedSaved {
    route: Route,
    local: Received,
}

/// The rows dispatch delivered to this rank, in its layout (see [`Dispatched`]).
#[derive(Debug)]
struct Delivered {
    /// `[R·S, H]` f32.
    hidden_states: Tensor,
    /// `[R·S, K]` i32, local expert ids.
    expert_index: Tensor,
    /// `[R·S, K]` f32.
    topk_affinities: Tensor,
}

/// What this rank's experts did with the rows dispatch delivered.
#[derive(Debug)]
enum Received {
    /// Rows arrived: their forward through this rank's experts.
    Rows(Box<(Delivered, LocalSaved)>),
    /// No row arrived (dispatch's layout still has `[R·S, H]` zero rows and `[R·S, K]` slots).
    Nothing { rows: usize, k: usize },
}

impl ShardedExperts {
    /// This rank's experts, computing in f32.
    fn local(&self) -> LocalExperts {
        LocalExperts {
            backend: Arc::clone(&self.backend),
            block_size: self.block_size,
            output_dtype: OutputDType::Float32,
            weight_layout: WeightLayout::Nki,
        }
    }

    /// The sizes of the local experts' call on one of `ranks` ranks when every rank has
    /// `sizes.t` tokens: dispatch's layout of `R·T` rows, over this rank's `E/R` experts.
    pub fn local_sizes(sizes: ExpertsSizes, ranks: usize) -> Result<ExpertsSizes> {
        check_sharding(sizes.e, ranks)?;
        let t = sizes.t.checked_mul(ranks).ok_or_else(|| {
            Error::invalid(
                "hidden_states",
                format!(
                    "R·T = {ranks}·{} rows of dispatch's layout overflow",
                    sizes.t
                ),
            )
        })?;
        Ok(ExpertsSizes {
            t,
            e: sizes.e / ranks,
            ..sizes
        })
    }

    fn dispatch_params(&self) -> DispatchParams {
        DispatchParams {
            num_experts: self.num_experts,
        }
    }

    /// This rank's experts on the rows dispatch delivered (`received` of them real): their
    /// output in dispatch's layout `[R·S, H]`, zero where no row arrived.
    fn local_forward(
        &self,
        inputs: ExpertsInputs<'_>,
        delivered: Delivered,
        received: usize,
        record: bool,
    ) -> Result<(Tensor, Option<Received>)> {
        let [rows, h] = [0, 1].map(|axis| delivered.hidden_states.shape()[axis]);
        let local_experts = self.num_experts / self.comm.size();
        if inputs.gate_up_proj_weight.shape().first() != Some(&local_experts) {
            return Err(Error::shape(
                "gate_up_proj_weight",
                format!("[E/R, H, 2, I] = [{local_experts}, {h}, 2, _]"),
                inputs.gate_up_proj_weight.shape(),
            ));
        }
        if received == 0 {
            let k = delivered.expert_index.shape()[1];
            let zeros = Tensor::from_f32([rows, h], vec![0.0; rows * h])?;
            return Ok((zeros, record.then_some(Received::Nothing { rows, k })));
        }
        let (output, saved) = self
            .local()
            .forward(local_inputs(&delivered, inputs), record)?;
        Ok((
            output,
            saved.map(|saved| Received::Rows(Box::new((delivered, saved)))),
        ))
    }

    /// The backward of this rank's experts, in dispatch's layout; zeros when no row arrived.
    fn local_backward(
        &self,
        inputs: ExpertsInputs<'_>,
        received: &Received,
        d_expert_output: &Tensor,
    ) -> Result<ExpertsGrads> {
        match received {
            Received::Rows(rows) => {
                let (delivered, saved) = rows.as_ref();
                self.local()
                    .backward(local_inputs(delivered, inputs), saved, d_expert_output)
            }
            &Received::Nothing { rows, k } => {
                let zeros =
                    |shape: &[usize]| Tensor::from_f32(shape, vec![0.0; shape.iter().product()]);
                let h = d_expert_output.shape()[1];
                Ok(ExpertsGrads {
                    d_hidden_states: zeros(&[rows, h])?,
                    d_topk_affinities: zeros(&[rows, k])?,
                    d_gate_up_proj_weight: zeros(inputs.gate_up_proj_weight.shape())?,
                    d_down_proj_weight: zeros(inputs.down_proj_weight.shape())?,
                })
            }
        }
    }
}

impl Experts for ShardedExperts {
    type Saved = ShardedSaved;

    /// `output [T, H]` f32: each token's rows through the experts of whichever ranks own them,
    /// weighted and summed back on this rank.
    fn forward(
        &self,
        inputs: ExpertsInputs<'_>,
        record: bool,
    ) -> Result<(Tensor, Option<ShardedSaved>)> {
        let comm = self.comm.as_ref();
        let Dispatched {
            route,
            hidden_states,
            expert_index,
            topk_affinities,
        } = dispatch(
            comm,
            inputs.hidden_states,
            inputs.expert_index,
            inputs.topk_affinities,
            self.dispatch_params(),
        )?;
        let delivered = Delivered {
            hidden_states,
            expert_index,
            topk_affinities,
        };
        let received = route.received_rows();
        let (output, local) = super::comm::agree(
            comm,
            self.local_forward(inputs, delivered, received, record),
        )?;
        let output = combine(comm, &route, &output)?;
        Ok((output, local.map(|local| ShardedSaved { route, local })))
    }

    /// Gradients of the tokens (`[T, H]`, `[T, K]`, f32) and of this rank's experts (from
    /// every rank's tokens).
    fn backward(
        &self,
        inputs: ExpertsInputs<'_>,
        saved: &ShardedSaved,
        d_output: &Tensor,
    ) -> Result<ExpertsGrads> {
        let comm = self.comm.as_ref();
        let d_expert_output = combine_bwd(comm, &saved.route, d_output)?;
        let local = super::comm::agree(
            comm,
            self.local_backward(inputs, &saved.local, &d_expert_output),
        )?;
        let (d_hidden_states, d_topk_affinities) = dispatch_bwd(
            comm,
            &saved.route,
            inputs.expert_index,
            self.dispatch_params(),
            &local.d_hidden_states,
            &local.d_topk_affinities,
        )?;
        Ok(ExpertsGrads {
            d_hidden_states,
            d_topk_affinities,
            ..local
        })
    }

    /// The local experts' calls on dispatch's layout ([`Self::local_sizes`]), the same on
    /// every rank.
    fn planned_calls(&self, sizes: ExpertsSizes, record: bool) -> Result<Vec<PlannedCall>> {
        let local = Self::local_sizes(sizes, self.comm.size())?;
        self.local().planned_calls(local, record)
    }

    fn prepare(&self, sizes: ExpertsSizes, record: bool) -> Result<()> {
        let local = Self::local_sizes(sizes, self.comm.size())?;
        self.local().prepare(local, record)
    }
}

/// The rows dispatch delivered, with this rank's experts.
fn local_inputs<'a>(delivered: &'a Delivered, inputs: ExpertsInputs<'a>) -> ExpertsInputs<'a> {
    ExpertsInputs {
        hidden_states: &delivered.hidden_states,
        expert_index: &delivered.expert_index,
        topk_affinities: &delivered.topk_affinities,
        ..inputs
    }
}
