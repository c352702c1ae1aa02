//! The MoE experts' implementations, chosen by `[kernels] moe = "..."`.
//!
//! Every implementation computes, for routed tokens `x [T, H]` with `expert_index [T, K]` and
//! `affinities [T, K]`, the combined expert output
//! `y[t] = Σ_k affinities[t, k] · down_e(silu(x_t · W[e, :, 0, :]) ⊙ (x_t · W[e, :, 1, :]))`
//! with `e = expert_index[t, k]`, on weights in the kernels' layout: `gate_up [E, H, 2, I]`
//! and `down [E, I, H]`. They differ only in how, so the trainer switches between them by
//! configuration alone. With expert parallelism, [`KernelExperts`] runs moekit's sharded
//! experts: this rank's `E/R` experts, tokens exchanged with the other ranks.

mod grouped_mm;
mod kernels;
mod torch_loop;

use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Result, bail};
use moekit::contracts::OutputDType;
use moekit::ep::{Communicator, ShardedExperts};
use moekit::experts::LocalExperts;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::parallel::TimedComm;
use crate::tape::Tape;

pub use grouped_mm::{GroupedMmExperts, check_alignment as check_grouped_mm_alignment};
pub use kernels::KernelExperts;
pub use torch_loop::TorchLoopExperts;

/// The implementations `[kernels] moe` can name.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MoeImpl {
    /// Hugging Face's eager per-expert loop, in libtorch ops (autograd).
    Torch,
    /// `torch._grouped_mm` over tokens sorted by expert (autograd).
    GroupedMm,
    /// moekit's reference kernels (f64 oracle), backward stitched into autograd.
    Reference,
    /// moekit's cpu kernels, backward stitched into autograd (the default).
    #[default]
    Cpu,
    /// moekit's neuron backend (NEFF kernels through libnrt).
    Neuron,
}

impl MoeImpl {
    /// Every implementation, in the order the documentation lists them.
    pub const ALL: &'static [MoeImpl] = &[
        MoeImpl::Torch,
        MoeImpl::GroupedMm,
        MoeImpl::Reference,
        MoeImpl::Cpu,
        MoeImpl::Neuron,
    ];

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            MoeImpl::Torch => "torch",
            MoeImpl::GroupedMm => "grouped_mm",
            MoeImpl::Reference => "reference",
            MoeImpl::Cpu => "cpu",
            MoeImpl::Neuron => "neuron",
        }
    }

    /// Whether the implementation runs on a CUDA device (libtorch's own ops); moekit's
    /// kernels run on the host.
    pub fn runs_on_cuda(self) -> bool {
        matches!(self, MoeImpl::Torch | MoeImpl::GroupedMm)
    }

    /// The moekit backend of `reference` and `cpu`, the implementations that run moekit's
    /// kernels on the host (and so can exchange tokens between ranks).
    pub fn kernel_backend(self) -> Option<moekit::BackendKind> {
        match self {
            MoeImpl::Reference => Some(moekit::BackendKind::Reference),
            MoeImpl::Cpu => Some(moekit::BackendKind::Cpu),
            _ => None,
        }
    }

    /// This rank's experts of an expert-parallel run over `comm` (moekit's kernels only; the
    /// config checks it).
    pub fn create_expert_parallel(
        self,
        comm: Rc<dyn Communicator>,
        num_experts: usize,
        block_size: usize,
    ) -> Result<Box<dyn Experts>> {
        let Some(backend) = self.kernel_backend() else {
            bail!(
                "expert parallelism runs moekit's kernels: kernels.moe must be reference or cpu, \
                 got {}",
                self.name()
            );
        };
        let comm = Rc::new(TimedComm::new(comm));
        let experts = ShardedExperts {
            backend: Arc::from(backend.create()),
            comm: Rc::clone(&comm) as Rc<dyn Communicator>,
            num_experts,
            block_size,
        };
        Ok(Box::new(KernelExperts::new(experts, Some(comm))))
    }

    /// Instantiates the implementation; `block_size` is the moekit block plan's B.
    pub fn create(self, block_size: usize) -> Result<Box<dyn Experts>> {
        if let Some(backend) = self.kernel_backend() {
            let experts = LocalExperts {
                backend: Arc::from(backend.create()),
                block_size,
                // The layer's dtype.
                output_dtype: OutputDType::Input,
            };
            return Ok(Box::new(KernelExperts::new(experts, None)));
        }
        Ok(match self {
            MoeImpl::Torch => Box::new(TorchLoopExperts),
            MoeImpl::GroupedMm => Box::new(GroupedMmExperts),
            // `neuron` (reference and cpu returned above).
            _ => bail!(
                "kernels.moe = \"neuron\": moekit's neuron backend runs only the kernels \
                 the NKI library provides (router_topk, blockwise_mm, blockwise_mm_bwd), and \
                 training also needs router_topk_bwd, permute and the aux loss; \
                 choose one of torch, grouped_mm, reference, cpu"
            ),
        })
    }
}

/// `tensor` (an activation, a gradient or a parameter of this step) lent to moekit's kernels
/// in place, or converted where it cannot be lent (see [`moekit_tools::torch::lend_to_moekit`]).
///
/// Nothing writes to these tensors while the kernels' records hold them: the model updates no
/// activation or gradient in place, and parameters change only in the optimizer step, which
/// runs after [`Tape::backward`] has consumed (and dropped) every record of the step; a
/// forward without a gradient to compute drops its inputs before it returns.
fn lend(name: &str, tensor: &Tensor) -> Result<moekit::Tensor> {
    // SAFETY: nothing writes to `tensor` while the lent tensor lives (see above).
    Ok(unsafe { moekit_tools::torch::lend_to_moekit(name, tensor) }?)
}

/// One implementation of the MoE experts.
pub trait Experts {
    /// Whether the implementation runs outside autograd, so the model must cut the graph
    /// before it (see [`Tape`]).
    fn needs_graph_cuts(&self) -> bool;

    /// The combined expert output `[T, H]` for `x [T, H]`, `expert_index [T, K]` (i64),
    /// `affinities [T, K]`, `gate_up [E, H, 2, I]` and `down [E, I, H]`, all of `x`'s dtype
    /// except the index.
    fn forward(
        &self,
        x: &Tensor,
        expert_index: &Tensor,
        affinities: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        tape: &mut Tape,
    ) -> Result<Tensor>;

    /// Wall time spent exchanging tokens with other ranks since the last call (expert
    /// parallelism's dispatch and combine, forward and backward); `None` for implementations
    /// that exchange nothing.
    fn take_exchange_time(&self) -> Option<Duration> {
        None
    }
}
