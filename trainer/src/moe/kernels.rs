//! Experts on moekit's kernels, through [`moekit::experts::Experts`]: all E of them on this
//! rank ([`LocalExperts`](moekit::experts::LocalExperts): `permute` + `blockwise_mm`), or this
//! rank's E/R with tokens exchanged over the rank group
//! ([`ShardedExperts`](moekit::ep::ShardedExperts): dispatch … combine). One implementation
//! serves both: the forward runs outside autograd, on the tensors as libtorch holds them (lent,
//! not copied), and checkpoints its activations; the backward (`blockwise_mm_bwd` on the
//! forward's validated call, and the exchanges' backward when sharded) is stitched into
//! autograd through the [`Tape`] and returns the gradients of `x`, the affinities and both
//! weights.
//!
//! Sharded, every rank runs the same layers in the same order, so the collectives of the
//! forward and of the tape's backward line up across ranks; an error of one rank's kernels
//! reaches every rank (every rank's verdict on its inputs travels ahead of the payload of each
//! exchange).

use std::rc::Rc;
use std::time::Duration;

use anyhow::Result;
use moekit::experts::{Experts as MoekitExperts, ExpertsInputs, ExpertsSizes};
use moekit::threads::release_openmp_workers;
use moekit_tools::torch::from_tch;
use tch::{Device, Tensor};

use super::{Experts, lend};
use crate::parallel::TimedComm;
use crate::shim;
use crate::tape::{ExternalBackward, Tape, needs_backward};

/// moekit's experts `E` (one rank's or sharded) in the trainer's autograd.
pub struct KernelExperts<E> {
    experts: Rc<E>,
    /// The communicator of sharded experts, which times their exchanges (`None` on one rank).
    exchanges: Option<Rc<TimedComm>>,
}

impl<E: MoekitExperts> KernelExperts<E> {
    /// `experts`; `exchanges` is the communicator they exchange tokens over, if any.
    pub fn new(experts: E, exchanges: Option<Rc<TimedComm>>) -> Self {
        Self {
            experts: Rc::new(experts),
            exchanges,
        }
    }
}

/// A forward's inputs in moekit's layout, kept for its backward.
struct Inputs {
    /// `[T, H]`.
    hidden_states: moekit::Tensor,
    /// `[T, K]` i32.
    expert_index: moekit::Tensor,
    /// `[T, K]`.
    topk_affinities: moekit::Tensor,
    /// `[E, H, 2, I]` (this rank's E/R when sharded).
    gate_up_proj_weight: moekit::Tensor,
    /// `[E, I, H]`.
    down_proj_weight: moekit::Tensor,
}

impl Inputs {
    fn borrowed(&self) -> ExpertsInputs<'_> {
        ExpertsInputs {
            hidden_states: &self.hidden_states,
            expert_index: &self.expert_index,
            topk_affinities: &self.topk_affinities,
            gate_up_proj_weight: &self.gate_up_proj_weight,
            down_proj_weight: &self.down_proj_weight,
            up_proj_weight: None,
        }
    }
}

impl<E: MoekitExperts + 'static> Experts for KernelExperts<E> {
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
            "moekit's kernels (kernels.moe = \"reference\", \"cpu\" or \"neuron\") take \
             host tensors, but the activations are on {:?}",
            x.device()
        );
        // From here to the output, moekit's kernels run and libtorch waits.
        release_openmp_workers();
        let inputs = Inputs {
            hidden_states: lend("hidden_states", &x.detach())?,
            expert_index: from_tch("expert_index", expert_index)?,
            topk_affinities: from_tch("topk_affinities", &affinities.detach())?,
            gate_up_proj_weight: lend("gate_up_proj_weight", gate_up)?,
            down_proj_weight: lend("down_proj_weight", down)?,
        };
        // Without a gradient to compute (evaluation, no_grad) there is nothing to record.
        let differentiable = needs_backward(&[x, affinities, gate_up, down]);
        let (output, saved) = self.experts.forward(inputs.borrowed(), differentiable)?;
        let output = shim::into_tch(output)?.to_kind(x.kind());
        let Some(saved) = saved else {
            return Ok(output);
        };
        let output = output.set_requires_grad(true);
        tape.record(Box::new(KernelBackward {
            experts: Rc::clone(&self.experts),
            inputs,
            saved,
            graph_inputs: [x, affinities, gate_up, down].map(Tensor::shallow_clone),
            output: output.shallow_clone(),
        }));
        Ok(output)
    }

    fn prepare(&self, sizes: ExpertsSizes, record: bool) -> Result<()> {
        Ok(self.experts.prepare(sizes, record)?)
    }

    fn take_exchange_time(&self) -> Option<Duration> {
        self.exchanges.as_ref().map(|comm| comm.take_time())
    }
}

/// The backward of one [`KernelExperts::forward`] (sharded: a collective, run by every rank for
/// the same layer at the same point of the tape).
struct KernelBackward<E: MoekitExperts> {
    experts: Rc<E>,
    /// The forward's inputs, lent by libtorch.
    inputs: Inputs,
    saved: E::Saved,
    /// `x`, `affinities`, `gate_up`, `down` as the forward received them (with their graphs).
    graph_inputs: [Tensor; 4],
    output: Tensor,
}

impl<E: MoekitExperts> ExternalBackward for KernelBackward<E> {
    fn output(&self) -> &Tensor {
        &self.output
    }

    fn backward(&self, output_grad: &Tensor) -> Result<Vec<(Tensor, moekit::Tensor)>> {
        release_openmp_workers();
        let output_grad = lend("output_hidden_states_grad", output_grad)?;
        let grads = self
            .experts
            .backward(self.inputs.borrowed(), &self.saved, &output_grad)?;
        let grads = [
            grads.d_hidden_states,
            grads.d_topk_affinities,
            grads.d_gate_up_proj_weight,
            grads.d_down_proj_weight,
        ];
        Ok(self
            .graph_inputs
            .iter()
            .map(Tensor::shallow_clone)
            .zip(grads)
            .collect())
    }
}
