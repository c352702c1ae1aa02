//! Running any kernel by name on a map of named tensors (what `moekit run` and other front ends
//! do): the inputs are taken by contract name, the [`Params`] turned into the kernel's typed
//! parameters, and every output returned by name.

use std::collections::BTreeMap;

use crate::backend::Backend;
use crate::contracts::{
    A2avRouting, A2avRoutingInputs, A2avRoutingParams, BlockwiseDims, BlockwiseMm, BlockwiseMmBwd,
    BlockwiseMmBwdInputs, BlockwiseMmBwdParams, BlockwiseMmInputs, BlockwiseMmParams,
    FindNonzeroIndices, FindNonzeroIndicesInputs, FindNonzeroIndicesParams, IndexedFlatten,
    IndexedFlattenInputs, IndexedFlattenParams, LoadBalancingLoss, LoadBalancingLossBwd,
    LoadBalancingLossBwdInputs, LoadBalancingLossInputs, MoeBlockTkg, MoeBlockTkgInputs, MoeTkg,
    MoeTkgInputs, MoeTkgParams, Permute, PermuteBwd, PermuteBwdInputs, PermuteBwdParams,
    PermuteInputs, PermuteParams, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd,
    RmsNormRouterTopkTkgBwdInputs, RmsNormRouterTopkTkgInputs, RmsNormRouterTopkTkgParams,
    RouterTopk, RouterTopkBwd, RouterTopkBwdInputs, RouterTopkBwdParams, RouterTopkInputs,
    RouterTopkParams, TensorSpec, Topk, TopkInputs, TopkParams, TopkReduce, TopkReduceInputs,
    TopkReduceParams,
};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, Param, Params};
use crate::tensor::Tensor;

impl Kernel {
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
        let get = |spec: &TensorSpec| tensors.get(spec.name);
        let outputs = match self {
            Kernel::RouterTopk => {
                let params = RouterTopkParams {
                    k: required_param(Param::K, params.k)?,
                    pipeline: params.router_pipeline(),
                };
                let call = RouterTopk::new(RouterTopkInputs::from_named(get)?, params)?;
                let call = call.with_output_dtype(output_dtype);
                backend.router_topk(&call)?.into_named()
            }
            Kernel::RouterTopkBwd => {
                let params = RouterTopkBwdParams {
                    pipeline: params.router_pipeline(),
                    compute_dtype: params.compute_dtype,
                };
                let call = RouterTopkBwd::new(RouterTopkBwdInputs::from_named(get)?, params)?;
                let call = call.with_output_dtype(output_dtype);
                backend.router_topk_bwd(&call)?.into_named()
            }
            Kernel::LoadBalancingLoss => {
                let call = LoadBalancingLoss::new(LoadBalancingLossInputs::from_named(get)?)?;
                backend.load_balancing_loss(&call)?.into_named()
            }
            Kernel::LoadBalancingLossBwd => {
                let inputs = LoadBalancingLossBwdInputs::from_named(get)?;
                let call = LoadBalancingLossBwd::new(inputs)?.with_output_dtype(output_dtype);
                backend.load_balancing_loss_bwd(&call)?.into_named()
            }
            Kernel::Permute => {
                let params = PermuteParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                    block_size: required_param(Param::BlockSize, params.block_size)?,
                    n_block_per_iter: params
                        .n_block_per_iter
                        .unwrap_or(PermuteParams::DEFAULT_N_BLOCK_PER_ITER),
                    skip_dma: params.skip_dma(),
                };
                let call = Permute::new(PermuteInputs::from_named(get)?, params)?;
                backend
                    .permute(&call.with_output_dtype(output_dtype))?
                    .into_named()
            }
            Kernel::PermuteBwd => {
                let params = PermuteBwdParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                    skip_dma: params.skip_dma(),
                };
                let call = PermuteBwd::new(PermuteBwdInputs::from_named(get)?, params)?;
                backend
                    .permute_bwd(&call.with_output_dtype(output_dtype))?
                    .into_named()
            }
            Kernel::BlockwiseMm => {
                let default = BlockwiseMmParams::default();
                let params = BlockwiseMmParams {
                    checkpoint_activation: params
                        .checkpoint_activation
                        .unwrap_or(default.checkpoint_activation),
                    activation_function: params
                        .activation_function
                        .unwrap_or(default.activation_function),
                    expert_affinities_scaling_mode: params
                        .scaling_mode
                        .unwrap_or(default.expert_affinities_scaling_mode),
                    clamp: params.clamp,
                    skip_dma: params.skip_dma(),
                    is_tensor_update_accumulating: params
                        .is_tensor_update_accumulating
                        .unwrap_or(default.is_tensor_update_accumulating),
                    weight_layout: params.weight_layout.unwrap_or(default.weight_layout),
                    compute_dtype: params.compute_dtype,
                };
                let call = BlockwiseMm::new(BlockwiseMmInputs::from_named(get)?, params)?
                    .with_output_dtype(output_dtype);
                check_block_size(block_size, call.dims())?;
                backend.blockwise_mm(&call)?.into_named()
            }
            Kernel::BlockwiseMmBwd => {
                let default = BlockwiseMmBwdParams::default();
                let params = BlockwiseMmBwdParams {
                    activation_type: params.activation_type.unwrap_or(default.activation_type),
                    expert_affinities_scaling_mode: params
                        .scaling_mode
                        .unwrap_or(default.expert_affinities_scaling_mode),
                    clamp: params.clamp,
                    bias: params.bias.unwrap_or(default.bias),
                    skip_dma: params.skip_dma(),
                    is_tensor_update_accumulating: params
                        .is_tensor_update_accumulating
                        .unwrap_or(default.is_tensor_update_accumulating),
                    weight_layout: params.weight_layout.unwrap_or(default.weight_layout),
                    compute_dtype: params.compute_dtype,
                };
                let call = BlockwiseMmBwd::new(BlockwiseMmBwdInputs::from_named(get)?, params)?
                    .with_output_dtype(output_dtype);
                check_block_size(block_size, call.dims())?;
                backend.blockwise_mm_bwd(&call)?.into_named()
            }
            Kernel::A2avRouting => {
                let params = A2avRoutingParams {
                    num_experts: required_param(Param::NumExperts, params.num_experts)?,
                    expert_parallel_degree: required_param(
                        Param::ExpertParallelDegree,
                        params.expert_parallel_degree,
                    )?,
                };
                let call = A2avRouting::new(A2avRoutingInputs::from_named(get)?, params)?;
                backend.a2av_routing(&call)?.into_named()
            }
            Kernel::MoeTkg => {
                let default =
                    MoeTkgParams::new(required_param(Param::IsAllExpert, params.is_all_expert)?);
                let params = MoeTkgParams {
                    expert_affinities_scaling_mode: params
                        .scaling_mode
                        .unwrap_or(default.expert_affinities_scaling_mode),
                    activation_fn: params.activation_fn.unwrap_or(default.activation_fn),
                    clamp: params.clamp,
                    mask_unselected_experts: params
                        .mask_unselected_experts
                        .unwrap_or(default.mask_unselected_experts),
                    ..default
                };
                let call = MoeTkg::new(MoeTkgInputs::from_named(get)?, params)?
                    .with_output_dtype(output_dtype);
                backend.moe_tkg(&call)?.into_named()
            }
            Kernel::RmsNormRouterTopkTkg => {
                let default = RmsNormRouterTopkTkgParams::default();
                let params = RmsNormRouterTopkTkgParams {
                    top_k: params.top_k.unwrap_or(default.top_k),
                    quantization_type: params
                        .quantization_type
                        .unwrap_or(default.quantization_type),
                    shared: params.rmsnorm_router(),
                };
                let inputs = RmsNormRouterTopkTkgInputs::from_named(get)?;
                let call =
                    RmsNormRouterTopkTkg::new(inputs, params)?.with_output_dtype(output_dtype);
                backend.rmsnorm_router_topk_tkg(&call)?.into_named()
            }
            Kernel::RmsNormRouterTopkTkgBwd => {
                let inputs = RmsNormRouterTopkTkgBwdInputs::from_named(get)?;
                let call = RmsNormRouterTopkTkgBwd::new(inputs, params.rmsnorm_router())?
                    .with_output_dtype(output_dtype);
                backend.rmsnorm_router_topk_tkg_bwd(&call)?.into_named()
            }
            Kernel::MoeBlockTkg => {
                let inputs = MoeBlockTkgInputs::from_named(get)?;
                let call =
                    MoeBlockTkg::new(inputs, params.moe_block())?.with_output_dtype(output_dtype);
                backend.moe_block_tkg(&call)?.into_named()
            }
            Kernel::Topk => {
                let default = TopkParams::new(required_param(Param::K, params.k)?);
                let params = TopkParams {
                    sorted_flag: params.sorted_flag.unwrap_or(default.sorted_flag),
                    method: params.method.unwrap_or(default.method),
                    ..default
                };
                let call = Topk::new(TopkInputs::from_named(get)?, params)?
                    .with_output_dtype(output_dtype);
                backend.topk(&call)?.into_named()
            }
            Kernel::TopkReduce => {
                let params = TopkReduceParams {
                    token_base_index: params
                        .token_base_index
                        .unwrap_or(TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX),
                    ..TopkReduceParams::new(
                        required_param(Param::TokenCount, params.token_count)?,
                        required_param(Param::RowsPerToken, params.rows_per_token)?,
                    )
                };
                let call = TopkReduce::new(TopkReduceInputs::from_named(get)?, params)?
                    .with_output_dtype(output_dtype);
                backend.topk_reduce(&call)?.into_named()
            }
            Kernel::FindNonzeroIndices => {
                let params = FindNonzeroIndicesParams {
                    n_cols: params.n_cols,
                    chunk_size: params.chunk_size,
                };
                let inputs = FindNonzeroIndicesInputs::from_named(get)?;
                let call = FindNonzeroIndices::new(inputs, params)?;
                backend.find_nonzero_indices(&call)?.into_named()
            }
            Kernel::IndexedFlatten => {
                let params = IndexedFlattenParams {
                    f_len: required_param(Param::FLen, params.f_len)?,
                    output_len: required_param(Param::OutputLen, params.output_len)?,
                    padding_val: params
                        .padding_val
                        .unwrap_or(IndexedFlattenParams::DEFAULT_PADDING_VAL),
                };
                let call = IndexedFlatten::new(IndexedFlattenInputs::from_named(get)?, params)?;
                backend.indexed_flatten(&call)?.into_named()
            }
        };
        Ok(outputs
            .into_iter()
            .map(|(spec, tensor)| (spec.name, tensor))
            .collect())
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

/// A parameter the kernel cannot run without.
fn required_param<T>(param: Param, value: Option<T>) -> Result<T> {
    value.ok_or_else(|| Error::param(param.name(), "required by this kernel but not given"))
}
