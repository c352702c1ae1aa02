//! A routed MoE layer on seeded inputs: the fixture benchmarks and checks run kernels on. Its
//! sizes come from a named shape ([`MoeShape`]) or from a check's random draw; the router, the
//! block plan and the expert forward (with checkpoints) come from one backend, so every kernel
//! call built from it has valid, consistent inputs.

use std::str::FromStr;

use half::bf16;
use moekit::contracts::*;
use moekit::error::find_named;
use moekit::experts::ExpertsInputs;
use moekit::random::SplitMix64;
use moekit::tensor::try_capacity;
use moekit::{Backend, DType, Error, Result, Tensor};

/// An MoE layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub name: &'static str,
    pub h: usize,
    pub i: usize,
    pub e: usize,
    pub k: usize,
}

impl MoeShape {
    /// The shapes benchmarks know by name.
    pub const ALL: &'static [MoeShape] = &[
        MoeShape {
            name: "tiny",
            h: 64,
            i: 32,
            e: 8,
            k: 2,
        },
        // The MoE layer of the trainer's benchmark config (configs/qwen3_moe_small.toml).
        MoeShape {
            name: "qwen3-moe-small",
            h: 256,
            i: 128,
            e: 32,
            k: 4,
        },
        MoeShape {
            name: "qwen3-30b-a3b",
            h: 2048,
            i: 768,
            e: 128,
            k: 8,
        },
        MoeShape {
            name: "qwen3-235b-a22b",
            h: 4096,
            i: 1536,
            e: 128,
            k: 8,
        },
    ];
}

impl FromStr for MoeShape {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        find_named(Self::ALL, |shape| shape.name, s)
            .map_err(|known| Error::param("shape", format!("unknown shape `{s}`; known: {known}")))
    }
}

/// Deterministic pseudo-random values uniform in `[-scale, scale)` for the benchmark input
/// `name` of `shape`, or the error naming it when they cannot be allocated.
fn uniform(name: &str, shape: &[usize], scale: f32, seed: u64) -> Result<Vec<f32>> {
    let mut values = try_capacity(&format!("benchmark input `{name}`"), shape)?;
    let mut rng = SplitMix64::new(seed);
    let scale = f64::from(scale);
    values.extend((0..shape.iter().product()).map(|_| rng.uniform(-scale, scale) as f32));
    Ok(values)
}

fn float_tensor(shape: &[usize], values: Vec<f32>, dtype: DType) -> Result<Tensor> {
    let tensor = Tensor::from_f32(shape, values)?;
    Ok(if dtype == DType::BF16 {
        tensor.to_bf16()
    } else {
        tensor
    })
}

/// Qwen3's vocabulary: the last axis of [`LayerInputs::vocabulary_logits`].
pub const VOCAB: usize = 151_936;

/// The K of the top-k over a vocabulary, as nki-library's `topk` tests mostly take it.
pub const VOCAB_TOP_K: usize = 256;

/// One MoE layer's inputs at a benchmark shape: deterministic activations, weights and
/// gradients.
pub struct LayerInputs {
    pub shape: MoeShape,
    pub block_size: usize,
    pub x: Tensor,
    pub w: Tensor,
    pub hidden_states: Tensor,
    pub gate_up_proj_weight: Tensor,
    pub down_proj_weight: Tensor,
    pub d_topk_affinities: Tensor,
    pub d_aux_loss: Tensor,
    pub output_hidden_states_grad: Tensor,
    /// `[1, H]`, the decode-time RMSNorm's weight (`rmsnorm_router_topk_tkg`).
    pub gamma: Tensor,
    /// `[T, E]` f32, the gradient of `rmsnorm_router_topk_tkg`'s scattered affinities.
    pub d_expert_affinities: Tensor,
}

impl LayerInputs {
    pub fn new(shape: MoeShape, tokens: usize, dtype: DType, block_size: usize) -> Result<Self> {
        Self::seeded(shape, tokens, dtype, block_size, 0)
    }

    /// As [`LayerInputs::new`], with values drawn from stream `seed` (`new` is seed 0).
    pub fn seeded(
        shape: MoeShape,
        tokens: usize,
        dtype: DType,
        block_size: usize,
        seed: u64,
    ) -> Result<Self> {
        let MoeShape { h, i, e, k, .. } = shape;
        let uniform = |name, shape: &[usize], scale, stream: u64| {
            uniform(name, shape, scale, seed.wrapping_mul(16) + stream)
        };
        let t = tokens;
        if t == 0 {
            return Err(Error::param("tokens", "must be at least 1, got 0"));
        }
        let scale = 1.0 / (h as f32).sqrt();
        let x_values = uniform("x", &[t, h], 1.0, 1)?;
        // hidden_states [T+1, H]: x, then the zero padding row (T+1 cannot overflow: x holds
        // T rows).
        let padded = with_padding_row("hidden_states", &x_values, [t, h])?;
        let output_grad = uniform("output_hidden_states_grad", &[t, h], 1.0, 5)?;
        Ok(Self {
            shape,
            block_size,
            x: float_tensor(&[t, h], x_values, dtype)?,
            w: float_tensor(&[h, e], uniform("w", &[h, e], scale, 2)?, dtype)?,
            hidden_states: float_tensor(&[t + 1, h], padded, dtype)?,
            gate_up_proj_weight: float_tensor(
                &[e, h, 2, i],
                uniform("gate_up_proj_weight", &[e, h, 2, i], scale, 3)?,
                dtype,
            )?,
            down_proj_weight: float_tensor(
                &[e, i, h],
                uniform("down_proj_weight", &[e, i, h], 1.0 / (i as f32).sqrt(), 4)?,
                dtype,
            )?,
            d_topk_affinities: Tensor::from_f32(
                [t, k],
                uniform("d_topk_affinities", &[t, k], 1.0, 6)?,
            )?,
            d_aux_loss: Tensor::from_f32([1], vec![1.0])?,
            output_hidden_states_grad: float_tensor(
                &[t + 1, h],
                with_padding_row("output_hidden_states_grad", &output_grad, [t, h])?,
                dtype,
            )?,
            gamma: float_tensor(&[1, h], uniform("gamma", &[1, h], 1.0, 7)?, dtype)?,
            d_expert_affinities: Tensor::from_f32(
                [t, e],
                uniform("d_expert_affinities", &[t, e], 1.0, 8)?,
            )?,
        })
    }

    /// `[T, VOCAB]` logits in the layer's dtype, uniform in [−8, 8): what nki-library's `topk`
    /// picks a decoding step's candidate tokens from.
    pub fn vocabulary_logits(&self) -> Result<Tensor> {
        let (t, shape) = (self.x.shape()[0], [self.x.shape()[0], VOCAB]);
        let values = uniform("vocabulary_logits", &shape, 8.0, 9)?;
        float_tensor(&[t, VOCAB], values, self.x.dtype())
    }

    pub fn router_topk(&self) -> Result<RouterTopk<'_>> {
        RouterTopk::new(
            RouterTopkInputs {
                x: &self.x,
                w: &self.w,
                w_bias: None,
                selection_bias: None,
            },
            RouterTopkParams {
                k: self.shape.k,
                pipeline: RouterPipeline::QWEN3_MOE,
            },
        )
    }
}

/// `rows [T, H]` followed by the zero padding row T, as the blockwise kernels' `[T+1, H]`
/// tensors hold them (T+1 rows cannot overflow: `rows` holds T).
fn with_padding_row(name: &str, rows: &[f32], [t, h]: [usize; 2]) -> Result<Vec<f32>> {
    let mut padded = try_capacity(&format!("benchmark input `{name}`"), &[t + 1, h])?;
    padded.extend_from_slice(rows);
    padded.extend(std::iter::repeat_n(0.0, h));
    Ok(padded)
}

fn permute_call<'a>(routed: &'a RouterTopkOutputs, inputs: &LayerInputs) -> Result<Permute<'a>> {
    Permute::new(
        PermuteInputs {
            expert_index: &routed.expert_index,
            topk_affinities: &routed.topk_affinities,
        },
        PermuteParams::new(inputs.shape.e, inputs.block_size),
    )
}

fn blockwise_inputs<'a>(
    inputs: &'a LayerInputs,
    plan: &'a PermuteOutputs,
) -> BlockwiseMmInputs<'a> {
    BlockwiseMmInputs {
        hidden_states: &inputs.hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: &inputs.gate_up_proj_weight,
        down_proj_weight: &inputs.down_proj_weight,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
        up_proj_weight: None,
    }
}

/// The forward with checkpoints, as training runs it.
fn blockwise_call<'a>(
    inputs: &'a LayerInputs,
    plan: &'a PermuteOutputs,
) -> Result<BlockwiseMm<'a>> {
    BlockwiseMm::new(
        blockwise_inputs(inputs, plan),
        BlockwiseMmParams {
            checkpoint_activation: true,
            ..BlockwiseMmParams::default()
        },
    )
}

/// A routed layer: its inputs plus the router outputs, block plan and checkpoints that the
/// later kernels consume, so each kernel can be called on its own.
pub struct Layer {
    pub inputs: LayerInputs,
    pub routed: RouterTopkOutputs,
    pub plan: PermuteOutputs,
    pub checkpoints: BlockwiseMmOutputs,
}

impl Layer {
    /// Runs the forward kernels once on `backend` to route `inputs`.
    pub fn new(backend: &dyn Backend, inputs: LayerInputs) -> Result<Self> {
        let routed = backend.router_topk(&inputs.router_topk()?)?;
        let plan = backend.permute(&permute_call(&routed, &inputs)?)?;
        let checkpoints = backend.blockwise_mm(&blockwise_call(&inputs, &plan)?)?;
        Ok(Self {
            inputs,
            routed,
            plan,
            checkpoints,
        })
    }

    pub fn router_topk_bwd(&self) -> Result<RouterTopkBwd<'_>> {
        RouterTopkBwd::new(
            RouterTopkBwdInputs {
                x: &self.inputs.x,
                w: &self.inputs.w,
                router_logits: &self.routed.router_logits,
                expert_index: &self.routed.expert_index,
                d_topk_affinities: &self.inputs.d_topk_affinities,
                d_router_logits: None,
            },
            RouterTopkBwdParams {
                pipeline: RouterPipeline::QWEN3_MOE,
                compute_dtype: None,
            },
        )
    }

    pub fn load_balancing_loss(&self) -> Result<LoadBalancingLoss<'_>> {
        LoadBalancingLoss::new(LoadBalancingLossInputs {
            router_logits: &self.routed.router_logits,
            expert_index: &self.routed.expert_index,
        })
    }

    pub fn load_balancing_loss_bwd(&self) -> Result<LoadBalancingLossBwd<'_>> {
        LoadBalancingLossBwd::new(LoadBalancingLossBwdInputs {
            router_logits: &self.routed.router_logits,
            expert_index: &self.routed.expert_index,
            d_aux_loss: &self.inputs.d_aux_loss,
        })
    }

    pub fn permute(&self) -> Result<Permute<'_>> {
        permute_call(&self.routed, &self.inputs)
    }

    pub fn permute_bwd(&self) -> Result<PermuteBwd<'_>> {
        PermuteBwd::new(
            PermuteBwdInputs {
                expert_index: &self.routed.expert_index,
                expert_affinities_masked_grad: &self.plan.expert_affinities_masked,
            },
            PermuteBwdParams::new(self.inputs.shape.e),
        )
    }

    pub fn blockwise_mm(&self) -> Result<BlockwiseMm<'_>> {
        blockwise_call(&self.inputs, &self.plan)
    }

    /// The routing table of this layer's routing over `ranks` expert-parallel ranks.
    pub fn a2av_routing(&self, ranks: usize) -> Result<A2avRouting<'_>> {
        A2avRouting::new(
            A2avRoutingInputs {
                expert_index: &self.routed.expert_index,
            },
            A2avRoutingParams {
                num_experts: self.inputs.shape.e,
                expert_parallel_degree: ranks,
            },
        )
    }

    /// The same tokens decoded by nki-library's `moe_tkg`: selective (each token's K experts),
    /// POST_SCALE by the router's affinities, every expert held here.
    pub fn moe_tkg(&self) -> Result<MoeTkg<'_>> {
        MoeTkg::new(
            MoeTkgInputs {
                hidden_input: &self.inputs.x,
                expert_gate_up_weights: &self.inputs.gate_up_proj_weight,
                expert_down_weights: &self.inputs.down_proj_weight,
                expert_affinities: &self.routed.expert_affinities,
                expert_index: &self.routed.expert_index,
                rank_id: None,
                expert_gate_up_bias: None,
                expert_down_bias: None,
                expert_affinities_eager: None,
            },
            MoeTkgParams {
                expert_affinities_scaling_mode: ExpertAffinityScaleMode::PostScale,
                ..MoeTkgParams::new(false)
            },
        )
    }

    /// The same tokens' decode-time RMSNorm and router (nki-library's
    /// `rmsnorm_router_topk_tkg`): K experts by SOFTMAX over them, the router's operands in the
    /// layer's dtype.
    pub fn rmsnorm_router_topk_tkg(&self) -> Result<RmsNormRouterTopkTkg<'_>> {
        RmsNormRouterTopkTkg::new(
            RmsNormRouterTopkTkgInputs {
                hidden_states: &self.inputs.x,
                gamma: &self.inputs.gamma,
                router_weights: &self.inputs.w,
                router_bias: None,
            },
            self.rmsnorm_router_params(),
        )
    }

    /// [`Layer::rmsnorm_router_topk_tkg`]'s backward, at the layer's routing.
    pub fn rmsnorm_router_topk_tkg_bwd(&self) -> Result<RmsNormRouterTopkTkgBwd<'_>> {
        RmsNormRouterTopkTkgBwd::new(
            RmsNormRouterTopkTkgBwdInputs {
                hidden_states: &self.inputs.x,
                gamma: &self.inputs.gamma,
                router_weights: &self.inputs.w,
                router_bias: None,
                expert_index: &self.routed.expert_index,
                d_expert_affinities: &self.inputs.d_expert_affinities,
                d_norm_output: None,
            },
            self.rmsnorm_router_params().shared,
        )
    }

    /// The same tokens through nki-library's decode block (`moe_block_tkg`) as Hugging Face's
    /// Qwen3-MoE decodes them: SOFTMAX over all E, the top K renormalised (ACT1 with
    /// `norm_topk_prob`), POST_SCALE, every expert held here, the router's operands in the
    /// layer's dtype.
    pub fn moe_block_tkg(&self) -> Result<MoeBlockTkg<'_>> {
        MoeBlockTkg::new(
            MoeBlockTkgInputs {
                inp: &self.inputs.x,
                gamma: &self.inputs.gamma,
                router_weights: &self.inputs.w,
                expert_gate_up_weights: &self.inputs.gate_up_proj_weight,
                expert_down_weights: &self.inputs.down_proj_weight,
                router_bias: None,
                expert_gate_up_bias: None,
                expert_down_bias: None,
                rank_id: None,
                residual: None,
            },
            MoeBlockTkgParams {
                top_k: self.inputs.shape.k,
                router_act_fn: RouterActFnType::Softmax,
                norm_topk_prob: true,
                expert_affinities_scaling_mode: ExpertAffinityScaleMode::PostScale,
                router_mm_dtype: RouterMmDType::of(self.inputs.w.dtype()),
                ..MoeBlockTkgParams::default()
            },
        )
    }

    /// The rows an expert-parallel exchange returns to `topk_reduce` for this layer's tokens,
    /// as K source ranks each return one row per token (each token's K experts on K ranks):
    /// `[K·T, H+2]` bf16, row `r·T + t` holding `x[t]` (in place of its r-th expert's output)
    /// tagged with the id `token_base_index + t`, so token t's rows sum to `K·x[t]`. A base
    /// whose last id passes i32 is an error naming `token_base_index`.
    pub fn exchanged_rows(&self, token_base_index: i32) -> Result<Tensor> {
        let x = self.inputs.x.f32_values();
        let (t, h, k) = (
            self.inputs.x.shape()[0],
            self.inputs.shape.h,
            self.inputs.shape.k,
        );
        let ids = (0..t)
            .map(|token| {
                i32::try_from(token)
                    .ok()
                    .and_then(|token| token_base_index.checked_add(token))
                    .ok_or_else(|| {
                        Error::param(
                            "token_base_index",
                            format!("{token_base_index} + token {token} is not an i32 id"),
                        )
                    })
            })
            .collect::<Result<Vec<i32>>>()?;
        let shape = [k * t, h + 2];
        let mut rows = try_capacity("benchmark input `input` (topk_reduce)", &shape)?;
        for _source in 0..k {
            for token in 0..t {
                let row = &x[token * h..(token + 1) * h];
                rows.extend(row.iter().map(|&v| bf16::from_f32(v)));
                rows.extend(token_id_columns(ids[token]));
            }
        }
        Tensor::from_bf16(shape, rows)
    }

    /// The routed affinities as `[T, E]` (`expert_affinities_masked` without its padding row):
    /// what `find_nonzero_indices` turns into each expert's token list on the device.
    pub fn routed_affinities(&self) -> Result<Tensor> {
        let (t, e) = (self.inputs.x.shape()[0], self.inputs.shape.e);
        let name = tensors::blockwise_mm::EXPERT_AFFINITIES_MASKED.name;
        (self.plan.expert_affinities_masked.clone())
            .reshaped([t + 1, e])?
            .into_leading_rows(name, t)
    }

    fn rmsnorm_router_params(&self) -> RmsNormRouterTopkTkgParams {
        let default = RmsNormRouterTopkTkgParams::default();
        RmsNormRouterTopkTkgParams {
            top_k: self.inputs.shape.k,
            shared: RmsNormRouterParams {
                router_mm_dtype: RouterMmDType::of(self.inputs.w.dtype()),
                router_act_fn: RouterActFnType::Softmax,
                ..default.shared
            },
            ..default
        }
    }

    pub fn blockwise_mm_bwd(&self) -> Result<BlockwiseMmBwd<'_>> {
        let added = self.blockwise_mm_bwd_added()?;
        BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: blockwise_inputs(&self.inputs, &self.plan),
                gate_up_proj_act_checkpoint_t: added.gate_up_proj_act_checkpoint_t,
                down_proj_act_checkpoint: added.down_proj_act_checkpoint,
                output_hidden_states_grad: added.output_hidden_states_grad,
                expert_index: added.expert_index,
            },
            BlockwiseMmBwdParams::default(),
        )
    }

    /// The inputs of the composed experts ([`Experts`](moekit::experts::Experts)): the tokens `x [T, H]`, their routing
    /// and the weights.
    pub fn experts_inputs(&self) -> ExpertsInputs<'_> {
        ExpertsInputs {
            hidden_states: &self.inputs.x,
            expert_index: &self.routed.expert_index,
            topk_affinities: &self.routed.topk_affinities,
            gate_up_proj_weight: &self.inputs.gate_up_proj_weight,
            down_proj_weight: &self.inputs.down_proj_weight,
            up_proj_weight: None,
        }
    }

    /// The gradient of the composed experts' output, `[T, H]`: the layer's output gradient
    /// without the padding row.
    pub fn experts_output_grad(&self) -> Result<Tensor> {
        let t = self.inputs.x.shape()[0];
        (self.inputs.output_hidden_states_grad.clone())
            .into_leading_rows("output_hidden_states_grad", t)
    }

    /// What the backward adds to the forward's inputs: the checkpoints, the output gradient
    /// and `expert_index`.
    pub fn blockwise_mm_bwd_added(&self) -> Result<BlockwiseMmBwdAdded<'_>> {
        let missing = || Error::invalid("blockwise_mm", "checkpoints were not returned");
        Ok(BlockwiseMmBwdAdded {
            gate_up_proj_act_checkpoint_t: self
                .checkpoints
                .gate_up_activations_t
                .as_ref()
                .ok_or_else(missing)?,
            down_proj_act_checkpoint: self
                .checkpoints
                .down_activations
                .as_ref()
                .ok_or_else(missing)?,
            output_hidden_states_grad: &self.inputs.output_hidden_states_grad,
            expert_index: Some(&self.routed.expert_index),
        })
    }
}

/// `indexed_flatten`'s `row_offsets` and parameters that lay `find_nonzero_indices`' token
/// lists (`nonzero_counts [E]` of lists of T) out back to back in blocks of
/// `f_len = gcd(T, B)`: expert e's `⌈count_e / f_len⌉` blocks after the experts before it,
/// `output_len` the blocks used, so each list's trailing −1 blocks past the end are skipped.
/// With f_len = B that is the block plan's `token_position_to_id` with `skip_token`.
pub fn flatten_plan(counts: &[i32], t: usize, b: usize) -> Result<(Tensor, IndexedFlattenParams)> {
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let f_len = gcd(t, b).max(1);
    let mut offsets = Vec::with_capacity(counts.len());
    let mut used = 0usize;
    for &count in counts {
        offsets.push(i32::try_from(used).map_err(|_| {
            Error::invalid("row_offsets", format!("block offset {used} exceeds i32"))
        })?);
        used += usize::try_from(count).unwrap_or(0).div_ceil(f_len);
    }
    let row_offsets = Tensor::from_i32([counts.len()], offsets)?;
    let params = IndexedFlattenParams {
        f_len,
        output_len: used * f_len,
        padding_val: IndexedFlattenParams::DEFAULT_PADDING_VAL,
    };
    Ok((row_offsets, params))
}
