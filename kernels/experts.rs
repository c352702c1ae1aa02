//! The routed experts of one MoE layer, composed of the kernels once for every caller
//! (moekit's own): the [`Experts`] interface, with [`LocalExperts`] on one rank and
//! [`ShardedExperts`](crate::ep::ShardedExperts) over the ranks of a communicator.
//!
//! ```text
//! forward:  permute (the block plan) → blockwise_mm (checkpointing when a backward follows)
//! backward: blockwise_mm_bwd on the forward's validated call
//! ```
//!
//! The tokens arrive routed: `hidden_states [T, H]`, `expert_index [T, K]` and
//! `topk_affinities [T, K]`. They run in nki-library's `skip_token` layout (padding slots hold
//! −1), so `hidden_states` is read as given, with no `[T+1, H]` copy carrying a zero padding row,
//! and the output and its gradient are `[T, H]`.
//!
//! As nki-library's backward kernels do, the backward takes the forward's inputs again, and
//! they must be the very tensors the forward read (the backward refuses others, by address,
//! dtype and shape) and unchanged since. It checks only what it adds (the output gradient, and
//! the checkpoints' shapes: their values are the forward's own outputs): the forward's
//! tensors, plan and weights were checked once, when the forward ran.

use std::sync::Arc;

use crate::backend::{Backend, PlannedCall};
use crate::contracts::{
    BlockwiseDims, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmBwdAdded, BlockwiseMmInputs,
    BlockwiseMmParams, OutputDType, Permute, PermuteInputs, PermuteOutputs, PermuteParams,
    SkipMode, WeightLayout,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};

/// The routed experts of one MoE layer: `forward → (output, saved state)`, then
/// `backward(saved state, output gradient)` on the same inputs.
pub trait Experts {
    /// What the backward needs from its forward.
    type Saved;

    /// `output [T, H]`, each token's expert outputs weighted by its affinities and summed;
    /// with `record`, also what the backward needs (the forward then keeps its checkpoints).
    fn forward(
        &self,
        inputs: ExpertsInputs<'_>,
        record: bool,
    ) -> Result<(Tensor, Option<Self::Saved>)>;

    /// The gradients of the tokens, their affinities and the weights for `d_output [T, H]`,
    /// the gradient of the forward's output. `inputs` must be the forward's.
    fn backward(
        &self,
        inputs: ExpertsInputs<'_>,
        saved: &Self::Saved,
        d_output: &Tensor,
    ) -> Result<ExpertsGrads>;

    /// The backend calls of compiled shapes a forward of `sizes` makes (and, with `record`, its
    /// backward): what a backend of compiled kernels must have for them.
    fn planned_calls(&self, sizes: ExpertsSizes, record: bool) -> Result<Vec<PlannedCall>>;

    /// Readies the backend for a forward of `sizes` (and, with `record`, its backward), or
    /// says what it lacks ([`Backend::prepare`] of [`Self::planned_calls`]).
    fn prepare(&self, sizes: ExpertsSizes, record: bool) -> Result<()>;
}

/// The sizes of one experts call: T tokens, each routed to K of E experts of hidden size H and
/// intermediate size I. E counts every expert (over all ranks when sharded), T this rank's
/// tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertsSizes {
    pub t: usize,
    pub h: usize,
    pub e: usize,
    pub k: usize,
    pub i: usize,
}

/// The inputs of one call: the routed tokens and the experts' weights, the caller's.
#[derive(Clone, Copy, Debug)]
pub struct ExpertsInputs<'a> {
    /// `[T, H]`.
    pub hidden_states: &'a Tensor,
    /// `[T, K]` i32: expert ids in `[0, E)`, or [`SKIP`](crate::contracts::SKIP).
    pub expert_index: &'a Tensor,
    /// `[T, K]`: each slot's weight (0 in skipped slots).
    pub topk_affinities: &'a Tensor,
    /// `[E, H, 2, I]` (this rank's `E/R` experts when sharded), or `[E, 2, I, H]` in the
    /// experts' [`WeightLayout::Linear`] (the gate projection's `[E, I, H]` alone with
    /// `up_proj_weight`).
    pub gate_up_proj_weight: &'a Tensor,
    /// `[E, I, H]` (this rank's `E/R` experts when sharded), or `[E, H, I]` in the experts'
    /// [`WeightLayout::Linear`].
    pub down_proj_weight: &'a Tensor,
    /// With [`WeightLayout::Linear`] only: the up projection's `[E, I, H]` apart from the
    /// gate's (`blockwise_mm`'s `up_proj_weight`); the weight gradient is still the stacked
    /// `[E, 2, I, H]`.
    pub up_proj_weight: Option<&'a Tensor>,
}

impl<'a> ExpertsInputs<'a> {
    /// The call's sizes with weights in `layout`, or the error naming the first tensor whose
    /// shape disagrees with the others': T and H read off `hidden_states [T, H]`, K off
    /// `expert_index [T, K]`, E and I off `gate_up_proj_weight` (`[E, H, 2, I]`, or
    /// `[E, 2, I, H]`, or with `up_proj_weight` `[E, I, H]`). (Dtypes and values are the
    /// kernels' to check.)
    pub fn sizes(&self, layout: WeightLayout) -> Result<ExpertsSizes> {
        let (t, h) = match self.hidden_states.shape() {
            &[t, h] => (t, h),
            shape => return Err(Error::shape("hidden_states", "[T, H]", shape)),
        };
        let k = match self.expert_index.shape() {
            &[rows, k] if rows == t => k,
            shape => {
                return Err(Error::shape(
                    "expert_index",
                    format!("[T, K] = [{t}, _]"),
                    shape,
                ));
            }
        };
        if self.topk_affinities.shape() != [t, k] {
            return Err(Error::shape(
                "topk_affinities",
                format!("[T, K] = [{t}, {k}]"),
                self.topk_affinities.shape(),
            ));
        }
        let split = self.up_proj_weight.is_some();
        let (e, i) = match (layout, split, self.gate_up_proj_weight.shape()) {
            (WeightLayout::Nki, false, &[e, rows, 2, i]) if rows == h => (e, i),
            (WeightLayout::Linear, false, &[e, 2, i, cols]) if cols == h => (e, i),
            (WeightLayout::Linear, true, &[e, i, cols]) if cols == h => (e, i),
            (WeightLayout::Nki, true, _) => {
                return Err(Error::invalid(
                    "up_proj_weight",
                    "takes the linear weight layout (`[E, I, H]` gate and up weights)",
                ));
            }
            (_, _, shape) => {
                let known = match (layout, split) {
                    (WeightLayout::Nki, _) => {
                        format!("{} = [_, {h}, 2, _]", layout.gate_up_shape())
                    }
                    (WeightLayout::Linear, false) => {
                        format!("{} = [_, 2, _, {h}]", layout.gate_up_shape())
                    }
                    (WeightLayout::Linear, true) => format!("[E, I, H] = [_, _, {h}]"),
                };
                return Err(Error::shape("gate_up_proj_weight", known, shape));
            }
        };
        if let Some(up) = self.up_proj_weight
            && up.shape() != [e, i, h]
        {
            return Err(Error::shape(
                "up_proj_weight",
                format!("[E, I, H] = {:?}", [e, i, h]),
                up.shape(),
            ));
        }
        let down = layout.down_dims(e, h, i);
        if self.down_proj_weight.shape() != down {
            return Err(Error::shape(
                "down_proj_weight",
                format!("{} = {down:?}", layout.down_shape()),
                self.down_proj_weight.shape(),
            ));
        }
        Ok(ExpertsSizes { t, h, e, k, i })
    }

    /// Each input with its contract name (`up_proj_weight` when given).
    fn named(self) -> [(&'static str, Option<&'a Tensor>); 6] {
        [
            ("hidden_states", Some(self.hidden_states)),
            ("expert_index", Some(self.expert_index)),
            ("topk_affinities", Some(self.topk_affinities)),
            ("gate_up_proj_weight", Some(self.gate_up_proj_weight)),
            ("down_proj_weight", Some(self.down_proj_weight)),
            ("up_proj_weight", self.up_proj_weight),
        ]
    }
}

/// The gradients of one [`Experts::backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsGrads {
    /// `[T, H]`, in the experts' output dtype.
    pub d_hidden_states: Tensor,
    /// `[T, K]` (0 in skipped slots).
    pub d_topk_affinities: Tensor,
    /// Shaped and laid out as `gate_up_proj_weight`.
    pub d_gate_up_proj_weight: Tensor,
    /// Shaped and laid out as `down_proj_weight`.
    pub d_down_proj_weight: Tensor,
}

/// The experts on one backend, all E of them on this rank.
#[derive(Clone)]
pub struct LocalExperts {
    pub backend: Arc<dyn Backend>,
    /// B of the block plan.
    pub block_size: usize,
    /// The dtype of the plan's affinities, the output and the gradients ([`OutputDType`]).
    pub output_dtype: OutputDType,
    /// The layout of the weights and of their gradients.
    pub weight_layout: WeightLayout,
}

/// What [`LocalExperts::backward`] needs from its forward: the plan, the checkpoints, and what
/// the forward's validation established.
#[derive(Clone, Debug)]
pub struct LocalSaved {
    /// The inputs it ran on, in [`ExpertsInputs::named`]'s order.
    inputs: [Option<TensorIdentity>; 6],
    plan: PermuteOutputs,
    params: BlockwiseMmParams,
    dims: BlockwiseDims,
    /// `[N, 2, I, B]`.
    gate_up_activations_t: Tensor,
    /// `[N, B, H]`.
    down_activations: Tensor,
}

/// nki-library's layout without a padding row: padding slots hold −1.
const SKIP_TOKEN: SkipMode = SkipMode { skip_token: true };

/// The experts have no biases: their backward returns no bias gradients.
const BIAS_GRADIENTS: bool = false;

impl LocalExperts {
    /// The block size B callers take when they set none (moekit's own choice: whole register
    /// tiles of rows, few padding slots per expert at training batch sizes).
    pub const DEFAULT_BLOCK_SIZE: usize = 64;

    /// The block plan's parameters for `experts` experts.
    fn permute_params(&self, experts: usize) -> PermuteParams {
        PermuteParams {
            skip_dma: SKIP_TOKEN,
            ..PermuteParams::new(experts, self.block_size)
        }
    }

    /// The forward's `blockwise_mm` parameters (checkpointing when a backward follows).
    fn forward_params(&self, record: bool) -> BlockwiseMmParams {
        BlockwiseMmParams {
            checkpoint_activation: record,
            skip_dma: SKIP_TOKEN,
            weight_layout: self.weight_layout,
            ..BlockwiseMmParams::default()
        }
    }
}

impl Experts for LocalExperts {
    type Saved = LocalSaved;

    fn forward(
        &self,
        inputs: ExpertsInputs<'_>,
        record: bool,
    ) -> Result<(Tensor, Option<LocalSaved>)> {
        let experts = inputs.sizes(self.weight_layout)?.e;
        let plan = self.backend.permute(
            &Permute::new(
                PermuteInputs {
                    expert_index: inputs.expert_index,
                    topk_affinities: inputs.topk_affinities,
                },
                self.permute_params(experts),
            )?
            .with_output_dtype(self.output_dtype),
        )?;
        let params = self.forward_params(record);
        let call = BlockwiseMm::new(blockwise_inputs(inputs, &plan), params)?
            .with_output_dtype(self.output_dtype);
        let dims = call.dims();
        let out = self.backend.blockwise_mm(&call)?;
        if !record {
            return Ok((out.output, None));
        }
        let (Some(gate_up_activations_t), Some(down_activations)) =
            (out.gate_up_activations_t, out.down_activations)
        else {
            return Err(Error::invalid(
                "blockwise_mm",
                format!("backend `{}` returned no checkpoints", self.backend.name()),
            ));
        };
        let saved = LocalSaved {
            inputs: inputs
                .named()
                .map(|(_, tensor)| tensor.map(TensorIdentity::of)),
            plan,
            params,
            dims,
            gate_up_activations_t,
            down_activations,
        };
        Ok((out.output, Some(saved)))
    }

    fn backward(
        &self,
        inputs: ExpertsInputs<'_>,
        saved: &LocalSaved,
        d_output: &Tensor,
    ) -> Result<ExpertsGrads> {
        for ((name, tensor), identity) in inputs.named().into_iter().zip(&saved.inputs) {
            if tensor.map(TensorIdentity::of) != *identity {
                return Err(Error::invalid(
                    name,
                    "the backward was given another tensor than its forward",
                ));
            }
        }
        let forward = BlockwiseMm::rebuilt(
            blockwise_inputs(inputs, &saved.plan),
            saved.params,
            saved.dims,
        )?;
        let call = BlockwiseMmBwd::of_own_forward(
            &forward,
            BlockwiseMmBwdAdded {
                gate_up_proj_act_checkpoint_t: &saved.gate_up_activations_t,
                down_proj_act_checkpoint: &saved.down_activations,
                output_hidden_states_grad: d_output,
                expert_index: Some(inputs.expert_index),
            },
            BIAS_GRADIENTS,
        )?
        .with_output_dtype(self.output_dtype);
        let grads = self.backend.blockwise_mm_bwd(&call)?;
        let d_topk_affinities = grads.d_topk_affinities.ok_or_else(|| {
            Error::invalid(
                "blockwise_mm_bwd",
                format!(
                    "backend `{}` returned no d_topk_affinities",
                    self.backend.name()
                ),
            )
        })?;
        Ok(ExpertsGrads {
            d_hidden_states: grads.hidden_states_grad,
            d_topk_affinities,
            d_gate_up_proj_weight: grads.gate_up_proj_weight_grad,
            d_down_proj_weight: grads.down_proj_weight_grad,
        })
    }

    /// `blockwise_mm` (and `blockwise_mm_bwd`) on T rows of `skip_token`'s layout and the
    /// static plan of T·K assignments (the `permute` plan runs at any shape).
    fn planned_calls(&self, sizes: ExpertsSizes, record: bool) -> Result<Vec<PlannedCall>> {
        let ExpertsSizes { t, h, e, k, i } = sizes;
        let dims = BlockwiseDims {
            t,
            rows: t,
            h,
            e,
            i,
            b: self.block_size,
            n: self.permute_params(e).block_count(t, k)?,
        };
        let params = self.forward_params(record);
        let mut calls = vec![PlannedCall::BlockwiseMm { dims, params }];
        if record {
            calls.push(PlannedCall::BlockwiseMmBwd {
                dims,
                params: params.backward(BIAS_GRADIENTS),
            });
        }
        Ok(calls)
    }

    fn prepare(&self, sizes: ExpertsSizes, record: bool) -> Result<()> {
        self.backend.prepare(&self.planned_calls(sizes, record)?)
    }
}

fn blockwise_inputs<'a>(
    inputs: ExpertsInputs<'a>,
    plan: &'a PermuteOutputs,
) -> BlockwiseMmInputs<'a> {
    BlockwiseMmInputs {
        hidden_states: inputs.hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: inputs.gate_up_proj_weight,
        down_proj_weight: inputs.down_proj_weight,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
        up_proj_weight: inputs.up_proj_weight,
    }
}

/// Which tensor a reference points at: its elements' address, its dtype and its shape.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TensorIdentity {
    address: usize,
    dtype: DType,
    shape: Vec<usize>,
}

impl TensorIdentity {
    fn of(tensor: &Tensor) -> Self {
        let address = match tensor.storage() {
            Storage::F32(v) => v.as_ptr() as usize,
            Storage::BF16(v) => v.as_ptr() as usize,
            Storage::I32(v) => v.as_ptr() as usize,
        };
        Self {
            address,
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
        }
    }
}
