//! `moe_block_tkg`: nki-library's decode-time MoE block (`core/moe_block/moe_block_tkg.py`),
//! RMSNorm, router top-k and the experts in one call, with its tensor names, shapes, parameters
//! and defaults.
//!
//! Per token `t` of `inp` (`[B, S, H]`, or `[T, H]`; T = B·S):
//! ```text
//! x[t]             = inp[t] / sqrt(Σ_h inp[t, h]² / hidden_actual + eps) ⊙ gamma,
//!                    rounded to inp's dtype                                            [T, H]
//! router_logits[t] = mm(x[t]) · router_weights + router_bias                           [T, E]
//! expert_index, a  = router_topk(router_logits, top_k, router_act_fn, router_pre_norm,
//!                    norm_topk_prob)                                          [T, K], [T, E]
//! out[t]           = moe_tkg(x, a, expert_index) with hidden_act_fn, the clamps, the
//!                    biases, expert_affinities_scaling_mode and is_all_expert         [T, H]
//! ```
//! `mm` rounds to `router_mm_dtype`, which `router_weights` and `router_bias` must have (as in
//! [`super::rmsnorm_router_topk_tkg`]). The router is [`super::router_topk`] with nki-library's
//! pipelines: ACT1 (`router_pre_norm`, the default) activates all E logits (SIGMOID by default,
//! or SOFTMAX), takes the K largest and keeps the dense `[T, E]` activations, or, with
//! `norm_topk_prob`, the K renormalised to sum 1 and zeros elsewhere; ACT2 takes the K largest
//! logits and softmaxes them (SIGMOID with ACT2 is refused, as nki-library refuses it here).
//! The experts are [`super::moe_tkg`]'s on `x` with `mask_unselected_experts = router_pre_norm
//! && !norm_topk_prob`, so an expert a token did not select contributes nothing under
//! POST_SCALE whatever its dense affinity:
//!
//! - **selective** (`is_all_expert = false`, the default): each token through its K experts;
//!   the weights must hold all E experts (`E_L = E`), since the router's ids are global.
//! - **all-expert**: every token through the E_L experts held here, `rank_id` (required)
//!   choosing which (`[r·E_L, (r+1)·E_L)`, so E must be a multiple of E_L).
//!
//! Outputs: `out [T, H]` and `router_logits [T, E]` (before the activation; not returned with
//! `skip_router_logits`), both in `inp`'s dtype (moekit's `output_dtype = float32` makes them
//! f32). Ties between bit-identical logits go to the lower expert id.
//!
//! Refused, with nki-library's reasons: `residual` (fused only for MX weights), MX and
//! quantised weights (Trainium3 formats; moekit's weights are f32 or bf16), the shared expert
//! (not implemented by nki-library's kernel), PRE_SCALE and PRE_SCALE_DELAYED, `router_mm_dtype
//! = float16` (moekit has no f16 tensors). nki-library's device limits (H a multiple of 128, of
//! 256 but for bf16 all-expert; T ≤ 128 in selective mode; K ≤ 8; E ≤ 512) bound its compiled
//! kernel, not the host backends.
//!
//! Error bound (reference backend): the norm is computed in f64 and rounded once to `inp`'s
//! dtype; the router and the experts compute in f64 from their rounded inputs (see
//! [`super::router_topk`], [`super::moe_tkg`]). nki-library's tests allow `1e-5 + 1.1e-2 ·
//! |ref|` for bf16 weights.

use super::moe_tkg::{ExpertTensors, Scan, check_experts, check_scaling_and_clamps};
use super::rmsnorm_router_topk_tkg::{check_common, rmsnorm_spec};
use super::spec::{self, Named, TensorSpec};
use super::tensors::moe_block_tkg as blk;
use super::{
    ActFnType, ClampLimits, ExpertAffinityScaleMode, MoeTkgParams, OutputDType, RmsNormRouterDims,
    RmsNormRouterFloats, RmsNormRouterParams, RmsNormSpec, RouterActFnType, RouterMmDType,
    RouterPipeline, XHbmLayout, check_top_k, validate,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Inputs of [`MoeBlockTkg`], named as nki-library's `moe_block_tkg` names them.
#[derive(Clone, Copy, Debug)]
pub struct MoeBlockTkgInputs<'a> {
    /// `[B, S, H]` or `[T, H]`, f32 or bf16.
    pub inp: &'a Tensor,
    /// `[1, H]` (or `[H]`), the RMSNorm weight.
    pub gamma: &'a Tensor,
    /// `[H, E]` in `router_mm_dtype`.
    pub router_weights: &'a Tensor,
    /// `[E_L, H, 2, I]`; index 0 of the third axis is the gate projection, 1 the up projection.
    pub expert_gate_up_weights: &'a Tensor,
    /// `[E_L, I, H]`.
    pub expert_down_weights: &'a Tensor,
    /// `[1, E]` (or `[E]`) in `router_mm_dtype`, added to the logits.
    pub router_bias: Option<&'a Tensor>,
    /// `[E_L, 2, I]` (0 gate, 1 up), added before the clamps.
    pub expert_gate_up_bias: Option<&'a Tensor>,
    /// `[E_L, H]`.
    pub expert_down_bias: Option<&'a Tensor>,
    /// `[1, 1]` i32, this rank's expert-parallel index; required with `is_all_expert`.
    pub rank_id: Option<&'a Tensor>,
    /// nki-library's fused residual add (MX weights only): refused.
    pub residual: Option<&'a Tensor>,
}

impl<'a> MoeBlockTkgInputs<'a> {
    /// The inputs by their specs ([`blk::INPUTS`]), absent optional ones left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&blk::INP, self.inp),
            (&blk::GAMMA, self.gamma),
            (&blk::ROUTER_WEIGHTS, self.router_weights),
            (&blk::EXPERT_GATE_UP_WEIGHTS, self.expert_gate_up_weights),
            (&blk::EXPERT_DOWN_WEIGHTS, self.expert_down_weights),
        ];
        let optional = [
            (&blk::ROUTER_BIAS, self.router_bias),
            (&blk::EXPERT_GATE_UP_BIAS, self.expert_gate_up_bias),
            (&blk::EXPERT_DOWN_BIAS, self.expert_down_bias),
            (&blk::RANK_ID, self.rank_id),
            (&blk::RESIDUAL, self.residual),
        ];
        named.extend(
            optional
                .into_iter()
                .filter_map(|(spec, tensor)| tensor.map(|t| (spec, t))),
        );
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            inp: required(&blk::INP)?,
            gamma: required(&blk::GAMMA)?,
            router_weights: required(&blk::ROUTER_WEIGHTS)?,
            expert_gate_up_weights: required(&blk::EXPERT_GATE_UP_WEIGHTS)?,
            expert_down_weights: required(&blk::EXPERT_DOWN_WEIGHTS)?,
            router_bias: get(&blk::ROUTER_BIAS),
            expert_gate_up_bias: get(&blk::EXPERT_GATE_UP_BIAS),
            expert_down_bias: get(&blk::EXPERT_DOWN_BIAS),
            rank_id: get(&blk::RANK_ID),
            residual: get(&blk::RESIDUAL),
        })
    }
}

/// `moe_block_tkg`'s parameters, nki-library's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeBlockTkgParams {
    /// RMSNorm epsilon (1e-6); positive and finite.
    pub eps: f32,
    /// K, experts per token (1); `1 ≤ K ≤ E`.
    pub top_k: usize,
    /// SIGMOID (the default) or SOFTMAX.
    pub router_act_fn: RouterActFnType,
    /// ACT1 (true, the default): activate all E, then top-K; ACT2: top-K logits, then activate.
    pub router_pre_norm: bool,
    /// ACT1: renormalise the K selected activations to sum 1 (false).
    pub norm_topk_prob: bool,
    /// NO_SCALE (the default) or POST_SCALE.
    pub expert_affinities_scaling_mode: ExpertAffinityScaleMode,
    /// The experts' gate activation (SiLU).
    pub hidden_act_fn: ActFnType,
    /// `gate_clamp_*_limit`, `up_clamp_*_limit` (none).
    pub clamp: ClampLimits,
    /// The router matmul's operand dtype (bfloat16).
    pub router_mm_dtype: RouterMmDType,
    /// The RMSNorm's divisor where H is padded with zeros (H when `None`); in `1..=H`.
    pub hidden_actual: Option<usize>,
    /// Leave `router_logits` out of the outputs (false).
    pub skip_router_logits: bool,
    /// Every expert held here for every token (true), or each token's K (false, the default).
    pub is_all_expert: bool,
}

impl Default for MoeBlockTkgParams {
    fn default() -> Self {
        Self {
            eps: RmsNormRouterParams::DEFAULT_EPS,
            top_k: 1,
            router_act_fn: RouterActFnType::Sigmoid,
            router_pre_norm: true,
            norm_topk_prob: false,
            expert_affinities_scaling_mode: MoeTkgParams::DEFAULT_SCALING_MODE,
            hidden_act_fn: ActFnType::default(),
            clamp: ClampLimits::default(),
            router_mm_dtype: RouterMmDType::default(),
            hidden_actual: None,
            skip_router_logits: false,
            is_all_expert: false,
        }
    }
}

impl MoeBlockTkgParams {
    /// The router pipeline: `router_topk` with this block's activation and pipeline, `x [T, H]`.
    pub fn router_pipeline(&self) -> RouterPipeline {
        RouterPipeline {
            act_fn: self.router_act_fn,
            router_pre_norm: self.router_pre_norm,
            norm_topk_prob: self.norm_topk_prob,
            x_hbm_layout: XHbmLayout::TH,
        }
    }

    /// The experts' parameters: `moe_tkg` in this block's mode, masking the experts a token did
    /// not select where the router's affinities are dense (ACT1 without `norm_topk_prob`).
    pub fn moe_tkg(&self) -> MoeTkgParams {
        MoeTkgParams {
            expert_affinities_scaling_mode: self.expert_affinities_scaling_mode,
            activation_fn: self.hidden_act_fn,
            clamp: self.clamp,
            mask_unselected_experts: self.router_pre_norm && !self.norm_topk_prob,
            ..MoeTkgParams::new(self.is_all_expert)
        }
    }

    /// The RMSNorm and router parameters this block shares with `rmsnorm_router_topk_tkg`.
    fn rmsnorm_router(&self) -> RmsNormRouterParams {
        RmsNormRouterParams {
            eps: self.eps,
            hidden_actual: self.hidden_actual,
            router_mm_dtype: self.router_mm_dtype,
            router_act_fn: self.router_act_fn,
            store_eager_affi_only: false,
        }
    }
}

/// The sizes a `moe_block_tkg` call's tensors agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeBlockTkgDims {
    /// T = B·S, tokens.
    pub t: usize,
    pub h: usize,
    /// E, experts over all ranks (`router_weights`' columns).
    pub e: usize,
    /// E_L, experts held here (the weights' first axis).
    pub e_local: usize,
    pub k: usize,
    /// I, expert intermediate size.
    pub i: usize,
}

/// A validated `moe_block_tkg` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct MoeBlockTkg<'a> {
    inputs: MoeBlockTkgInputs<'a>,
    floats: RmsNormRouterFloats<'a>,
    params: MoeBlockTkgParams,
    dims: MoeBlockTkgDims,
    output_dtype: OutputDType,
}

impl<'a> MoeBlockTkg<'a> {
    /// Checks shapes, dtypes (`router_weights` and `router_bias` in `router_mm_dtype`),
    /// finiteness, `rank_id` and the parameters (see the module docs).
    pub fn new(inputs: MoeBlockTkgInputs<'a>, params: MoeBlockTkgParams) -> Result<Self> {
        if inputs.residual.is_some() {
            return Err(Error::invalid(
                blk::RESIDUAL.name,
                "the fused residual add is only supported for MXFP weights in all-expert mode \
                 (Trainium3), which moekit does not compute; add it to `inp` before the call",
            ));
        }
        if params.router_act_fn == RouterActFnType::Sigmoid && !params.router_pre_norm {
            return Err(Error::param(
                "router_act_fn",
                "SIGMOID activation with router_pre_norm=False requires \
                 use_indirect_dma_scatter=True, which moe_block_tkg does not set; use SOFTMAX \
                 or router_pre_norm=True",
            ));
        }
        let ((t, h, e), floats) = check_common(
            &blk::INP,
            inputs.inp,
            inputs.gamma,
            inputs.router_weights,
            inputs.router_bias,
            &params.rmsnorm_router(),
        )?;
        check_top_k(params.top_k, e).map_err(|_| {
            Error::param(
                "top_k",
                format!(
                    "must be in 1..={e} (E, router_weights' columns), got {}",
                    params.top_k
                ),
            )
        })?;
        // The experts' parameters as moe_tkg checks them (PRE_SCALE refused, the clamps).
        let experts = params.moe_tkg();
        check_scaling_and_clamps(&experts)?;
        let (e_local, i) = check_experts(
            ExpertTensors {
                gate_up: inputs.expert_gate_up_weights,
                down: inputs.expert_down_weights,
                gate_up_bias: inputs.expert_gate_up_bias,
                down_bias: inputs.expert_down_bias,
            },
            h,
            Scan::Values,
        )?;
        check_expert_shards(&inputs, &params, e, e_local)?;
        Ok(Self {
            inputs,
            floats,
            params,
            dims: MoeBlockTkgDims {
                t,
                h,
                e,
                e_local,
                k: params.top_k,
                i,
            },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> MoeBlockTkgInputs<'a> {
        self.inputs
    }

    /// `inp` (as `[T, H]` rows) and `gamma`, as stored.
    pub fn floats(&self) -> RmsNormRouterFloats<'a> {
        self.floats
    }

    pub fn params(&self) -> MoeBlockTkgParams {
        self.params
    }

    pub fn dims(&self) -> MoeBlockTkgDims {
        self.dims
    }

    /// The RMSNorm this call computes.
    pub fn rmsnorm(&self) -> RmsNormSpec {
        let MoeBlockTkgDims { t, h, e, k, .. } = self.dims;
        rmsnorm_spec(
            RmsNormRouterDims { t, h, e, k },
            &self.params.rmsnorm_router(),
        )
    }
}

output_dtype_accessors!(MoeBlockTkg, MoeBlockTkgOutputs);

/// Which experts the weights hold: all E in selective mode (the router's ids are global), a
/// shard of E_L chosen by `rank_id` in all-expert mode.
fn check_expert_shards(
    inputs: &MoeBlockTkgInputs<'_>,
    params: &MoeBlockTkgParams,
    e: usize,
    e_local: usize,
) -> Result<()> {
    let weights = blk::EXPERT_GATE_UP_WEIGHTS.name;
    if !params.is_all_expert {
        if e_local != e {
            return Err(Error::shape(
                weights,
                format!(
                    "[E, H, 2, I] with E = {e} (router_weights' columns): selective mode routes \
                     by global expert ids, so every expert is held here"
                ),
                inputs.expert_gate_up_weights.shape(),
            ));
        }
        return Ok(());
    }
    if e_local > e || !e.is_multiple_of(e_local) {
        return Err(Error::shape(
            weights,
            format!(
                "[E_L, H, 2, I] with E_L dividing E = {e} (router_weights' columns): all-expert \
                 mode holds one of E / E_L equal shards"
            ),
            inputs.expert_gate_up_weights.shape(),
        ));
    }
    let Some(rank_id) = inputs.rank_id else {
        return Err(Error::invalid(
            blk::RANK_ID.name,
            "rank_id is required for all_expert mode, but not given",
        ));
    };
    let (_, rank) = validate::index_input(&blk::RANK_ID, rank_id, &[Some(1), Some(1)])?;
    let ranks = e / e_local;
    if usize::try_from(rank[0]).map_or(true, |r| r >= ranks) {
        return Err(Error::invalid(
            blk::RANK_ID.name,
            format!(
                "rank {} holds no experts: E = {e} experts over E_L = {e_local} per rank make \
                 {ranks} rank(s)",
                rank[0]
            ),
        ));
    }
    Ok(())
}

/// Outputs of `moe_block_tkg`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeBlockTkgOutputs {
    /// `[T, H]` in `inp`'s dtype: the experts' output (no residual).
    pub out: Tensor,
    /// `[T, E]` in `inp`'s dtype, before the activation; `None` with `skip_router_logits`.
    pub router_logits: Option<Tensor>,
}

impl MoeBlockTkgOutputs {
    /// The outputs by their specs ([`blk::OUTPUTS`]), a skipped one left out.
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        let mut named = vec![(&blk::OUT, self.out)];
        named.extend(
            self.router_logits
                .map(|logits| (&blk::ROUTER_LOGITS, logits)),
        );
        named
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            out: f(&blk::OUT, self.out)?,
            router_logits: self
                .router_logits
                .map(|logits| f(&blk::ROUTER_LOGITS, logits))
                .transpose()?,
        })
    }
}
