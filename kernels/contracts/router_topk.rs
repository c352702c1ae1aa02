//! `router_topk`: token-choice top-k routing (the NKI `router_topk` kernel), and its backward.
//!
//! Forward, per token `t`:
//! ```text
//! router_logits[t]      = x[t] · w (+ bias)                          [T, E]  f32
//! p[t]                  = softmax(router_logits[t]) or sigmoid(...)  over all E experts
//! expert_index[t]       = the K experts with the largest p[t] (+ selection_bias), in descending
//!                         order, ties to the lower expert id                        [T, K]  i32
//! topk_affinities[t, k] = p[t, expert_index[t, k]], divided by Σ_k of those values if
//!                         norm_topk_prob                                            [T, K]  f32
//! expert_affinities[t]  = topk_affinities scattered to their experts, 0 elsewhere   [T, E]  f32
//! ```
//! `selection_bias` only changes which experts are chosen, never the affinities (aux-loss-free
//! balancing). With softmax, no biases and `norm_topk_prob` this is Hugging Face Qwen3-MoE's
//! router formula: softmax over all experts, top-k, divide by the top-k sum (no epsilon).
//!
//! Error bound (reference backend): every value is computed in f64 and rounded once to f32, so
//! each output is within 0.5 ulp (f32) of the f64 result; `expert_index` is exact except where
//! two selection scores agree to within f64 rounding. "Equals Hugging Face" means the same
//! formula: HF computes the gate matmul in the activation dtype and the softmax in f32, so its
//! values agree with these to f32 (or bf16) rounding, and its choice can differ only at such
//! near-ties.

use std::fmt;
use std::str::FromStr;

use super::validate;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The function that turns router logits into affinities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// Softmax over all E experts (Qwen3-MoE, Mixtral).
    #[default]
    Softmax,
    /// Independent sigmoid per expert (DeepSeek-V3 style).
    Sigmoid,
}

impl FromStr for Activation {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "softmax" => Ok(Self::Softmax),
            "sigmoid" => Ok(Self::Sigmoid),
            other => Err(Error::param(
                "activation",
                format!("expected `softmax` or `sigmoid`, got `{other}`"),
            )),
        }
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Softmax => "softmax",
            Self::Sigmoid => "sigmoid",
        })
    }
}

/// Parameters of [`RouterTopk`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterTopkParams {
    /// K, experts per token; `1 ≤ K ≤ E`.
    pub top_k: usize,
    pub activation: Activation,
    /// Divide the K selected affinities by their sum.
    pub norm_topk_prob: bool,
}

/// Inputs of [`RouterTopk`]. Floating-point tensors may be f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkInputs<'a> {
    /// `[T, H]` token activations.
    pub x: &'a Tensor,
    /// `[H, E]` router weight (the transpose of Hugging Face's `mlp.gate.weight [E, H]`).
    pub w: &'a Tensor,
    /// `[E]`, added to the logits.
    pub bias: Option<&'a Tensor>,
    /// `[E]`, added to the affinities only when choosing experts.
    pub selection_bias: Option<&'a Tensor>,
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
}

impl<'a> RouterTopk<'a> {
    /// Checks shapes, dtypes, finiteness and `1 ≤ top_k ≤ E`.
    pub fn new(inputs: RouterTopkInputs<'a>, params: RouterTopkParams) -> Result<Self> {
        let x = validate::float_tensor("x", inputs.x, "[T, H]", &[None, None])?;
        let (t, h) = (x[0], x[1]);
        validate::non_empty("x", "T (tokens)", t)?;
        validate::non_empty("x", "H (hidden size)", h)?;
        let w = validate::float_tensor("w", inputs.w, "[H, E]", &[Some(h), None])?;
        let e = w[1];
        validate::non_empty("w", "E (experts)", e)?;
        if let Some(bias) = inputs.bias {
            validate::float_tensor("bias", bias, "[E]", &[Some(e)])?;
        }
        if let Some(bias) = inputs.selection_bias {
            validate::float_tensor("selection_bias", bias, "[E]", &[Some(e)])?;
        }
        check_top_k(params.top_k, e)?;
        let k = params.top_k;
        Ok(Self {
            inputs,
            params,
            dims: RouterDims { t, h, e, k },
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

pub(crate) fn check_top_k(top_k: usize, experts: usize) -> Result<()> {
    if top_k == 0 || top_k > experts {
        return Err(Error::param(
            "top_k",
            format!("must be in 1..={experts} (E, the number of experts), got {top_k}"),
        ));
    }
    Ok(())
}

/// Outputs of `router_topk`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterTopkOutputs {
    /// `[T, E]` f32.
    pub router_logits: Tensor,
    /// `[T, K]` i32, descending affinity, ties to the lower expert id.
    pub expert_index: Tensor,
    /// `[T, K]` f32.
    pub topk_affinities: Tensor,
    /// `[T, E]` f32, `topk_affinities` scattered, zeros elsewhere.
    pub expert_affinities: Tensor,
}

/// Parameters of [`RouterTopkBwd`]; K is read from `expert_index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouterTopkBwdParams {
    pub activation: Activation,
    pub norm_topk_prob: bool,
}

/// Inputs of the router backward: the forward's inputs and outputs it needs, plus gradients.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkBwdInputs<'a> {
    /// `[T, H]`.
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

/// A validated `router_topk_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct RouterTopkBwd<'a> {
    inputs: RouterTopkBwdInputs<'a>,
    params: RouterTopkBwdParams,
    dims: RouterDims,
}

impl<'a> RouterTopkBwd<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: RouterTopkBwdInputs<'a>, params: RouterTopkBwdParams) -> Result<Self> {
        let x = validate::float_tensor("x", inputs.x, "[T, H]", &[None, None])?;
        let (t, h) = (x[0], x[1]);
        validate::non_empty("x", "T (tokens)", t)?;
        validate::non_empty("x", "H (hidden size)", h)?;
        let e = validate::float_tensor("w", inputs.w, "[H, E]", &[Some(h), None])?[1];
        validate::non_empty("w", "E (experts)", e)?;
        validate::float_tensor(
            "router_logits",
            inputs.router_logits,
            "[T, E]",
            &[Some(t), Some(e)],
        )?;
        let (shape, ids) = validate::index_tensor(
            "expert_index",
            inputs.expert_index,
            "[T, K]",
            &[Some(t), None],
        )?;
        let k = shape[1];
        check_top_k(k, e).map_err(|_| {
            Error::shape(
                "expert_index",
                format!("[T, K] with 1 ≤ K ≤ E = {e}"),
                &shape,
            )
        })?;
        validate::expert_ids("expert_index", ids, &shape, e)?;
        validate::float_tensor(
            "d_topk_affinities",
            inputs.d_topk_affinities,
            "[T, K]",
            &[Some(t), Some(k)],
        )?;
        if let Some(d) = inputs.d_router_logits {
            validate::float_tensor("d_router_logits", d, "[T, E]", &[Some(t), Some(e)])?;
        }
        Ok(Self {
            inputs,
            params,
            dims: RouterDims { t, h, e, k },
        })
    }

    pub fn inputs(&self) -> RouterTopkBwdInputs<'a> {
        self.inputs
    }

    pub fn params(&self) -> RouterTopkBwdParams {
        self.params
    }

    pub fn dims(&self) -> RouterDims {
        self.dims
    }
}

/// Gradients produced by `router_topk_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterTopkGrads {
    /// `[T, H]` f32.
    pub d_x: Tensor,
    /// `[H, E]` f32.
    pub d_w: Tensor,
    /// `[E]` f32.
    pub d_bias: Tensor,
}
