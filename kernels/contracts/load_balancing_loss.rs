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

use super::spec::{self, Named, TensorSpec};
use super::tensors::{load_balancing_loss as fwd, load_balancing_loss_bwd as bwd};
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

impl<'a> LoadBalancingLossInputs<'a> {
    /// The inputs by their specs ([`fwd::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![
            (&fwd::ROUTER_LOGITS, self.router_logits),
            (&fwd::EXPERT_INDEX, self.expert_index),
        ]
    }

    /// The inputs `get` finds by spec; a missing one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            router_logits: spec::required(&get, &fwd::ROUTER_LOGITS)?,
            expert_index: spec::required(&get, &fwd::EXPERT_INDEX)?,
        })
    }
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
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    dims: LoadBalancingDims,
}

impl<'a> LoadBalancingLoss<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossInputs<'a>) -> Result<Self> {
        let (dims, expert_ids) = check(inputs.router_logits, inputs.expert_index)?;
        Ok(Self {
            inputs,
            expert_ids,
            dims,
        })
    }

    pub fn inputs(&self) -> LoadBalancingLossInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values, ids in `[0, E)`.
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn dims(&self) -> LoadBalancingDims {
        self.dims
    }
}

/// Validates `router_logits [L,T,E]` against `expert_index [L,T,K]`; returns the dimensions and
/// the expert ids.
fn check<'a>(
    router_logits: &Tensor,
    expert_index: &'a Tensor,
) -> Result<(LoadBalancingDims, &'a [i32])> {
    let rank = router_logits.shape().len();
    let (layout, dims): (&str, &[Option<usize>]) = if rank == 2 {
        ("[T, E]", &[None, None])
    } else {
        ("[L, T, E]", &[None, None, None])
    };
    let logits = validate::float_tensor(fwd::ROUTER_LOGITS.name, router_logits, layout, dims)?;
    let (l, t, e) = match logits[..] {
        [t, e] => (1, t, e),
        [l, t, e] => (l, t, e),
        _ => unreachable!("rank checked by float_tensor"),
    };
    validate::non_empty(fwd::ROUTER_LOGITS.name, "L (layers)", l)?;
    validate::non_empty(fwd::ROUTER_LOGITS.name, "T (tokens)", t)?;
    validate::non_empty(fwd::ROUTER_LOGITS.name, "E (experts)", e)?;
    let (layout, dims): (&str, Vec<Option<usize>>) = if rank == 2 {
        ("[T, K]", vec![Some(t), None])
    } else {
        ("[L, T, K]", vec![Some(l), Some(t), None])
    };
    let (shape, ids) = validate::index_tensor(fwd::EXPERT_INDEX.name, expert_index, layout, &dims)?;
    let k = *shape.last().expect("rank ≥ 2");
    if k == 0 || k > e {
        return Err(Error::shape(
            fwd::EXPERT_INDEX.name,
            format!("{layout} with 1 ≤ K ≤ E = {e}"),
            &shape,
        ));
    }
    validate::expert_ids(fwd::EXPERT_INDEX.name, ids, &shape, e)?;
    Ok((LoadBalancingDims { l, t, e, k }, ids))
}

/// Outputs of `load_balancing_loss`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossOutputs {
    /// `[1]` f32 whatever the logits' dtype.
    pub aux_loss: Tensor,
    /// `[L, E]` i32, top-k assignments per layer and expert (per-layer load statistics).
    pub expert_counts: Tensor,
}

impl LoadBalancingLossOutputs {
    /// The outputs by their specs ([`fwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&fwd::AUX_LOSS, self.aux_loss),
            (&fwd::EXPERT_COUNTS, self.expert_counts),
        ]
    }
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

impl<'a> LoadBalancingLossBwdInputs<'a> {
    /// The inputs by their specs ([`bwd::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![
            (&bwd::ROUTER_LOGITS, self.router_logits),
            (&bwd::EXPERT_INDEX, self.expert_index),
            (&bwd::D_AUX_LOSS, self.d_aux_loss),
        ]
    }

    /// The inputs `get` finds by spec; a missing one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            router_logits: spec::required(&get, &bwd::ROUTER_LOGITS)?,
            expert_index: spec::required(&get, &bwd::EXPERT_INDEX)?,
            d_aux_loss: spec::required(&get, &bwd::D_AUX_LOSS)?,
        })
    }
}

/// A validated `load_balancing_loss_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct LoadBalancingLossBwd<'a> {
    inputs: LoadBalancingLossBwdInputs<'a>,
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    dims: LoadBalancingDims,
    output_dtype: OutputDType,
}

impl<'a> LoadBalancingLossBwd<'a> {
    /// Checks shapes, dtypes, finiteness and expert ids.
    pub fn new(inputs: LoadBalancingLossBwdInputs<'a>) -> Result<Self> {
        let (dims, expert_ids) = check(inputs.router_logits, inputs.expert_index)?;
        validate::float_input(&bwd::D_AUX_LOSS, inputs.d_aux_loss, &[Some(1)])?;
        Ok(Self {
            inputs,
            expert_ids,
            dims,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> LoadBalancingLossBwdInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values, ids in `[0, E)`.
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn dims(&self) -> LoadBalancingDims {
        self.dims
    }
}

output_dtype_accessors!(LoadBalancingLossBwd, LoadBalancingLossGrads);

/// Gradient produced by `load_balancing_loss_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadBalancingLossGrads {
    /// Same shape and dtype as `router_logits`.
    pub d_router_logits: Tensor,
}

impl LoadBalancingLossGrads {
    /// The gradient by its spec ([`bwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![(&bwd::D_ROUTER_LOGITS, self.d_router_logits)]
    }

    /// The gradient through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            d_router_logits: f(&bwd::D_ROUTER_LOGITS, self.d_router_logits)?,
        })
    }
}
