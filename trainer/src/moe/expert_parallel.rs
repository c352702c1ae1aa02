//! Experts sharded over the ranks of a communicator (expert parallelism): each rank holds
//! `E/R` experts of every MoE layer, and tokens travel to the ranks that own their experts
//! through moekit's dispatch and combine ([`ShardedExperts`]), with the backward stitched into
//! autograd through the [`Tape`] as for [`super::kernels::KernelExperts`].
//!
//! Every rank runs the same layers in the same order, so the collectives of the forward and of
//! the tape's backward line up across ranks. An error of one rank's kernels reaches every rank
//! (every rank's verdict on its inputs travels ahead of the payload of each exchange).

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use anyhow::Result;
use moekit::ep::{Communicator, ShardedExperts, ShardedInputs, ShardedSaved};
use moekit_tools::torch::{from_tch, to_tch};

use super::kernels::input_gradients;
use moekit::{Backend, BackendKind};
use tch::{Device, Tensor};

use super::{Experts, lend};
use crate::tape::{ExternalBackward, Tape, needs_backward};
use crate::threads::release_openmp_workers;

/// The experts of this rank on moekit's kernels; the other ranks' experts are reached through
/// the communicator.
pub struct ExpertParallelExperts {
    group: Rc<ExpertGroup>,
}

/// What the forward and every recorded backward share.
struct ExpertGroup {
    backend: Box<dyn Backend>,
    comm: Rc<dyn Communicator>,
    /// E, experts over all ranks.
    num_experts: usize,
    block_size: usize,
    /// Exchange time accumulated since [`Experts::take_exchange_time`] last read it.
    exchange_time: Cell<Duration>,
}

impl ExpertGroup {
    fn add_exchange_time(&self, time: Duration) {
        self.exchange_time.set(self.exchange_time.get() + time);
    }

    fn sharded(&self) -> ShardedExperts<'_> {
        ShardedExperts {
            backend: self.backend.as_ref(),
            comm: self.comm.as_ref(),
            num_experts: self.num_experts,
            block_size: self.block_size,
        }
    }
}

impl ExpertParallelExperts {
    pub fn new(
        backend: BackendKind,
        comm: Rc<dyn Communicator>,
        num_experts: usize,
        block_size: usize,
    ) -> Self {
        Self {
            group: Rc::new(ExpertGroup {
                backend: backend.create(),
                comm,
                num_experts,
                block_size,
                exchange_time: Cell::new(Duration::ZERO),
            }),
        }
    }
}

/// The forward's inputs in moekit's layout.
struct Saved {
    /// `[T, H]`.
    x: moekit::Tensor,
    /// `[T, K]` i32, global expert ids.
    expert_index: moekit::Tensor,
    /// `[T, K]`.
    topk_affinities: moekit::Tensor,
    /// `[E/R, H, 2, I]`.
    gate_up: moekit::Tensor,
    /// `[E/R, I, H]`.
    down: moekit::Tensor,
}

impl Saved {
    fn inputs(&self) -> ShardedInputs<'_> {
        ShardedInputs {
            x: &self.x,
            expert_index: &self.expert_index,
            topk_affinities: &self.topk_affinities,
            gate_up_proj_weight: &self.gate_up,
            down_proj_weight: &self.down,
        }
    }
}

impl Experts for ExpertParallelExperts {
    fn needs_graph_cuts(&self) -> bool {
        true
    }

    /// `x [T, H]` (this rank's tokens), `expert_index [T, K]` (global ids), `affinities
    /// [T, K]`, and this rank's `gate_up [E/R, H, 2, I]` and `down [E/R, I, H]`.
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
            "expert parallelism runs moekit's kernels on the CPU, but the activations are on {:?}",
            x.device()
        );
        release_openmp_workers();
        let saved = Saved {
            x: lend("x", x)?,
            expert_index: from_tch("expert_index", expert_index)?,
            topk_affinities: from_tch("topk_affinities", &affinities.detach())?,
            gate_up: lend("gate_up_proj_weight", gate_up)?,
            down: lend("down_proj_weight", down)?,
        };
        let (output, experts) = self.group.sharded().forward(saved.inputs())?;
        self.group.add_exchange_time(experts.exchange_time());
        let output = to_tch(&output).to_kind(x.kind());
        let differentiable = needs_backward(&[x, affinities, gate_up, down]);
        if !differentiable {
            return Ok(output);
        }
        let output = output.set_requires_grad(true);
        tape.record(Box::new(ExpertParallelBackward {
            group: Rc::clone(&self.group),
            saved,
            experts,
            inputs: [x, affinities, gate_up, down].map(Tensor::shallow_clone),
            output: output.shallow_clone(),
        }));
        Ok(output)
    }

    fn take_exchange_time(&self) -> Option<Duration> {
        Some(self.group.exchange_time.replace(Duration::ZERO))
    }
}

/// The backward of one [`ExpertParallelExperts::forward`]: a collective, run by every rank for
/// the same layer at the same point of the tape.
struct ExpertParallelBackward {
    group: Rc<ExpertGroup>,
    saved: Saved,
    experts: ShardedSaved,
    /// `x`, `affinities`, `gate_up`, `down` as the forward received them (with their graphs).
    inputs: [Tensor; 4],
    output: Tensor,
}

impl ExternalBackward for ExpertParallelBackward {
    fn output(&self) -> &Tensor {
        &self.output
    }

    fn backward(&self, output_grad: &Tensor) -> Result<Vec<(Tensor, moekit::Tensor)>> {
        release_openmp_workers();
        let d_output = lend("output_hidden_states_grad", output_grad)?;
        let grads = self
            .group
            .sharded()
            .backward(self.saved.inputs(), &self.experts, &d_output)?;
        self.group.add_exchange_time(grads.exchange_time);
        Ok(input_gradients(
            &self.inputs,
            [
                grads.d_x,
                grads.d_topk_affinities,
                grads.d_gate_up_proj_weight,
                grads.d_down_proj_weight,
            ],
        ))
    }
}
