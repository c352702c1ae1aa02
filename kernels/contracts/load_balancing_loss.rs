//! `load_balancing_loss`: Hugging Face Qwen3-MoE's auxiliary load-balancing loss, and its
//! backward.
//!
//! All L layers are pooled exactly as `transformers`' `load_balancing_loss_func` pools them
//! (their logits concatenated into one `[L·T, E]` batch):
//! ```text
//! p[n]       = softmax(router_logits[n])                    n over all L·T rows
//! f[e]       = #{(n, k) : expert_index[n, k] = e} / (L·T)    (Σ_e f[e] = K)
//! P[e]       = mean_n p[n, e]
//! aux_loss   = E · Σ_e f[e] · P[e]                           (= K for perfectly uniform routing)
//! ```
//! The softmax is always used for `P`, whatever the router's activation, as in Hugging Face.
//! Only `P` is differentiable; `f` comes from the discrete top-k choice.
//!
//! Error bound (reference backend): computed in f64, rounded once to f32 (0.5 ulp); counts are
//! exact. The softmax is applied once, to the raw logits, as `load_balancing_loss_func` intends.

use super::{OutputDType, validate};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Inputs of [`LoadBalancingLoss`].
#[derive(Clone, Copy, Debug)]
pub struct LoadBalancingLossInputs<'a> {
    /// `[L, T, E]` (or `[T, E]` for one layer), f32 or bf16.
    pub router_logits: &'a Tensor,
    /// `[L, T, K]` (or `[T, K]`) i32.
    pub expert_index: &'a Tensor,
}

/// Dimensions an aux-loss call's tensors agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadBalancingDims {
    /// L, layers pooled (1 for `[T, E]` inputs).
    pub l: usize,
    pub t: usize,
    pub e: usize,
    pub k: usize,
}

/// A validated `load_balancing_loss` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct LoadBalancingLoss<'a> {
    inputs: LoadBalancingLossInputs<'a>,
    dims: LoadBalancingDims,
}

impl<'a> LoadBalancingLoss<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossInputs<'a>) -> Result<Self> {
        let dims = check(inputs.router_logits, inputs.expert_index)?;
        Ok(Self { inputs, dims })
    }

    pub fn inputs(&self) -> LoadBalancingLossInputs<'a> {
        self.inputs
    }

    pub fn dims(&self) -> LoadBalancingDims {
        self.dims
    }
}

/// Validates `router_logits [L,T,E]` against `expert_index [L,T,K]`.
fn check(router_logits: &Tensor, expert_index: &Tensor) -> Result<LoadBalancingDims> {
    let rank = router_logits.shape().len();
    let (layout, dims): (&str, &[Option<usize>]) = if rank == 2 {
        ("[T, E]", &[None, None])
    } else {
        ("[L, T, E]", &[None, None, None])
    };
    let logits = validate::float_tensor("router_logits", router_logits, layout, dims)?;
    let (l, t, e) = match logits[..] {
        [t, e] => (1, t, e),
        [l, t, e] => (l, t, e),
        _ => unreachable!("rank checked by float_tensor"),
    };
    validate::non_empty("router_logits", "L (layers)", l)?;
    validate::non_empty("router_logits", "T (tokens)", t)?;
    validate::non_empty("router_logits", "E (experts)", e)?;
    let (layout, dims): (&str, Vec<Option<usize>>) = if rank == 2 {
        ("[T, K]", vec![Some(t), None])
    } else {
        ("[L, T, K]", vec![Some(l), Some(t), None])
    };
    let (shape, ids) = validate::index_tensor("expert_index", expert_index, layout, &dims)?;
    let k = *shape.last().expect("rank ≥ 2");
    if k == 0 || k > e {
        return Err(Error::shape(
            "expert_index",
            format!("{layout} with 1 ≤ K ≤ E = {e}"),
            &shape,
        ));
    }
    validate::expert_ids("expert_index", ids, &shape, e)?;
    Ok(LoadBalancingDims { l, t, e, k })
}

/// Outputs of `load_balancing_loss`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossOutputs {
    /// `[1]` f32 whatever the logits' dtype.
    pub aux_loss: Tensor,
    /// `[L, E]` i32, top-k assignments per layer and expert (per-layer load statistics).
    pub expert_counts: Tensor,
}

/// Inputs of [`LoadBalancingLossBwd`].
#[derive(Clone, Copy, Debug)]
pub struct LoadBalancingLossBwdInputs<'a> {
    /// `[L, T, E]` or `[T, E]`.
    pub router_logits: &'a Tensor,
    /// `[L, T, K]` or `[T, K]` i32.
    pub expert_index: &'a Tensor,
    /// `[1]`.
    pub d_aux_loss: &'a Tensor,
}

/// A validated `load_balancing_loss_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct LoadBalancingLossBwd<'a> {
    inputs: LoadBalancingLossBwdInputs<'a>,
    dims: LoadBalancingDims,
    output_dtype: OutputDType,
}

impl<'a> LoadBalancingLossBwd<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossBwdInputs<'a>) -> Result<Self> {
        let dims = check(inputs.router_logits, inputs.expert_index)?;
        validate::float_tensor("d_aux_loss", inputs.d_aux_loss, "[1]", &[Some(1)])?;
        Ok(Self {
            inputs,
            dims,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> LoadBalancingLossBwdInputs<'a> {
        self.inputs
    }

    pub fn dims(&self) -> LoadBalancingDims {
        self.dims
    }

    /// This call with moekit's own `output_dtype` ([`OutputDType`]; `input`, nki-library's
    /// choice, when not set).
    pub fn with_output_dtype(mut self, output_dtype: OutputDType) -> Self {
        self.output_dtype = output_dtype;
        self
    }

    pub fn output_dtype(&self) -> OutputDType {
        self.output_dtype
    }

    /// `grads` in the dtypes this call gives them: `d_router_logits` in `router_logits`'
    /// dtype, or f32.
    pub fn cast_outputs(&self, grads: LoadBalancingLossGrads) -> Result<LoadBalancingLossGrads> {
        Ok(LoadBalancingLossGrads {
            d_router_logits: self.output_dtype.apply(
                "d_router_logits",
                grads.d_router_logits,
                self.inputs.router_logits.dtype(),
            )?,
        })
    }
}

/// Gradient produced by `load_balancing_loss_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossGrads {
    /// Same shape and dtype as `router_logits`.
    pub d_router_logits: Tensor,
}
