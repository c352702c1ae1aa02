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

use anyhow::{Context, Result, bail, ensure};
use moekit::backend::PlannedCall;
use moekit::contracts::{OutputDType, WeightLayout};
use moekit::cpu::CpuBackend;
use moekit::ep::{Communicator, ShardedExperts};
use moekit::experts::{Experts as _, ExpertsSizes, LocalExperts};
use moekit::fallback::FallbackBackend;
use moekit::kernel::Kernel;
use moekit::neuron::{NeuronBackend, NeuronConfig};
use moekit::{Backend, BackendKind};
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::{JobConfig, Kernels};
use crate::model::ModelName;
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
    /// moekit's neuron backend: the experts' `blockwise_mm` and `blockwise_mm_bwd` as NEFFs
    /// through libnrt (see [`NEURON_KERNELS`]), backward stitched into autograd.
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

    /// The moekit backend of `reference`, `cpu` and `neuron`, the implementations that run
    /// moekit's kernels on the host (and so can exchange tokens between ranks).
    pub fn kernel_backend(self) -> Option<BackendKind> {
        match self {
            MoeImpl::Reference => Some(BackendKind::Reference),
            MoeImpl::Cpu => Some(BackendKind::Cpu),
            MoeImpl::Neuron => Some(BackendKind::Neuron),
            MoeImpl::Torch | MoeImpl::GroupedMm => None,
        }
    }

    /// The backend moekit's experts run on (`neuron`: where it finds its runtime and manifest).
    /// `neuron` runs the kernels of [`NEURON_KERNELS`] as NEFFs and the block plan on `cpu`; a
    /// manifest that cannot be read, or that registers no NEFF of one of those kernels, is an
    /// error.
    fn experts_backend(self, neuron: NeuronConfig) -> Result<Option<Arc<dyn Backend>>> {
        let Some(kind) = self.kernel_backend() else {
            return Ok(None);
        };
        if kind != BackendKind::Neuron {
            return Ok(Some(Arc::from(kind.create())));
        }
        let neuron = NeuronBackend::new(neuron);
        let manifest = neuron.config().manifest.display().to_string();
        for kernel in NEURON_KERNELS {
            let registered = neuron
                .supports(kernel)
                .context("kernels.moe = \"neuron\": its kernel manifest")?;
            ensure!(
                registered,
                "kernels.moe = \"neuron\" runs {} as NEFFs, but the kernel manifest {manifest} \
                 registers no {} NEFF; `moekit-train neffs --config FILE` lists the entries a \
                 config needs",
                NEURON_KERNELS.map(Kernel::name).join(" and "),
                kernel.name()
            );
        }
        let backend = FallbackBackend::new(Box::new(neuron), BackendKind::Cpu.create())?;
        Ok(Some(Arc::new(backend)))
    }

    /// This rank's experts of an expert-parallel run over `comm` (moekit's kernels only; the
    /// config checks it).
    pub fn create_expert_parallel(
        self,
        kernels: &Kernels,
        comm: Rc<dyn Communicator>,
        num_experts: usize,
    ) -> Result<Box<dyn Experts>> {
        let Some(backend) = self.experts_backend(neuron_config(kernels))? else {
            bail!(
                "expert parallelism runs moekit's kernels: kernels.moe must be reference, cpu \
                 or neuron, got {}",
                self.name()
            );
        };
        let comm = Rc::new(TimedComm::new(comm));
        let experts = ShardedExperts {
            backend,
            comm: Rc::clone(&comm) as Rc<dyn Communicator>,
            num_experts,
            block_size: kernels.block_size,
        };
        Ok(Box::new(KernelExperts::new(experts, Some(comm))))
    }

    /// Instantiates the implementation; `block_size` is the moekit block plan's B (`neuron`
    /// finds its runtime and manifest as [`NeuronConfig::from_env`] says).
    pub fn create(self, block_size: usize) -> Result<Box<dyn Experts>> {
        self.create_with(block_size, NeuronConfig::from_env())
    }

    /// `kernels.moe` with `kernels`' block size, runtime and manifest.
    pub fn create_for(kernels: &Kernels) -> Result<Box<dyn Experts>> {
        kernels
            .moe
            .create_with(kernels.block_size, neuron_config(kernels))
    }

    fn create_with(self, block_size: usize, neuron: NeuronConfig) -> Result<Box<dyn Experts>> {
        if let Some(backend) = self.experts_backend(neuron)? {
            let experts = LocalExperts {
                backend,
                block_size,
                // The layer's dtype.
                output_dtype: OutputDType::Input,
                weight_layout: WeightLayout::Nki,
            };
            return Ok(Box::new(KernelExperts::new(experts, None)));
        }
        Ok(match self {
            MoeImpl::GroupedMm => Box::new(GroupedMmExperts),
            _ => Box::new(TorchLoopExperts),
        })
    }
}

/// The kernels `kernels.moe = "neuron"` runs on NeuronCores: the experts' products. The block
/// plan (`permute`, which nki-library ships no kernel for) runs on `cpu`, the router and the
/// auxiliary loss in libtorch, as for every implementation.
pub const NEURON_KERNELS: [Kernel; 2] = [Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd];

/// Where the `neuron` backend finds its runtime and manifest: `kernels`' paths, else the
/// environment's.
fn neuron_config(kernels: &Kernels) -> NeuronConfig {
    let from_env = NeuronConfig::from_env();
    NeuronConfig {
        library: kernels.neuron_runtime.clone().or(from_env.library),
        manifest: kernels.neuron_manifest.clone().unwrap_or(from_env.manifest),
    }
}

/// The experts calls training `config` makes on each rank, as (sizes, whether a backward
/// follows): a training step's micro-batch of `batch_size · seq_len` tokens, forward and
/// backward, and with a validation split the validation loss's forward of as many tokens.
/// None for the dense Qwen3, which has no experts.
fn training_calls(config: &JobConfig) -> Vec<(ExpertsSizes, bool)> {
    let model = &config.model;
    if model.name != ModelName::Qwen3Moe {
        return Vec::new();
    }
    let sizes = ExpertsSizes {
        t: config.training.batch_size * config.training.seq_len,
        h: model.hidden_size,
        e: model.num_experts,
        k: model.num_experts_per_tok,
        i: model.moe_intermediate_size,
    };
    let mut calls = vec![(sizes, true)];
    if config.data.has_validation() {
        calls.push((sizes, false));
    }
    calls
}

/// Readies `experts` for training `config`, or says what they lack (a `neuron` run's
/// missing runtime, manifest, entry or NEFF), before the first step.
pub fn prepare(experts: &dyn Experts, config: &JobConfig) -> Result<()> {
    for (sizes, record) in training_calls(config) {
        experts.prepare(sizes, record).with_context(|| {
            format!(
                "kernels.moe = \"{}\" cannot run this config's experts",
                config.kernels.moe.name()
            )
        })?;
    }
    Ok(())
}

/// The kernel calls of compiled shapes training `config` makes on each rank with moekit's
/// experts ([`training_calls`], in dispatch's layout under expert parallelism): what a
/// `neuron` run needs NEFFs for.
pub fn planned_calls(config: &JobConfig) -> Result<Vec<PlannedCall>> {
    let ranks = config.parallelism.expert_parallel_degree;
    // The plan of the experts on any backend (the calls do not depend on it).
    let experts = LocalExperts {
        backend: Arc::new(CpuBackend),
        block_size: config.kernels.block_size,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    };
    let mut calls = Vec::new();
    for (sizes, record) in training_calls(config) {
        let sizes = match ranks {
            1 => sizes,
            _ => ShardedExperts::local_sizes(sizes, ranks)?,
        };
        calls.extend(experts.planned_calls(sizes, record)?);
    }
    Ok(calls)
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

    /// Readies the implementation for calls of `sizes` (with `record`, forwards whose backward
    /// follows), or says what it lacks: a `neuron` run's NEFFs are found and loaded.
    fn prepare(&self, _sizes: ExpertsSizes, _record: bool) -> Result<()> {
        Ok(())
    }

    /// Wall time spent exchanging tokens with other ranks since the last call (expert
    /// parallelism's dispatch and combine, forward and backward); `None` for implementations
    /// that exchange nothing.
    fn take_exchange_time(&self) -> Option<Duration> {
        None
    }
}
