//! `permute`: the block plan that groups token copies by expert into fixed-size blocks, and its
//! backward. nki-library makes this plan on the host (its tests' generator); the plan is the
//! input of its blockwise matmul kernels, in their convention, so a plan made here goes
//! unchanged into an NKI kernel and one made by nki-library's generator goes unchanged into
//! moekit's `blockwise_mm`. `permute` itself is moekit's own kernel.
//!
//! ```text
//! expert_counts [E]                      i32  top-k assignments per expert (Σ = T·K minus
//!                                             skipped slots, whose expert_index is SKIP = −1)
//! token_position_to_id [N·B]             i32  token id per block slot, T (the all-zero padding
//!                                             row of hidden_states [T+1, H]) for padding; each
//!                                             expert's tokens in ascending token order, each
//!                                             expert starts a new block, blocks ordered by
//!                                             expert id, padding only at the tail of an
//!                                             expert's last block
//! block_to_expert [N, 1]                 i32  expert of each block; the unused blocks follow
//!                                             the last used one, on expert E−1, all padding
//! expert_affinities_masked [(T+1)·E, 1]  f32  affinity of token t for expert e at t·E + e, 0
//!                                             when t did not choose e; row T all zeros
//! num_used_blocks [1]                    i32  Σ_e ceil(count_e / B); blocks past it are unused
//!                                             (moekit's own)
//! ```
//! With `skip_token` (nki-library's `SkipMode`, for blockwise kernels that take `hidden_states
//! [T, H]`) padding slots hold −1 and `expert_affinities_masked` is `[T·E, 1]`.
//!
//! N is nki-library's static bound `ceil((T·K − (E−1)) / B) + (E−1)`, the most blocks any
//! routing of T·K assignments over E experts can need, rounded up to a multiple of
//! `n_block_per_iter` (the blocks its shard-on-block kernel takes per iteration), so buffers can
//! be sized before routing.
//!
//! Error bound: exact. Indices and counts are integers and affinities are copied, not computed.

use super::spec::{self, Named, TensorSpec};
use super::tensors::{permute as fwd, permute_bwd as bwd};
use super::{OutputDType, SkipMode, validate};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// nki-library's static block count N for `assignments = T·K` token copies over `experts`
/// experts in blocks of `block_size`: `ceil((T·K − (E−1)) / B) + (E−1)`, rounded up to a
/// multiple of `n_block_per_iter` (B and `n_block_per_iter` of 0 are treated as 1). `None` when
/// N does not fit in usize.
pub fn static_block_count(
    assignments: usize,
    experts: usize,
    block_size: usize,
    n_block_per_iter: usize,
) -> Option<usize> {
    // i128 holds every usize, so the possibly negative numerator cannot overflow.
    let m = assignments as i128;
    let spread = experts as i128 - 1;
    let b = block_size.max(1) as i128;
    let blocks = -(spread - m).div_euclid(b) + spread; // ceil((m − spread) / b) + spread
    let per_iter = n_block_per_iter.max(1) as i128;
    let rounded = -(-blocks).div_euclid(per_iter) * per_iter;
    usize::try_from(rounded.max(0)).ok()
}

/// Parameters of [`Permute`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PermuteParams {
    /// E, experts.
    pub num_experts: usize,
    /// B, token slots per block.
    pub block_size: usize,
    /// N is rounded up to a multiple of this (nki-library's `n_block_per_iter`; 1 for the
    /// shard-on-I kernels).
    pub n_block_per_iter: usize,
    /// The blockwise kernels' `skip_dma` the plan is for: with `skip_token`, padding slots
    /// hold −1 and `expert_affinities_masked` has no row T.
    pub skip_dma: SkipMode,
}

impl PermuteParams {
    /// nki-library's `get_n_blocks` default of `n_block_per_iter`.
    pub const DEFAULT_N_BLOCK_PER_ITER: usize = 1;

    /// `n_block_per_iter` at its default, [`Self::DEFAULT_N_BLOCK_PER_ITER`], for the padded
    /// layout (no `skip_token`).
    pub fn new(num_experts: usize, block_size: usize) -> Self {
        Self {
            num_experts,
            block_size,
            n_block_per_iter: Self::DEFAULT_N_BLOCK_PER_ITER,
            skip_dma: SkipMode::default(),
        }
    }

    /// N, the plan's blocks for `t` tokens of top-`k` ([`static_block_count`]): an error
    /// where B or `n_block_per_iter` is 0, or the N·B slots do not fit in i32 indices.
    pub fn block_count(&self, t: usize, k: usize) -> Result<usize> {
        let (e, b) = (self.num_experts, self.block_size);
        if b == 0 {
            return Err(Error::param("block_size", "must be at least 1, got 0"));
        }
        if self.n_block_per_iter == 0 {
            return Err(Error::param(
                "n_block_per_iter",
                "must be at least 1, got 0",
            ));
        }
        t.checked_mul(k)
            .and_then(|assignments| static_block_count(assignments, e, b, self.n_block_per_iter))
            .filter(|n| {
                n.checked_mul(b)
                    .is_some_and(|slots| i32::try_from(slots).is_ok())
            })
            .ok_or_else(|| {
                Error::param(
                    "block_size",
                    format!(
                        "the N·B block slots of T·K = {t}·{k} assignments over E = {e} experts in \
                         blocks of {b} (n_block_per_iter = {}) do not fit in i32 indices",
                        self.n_block_per_iter
                    ),
                )
            })
    }
}

/// The `expert_index` value of a slot with no assignment (`permute`, `permute_bwd`,
/// `blockwise_mm_bwd`): an expert-parallel receiver holds only the slots of its local experts.
/// A skipped slot's affinity must be 0; it gets no block slot and a zero affinity gradient.
pub const SKIP: i32 = -1;

/// Inputs of [`Permute`].
#[derive(Clone, Copy, Debug)]
pub struct PermuteInputs<'a> {
    /// `[T, K]` i32, distinct ids in `[0, E)` per row, or [`SKIP`].
    pub expert_index: &'a Tensor,
    /// `[T, K]` f32 or bf16; 0 in skipped slots.
    pub topk_affinities: &'a Tensor,
}

impl<'a> PermuteInputs<'a> {
    /// The inputs by their specs ([`fwd::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![
            (&fwd::EXPERT_INDEX, self.expert_index),
            (&fwd::TOPK_AFFINITIES, self.topk_affinities),
        ]
    }

    /// The inputs `get` finds by spec; a missing one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            expert_index: spec::required(&get, &fwd::EXPERT_INDEX)?,
            topk_affinities: spec::required(&get, &fwd::TOPK_AFFINITIES)?,
        })
    }
}

/// Dimensions of a `permute` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PermuteDims {
    pub t: usize,
    pub k: usize,
    /// E, `num_experts`.
    pub e: usize,
    /// B, `block_size`.
    pub b: usize,
    /// N, the static block count.
    pub n: usize,
    /// The layout the plan is for.
    pub skip_dma: SkipMode,
}

impl PermuteDims {
    /// What a padding slot of `token_position_to_id` holds: T, or −1 with `skip_token`.
    pub fn padding_id(&self) -> i32 {
        // (T+1)·E fits in i32 (checked by `Permute::new`), so T does.
        self.skip_dma.padding_id(self.t) as i32
    }

    /// Rows of `expert_affinities_masked` `[rows·E, 1]`: T+1, or T with `skip_token`.
    pub fn rows(&self) -> usize {
        self.skip_dma.rows(self.t)
    }
}

/// A validated `permute` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct Permute<'a> {
    inputs: PermuteInputs<'a>,
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    dims: PermuteDims,
    output_dtype: OutputDType,
}

/// Requires `num_experts ≥ 1` with every masked-affinity index `t·E + e < (T+1)·E` in i32 range,
/// as the NKI kernels address them.
fn check_num_experts(num_experts: usize, t: usize) -> Result<()> {
    if num_experts == 0 {
        return Err(Error::param("num_experts", "must be at least 1, got 0"));
    }
    if (t + 1)
        .checked_mul(num_experts)
        .is_none_or(|len| i32::try_from(len).is_err())
    {
        return Err(Error::param(
            "num_experts",
            format!(
                "(T+1)·E = {}·{num_experts} masked affinities do not fit in i32 indices",
                t + 1
            ),
        ));
    }
    Ok(())
}

/// Checks `expert_index [T, K]` against `num_experts`: i32, T and K at least 1, ids in
/// `[0, E)` distinct per row or [`SKIP`], and every masked-affinity index within i32. Returns
/// `(T, K, the ids)`. (K may exceed E when a row skips slots, as on an expert-parallel
/// receiver.)
fn check_expert_index(expert_index: &Tensor, e: usize) -> Result<(usize, usize, &[i32])> {
    let (shape, ids) = validate::index_input(&fwd::EXPERT_INDEX, expert_index, &[None, None])?;
    let (t, k) = (shape[0], shape[1]);
    validate::non_empty(fwd::EXPERT_INDEX.name, "T (tokens)", t)?;
    validate::non_empty(fwd::EXPERT_INDEX.name, "K (top_k)", k)?;
    check_num_experts(e, t)?;
    validate::expert_ids_or_skip(fwd::EXPERT_INDEX.name, ids, &shape, e)?;
    Ok((t, k, ids))
}

impl<'a> Permute<'a> {
    /// Checks shapes, dtypes, ids and parameters.
    pub fn new(inputs: PermuteInputs<'a>, params: PermuteParams) -> Result<Self> {
        let (e, b) = (params.num_experts, params.block_size);
        if b == 0 {
            return Err(Error::param("block_size", "must be at least 1, got 0"));
        }
        let (t, k, ids) = check_expert_index(inputs.expert_index, e)?;
        validate::float_input(
            &fwd::TOPK_AFFINITIES,
            inputs.topk_affinities,
            &[Some(t), Some(k)],
        )?;
        if let Some(pair) = ids
            .iter()
            .enumerate()
            .position(|(pair, &id)| id == SKIP && inputs.topk_affinities.get_f64(pair) != Some(0.0))
        {
            return Err(Error::invalid(
                fwd::TOPK_AFFINITIES.name,
                format!(
                    "slot {} is skipped (expert_index -1) but has affinity {}; skipped slots \
                     must hold 0",
                    crate::tensor::position(&[t, k], pair),
                    inputs.topk_affinities.get_f64(pair).unwrap_or(f64::NAN)
                ),
            ));
        }
        let n = params.block_count(t, k)?;
        Ok(Self {
            inputs,
            expert_ids: ids,
            dims: PermuteDims {
                t,
                k,
                e,
                b,
                n,
                skip_dma: params.skip_dma,
            },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> PermuteInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values: ids in `[0, E)` or [`SKIP`].
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    pub fn dims(&self) -> PermuteDims {
        self.dims
    }
}

output_dtype_accessors!(Permute, PermuteOutputs);

/// Outputs of `permute`.
#[derive(Clone, Debug, PartialEq)]
pub struct PermuteOutputs {
    /// `[E]` i32.
    pub expert_counts: Tensor,
    /// `[N·B]` i32, T in padding slots (−1 with `skip_token`).
    pub token_position_to_id: Tensor,
    /// `[N, 1]` i32, E−1 for the unused blocks.
    pub block_to_expert: Tensor,
    /// `[(T+1)·E, 1]` in `topk_affinities`' dtype (`[T·E, 1]` with `skip_token`).
    pub expert_affinities_masked: Tensor,
    /// `[1]` i32.
    pub num_used_blocks: Tensor,
}

impl PermuteOutputs {
    /// The outputs by their specs ([`fwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&fwd::EXPERT_COUNTS, self.expert_counts),
            (&fwd::TOKEN_POSITION_TO_ID, self.token_position_to_id),
            (&fwd::BLOCK_TO_EXPERT, self.block_to_expert),
            (
                &fwd::EXPERT_AFFINITIES_MASKED,
                self.expert_affinities_masked,
            ),
            (&fwd::NUM_USED_BLOCKS, self.num_used_blocks),
        ]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            expert_counts: f(&fwd::EXPERT_COUNTS, self.expert_counts)?,
            token_position_to_id: f(&fwd::TOKEN_POSITION_TO_ID, self.token_position_to_id)?,
            block_to_expert: f(&fwd::BLOCK_TO_EXPERT, self.block_to_expert)?,
            expert_affinities_masked: f(
                &fwd::EXPERT_AFFINITIES_MASKED,
                self.expert_affinities_masked,
            )?,
            num_used_blocks: f(&fwd::NUM_USED_BLOCKS, self.num_used_blocks)?,
        })
    }
}

/// Inputs of [`PermuteBwd`]: maps an affinity gradient in the masked layout back to the
/// `[T, K]` layout the router consumes (the transpose of the scatter in `permute`).
#[derive(Clone, Copy, Debug)]
pub struct PermuteBwdInputs<'a> {
    /// `[T, K]` i32.
    pub expert_index: &'a Tensor,
    /// `[(T+1)·E]` or `[(T+1)·E, 1]` (`T·E` with `skip_token`).
    pub expert_affinities_masked_grad: &'a Tensor,
}

impl<'a> PermuteBwdInputs<'a> {
    /// The inputs by their specs ([`bwd::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![
            (&bwd::EXPERT_INDEX, self.expert_index),
            (
                &bwd::EXPERT_AFFINITIES_MASKED_GRAD,
                self.expert_affinities_masked_grad,
            ),
        ]
    }

    /// The inputs `get` finds by spec; a missing one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            expert_index: spec::required(&get, &bwd::EXPERT_INDEX)?,
            expert_affinities_masked_grad: spec::required(
                &get,
                &bwd::EXPERT_AFFINITIES_MASKED_GRAD,
            )?,
        })
    }
}

/// Parameters of [`PermuteBwd`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PermuteBwdParams {
    /// E, experts: fixes how `expert_affinities_masked_grad` is laid out.
    pub num_experts: usize,
    /// With `skip_token`, `expert_affinities_masked_grad` has no row T.
    pub skip_dma: SkipMode,
}

impl PermuteBwdParams {
    /// For the padded layout (no `skip_token`).
    pub fn new(num_experts: usize) -> Self {
        Self {
            num_experts,
            skip_dma: SkipMode::default(),
        }
    }
}

/// A validated `permute_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct PermuteBwd<'a> {
    inputs: PermuteBwdInputs<'a>,
    /// `expert_index`'s values.
    expert_ids: &'a [i32],
    /// T, K and E; B and N do not apply.
    dims: (usize, usize, usize),
    output_dtype: OutputDType,
}

impl<'a> PermuteBwd<'a> {
    /// Checks shapes, dtypes and ids.
    pub fn new(inputs: PermuteBwdInputs<'a>, params: PermuteBwdParams) -> Result<Self> {
        let e = params.num_experts;
        let (t, k, expert_ids) = check_expert_index(inputs.expert_index, e)?;
        validate::masked_affinities(
            bwd::EXPERT_AFFINITIES_MASKED_GRAD.name,
            inputs.expert_affinities_masked_grad,
            params.skip_dma.rows(t) * e,
            params.skip_dma,
        )?;
        Ok(Self {
            inputs,
            expert_ids,
            dims: (t, k, e),
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> PermuteBwdInputs<'a> {
        self.inputs
    }

    /// `expert_index`'s values: ids in `[0, E)` or [`SKIP`].
    pub fn expert_ids(&self) -> &'a [i32] {
        self.expert_ids
    }

    /// `(T, K, E)`.
    pub fn dims(&self) -> (usize, usize, usize) {
        self.dims
    }
}

output_dtype_accessors!(PermuteBwd, PermuteGrads);

/// Gradient produced by `permute_bwd`.
#[derive(Clone, Debug, PartialEq)]
pub struct PermuteGrads {
    /// `[T, K]` in the gradient's dtype.
    pub d_topk_affinities: Tensor,
}

impl PermuteGrads {
    /// The gradient by its spec ([`bwd::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![(&bwd::D_TOPK_AFFINITIES, self.d_topk_affinities)]
    }

    /// The gradient through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            d_topk_affinities: f(&bwd::D_TOPK_AFFINITIES, self.d_topk_affinities)?,
        })
    }
}
