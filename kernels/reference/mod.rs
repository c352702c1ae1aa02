//! The `reference` backend: plain loops written for obvious correctness, every value widened to
//! f64 and accumulated in f64, outputs rounded once to f32 at the end. It is the oracle for the
//! other backends and for the trainer.
//!
//! The f64 cores ([`router`], [`rmsnorm`], [`load_balancing`], [`permute`], [`blockwise`]) are public so that
//! tests can differentiate them with finite differences without f32 rounding noise.

#![forbid(unsafe_code)]

// The blockwise reference indexes every tensor explicitly, subscript for subscript as in the
// formulas it implements.
#[allow(clippy::needless_range_loop)]
pub mod blockwise;
pub mod device_plan;
pub mod load_balancing;
pub mod moe_tkg;
pub mod permute;
pub mod rmsnorm;
pub mod router;
pub mod topk;
pub mod topk_reduce;

use crate::backend::{Backend, Tolerance};
use crate::composed::{self, RmsNorm};
use crate::contracts::spec::output;
use crate::contracts::tensors::{
    a2av_routing as a2, blockwise_mm as bm, blockwise_mm_bwd as bmb, load_balancing_loss as lb,
    load_balancing_loss_bwd as lbb, moe_tkg as tkg, permute as pm, permute_bwd as pmb,
    router_topk as rt, router_topk_bwd as rtb,
};
use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockPlan, BlockwiseDims, BlockwiseMm, BlockwiseMmBwd,
    BlockwiseMmGrads, BlockwiseMmInputs, BlockwiseMmOutputs, FindNonzeroIndices,
    FindNonzeroIndicesOutputs, FlattenSource, IndexedFlatten, IndexedFlattenOutputs,
    LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads, LoadBalancingLossOutputs,
    MoeBlockTkg, MoeBlockTkgOutputs, MoeTkg, MoeTkgDims, MoeTkgOutputs, Permute, PermuteBwd,
    PermuteDims, PermuteGrads, PermuteOutputs, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd,
    RmsNormRouterTopkTkgGrads, RmsNormRouterTopkTkgOutputs, RmsNormSpec, RouterDims, RouterTopk,
    RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs, SKIP, Topk, TopkOutputs, TopkReduce,
    TopkReduceDims, TopkReduceOutputs, WeightLayout,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Floats, Storage, Tensor, try_filled};
use blockwise::BlockwiseOperands;
use moe_tkg::TkgOperands;

/// The oracle backend. Stateless.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceBackend;

/// Rounds f64 values to an f32 tensor, refusing results that overflow f32.
fn f32_output(name: &str, shape: &[usize], values: &[f64]) -> Result<Tensor> {
    let data: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    if let Some(index) = data.iter().position(|v| !v.is_finite()) {
        return Err(Error::invalid(
            name,
            format!(
                "result {} at {} does not fit in f32",
                values[index],
                crate::tensor::position(shape, index)
            ),
        ));
    }
    Tensor::from_f32(shape, data)
}

/// Counts as an i32 tensor, refusing counts beyond i32.
fn i32_output(
    name: &str,
    shape: &[usize],
    values: impl IntoIterator<Item = usize>,
) -> Result<Tensor> {
    let data = values
        .into_iter()
        .map(|v| {
            i32::try_from(v).map_err(|_| Error::invalid(name, format!("count {v} exceeds i32")))
        })
        .collect::<Result<Vec<i32>>>()?;
    Tensor::from_i32(shape, data)
}

/// `x` as a matmul operand of a kernel computing in `compute_dtype`
/// ([`ComputeDType`](crate::contracts::ComputeDType)): rounded to the nearest bf16 (ties to
/// even) when that is bf16.
fn operand(compute_dtype: DType, x: f64) -> f64 {
    match compute_dtype {
        DType::BF16 => round_to_bf16(x),
        DType::F32 | DType::I32 => x,
    }
}

/// `x` rounded to the nearest bf16, ties to even, in one step. (`half`'s `bf16::from_f64` is
/// not correctly rounded near ties: it takes −0.70507854 to −0.703125, not the nearer
/// −0.70703125; and rounding through f32 first can land on a tie that `x` is not.)
fn round_to_bf16(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    // 8 significant bits from bf16's smallest normal exponent, −126, up; a fixed step below.
    let exponent = ((x.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let step = 2f64.powi(exponent.max(-126) - 7);
    let rounded = (x / step).round_ties_even() * step;
    if rounded.abs() > half::bf16::MAX.to_f64() {
        f64::INFINITY.copysign(x)
    } else {
        rounded
    }
}

/// Expert ids a validation found in `[0, E)`.
fn expert_ids(ids: &[i32]) -> Vec<usize> {
    ids.iter().map(|&id| id as usize).collect()
}

/// Widened copies of the blockwise operands.
struct OwnedOperands {
    /// The dimensions with the padding row: with `skip_token` the tokens get one (zeros) and
    /// the padding slots its id T, as nki-library's reference computes that case.
    dims: BlockwiseDims,
    hidden_states: Vec<f64>,
    affinities: Vec<f64>,
    gate_up: Vec<f64>,
    down: Vec<f64>,
    weight_layout: WeightLayout,
    gate_up_bias: Option<Vec<f64>>,
    down_bias: Option<Vec<f64>>,
    token_position_to_id: Vec<i32>,
}

impl OwnedOperands {
    fn new(
        inputs: &BlockwiseMmInputs<'_>,
        (plan, weight_layout): (BlockPlan<'_>, WeightLayout),
        dims: BlockwiseDims,
    ) -> Self {
        let BlockwiseDims { t, h, e, .. } = dims;
        let (mut hidden_states, mut affinities) = (
            inputs.hidden_states.to_f64_vec(),
            inputs.expert_affinities_masked.to_f64_vec(),
        );
        hidden_states.resize((t + 1) * h, 0.0);
        affinities.resize((t + 1) * e, 0.0);
        let token_position_to_id = (0..plan.token_position_to_id().len())
            .map(|position| plan.token(position).unwrap_or(t) as i32)
            .collect();
        Self {
            dims: BlockwiseDims {
                rows: t + 1,
                ..dims
            },
            hidden_states,
            affinities,
            gate_up: stacked_gate_up(inputs, dims),
            down: inputs.down_proj_weight.to_f64_vec(),
            weight_layout,
            gate_up_bias: inputs.gate_and_up_proj_bias.map(Tensor::to_f64_vec),
            down_bias: inputs.down_proj_bias.map(Tensor::to_f64_vec),
            token_position_to_id,
        }
    }

    fn borrow<'a>(&'a self, plan: BlockPlan<'a>) -> BlockwiseOperands<'a> {
        BlockwiseOperands {
            dims: self.dims,
            hidden_states: &self.hidden_states,
            expert_affinities_masked: &self.affinities,
            gate_up_proj_weight: &self.gate_up,
            down_proj_weight: &self.down,
            weight_layout: self.weight_layout,
            token_position_to_id: &self.token_position_to_id,
            block_to_expert: plan.block_to_expert(),
            gate_and_up_proj_bias: self.gate_up_bias.as_deref(),
            down_proj_bias: self.down_bias.as_deref(),
        }
    }
}

/// `gate_up_proj_weight` in f64; with a separate `up_proj_weight` (linear layout), each
/// expert's gate rows followed by its up rows: the `[E, 2, I, H]` the pair stands for.
fn stacked_gate_up(inputs: &BlockwiseMmInputs<'_>, dims: BlockwiseDims) -> Vec<f64> {
    let gate = inputs.gate_up_proj_weight.to_f64_vec();
    let Some(up) = inputs.up_proj_weight else {
        return gate;
    };
    let matrix = (dims.i * dims.h).max(1);
    gate.chunks(matrix)
        .zip(up.to_f64_vec().chunks(matrix))
        .flat_map(|(gate, up)| gate.iter().chain(up))
        .copied()
        .collect()
}

impl ReferenceBackend {
    /// The name that selects it.
    pub const NAME: &'static str = "reference";
}

impl Backend for ReferenceBackend {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    /// The oracle agrees with itself exactly.
    fn tolerance(&self, _dtype: DType) -> Tolerance {
        Tolerance::EXACT
    }

    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
        let (inputs, RouterDims { t, h, e, k }) = (call.inputs(), call.dims());
        let pipeline = call.params().pipeline;
        let w_bias = inputs.w_bias.map(Tensor::to_f64_vec);
        let selection_bias = inputs.selection_bias.map(Tensor::to_f64_vec);
        let fwd = router::router_forward(
            &pipeline.x_hbm_layout.tokens_major(inputs.x)?.to_f64_vec(),
            &inputs.w.to_f64_vec(),
            w_bias.as_deref(),
            selection_bias.as_deref(),
            (t, h, e, k),
            pipeline,
        )?;
        call.cast_outputs(RouterTopkOutputs {
            router_logits: f32_output(rt::ROUTER_LOGITS.name, &[t, e], &fwd.logits)?,
            expert_index: i32_output(rt::EXPERT_INDEX.name, &[t, k], fwd.expert_index)?,
            topk_affinities: f32_output(rt::TOPK_AFFINITIES.name, &[t, k], &fwd.topk_affinities)?,
            expert_affinities: f32_output(
                rt::EXPERT_AFFINITIES.name,
                &[t, e],
                &fwd.expert_affinities,
            )?,
        })
    }

    fn router_topk_bwd(&self, call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads> {
        let (inputs, RouterDims { t, h, e, k }) = (call.inputs(), call.dims());
        let pipeline = call.params().pipeline;
        let d_router_logits = inputs.d_router_logits.map(Tensor::to_f64_vec);
        let grads = router::router_backward(
            &pipeline.x_hbm_layout.tokens_major(inputs.x)?.to_f64_vec(),
            &inputs.w.to_f64_vec(),
            &inputs.router_logits.to_f64_vec(),
            &expert_ids(call.expert_ids()),
            &inputs.d_topk_affinities.to_f64_vec(),
            d_router_logits.as_deref(),
            (t, h, e, k),
            (pipeline, call.compute_dtype()),
        );
        let d_x = f32_output(rtb::D_X.name, &[t, h], &grads.d_x)?;
        call.cast_outputs(RouterTopkGrads {
            d_x: pipeline.x_hbm_layout.from_tokens_major(d_x)?,
            d_w: f32_output(rtb::D_W.name, &[h, e], &grads.d_w)?,
            d_w_bias: f32_output(rtb::D_W_BIAS.name, &[e], &grads.d_w_bias)?,
        })
    }

    fn load_balancing_loss(
        &self,
        call: &LoadBalancingLoss<'_>,
    ) -> Result<LoadBalancingLossOutputs> {
        let (inputs, dims) = (call.inputs(), call.dims());
        let (loss, counts) = load_balancing::load_balancing_forward(
            &inputs.router_logits.to_f64_vec(),
            &expert_ids(call.expert_ids()),
            dims,
        );
        Ok(LoadBalancingLossOutputs {
            aux_loss: f32_output(lb::AUX_LOSS.name, &[1], &[loss])?,
            expert_counts: i32_output(lb::EXPERT_COUNTS.name, &[dims.l, dims.e], counts)?,
        })
    }

    fn load_balancing_loss_bwd(
        &self,
        call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads> {
        let inputs = call.inputs();
        let d_logits = load_balancing::load_balancing_backward(
            &inputs.router_logits.to_f64_vec(),
            &expert_ids(call.expert_ids()),
            inputs.d_aux_loss.to_f64_vec()[0],
            call.dims(),
        );
        call.cast_outputs(LoadBalancingLossGrads {
            d_router_logits: f32_output(
                lbb::D_ROUTER_LOGITS.name,
                inputs.router_logits.shape(),
                &d_logits,
            )?,
        })
    }

    fn permute(&self, call: &Permute<'_>) -> Result<PermuteOutputs> {
        let (inputs, dims) = (call.inputs(), call.dims());
        let PermuteDims { e, b, n, .. } = dims;
        let rows = dims.rows();
        let plan = permute::permute(
            call.expert_ids(),
            &inputs.topk_affinities.to_f64_vec(),
            dims,
        )?;
        call.cast_outputs(PermuteOutputs {
            expert_counts: i32_output(pm::EXPERT_COUNTS.name, &[e], plan.expert_counts)?,
            token_position_to_id: Tensor::from_i32([n * b], plan.token_position_to_id)?,
            block_to_expert: Tensor::from_i32([n, 1], plan.block_to_expert)?,
            expert_affinities_masked: f32_output(
                pm::EXPERT_AFFINITIES_MASKED.name,
                &[rows * e, 1],
                &plan.expert_affinities_masked,
            )?,
            num_used_blocks: i32_output(pm::NUM_USED_BLOCKS.name, &[1], [plan.num_used_blocks])?,
        })
    }

    fn permute_bwd(&self, call: &PermuteBwd<'_>) -> Result<PermuteGrads> {
        let (inputs, (t, k, e)) = (call.inputs(), call.dims());
        let d = permute::permute_backward(
            call.expert_ids(),
            &inputs.expert_affinities_masked_grad.to_f64_vec(),
            k,
            e,
        );
        call.cast_outputs(PermuteGrads {
            d_topk_affinities: f32_output(pmb::D_TOPK_AFFINITIES.name, &[t, k], &d)?,
        })
    }

    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
        let (inputs, dims) = (call.inputs(), call.dims());
        let BlockwiseDims {
            rows, h, i, b, n, ..
        } = dims;
        let params = call.params();
        let owned = OwnedOperands::new(&inputs, (call.plan(), params.weight_layout), dims);
        let fwd = blockwise::blockwise_forward(
            &owned.borrow(call.plan()),
            blockwise::ExpertOptions {
                act_fn: params.activation_function,
                scaling: params.expert_affinities_scaling_mode,
                clamp: params.clamp,
                accumulating: params.is_tensor_update_accumulating,
                compute_dtype: call.compute_dtype(),
            },
        )?;
        let checkpoint = call.params().checkpoint_activation;
        call.cast_outputs(BlockwiseMmOutputs {
            // Without the padding row (`skip_token`), what the padding slots add is dropped.
            output: f32_output(bm::OUTPUT.name, &[rows, h], &fwd.output[..rows * h])?,
            gate_up_activations_t: checkpoint
                .then(|| {
                    f32_output(
                        bm::GATE_UP_ACTIVATIONS_T.name,
                        &[n, 2, i, b],
                        &fwd.gate_up_activations_t,
                    )
                })
                .transpose()?,
            down_activations: checkpoint
                .then(|| f32_output(bm::DOWN_ACTIVATIONS.name, &[n, b, h], &fwd.down_activations))
                .transpose()?,
        })
    }

    fn a2av_routing(&self, call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs> {
        let dims = call.dims();
        let (t, k, ranks) = (dims.t, dims.k, dims.ranks);
        let ids = call.expert_ids();
        // Rank by rank, the tokens with an expert there, ascending.
        let mut send_indices = try_filled(&output(&a2::SEND_INDICES), &[t, ranks], t as i32)?;
        let mut send_counts = Vec::with_capacity(ranks);
        for rank in 0..ranks {
            let tokens = (0..t).filter(|&token| {
                ids[token * k..(token + 1) * k]
                    .iter()
                    .any(|&id| id != SKIP && dims.rank_of(id as usize) == rank)
            });
            let mut count = 0;
            for (row, token) in tokens.enumerate() {
                send_indices[row * ranks + rank] = token as i32;
                count += 1;
            }
            send_counts.push(count);
        }
        Ok(A2avRoutingOutputs {
            send_indices: Tensor::from_i32([t, ranks], send_indices)?,
            send_counts: i32_output(a2::SEND_COUNTS.name, &[1, ranks], send_counts)?,
        })
    }

    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
        let (inputs, dims) = (call.inputs(), call.dims());
        let BlockwiseDims {
            t, rows, h, e, i, ..
        } = dims;
        let layout = call.params().weight_layout;
        let owned = OwnedOperands::new(&inputs.forward, (call.plan(), layout), dims);
        let mut output_grad = inputs.output_hidden_states_grad.to_f64_vec();
        output_grad.resize((t + 1) * h, 0.0);
        let grads = blockwise::blockwise_backward(
            &owned.borrow(call.plan()),
            &inputs.gate_up_proj_act_checkpoint_t.to_f64_vec(),
            &inputs.down_proj_act_checkpoint.to_f64_vec(),
            &output_grad,
            blockwise::ExpertOptions {
                act_fn: call.params().activation_type,
                scaling: call.params().expert_affinities_scaling_mode,
                clamp: call.params().clamp,
                compute_dtype: call.compute_dtype(),
                ..blockwise::ExpertOptions::default()
            },
        )?;
        let bias = call.params().bias;
        let d_topk_affinities = call
            .expert_ids()
            .map(|(ids, k)| {
                let d = permute::permute_backward(ids, &grads.expert_affinities_masked_grad, k, e);
                f32_output(bmb::D_TOPK_AFFINITIES.name, &[t, k], &d)
            })
            .transpose()?;
        call.cast_outputs(BlockwiseMmGrads {
            hidden_states_grad: f32_output(
                bmb::HIDDEN_STATES_GRAD.name,
                &[rows, h],
                &grads.hidden_states_grad[..rows * h],
            )?,
            expert_affinities_masked_grad: f32_output(
                bmb::EXPERT_AFFINITIES_MASKED_GRAD.name,
                &[rows * e, 1],
                &grads.expert_affinities_masked_grad[..rows * e],
            )?,
            gate_up_proj_weight_grad: f32_output(
                bmb::GATE_UP_PROJ_WEIGHT_GRAD.name,
                &layout.gate_up_dims(e, h, i),
                &grads.gate_up_proj_weight_grad,
            )?,
            down_proj_weight_grad: f32_output(
                bmb::DOWN_PROJ_WEIGHT_GRAD.name,
                &layout.down_dims(e, h, i),
                &grads.down_proj_weight_grad,
            )?,
            d_topk_affinities,
            gate_and_up_proj_bias_grad: bias
                .then(|| {
                    f32_output(
                        bmb::GATE_AND_UP_PROJ_BIAS_GRAD.name,
                        &[e, 2, i],
                        &grads.gate_and_up_proj_bias_grad,
                    )
                })
                .transpose()?,
            down_proj_bias_grad: bias
                .then(|| {
                    f32_output(
                        bmb::DOWN_PROJ_BIAS_GRAD.name,
                        &[e, h],
                        &grads.down_proj_bias_grad,
                    )
                })
                .transpose()?,
        })
    }

    fn moe_tkg(&self, call: &MoeTkg<'_>) -> Result<MoeTkgOutputs> {
        let (inputs, params) = (call.inputs(), call.params());
        let MoeTkgDims { t, h, .. } = call.dims();
        let gate_up_bias = inputs.expert_gate_up_bias.map(Tensor::to_f64_vec);
        let down_bias = inputs.expert_down_bias.map(Tensor::to_f64_vec);
        let ops = TkgOperands {
            dims: call.dims(),
            hidden_input: &inputs.hidden_input.to_f64_vec(),
            expert_gate_up_weights: &inputs.expert_gate_up_weights.to_f64_vec(),
            expert_down_weights: &inputs.expert_down_weights.to_f64_vec(),
            expert_gate_up_bias: gate_up_bias.as_deref(),
            expert_down_bias: down_bias.as_deref(),
            activation_fn: params.activation_fn,
            clamp: params.clamp,
        };
        let output = moe_tkg::moe_tkg_forward(&ops, call.routing());
        call.cast_outputs(MoeTkgOutputs {
            output: f32_output(tkg::OUTPUT.name, &[t, h], &output)?,
        })
    }

    fn rmsnorm_router_topk_tkg(
        &self,
        call: &RmsNormRouterTopkTkg<'_>,
    ) -> Result<RmsNormRouterTopkTkgOutputs> {
        composed::rmsnorm_router_topk_tkg(self, self, call)
    }

    fn rmsnorm_router_topk_tkg_bwd(
        &self,
        call: &RmsNormRouterTopkTkgBwd<'_>,
    ) -> Result<RmsNormRouterTopkTkgGrads> {
        composed::rmsnorm_router_topk_tkg_bwd(self, self, call)
    }

    fn moe_block_tkg(&self, call: &MoeBlockTkg<'_>) -> Result<MoeBlockTkgOutputs> {
        composed::moe_block_tkg(self, self, call)
    }

    fn topk(&self, call: &Topk<'_>) -> Result<TopkOutputs> {
        call.outputs_at(topk::topk_positions(call))
    }

    fn topk_reduce(&self, call: &TopkReduce<'_>) -> Result<TopkReduceOutputs> {
        let TopkReduceDims { t, h, .. } = call.dims();
        call.cast_outputs(TopkReduceOutputs {
            output: Tensor::from_f32([t, h], topk_reduce::topk_reduce(call))?,
        })
    }

    fn find_nonzero_indices(
        &self,
        call: &FindNonzeroIndices<'_>,
    ) -> Result<FindNonzeroIndicesOutputs> {
        call.outputs_from(device_plan::nonzero_rows(call))
    }

    fn indexed_flatten(&self, call: &IndexedFlatten<'_>) -> Result<IndexedFlattenOutputs> {
        let flattened = match call.source() {
            FlattenSource::F32(input, pad) => {
                Storage::F32(device_plan::flattened(call, input, pad)?.into())
            }
            FlattenSource::BF16(input, pad) => {
                Storage::BF16(device_plan::flattened(call, input, pad)?.into())
            }
            FlattenSource::I32(input, pad) => {
                Storage::I32(device_plan::flattened(call, input, pad)?.into())
            }
        };
        call.outputs_from(flattened)
    }
}

fn widened(values: Floats<'_>) -> Vec<f64> {
    values.to_f32().iter().map(|&x| f64::from(x)).collect()
}

/// f64 results rounded once to f32.
fn rounded(values: Vec<f64>) -> Vec<f32> {
    values.into_iter().map(|x| x as f32).collect()
}

/// The f64 RMSNorm of [`rmsnorm`].
impl RmsNorm for ReferenceBackend {
    fn forward(&self, spec: RmsNormSpec, x: Floats<'_>, gamma: Floats<'_>) -> Result<Vec<f32>> {
        let y = rmsnorm::rmsnorm_forward(&widened(x), &widened(gamma), spec)?;
        Ok(rounded(y))
    }

    fn backward(
        &self,
        spec: RmsNormSpec,
        x: Floats<'_>,
        gamma: Floats<'_>,
        d_y: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let d_y: Vec<f64> = d_y.iter().map(|&d| f64::from(d)).collect();
        let (d_x, d_gamma) = rmsnorm::rmsnorm_backward(&widened(x), &widened(gamma), &d_y, spec)?;
        Ok((rounded(d_x), rounded(d_gamma)))
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::round_to_bf16;

    #[test]
    fn rounds_to_the_nearest_bf16_in_one_step() {
        // f32 values across every exponent, subnormals and the overflow edge included: their
        // f32-to-bf16 rounding (ties to even, on the bits) is exact to check against.
        for bits in (0..u32::MAX).step_by(65_521) {
            let x = f32::from_bits(bits);
            if !x.is_nan() {
                assert_eq!(
                    round_to_bf16(f64::from(x)),
                    bf16::from_f32(x).to_f64(),
                    "{x:e}"
                );
            }
        }
        assert_eq!(round_to_bf16(f64::from(-0.705_078_54_f32)), -0.707_031_25);
        // Just above the tie between 1 and 1 + 2⁻⁷ rounds up; through f32 it would become the
        // tie itself, which goes to the even neighbour, 1.
        let tie = 1.0 + 2f64.powi(-8);
        assert_eq!(round_to_bf16(tie), 1.0);
        assert_eq!(round_to_bf16(tie + 2f64.powi(-30)), 1.0 + 2f64.powi(-7));
        // Half a step past bf16's largest finite value is a tie, which rounds to infinity.
        let max = bf16::MAX.to_f64();
        assert_eq!(round_to_bf16(max + 2f64.powi(119)), f64::INFINITY);
        assert_eq!(round_to_bf16(-(max + 2f64.powi(118))), -max);
    }
}
