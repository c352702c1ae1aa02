//! Experts on moekit's kernels (`permute` + `blockwise_mm`), with the backward
//! (`blockwise_mm_bwd`) stitched into autograd through the [`Tape`].

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use moekit::contracts::{
    BlockwiseMm, BlockwiseMmBwd, BlockwiseMmBwdInputs, BlockwiseMmBwdParams, BlockwiseMmInputs,
    BlockwiseMmParams, Permute, PermuteInputs, PermuteOutputs, PermuteParams,
};
use moekit::{Backend, BackendKind};
use moekit_tools::torch::{from_tch, to_tch};
use tch::{Device, Tensor};

use super::{Experts, lend};
use crate::tape::{ExternalBackward, Tape, needs_backward};
use crate::threads::release_openmp_workers;

/// moekit's `permute` and `blockwise_mm` on one backend. The forward runs outside autograd,
/// on the tensors as libtorch holds them (lent, not copied; the padding token is appended as
/// row T of `hidden_states`), and checkpoints its activations; the backward returns the
/// gradients of `x`, the affinities and both weights.
pub struct KernelExperts {
    backend: Arc<dyn Backend>,
    block_size: usize,
}

impl KernelExperts {
    pub fn new(backend: BackendKind, block_size: usize) -> Self {
        Self {
            backend: Arc::from(backend.create()),
            block_size,
        }
    }
}

impl Experts for KernelExperts {
    fn needs_graph_cuts(&self) -> bool {
        true
    }

    fn forward(
        &self,
        x: &Tensor,
        expert_index: &Tensor,
        affinities: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        tape: &mut Tape,
    ) -> Result<Tensor> {
        anyhow::ensure!(
            x.device() == Device::Cpu,
            "kernels.moe = \"{}\" runs on the CPU, but the activations are on {:?}",
            self.backend.name(),
            x.device()
        );
        let experts = gate_up.size()[0] as usize;
        let padded = with_padding_row(&x.detach());
        // From here to the output, moekit's kernels run and libtorch waits.
        release_openmp_workers();
        let expert_index_i32 = from_tch("expert_index", expert_index)?;
        let topk = from_tch("topk_affinities", &affinities.detach())?;
        let plan = self.backend.permute(&Permute::new(
            PermuteInputs {
                expert_index: &expert_index_i32,
                topk_affinities: &topk,
            },
            PermuteParams::new(experts, self.block_size),
        )?)?;
        let saved = Saved {
            hidden_states: lend("hidden_states", &padded)?,
            expert_index: expert_index_i32,
            gate_up: lend("gate_up_proj_weight", gate_up)?,
            down: lend("down_proj_weight", down)?,
            plan,
        };
        // Without a gradient to compute (evaluation, no_grad) there is nothing to record.
        let differentiable = needs_backward(&[x, affinities, gate_up, down]);
        let out = self.backend.blockwise_mm(&BlockwiseMm::new(
            saved.forward_inputs(),
            BlockwiseMmParams {
                checkpoint_activation: differentiable,
                ..BlockwiseMmParams::default()
            },
        )?)?;
        // `output [T+1, H]` without its padding row.
        let tokens = x.size()[0] as usize;
        let output = to_tch(&out.output.into_leading_rows("output", tokens)?).to_kind(x.kind());
        if !differentiable {
            return Ok(output);
        }
        let output = output.set_requires_grad(true);
        let (Some(gate_up_activations_t), Some(down_activations)) =
            (out.gate_up_activations_t, out.down_activations)
        else {
            bail!("blockwise_mm returned no checkpoints");
        };
        tape.record(Box::new(KernelBackward {
            backend: Arc::clone(&self.backend),
            saved,
            gate_up_activations_t,
            down_activations,
            inputs: [x, affinities, gate_up, down].map(Tensor::shallow_clone),
            output: output.shallow_clone(),
        }));
        Ok(output)
    }
}

/// `rows [T, H]` followed by a zero row: the blockwise kernels' `[T+1, H]` layout, whose row T
/// is the padding token's.
fn with_padding_row(rows: &Tensor) -> Tensor {
    Tensor::cat(
        &[
            rows,
            &rows.new_zeros([1, rows.size()[1]], (rows.kind(), rows.device())),
        ],
        0,
    )
}

/// The forward's inputs in moekit's layout.
struct Saved {
    /// `[T+1, H]`.
    hidden_states: moekit::Tensor,
    /// `[T, K]` i32.
    expert_index: moekit::Tensor,
    /// `[E, H, 2, I]`.
    gate_up: moekit::Tensor,
    /// `[E, I, H]`.
    down: moekit::Tensor,
    plan: PermuteOutputs,
}

impl Saved {
    fn forward_inputs(&self) -> BlockwiseMmInputs<'_> {
        BlockwiseMmInputs {
            hidden_states: &self.hidden_states,
            expert_affinities_masked: &self.plan.expert_affinities_masked,
            gate_up_proj_weight: &self.gate_up,
            down_proj_weight: &self.down,
            token_position_to_id: &self.plan.token_position_to_id,
            block_to_expert: &self.plan.block_to_expert,
            gate_and_up_proj_bias: None,
            down_proj_bias: None,
        }
    }
}

/// The backward of one [`KernelExperts::forward`].
struct KernelBackward {
    backend: Arc<dyn Backend>,
    saved: Saved,
    /// `[N, 2, I, B]`.
    gate_up_activations_t: moekit::Tensor,
    /// `[N, B, H]`.
    down_activations: moekit::Tensor,
    /// `x`, `affinities`, `gate_up`, `down` as the forward received them (with their graphs).
    inputs: [Tensor; 4],
    output: Tensor,
}

impl ExternalBackward for KernelBackward {
    fn output(&self) -> &Tensor {
        &self.output
    }

    fn backward(&self, output_grad: &Tensor) -> Result<Vec<(Tensor, moekit::Tensor)>> {
        release_openmp_workers();
        // `[T+1, H]`: the padding row's gradient is zero.
        let output_grad = with_padding_row(output_grad);
        let output_grad = lend("output_hidden_states_grad", &output_grad)?;
        let grads = self.backend.blockwise_mm_bwd(&BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: self.saved.forward_inputs(),
                gate_up_proj_act_checkpoint_t: &self.gate_up_activations_t,
                down_proj_act_checkpoint: &self.down_activations,
                output_hidden_states_grad: &output_grad,
                expert_index: Some(&self.saved.expert_index),
            },
            BlockwiseMmBwdParams::default(),
        )?)?;
        let tokens = output_grad.shape()[0] - 1;
        let d_affinities = grads
            .d_topk_affinities
            .context("blockwise_mm_bwd returned no d_topk_affinities")?;
        Ok(input_gradients(
            &self.inputs,
            [
                grads
                    .hidden_states_grad
                    .into_leading_rows("hidden_states_grad", tokens)?,
                d_affinities,
                grads.gate_up_proj_weight_grad,
                grads.down_proj_weight_grad,
            ],
        ))
    }
}

/// The experts' four differentiable inputs (`x`, the affinities, `gate_up`, `down`), each
/// paired with its kernel gradient.
pub(super) fn input_gradients(
    inputs: &[Tensor; 4],
    grads: [moekit::Tensor; 4],
) -> Vec<(Tensor, moekit::Tensor)> {
    inputs
        .iter()
        .map(Tensor::shallow_clone)
        .zip(grads)
        .collect()
}
