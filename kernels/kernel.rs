//! The kernel catalog: every kernel's tensor contract as data (what `moekit list` prints), the
//! parameters they take ([`Params`], settable by name). Running a kernel by name on named
//! tensors is [`Kernel::run`].

use std::str::FromStr;

use crate::contracts::{
    ActFnType, BlockwiseMmBwdParams, BlockwiseMmParams, ClampLimits, ComputeDType,
    ExpertAffinityScaleMode, INDEX_DTYPE, IndexedFlattenParams, MoeBlockTkgParams, MoeTkgParams,
    OutputDType, PermuteParams, QuantizationType, RmsNormRouterParams, RmsNormRouterTopkTkgParams,
    RouterActFnType, RouterMmDType, RouterPipeline, SkipMode, TensorSpec, TopkMethod, TopkParams,
    TopkReduceParams, WeightLayout, XHbmLayout, tensors,
};
use crate::error::{Error, Result, find_named};

/// A kernel's contract: what `moekit list` prints.
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    pub name: &'static str,
    pub summary: &'static str,
    pub inputs: &'static [TensorSpec],
    pub outputs: &'static [TensorSpec],
    /// The parameters it takes, each required or at its default ([`Param::default_value`]).
    pub params: &'static [(Param, ParamUse)],
}

/// Whether a kernel requires a parameter or takes its default when it is not given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamUse {
    Required,
    Defaulted,
}

/// Every kernel contract, forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    RouterTopk,
    RouterTopkBwd,
    LoadBalancingLoss,
    LoadBalancingLossBwd,
    Permute,
    PermuteBwd,
    BlockwiseMm,
    BlockwiseMmBwd,
    A2avRouting,
    MoeTkg,
    RmsNormRouterTopkTkg,
    RmsNormRouterTopkTkgBwd,
    MoeBlockTkg,
    Topk,
    TopkReduce,
    FindNonzeroIndices,
    IndexedFlatten,
}

impl Kernel {
    /// Every kernel, in catalog order.
    pub const ALL: &'static [Kernel] = &[
        Kernel::RouterTopk,
        Kernel::RouterTopkBwd,
        Kernel::LoadBalancingLoss,
        Kernel::LoadBalancingLossBwd,
        Kernel::Permute,
        Kernel::PermuteBwd,
        Kernel::BlockwiseMm,
        Kernel::BlockwiseMmBwd,
        Kernel::A2avRouting,
        Kernel::MoeTkg,
        Kernel::RmsNormRouterTopkTkg,
        Kernel::RmsNormRouterTopkTkgBwd,
        Kernel::MoeBlockTkg,
        Kernel::Topk,
        Kernel::TopkReduce,
        Kernel::FindNonzeroIndices,
        Kernel::IndexedFlatten,
    ];

    pub fn name(self) -> &'static str {
        self.spec().name
    }

    /// The kernel's tensor contract.
    pub fn spec(self) -> &'static KernelSpec {
        match self {
            Kernel::RouterTopk => &ROUTER_TOPK,
            Kernel::RouterTopkBwd => &ROUTER_TOPK_BWD,
            Kernel::LoadBalancingLoss => &LOAD_BALANCING_LOSS,
            Kernel::LoadBalancingLossBwd => &LOAD_BALANCING_LOSS_BWD,
            Kernel::Permute => &PERMUTE,
            Kernel::PermuteBwd => &PERMUTE_BWD,
            Kernel::BlockwiseMm => &BLOCKWISE_MM,
            Kernel::BlockwiseMmBwd => &BLOCKWISE_MM_BWD,
            Kernel::A2avRouting => &A2AV_ROUTING,
            Kernel::MoeTkg => &MOE_TKG,
            Kernel::RmsNormRouterTopkTkg => &RMSNORM_ROUTER_TOPK_TKG,
            Kernel::RmsNormRouterTopkTkgBwd => &RMSNORM_ROUTER_TOPK_TKG_BWD,
            Kernel::MoeBlockTkg => &MOE_BLOCK_TKG,
            Kernel::Topk => &TOPK,
            Kernel::TopkReduce => &TOPK_REDUCE,
            Kernel::FindNonzeroIndices => &FIND_NONZERO_INDICES,
            Kernel::IndexedFlatten => &INDEXED_FLATTEN,
        }
    }
}

impl FromStr for Kernel {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        find_named(Self::ALL, Self::name, s).map_err(|known| Error::UnknownKernel {
            name: s.to_owned(),
            known,
        })
    }
}

/// The parameter names kernels accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    K,
    ActFn,
    RouterPreNorm,
    NormTopkProb,
    XHbmLayout,
    NumExperts,
    BlockSize,
    NBlockPerIter,
    CheckpointActivation,
    ActivationFunction,
    ActivationType,
    ExpertAffinitiesScalingMode,
    GateClampLowerLimit,
    GateClampUpperLimit,
    UpClampLowerLimit,
    UpClampUpperLimit,
    NonLinearClampLowerLimit,
    NonLinearClampUpperLimit,
    LinearClampLowerLimit,
    LinearClampUpperLimit,
    Bias,
    SkipToken,
    IsTensorUpdateAccumulating,
    WeightLayout,
    ComputeDType,
    ExpertParallelDegree,
    IsAllExpert,
    ActivationFn,
    MaskUnselectedExperts,
    TopK,
    Eps,
    HiddenActual,
    QuantizationType,
    RouterMmDType,
    RouterActFn,
    StoreEagerAffiOnly,
    HiddenActFn,
    SkipRouterLogits,
    SortedFlag,
    Method,
    /// `topk_reduce`'s `T` (output tokens).
    TokenCount,
    /// `topk_reduce`'s `K` (rows summed per token).
    RowsPerToken,
    TokenBaseIndex,
    NCols,
    ChunkSize,
    IndexDType,
    FLen,
    OutputLen,
    PaddingVal,
    OutputDType,
}

impl Param {
    /// The value `kernel` takes for this parameter when it is not given, as `moekit list`
    /// prints it: read off the contracts' typed defaults (nki-library's), so it is declared
    /// once. What has no default (`k`, `num_experts`, `expert_parallel_degree`,
    /// `moe_tkg`'s `is_all_expert`) prints as `none`, which no catalog entry shows.
    pub fn default_value(self, kernel: Kernel) -> String {
        let router = RouterPipeline::default();
        let forward = BlockwiseMmParams::default();
        let backward = BlockwiseMmBwdParams::default();
        let decode = MoeTkgParams::new(false);
        let fused = RmsNormRouterTopkTkgParams::default();
        let block = MoeBlockTkgParams::default();
        let limit = |limit: Option<f32>| limit.map_or_else(|| "none".to_owned(), |v| v.to_string());
        match self {
            // moe_block_tkg's own router and experts defaults.
            Param::IsAllExpert if kernel == Kernel::MoeBlockTkg => block.is_all_expert.to_string(),
            Param::ExpertAffinitiesScalingMode if kernel == Kernel::MoeBlockTkg => {
                block.expert_affinities_scaling_mode.to_string()
            }
            Param::RouterActFn if kernel == Kernel::MoeBlockTkg => block.router_act_fn.to_string(),
            Param::RouterPreNorm if kernel == Kernel::MoeBlockTkg => {
                block.router_pre_norm.to_string()
            }
            Param::NormTopkProb if kernel == Kernel::MoeBlockTkg => {
                block.norm_topk_prob.to_string()
            }
            Param::TopK if kernel == Kernel::MoeBlockTkg => block.top_k.to_string(),
            Param::K
            | Param::NumExperts
            | Param::ExpertParallelDegree
            | Param::IsAllExpert
            | Param::TokenCount
            | Param::RowsPerToken
            | Param::NCols
            | Param::FLen
            | Param::OutputLen => "none".to_owned(),
            // The whole of T, as one chunk.
            Param::ChunkSize => "T".to_owned(),
            Param::IndexDType => INDEX_DTYPE.to_owned(),
            Param::PaddingVal => IndexedFlattenParams::DEFAULT_PADDING_VAL.to_string(),
            Param::TokenBaseIndex => TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX.to_string(),
            Param::ActFn => router.act_fn.to_string(),
            Param::RouterPreNorm => router.router_pre_norm.to_string(),
            Param::NormTopkProb => router.norm_topk_prob.to_string(),
            Param::XHbmLayout => router.x_hbm_layout.to_string(),
            // The blockwise kernels read B off the plan; `permute` requires it.
            Param::BlockSize => "the plan's B".to_owned(),
            Param::NBlockPerIter => PermuteParams::DEFAULT_N_BLOCK_PER_ITER.to_string(),
            Param::CheckpointActivation => forward.checkpoint_activation.to_string(),
            Param::ActivationFunction => forward.activation_function.to_string(),
            Param::ActivationType => backward.activation_type.to_string(),
            Param::ExpertAffinitiesScalingMode if kernel == Kernel::MoeTkg => {
                decode.expert_affinities_scaling_mode.to_string()
            }
            Param::HiddenActFn => block.hidden_act_fn.to_string(),
            Param::SkipRouterLogits => block.skip_router_logits.to_string(),
            Param::SortedFlag => TopkParams::new(1).sorted_flag.to_string(),
            Param::Method => TopkMethod::default().to_string(),
            Param::ExpertAffinitiesScalingMode => {
                forward.expert_affinities_scaling_mode.to_string()
            }
            Param::ActivationFn => decode.activation_fn.to_string(),
            Param::MaskUnselectedExperts => decode.mask_unselected_experts.to_string(),
            Param::TopK => fused.top_k.to_string(),
            Param::Eps => fused.shared.eps.to_string(),
            // The divisor of the mean of squares is H unless given.
            Param::HiddenActual => "H".to_owned(),
            Param::QuantizationType => fused.quantization_type.to_string(),
            Param::RouterMmDType => fused.shared.router_mm_dtype.to_string(),
            Param::RouterActFn => fused.shared.router_act_fn.to_string(),
            Param::StoreEagerAffiOnly => fused.shared.store_eager_affi_only.to_string(),
            Param::GateClampLowerLimit => limit(forward.clamp.gate.lower),
            Param::GateClampUpperLimit => limit(forward.clamp.gate.upper),
            Param::UpClampLowerLimit => limit(forward.clamp.up.lower),
            Param::UpClampUpperLimit => limit(forward.clamp.up.upper),
            Param::NonLinearClampLowerLimit => limit(backward.clamp.gate.lower),
            Param::NonLinearClampUpperLimit => limit(backward.clamp.gate.upper),
            Param::LinearClampLowerLimit => limit(backward.clamp.up.lower),
            Param::LinearClampUpperLimit => limit(backward.clamp.up.upper),
            Param::Bias => backward.bias.to_string(),
            Param::SkipToken => forward.skip_dma.skip_token.to_string(),
            Param::IsTensorUpdateAccumulating => forward.is_tensor_update_accumulating.to_string(),
            Param::WeightLayout => forward.weight_layout.to_string(),
            Param::ComputeDType => ComputeDType::DEFAULT.to_owned(),
            Param::OutputDType => OutputDType::default().to_string(),
        }
    }

    pub const ALL: &'static [Param] = &[
        Param::K,
        Param::ActFn,
        Param::RouterPreNorm,
        Param::NormTopkProb,
        Param::XHbmLayout,
        Param::NumExperts,
        Param::BlockSize,
        Param::NBlockPerIter,
        Param::CheckpointActivation,
        Param::ActivationFunction,
        Param::ActivationType,
        Param::ExpertAffinitiesScalingMode,
        Param::GateClampLowerLimit,
        Param::GateClampUpperLimit,
        Param::UpClampLowerLimit,
        Param::UpClampUpperLimit,
        Param::NonLinearClampLowerLimit,
        Param::NonLinearClampUpperLimit,
        Param::LinearClampLowerLimit,
        Param::LinearClampUpperLimit,
        Param::Bias,
        Param::SkipToken,
        Param::IsTensorUpdateAccumulating,
        Param::WeightLayout,
        Param::ComputeDType,
        Param::ExpertParallelDegree,
        Param::IsAllExpert,
        Param::ActivationFn,
        Param::MaskUnselectedExperts,
        Param::TopK,
        Param::Eps,
        Param::HiddenActual,
        Param::QuantizationType,
        Param::RouterMmDType,
        Param::RouterActFn,
        Param::StoreEagerAffiOnly,
        Param::HiddenActFn,
        Param::SkipRouterLogits,
        Param::SortedFlag,
        Param::Method,
        Param::TokenCount,
        Param::RowsPerToken,
        Param::TokenBaseIndex,
        Param::NCols,
        Param::ChunkSize,
        Param::IndexDType,
        Param::FLen,
        Param::OutputLen,
        Param::PaddingVal,
        Param::OutputDType,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Param::K => "k",
            Param::ActFn => "act_fn",
            Param::RouterPreNorm => "router_pre_norm",
            Param::NormTopkProb => "norm_topk_prob",
            Param::XHbmLayout => "x_hbm_layout",
            Param::NumExperts => "num_experts",
            Param::BlockSize => "block_size",
            Param::NBlockPerIter => "n_block_per_iter",
            Param::CheckpointActivation => "checkpoint_activation",
            Param::ActivationFunction => "activation_function",
            Param::ActivationType => "activation_type",
            Param::ExpertAffinitiesScalingMode => "expert_affinities_scaling_mode",
            Param::GateClampLowerLimit => "gate_clamp_lower_limit",
            Param::GateClampUpperLimit => "gate_clamp_upper_limit",
            Param::UpClampLowerLimit => "up_clamp_lower_limit",
            Param::UpClampUpperLimit => "up_clamp_upper_limit",
            Param::NonLinearClampLowerLimit => "non_linear_clamp_lower_limit",
            Param::NonLinearClampUpperLimit => "non_linear_clamp_upper_limit",
            Param::LinearClampLowerLimit => "linear_clamp_lower_limit",
            Param::LinearClampUpperLimit => "linear_clamp_upper_limit",
            Param::Bias => "bias",
            Param::SkipToken => "skip_token",
            Param::IsTensorUpdateAccumulating => "is_tensor_update_accumulating",
            Param::WeightLayout => WeightLayout::PARAM,
            Param::ComputeDType => ComputeDType::PARAM,
            Param::ExpertParallelDegree => "expert_parallel_degree",
            Param::IsAllExpert => "is_all_expert",
            Param::ActivationFn => "activation_fn",
            Param::MaskUnselectedExperts => "mask_unselected_experts",
            Param::TopK => "top_k",
            Param::Eps => "eps",
            Param::HiddenActual => "hidden_actual",
            Param::QuantizationType => QuantizationType::PARAM,
            Param::RouterMmDType => RouterMmDType::PARAM,
            Param::RouterActFn => "router_act_fn",
            Param::StoreEagerAffiOnly => "store_eager_affi_only",
            Param::HiddenActFn => "hidden_act_fn",
            Param::SkipRouterLogits => "skip_router_logits",
            Param::SortedFlag => "sorted_flag",
            Param::Method => TopkMethod::PARAM,
            Param::TokenCount => "T",
            Param::RowsPerToken => "K",
            Param::TokenBaseIndex => "token_base_index",
            Param::NCols => "n_cols",
            Param::ChunkSize => "chunk_size",
            Param::IndexDType => "index_dtype",
            Param::FLen => "f_len",
            Param::OutputLen => "output_len",
            Param::PaddingVal => "padding_val",
            Param::OutputDType => OutputDType::PARAM,
        }
    }

    /// Accepted values, for `moekit list`.
    pub fn values(self) -> &'static str {
        match self {
            Param::K
            | Param::NumExperts
            | Param::BlockSize
            | Param::NBlockPerIter
            | Param::ExpertParallelDegree
            | Param::TopK
            | Param::HiddenActual
            | Param::TokenCount
            | Param::RowsPerToken
            | Param::NCols
            | Param::ChunkSize
            | Param::FLen
            | Param::OutputLen
            | Param::PaddingVal
            | Param::TokenBaseIndex => "integer",
            Param::IndexDType => INDEX_DTYPE,
            Param::ActFn | Param::RouterActFn => "SOFTMAX|SIGMOID",
            Param::Eps => "number",
            Param::QuantizationType => "NONE|MX",
            Param::RouterMmDType => "bfloat16|float32",
            Param::XHbmLayout => "0 [H,T]|1 [T,H]",
            Param::ActivationFunction
            | Param::ActivationType
            | Param::ActivationFn
            | Param::HiddenActFn => "SiLU|GELU|GELU_Tanh_Approx|Swish|ReLU|SquaredReLU",
            Param::ExpertAffinitiesScalingMode => "NO_SCALE|POST_SCALE|PRE_SCALE|PRE_SCALE_DELAYED",
            Param::GateClampLowerLimit
            | Param::GateClampUpperLimit
            | Param::UpClampLowerLimit
            | Param::UpClampUpperLimit
            | Param::NonLinearClampLowerLimit
            | Param::NonLinearClampUpperLimit
            | Param::LinearClampLowerLimit
            | Param::LinearClampUpperLimit => "number",
            Param::Bias => "true|false",
            Param::OutputDType => "input|float32",
            Param::WeightLayout => "nki|linear",
            Param::ComputeDType => "bfloat16|float32",
            Param::RouterPreNorm
            | Param::NormTopkProb
            | Param::CheckpointActivation
            | Param::SkipToken
            | Param::IsTensorUpdateAccumulating
            | Param::IsAllExpert
            | Param::MaskUnselectedExperts
            | Param::StoreEagerAffiOnly
            | Param::SkipRouterLogits
            | Param::SortedFlag => "true|false",
            Param::Method => "ROTATIONAL|SCANNING|CASCADED",
        }
    }
}

/// Parameter values given to a kernel run; a kernel reads those it uses and ignores the rest.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Params {
    pub k: Option<usize>,
    pub act_fn: Option<RouterActFnType>,
    pub router_pre_norm: Option<bool>,
    pub norm_topk_prob: Option<bool>,
    pub x_hbm_layout: Option<XHbmLayout>,
    pub num_experts: Option<usize>,
    pub block_size: Option<usize>,
    pub n_block_per_iter: Option<usize>,
    pub checkpoint_activation: Option<bool>,
    pub activation_function: Option<ActFnType>,
    pub activation_type: Option<ActFnType>,
    /// `expert_affinities_scaling_mode`, for the forward and the backward.
    pub scaling_mode: Option<ExpertAffinityScaleMode>,
    /// The clamp limits, by the forward's names or the backward's (`non_linear_*` the gate,
    /// `linear_*` the up projection).
    pub clamp: ClampLimits,
    /// The backward's `bias`.
    pub bias: Option<bool>,
    /// `skip_dma`'s `skip_token` (`SkipMode`), for the blockwise kernels, `permute` and
    /// `permute_bwd`.
    pub skip_token: Option<bool>,
    /// The blockwise kernels' `is_tensor_update_accumulating`.
    pub is_tensor_update_accumulating: Option<bool>,
    /// The blockwise kernels' `weight_layout` (moekit's own).
    pub weight_layout: Option<WeightLayout>,
    /// The blockwise kernels' and `router_topk_bwd`'s `compute_dtype`.
    pub compute_dtype: Option<ComputeDType>,
    pub expert_parallel_degree: Option<usize>,
    /// `moe_tkg`'s mode.
    pub is_all_expert: Option<bool>,
    /// `moe_tkg`'s gate activation.
    pub activation_fn: Option<ActFnType>,
    pub mask_unselected_experts: Option<bool>,
    /// `rmsnorm_router_topk_tkg`'s K.
    pub top_k: Option<usize>,
    /// The RMSNorm's epsilon.
    pub eps: Option<f32>,
    /// The RMSNorm's divisor where H is padded.
    pub hidden_actual: Option<usize>,
    pub quantization_type: Option<QuantizationType>,
    pub router_mm_dtype: Option<RouterMmDType>,
    /// `rmsnorm_router_topk_tkg`'s router activation (`router_topk`'s is `act_fn`).
    pub router_act_fn: Option<RouterActFnType>,
    pub store_eager_affi_only: Option<bool>,
    /// `moe_block_tkg`'s expert activation.
    pub hidden_act_fn: Option<ActFnType>,
    pub skip_router_logits: Option<bool>,
    /// `topk`'s order and method.
    pub sorted_flag: Option<bool>,
    pub method: Option<TopkMethod>,
    /// `topk_reduce`'s `T` and `K`.
    pub token_count: Option<usize>,
    pub rows_per_token: Option<usize>,
    pub token_base_index: Option<i32>,
    /// `find_nonzero_indices`' column count and row chunk.
    pub n_cols: Option<usize>,
    pub chunk_size: Option<usize>,
    /// `indexed_flatten`'s block length, output length and fill.
    pub f_len: Option<usize>,
    pub output_len: Option<usize>,
    pub padding_val: Option<i32>,
    /// moekit's own `output_dtype`.
    pub output_dtype: Option<OutputDType>,
}

fn parse_count(param: Param, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::param(param.name(), format!("expected an integer, got `{value}`")))
}

fn parse_i32(param: Param, value: &str) -> Result<i32> {
    value.trim().parse().map_err(|_| {
        Error::param(
            param.name(),
            format!("expected an i32 integer, got `{value}`"),
        )
    })
}

fn parse_finite(param: Param, value: &str) -> Result<f32> {
    value
        .trim()
        .parse::<f32>()
        .ok()
        .filter(|v| v.is_finite())
        .ok_or_else(|| {
            Error::param(
                param.name(),
                format!("expected a finite number, got `{value}`"),
            )
        })
}

fn parse_bool(param: Param, value: &str) -> Result<bool> {
    match value.trim() {
        "true" | "1" => Ok(true),
        "false" | "0" => Ok(false),
        other => Err(Error::param(
            param.name(),
            format!("expected true or false, got `{other}`"),
        )),
    }
}

/// nki-library parameters (of `router_topk`, the blockwise kernels, `moe_tkg` and `topk`) that
/// only choose the launch grid, the on-chip schedule, the SBUF layout or the internal precision (or, for `return_eager_affi`, an
/// output moekit always returns): accepted with any value so the same call works on both sides,
/// and without effect on moekit's results.
pub const SCHEDULE_ONLY_PARAMS: &[&str] = &[
    // router_topk
    "x_sb_layout",
    "use_column_tiling",
    "use_indirect_dma_scatter",
    "return_eager_affi",
    "use_PE_broadcast_w_bias",
    "shard_on_tokens",
    "skip_store_expert_index",
    "skip_store_router_logits",
    // blockwise_mm and blockwise_mm_bwd (moekit accumulates in f32 whatever
    // `accumulation_dtype` says)
    "accumulation_dtype",
    "block_sharding_strategy",
    "shard_option",
    "block_tile_size",
    // `skip_dma`'s other field: skips reloading weights already on chip
    "skip_weight",
    // moe_tkg: where the output lies (SBUF or HBM), and the MX all-expert kernel's skipping of
    // token blocks without routed tokens (whose outputs are zero anyway)
    "output_in_sbuf",
    "is_all_expert_dynamic",
    // topk: the launch grid (logical NeuronCores)
    "lnc",
];

impl Params {
    /// The router pipeline these parameters choose, with nki-library's defaults (SOFTMAX, ACT1,
    /// no renormalisation) and moekit's `x [T, H]` where a parameter is not given.
    pub fn router_pipeline(&self) -> RouterPipeline {
        let default = RouterPipeline::default();
        RouterPipeline {
            act_fn: self.act_fn.unwrap_or(default.act_fn),
            router_pre_norm: self.router_pre_norm.unwrap_or(default.router_pre_norm),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(default.norm_topk_prob),
            x_hbm_layout: self.x_hbm_layout.unwrap_or(default.x_hbm_layout),
        }
    }

    /// The parameters `rmsnorm_router_topk_tkg` and its backward share, nki-library's defaults
    /// where not given.
    pub fn rmsnorm_router(&self) -> RmsNormRouterParams {
        let default = RmsNormRouterParams::default();
        RmsNormRouterParams {
            eps: self.eps.unwrap_or(default.eps),
            hidden_actual: self.hidden_actual,
            router_mm_dtype: self.router_mm_dtype.unwrap_or(default.router_mm_dtype),
            router_act_fn: self.router_act_fn.unwrap_or(default.router_act_fn),
            store_eager_affi_only: self
                .store_eager_affi_only
                .unwrap_or(default.store_eager_affi_only),
        }
    }

    /// `moe_block_tkg`'s parameters, nki-library's defaults where not given.
    pub fn moe_block(&self) -> MoeBlockTkgParams {
        let default = MoeBlockTkgParams::default();
        MoeBlockTkgParams {
            eps: self.eps.unwrap_or(default.eps),
            top_k: self.top_k.unwrap_or(default.top_k),
            router_act_fn: self.router_act_fn.unwrap_or(default.router_act_fn),
            router_pre_norm: self.router_pre_norm.unwrap_or(default.router_pre_norm),
            norm_topk_prob: self.norm_topk_prob.unwrap_or(default.norm_topk_prob),
            expert_affinities_scaling_mode: self
                .scaling_mode
                .unwrap_or(default.expert_affinities_scaling_mode),
            hidden_act_fn: self.hidden_act_fn.unwrap_or(default.hidden_act_fn),
            clamp: self.clamp,
            router_mm_dtype: self.router_mm_dtype.unwrap_or(default.router_mm_dtype),
            hidden_actual: self.hidden_actual,
            skip_router_logits: self
                .skip_router_logits
                .unwrap_or(default.skip_router_logits),
            is_all_expert: self.is_all_expert.unwrap_or(default.is_all_expert),
        }
    }

    /// The `skip_dma` these parameters choose (`skip_token` false when not given).
    pub fn skip_dma(&self) -> SkipMode {
        SkipMode {
            skip_token: self.skip_token.unwrap_or_default(),
        }
    }

    /// Sets `name` from its textual `value`; an unknown name is an error. The
    /// [`SCHEDULE_ONLY_PARAMS`] are accepted and change nothing.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        if SCHEDULE_ONLY_PARAMS.contains(&name) {
            return Ok(());
        }
        let param = find_named(Param::ALL, Param::name, name)
            .map_err(|known| Error::param(name, format!("unknown parameter; known: {known}")))?;
        match param {
            Param::K => self.k = Some(parse_count(param, value)?),
            Param::ActFn => self.act_fn = Some(value.trim().parse()?),
            Param::RouterPreNorm => self.router_pre_norm = Some(parse_bool(param, value)?),
            Param::NormTopkProb => self.norm_topk_prob = Some(parse_bool(param, value)?),
            Param::XHbmLayout => self.x_hbm_layout = Some(value.trim().parse()?),
            Param::NumExperts => self.num_experts = Some(parse_count(param, value)?),
            Param::BlockSize => self.block_size = Some(parse_count(param, value)?),
            Param::NBlockPerIter => self.n_block_per_iter = Some(parse_count(param, value)?),
            Param::CheckpointActivation => {
                self.checkpoint_activation = Some(parse_bool(param, value)?)
            }
            Param::ActivationFunction => {
                self.activation_function = Some(ActFnType::parse(name, value.trim())?)
            }
            Param::ActivationType => {
                self.activation_type = Some(ActFnType::parse(name, value.trim())?)
            }
            Param::ExpertAffinitiesScalingMode => {
                self.scaling_mode = Some(ExpertAffinityScaleMode::parse(name, value.trim())?)
            }
            Param::GateClampLowerLimit | Param::NonLinearClampLowerLimit => {
                self.clamp.gate.lower = Some(parse_finite(param, value)?)
            }
            Param::GateClampUpperLimit | Param::NonLinearClampUpperLimit => {
                self.clamp.gate.upper = Some(parse_finite(param, value)?)
            }
            Param::UpClampLowerLimit | Param::LinearClampLowerLimit => {
                self.clamp.up.lower = Some(parse_finite(param, value)?)
            }
            Param::UpClampUpperLimit | Param::LinearClampUpperLimit => {
                self.clamp.up.upper = Some(parse_finite(param, value)?)
            }
            Param::Bias => self.bias = Some(parse_bool(param, value)?),
            Param::SkipToken => self.skip_token = Some(parse_bool(param, value)?),
            Param::IsTensorUpdateAccumulating => {
                self.is_tensor_update_accumulating = Some(parse_bool(param, value)?)
            }
            Param::WeightLayout => self.weight_layout = Some(WeightLayout::parse(value.trim())?),
            Param::ComputeDType => self.compute_dtype = Some(value.parse()?),
            Param::ExpertParallelDegree => {
                self.expert_parallel_degree = Some(parse_count(param, value)?)
            }
            Param::IsAllExpert => self.is_all_expert = Some(parse_bool(param, value)?),
            Param::ActivationFn => self.activation_fn = Some(ActFnType::parse(name, value.trim())?),
            Param::MaskUnselectedExperts => {
                self.mask_unselected_experts = Some(parse_bool(param, value)?)
            }
            Param::TopK => self.top_k = Some(parse_count(param, value)?),
            Param::Eps => self.eps = Some(parse_finite(param, value)?),
            Param::HiddenActual => self.hidden_actual = Some(parse_count(param, value)?),
            Param::QuantizationType => self.quantization_type = Some(value.trim().parse()?),
            Param::RouterMmDType => self.router_mm_dtype = Some(value.trim().parse()?),
            Param::RouterActFn => {
                self.router_act_fn = Some(value.trim().parse().map_err(|_| {
                    Error::param(
                        name,
                        format!("expected SOFTMAX or SIGMOID (RouterActFnType), got `{value}`"),
                    )
                })?)
            }
            Param::StoreEagerAffiOnly => {
                self.store_eager_affi_only = Some(parse_bool(param, value)?)
            }
            Param::HiddenActFn => self.hidden_act_fn = Some(ActFnType::parse(name, value.trim())?),
            Param::SkipRouterLogits => self.skip_router_logits = Some(parse_bool(param, value)?),
            Param::SortedFlag => self.sorted_flag = Some(parse_bool(param, value)?),
            Param::Method => self.method = Some(value.trim().parse()?),
            Param::TokenCount => self.token_count = Some(parse_count(param, value)?),
            Param::RowsPerToken => self.rows_per_token = Some(parse_count(param, value)?),
            Param::NCols => self.n_cols = Some(parse_count(param, value)?),
            Param::ChunkSize => self.chunk_size = Some(parse_count(param, value)?),
            Param::IndexDType => {
                if value.trim() != INDEX_DTYPE {
                    return Err(Error::param(
                        name,
                        format!("expected {INDEX_DTYPE} (the only index dtype), got `{value}`"),
                    ));
                }
            }
            Param::FLen => self.f_len = Some(parse_count(param, value)?),
            Param::OutputLen => self.output_len = Some(parse_count(param, value)?),
            Param::PaddingVal => self.padding_val = Some(parse_i32(param, value)?),
            Param::TokenBaseIndex => self.token_base_index = Some(parse_i32(param, value)?),
            Param::OutputDType => self.output_dtype = Some(value.trim().parse()?),
        }
        Ok(())
    }

    /// Reads the parameters in file metadata. Metadata is free-form (PyTorch writes `format`,
    /// moekit's own outputs carry `kernel` and `backend`), so other keys are not errors; they
    /// are returned, sorted, so a caller can warn about likely typos.
    pub fn from_metadata<'m>(
        metadata: impl IntoIterator<Item = (&'m str, &'m str)>,
    ) -> Result<(Self, Vec<&'m str>)> {
        let mut params = Self::default();
        let mut ignored = Vec::new();
        for (key, value) in metadata {
            if Param::ALL.iter().any(|p| p.name() == key) || SCHEDULE_ONLY_PARAMS.contains(&key) {
                params.set(key, value)?;
            } else {
                ignored.push(key);
            }
        }
        ignored.sort_unstable();
        Ok((params, ignored))
    }
}

const ROUTER_TOPK: KernelSpec = KernelSpec {
    name: "router_topk",
    summary: "nki-library's router: logits = x·w (+w_bias); ACT1: act_fn over all E, top-K (+selection_bias), optional renormalisation, dense affinities without it; ACT2: top-K logits, act_fn over the K; ties to the lower id",
    inputs: tensors::router_topk::INPUTS,
    outputs: tensors::router_topk::OUTPUTS,
    params: &[
        (Param::K, ParamUse::Required),
        (Param::ActFn, ParamUse::Defaulted),
        (Param::RouterPreNorm, ParamUse::Defaulted),
        (Param::NormTopkProb, ParamUse::Defaulted),
        (Param::XHbmLayout, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const ROUTER_TOPK_BWD: KernelSpec = KernelSpec {
    name: "router_topk_bwd",
    summary: "moekit's own: gradients of router_topk w.r.t. x (in its layout), w and w_bias from d_topk_affinities (+ d_router_logits)",
    inputs: tensors::router_topk_bwd::INPUTS,
    outputs: tensors::router_topk_bwd::OUTPUTS,
    params: &[
        (Param::ActFn, ParamUse::Defaulted),
        (Param::RouterPreNorm, ParamUse::Defaulted),
        (Param::NormTopkProb, ParamUse::Defaulted),
        (Param::XHbmLayout, ParamUse::Defaulted),
        (Param::ComputeDType, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const LOAD_BALANCING_LOSS: KernelSpec = KernelSpec {
    name: "load_balancing_loss",
    summary: "Hugging Face Qwen3-MoE aux loss E·Σ_e f_e·P_e, layers pooled as HF pools them",
    inputs: tensors::load_balancing_loss::INPUTS,
    outputs: tensors::load_balancing_loss::OUTPUTS,
    params: &[],
};

const LOAD_BALANCING_LOSS_BWD: KernelSpec = KernelSpec {
    name: "load_balancing_loss_bwd",
    summary: "gradient of the aux loss w.r.t. router_logits",
    inputs: tensors::load_balancing_loss_bwd::INPUTS,
    outputs: tensors::load_balancing_loss_bwd::OUTPUTS,
    params: &[(Param::OutputDType, ParamUse::Defaulted)],
};

const PERMUTE: KernelSpec = KernelSpec {
    name: "permute",
    summary: "block plan (moekit's own) in nki-library's convention: each expert's tokens (ascending) in blocks of B, blocks by expert id, padding T (−1 with skip_token), unused blocks on E−1, N = ceil((T·K−(E−1))/B)+(E−1) rounded up to n_block_per_iter",
    inputs: tensors::permute::INPUTS,
    outputs: tensors::permute::OUTPUTS,
    params: &[
        (Param::NumExperts, ParamUse::Required),
        (Param::BlockSize, ParamUse::Required),
        (Param::NBlockPerIter, ParamUse::Defaulted),
        (Param::SkipToken, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const PERMUTE_BWD: KernelSpec = KernelSpec {
    name: "permute_bwd",
    summary: "maps an affinity gradient from the masked [(T+1)·E] layout back to [T, K]",
    inputs: tensors::permute_bwd::INPUTS,
    outputs: tensors::permute_bwd::OUTPUTS,
    params: &[
        (Param::NumExperts, ParamUse::Required),
        (Param::SkipToken, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const BLOCKWISE_MM: KernelSpec = KernelSpec {
    name: "blockwise_mm",
    summary: "nki-library's moe_cte: per block, gather, gate_up matmul (+bias, clamped), act(gate)⊙up, down matmul (+bias), scale by affinity, scatter-add into [T+1, H]",
    inputs: tensors::blockwise_mm::INPUTS,
    outputs: tensors::blockwise_mm::OUTPUTS,
    params: &[
        (Param::BlockSize, ParamUse::Defaulted),
        (Param::CheckpointActivation, ParamUse::Defaulted),
        (Param::ActivationFunction, ParamUse::Defaulted),
        (Param::ExpertAffinitiesScalingMode, ParamUse::Defaulted),
        (Param::GateClampLowerLimit, ParamUse::Defaulted),
        (Param::GateClampUpperLimit, ParamUse::Defaulted),
        (Param::UpClampLowerLimit, ParamUse::Defaulted),
        (Param::UpClampUpperLimit, ParamUse::Defaulted),
        (Param::SkipToken, ParamUse::Defaulted),
        (Param::IsTensorUpdateAccumulating, ParamUse::Defaulted),
        (Param::WeightLayout, ParamUse::Defaulted),
        (Param::ComputeDType, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const BLOCKWISE_MM_BWD: KernelSpec = KernelSpec {
    name: "blockwise_mm_bwd",
    summary: "nki-library's blockwise_mm_bwd: gradients of blockwise_mm from its checkpoints; with expert_index also d_topk_affinities (moekit's own)",
    inputs: tensors::blockwise_mm_bwd::INPUTS,
    outputs: tensors::blockwise_mm_bwd::OUTPUTS,
    params: &[
        (Param::BlockSize, ParamUse::Defaulted),
        (Param::ActivationType, ParamUse::Defaulted),
        (Param::ExpertAffinitiesScalingMode, ParamUse::Defaulted),
        (Param::Bias, ParamUse::Defaulted),
        (Param::NonLinearClampLowerLimit, ParamUse::Defaulted),
        (Param::NonLinearClampUpperLimit, ParamUse::Defaulted),
        (Param::LinearClampLowerLimit, ParamUse::Defaulted),
        (Param::LinearClampUpperLimit, ParamUse::Defaulted),
        (Param::SkipToken, ParamUse::Defaulted),
        (Param::IsTensorUpdateAccumulating, ParamUse::Defaulted),
        (Param::WeightLayout, ParamUse::Defaulted),
        (Param::ComputeDType, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const A2AV_ROUTING: KernelSpec = KernelSpec {
    name: "a2av_routing",
    summary: "moekit's own: nki-library's expert-parallel routing table (permute_a2av, unpermute_a2av): column d of send_indices the tokens sent to rank d, ascending, T when empty",
    inputs: tensors::a2av_routing::INPUTS,
    outputs: tensors::a2av_routing::OUTPUTS,
    params: &[
        (Param::NumExperts, ParamUse::Required),
        (Param::ExpertParallelDegree, ParamUse::Required),
    ],
};

const MOE_TKG: KernelSpec = KernelSpec {
    name: "moe_tkg",
    summary: "nki-library's moe_tkg (decode experts): selective (each token's K experts, ids into the E_L held here) or all-expert (every held expert for every token; POST_SCALE reads columns rank_id·E_L.. of expert_affinities, with mask_unselected_experts times how often the token chose it); gate/up (+bias, clamped), act(gate)⊙up, down (+bias), NO_SCALE or POST_SCALE, summed into [T, H]",
    inputs: tensors::moe_tkg::INPUTS,
    outputs: tensors::moe_tkg::OUTPUTS,
    params: &[
        (Param::IsAllExpert, ParamUse::Required),
        (Param::ExpertAffinitiesScalingMode, ParamUse::Defaulted),
        (Param::ActivationFn, ParamUse::Defaulted),
        (Param::GateClampLowerLimit, ParamUse::Defaulted),
        (Param::GateClampUpperLimit, ParamUse::Defaulted),
        (Param::UpClampLowerLimit, ParamUse::Defaulted),
        (Param::UpClampUpperLimit, ParamUse::Defaulted),
        (Param::MaskUnselectedExperts, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const RMSNORM_ROUTER_TOPK_TKG: KernelSpec = KernelSpec {
    name: "rmsnorm_router_topk_tkg",
    summary: "nki-library's fused decode RMSNorm + router: norm = x / sqrt(Σx²/hidden_actual + eps) ⊙ gamma (norm_output, router_mm_dtype), logits = norm · router_weights + router_bias, the top-K logits (ties to the lower id), router_act_fn over the K; bf16 affinities scattered [T, E], or [T, K] with store_eager_affi_only",
    inputs: tensors::rmsnorm_router_topk_tkg::INPUTS,
    outputs: tensors::rmsnorm_router_topk_tkg::OUTPUTS,
    params: &[
        (Param::TopK, ParamUse::Defaulted),
        (Param::Eps, ParamUse::Defaulted),
        (Param::HiddenActual, ParamUse::Defaulted),
        (Param::QuantizationType, ParamUse::Defaulted),
        (Param::RouterMmDType, ParamUse::Defaulted),
        (Param::RouterActFn, ParamUse::Defaulted),
        (Param::StoreEagerAffiOnly, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const RMSNORM_ROUTER_TOPK_TKG_BWD: KernelSpec = KernelSpec {
    name: "rmsnorm_router_topk_tkg_bwd",
    summary: "moekit's own: gradients of rmsnorm_router_topk_tkg w.r.t. hidden_states, gamma, router_weights and router_bias from d_expert_affinities (+ d_norm_output); the rounding to router_mm_dtype passed straight through",
    inputs: tensors::rmsnorm_router_topk_tkg_bwd::INPUTS,
    outputs: tensors::rmsnorm_router_topk_tkg_bwd::OUTPUTS,
    params: &[
        (Param::Eps, ParamUse::Defaulted),
        (Param::HiddenActual, ParamUse::Defaulted),
        (Param::RouterMmDType, ParamUse::Defaulted),
        (Param::RouterActFn, ParamUse::Defaulted),
        (Param::StoreEagerAffiOnly, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const MOE_BLOCK_TKG: KernelSpec = KernelSpec {
    name: "moe_block_tkg",
    summary: "nki-library's decode MoE block: RMSNorm (eps, hidden_actual) rounded to inp's dtype, router_topk on it in router_mm_dtype (router_act_fn, ACT1 by router_pre_norm with norm_topk_prob, or ACT2), moe_tkg on the norm (selective over all E experts, or all-expert on rank_id's shard; unselected experts masked under ACT1's dense affinities); out [T, H] and the pre-activation router_logits [T, E]",
    inputs: tensors::moe_block_tkg::INPUTS,
    outputs: tensors::moe_block_tkg::OUTPUTS,
    params: &[
        (Param::Eps, ParamUse::Defaulted),
        (Param::TopK, ParamUse::Defaulted),
        (Param::RouterActFn, ParamUse::Defaulted),
        (Param::RouterPreNorm, ParamUse::Defaulted),
        (Param::NormTopkProb, ParamUse::Defaulted),
        (Param::ExpertAffinitiesScalingMode, ParamUse::Defaulted),
        (Param::HiddenActFn, ParamUse::Defaulted),
        (Param::GateClampLowerLimit, ParamUse::Defaulted),
        (Param::GateClampUpperLimit, ParamUse::Defaulted),
        (Param::UpClampLowerLimit, ParamUse::Defaulted),
        (Param::UpClampUpperLimit, ParamUse::Defaulted),
        (Param::RouterMmDType, ParamUse::Defaulted),
        (Param::HiddenActual, ParamUse::Defaulted),
        (Param::SkipRouterLogits, ParamUse::Defaulted),
        (Param::IsAllExpert, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const TOPK: KernelSpec = KernelSpec {
    name: "topk",
    summary: "nki-library's topk (and rotational_topk): per row of inp [..., V], the K largest values and their positions, descending (sorted_flag) or in ascending position, equal values by lower position; K = V returns inp as given with positions 0..V",
    inputs: tensors::topk::INPUTS,
    outputs: tensors::topk::OUTPUTS,
    params: &[
        (Param::K, ParamUse::Required),
        (Param::SortedFlag, ParamUse::Defaulted),
        (Param::Method, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const TOPK_REDUCE: KernelSpec = KernelSpec {
    name: "topk_reduce",
    summary: "nki-library's topk_reduce: output [T, H] sums, per token t, its first K (at least 1) rows of input [TK_padded, H+2] tagged with id token_base_index + t (the bits of its last two columns as a little-endian i32; other ids ignored), as an expert-parallel exchange returns them",
    inputs: tensors::topk_reduce::INPUTS,
    outputs: tensors::topk_reduce::OUTPUTS,
    params: &[
        (Param::TokenCount, ParamUse::Required),
        (Param::RowsPerToken, ParamUse::Required),
        (Param::TokenBaseIndex, ParamUse::Defaulted),
        (Param::OutputDType, ParamUse::Defaulted),
    ],
};

const FIND_NONZERO_INDICES: KernelSpec = KernelSpec {
    name: "find_nonzero_indices",
    summary: "nki-library's find_nonzero_indices: per column of input_tensor [T, C_full] (col_start_id[0] + 0..n_cols, or all), its nonzero rows ascending then -1 (indices [C, T]) and their count",
    inputs: tensors::find_nonzero_indices::INPUTS,
    outputs: tensors::find_nonzero_indices::OUTPUTS,
    params: &[
        (Param::NCols, ParamUse::Defaulted),
        (Param::ChunkSize, ParamUse::Defaulted),
        (Param::IndexDType, ParamUse::Defaulted),
    ],
};

const INDEXED_FLATTEN: KernelSpec = KernelSpec {
    name: "indexed_flatten",
    summary: "nki-library's indexed_flatten: row e of input_tensor [E, T], in blocks of f_len, written from block row_offsets[row_offsets_start + e] of flattened_array [output_len] (later rows win, blocks past the end skipped, the rest padding_val)",
    inputs: tensors::indexed_flatten::INPUTS,
    outputs: tensors::indexed_flatten::OUTPUTS,
    params: &[
        (Param::FLen, ParamUse::Required),
        (Param::OutputLen, ParamUse::Required),
        (Param::PaddingVal, ParamUse::Defaulted),
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_are_values_the_kernels_take_when_the_parameter_is_absent() {
        for kernel in Kernel::ALL {
            for &(param, usage) in kernel.spec().params {
                let value = param.default_value(*kernel);
                if usage == ParamUse::Required {
                    continue;
                }
                assert!(
                    !matches!(
                        param,
                        Param::K
                            | Param::NumExperts
                            | Param::ExpertParallelDegree
                            | Param::TokenCount
                            | Param::RowsPerToken
                            | Param::FLen
                            | Param::OutputLen
                    ) && (param != Param::IsAllExpert || *kernel == Kernel::MoeBlockTkg),
                    "{}: `{}` has no default",
                    kernel.name(),
                    param.name()
                );
                // Limits print `none` (no clamp), B "the plan's B", `hidden_actual` "H",
                // `compute_dtype` "the tokens' dtype": not values to pass.
                if value == "none"
                    || matches!(
                        param,
                        Param::BlockSize
                            | Param::HiddenActual
                            | Param::ChunkSize
                            | Param::ComputeDType
                    )
                {
                    continue;
                }
                let mut given = Params::default();
                given
                    .set(param.name(), &value)
                    .unwrap_or_else(|e| panic!("`{}` = {value}: {e}", param.name()));
                assert_eq!(given.router_pipeline(), Params::default().router_pipeline());
                assert_eq!(given.rmsnorm_router(), Params::default().rmsnorm_router());
                if *kernel == Kernel::MoeBlockTkg {
                    assert_eq!(given.moe_block(), MoeBlockTkgParams::default());
                }
            }
        }
        // The typed defaults that the run path and the catalog both read.
        let (forward, backward) = (
            BlockwiseMmParams::default(),
            BlockwiseMmBwdParams::default(),
        );
        assert_eq!(forward.activation_function, ActFnType::Silu);
        assert_eq!(backward.activation_type, ActFnType::Silu);
        assert_eq!(
            forward.expert_affinities_scaling_mode,
            ExpertAffinityScaleMode::PostScale
        );
        assert!(!forward.checkpoint_activation && !backward.bias);
        // moe_tkg's own defaults differ from moe_cte's: NO_SCALE.
        let decode = MoeTkgParams::new(true);
        assert_eq!(
            decode.expert_affinities_scaling_mode,
            ExpertAffinityScaleMode::NoScale
        );
        assert_eq!(
            Param::ExpertAffinitiesScalingMode.default_value(Kernel::MoeTkg),
            "NO_SCALE"
        );
        assert_eq!(decode.activation_fn, ActFnType::Silu);
        assert!(!decode.mask_unselected_experts);
        assert_eq!(forward.clamp, ClampLimits::default());
        // rmsnorm_router_topk_tkg's: K = 1, eps 1e-6, bf16 router operands, SIGMOID, sparse.
        let fused = RmsNormRouterTopkTkgParams::default();
        assert_eq!(fused.top_k, 1);
        assert_eq!(fused.quantization_type, QuantizationType::None);
        assert_eq!(fused.shared.eps, 1e-6);
        assert_eq!(fused.shared.router_mm_dtype, RouterMmDType::BFLOAT16);
        assert_eq!(fused.shared.router_act_fn, RouterActFnType::Sigmoid);
        assert!(!fused.shared.store_eager_affi_only && fused.shared.hidden_actual.is_none());
        // moe_block_tkg's: K = 1, SIGMOID ACT1 without renormalisation, NO_SCALE, SiLU,
        // selective, the router logits returned.
        let block = MoeBlockTkgParams::default();
        assert_eq!((block.top_k, block.eps), (1, 1e-6));
        assert_eq!(block.router_act_fn, RouterActFnType::Sigmoid);
        assert!(block.router_pre_norm && !block.norm_topk_prob);
        assert_eq!(
            block.expert_affinities_scaling_mode,
            ExpertAffinityScaleMode::NoScale
        );
        assert_eq!(block.hidden_act_fn, ActFnType::Silu);
        assert_eq!(block.router_mm_dtype, RouterMmDType::BFLOAT16);
        assert!(!block.skip_router_logits && !block.is_all_expert);
        assert_eq!(block.clamp, ClampLimits::default());
        assert_eq!(
            Param::IsAllExpert.default_value(Kernel::MoeBlockTkg),
            "false"
        );
    }
}
