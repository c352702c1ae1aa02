//! `rmsnorm_router_topk_tkg`: nki-library's fused decode-time RMSNorm and router
//! (`experimental/moe_block/rmsnorm_router_topk_tkg.py`) with its tensor names, shapes,
//! parameters and defaults, and its backward `rmsnorm_router_topk_tkg_bwd` (moekit's own:
//! nki-library has none).
//!
//! Forward, per token `t` of `hidden_states` (`[B, S, H]`, or `[T, H]`; T = B·S):
//! ```text
//! norm[t]          = x[t] / sqrt(Σ_h x[t, h]² / hidden_actual + eps) ⊙ gamma           [T, H]
//! logits[t]        = mm(norm[t]) · router_weights + router_bias                         [T, E]
//! expert_index[t]  = the K = top_k largest logits, descending, ties to the lower id     [T, K]
//! a[t, k]          = router_act_fn of the K selected logits: a softmax over the K
//!                    (SOFTMAX), or each one's sigmoid (SIGMOID, the default)             [T, K]
//! ```
//! `hidden_actual` (H by default) is the divisor of the mean of squares, for an H padded with
//! zeros; `mm` rounds to `router_mm_dtype`, which `router_weights` must have (nki-library
//! asserts both operands of the router matmul share it). The router is `router_topk`'s ACT2
//! pipeline (`router_pre_norm = false`), so `norm_topk_prob` never applies; `router_bias` moves
//! the logits, so both the choice and the affinities. Outputs: `norm_output [T, H]` in
//! `router_mm_dtype`, `expert_index [T, K]` i32, and `expert_affinities` in bf16: `[T, E]`
//! holding `a` at the selected experts and zeros elsewhere, or, with `store_eager_affi_only`,
//! `[T, K]` holding `a` in `expert_index`'s order. moekit's `output_dtype = float32` makes
//! `norm_output` and the affinities f32; the router still reads the norm rounded to
//! `router_mm_dtype`.
//!
//! Where two of a token's K largest logits are bit-identical nki-library's `nc_find_index8`
//! returns the lower id twice; moekit returns distinct experts, the lower id first (as
//! `router_topk` does). Its `quantization_type = MX` (the norm quantised to packed FP8, Trn3
//! only) is refused, and `router_mm_dtype` is `bfloat16` or `float32` (moekit's tensors have
//! no float16). nki-library's device limits (K ≤ 8, E ≤ 512, H a multiple of 128) bound its
//! compiled kernel, not the host backends.
//!
//! The backward (moekit's own) takes the forward's inputs, its `expert_index`, the gradient of
//! `expert_affinities` in the forward's layout (`[T, E]`, read at the selected experts only,
//! the others being constants; `[T, K]` with `store_eager_affi_only`) and optionally that of
//! `norm_output` (`d_norm_output`, from the layer the norm also feeds), and returns
//! `d_hidden_states` (shaped like `hidden_states`), `d_gamma`, `d_router_weights` and
//! `d_router_bias` (shaped like `router_bias`, `[1, E]` without one). The rounding `mm` is
//! taken as the identity (a straight-through derivative): `d_router_weights = mm(norm)ᵀ ·
//! d_logits`, and `d_norm = d_logits · router_weightsᵀ + d_norm_output` flows into the RMSNorm.
//!
//! Error bound (reference backend): the norm is computed in f64 and rounded once to each
//! output; the router reads it in `router_mm_dtype` and computes in f64 (see
//! [`super::router_topk`]). nki-library reduces in f32 and rounds `x / rms` to the input dtype
//! before `gamma`; its tests allow `2e-2` relative on f32 inputs.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use super::spec::{self, Named, TensorSpec};
use super::tensors::{rmsnorm_router_topk_tkg as fwd, rmsnorm_router_topk_tkg_bwd as bwd};
use super::{
    OutputDType, RouterActFnType, RouterPipeline, XHbmLayout, check_top_k, operand_dtype, validate,
};
use crate::error::{Error, Result};
use crate::tensor::{DType, Floats, Tensor};

/// nki-library's `QuantizationType` as `rmsnorm_router_topk_tkg` takes it: `NONE` or `MX`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantizationType {
    /// `norm_output` as computed (in `router_mm_dtype`).
    #[default]
    None,
    /// `norm_output` quantised to packed MX FP8, `[T, H + H/4]` (Trainium3): refused by moekit.
    Mx,
}

impl QuantizationType {
    /// The parameter's name.
    pub const PARAM: &'static str = "quantization_type";
}

impl FromStr for QuantizationType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "NONE" => Ok(Self::None),
            "MX" => Ok(Self::Mx),
            other => Err(Error::param(
                Self::PARAM,
                format!(
                    "expected NONE or MX (the QuantizationType members rmsnorm_router_topk_tkg \
                     takes), got `{other}`"
                ),
            )),
        }
    }
}

impl fmt::Display for QuantizationType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "NONE",
            Self::Mx => "MX",
        })
    }
}

/// `router_mm_dtype`: the dtype of the router matmul's operands (`bfloat16`, nki-library's
/// default, or `float32`), which is also `norm_output`'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterMmDType(DType);

impl RouterMmDType {
    /// The parameter's name.
    pub const PARAM: &'static str = "router_mm_dtype";
    pub const BFLOAT16: Self = Self(DType::BF16);
    pub const FLOAT32: Self = Self(DType::F32);

    pub fn dtype(self) -> DType {
        self.0
    }

    /// The `router_mm_dtype` of router weights in float dtype `dtype` (bf16 or f32).
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => Self::BFLOAT16,
            DType::F32 | DType::I32 => Self::FLOAT32,
        }
    }
}

impl FromStr for RouterMmDType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        operand_dtype::parse(Self::PARAM, s).map(Self)
    }
}

impl fmt::Display for RouterMmDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(operand_dtype::name(self.0))
    }
}

impl Default for RouterMmDType {
    /// `bfloat16`, nki-library's default.
    fn default() -> Self {
        Self::BFLOAT16
    }
}

/// The RMSNorm the forward and the backward share: `x / sqrt(Σx² / divisor + eps) ⊙ gamma`
/// over rows of H.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormSpec {
    /// T, rows.
    pub t: usize,
    /// H, the row length.
    pub h: usize,
    /// `hidden_actual`, or H.
    pub divisor: usize,
    pub eps: f32,
}

/// The parameters the forward and the backward share, nki-library's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormRouterParams {
    /// RMSNorm epsilon, added inside the square root (1e-6); positive and finite.
    pub eps: f32,
    /// The divisor of the mean of squares where H is padded with zeros (H when `None`); in
    /// `1..=H`.
    pub hidden_actual: Option<usize>,
    /// The dtype of the router matmul's operands and of `norm_output` (bf16).
    pub router_mm_dtype: RouterMmDType,
    /// SIGMOID (the default) or SOFTMAX over the K selected logits.
    pub router_act_fn: RouterActFnType,
    /// `expert_affinities` as the dense `[T, K]` (true) or the scattered `[T, E]` (false).
    pub store_eager_affi_only: bool,
}

impl Default for RmsNormRouterParams {
    fn default() -> Self {
        Self {
            eps: Self::DEFAULT_EPS,
            hidden_actual: None,
            router_mm_dtype: RouterMmDType::default(),
            router_act_fn: RouterActFnType::Sigmoid,
            store_eager_affi_only: false,
        }
    }
}

impl RmsNormRouterParams {
    pub const DEFAULT_EPS: f32 = 1e-6;

    /// The router pipeline: `router_topk`'s ACT2 with `router_act_fn`, `x [T, H]`.
    pub fn router_pipeline(&self) -> RouterPipeline {
        RouterPipeline {
            act_fn: self.router_act_fn,
            router_pre_norm: false,
            norm_topk_prob: false,
            x_hbm_layout: XHbmLayout::TH,
        }
    }

    fn check(&self, h: usize) -> Result<()> {
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(Error::param(
                "eps",
                format!("must be a positive finite number, got {}", self.eps),
            ));
        }
        if let Some(actual) = self.hidden_actual
            && !(1..=h).contains(&actual)
        {
            return Err(Error::param(
                "hidden_actual",
                format!("must be in 1..={h} (H, the hidden size), got {actual}"),
            ));
        }
        Ok(())
    }
}

/// `rmsnorm_router_topk_tkg`'s parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormRouterTopkTkgParams {
    /// K, experts per token (nki-library's default 1); `1 ≤ K ≤ E`.
    pub top_k: usize,
    /// NONE (the default); MX is refused.
    pub quantization_type: QuantizationType,
    pub shared: RmsNormRouterParams,
}

impl Default for RmsNormRouterTopkTkgParams {
    fn default() -> Self {
        Self {
            top_k: Self::DEFAULT_TOP_K,
            quantization_type: QuantizationType::default(),
            shared: RmsNormRouterParams::default(),
        }
    }
}

impl RmsNormRouterTopkTkgParams {
    pub const DEFAULT_TOP_K: usize = 1;
}

/// Inputs of [`RmsNormRouterTopkTkg`], named as nki-library names them.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormRouterTopkTkgInputs<'a> {
    /// `[B, S, H]` or `[T, H]`, f32 or bf16.
    pub hidden_states: &'a Tensor,
    /// `[1, H]` (or `[H]`), the RMSNorm weight.
    pub gamma: &'a Tensor,
    /// `[H, E]` in `router_mm_dtype` (the transpose of Hugging Face's `gate.weight [E, H]`).
    pub router_weights: &'a Tensor,
    /// `[1, E]` (or `[E]`) in `router_mm_dtype`, added to the logits.
    pub router_bias: Option<&'a Tensor>,
}

impl<'a> RmsNormRouterTopkTkgInputs<'a> {
    /// The inputs by their specs ([`fwd::INPUTS`]), an absent bias left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&fwd::HIDDEN_STATES, self.hidden_states),
            (&fwd::GAMMA, self.gamma),
            (&fwd::ROUTER_WEIGHTS, self.router_weights),
        ];
        named.extend(self.router_bias.map(|bias| (&fwd::ROUTER_BIAS, bias)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            hidden_states: required(&fwd::HIDDEN_STATES)?,
            gamma: required(&fwd::GAMMA)?,
            router_weights: required(&fwd::ROUTER_WEIGHTS)?,
            router_bias: get(&fwd::ROUTER_BIAS),
        })
    }
}

/// The sizes the tensors of a call agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmsNormRouterDims {
    /// T = B·S, tokens.
    pub t: usize,
    pub h: usize,
    /// E, experts.
    pub e: usize,
    /// K, experts per token.
    pub k: usize,
}

/// The float inputs of a validated call, as stored (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct RmsNormRouterFloats<'a> {
    /// `[T, H]` (a `[B, S, H]` tensor's rows).
    pub hidden_states: Floats<'a>,
    /// `[H]`.
    pub gamma: Floats<'a>,
}

/// Checks the tensors both directions (and `moe_block_tkg`) read, `hidden_states` by `x_spec`'s
/// name, and returns `(T, H, E)` and their elements.
pub(super) fn check_common<'a>(
    x_spec: &TensorSpec,
    hidden_states: &'a Tensor,
    gamma: &'a Tensor,
    router_weights: &'a Tensor,
    router_bias: Option<&'a Tensor>,
    params: &RmsNormRouterParams,
) -> Result<((usize, usize, usize), RmsNormRouterFloats<'a>)> {
    let name = x_spec.name;
    let (t, h) = match hidden_states.shape() {
        &[b, s, h] => (b * s, h),
        &[t, h] => (t, h),
        other => {
            return Err(Error::shape(name, x_spec.shape, other));
        }
    };
    let rank = hidden_states.shape().len();
    validate::float_tensor(name, hidden_states, x_spec.shape, &vec![None; rank])?;
    validate::non_empty(name, "T (tokens)", t)?;
    validate::non_empty(name, "H (hidden size)", h)?;
    params.check(h)?;
    validate::row_tensor(fwd::GAMMA.name, gamma, h, "[1, H] or [H]")?;
    let mm = params.router_mm_dtype;
    if router_weights.dtype() != mm.dtype() {
        return Err(Error::DType {
            tensor: fwd::ROUTER_WEIGHTS.name.to_owned(),
            expected: format!("{} ({} = {mm})", mm.dtype(), RouterMmDType::PARAM),
            actual: router_weights.dtype(),
        });
    }
    let e = validate::float_input(&fwd::ROUTER_WEIGHTS, router_weights, &[Some(h), None])?[1];
    validate::non_empty(fwd::ROUTER_WEIGHTS.name, "E (experts)", e)?;
    if let Some(bias) = router_bias {
        // Added to the logits in the router's operand dtype, as nki-library's reference casts it.
        if bias.dtype() != mm.dtype() {
            return Err(Error::DType {
                tensor: fwd::ROUTER_BIAS.name.to_owned(),
                expected: format!("{} ({} = {mm})", mm.dtype(), RouterMmDType::PARAM),
                actual: bias.dtype(),
            });
        }
        validate::row_tensor(fwd::ROUTER_BIAS.name, bias, e, "[1, E] or [E]")?;
    }
    let floats = |spec: &TensorSpec, tensor| validate::floats(spec.name, tensor);
    Ok((
        (t, h, e),
        RmsNormRouterFloats {
            hidden_states: floats(x_spec, hidden_states)?,
            gamma: floats(&fwd::GAMMA, gamma)?,
        },
    ))
}

/// A validated `rmsnorm_router_topk_tkg` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormRouterTopkTkg<'a> {
    inputs: RmsNormRouterTopkTkgInputs<'a>,
    floats: RmsNormRouterFloats<'a>,
    params: RmsNormRouterTopkTkgParams,
    dims: RmsNormRouterDims,
    output_dtype: OutputDType,
}

impl<'a> RmsNormRouterTopkTkg<'a> {
    /// Checks shapes, dtypes (`router_weights` in `router_mm_dtype`), finiteness and the
    /// parameters (see the module docs).
    pub fn new(
        inputs: RmsNormRouterTopkTkgInputs<'a>,
        params: RmsNormRouterTopkTkgParams,
    ) -> Result<Self> {
        if params.quantization_type == QuantizationType::Mx {
            return Err(Error::param(
                QuantizationType::PARAM,
                "MX (norm_output quantised to packed MX FP8, a Trainium3 format) is not computed \
                 by moekit; use NONE",
            ));
        }
        let ((t, h, e), floats) = check_common(
            &fwd::HIDDEN_STATES,
            inputs.hidden_states,
            inputs.gamma,
            inputs.router_weights,
            inputs.router_bias,
            &params.shared,
        )?;
        check_top_k(params.top_k, e).map_err(|_| {
            Error::param(
                "top_k",
                format!(
                    "must be in 1..={e} (E, the number of experts), got {}",
                    params.top_k
                ),
            )
        })?;
        Ok(Self {
            inputs,
            floats,
            params,
            dims: RmsNormRouterDims {
                t,
                h,
                e,
                k: params.top_k,
            },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> RmsNormRouterTopkTkgInputs<'a> {
        self.inputs
    }

    pub fn floats(&self) -> RmsNormRouterFloats<'a> {
        self.floats
    }

    pub fn params(&self) -> RmsNormRouterTopkTkgParams {
        self.params
    }

    pub fn dims(&self) -> RmsNormRouterDims {
        self.dims
    }

    /// The RMSNorm this call computes.
    pub fn rmsnorm(&self) -> RmsNormSpec {
        rmsnorm_spec(self.dims, &self.params.shared)
    }
}

output_dtype_accessors!(RmsNormRouterTopkTkg, RmsNormRouterTopkTkgOutputs);

pub(super) fn rmsnorm_spec(dims: RmsNormRouterDims, params: &RmsNormRouterParams) -> RmsNormSpec {
    RmsNormSpec {
        t: dims.t,
        h: dims.h,
        divisor: params.hidden_actual.unwrap_or(dims.h),
        eps: params.eps,
    }
}

/// Outputs of `rmsnorm_router_topk_tkg`.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormRouterTopkTkgOutputs {
    /// `[T, H]` in `router_mm_dtype`.
    pub norm_output: Tensor,
    /// `[T, K]` i32, descending logit, ties to the lower expert id.
    pub expert_index: Tensor,
    /// bf16: `[T, E]`, the K affinities scattered, zeros elsewhere; `[T, K]` with
    /// `store_eager_affi_only`.
    pub expert_affinities: Tensor,
}

impl RmsNormRouterTopkTkgOutputs {
    /// The outputs by their specs ([`fwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&fwd::NORM_OUTPUT, self.norm_output),
            (&fwd::EXPERT_INDEX, self.expert_index),
            (&fwd::EXPERT_AFFINITIES, self.expert_affinities),
        ]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            norm_output: f(&fwd::NORM_OUTPUT, self.norm_output)?,
            expert_index: f(&fwd::EXPERT_INDEX, self.expert_index)?,
            expert_affinities: f(&fwd::EXPERT_AFFINITIES, self.expert_affinities)?,
        })
    }
}

/// Inputs of [`RmsNormRouterTopkTkgBwd`]: the forward's inputs, its `expert_index`, and
/// gradients of its outputs.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormRouterTopkTkgBwdInputs<'a> {
    /// `[B, S, H]` or `[T, H]`.
    pub hidden_states: &'a Tensor,
    /// `[1, H]` (or `[H]`).
    pub gamma: &'a Tensor,
    /// `[H, E]` in `router_mm_dtype`.
    pub router_weights: &'a Tensor,
    /// `[1, E]` (or `[E]`).
    pub router_bias: Option<&'a Tensor>,
    /// `[T, K]` i32, the forward's output.
    pub expert_index: &'a Tensor,
    /// `[T, E]` (read at the selected experts), or `[T, K]` with `store_eager_affi_only`.
    pub d_expert_affinities: &'a Tensor,
    /// `[T, H]`, the gradient of `norm_output` from its other consumers.
    pub d_norm_output: Option<&'a Tensor>,
}

impl<'a> RmsNormRouterTopkTkgBwdInputs<'a> {
    /// The inputs by their specs ([`bwd::INPUTS`]), absent optional ones left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&bwd::HIDDEN_STATES, self.hidden_states),
            (&bwd::GAMMA, self.gamma),
            (&bwd::ROUTER_WEIGHTS, self.router_weights),
        ];
        named.extend(self.router_bias.map(|bias| (&bwd::ROUTER_BIAS, bias)));
        named.push((&bwd::EXPERT_INDEX, self.expert_index));
        named.push((&bwd::D_EXPERT_AFFINITIES, self.d_expert_affinities));
        named.extend(self.d_norm_output.map(|d| (&bwd::D_NORM_OUTPUT, d)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            hidden_states: required(&bwd::HIDDEN_STATES)?,
            gamma: required(&bwd::GAMMA)?,
            router_weights: required(&bwd::ROUTER_WEIGHTS)?,
            router_bias: get(&bwd::ROUTER_BIAS),
            expert_index: required(&bwd::EXPERT_INDEX)?,
            d_expert_affinities: required(&bwd::D_EXPERT_AFFINITIES)?,
            d_norm_output: get(&bwd::D_NORM_OUTPUT),
        })
    }
}

/// A validated `rmsnorm_router_topk_tkg_bwd` call (moekit's own kernel); K is read from
/// `expert_index`.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormRouterTopkTkgBwd<'a> {
    inputs: RmsNormRouterTopkTkgBwdInputs<'a>,
    floats: RmsNormRouterFloats<'a>,
    expert_ids: &'a [i32],
    params: RmsNormRouterParams,
    dims: RmsNormRouterDims,
    output_dtype: OutputDType,
}

impl<'a> RmsNormRouterTopkTkgBwd<'a> {
    /// Checks what the forward checks, expert ids in `[0, E)` without repeats, and the
    /// gradients' shapes.
    pub fn new(
        inputs: RmsNormRouterTopkTkgBwdInputs<'a>,
        params: RmsNormRouterParams,
    ) -> Result<Self> {
        let ((t, h, e), floats) = check_common(
            &fwd::HIDDEN_STATES,
            inputs.hidden_states,
            inputs.gamma,
            inputs.router_weights,
            inputs.router_bias,
            &params,
        )?;
        let (shape, ids) =
            validate::index_input(&bwd::EXPERT_INDEX, inputs.expert_index, &[Some(t), None])?;
        let k = shape[1];
        check_top_k(k, e).map_err(|_| {
            Error::shape(
                bwd::EXPERT_INDEX.name,
                format!("[T, K] with 1 ≤ K ≤ E = {e}"),
                &shape,
            )
        })?;
        validate::expert_ids(bwd::EXPERT_INDEX.name, ids, &shape, e)?;
        let width = if params.store_eager_affi_only { k } else { e };
        validate::float_tensor(
            bwd::D_EXPERT_AFFINITIES.name,
            inputs.d_expert_affinities,
            if params.store_eager_affi_only {
                "[T, K] (store_eager_affi_only)"
            } else {
                "[T, E]"
            },
            &[Some(t), Some(width)],
        )?;
        if let Some(d) = inputs.d_norm_output {
            validate::float_input(&bwd::D_NORM_OUTPUT, d, &[Some(t), Some(h)])?;
        }
        Ok(Self {
            inputs,
            floats,
            expert_ids: ids,
            params,
            dims: RmsNormRouterDims { t, h, e, k },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> RmsNormRouterTopkTkgBwdInputs<'a> {
        self.inputs
    }

    pub fn floats(&self) -> RmsNormRouterFloats<'a> {
        self.floats
    }

    /// `expert_index`'s values: distinct ids in `[0, E)` per token.
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn params(&self) -> RmsNormRouterParams {
        self.params
    }

    pub fn dims(&self) -> RmsNormRouterDims {
        self.dims
    }

    /// The RMSNorm the forward computed.
    pub fn rmsnorm(&self) -> RmsNormSpec {
        rmsnorm_spec(self.dims, &self.params)
    }

    /// The gradient of the K selected affinities, `[T, K]` in `expert_index`'s order: the
    /// eager gradient as given, or the `[T, E]` one read at the selected experts.
    pub fn d_topk_affinities(&self) -> Result<Cow<'a, Tensor>> {
        let d = self.inputs.d_expert_affinities;
        if self.params.store_eager_affi_only {
            return Ok(Cow::Borrowed(d));
        }
        let RmsNormRouterDims { t, e, k, .. } = self.dims;
        let values = d.f32_values();
        let gathered = (0..t * k)
            .map(|slot| values[(slot / k) * e + self.expert_ids[slot] as usize])
            .collect();
        Tensor::from_f32([t, k], gathered).map(Cow::Owned)
    }
}

output_dtype_accessors!(RmsNormRouterTopkTkgBwd, RmsNormRouterTopkTkgGrads);

/// Gradients produced by `rmsnorm_router_topk_tkg_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormRouterTopkTkgGrads {
    /// Shaped and typed like `hidden_states`.
    pub d_hidden_states: Tensor,
    /// Shaped and typed like `gamma`.
    pub d_gamma: Tensor,
    /// `[H, E]` in `router_weights`' dtype.
    pub d_router_weights: Tensor,
    /// Shaped like `router_bias` (`[1, E]` without one), in `router_weights`' dtype.
    pub d_router_bias: Tensor,
}

impl RmsNormRouterTopkTkgGrads {
    /// The gradients by their specs ([`bwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&bwd::D_HIDDEN_STATES, self.d_hidden_states),
            (&bwd::D_GAMMA, self.d_gamma),
            (&bwd::D_ROUTER_WEIGHTS, self.d_router_weights),
            (&bwd::D_ROUTER_BIAS, self.d_router_bias),
        ]
    }

    /// Every gradient through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            d_hidden_states: f(&bwd::D_HIDDEN_STATES, self.d_hidden_states)?,
            d_gamma: f(&bwd::D_GAMMA, self.d_gamma)?,
            d_router_weights: f(&bwd::D_ROUTER_WEIGHTS, self.d_router_weights)?,
            d_router_bias: f(&bwd::D_ROUTER_BIAS, self.d_router_bias)?,
        })
    }
}
