//! `blockwise_mm`: nki-library's MoE context-encoding kernel (`moe_cte`: blockwise expert
//! matmul with a fused gated activation), and its backward (`blockwise_mm_bwd`), with their
//! tensor names, shapes and parameters.
//!
//! For each block `n` of B slots, expert `e = block_to_expert[n]` and each slot holding token
//! `t = token_position_to_id[n·B + j]` (padding slots hold T, the zero row):
//! ```text
//! gate = clamp(x_t · W[e, :, 0, :] + gate_and_up_proj_bias[e, 0])     [I]
//! up   = clamp(x_t · W[e, :, 1, :] + gate_and_up_proj_bias[e, 1])     [I]
//! y    = (act(gate) ⊙ up) · D[e] + down_proj_bias[e]                  [H]
//! output[t] += expert_affinities_masked[t·E + e] · y                 POST_SCALE (the default)
//! ```
//! so without biases and clamps `output [T+1, H]` holds
//! `Σ_e a[t, e] · down_e(act(x_t W_gate_e) ⊙ x_t W_up_e)` in row t and zeros in the padding row
//! T. `act` is `activation_function` (nki-library's `ActFnType`: SiLU by default, GELU,
//! GELU_Tanh_Approx, Swish, ReLU, SquaredReLU; the backward takes it as `activation_type`).
//! `expert_affinities_scaling_mode` (nki-library's `ExpertAffinityScaleMode`) moves the
//! affinity: POST_SCALE as above, NO_SCALE drops it, PRE_SCALE and PRE_SCALE_DELAYED multiply
//! `x_t` by it before the gate/up projection instead.
//!
//! The biases and the clamp limits are optional. With a bias or a clamp that moves 0, a padding
//! slot has an expert output too (the zero row's), as in nki-library's kernels: it lands in row
//! T of `output` unless POST_SCALE multiplies it by row T's zero affinity.
//!
//! With `checkpoint_activation` the kernel also returns `gate_up_activations_T [N, 2, I, B]`
//! (gate and up as above: after the biases and clamps, as nki-library's reference writes them)
//! and the down projection before affinity scaling `down_activations [N, B, H]` (padding slots
//! hold the zero row's values), which the backward takes as `gate_up_proj_act_checkpoint_T` and
//! `down_proj_act_checkpoint` instead of recomputing them. The backward's
//! `output_hidden_states_grad` and `hidden_states_grad` are `[T+1, H]` like the forward's
//! `output` and `hidden_states`, with zero padding rows; with `bias` it also returns the
//! biases' gradients.
//!
//! nki-library's `skip_dma` ([`SkipMode`]) `skip_token` drops the padding row: `hidden_states
//! [T, H]`, padding slots −1, and `expert_affinities_masked`, `output`,
//! `output_hidden_states_grad` and the gradients shaped like them without row T.
//! `is_tensor_update_accumulating` false stores each slot's row of `output` instead of adding
//! it: a token with two slots is then an error, and row T holds the last padding slot's output.
//!
//! Plan rules checked on every call (see [`super::plan`]): token ids in `[0, T)` or the padding
//! id (T, or −1 with `skip_token`), expert ids in `[0, E)`, no (token, expert) pair twice, every
//! non-zero affinity of a real token covered by the plan, and the padding row T of
//! `hidden_states` and of `expert_affinities_masked`, where they have one, all zeros.
//!
//! Error bound (reference backend): every output, checkpoint and gradient is computed in f64
//! from the inputs (bf16 widened exactly) and rounded once to f32 (0.5 ulp of the f64 result).
//! The backward reads the f32 checkpoints, so its gradients match the exact f64 ones to about
//! 1e-6 relative.

use std::fmt;

use super::spec::{self, Named, TensorSpec};
use super::tensors::{blockwise_mm as fwd, blockwise_mm_bwd as bwd};
use super::{BlockPlan, ComputeDType, OutputDType, SKIP, validate};
use crate::error::{Error, Result, find_named};
use crate::tensor::{DType, Floats, Tensor};

/// The activation of the gate projection, which then multiplies the up projection:
/// nki-library's `ActFnType`, spelled as its members.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActFnType {
    /// `SiLU`: `g · σ(g)` (SwiGLU; Qwen3, Mixtral, DeepSeek). nki-library's default.
    #[default]
    Silu,
    /// `GELU`: `g · Φ(g) = ½ g (1 + erf(g / √2))`.
    Gelu,
    /// `GELU_Tanh_Approx`: `½ g (1 + tanh(√(2/π) (g + 0.044715 g³)))`.
    GeluTanhApprox,
    /// `Swish`: `g · σ(1.702 g)`, the sigmoid approximation of GELU.
    Swish,
    /// `ReLU`: `max(g, 0)`.
    Relu,
    /// `SquaredReLU`: `max(g, 0)²`.
    SquaredRelu,
}

impl ActFnType {
    /// Every member, in nki-library's order.
    pub const ALL: [ActFnType; 6] = [
        Self::Silu,
        Self::Gelu,
        Self::GeluTanhApprox,
        Self::Swish,
        Self::Relu,
        Self::SquaredRelu,
    ];

    /// The member's name in nki-library.
    pub fn name(self) -> &'static str {
        match self {
            Self::Silu => "SiLU",
            Self::Gelu => "GELU",
            Self::GeluTanhApprox => "GELU_Tanh_Approx",
            Self::Swish => "Swish",
            Self::Relu => "ReLU",
            Self::SquaredRelu => "SquaredReLU",
        }
    }

    /// Parses a member name for parameter `param`.
    pub fn parse(param: &str, name: &str) -> Result<Self> {
        find_named(&Self::ALL, Self::name, name).map_err(|known| {
            Error::param(
                param,
                format!("expected one of {known} (ActFnType), got `{name}`"),
            )
        })
    }
}

impl fmt::Display for ActFnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the affinity multiplies: nki-library's `ExpertAffinityScaleMode`, spelled as its
/// members.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertAffinityScaleMode {
    /// `NO_SCALE`: the expert outputs are summed unweighted.
    NoScale,
    /// `POST_SCALE`: each expert's down projection is multiplied by the affinity (`moe_cte`'s
    /// default).
    #[default]
    PostScale,
    /// `PRE_SCALE`: each gathered token row is multiplied by the affinity before the gate/up
    /// projection.
    PreScale,
    /// `PRE_SCALE_DELAYED`: PRE_SCALE's result, the multiplication scheduled later on chip.
    PreScaleDelayed,
}

impl ExpertAffinityScaleMode {
    /// Every member, in nki-library's order.
    pub const ALL: [ExpertAffinityScaleMode; 4] = [
        Self::NoScale,
        Self::PostScale,
        Self::PreScale,
        Self::PreScaleDelayed,
    ];

    /// The member's name in nki-library.
    pub fn name(self) -> &'static str {
        match self {
            Self::NoScale => "NO_SCALE",
            Self::PostScale => "POST_SCALE",
            Self::PreScale => "PRE_SCALE",
            Self::PreScaleDelayed => "PRE_SCALE_DELAYED",
        }
    }

    /// Parses a member name for parameter `param`.
    pub fn parse(param: &str, name: &str) -> Result<Self> {
        find_named(&Self::ALL, Self::name, name).map_err(|known| {
            Error::param(
                param,
                format!("expected one of {known} (ExpertAffinityScaleMode), got `{name}`"),
            )
        })
    }

    /// Whether the token rows are multiplied by the affinity before the gate/up projection.
    pub fn scales_rows(self) -> bool {
        matches!(self, Self::PreScale | Self::PreScaleDelayed)
    }

    /// Whether the down projection is multiplied by the affinity.
    pub fn scales_outputs(self) -> bool {
        self == Self::PostScale
    }
}

impl fmt::Display for ExpertAffinityScaleMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether the token rows carry the padding row: nki-library's `SkipMode.skip_token` (its
/// other field, `skip_weight`, only skips reloading weights already on chip and changes no
/// result).
///
/// Without it (the default) `hidden_states` is `[T+1, H]` whose row T is the zero padding
/// token, padding slots of `token_position_to_id` hold T, and `expert_affinities_masked`,
/// `output`, `output_hidden_states_grad` and the gradients shaped like them have a row T. With
/// it, `hidden_states` is `[T, H]`, padding slots hold −1 (a row of zeros the kernel never
/// reads) and every one of those tensors has T rows: what the padding slots would add to row T
/// is dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkipMode {
    pub skip_token: bool,
}

impl SkipMode {
    /// The padding id of `token_position_to_id` for T tokens: T, or −1 with `skip_token`.
    pub fn padding_id(self, t: usize) -> i64 {
        if self.skip_token { -1 } else { t as i64 }
    }

    /// The rows of `hidden_states` and of the tensors shaped like it, for T tokens.
    pub fn rows(self, t: usize) -> usize {
        if self.skip_token { t } else { t + 1 }
    }
}

/// moekit's own: how each expert's two weight matrices lie in memory. The gradients come back
/// in their weights' layout; the biases and everything else are the same in both.
///
/// `nki` (the default) is nki-library's: `gate_up_proj_weight [E, H, 2, I]` and
/// `down_proj_weight [E, I, H]`, each matrix `[in, out]`. `linear` is `torch.nn.Linear`'s
/// `[out, in]`: `gate_up_proj_weight [E, 2, I, H]` and `down_proj_weight [E, H, I]`, the layout
/// Hugging Face transformers keeps its experts in (`gate_up_proj [E, 2·I, H]`, gate rows first,
/// and `down_proj [E, H, I]`) and torchtitan its `w2 [E, D, F]`, so such weights are read where
/// they lie rather than rearranged for every call. Under `linear` the gate and up projections
/// may also come apart (moekit's own `up_proj_weight`): torchtitan's `w1` and `w3 [E, F, D]`
/// as `gate_up_proj_weight [E, I, H]` and `up_proj_weight [E, I, H]`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLayout {
    /// `nki`: `[E, H, 2, I]` and `[E, I, H]`.
    #[default]
    Nki,
    /// `linear`: `[E, 2, I, H]` and `[E, H, I]`.
    Linear,
}

impl WeightLayout {
    /// Every member.
    pub const ALL: [WeightLayout; 2] = [Self::Nki, Self::Linear];

    /// The parameter's name.
    pub const PARAM: &'static str = "weight_layout";

    /// The member's name, as the parameter takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Nki => "nki",
            Self::Linear => "linear",
        }
    }

    /// Parses a member name.
    pub fn parse(name: &str) -> Result<Self> {
        find_named(&Self::ALL, Self::name, name).map_err(|known| {
            Error::param(
                Self::PARAM,
                format!("expected one of {known}, got `{name}`"),
            )
        })
    }

    /// The layout of `gate_up_proj_weight` (and of its gradient).
    pub fn gate_up_shape(self) -> &'static str {
        match self {
            Self::Nki => "[E, H, 2, I]",
            Self::Linear => "[E, 2, I, H]",
        }
    }

    /// The layout of `down_proj_weight` (and of its gradient).
    pub fn down_shape(self) -> &'static str {
        match self {
            Self::Nki => "[E, I, H]",
            Self::Linear => "[E, H, I]",
        }
    }

    /// `gate_up_proj_weight`'s extents for E experts of hidden size H and intermediate size I.
    pub fn gate_up_dims(self, e: usize, h: usize, i: usize) -> [usize; 4] {
        match self {
            Self::Nki => [e, h, 2, i],
            Self::Linear => [e, 2, i, h],
        }
    }

    /// `down_proj_weight`'s extents for E experts of hidden size H and intermediate size I.
    pub fn down_dims(self, e: usize, h: usize, i: usize) -> [usize; 3] {
        match self {
            Self::Nki => [e, i, h],
            Self::Linear => [e, h, i],
        }
    }

    /// `(E, I)` of a `gate_up_proj_weight` of extents `dims` in this layout.
    fn experts_and_intermediate(self, dims: &[usize]) -> (usize, usize) {
        match self {
            Self::Nki => (dims[0], dims[3]),
            Self::Linear => (dims[0], dims[2]),
        }
    }

    /// The offset in `gate_up_proj_weight` of expert `expert`'s weight from hidden unit `j` to
    /// column `col` of projection `which` (0 gate, 1 up), for H = `h` and I = `i`.
    pub fn gate_up_offset(
        self,
        (h, i): (usize, usize),
        expert: usize,
        j: usize,
        which: usize,
        col: usize,
    ) -> usize {
        match self {
            Self::Nki => ((expert * h + j) * 2 + which) * i + col,
            Self::Linear => ((expert * 2 + which) * i + col) * h + j,
        }
    }

    /// The offset in `down_proj_weight` of expert `expert`'s weight from intermediate unit
    /// `row` to hidden unit `j`, for H = `h` and I = `i`.
    pub fn down_offset(self, (h, i): (usize, usize), expert: usize, row: usize, j: usize) -> usize {
        match self {
            Self::Nki => (expert * i + row) * h + j,
            Self::Linear => (expert * h + j) * i + row,
        }
    }
}

impl fmt::Display for WeightLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parameters of [`BlockwiseMm`], named as nki-library's `moe_cte` names them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockwiseMmParams {
    /// Also return `gate_up_activations_T` and `down_activations` (default false).
    pub checkpoint_activation: bool,
    /// The gate's activation (default SiLU).
    pub activation_function: ActFnType,
    /// Where the affinity multiplies (default POST_SCALE).
    pub expert_affinities_scaling_mode: ExpertAffinityScaleMode,
    /// The gate and up projections' clamps (default none).
    pub clamp: ClampLimits,
    /// `skip_dma` (default: neither field).
    pub skip_dma: SkipMode,
    /// Whether the blocks' results are added into `output` (the default) or stored, which
    /// gives the sum only when no token has two slots (top-k = 1): without it, a token with
    /// two slots is an error.
    pub is_tensor_update_accumulating: bool,
    /// moekit's own: the weights' layout (default `nki`).
    pub weight_layout: WeightLayout,
    /// The matmul operands' dtype; `None`, the default, is `hidden_states`' dtype.
    pub compute_dtype: Option<ComputeDType>,
}

impl Default for BlockwiseMmParams {
    fn default() -> Self {
        Self {
            checkpoint_activation: false,
            activation_function: ActFnType::default(),
            expert_affinities_scaling_mode: ExpertAffinityScaleMode::default(),
            clamp: ClampLimits::default(),
            skip_dma: SkipMode::default(),
            is_tensor_update_accumulating: true,
            weight_layout: WeightLayout::default(),
            compute_dtype: None,
        }
    }
}

impl BlockwiseMmParams {
    /// The parameters of this forward's backward: its activation, scaling, clamps, layout and
    /// compute dtype carry over (`bias`: also return the biases' gradients).
    pub fn backward(&self, bias: bool) -> BlockwiseMmBwdParams {
        BlockwiseMmBwdParams {
            activation_type: self.activation_function,
            expert_affinities_scaling_mode: self.expert_affinities_scaling_mode,
            clamp: self.clamp,
            bias,
            skip_dma: self.skip_dma,
            is_tensor_update_accumulating: self.is_tensor_update_accumulating,
            weight_layout: self.weight_layout,
            compute_dtype: self.compute_dtype,
        }
    }
}

/// Parameters of [`BlockwiseMmBwd`], named as nki-library's `blockwise_mm_bwd` names them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockwiseMmBwdParams {
    /// The forward's `activation_function` (default SiLU).
    pub activation_type: ActFnType,
    /// The forward's scaling mode (default POST_SCALE). moekit's own: nki-library's backward
    /// scales after the down projection only (`affinity_option`).
    pub expert_affinities_scaling_mode: ExpertAffinityScaleMode,
    /// The forward's clamps (nki-library's `clamp_limits`).
    pub clamp: ClampLimits,
    /// Also return the biases' gradients (nki-library's `bias`).
    pub bias: bool,
    /// The forward's `skip_dma` (default: neither field).
    pub skip_dma: SkipMode,
    /// As the forward's, for `hidden_states_grad` (default true).
    pub is_tensor_update_accumulating: bool,
    /// moekit's own: the forward's weight layout, which the weight gradients take too
    /// (default `nki`).
    pub weight_layout: WeightLayout,
    /// The matmul operands' dtype; `None`, the default, is `hidden_states`' dtype.
    pub compute_dtype: Option<ComputeDType>,
}

impl Default for BlockwiseMmBwdParams {
    fn default() -> Self {
        Self {
            activation_type: ActFnType::default(),
            expert_affinities_scaling_mode: ExpertAffinityScaleMode::default(),
            clamp: ClampLimits::default(),
            bias: false,
            skip_dma: SkipMode::default(),
            is_tensor_update_accumulating: true,
            weight_layout: WeightLayout::default(),
            compute_dtype: None,
        }
    }
}

/// Inputs of [`BlockwiseMm`]. Floating-point tensors may be f32 or bf16.
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseMmInputs<'a> {
    /// `[T+1, H]`; row T is the all-zero padding token (`[T, H]` with `skip_token`).
    pub hidden_states: &'a Tensor,
    /// `[(T+1)·E]` or `[(T+1)·E, 1]`, from `permute` (T·E with `skip_token`).
    pub expert_affinities_masked: &'a Tensor,
    /// `[E, H, 2, I]`; index 0 of the third axis is the gate projection, 1 the up projection
    /// (`[E, 2, I, H]` with [`WeightLayout::Linear`]; the gate projection's `[E, I, H]` alone
    /// with `up_proj_weight`).
    pub gate_up_proj_weight: &'a Tensor,
    /// `[E, I, H]` (`[E, H, I]` with [`WeightLayout::Linear`]).
    pub down_proj_weight: &'a Tensor,
    /// `[N·B]` i32, T in padding slots (−1 with `skip_token`), from `permute` (see
    /// [`super::plan`]).
    pub token_position_to_id: &'a Tensor,
    /// `[N, 1]` (or `[N]`) i32, from `permute`.
    pub block_to_expert: &'a Tensor,
    /// `[E, 2, I]` (0 gate, 1 up), added to the gate/up projection before the clamps.
    pub gate_and_up_proj_bias: Option<&'a Tensor>,
    /// `[E, H]`, added to the down projection before the affinity scaling.
    pub down_proj_bias: Option<&'a Tensor>,
    /// moekit's own, with [`WeightLayout::Linear`] only: the up projection's `[E, I, H]` apart
    /// from the gate's (then `gate_up_proj_weight`), in the gate's dtype.
    pub up_proj_weight: Option<&'a Tensor>,
}

impl<'a> BlockwiseMmInputs<'a> {
    /// The inputs by their specs ([`fwd::INPUTS`]), absent biases left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&fwd::HIDDEN_STATES, self.hidden_states),
            (
                &fwd::EXPERT_AFFINITIES_MASKED,
                self.expert_affinities_masked,
            ),
            (&fwd::GATE_UP_PROJ_WEIGHT, self.gate_up_proj_weight),
            (&fwd::DOWN_PROJ_WEIGHT, self.down_proj_weight),
            (&fwd::TOKEN_POSITION_TO_ID, self.token_position_to_id),
            (&fwd::BLOCK_TO_EXPERT, self.block_to_expert),
        ];
        named.extend(
            self.gate_and_up_proj_bias
                .map(|bias| (&fwd::GATE_AND_UP_PROJ_BIAS, bias)),
        );
        named.extend(self.down_proj_bias.map(|bias| (&fwd::DOWN_PROJ_BIAS, bias)));
        named.extend(self.up_proj_weight.map(|up| (&fwd::UP_PROJ_WEIGHT, up)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            hidden_states: required(&fwd::HIDDEN_STATES)?,
            expert_affinities_masked: required(&fwd::EXPERT_AFFINITIES_MASKED)?,
            gate_up_proj_weight: required(&fwd::GATE_UP_PROJ_WEIGHT)?,
            down_proj_weight: required(&fwd::DOWN_PROJ_WEIGHT)?,
            token_position_to_id: required(&fwd::TOKEN_POSITION_TO_ID)?,
            block_to_expert: required(&fwd::BLOCK_TO_EXPERT)?,
            gate_and_up_proj_bias: get(&fwd::GATE_AND_UP_PROJ_BIAS),
            down_proj_bias: get(&fwd::DOWN_PROJ_BIAS),
            up_proj_weight: get(&fwd::UP_PROJ_WEIGHT),
        })
    }

    /// Whether a padding slot (the zero row T) has a non-zero expert output: with a bias or a
    /// clamp that moves 0, nki-library's kernels (and moekit's) compute it as for any row.
    pub fn padding_has_outputs(&self, clamp: ClampLimits) -> bool {
        self.gate_and_up_proj_bias.is_some()
            || self.down_proj_bias.is_some()
            || clamp.gate.moves_zero()
            || clamp.up.moves_zero()
    }
}

/// The limits a projection's values are clamped to (either may be absent).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Clamp {
    pub lower: Option<f32>,
    pub upper: Option<f32>,
}

impl Clamp {
    /// `v` clamped to the limits.
    pub fn apply(self, v: f64) -> f64 {
        let v = self.lower.map_or(v, |lo| v.max(f64::from(lo)));
        self.upper.map_or(v, |hi| v.min(f64::from(hi)))
    }

    /// The derivative of [`Clamp::apply`] at a clamped value `v`: 1 strictly inside the limits,
    /// 0 at (or past) one, as nki-library's backward masks it.
    pub fn passes(self, v: f64) -> bool {
        self.lower.is_none_or(|lo| v > f64::from(lo))
            && self.upper.is_none_or(|hi| v < f64::from(hi))
    }

    /// Whether clamping moves 0.
    fn moves_zero(self) -> bool {
        self.apply(0.0) != 0.0
    }

    /// Checks the limits: finite, and the lower not above the upper.
    fn check(self, lower: &str, upper: &str) -> Result<()> {
        for (name, limit) in [(lower, self.lower), (upper, self.upper)] {
            if let Some(v) = limit.filter(|v| !v.is_finite()) {
                return Err(Error::param(name, format!("must be finite, got {v}")));
            }
        }
        if let (Some(lo), Some(hi)) = (self.lower, self.upper)
            && lo > hi
        {
            return Err(Error::param(
                lower,
                format!("is {lo}, above {upper} = {hi}"),
            ));
        }
        Ok(())
    }
}

/// nki-library's four clamp limits: `gate_clamp_{lower,upper}_limit` and
/// `up_clamp_{lower,upper}_limit` in `moe_cte`, `non_linear_clamp_*` (gate) and
/// `linear_clamp_*` (up) in `blockwise_mm_bwd`'s `clamp_limits`. Applied after the biases; the
/// checkpoint holds the clamped values.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClampLimits {
    pub gate: Clamp,
    pub up: Clamp,
}

impl ClampLimits {
    /// Checks the four limits (finite, each lower not above its upper), naming them as
    /// `moe_cte` and `moe_tkg` do.
    pub(crate) fn check(self) -> Result<()> {
        self.gate
            .check("gate_clamp_lower_limit", "gate_clamp_upper_limit")?;
        self.up
            .check("up_clamp_lower_limit", "up_clamp_upper_limit")
    }
}

/// Dimensions shared by the forward and backward calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockwiseDims {
    /// T, real tokens.
    pub t: usize,
    /// Rows of `hidden_states` and the tensors shaped like it: T+1, or T with `skip_token`
    /// ([`SkipMode`]).
    pub rows: usize,
    pub h: usize,
    pub e: usize,
    /// I, expert intermediate size.
    pub i: usize,
    /// B, block size, inferred as `len(token_position_to_id) / N`.
    pub b: usize,
    /// N, blocks.
    pub n: usize,
}

impl BlockwiseDims {
    /// Whether row T is the padding row (not with `skip_token`).
    pub fn has_padding_row(&self) -> bool {
        self.rows > self.t
    }
}

/// A validated `blockwise_mm` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseMm<'a> {
    inputs: BlockwiseMmInputs<'a>,
    floats: BlockwiseFloats<'a>,
    params: BlockwiseMmParams,
    dims: BlockwiseDims,
    plan: BlockPlan<'a>,
    output_dtype: OutputDType,
}

impl<'a> BlockwiseMm<'a> {
    /// Checks shapes, dtypes, finiteness and the plan rules in the module docs.
    pub fn new(inputs: BlockwiseMmInputs<'a>, params: BlockwiseMmParams) -> Result<Self> {
        let (dims, plan, _) = check(
            &inputs,
            (params.skip_dma, params.weight_layout),
            params.is_tensor_update_accumulating,
        )?;
        params.clamp.check()?;
        Ok(Self {
            floats: BlockwiseFloats::new(&inputs)?,
            inputs,
            params,
            dims,
            plan,
            output_dtype: OutputDType::default(),
        })
    }

    /// The call [`Self::new`] accepted with these inputs and parameters (and found `dims`),
    /// formed again without checking its tensors again: the caller kept them unaltered since.
    pub(crate) fn rebuilt(
        inputs: BlockwiseMmInputs<'a>,
        params: BlockwiseMmParams,
        dims: BlockwiseDims,
    ) -> Result<Self> {
        Ok(Self {
            floats: BlockwiseFloats::new(&inputs)?,
            plan: BlockPlan::rebuilt(
                inputs.token_position_to_id,
                inputs.block_to_expert,
                dims.t,
                params.skip_dma,
            ),
            inputs,
            params,
            dims,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> BlockwiseMmInputs<'a> {
        self.inputs
    }

    /// The float inputs as stored.
    pub fn floats(&self) -> BlockwiseFloats<'a> {
        self.floats
    }

    pub fn params(&self) -> BlockwiseMmParams {
        self.params
    }

    /// The dtype of the matmul operands ([`ComputeDType`]): bf16 or f32.
    pub fn compute_dtype(&self) -> DType {
        ComputeDType::resolve(self.params.compute_dtype, self.floats.hidden_states.dtype())
    }

    pub fn dims(&self) -> BlockwiseDims {
        self.dims
    }

    /// The validated block plan.
    pub fn plan(&self) -> BlockPlan<'a> {
        self.plan
    }
}

output_dtype_accessors!(BlockwiseMm, BlockwiseMmOutputs);

/// The float inputs of a validated blockwise call, as stored (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseFloats<'a> {
    /// `[T+1, H]` (`[T, H]` with `skip_token`).
    pub hidden_states: Floats<'a>,
    /// `[(T+1)·E]` (`[T·E]` with `skip_token`).
    pub expert_affinities_masked: Floats<'a>,
    /// `[E, H, 2, I]` (`[E, 2, I, H]` with [`WeightLayout::Linear`]; the gate's `[E, I, H]`
    /// with `up_proj_weight`).
    pub gate_up_proj_weight: Floats<'a>,
    /// `[E, I, H]` (`[E, H, I]` with [`WeightLayout::Linear`]).
    pub down_proj_weight: Floats<'a>,
    /// moekit's own: the up projection's `[E, I, H]`, apart from the gate's, in its dtype.
    pub up_proj_weight: Option<Floats<'a>>,
    /// `[E, 2, I]`.
    pub gate_and_up_proj_bias: Option<Floats<'a>>,
    /// `[E, H]`.
    pub down_proj_bias: Option<Floats<'a>>,
}

impl<'a> BlockwiseFloats<'a> {
    fn new(inputs: &BlockwiseMmInputs<'a>) -> Result<Self> {
        let floats = |spec: &TensorSpec, tensor| validate::floats(spec.name, tensor);
        Ok(Self {
            hidden_states: floats(&fwd::HIDDEN_STATES, inputs.hidden_states)?,
            expert_affinities_masked: floats(
                &fwd::EXPERT_AFFINITIES_MASKED,
                inputs.expert_affinities_masked,
            )?,
            gate_up_proj_weight: floats(&fwd::GATE_UP_PROJ_WEIGHT, inputs.gate_up_proj_weight)?,
            down_proj_weight: floats(&fwd::DOWN_PROJ_WEIGHT, inputs.down_proj_weight)?,
            gate_and_up_proj_bias: inputs
                .gate_and_up_proj_bias
                .map(|bias| floats(&fwd::GATE_AND_UP_PROJ_BIAS, bias))
                .transpose()?,
            down_proj_bias: inputs
                .down_proj_bias
                .map(|bias| floats(&fwd::DOWN_PROJ_BIAS, bias))
                .transpose()?,
            up_proj_weight: inputs
                .up_proj_weight
                .map(|up| floats(&fwd::UP_PROJ_WEIGHT, up))
                .transpose()?,
        })
    }
}

/// Validates the forward inputs for `skip_dma` and the weights' `layout`, and with
/// `accumulating` false that no token has two slots; returns the dimensions, the plan and which
/// (token, expert) pairs the plan covers (`[T·E]`, token-major).
fn check<'a>(
    inputs: &BlockwiseMmInputs<'a>,
    (skip_dma, layout): (SkipMode, WeightLayout),
    accumulating: bool,
) -> Result<(BlockwiseDims, BlockPlan<'a>, Vec<bool>)> {
    let hs = validate::float_input(&fwd::HIDDEN_STATES, inputs.hidden_states, &[None, None])?;
    let (rows, h) = (hs[0], hs[1]);
    let least = skip_dma.rows(1);
    if rows < least {
        let layout = if skip_dma.skip_token {
            "T ≥ 1 rows (skip_token: no padding row)"
        } else {
            "T+1 ≥ 2 rows (at least one token plus the padding row)"
        };
        return Err(Error::invalid(
            fwd::HIDDEN_STATES.name,
            format!("needs {layout}, got {rows}"),
        ));
    }
    validate::non_empty(fwd::HIDDEN_STATES.name, "H (hidden size)", h)?;
    let t = if skip_dma.skip_token { rows } else { rows - 1 };
    let (e, i) = check_gate_up(inputs, layout, h)?;
    validate::non_empty(fwd::GATE_UP_PROJ_WEIGHT.name, "E (experts)", e)?;
    validate::non_empty(fwd::GATE_UP_PROJ_WEIGHT.name, "I (intermediate size)", i)?;
    validate::float_tensor(
        fwd::DOWN_PROJ_WEIGHT.name,
        inputs.down_proj_weight,
        layout.down_shape(),
        &layout.down_dims(e, h, i).map(Some),
    )?;
    validate::masked_affinities(
        fwd::EXPERT_AFFINITIES_MASKED.name,
        inputs.expert_affinities_masked,
        rows * e,
        skip_dma,
    )?;
    if let Some(bias) = inputs.gate_and_up_proj_bias {
        validate::float_input(
            &fwd::GATE_AND_UP_PROJ_BIAS,
            bias,
            &[Some(e), Some(2), Some(i)],
        )?;
    }
    if let Some(bias) = inputs.down_proj_bias {
        validate::float_input(&fwd::DOWN_PROJ_BIAS, bias, &[Some(e), Some(h)])?;
    }
    let (plan, covered) = BlockPlan::new(
        inputs.token_position_to_id,
        inputs.block_to_expert,
        (t, e),
        skip_dma,
    )?;
    if !accumulating {
        check_single_slots(&covered, e)?;
    }
    let dims = BlockwiseDims {
        t,
        rows,
        h,
        e,
        i,
        b: plan.block_size(),
        n: plan.blocks(),
    };
    check_padding_row(inputs, dims)?;
    if let Some(pair) = (0..t * e).find(|&pair| {
        !covered[pair]
            && inputs
                .expert_affinities_masked
                .get_f64(pair)
                .is_some_and(|a| a != 0.0)
    }) {
        return Err(Error::invalid(
            fwd::EXPERT_AFFINITIES_MASKED.name,
            format!(
                "token {} has a non-zero affinity for expert {} but no slot in the block plan",
                pair / e,
                pair % e
            ),
        ));
    }
    Ok((dims, plan, covered))
}

/// E and I of the gate and up projections' weights in `layout` for hidden size `h`: from
/// `gate_up_proj_weight`, or with `up_proj_weight` (linear layout only) from the gate's
/// `[E, I, H]` and the up's, alike in shape and dtype.
fn check_gate_up(
    inputs: &BlockwiseMmInputs<'_>,
    layout: WeightLayout,
    h: usize,
) -> Result<(usize, usize)> {
    let gate_up = inputs.gate_up_proj_weight;
    let Some(up) = inputs.up_proj_weight else {
        let extents = match layout {
            WeightLayout::Nki => [None, Some(h), Some(2), None],
            WeightLayout::Linear => [None, Some(2), None, Some(h)],
        };
        let gu = validate::float_tensor(
            fwd::GATE_UP_PROJ_WEIGHT.name,
            gate_up,
            layout.gate_up_shape(),
            &extents,
        )?;
        return Ok(layout.experts_and_intermediate(&gu));
    };
    if layout != WeightLayout::Linear {
        return Err(Error::invalid(
            fwd::UP_PROJ_WEIGHT.name,
            format!(
                "takes weight_layout `{}` (the gate and up projections as `[E, I, H]` each), \
                 got `{layout}`",
                WeightLayout::Linear
            ),
        ));
    }
    let gate = validate::float_tensor(
        fwd::GATE_UP_PROJ_WEIGHT.name,
        gate_up,
        "[E, I, H] (the gate projection's, with up_proj_weight)",
        &[None, None, Some(h)],
    )?;
    validate::float_tensor(
        fwd::UP_PROJ_WEIGHT.name,
        up,
        fwd::UP_PROJ_WEIGHT.shape,
        &gate.iter().map(|&extent| Some(extent)).collect::<Vec<_>>(),
    )?;
    if up.dtype() != gate_up.dtype() {
        return Err(Error::DType {
            tensor: fwd::UP_PROJ_WEIGHT.name.to_owned(),
            expected: format!("{} (gate_up_proj_weight's)", gate_up.dtype()),
            actual: up.dtype(),
        });
    }
    Ok((gate[0], gate[1]))
}

/// With `is_tensor_update_accumulating` false a block stores its rows of `output` rather than
/// adding them, which gives the sum only when every token has at most one slot.
fn check_single_slots(covered: &[bool], e: usize) -> Result<()> {
    for (token, pairs) in covered.chunks(e).enumerate() {
        let mut experts = (0..e).filter(|&expert| pairs[expert]);
        if let (Some(first), Some(second)) = (experts.next(), experts.next()) {
            return Err(Error::param(
                "is_tensor_update_accumulating",
                format!(
                    "is false, which stores each block's rows instead of adding them, but token \
                     {token} has slots for experts {first} and {second} (top-k > 1 needs true)"
                ),
            ));
        }
    }
    Ok(())
}

fn check_padding_row(inputs: &BlockwiseMmInputs<'_>, dims: BlockwiseDims) -> Result<()> {
    if !dims.has_padding_row() {
        return Ok(());
    }
    let BlockwiseDims { t, h, e, .. } = dims;
    validate::zero_padding_row(fwd::HIDDEN_STATES.name, inputs.hidden_states, t, h)?;
    validate::zero_padding_row(
        fwd::EXPERT_AFFINITIES_MASKED.name,
        inputs.expert_affinities_masked,
        t,
        e,
    )
}

/// Outputs of `blockwise_mm`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockwiseMmOutputs {
    /// `[T+1, H]` in `hidden_states`' dtype, as nki-library's kernels write it: row t the token's
    /// combined expert outputs, row T what the padding slots add (zero under POST_SCALE, whose
    /// affinity there is 0). `[T, H]` with `skip_token`.
    pub output: Tensor,
    /// `[N, 2, I, B]` gate/up projections (with their biases, clamped) before the activation,
    /// in `gate_up_proj_weight`'s dtype, when checkpointing.
    pub gate_up_activations_t: Option<Tensor>,
    /// `[N, B, H]` down projection before affinity scaling, in `down_proj_weight`'s dtype, when
    /// checkpointing.
    pub down_activations: Option<Tensor>,
}

impl BlockwiseMmOutputs {
    /// The outputs by their specs ([`fwd::OUTPUTS`]), absent checkpoints left out.
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        let mut named = vec![(&fwd::OUTPUT, self.output)];
        named.extend(
            self.gate_up_activations_t
                .map(|t| (&fwd::GATE_UP_ACTIVATIONS_T, t)),
        );
        named.extend(self.down_activations.map(|t| (&fwd::DOWN_ACTIVATIONS, t)));
        named
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            output: f(&fwd::OUTPUT, self.output)?,
            gate_up_activations_t: self
                .gate_up_activations_t
                .map(|t| f(&fwd::GATE_UP_ACTIVATIONS_T, t))
                .transpose()?,
            down_activations: self
                .down_activations
                .map(|t| f(&fwd::DOWN_ACTIVATIONS, t))
                .transpose()?,
        })
    }
}

/// Inputs of [`BlockwiseMmBwd`]: the forward's inputs, its checkpoints and the output
/// gradient, named as nki-library's `blockwise_mm_bwd` names them.
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseMmBwdInputs<'a> {
    pub forward: BlockwiseMmInputs<'a>,
    /// `gate_up_proj_act_checkpoint_T [N, 2, I, B]`: the forward's `gate_up_activations_T`.
    pub gate_up_proj_act_checkpoint_t: &'a Tensor,
    /// `[N, B, H]`: the forward's `down_activations`.
    pub down_proj_act_checkpoint: &'a Tensor,
    /// `[T+1, H]`, the gradient of the forward's `output`; row T (the padding row) zero.
    /// `[T, H]` with `skip_token`.
    pub output_hidden_states_grad: &'a Tensor,
    /// `[T, K]` i32 (ids or [`SKIP`]); when given, the affinity gradient is also
    /// returned as `d_topk_affinities` (0 in skipped slots).
    pub expert_index: Option<&'a Tensor>,
}

/// What [`BlockwiseMmBwd`] adds to its forward's inputs (for [`BlockwiseMmBwd::of_forward`]):
/// the checkpoints, the output gradient and, optionally, `expert_index`, as in
/// [`BlockwiseMmBwdInputs`].
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseMmBwdAdded<'a> {
    /// `[N, 2, I, B]`: the forward's `gate_up_activations_T`.
    pub gate_up_proj_act_checkpoint_t: &'a Tensor,
    /// `[N, B, H]`: the forward's `down_activations`.
    pub down_proj_act_checkpoint: &'a Tensor,
    /// `[T+1, H]` (`[T, H]` with `skip_token`), the gradient of the forward's `output`.
    pub output_hidden_states_grad: &'a Tensor,
    /// `[T, K]` i32 (ids or [`SKIP`]).
    pub expert_index: Option<&'a Tensor>,
}

impl<'a> BlockwiseMmBwdInputs<'a> {
    /// The inputs by their specs ([`bwd::INPUTS`]), absent optional ones left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = self.forward.named();
        named.extend([
            (
                &bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T,
                self.gate_up_proj_act_checkpoint_t,
            ),
            (
                &bwd::DOWN_PROJ_ACT_CHECKPOINT,
                self.down_proj_act_checkpoint,
            ),
            (
                &bwd::OUTPUT_HIDDEN_STATES_GRAD,
                self.output_hidden_states_grad,
            ),
        ]);
        named.extend(self.expert_index.map(|index| (&bwd::EXPERT_INDEX, index)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        let required = |spec| spec::required(&get, spec);
        Ok(Self {
            forward: BlockwiseMmInputs::from_named(&get)?,
            gate_up_proj_act_checkpoint_t: required(&bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T)?,
            down_proj_act_checkpoint: required(&bwd::DOWN_PROJ_ACT_CHECKPOINT)?,
            output_hidden_states_grad: required(&bwd::OUTPUT_HIDDEN_STATES_GRAD)?,
            expert_index: get(&bwd::EXPERT_INDEX),
        })
    }
}

/// The float inputs of a validated `blockwise_mm_bwd` call, as stored (f32 or bf16).
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseBwdFloats<'a> {
    pub forward: BlockwiseFloats<'a>,
    /// `[N, 2, I, B]`.
    pub gate_up_proj_act_checkpoint_t: Floats<'a>,
    /// `[N, B, H]`.
    pub down_proj_act_checkpoint: Floats<'a>,
    /// `[T+1, H]` (`[T, H]` with `skip_token`).
    pub output_hidden_states_grad: Floats<'a>,
}

/// A validated `blockwise_mm_bwd` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct BlockwiseMmBwd<'a> {
    inputs: BlockwiseMmBwdInputs<'a>,
    floats: BlockwiseBwdFloats<'a>,
    /// `expert_index`'s values and K, when given.
    expert_ids: Option<(&'a [i32], usize)>,
    params: BlockwiseMmBwdParams,
    dims: BlockwiseDims,
    plan: BlockPlan<'a>,
    output_dtype: OutputDType,
}

/// Whether a backward's checkpoints are checked in full, or are its forward's own outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Checkpoints {
    Checked,
    Trusted,
}

impl<'a> BlockwiseMmBwd<'a> {
    /// Checks everything [`BlockwiseMm::new`] checks, plus the checkpoints and gradients.
    pub fn new(inputs: BlockwiseMmBwdInputs<'a>, params: BlockwiseMmBwdParams) -> Result<Self> {
        let (dims, plan, covered) = check(
            &inputs.forward,
            (params.skip_dma, params.weight_layout),
            params.is_tensor_update_accumulating,
        )?;
        params.clamp.check()?;
        let forward = BlockwiseFloats::new(&inputs.forward)?;
        Self::with_forward_checked(
            inputs,
            params,
            (dims, plan, forward),
            Checkpoints::Checked,
            || covered,
        )
    }

    /// moekit's own: the backward of the validated call `forward`, which checks only the
    /// tensors the backward adds (the checkpoints, the output gradient and `expert_index`):
    /// the forward's tensors and plan were checked when it was made, and its parameters carry
    /// over (`bias`: also return the biases' gradients).
    pub fn of_forward(
        forward: &BlockwiseMm<'a>,
        added: BlockwiseMmBwdAdded<'a>,
        bias: bool,
    ) -> Result<Self> {
        Self::of_forward_checking(forward, added, bias, Checkpoints::Checked)
    }

    fn of_forward_checking(
        forward: &BlockwiseMm<'a>,
        added: BlockwiseMmBwdAdded<'a>,
        bias: bool,
        checkpoints: Checkpoints,
    ) -> Result<Self> {
        let params = forward.params().backward(bias);
        let inputs = BlockwiseMmBwdInputs {
            forward: forward.inputs(),
            gate_up_proj_act_checkpoint_t: added.gate_up_proj_act_checkpoint_t,
            down_proj_act_checkpoint: added.down_proj_act_checkpoint,
            output_hidden_states_grad: added.output_hidden_states_grad,
            expert_index: added.expert_index,
        };
        let (dims, plan) = (forward.dims(), forward.plan());
        let covered = || plan.covered(dims.e);
        Self::with_forward_checked(
            inputs,
            params,
            (dims, plan, forward.floats()),
            checkpoints,
            covered,
        )
    }

    /// [`Self::of_forward`] whose checkpoints are `forward`'s own outputs, kept unaltered since
    /// (moekit's experts composition): their shapes and dtypes are checked, their values, which
    /// the backend computed from checked inputs, are not scanned again.
    pub(crate) fn of_own_forward(
        forward: &BlockwiseMm<'a>,
        added: BlockwiseMmBwdAdded<'a>,
        bias: bool,
    ) -> Result<Self> {
        let BlockwiseDims { h, i, b, n, .. } = forward.dims();
        validate::float_tensor_shape(
            bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T.name,
            added.gate_up_proj_act_checkpoint_t,
            bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T.shape,
            &[Some(n), Some(2), Some(i), Some(b)],
        )?;
        validate::float_tensor_shape(
            bwd::DOWN_PROJ_ACT_CHECKPOINT.name,
            added.down_proj_act_checkpoint,
            bwd::DOWN_PROJ_ACT_CHECKPOINT.shape,
            &[Some(n), Some(b), Some(h)],
        )?;
        Self::of_forward_checking(forward, added, bias, Checkpoints::Trusted)
    }

    /// Checks what the backward adds to a checked forward (its dims, plan and floats;
    /// `covered`: the (token, expert) pairs of its plan, needed only with `expert_index`).
    fn with_forward_checked(
        inputs: BlockwiseMmBwdInputs<'a>,
        params: BlockwiseMmBwdParams,
        (dims, plan, forward): (BlockwiseDims, BlockPlan<'a>, BlockwiseFloats<'a>),
        checkpoints: Checkpoints,
        covered: impl FnOnce() -> Vec<bool>,
    ) -> Result<Self> {
        let BlockwiseDims {
            t, h, e, i, b, n, ..
        } = dims;
        if checkpoints == Checkpoints::Checked {
            validate::float_input(
                &bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T,
                inputs.gate_up_proj_act_checkpoint_t,
                &[Some(n), Some(2), Some(i), Some(b)],
            )?;
            validate::float_input(
                &bwd::DOWN_PROJ_ACT_CHECKPOINT,
                inputs.down_proj_act_checkpoint,
                &[Some(n), Some(b), Some(h)],
            )?;
        }
        validate::float_input(
            &bwd::OUTPUT_HIDDEN_STATES_GRAD,
            inputs.output_hidden_states_grad,
            &[Some(dims.rows), Some(h)],
        )?;
        if dims.has_padding_row() {
            validate::zero_padding_row(
                bwd::OUTPUT_HIDDEN_STATES_GRAD.name,
                inputs.output_hidden_states_grad,
                t,
                h,
            )?;
        }
        let mut expert_ids = None;
        if let Some(index) = inputs.expert_index {
            let (shape, ids) = validate::index_input(&bwd::EXPERT_INDEX, index, &[Some(t), None])?;
            expert_ids = Some((ids, shape[1]));
            validate::non_empty(bwd::EXPERT_INDEX.name, "K (top_k)", shape[1])?;
            validate::expert_ids_or_skip(bwd::EXPERT_INDEX.name, ids, &shape, e)?;
            let k = shape[1];
            let covered = covered();
            if let Some(pair) = ids
                .iter()
                .enumerate()
                .position(|(pair, &id)| id != SKIP && !covered[(pair / k) * e + id as usize])
            {
                return Err(Error::invalid(
                    bwd::EXPERT_INDEX.name,
                    format!(
                        "token {} chose expert {}, but the block plan has no slot for that pair",
                        pair / k,
                        ids[pair]
                    ),
                ));
            }
        }
        let floats = BlockwiseBwdFloats {
            forward,
            gate_up_proj_act_checkpoint_t: validate::floats(
                bwd::GATE_UP_PROJ_ACT_CHECKPOINT_T.name,
                inputs.gate_up_proj_act_checkpoint_t,
            )?,
            down_proj_act_checkpoint: validate::floats(
                bwd::DOWN_PROJ_ACT_CHECKPOINT.name,
                inputs.down_proj_act_checkpoint,
            )?,
            output_hidden_states_grad: validate::floats(
                bwd::OUTPUT_HIDDEN_STATES_GRAD.name,
                inputs.output_hidden_states_grad,
            )?,
        };
        Ok(Self {
            inputs,
            floats,
            expert_ids,
            params,
            dims,
            plan,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> BlockwiseMmBwdInputs<'a> {
        self.inputs
    }

    /// The float inputs as stored.
    pub fn floats(&self) -> BlockwiseBwdFloats<'a> {
        self.floats
    }

    /// `expert_index`'s values (ids in `[0, E)` or [`SKIP`]) and K, when given.
    pub fn expert_ids(&self) -> Option<(&'a [i32], usize)> {
        self.expert_ids
    }

    pub fn params(&self) -> BlockwiseMmBwdParams {
        self.params
    }

    /// The dtype of the matmul operands ([`ComputeDType`]): bf16 or f32.
    pub fn compute_dtype(&self) -> DType {
        ComputeDType::resolve(
            self.params.compute_dtype,
            self.floats.forward.hidden_states.dtype(),
        )
    }

    pub fn dims(&self) -> BlockwiseDims {
        self.dims
    }

    /// The validated block plan.
    pub fn plan(&self) -> BlockPlan<'a> {
        self.plan
    }
}

output_dtype_accessors!(BlockwiseMmBwd, BlockwiseMmGrads);

/// Gradients produced by `blockwise_mm_bwd`, shaped like the inputs they belong to.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockwiseMmGrads {
    /// `[T+1, H]` in `hidden_states`' dtype; row T (the padding row) zero. `[T, H]` with
    /// `skip_token`.
    pub hidden_states_grad: Tensor,
    /// `[(T+1)·E, 1]` in the affinities' dtype; zero outside the plan's (token, expert) pairs
    /// and in row T. `[T·E, 1]` with `skip_token`.
    pub expert_affinities_masked_grad: Tensor,
    /// `[E, H, 2, I]` in the weight's dtype (`[E, 2, I, H]` with [`WeightLayout::Linear`],
    /// with or without `up_proj_weight`).
    pub gate_up_proj_weight_grad: Tensor,
    /// `[E, I, H]` in the weight's dtype.
    pub down_proj_weight_grad: Tensor,
    /// `[T, K]` in the affinities' dtype, when `expert_index` was given (same mapping as `permute_bwd`).
    pub d_topk_affinities: Option<Tensor>,
    /// `[E, 2, I]` in `gate_up_proj_weight`'s dtype, with `bias`.
    pub gate_and_up_proj_bias_grad: Option<Tensor>,
    /// `[E, H]` in `down_proj_weight`'s dtype, with `bias`.
    pub down_proj_bias_grad: Option<Tensor>,
}

impl BlockwiseMmGrads {
    /// The gradients by their specs ([`bwd::OUTPUTS`]), absent optional ones left out.
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        let mut named = vec![
            (&bwd::HIDDEN_STATES_GRAD, self.hidden_states_grad),
            (
                &bwd::EXPERT_AFFINITIES_MASKED_GRAD,
                self.expert_affinities_masked_grad,
            ),
            (
                &bwd::GATE_UP_PROJ_WEIGHT_GRAD,
                self.gate_up_proj_weight_grad,
            ),
            (&bwd::DOWN_PROJ_WEIGHT_GRAD, self.down_proj_weight_grad),
        ];
        named.extend(self.d_topk_affinities.map(|t| (&bwd::D_TOPK_AFFINITIES, t)));
        named.extend(
            self.gate_and_up_proj_bias_grad
                .map(|t| (&bwd::GATE_AND_UP_PROJ_BIAS_GRAD, t)),
        );
        named.extend(
            self.down_proj_bias_grad
                .map(|t| (&bwd::DOWN_PROJ_BIAS_GRAD, t)),
        );
        named
    }

    /// Every gradient through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        let mut optional = |spec, t: Option<Tensor>| t.map(|t| f(spec, t)).transpose();
        Ok(Self {
            d_topk_affinities: optional(&bwd::D_TOPK_AFFINITIES, self.d_topk_affinities)?,
            gate_and_up_proj_bias_grad: optional(
                &bwd::GATE_AND_UP_PROJ_BIAS_GRAD,
                self.gate_and_up_proj_bias_grad,
            )?,
            down_proj_bias_grad: optional(&bwd::DOWN_PROJ_BIAS_GRAD, self.down_proj_bias_grad)?,
            hidden_states_grad: f(&bwd::HIDDEN_STATES_GRAD, self.hidden_states_grad)?,
            expert_affinities_masked_grad: f(
                &bwd::EXPERT_AFFINITIES_MASKED_GRAD,
                self.expert_affinities_masked_grad,
            )?,
            gate_up_proj_weight_grad: f(
                &bwd::GATE_UP_PROJ_WEIGHT_GRAD,
                self.gate_up_proj_weight_grad,
            )?,
            down_proj_weight_grad: f(&bwd::DOWN_PROJ_WEIGHT_GRAD, self.down_proj_weight_grad)?,
        })
    }
}
