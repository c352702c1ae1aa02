//! `router_topk`: token-choice top-k routing, nki-library's `router_topk` kernel with its
//! parameter names and modes, and its backward (moekit's own).
//!
//! Forward, per token `t` (`x` is `[T, H]` with `x_hbm_layout = 1`, `[H, T]` with 0):
//! ```text
//! router_logits[t]      = x[t] · w (+ w_bias)                                  [T, E]  f32
//! ACT1 (router_pre_norm = true, the default):
//!   p[t]                = act_fn(router_logits[t]) over all E (SOFTMAX or SIGMOID)
//!   expert_index[t]     = the K experts with the largest p[t] (+ selection_bias)
//!   topk_affinities[t]  = p[t, expert_index[t]], divided by their sum if norm_topk_prob
//!   expert_affinities[t]= p[t] itself (dense) without norm_topk_prob, else topk_affinities
//!                         scattered to their experts, zeros elsewhere
//! ACT2 (router_pre_norm = false):
//!   expert_index[t]     = the K experts with the largest logits (+ selection_bias)
//!   topk_affinities[t]  = act_fn of the K selected logits (a softmax over the K, or a sigmoid
//!                         of each); norm_topk_prob has no effect, as in nki-library
//!   expert_affinities[t]= topk_affinities scattered, zeros elsewhere
//! ```
//! `expert_index` is `[T, K]` i32 in descending order, ties to the lower expert id;
//! `topk_affinities [T, K]` is nki-library's `return_eager_affi` output, always returned.
//! `selection_bias` (moekit's own) only changes which experts are chosen, never the affinities
//! (aux-loss-free balancing). With SOFTMAX, ACT1, no biases and `norm_topk_prob` this is
//! Hugging Face Qwen3-MoE's router formula: softmax over all experts, top-k, divide by the
//! top-k sum (no epsilon).
//!
//! Error bound (reference backend): every value is computed in f64 and rounded once to f32, so
//! each output is within 0.5 ulp (f32) of the f64 result; `expert_index` is exact except where
//! two selection scores agree to within f64 rounding. "Equals Hugging Face" means the same
//! formula: HF computes the gate matmul in the activation dtype and the softmax in f32, so its
//! values agree with these to f32 (or bf16) rounding, and its choice can differ only at such
//! near-ties.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use super::spec::{self, Named, TensorSpec};
use super::tensors::{router_topk as fwd, router_topk_bwd as bwd};
use super::{ComputeDType, OutputDType, validate};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The function that turns router logits into affinities: nki-library's `RouterActFnType`,
/// spelled as its members (`SOFTMAX`, `SIGMOID`; its lower-case string forms are accepted too).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RouterActFnType {
    /// Softmax (over all E experts under ACT1, over the K selected under ACT2): Qwen3-MoE,
    /// Mixtral.
    #[default]
    Softmax,
    /// Independent sigmoid per expert (DeepSeek-V3 style).
    Sigmoid,
}

impl FromStr for RouterActFnType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "SOFTMAX" | "softmax" => Ok(Self::Softmax),
            "SIGMOID" | "sigmoid" => Ok(Self::Sigmoid),
            other => Err(Error::param(
                "act_fn",
                format!("expected SOFTMAX or SIGMOID (RouterActFnType), got `{other}`"),
            )),
        }
    }
}

impl fmt::Display for RouterActFnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Softmax => "SOFTMAX",
            Self::Sigmoid => "SIGMOID",
        })
    }
}

/// How `x` lies in memory: nki-library's `x_hbm_layout` (0 = `[H, T]`, 1 = `[T, H]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XHbmLayout {
    /// 0: `x [H, T]`.
    HT,
    /// 1: `x [T, H]`, moekit's default.
    #[default]
    TH,
}

impl FromStr for XHbmLayout {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "0" => Ok(Self::HT),
            "1" => Ok(Self::TH),
            other => Err(Error::param(
                "x_hbm_layout",
                format!("expected 0 ([H, T]) or 1 ([T, H]), got `{other}`"),
            )),
        }
    }
}

impl fmt::Display for XHbmLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.value())
    }
}

impl XHbmLayout {
    /// nki-library's value: 0 for `[H, T]`, 1 for `[T, H]`.
    pub fn value(self) -> usize {
        match self {
            Self::HT => 0,
            Self::TH => 1,
        }
    }

    /// The human form of `x`'s layout.
    fn layout(self) -> &'static str {
        match self {
            Self::HT => "[H, T]",
            Self::TH => "[T, H]",
        }
    }

    /// `x` (in this layout) as `[T, H]`: itself, or its transpose.
    pub fn tokens_major(self, x: &Tensor) -> Result<Cow<'_, Tensor>> {
        match self {
            Self::TH => Ok(Cow::Borrowed(x)),
            Self::HT => x.transposed(fwd::X.name).map(Cow::Owned),
        }
    }

    /// A `[T, H]` gradient of `x`, laid out as `x` is.
    pub fn from_tokens_major(self, d_x: Tensor) -> Result<Tensor> {
        match self {
            Self::TH => Ok(d_x),
            Self::HT => d_x.transposed(bwd::D_X.name),
        }
    }
}

/// The activation pipeline every router call and its backward share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterPipeline {
    pub act_fn: RouterActFnType,
    /// ACT1 (activate over all E, then top-k) when true, ACT2 (top-k of the logits, then
    /// activate the K) when false; nki-library's default is true.
    pub router_pre_norm: bool,
    /// L1-normalise the K selected affinities (ACT1 only, as in nki-library).
    pub norm_topk_prob: bool,
    /// The layout of `x` (and of the backward's `d_x`).
    pub x_hbm_layout: XHbmLayout,
}

impl Default for RouterPipeline {
    /// nki-library's defaults: SOFTMAX, ACT1, no renormalisation; moekit's `[T, H]` layout.
    fn default() -> Self {
        Self {
            act_fn: RouterActFnType::Softmax,
            router_pre_norm: true,
            norm_topk_prob: false,
            x_hbm_layout: XHbmLayout::TH,
        }
    }
}

impl RouterPipeline {
    /// Hugging Face Qwen3-MoE's router (with `norm_topk_prob`, as its configs set it): SOFTMAX
    /// over all experts, top-k, renormalised; `x [T, H]`.
    pub const QWEN3_MOE: Self = Self {
        act_fn: RouterActFnType::Softmax,
        router_pre_norm: true,
        norm_topk_prob: true,
        x_hbm_layout: XHbmLayout::TH,
    };

    /// Whether the K selected affinities are the activation renormalised over the selection
    /// (a softmax over the selected log-affinities): ACT1 with `norm_topk_prob`, and ACT2 with
    /// SOFTMAX (a softmax over the K selected logits is exactly that).
    pub fn renormalises(&self) -> bool {
        if self.router_pre_norm {
            self.norm_topk_prob
        } else {
            self.act_fn == RouterActFnType::Softmax
        }
    }

    /// Whether `expert_affinities` is the activation of every logit (ACT1 without
    /// `norm_topk_prob`) rather than the K selected affinities scattered.
    pub fn dense_affinities(&self) -> bool {
        self.router_pre_norm && !self.norm_topk_prob
    }
}

/// Parameters of [`RouterTopk`], named as nki-library's `router_topk` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterTopkParams {
    /// K, experts per token; `1 ≤ K ≤ E` (nki-library's hardware also needs K ≤ 8).
    pub k: usize,
    pub pipeline: RouterPipeline,
}

/// Inputs of [`RouterTopk`]. Floating-point tensors may be f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkInputs<'a> {
    /// Token activations: `[T, H]`, or `[H, T]` with `x_hbm_layout = 0`.
    pub x: &'a Tensor,
    /// `[H, E]` router weight (the transpose of Hugging Face's `mlp.gate.weight [E, H]`).
    pub w: &'a Tensor,
    /// `[E]` or `[1, E]`, added to the logits.
    pub w_bias: Option<&'a Tensor>,
    /// `[E]`, added to the affinities only when choosing experts.
    pub selection_bias: Option<&'a Tensor>,
}

impl<'a> RouterTopkInputs<'a> {
    /// The inputs by their specs ([`fwd::INPUTS`]), absent biases left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![(&fwd::X, self.x), (&fwd::W, self.w)];
        named.extend(self.w_bias.map(|bias| (&fwd::W_BIAS, bias)));
        named.extend(self.selection_bias.map(|bias| (&fwd::SELECTION_BIAS, bias)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            x: required(&fwd::X)?,
            w: required(&fwd::W)?,
            w_bias: get(&fwd::W_BIAS),
            selection_bias: get(&fwd::SELECTION_BIAS),
        })
    }
}

/// Dimensions a router call's tensors agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterDims {
    /// T, tokens.
    pub t: usize,
    /// H, hidden size.
    pub h: usize,
    /// E, experts.
    pub e: usize,
    /// K, experts per token.
    pub k: usize,
}

/// A validated `router_topk` call: inputs, parameters and the dimensions they agree on.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopk<'a> {
    inputs: RouterTopkInputs<'a>,
    params: RouterTopkParams,
    dims: RouterDims,
    output_dtype: OutputDType,
}

impl<'a> RouterTopk<'a> {
    /// Checks shapes, dtypes, finiteness and `1 ≤ k ≤ E`.
    pub fn new(inputs: RouterTopkInputs<'a>, params: RouterTopkParams) -> Result<Self> {
        let (t, h) = check_x(inputs.x, params.pipeline.x_hbm_layout)?;
        let w = validate::float_input(&fwd::W, inputs.w, &[Some(h), None])?;
        let e = w[1];
        validate::non_empty(fwd::W.name, "E (experts)", e)?;
        if let Some(bias) = inputs.w_bias {
            // `[E]`, or `[1, E]` as nki-library also takes it.
            validate::row_tensor(fwd::W_BIAS.name, bias, e, "[E] or [1, E]")?;
        }
        if let Some(bias) = inputs.selection_bias {
            validate::float_input(&fwd::SELECTION_BIAS, bias, &[Some(e)])?;
        }
        check_top_k(params.k, e)?;
        let k = params.k;
        Ok(Self {
            inputs,
            params,
            dims: RouterDims { t, h, e, k },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> RouterTopkInputs<'a> {
        self.inputs
    }

    pub fn params(&self) -> RouterTopkParams {
        self.params
    }

    pub fn dims(&self) -> RouterDims {
        self.dims
    }
}

output_dtype_accessors!(RouterTopk, RouterTopkOutputs);

pub(crate) fn check_top_k(k: usize, experts: usize) -> Result<()> {
    if k == 0 || k > experts {
        return Err(Error::param(
            "k",
            format!("must be in 1..={experts} (E, the number of experts), got {k}"),
        ));
    }
    Ok(())
}

/// Checks `x` in `layout` (`[T, H]` or `[H, T]`) and returns `(T, H)`.
fn check_x(x: &Tensor, layout: XHbmLayout) -> Result<(usize, usize)> {
    let shape = validate::float_tensor(fwd::X.name, x, layout.layout(), &[None, None])?;
    let (t, h) = match layout {
        XHbmLayout::TH => (shape[0], shape[1]),
        XHbmLayout::HT => (shape[1], shape[0]),
    };
    validate::non_empty(fwd::X.name, "T (tokens)", t)?;
    validate::non_empty(fwd::X.name, "H (hidden size)", h)?;
    Ok((t, h))
}

/// Outputs of `router_topk`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterTopkOutputs {
    /// `[T, E]` in `x`'s dtype.
    pub router_logits: Tensor,
    /// `[T, K]` i32, descending selection score, ties to the lower expert id.
    pub expert_index: Tensor,
    /// `[T, K]` in `x`'s dtype, the selected experts' affinities (nki-library's eager affinities).
    pub topk_affinities: Tensor,
    /// `[T, E]` in `x`'s dtype: the activation of every logit under ACT1 without `norm_topk_prob`,
    /// otherwise `topk_affinities` scattered, zeros elsewhere.
    pub expert_affinities: Tensor,
}

impl RouterTopkOutputs {
    /// The outputs by their specs ([`fwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&fwd::ROUTER_LOGITS, self.router_logits),
            (&fwd::EXPERT_INDEX, self.expert_index),
            (&fwd::TOPK_AFFINITIES, self.topk_affinities),
            (&fwd::EXPERT_AFFINITIES, self.expert_affinities),
        ]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            router_logits: f(&fwd::ROUTER_LOGITS, self.router_logits)?,
            expert_index: f(&fwd::EXPERT_INDEX, self.expert_index)?,
            topk_affinities: f(&fwd::TOPK_AFFINITIES, self.topk_affinities)?,
            expert_affinities: f(&fwd::EXPERT_AFFINITIES, self.expert_affinities)?,
        })
    }
}

/// Parameters of [`RouterTopkBwd`] (moekit's own kernel): the forward's pipeline and the dtype
/// of the products' operands; K is read from `expert_index`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouterTopkBwdParams {
    pub pipeline: RouterPipeline,
    /// `compute_dtype` ([`ComputeDType`], default `x`'s dtype).
    pub compute_dtype: Option<ComputeDType>,
}

/// Inputs of the router backward: the forward's inputs and outputs it needs, plus gradients.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkBwdInputs<'a> {
    /// `[T, H]`, or `[H, T]` with `x_hbm_layout = 0`.
    pub x: &'a Tensor,
    /// `[H, E]`.
    pub w: &'a Tensor,
    /// `[T, E]`, the forward's output (bias already included).
    pub router_logits: &'a Tensor,
    /// `[T, K]` i32, the forward's output.
    pub expert_index: &'a Tensor,
    /// `[T, K]`, gradient of the loss w.r.t. `topk_affinities`.
    pub d_topk_affinities: &'a Tensor,
    /// `[T, E]`, gradient w.r.t. `router_logits` from other consumers (e.g. the aux loss).
    pub d_router_logits: Option<&'a Tensor>,
}

impl<'a> RouterTopkBwdInputs<'a> {
    /// The inputs by their specs ([`bwd::INPUTS`]), an absent `d_router_logits` left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&bwd::X, self.x),
            (&bwd::W, self.w),
            (&bwd::ROUTER_LOGITS, self.router_logits),
            (&bwd::EXPERT_INDEX, self.expert_index),
            (&bwd::D_TOPK_AFFINITIES, self.d_topk_affinities),
        ];
        named.extend(self.d_router_logits.map(|d| (&bwd::D_ROUTER_LOGITS, d)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            x: required(&bwd::X)?,
            w: required(&bwd::W)?,
            router_logits: required(&bwd::ROUTER_LOGITS)?,
            expert_index: required(&bwd::EXPERT_INDEX)?,
            d_topk_affinities: required(&bwd::D_TOPK_AFFINITIES)?,
            d_router_logits: get(&bwd::D_ROUTER_LOGITS),
        })
    }
}

/// A validated `router_topk_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkBwd<'a> {
    inputs: RouterTopkBwdInputs<'a>,
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    params: RouterTopkBwdParams,
    dims: RouterDims,
    output_dtype: OutputDType,
}

impl<'a> RouterTopkBwd<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: RouterTopkBwdInputs<'a>, params: RouterTopkBwdParams) -> Result<Self> {
        let (t, h) = check_x(inputs.x, params.pipeline.x_hbm_layout)?;
        let e = validate::float_input(&bwd::W, inputs.w, &[Some(h), None])?[1];
        validate::non_empty(bwd::W.name, "E (experts)", e)?;
        validate::float_input(
            &bwd::ROUTER_LOGITS,
            inputs.router_logits,
            &[Some(t), Some(e)],
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
        validate::float_input(
            &bwd::D_TOPK_AFFINITIES,
            inputs.d_topk_affinities,
            &[Some(t), Some(k)],
        )?;
        if let Some(d) = inputs.d_router_logits {
            validate::float_input(&bwd::D_ROUTER_LOGITS, d, &[Some(t), Some(e)])?;
        }
        Ok(Self {
            inputs,
            expert_ids: ids,
            params,
            dims: RouterDims { t, h, e, k },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> RouterTopkBwdInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values, ids in `[0, E)`.
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn params(&self) -> RouterTopkBwdParams {
        self.params
    }

    /// The dtype of the products' operands ([`ComputeDType`]): bf16 or f32.
    pub fn compute_dtype(&self) -> DType {
        ComputeDType::resolve(self.params.compute_dtype, self.inputs.x.dtype())
    }

    pub fn dims(&self) -> RouterDims {
        self.dims
    }
}

output_dtype_accessors!(RouterTopkBwd, RouterTopkGrads);

/// Gradients produced by `router_topk_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterTopkGrads {
    /// In `x`'s dtype and layout: `[T, H]`, or `[H, T]` with `x_hbm_layout = 0`.
    pub d_x: Tensor,
    /// `[H, E]` in `w`'s dtype.
    pub d_w: Tensor,
    /// `[E]` in `w`'s dtype, the gradient of `w_bias`.
    pub d_w_bias: Tensor,
}

impl RouterTopkGrads {
    /// The gradients by their specs ([`bwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&bwd::D_X, self.d_x),
            (&bwd::D_W, self.d_w),
            (&bwd::D_W_BIAS, self.d_w_bias),
        ]
    }

    /// Every gradient through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            d_x: f(&bwd::D_X, self.d_x)?,
            d_w: f(&bwd::D_W, self.d_w)?,
            d_w_bias: f(&bwd::D_W_BIAS, self.d_w_bias)?,
        })
    }
}
