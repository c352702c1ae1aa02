//! The backend abstraction: every implementation of the kernel contracts (reference, cpu and
//! neuron) implements [`Backend`] and is chosen at run time by name.
//!
//! Backends receive validated calls only (see [`crate::contracts`]), so input errors are
//! reported identically whichever backend runs.

use std::fmt;
use std::str::FromStr;

use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseMm, BlockwiseMmBwd, BlockwiseMmGrads,
    BlockwiseMmOutputs, LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads,
    LoadBalancingLossOutputs, Permute, PermuteBwd, PermuteGrads, PermuteOutputs, RouterTopk,
    RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs,
};
use crate::cpu::CpuBackend;
use crate::error::{Error, Result, find_named};
use crate::neuron::{NeuronBackend, NeuronConfig};
use crate::reference::ReferenceBackend;

/// One implementation of every kernel contract, forward and backward.
pub trait Backend: Send + Sync {
    /// The name used to select this backend (`--backend NAME`).
    fn name(&self) -> &'static str;
    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs>;
    fn router_topk_bwd(&self, call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads>;
    fn load_balancing_loss(&self, call: &LoadBalancingLoss<'_>)
    -> Result<LoadBalancingLossOutputs>;
    fn load_balancing_loss_bwd(
        &self,
        call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads>;
    fn permute(&self, call: &Permute<'_>) -> Result<PermuteOutputs>;
    fn permute_bwd(&self, call: &PermuteBwd<'_>) -> Result<PermuteGrads>;
    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs>;
    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads>;
    fn a2av_routing(&self, call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs>;
}

/// The backends this build provides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// Plain f64 loops: the oracle for every other backend.
    #[default]
    Reference,
    /// Tuned f32/bf16 kernels on the host CPU: packed GEMMs, SIMD, rayon.
    Cpu,
    /// NEFFs on Trainium NeuronCores through libnrt, picked from a kernel manifest; see
    /// [`crate::neuron::backend`] for where it finds the runtime and the manifest.
    Neuron,
}

impl BackendKind {
    /// Every backend, in the order `moekit list` shows them.
    pub const ALL: &'static [BackendKind] = &[
        BackendKind::Reference,
        BackendKind::Cpu,
        BackendKind::Neuron,
    ];

    /// Instantiates the backend.
    pub fn create(self) -> Box<dyn Backend> {
        match self {
            BackendKind::Reference => Box::new(ReferenceBackend),
            BackendKind::Cpu => Box::new(CpuBackend),
            BackendKind::Neuron => Box::new(NeuronBackend::new(NeuronConfig::from_env())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Reference => "reference",
            BackendKind::Cpu => "cpu",
            BackendKind::Neuron => "neuron",
        }
    }
}

impl FromStr for BackendKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        find_named(Self::ALL, Self::name, s).map_err(|known| Error::UnknownBackend {
            name: s.to_owned(),
            known,
        })
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}
