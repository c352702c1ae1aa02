//! `moe_tkg`: nki-library's decode-time (token generation) MoE experts, with its tensor names,
//! shapes and parameters.
//!
//! Each of the E_L experts held here (`expert_gate_up_weights [E_L, H, 2, I]`, 0 gate, 1 up, and
//! `expert_down_weights [E_L, I, H]`) maps a token row `x [H]` to
//! ```text
//! gate   = clamp_gate(x · W[e, :, 0, :] + expert_gate_up_bias[e, 0])     [I]
//! up     = clamp_up(x · W[e, :, 1, :] + expert_gate_up_bias[e, 1])       [I]
//! f_e(x) = (act(gate) ⊙ up) · D[e] + expert_down_bias[e]                 [H]
//! ```
//! (`act` is `activation_fn`, nki-library's `ActFnType`, SiLU by default; the clamps come after
//! the biases, the gate's before the activation). `output [T, H]` sums each token's experts:
//!
//! - **selective** (`is_all_expert = false`): `output[t] = Σ_k α[t, k] · f_{e(t,k)}(x_t)` with
//!   `e(t, k) = expert_index[t, k]`, an index into the weights held here (so ids lie in
//!   `[0, E_L)`; a repeated id counts each time). α is 1 under NO_SCALE (the default), and under
//!   POST_SCALE `expert_affinities[t, e(t, k)]`, or `expert_affinities_eager[t, k]` where that
//!   `[T, K]` tensor is given (as nki-library's MX selective path reads it).
//! - **all-expert** (`is_all_expert = true`): every token through every expert held here,
//!   `output[t] = Σ_j β[t, j] · f_j(x_t)` over `j < E_L`. β is 1 under NO_SCALE; under
//!   POST_SCALE this rank holds global experts `[r·E_L, (r+1)·E_L)` for `r = rank_id[0, 0]`
//!   (required then), and `β[t, j] = expert_affinities[t, r·E_L + j]`, multiplied with
//!   `mask_unselected_experts` by how many times `r·E_L + j` appears in `expert_index[t]` (0 for
//!   an expert the token did not select). `expert_affinities_eager` is refused in this mode.
//!
//! PRE_SCALE and PRE_SCALE_DELAYED are refused, with nki-library's reasons. nki-library's
//! device limits (T ≤ 128 but for its MX all-expert kernel, K ≤ 16 in selective mode, H a
//! multiple of 128, of 256 where its two cores split H) bound its compiled kernels, not the
//! host backends, which run any size.
//!
//! Checked on every call: shapes and dtypes, finite floats, expert ids in `[0, E_L)`
//! (selective) or `[0, E)` (all-expert), the clamp limits, and, where it is read (all-expert
//! POST_SCALE), `rank_id` within the `E / E_L` ranks (other modes ignore its value, as
//! nki-library's kernel does).
//!
//! Error bound (reference backend): computed in f64 from the inputs (bf16 widened exactly),
//! rounded once to f32. nki-library's kernel rounds `act(gate) ⊙ up`, each expert's output and
//! the running sum to the input dtype on the way; its tests allow `1e-5 + 2e-2 · max |ref|`.

use super::spec::{self, Named, TensorSpec};
use super::tensors::moe_tkg as tkg;
use super::{ActFnType, ClampLimits, ExpertAffinityScaleMode, OutputDType, validate};
use crate::error::{Error, Result};
use crate::tensor::{Floats, Tensor};

/// Inputs of [`MoeTkg`], named as nki-library's `moe_tkg` names them. Floating-point tensors
/// may be f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct MoeTkgInputs<'a> {
    /// `[T, H]`, the tokens of this decoding step.
    pub hidden_input: &'a Tensor,
    /// `[E_L, H, 2, I]`; index 0 of the third axis is the gate projection, 1 the up projection.
    pub expert_gate_up_weights: &'a Tensor,
    /// `[E_L, I, H]`.
    pub expert_down_weights: &'a Tensor,
    /// `[T, E]`, non-zero at each token's selected experts (the router's affinities).
    pub expert_affinities: &'a Tensor,
    /// `[T, K]` i32: each token's experts (indices into the weights held here in selective
    /// mode, global ids in all-expert mode).
    pub expert_index: &'a Tensor,
    /// `[1, 1]` i32: this rank's expert-parallel index, for all-expert POST_SCALE.
    pub rank_id: Option<&'a Tensor>,
    /// `[E_L, 2, I]` (0 gate, 1 up), added before the clamps.
    pub expert_gate_up_bias: Option<&'a Tensor>,
    /// `[E_L, H]`, added to the down projection before the affinity scaling.
    pub expert_down_bias: Option<&'a Tensor>,
    /// `[T, K]`: selective POST_SCALE's affinities in `expert_index`'s order.
    pub expert_affinities_eager: Option<&'a Tensor>,
}

impl<'a> MoeTkgInputs<'a> {
    /// The inputs by their specs ([`tkg::INPUTS`]), absent optional ones left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&tkg::HIDDEN_INPUT, self.hidden_input),
            (&tkg::EXPERT_GATE_UP_WEIGHTS, self.expert_gate_up_weights),
            (&tkg::EXPERT_DOWN_WEIGHTS, self.expert_down_weights),
            (&tkg::EXPERT_AFFINITIES, self.expert_affinities),
            (&tkg::EXPERT_INDEX, self.expert_index),
        ];
        let optional = [
            (&tkg::RANK_ID, self.rank_id),
            (&tkg::EXPERT_GATE_UP_BIAS, self.expert_gate_up_bias),
            (&tkg::EXPERT_DOWN_BIAS, self.expert_down_bias),
            (&tkg::EXPERT_AFFINITIES_EAGER, self.expert_affinities_eager),
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
            hidden_input: required(&tkg::HIDDEN_INPUT)?,
            expert_gate_up_weights: required(&tkg::EXPERT_GATE_UP_WEIGHTS)?,
            expert_down_weights: required(&tkg::EXPERT_DOWN_WEIGHTS)?,
            expert_affinities: required(&tkg::EXPERT_AFFINITIES)?,
            expert_index: required(&tkg::EXPERT_INDEX)?,
            rank_id: get(&tkg::RANK_ID),
            expert_gate_up_bias: get(&tkg::EXPERT_GATE_UP_BIAS),
            expert_down_bias: get(&tkg::EXPERT_DOWN_BIAS),
            expert_affinities_eager: get(&tkg::EXPERT_AFFINITIES_EAGER),
        })
    }
}

/// `moe_tkg`'s parameters, nki-library's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeTkgParams {
    /// Every expert held here for every token (true), or each token's K (false). Required.
    pub is_all_expert: bool,
    /// NO_SCALE (`moe_tkg`'s default) or POST_SCALE.
    pub expert_affinities_scaling_mode: ExpertAffinityScaleMode,
    /// The gate's activation (`activation_fn`).
    pub activation_fn: ActFnType,
    /// `gate_clamp_*_limit`, `up_clamp_*_limit`.
    pub clamp: ClampLimits,
    /// All-expert POST_SCALE: weight each expert by how many times the token selected it.
    pub mask_unselected_experts: bool,
}

impl MoeTkgParams {
    /// `moe_tkg`'s default `expert_affinities_scaling_mode` (the context-encoding kernel's is
    /// POST_SCALE).
    pub const DEFAULT_SCALING_MODE: ExpertAffinityScaleMode = ExpertAffinityScaleMode::NoScale;

    /// The mode `is_all_expert` chooses, every other parameter at nki-library's default.
    pub fn new(is_all_expert: bool) -> Self {
        Self {
            is_all_expert,
            expert_affinities_scaling_mode: Self::DEFAULT_SCALING_MODE,
            activation_fn: ActFnType::default(),
            clamp: ClampLimits::default(),
            mask_unselected_experts: false,
        }
    }

    /// Whether the expert outputs are multiplied by affinities (POST_SCALE).
    pub fn scales(&self) -> bool {
        self.expert_affinities_scaling_mode == ExpertAffinityScaleMode::PostScale
    }
}

/// The sizes a `moe_tkg` call's tensors agree on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeTkgDims {
    /// T, tokens.
    pub t: usize,
    pub h: usize,
    /// E, experts over all ranks (`expert_affinities`' columns).
    pub e: usize,
    /// E_L, experts held here (the weights' first axis).
    pub e_local: usize,
    pub k: usize,
    /// I, expert intermediate size.
    pub i: usize,
}

/// The float inputs of a validated `moe_tkg` call, as stored (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct MoeTkgFloats<'a> {
    /// `[T, H]`.
    pub hidden_input: Floats<'a>,
    /// `[E_L, H, 2, I]`.
    pub expert_gate_up_weights: Floats<'a>,
    /// `[E_L, I, H]`.
    pub expert_down_weights: Floats<'a>,
    /// `[E_L, 2, I]`.
    pub expert_gate_up_bias: Option<Floats<'a>>,
    /// `[E_L, H]`.
    pub expert_down_bias: Option<Floats<'a>>,
}

/// Which expert each token goes through and with what weight: the two modes resolved into one
/// list per token, in the order the kernels sum them (moekit's own).
#[derive(Clone, Debug, PartialEq)]
pub struct TkgRouting {
    /// Routes per token: K (selective) or E_L (all-expert).
    pub per_token: usize,
    /// `[T, per_token]`: the local expert of each route.
    pub experts: Vec<usize>,
    /// `[T, per_token]`: the weight of each route's output (1 under NO_SCALE; 0 for an
    /// all-expert route a token does not take under POST_SCALE).
    pub weights: Vec<f64>,
}

/// A validated `moe_tkg` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Debug)]
pub struct MoeTkg<'a> {
    inputs: MoeTkgInputs<'a>,
    floats: MoeTkgFloats<'a>,
    params: MoeTkgParams,
    dims: MoeTkgDims,
    routing: TkgRouting,
    output_dtype: OutputDType,
}

impl<'a> MoeTkg<'a> {
    /// Checks shapes, dtypes, finiteness, expert ids, `rank_id` and the parameters (see the
    /// module docs).
    pub fn new(inputs: MoeTkgInputs<'a>, params: MoeTkgParams) -> Result<Self> {
        Self::checked(inputs, params, Scan::Values)
    }

    /// [`MoeTkg::new`] for a caller that has checked the experts' weights and biases for
    /// non-finite values itself (`moe_block_tkg`, whose every call would otherwise scan all
    /// E_L experts' weights twice); their shapes and dtypes are still checked.
    pub(crate) fn with_scanned_experts(
        inputs: MoeTkgInputs<'a>,
        params: MoeTkgParams,
    ) -> Result<Self> {
        Self::checked(inputs, params, Scan::ShapesOnly)
    }

    fn checked(inputs: MoeTkgInputs<'a>, params: MoeTkgParams, scan: Scan) -> Result<Self> {
        check_params(&params, &inputs)?;
        let dims = check_shapes(&inputs, scan)?;
        let routing = routing(&inputs, &params, dims)?;
        let floats = |spec: &TensorSpec, tensor| validate::floats(spec.name, tensor);
        let optional = |spec: &TensorSpec, tensor: Option<&'a Tensor>| {
            tensor.map(|t| validate::floats(spec.name, t)).transpose()
        };
        Ok(Self {
            floats: MoeTkgFloats {
                hidden_input: floats(&tkg::HIDDEN_INPUT, inputs.hidden_input)?,
                expert_gate_up_weights: floats(
                    &tkg::EXPERT_GATE_UP_WEIGHTS,
                    inputs.expert_gate_up_weights,
                )?,
                expert_down_weights: floats(&tkg::EXPERT_DOWN_WEIGHTS, inputs.expert_down_weights)?,
                expert_gate_up_bias: optional(
                    &tkg::EXPERT_GATE_UP_BIAS,
                    inputs.expert_gate_up_bias,
                )?,
                expert_down_bias: optional(&tkg::EXPERT_DOWN_BIAS, inputs.expert_down_bias)?,
            },
            inputs,
            params,
            dims,
            routing,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> MoeTkgInputs<'a> {
        self.inputs
    }

    /// The float inputs as stored.
    pub fn floats(&self) -> MoeTkgFloats<'a> {
        self.floats
    }

    pub fn params(&self) -> MoeTkgParams {
        self.params
    }

    pub fn dims(&self) -> MoeTkgDims {
        self.dims
    }

    /// Each token's experts and their weights, in summation order.
    pub fn routing(&self) -> &TkgRouting {
        &self.routing
    }
}

output_dtype_accessors!(MoeTkg, MoeTkgOutputs);

/// The parameters, and the inputs each mode requires or refuses.
fn check_params(params: &MoeTkgParams, inputs: &MoeTkgInputs<'_>) -> Result<()> {
    check_scaling_and_clamps(params)?;
    if params.is_all_expert {
        if inputs.expert_affinities_eager.is_some() {
            return Err(Error::invalid(
                tkg::EXPERT_AFFINITIES_EAGER.name,
                "eager affinities are not supported with is_all_expert=true",
            ));
        }
        if params.scales() && inputs.rank_id.is_none() {
            return Err(Error::invalid(
                tkg::RANK_ID.name,
                "required for all-expert mode with affinity scaling (POST_SCALE), but not given",
            ));
        }
    }
    Ok(())
}

/// The scaling mode (NO_SCALE or POST_SCALE) and the clamp limits.
pub(crate) fn check_scaling_and_clamps(params: &MoeTkgParams) -> Result<()> {
    const SCALING: &str = "expert_affinities_scaling_mode";
    match params.expert_affinities_scaling_mode {
        ExpertAffinityScaleMode::PreScale => {
            return Err(Error::param(
                SCALING,
                "PRE_SCALE: moe_tkg does not support pre-scale mode",
            ));
        }
        ExpertAffinityScaleMode::PreScaleDelayed => {
            return Err(Error::param(
                SCALING,
                "PRE_SCALE_DELAYED applies to the context-encoding experts (blockwise_mm) only",
            ));
        }
        ExpertAffinityScaleMode::NoScale | ExpertAffinityScaleMode::PostScale => {}
    }
    params.clamp.check()
}

/// Whether the experts' tensors are scanned for non-finite values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scan {
    Values,
    ShapesOnly,
}

/// The experts' weights and biases, as `moe_tkg` and `moe_block_tkg` both take them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertTensors<'a> {
    /// `[E_L, H, 2, I]`.
    pub gate_up: &'a Tensor,
    /// `[E_L, I, H]`.
    pub down: &'a Tensor,
    /// `[E_L, 2, I]`.
    pub gate_up_bias: Option<&'a Tensor>,
    /// `[E_L, H]`.
    pub down_bias: Option<&'a Tensor>,
}

/// Checks the experts' tensors for hidden size `h` (their values too with [`Scan::Values`]);
/// returns `(E_L, I)`.
pub(crate) fn check_experts(
    experts: ExpertTensors<'_>,
    h: usize,
    scan: Scan,
) -> Result<(usize, usize)> {
    let check = |spec: &TensorSpec, tensor: &Tensor, dims: &[Option<usize>]| match scan {
        Scan::Values => validate::float_input(spec, tensor, dims),
        Scan::ShapesOnly => validate::float_tensor_shape(spec.name, tensor, spec.shape, dims),
    };
    let gate_up = check(
        &tkg::EXPERT_GATE_UP_WEIGHTS,
        experts.gate_up,
        &[None, Some(h), Some(2), None],
    )?;
    let (e_local, i) = (gate_up[0], gate_up[3]);
    validate::non_empty(tkg::EXPERT_GATE_UP_WEIGHTS.name, "E_L (experts)", e_local)?;
    validate::non_empty(tkg::EXPERT_GATE_UP_WEIGHTS.name, "I (intermediate size)", i)?;
    check(
        &tkg::EXPERT_DOWN_WEIGHTS,
        experts.down,
        &[Some(e_local), Some(i), Some(h)],
    )?;
    if let Some(bias) = experts.gate_up_bias {
        check(
            &tkg::EXPERT_GATE_UP_BIAS,
            bias,
            &[Some(e_local), Some(2), Some(i)],
        )?;
    }
    if let Some(bias) = experts.down_bias {
        check(&tkg::EXPERT_DOWN_BIAS, bias, &[Some(e_local), Some(h)])?;
    }
    Ok((e_local, i))
}

/// Validates every tensor's shape, dtype and values (the experts' values as `scan` says);
/// returns the sizes.
fn check_shapes(inputs: &MoeTkgInputs<'_>, scan: Scan) -> Result<MoeTkgDims> {
    let x = validate::float_input(&tkg::HIDDEN_INPUT, inputs.hidden_input, &[None, None])?;
    let (t, h) = (x[0], x[1]);
    validate::non_empty(tkg::HIDDEN_INPUT.name, "T (tokens)", t)?;
    validate::non_empty(tkg::HIDDEN_INPUT.name, "H (hidden size)", h)?;
    let (e_local, i) = check_experts(
        ExpertTensors {
            gate_up: inputs.expert_gate_up_weights,
            down: inputs.expert_down_weights,
            gate_up_bias: inputs.expert_gate_up_bias,
            down_bias: inputs.expert_down_bias,
        },
        h,
        scan,
    )?;
    let affinities = validate::float_input(
        &tkg::EXPERT_AFFINITIES,
        inputs.expert_affinities,
        &[Some(t), None],
    )?;
    let e = affinities[1];
    if e < e_local {
        return Err(Error::shape(
            tkg::EXPERT_AFFINITIES.name,
            format!("[T, E] = [{t}, E] with E ≥ E_L = {e_local} (the experts held here)"),
            inputs.expert_affinities.shape(),
        ));
    }
    let (index, _) =
        validate::index_input(&tkg::EXPERT_INDEX, inputs.expert_index, &[Some(t), None])?;
    validate::non_empty(tkg::EXPERT_INDEX.name, "K (experts per token)", index[1])?;
    let k = index[1];
    if let Some(rank_id) = inputs.rank_id {
        validate::index_input(&tkg::RANK_ID, rank_id, &[Some(1), Some(1)])?;
    }
    if let Some(eager) = inputs.expert_affinities_eager {
        validate::float_input(&tkg::EXPERT_AFFINITIES_EAGER, eager, &[Some(t), Some(k)])?;
    }
    Ok(MoeTkgDims {
        t,
        h,
        e,
        e_local,
        k,
        i,
    })
}

/// Resolves the mode into [`TkgRouting`], checking the ids and `rank_id` it reads.
fn routing(
    inputs: &MoeTkgInputs<'_>,
    params: &MoeTkgParams,
    dims: MoeTkgDims,
) -> Result<TkgRouting> {
    let MoeTkgDims {
        t, e, e_local, k, ..
    } = dims;
    let ids = inputs.expert_index.as_i32().expect("dtype checked");
    let affinity = |t: usize, e: usize| {
        inputs
            .expert_affinities
            .get_f64(t * dims.e + e)
            .expect("shape checked")
    };
    if !params.is_all_expert {
        validate::repeatable_expert_ids(
            tkg::EXPERT_INDEX.name,
            ids,
            &[t, k],
            (e_local, "selective mode: the E_L experts held here"),
        )?;
        let experts: Vec<usize> = ids.iter().map(|&id| id as usize).collect();
        let weights = match (params.scales(), inputs.expert_affinities_eager) {
            (false, _) => vec![1.0; t * k],
            (true, Some(eager)) => eager.to_f64_vec(),
            (true, None) => (0..t * k)
                .map(|slot| affinity(slot / k, experts[slot]))
                .collect(),
        };
        return Ok(TkgRouting {
            per_token: k,
            experts,
            weights,
        });
    }
    validate::repeatable_expert_ids(
        tkg::EXPERT_INDEX.name,
        ids,
        &[t, k],
        (e, "all-expert mode: global ids"),
    )?;
    let experts = (0..t).flat_map(|_| 0..e_local).collect();
    if !params.scales() {
        return Ok(TkgRouting {
            per_token: e_local,
            experts,
            weights: vec![1.0; t * e_local],
        });
    }
    let rank_id = inputs.rank_id.expect("checked by check_params");
    let rank = rank_id.as_i32().expect("dtype checked")[0];
    let ranks = e / e_local;
    let Some(rank) = usize::try_from(rank).ok().filter(|&r| r < ranks) else {
        return Err(Error::invalid(
            tkg::RANK_ID.name,
            format!(
                "rank {rank} holds no experts: E = {e} experts over E_L = {e_local} per rank \
                 make {ranks} rank(s)"
            ),
        ));
    };
    let first = rank * e_local;
    let weights = (0..t)
        .flat_map(|token| (0..e_local).map(move |j| (token, j)))
        .map(|(token, j)| {
            let global = first + j;
            let scale = if params.mask_unselected_experts {
                let row = &ids[token * k..(token + 1) * k];
                row.iter().filter(|&&id| id as usize == global).count() as f64
            } else {
                1.0
            };
            affinity(token, global) * scale
        })
        .collect();
    Ok(TkgRouting {
        per_token: e_local,
        experts,
        weights,
    })
}

/// Outputs of `moe_tkg`.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeTkgOutputs {
    /// `[T, H]` in `hidden_input`'s dtype (or f32 with `output_dtype=float32`).
    pub output: Tensor,
}

impl MoeTkgOutputs {
    /// The outputs by their specs ([`tkg::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![(&tkg::OUTPUT, self.output)]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            output: f(&tkg::OUTPUT, self.output)?,
        })
    }
}
