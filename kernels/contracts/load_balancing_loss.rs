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

use super::validate;
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

/// A validated `load_balancing_loss` call.
///
/// Non-exhaustive: outside this crate a call can only come from `new`, which validates it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LoadBalancingLoss<'a> {
    pub inputs: LoadBalancingLossInputs<'a>,
    /// L, layers pooled.
    pub l: usize,
    pub t: usize,
    pub e: usize,
    pub k: usize,
}

impl<'a> LoadBalancingLoss<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossInputs<'a>) -> Result<Self> {
        let (l, t, e, k) = check(inputs.router_logits, inputs.expert_index)?;
        Ok(Self { inputs, l, t, e, k })
    }
}

/// Validates `router_logits [L,T,E]` against `expert_index [L,T,K]`; returns `(L, T, E, K)`.
fn check(router_logits: &Tensor, expert_index: &Tensor) -> Result<(usize, usize, usize, usize)> {
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
    Ok((l, t, e, k))
}

/// Outputs of `load_balancing_loss`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossOutputs {
    /// `[1]` f32.
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
/// Non-exhaustive: outside this crate a call can only come from `new`, which validates it.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LoadBalancingLossBwd<'a> {
    pub inputs: LoadBalancingLossBwdInputs<'a>,
    pub l: usize,
    pub t: usize,
    pub e: usize,
    pub k: usize,
}

impl<'a> LoadBalancingLossBwd<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossBwdInputs<'a>) -> Result<Self> {
        let (l, t, e, k) = check(inputs.router_logits, inputs.expert_index)?;
        validate::float_tensor("d_aux_loss", inputs.d_aux_loss, "[1]", &[Some(1)])?;
        Ok(Self { inputs, l, t, e, k })
    }
}

/// Gradient produced by `load_balancing_loss_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossGrads {
    /// Same shape as `router_logits`, f32.
    pub d_router_logits: Tensor,
}
