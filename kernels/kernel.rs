//! The kernel catalog: every kernel's tensor contract as data (what `moekit list` prints), the
//! parameters they take, and running any kernel by name on a map of named tensors (what
//! `moekit run` does).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::str::FromStr;

use crate::backend::Backend;
use crate::contracts::{
    A2avRouting, A2avRoutingInputs, A2avRoutingParams, ActFnType, BlockwiseDims, BlockwiseMm,
    BlockwiseMmBwd, BlockwiseMmBwdInputs, BlockwiseMmBwdParams, BlockwiseMmInputs,
    BlockwiseMmParams, ClampLimits, ExpertAffinityScaleMode, LoadBalancingLoss,
    LoadBalancingLossBwd, LoadBalancingLossBwdInputs, LoadBalancingLossInputs, OutputDType,
    Permute, PermuteBwd, PermuteBwdInputs, PermuteBwdParams, PermuteInputs, PermuteParams,
    RouterActFnType, RouterPipeline, RouterTopk, RouterTopkBwd, RouterTopkBwdInputs,
    RouterTopkBwdParams, RouterTopkInputs, RouterTopkParams, XHbmLayout,
};
use crate::error::{Error, Result, find_named};
use crate::tensor::Tensor;

/// One tensor of a kernel's contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: &'static str,
    /// Layout in contract units, e.g. `"[E, H, 2, I]"`.
    pub shape: &'static str,
    /// Accepted (inputs) or produced (outputs) dtypes.
    pub dtype: &'static str,
    /// Inputs: must be present. Outputs: always produced.
    pub required: bool,
}

const fn tensor(name: &'static str, shape: &'static str, dtype: &'static str) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        dtype,
        required: true,
    }
}

const fn optional(name: &'static str, shape: &'static str, dtype: &'static str) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        dtype,
        required: false,
    }
}

const FLOAT: &str = "f32|bf16";

/// A kernel's contract: what `moekit list` prints.
#[derive(Clone, Copy, Debug)]
pub struct KernelSpec {
    pub name: &'static str,
    pub summary: &'static str,
    pub inputs: &'static [TensorSpec],
    pub outputs: &'static [TensorSpec],
    /// Parameter names with their defaults (`None`: required).
    pub params: &'static [(Param, Option<&'static str>)],
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
        }
    }

    /// Runs the kernel on `backend` with inputs taken from `tensors` by contract name. Tensors
    /// the kernel does not use are ignored. Returns every output by name.
    pub fn run(
        self,
        backend: &dyn Backend,
        tensors: &BTreeMap<String, Tensor>,
        params: &Params,
    ) -> Result<Vec<(&'static str, Tensor)>> {
        // nki-library's blockwise kernels take B as a parameter; moekit reads it off the plan.
        let block_size = params.block_size;
        let output_dtype = params.output_dtype.unwrap_or_default();
        let required = |name: &str| {
            tensors
                .get(name)
                .ok_or_else(|| Error::MissingTensor(name.to_owned()))
        };
        let optional = |name: &str| tensors.get(name);
        let outputs = match self {
            Kernel::RouterTopk => {
                let inputs = RouterTopkInputs {
                    x: required("x")?,
                    w: required("w")?,
                    w_bias: optional("w_bias"),
                    selection_bias: optional("selection_bias"),
                };
                let params = RouterTopkParams {
                    k: required_param(Param::K, params.k)?,
                    pipeline: params.router_pipeline(),
                };
                let out = backend.router_topk(
                    &RouterTopk::new(inputs, params)?.with_output_dtype(output_dtype),
                )?;
                vec![
                    ("router_logits", out.router_logits),
                    ("expert_index", out.expert_index),
                    ("topk_affinities", out.topk_affinities),
                    ("expert_affinities", out.expert_affinities),
                ]
            }
            Kernel::RouterTopkBwd => {
                let inputs = RouterTopkBwdInputs {
                    x: required("x")?,
                    w: required("w")?,
                    router_logits: required("router_logits")?,
                    expert_index: required("expert_index")?,
                    d_topk_affinities: required("d_topk_affinities")?,
                    d_router_logits: optional("d_router_logits"),
                };
                let params = RouterTopkBwdParams {
                    pipeline: params.router_pipeline(),
                };
                let out = backend.router_topk_bwd(
                    &RouterTopkBwd::new(inputs, params)?.with_output_dtype(output_dtype),
                )?;
                vec![
                    ("d_x", out.d_x),
                    ("d_w", out.d_w),
                    ("d_w_bias", out.d_w_bias),
                ]
            }
            Kernel::LoadBalancingLoss => {
                let inputs = LoadBalancingLossInputs {
                    router_logits: required("router_logits")?,
                    expert_index: required("expert_index")?,
                };
                let out = backend.load_balancing_loss(&LoadBalancingLoss::new(inputs)?)?;
                vec![
                    ("aux_loss", out.aux_loss),
                    ("expert_counts", out.expert_counts),
                ]
            }
            Kernel::LoadBalancingLossBwd => {
                let inputs = LoadBalancingLossBwdInputs {
                    router_logits: required("router_logits")?,
                    expert_index: required("expert_index")?,
                    d_aux_loss: required("d_aux_loss")?,
                };
                let out = backend.load_balancing_loss_bwd(
                    &LoadBalancingLossBwd::new(inputs)?.with_output_dtype(output_dtype),
                )?;
                vec![("d_router_logits", out.d_router_logits)]
            }
            Kernel::Permute => {
                let inputs = PermuteInputs {
                    expert_index: required("expert_index")?,
                    topk_affinities: required("topk_affinities")?,
                };
                let params = PermuteParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                    block_size: required_param(Param::BlockSize, params.block_size)?,
                    n_block_per_iter: params.n_block_per_iter.unwrap_or(1),
                };
                let out = backend
                    .permute(&Permute::new(inputs, params)?.with_output_dtype(output_dtype))?;
                vec![
                    ("expert_counts", out.expert_counts),
                    ("token_position_to_id", out.token_position_to_id),
                    ("block_to_expert", out.block_to_expert),
                    ("expert_affinities_masked", out.expert_affinities_masked),
                    ("num_used_blocks", out.num_used_blocks),
                ]
            }
            Kernel::PermuteBwd => {
                let inputs = PermuteBwdInputs {
                    expert_index: required("expert_index")?,
                    expert_affinities_masked_grad: required("expert_affinities_masked_grad")?,
                };
                let params = PermuteBwdParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                };
                let out = backend.permute_bwd(
                    &PermuteBwd::new(inputs, params)?.with_output_dtype(output_dtype),
                )?;
                vec![("d_topk_affinities", out.d_topk_affinities)]
            }
            Kernel::BlockwiseMm => {
                let inputs = BlockwiseMmInputs {
                    gate_and_up_proj_bias: optional("gate_and_up_proj_bias"),
                    down_proj_bias: optional("down_proj_bias"),
                    ..blockwise_inputs(&required)?
                };
                let params = BlockwiseMmParams {
                    checkpoint_activation: params.checkpoint_activation.unwrap_or(false),
                    activation_function: params.activation_function.unwrap_or_default(),
                    expert_affinities_scaling_mode: params.scaling_mode.unwrap_or_default(),
                    clamp: params.clamp,
                };
                let call = BlockwiseMm::new(inputs, params)?.with_output_dtype(output_dtype);
                check_block_size(block_size, call.dims())?;
                let out = backend.blockwise_mm(&call)?;
                let mut named = vec![("output", out.output)];
                named.extend(
                    out.gate_up_activations_t
                        .map(|t| ("gate_up_activations_T", t)),
                );
                named.extend(out.down_activations.map(|t| ("down_activations", t)));
                named
            }
            Kernel::BlockwiseMmBwd => {
                let inputs = BlockwiseMmBwdInputs {
                    forward: blockwise_inputs(&required)?,
                    gate_up_proj_act_checkpoint_t: required("gate_up_proj_act_checkpoint_T")?,
                    down_proj_act_checkpoint: required("down_proj_act_checkpoint")?,
                    output_hidden_states_grad: required("output_hidden_states_grad")?,
                    expert_index: optional("expert_index"),
                };
                let params = BlockwiseMmBwdParams {
                    activation_type: params.activation_type.unwrap_or_default(),
                    expert_affinities_scaling_mode: params.scaling_mode.unwrap_or_default(),
                    clamp: params.clamp,
                    bias: params.bias.unwrap_or(false),
                };
                let call = BlockwiseMmBwd::new(inputs, params)?.with_output_dtype(output_dtype);
                check_block_size(block_size, call.dims())?;
                let out = backend.blockwise_mm_bwd(&call)?;
                let mut named = vec![
                    ("hidden_states_grad", out.hidden_states_grad),
                    (
                        "expert_affinities_masked_grad",
                        out.expert_affinities_masked_grad,
                    ),
                    ("gate_up_proj_weight_grad", out.gate_up_proj_weight_grad),
                    ("down_proj_weight_grad", out.down_proj_weight_grad),
                ];
                named.extend(out.d_topk_affinities.map(|t| ("d_topk_affinities", t)));
                named.extend(
                    out.gate_and_up_proj_bias_grad
                        .map(|t| ("gate_and_up_proj_bias_grad", t)),
                );
                named.extend(out.down_proj_bias_grad.map(|t| ("down_proj_bias_grad", t)));
                named
            }
            Kernel::A2avRouting => {
                let inputs = A2avRoutingInputs {
                    expert_index: required("expert_index")?,
                };
                let params = A2avRoutingParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                    expert_parallel_degree: required_param(
                        Param::ExpertParallelDegree,
                        params.expert_parallel_degree,
                    )?,
                };
                let out = backend.a2av_routing(&A2avRouting::new(inputs, params)?)?;
                vec![
                    ("send_indices", out.send_indices),
                    ("send_counts", out.send_counts),
                ]
            }
        };
        Ok(outputs)
    }
}

/// A `block_size` given to a blockwise kernel must be the plan's B (`token_position_to_id` holds
/// N·B slots for the N blocks of `block_to_expert`).
fn check_block_size(block_size: Option<usize>, dims: BlockwiseDims) -> Result<()> {
    match block_size {
        Some(b) if b != dims.b => Err(Error::param(
            Param::BlockSize.name(),
            format!(
                "is {b}, but the plan has B = {} (token_position_to_id holds {} slots for N = {} \
                 blocks)",
                dims.b,
                dims.n * dims.b,
                dims.n
            ),
        )),
        _ => Ok(()),
    }
}

fn blockwise_inputs<'a>(
    required: &impl Fn(&str) -> Result<&'a Tensor>,
) -> Result<BlockwiseMmInputs<'a>> {
    Ok(BlockwiseMmInputs {
        hidden_states: required("hidden_states")?,
        expert_affinities_masked: required("expert_affinities_masked")?,
        gate_up_proj_weight: required("gate_up_proj_weight")?,
        down_proj_weight: required("down_proj_weight")?,
        token_position_to_id: required("token_position_to_id")?,
        block_to_expert: required("block_to_expert")?,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
    })
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
    ExpertParallelDegree,
    OutputDType,
}

impl Param {
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
        Param::ExpertParallelDegree,
        Param::OutputDType,
    ];

    pub fn name(self) -> &'static str {
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
            Param::ExpertParallelDegree => "expert_parallel_degree",
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
            | Param::ExpertParallelDegree => "integer",
            Param::ActFn => "SOFTMAX|SIGMOID",
            Param::XHbmLayout => "0 [H,T]|1 [T,H]",
            Param::ActivationFunction | Param::ActivationType => {
                "SiLU|GELU|GELU_Tanh_Approx|Swish|ReLU|SquaredReLU"
            }
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
            Param::RouterPreNorm | Param::NormTopkProb | Param::CheckpointActivation => {
                "true|false"
            }
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
    pub expert_parallel_degree: Option<usize>,
    /// moekit's own `output_dtype`.
    pub output_dtype: Option<OutputDType>,
}

/// A parameter the kernel cannot run without.
fn required_param<T>(param: Param, value: Option<T>) -> Result<T> {
    value.ok_or_else(|| Error::param(param.name(), "required by this kernel but not given"))
}

fn parse_count(param: Param, value: &str) -> Result<usize> {
    value
        .trim()
        .parse()
        .map_err(|_| Error::param(param.name(), format!("expected an integer, got `{value}`")))
}

fn parse_limit(param: Param, value: &str) -> Result<f32> {
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

/// nki-library parameters of `router_topk` and the blockwise kernels that only choose the
/// on-chip schedule, the SBUF layout or the internal precision (or, for `return_eager_affi`, an
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
    // blockwise_mm and blockwise_mm_bwd (moekit computes and accumulates in f32 whatever
    // `compute_dtype` and `accumulation_dtype` say)
    "compute_dtype",
    "accumulation_dtype",
    "block_sharding_strategy",
    "shard_option",
    "block_tile_size",
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
                self.clamp.gate.lower = Some(parse_limit(param, value)?)
            }
            Param::GateClampUpperLimit | Param::NonLinearClampUpperLimit => {
                self.clamp.gate.upper = Some(parse_limit(param, value)?)
            }
            Param::UpClampLowerLimit | Param::LinearClampLowerLimit => {
                self.clamp.up.lower = Some(parse_limit(param, value)?)
            }
            Param::UpClampUpperLimit | Param::LinearClampUpperLimit => {
                self.clamp.up.upper = Some(parse_limit(param, value)?)
            }
            Param::Bias => self.bias = Some(parse_bool(param, value)?),
            Param::ExpertParallelDegree => {
                self.expert_parallel_degree = Some(parse_count(param, value)?)
            }
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

/// The catalog as the text table `moekit list` prints.
pub fn catalog_table() -> String {
    let mut out = String::new();
    for kernel in Kernel::ALL {
        let spec = kernel.spec();
        let _ = writeln!(out, "{}\n  {}", spec.name, spec.summary);
        for (heading, tensors) in [("inputs", spec.inputs), ("outputs", spec.outputs)] {
            let _ = writeln!(out, "  {heading}:");
            for t in tensors {
                let note = if t.required { "" } else { "  (optional)" };
                let _ = writeln!(out, "    {:<31} {:<16} {}{note}", t.name, t.shape, t.dtype);
            }
        }
        if !spec.params.is_empty() {
            let _ = writeln!(out, "  params:");
            for (param, default) in spec.params {
                let default =
                    default.map_or_else(|| "required".to_owned(), |d| format!("default {d}"));
                let _ = writeln!(
                    out,
                    "    {:<31} {:<16} {default}",
                    param.name(),
                    param.values()
                );
            }
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "nki-library parameters accepted without effect on the results: {}.",
        SCHEDULE_ONLY_PARAMS.join(", ")
    );
    out.push_str(
        "[(T+1)·E, 1] tensors are also accepted as [(T+1)·E], and block_to_expert [N, 1] as [N].\n\
         token_position_to_id holds T (the zero row of hidden_states) in padding slots.\n\
         Float outputs `like x` take input x's dtype (nki-library's), or f32 with \
         output_dtype=float32 (moekit's own).\n\
         Reference error bound: every value is computed in f64 and rounded once to f32, then to \
         bf16 for a bf16 output (indices and counts are exact).\n",
    );
    out
}

/// Where the README's kernel table ([`catalog_markdown`]) starts and ends.
pub const README_TABLE_MARKERS: (&str, &str) = (
    "<!-- kernel table: moekit list --markdown -->\n",
    "<!-- end of kernel table -->\n",
);

/// The catalog as the Markdown table of the README (`moekit list --markdown`): each kernel's
/// tensors with their layouts (`?` marks optional ones) and its parameters with their defaults.
pub fn catalog_markdown() -> String {
    let tensors = |list: &[TensorSpec]| {
        list.iter()
            .map(|t| {
                let optional = if t.required { "" } else { "?" };
                // A `|` in a layout would end the table cell.
                format!("`{} {}`{optional}", t.name, t.shape.replace('|', "\\|"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut out =
        String::from("| kernel | inputs | outputs | params (default) |\n|---|---|---|---|\n");
    for kernel in Kernel::ALL {
        let spec = kernel.spec();
        let params: Vec<String> = spec
            .params
            .iter()
            .map(|(param, default)| match default {
                Some(default) => format!("`{}` ({default})", param.name()),
                None => format!("`{}`", param.name()),
            })
            .collect();
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            spec.name,
            tensors(spec.inputs),
            tensors(spec.outputs),
            params.join(", ")
        );
    }
    out
}

const ROUTER_TOPK: KernelSpec = KernelSpec {
    name: "router_topk",
    summary: "nki-library's router: logits = x·w (+w_bias); ACT1: act_fn over all E, top-K (+selection_bias), optional renormalisation, dense affinities without it; ACT2: top-K logits, act_fn over the K; ties to the lower id",
    inputs: &[
        tensor("x", "[T, H]|[H, T]", FLOAT),
        tensor("w", "[H, E]", FLOAT),
        optional("w_bias", "[E]|[1, E]", FLOAT),
        optional("selection_bias", "[E]", FLOAT),
    ],
    outputs: &[
        tensor("router_logits", "[T, E]", "like x"),
        tensor("expert_index", "[T, K]", "i32"),
        tensor("topk_affinities", "[T, K]", "like x"),
        tensor("expert_affinities", "[T, E]", "like x"),
    ],
    params: &[
        (Param::K, None),
        (Param::ActFn, Some("SOFTMAX")),
        (Param::RouterPreNorm, Some("true")),
        (Param::NormTopkProb, Some("false")),
        (Param::XHbmLayout, Some("1")),
        (Param::OutputDType, Some("input")),
    ],
};

const ROUTER_TOPK_BWD: KernelSpec = KernelSpec {
    name: "router_topk_bwd",
    summary: "moekit's own: gradients of router_topk w.r.t. x (in its layout), w and w_bias from d_topk_affinities (+ d_router_logits)",
    inputs: &[
        tensor("x", "[T, H]|[H, T]", FLOAT),
        tensor("w", "[H, E]", FLOAT),
        tensor("router_logits", "[T, E]", FLOAT),
        tensor("expert_index", "[T, K]", "i32"),
        tensor("d_topk_affinities", "[T, K]", FLOAT),
        optional("d_router_logits", "[T, E]", FLOAT),
    ],
    outputs: &[
        tensor("d_x", "[T, H]|[H, T]", "like x"),
        tensor("d_w", "[H, E]", "like w"),
        tensor("d_w_bias", "[E]", "like w"),
    ],
    params: &[
        (Param::ActFn, Some("SOFTMAX")),
        (Param::RouterPreNorm, Some("true")),
        (Param::NormTopkProb, Some("false")),
        (Param::XHbmLayout, Some("1")),
        (Param::OutputDType, Some("input")),
    ],
};

const LOAD_BALANCING_LOSS: KernelSpec = KernelSpec {
    name: "load_balancing_loss",
    summary: "Hugging Face Qwen3-MoE aux loss E·Σ_e f_e·P_e, layers pooled as HF pools them",
    inputs: &[
        tensor("router_logits", "[L, T, E]", FLOAT),
        tensor("expert_index", "[L, T, K]", "i32"),
    ],
    outputs: &[
        tensor("aux_loss", "[1]", "f32"),
        tensor("expert_counts", "[L, E]", "i32"),
    ],
    params: &[],
};

const LOAD_BALANCING_LOSS_BWD: KernelSpec = KernelSpec {
    name: "load_balancing_loss_bwd",
    summary: "gradient of the aux loss w.r.t. router_logits",
    inputs: &[
        tensor("router_logits", "[L, T, E]", FLOAT),
        tensor("expert_index", "[L, T, K]", "i32"),
        tensor("d_aux_loss", "[1]", FLOAT),
    ],
    outputs: &[tensor("d_router_logits", "[L, T, E]", "like router_logits")],
    params: &[(Param::OutputDType, Some("input"))],
};

const PERMUTE: KernelSpec = KernelSpec {
    name: "permute",
    summary: "block plan (moekit's own) in nki-library's convention: each expert's tokens (ascending) in blocks of B, blocks by expert id, padding T, unused blocks on E−1, N = ceil((T·K−(E−1))/B)+(E−1) rounded up to n_block_per_iter",
    inputs: &[
        tensor("expert_index", "[T, K]", "i32"),
        tensor("topk_affinities", "[T, K]", FLOAT),
    ],
    outputs: &[
        tensor("expert_counts", "[E]", "i32"),
        tensor("token_position_to_id", "[N·B]", "i32"),
        tensor("block_to_expert", "[N, 1]", "i32"),
        tensor(
            "expert_affinities_masked",
            "[(T+1)·E, 1]",
            "like topk_affinities",
        ),
        tensor("num_used_blocks", "[1]", "i32"),
    ],
    params: &[
        (Param::NumExperts, None),
        (Param::BlockSize, None),
        (Param::NBlockPerIter, Some("1")),
        (Param::OutputDType, Some("input")),
    ],
};

const PERMUTE_BWD: KernelSpec = KernelSpec {
    name: "permute_bwd",
    summary: "maps an affinity gradient from the masked [(T+1)·E] layout back to [T, K]",
    inputs: &[
        tensor("expert_index", "[T, K]", "i32"),
        tensor("expert_affinities_masked_grad", "[(T+1)·E, 1]", FLOAT),
    ],
    outputs: &[tensor(
        "d_topk_affinities",
        "[T, K]",
        "like expert_affinities_masked_grad",
    )],
    params: &[
        (Param::NumExperts, None),
        (Param::OutputDType, Some("input")),
    ],
};

const BLOCKWISE_INPUTS: [TensorSpec; 6] = [
    tensor("hidden_states", "[T+1, H]", FLOAT),
    tensor("expert_affinities_masked", "[(T+1)·E, 1]", FLOAT),
    tensor("gate_up_proj_weight", "[E, H, 2, I]", FLOAT),
    tensor("down_proj_weight", "[E, I, H]", FLOAT),
    tensor("token_position_to_id", "[N·B]", "i32"),
    tensor("block_to_expert", "[N, 1]", "i32"),
];

const BLOCKWISE_MM: KernelSpec = KernelSpec {
    name: "blockwise_mm",
    summary: "nki-library's moe_cte: per block, gather, gate_up matmul (+bias, clamped), act(gate)⊙up, down matmul (+bias), scale by affinity, scatter-add into [T+1, H]",
    inputs: &[
        BLOCKWISE_INPUTS[0],
        BLOCKWISE_INPUTS[1],
        BLOCKWISE_INPUTS[2],
        BLOCKWISE_INPUTS[3],
        BLOCKWISE_INPUTS[4],
        BLOCKWISE_INPUTS[5],
        optional("gate_and_up_proj_bias", "[E, 2, I]", FLOAT),
        optional("down_proj_bias", "[E, H]", FLOAT),
    ],
    outputs: &[
        tensor("output", "[T+1, H]", "like hidden_states"),
        optional(
            "gate_up_activations_T",
            "[N, 2, I, B]",
            "like gate_up_proj_weight",
        ),
        optional("down_activations", "[N, B, H]", "like down_proj_weight"),
    ],
    params: &[
        (Param::BlockSize, Some("the plan's B")),
        (Param::CheckpointActivation, Some("false")),
        (Param::ActivationFunction, Some("SiLU")),
        (Param::ExpertAffinitiesScalingMode, Some("POST_SCALE")),
        (Param::GateClampLowerLimit, Some("none")),
        (Param::GateClampUpperLimit, Some("none")),
        (Param::UpClampLowerLimit, Some("none")),
        (Param::UpClampUpperLimit, Some("none")),
        (Param::OutputDType, Some("input")),
    ],
};

const BLOCKWISE_MM_BWD: KernelSpec = KernelSpec {
    name: "blockwise_mm_bwd",
    summary: "nki-library's blockwise_mm_bwd: gradients of blockwise_mm from its checkpoints; with expert_index also d_topk_affinities (moekit's own)",
    inputs: &[
        BLOCKWISE_INPUTS[0],
        BLOCKWISE_INPUTS[1],
        BLOCKWISE_INPUTS[2],
        BLOCKWISE_INPUTS[3],
        BLOCKWISE_INPUTS[4],
        BLOCKWISE_INPUTS[5],
        tensor("gate_up_proj_act_checkpoint_T", "[N, 2, I, B]", FLOAT),
        tensor("down_proj_act_checkpoint", "[N, B, H]", FLOAT),
        tensor("output_hidden_states_grad", "[T+1, H]", FLOAT),
        optional("expert_index", "[T, K]", "i32"),
    ],
    outputs: &[
        tensor("hidden_states_grad", "[T+1, H]", "like hidden_states"),
        tensor(
            "expert_affinities_masked_grad",
            "[(T+1)·E, 1]",
            "like expert_affinities_masked",
        ),
        tensor(
            "gate_up_proj_weight_grad",
            "[E, H, 2, I]",
            "like gate_up_proj_weight",
        ),
        tensor(
            "down_proj_weight_grad",
            "[E, I, H]",
            "like down_proj_weight",
        ),
        optional(
            "d_topk_affinities",
            "[T, K]",
            "like expert_affinities_masked",
        ),
        optional(
            "gate_and_up_proj_bias_grad",
            "[E, 2, I]",
            "like gate_up_proj_weight",
        ),
        optional("down_proj_bias_grad", "[E, H]", "like down_proj_weight"),
    ],
    params: &[
        (Param::BlockSize, Some("the plan's B")),
        (Param::ActivationType, Some("SiLU")),
        (Param::ExpertAffinitiesScalingMode, Some("POST_SCALE")),
        (Param::Bias, Some("false")),
        (Param::NonLinearClampLowerLimit, Some("none")),
        (Param::NonLinearClampUpperLimit, Some("none")),
        (Param::LinearClampLowerLimit, Some("none")),
        (Param::LinearClampUpperLimit, Some("none")),
        (Param::OutputDType, Some("input")),
    ],
};

const A2AV_ROUTING: KernelSpec = KernelSpec {
    name: "a2av_routing",
    summary: "moekit's own: nki-library's expert-parallel routing table (permute_a2av, unpermute_a2av): column d of send_indices the tokens sent to rank d, ascending, T when empty",
    inputs: &[tensor("expert_index", "[T, K]", "i32")],
    outputs: &[
        tensor("send_indices", "[T, EP]", "i32"),
        tensor("send_counts", "[1, EP]", "i32"),
    ],
    params: &[
        (Param::NumExperts, None),
        (Param::ExpertParallelDegree, None),
    ],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readme_kernel_table_is_the_catalog() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
        let (begin, end) = README_TABLE_MARKERS;
        let start = readme
            .find(begin)
            .expect("README.md has the table's start marker")
            + begin.len();
        let len = readme[start..]
            .find(end)
            .expect("README.md has the table's end marker");
        assert_eq!(
            &readme[start..start + len],
            catalog_markdown(),
            "README.md's kernel table differs from the catalog: paste `moekit list --markdown`"
        );
    }
}
