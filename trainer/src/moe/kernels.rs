//! Experts on moekit's kernels ([`moekit::experts::LocalExperts`]: `permute` +
//! `blockwise_mm`), with the backward (`blockwise_mm_bwd` on the forward's validated call)
//! stitched into autograd through the [`Tape`].

use std::sync::Arc;

use anyhow::Result;
use moekit::contracts::OutputDType;
use moekit::experts::{ExpertWeights, ExpertsSaved, LocalExperts, RoutedTokens};
use moekit::{Backend, BackendKind};
use moekit_tools::torch::{from_tch, to_tch};
use tch::{Device, Tensor};

use super::{Experts, lend};
use crate::tape::{ExternalBackward, Tape, needs_backward};
use crate::threads::release_openmp_workers;

/// moekit's experts on one backend. The forward runs outside autograd, on the tensors as
/// libtorch holds them (lent, not copied), and checkpoints its activations; the backward
/// returns the gradients of `x`, the affinities and both weights.
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

/// The experts of `backend` in the layer's dtype.
fn local_experts(backend: &dyn Backend, block_size: usize) -> LocalExperts<'_> {
    LocalExperts {
        backend,
        block_size,
        output_dtype: OutputDType::Input,
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
        // From here to the output, moekit's kernels run and libtorch waits.
        release_openmp_workers();
        let tokens = RoutedTokens {
            hidden_states: lend("hidden_states", &x.detach())?,
            expert_index: from_tch("expert_index", expert_index)?,
            topk_affinities: from_tch("topk_affinities", &affinities.detach())?,
        };
        let weights = [
            lend("gate_up_proj_weight", gate_up)?,
            lend("down_proj_weight", down)?,
        ];
        // Without a gradient to compute (evaluation, no_grad) there is nothing to record.
        let differentiable = needs_backward(&[x, affinities, gate_up, down]);
        let experts = local_experts(self.backend.as_ref(), self.block_size);
        let (output, saved) = experts.forward(expert_weights(&weights), tokens, differentiable)?;
        let output = to_tch(&output).to_kind(x.kind());
        let Some(saved) = saved else {
            return Ok(output);
        };
        let output = output.set_requires_grad(true);
        tape.record(Box::new(KernelBackward {
            backend: Arc::clone(&self.backend),
            block_size: self.block_size,
            weights,
            saved,
            inputs: [x, affinities, gate_up, down].map(Tensor::shallow_clone),
            output: output.shallow_clone(),
        }));
        Ok(output)
    }
}

/// `[gate_up [E, H, 2, I], down [E, I, H]]` as the kernels take them.
fn expert_weights(weights: &[moekit::Tensor; 2]) -> ExpertWeights<'_> {
    ExpertWeights {
        gate_up_proj_weight: &weights[0],
        down_proj_weight: &weights[1],
    }
}

/// The backward of one [`KernelExperts::forward`].
struct KernelBackward {
    backend: Arc<dyn Backend>,
    block_size: usize,
    /// The forward's `[gate_up, down]`, lent by libtorch.
    weights: [moekit::Tensor; 2],
    saved: ExpertsSaved,
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
        let output_grad = lend("output_hidden_states_grad", output_grad)?;
        let experts = local_experts(self.backend.as_ref(), self.block_size);
        let grads = experts.backward(expert_weights(&self.weights), &self.saved, &output_grad)?;
        Ok(input_gradients(
            &self.inputs,
            [
                grads.d_hidden_states,
                grads.d_topk_affinities,
                grads.d_gate_up_proj_weight,
                grads.d_down_proj_weight,
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
