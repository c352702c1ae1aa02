//! `a2av_routing` (moekit's own): the routing table of nki-library's expert-parallel exchange
//! kernels (`permute_a2av` and `unpermute_a2av`, in its newer releases) from one rank's
//! `expert_index`. nki-library builds this table on the host; this kernel builds it as those
//! kernels take it.
//!
//! ```text
//! send_indices [T, EP]  i32  column d lists, ascending, the tokens with at least one of their
//!                            K experts on rank d (experts [d·E/EP, (d+1)·E/EP)); each token
//!                            once per rank; the rest of the column holds T (empty)
//! send_counts [1, EP]   i32  how many tokens column d lists
//! ```
//! `permute_a2av` sends token `send_indices[j, d]` to rank d for every listed j; the receiving
//! rank places the rows from source s at `[s·T, s·T + n_s)` of its `[EP·T, H]` buffer, and
//! `unpermute_a2av` scatter-adds the returned rows back into `[T, H]` through the same table.
//! An `expert_index` slot of [`SKIP`](super::SKIP) (−1) sends nothing.
//!
//! Error bound: exact (indices and counts).

use super::spec::{self, Named, TensorSpec};
use super::tensors::a2av_routing as spec_of;
use super::validate;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Parameters of [`A2avRouting`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct A2avRoutingParams {
    /// E, experts over all ranks.
    pub num_experts: usize,
    /// EP, expert-parallel ranks; each holds E/EP consecutive experts.
    pub expert_parallel_degree: usize,
}

/// Inputs of [`A2avRouting`].
#[derive(Clone, Copy, Debug)]
pub struct A2avRoutingInputs<'a> {
    /// `[T, K]` i32, global expert ids in `[0, E)` distinct per row, or SKIP.
    pub expert_index: &'a Tensor,
}

impl<'a> A2avRoutingInputs<'a> {
    /// The inputs by their specs ([`spec_of::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![(&spec_of::EXPERT_INDEX, self.expert_index)]
    }

    /// The inputs `get` finds by spec; a missing one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            expert_index: spec::required(&get, &spec_of::EXPERT_INDEX)?,
        })
    }
}

/// Dimensions of an `a2av_routing` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct A2avRoutingDims {
    pub t: usize,
    pub k: usize,
    pub e: usize,
    /// EP.
    pub ranks: usize,
}

impl A2avRoutingDims {
    /// The rank holding expert `expert`.
    pub fn rank_of(&self, expert: usize) -> usize {
        expert / (self.e / self.ranks)
    }
}

/// A validated `a2av_routing` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct A2avRouting<'a> {
    inputs: A2avRoutingInputs<'a>,
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    dims: A2avRoutingDims,
}

impl<'a> A2avRouting<'a> {
    /// Checks the ids, E ≥ 1, 1 ≤ EP dividing E, and that the table's ids fit in i32.
    pub fn new(inputs: A2avRoutingInputs<'a>, params: A2avRoutingParams) -> Result<Self> {
        let A2avRoutingParams {
            num_experts: e,
            expert_parallel_degree: ranks,
        } = params;
        if e == 0 {
            return Err(Error::param("num_experts", "must be at least 1, got 0"));
        }
        if ranks == 0 || !e.is_multiple_of(ranks) {
            return Err(Error::param(
                "expert_parallel_degree",
                format!(
                    "must divide num_experts = {e} (each rank holds E/EP experts), got {ranks}"
                ),
            ));
        }
        let (shape, ids) =
            validate::index_input(&spec_of::EXPERT_INDEX, inputs.expert_index, &[None, None])?;
        let (t, k) = (shape[0], shape[1]);
        // T may be 0: an expert-parallel rank without tokens sends nothing.
        validate::non_empty(spec_of::EXPERT_INDEX.name, "K (top_k)", k)?;
        validate::expert_ids_or_skip(spec_of::EXPERT_INDEX.name, ids, &shape, e)?;
        if i32::try_from(t).is_err() {
            return Err(Error::invalid(
                spec_of::EXPERT_INDEX.name,
                format!("T = {t} tokens: send_indices holds ids up to T, past i32"),
            ));
        }
        Ok(Self {
            inputs,
            expert_ids: ids,
            dims: A2avRoutingDims { t, k, e, ranks },
        })
    }

    pub fn inputs(&self) -> A2avRoutingInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values: ids in `[0, E)` or [`SKIP`](super::SKIP).
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn dims(&self) -> A2avRoutingDims {
        self.dims
    }
}

/// Outputs of `a2av_routing`.
#[derive(Clone, Debug, PartialEq)]
pub struct A2avRoutingOutputs {
    /// `[T, EP]` i32, T in empty entries.
    pub send_indices: Tensor,
    /// `[1, EP]` i32.
    pub send_counts: Tensor,
}

impl A2avRoutingOutputs {
    /// The outputs by their specs ([`spec_of::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&spec_of::SEND_INDICES, self.send_indices),
            (&spec_of::SEND_COUNTS, self.send_counts),
        ]
    }
}
