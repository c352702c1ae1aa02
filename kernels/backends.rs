//! The backends this build provides ([`BackendKind`]) and their selection by name at run time.

use std::fmt;
use std::str::FromStr;

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::error::{Error, Result, find_named};
use crate::neuron::{NeuronBackend, NeuronConfig};
use crate::reference::ReferenceBackend;

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

    /// Instantiates the backend, configured from the environment.
    pub fn create(self) -> Box<dyn Backend> {
        self.create_with(BackendOptions::from_env())
    }

    /// The backend of this kind, configured by `options`.
    pub fn create_with(self, options: BackendOptions) -> Box<dyn Backend> {
        match self {
            BackendKind::Reference => Box::new(ReferenceBackend),
            BackendKind::Cpu => Box::new(CpuBackend),
            BackendKind::Neuron => Box::new(NeuronBackend::new(options.neuron)),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Reference => ReferenceBackend::NAME,
            BackendKind::Cpu => CpuBackend::NAME,
            BackendKind::Neuron => NeuronBackend::NAME,
        }
    }
}

/// What creating a backend may need beyond its kind.
#[derive(Clone, Debug)]
pub struct BackendOptions {
    /// Where the `neuron` backend finds libnrt and its kernel manifest.
    pub neuron: NeuronConfig,
}

impl BackendOptions {
    /// Every option from the environment (see [`NeuronConfig::from_env`]).
    pub fn from_env() -> Self {
        Self {
            neuron: NeuronConfig::from_env(),
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
