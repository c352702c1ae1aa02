//! Kernels that nki-library fuses on the device and the host backends compose from their own
//! pieces (moekit's own arrangement; the contracts are nki-library's):
//! `rmsnorm_router_topk_tkg` is a backend's RMSNorm ([`RmsNorm`]) followed by its
//! `router_topk` (ACT2), and its backward the router's backward followed by the RMSNorm's;
//! `moe_block_tkg` is the RMSNorm, the backend's `router_topk` and its `moe_tkg`.
//! What is composed here is only the plumbing between the pieces, so each backend's results
//! keep that backend's error bound.

use crate::backend::Backend;
use crate::contracts::tensors::{moe_block_tkg as blk, rmsnorm_router_topk_tkg as fwd};
use crate::contracts::{
    ComputeDType, MoeBlockTkg, MoeBlockTkgDims, MoeBlockTkgOutputs, MoeTkg, MoeTkgInputs,
    OutputDType, RmsNormRouterDims, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd,
    RmsNormRouterTopkTkgGrads, RmsNormRouterTopkTkgOutputs, RmsNormSpec, RouterTopk, RouterTopkBwd,
    RouterTopkBwdInputs, RouterTopkBwdParams, RouterTopkInputs, RouterTopkParams,
};
use crate::error::Result;
use crate::tensor::{DType, Floats, Tensor};

/// `[T, H]` f32 rows as a tensor of float `dtype`, each value rounded once (a value past
/// bf16's range an error naming `name`).
fn rows_tensor(name: &str, rows: &[f32], (t, h): (usize, usize), dtype: DType) -> Result<Tensor> {
    Tensor::from_f32([t, h], rows.to_vec())?.into_float_dtype(name, dtype)
}

/// A host backend's RMSNorm, `y = x / sqrt(Σ_h x² / divisor + eps) ⊙ gamma` per row of
/// `x [T, H]`, and its backward.
pub(crate) trait RmsNorm {
    /// `y [T, H]`.
    fn forward(&self, spec: RmsNormSpec, x: Floats<'_>, gamma: Floats<'_>) -> Result<Vec<f32>>;

    /// `(d_x [T, H], d_gamma [H])` from `d_y [T, H]`.
    fn backward(
        &self,
        spec: RmsNormSpec,
        x: Floats<'_>,
        gamma: Floats<'_>,
        d_y: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)>;
}

/// The router call that reads `router_input` (the norm in `router_mm_dtype`), with f32 outputs
/// so each output is rounded once, by the caller.
fn router_call<'a>(
    router_input: &'a Tensor,
    router_weights: &'a Tensor,
    router_bias: Option<&'a Tensor>,
    k: usize,
    pipeline: crate::contracts::RouterPipeline,
) -> Result<RouterTopk<'a>> {
    let inputs = RouterTopkInputs {
        x: router_input,
        w: router_weights,
        w_bias: router_bias,
        selection_bias: None,
    };
    Ok(RouterTopk::new(inputs, RouterTopkParams { k, pipeline })?
        .with_output_dtype(OutputDType::Float32))
}

/// `rmsnorm_router_topk_tkg` on `backend`, whose RMSNorm is `norm`.
pub(crate) fn rmsnorm_router_topk_tkg(
    backend: &dyn Backend,
    norm: &impl RmsNorm,
    call: &RmsNormRouterTopkTkg<'_>,
) -> Result<RmsNormRouterTopkTkgOutputs> {
    let (inputs, floats, params) = (call.inputs(), call.floats(), call.params());
    let RmsNormRouterDims { t, h, k, .. } = call.dims();
    let rows = norm.forward(call.rmsnorm(), floats.hidden_states, floats.gamma)?;
    let router_input = rows_tensor(
        fwd::NORM_OUTPUT.name,
        &rows,
        (t, h),
        params.shared.router_mm_dtype.dtype(),
    )?;
    let router = router_call(
        &router_input,
        inputs.router_weights,
        inputs.router_bias,
        k,
        params.shared.router_pipeline(),
    )?;
    let routed = backend.router_topk(&router)?;
    let norm_output = rows_tensor(
        fwd::NORM_OUTPUT.name,
        &rows,
        (t, h),
        call.output_dtype_of(&fwd::NORM_OUTPUT),
    )?;
    let expert_affinities = if params.shared.store_eager_affi_only {
        routed.topk_affinities
    } else {
        routed.expert_affinities
    };
    call.cast_outputs(RmsNormRouterTopkTkgOutputs {
        norm_output,
        expert_index: routed.expert_index,
        expert_affinities,
    })
}

/// `rmsnorm_router_topk_tkg_bwd` on `backend`, whose RMSNorm is `norm`: the forward's norm and
/// logits recomputed, the router's backward (ACT2) from the selected affinities' gradient, then
/// the RMSNorm's from the norm's.
pub(crate) fn rmsnorm_router_topk_tkg_bwd(
    backend: &dyn Backend,
    norm: &impl RmsNorm,
    call: &RmsNormRouterTopkTkgBwd<'_>,
) -> Result<RmsNormRouterTopkTkgGrads> {
    let (inputs, floats, params) = (call.inputs(), call.floats(), call.params());
    let RmsNormRouterDims { t, h, e, k } = call.dims();
    let spec = call.rmsnorm();
    let rows = norm.forward(spec, floats.hidden_states, floats.gamma)?;
    let router_input = rows_tensor(
        fwd::NORM_OUTPUT.name,
        &rows,
        (t, h),
        params.router_mm_dtype.dtype(),
    )?;
    let pipeline = params.router_pipeline();
    let forward = router_call(
        &router_input,
        inputs.router_weights,
        inputs.router_bias,
        k,
        pipeline,
    )?;
    let router_logits = backend.router_topk(&forward)?.router_logits;
    let d_topk_affinities = call.d_topk_affinities()?;
    let router_bwd = RouterTopkBwd::new(
        RouterTopkBwdInputs {
            x: &router_input,
            w: inputs.router_weights,
            router_logits: &router_logits,
            expert_index: inputs.expert_index,
            d_topk_affinities: &d_topk_affinities,
            d_router_logits: None,
        },
        // The router's gradients in f32 whatever `router_mm_dtype` is: it rounds the forward's
        // operands only.
        RouterTopkBwdParams {
            pipeline,
            compute_dtype: Some(ComputeDType::FLOAT32),
        },
    )?
    .with_output_dtype(OutputDType::Float32);
    let router_grads = backend.router_topk_bwd(&router_bwd)?;
    let mut d_norm = router_grads.d_x.f32_values().into_owned();
    if let Some(d) = inputs.d_norm_output {
        for (acc, d) in d_norm.iter_mut().zip(d.f32_values().iter()) {
            *acc += d;
        }
    }
    let (d_x, d_gamma) = norm.backward(spec, floats.hidden_states, floats.gamma, &d_norm)?;
    let bias_shape = inputs
        .router_bias
        .map_or_else(|| vec![1, e], |bias| bias.shape().to_vec());
    call.cast_outputs(RmsNormRouterTopkTkgGrads {
        d_hidden_states: Tensor::from_f32(inputs.hidden_states.shape(), d_x)?,
        d_gamma: Tensor::from_f32(inputs.gamma.shape(), d_gamma)?,
        d_router_weights: router_grads.d_w,
        d_router_bias: router_grads.d_w_bias.reshaped(bias_shape)?,
    })
}

/// `moe_block_tkg` on `backend`, whose RMSNorm is `norm`: the norm rounded to `inp`'s dtype (the
/// experts' input), the backend's `router_topk` on it in `router_mm_dtype`, and its `moe_tkg` on
/// the norm with the router's f32 affinities and ids.
pub(crate) fn moe_block_tkg(
    backend: &dyn Backend,
    norm: &impl RmsNorm,
    call: &MoeBlockTkg<'_>,
) -> Result<MoeBlockTkgOutputs> {
    let (inputs, floats, params) = (call.inputs(), call.floats(), call.params());
    let MoeBlockTkgDims { t, h, k, .. } = call.dims();
    let rows = norm.forward(call.rmsnorm(), floats.hidden_states, floats.gamma)?;
    let name = format!("{} (its RMSNorm)", blk::INP.name);
    let x = rows_tensor(&name, &rows, (t, h), inputs.inp.dtype())?;
    let router_input = x
        .clone()
        .into_float_dtype(&name, params.router_mm_dtype.dtype())?;
    let router = router_call(
        &router_input,
        inputs.router_weights,
        inputs.router_bias,
        k,
        params.router_pipeline(),
    )?;
    let routed = backend.router_topk(&router)?;
    let experts = MoeTkg::with_scanned_experts(
        MoeTkgInputs {
            hidden_input: &x,
            expert_gate_up_weights: inputs.expert_gate_up_weights,
            expert_down_weights: inputs.expert_down_weights,
            expert_affinities: &routed.expert_affinities,
            expert_index: &routed.expert_index,
            rank_id: inputs.rank_id,
            expert_gate_up_bias: inputs.expert_gate_up_bias,
            expert_down_bias: inputs.expert_down_bias,
            expert_affinities_eager: None,
        },
        params.moe_tkg(),
    )?
    .with_output_dtype(OutputDType::Float32);
    let out = backend.moe_tkg(&experts)?.output;
    call.cast_outputs(MoeBlockTkgOutputs {
        out,
        router_logits: (!params.skip_router_logits).then_some(routed.router_logits),
    })
}
