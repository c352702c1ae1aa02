//! The declaration of a kernel's tensors: each tensor's name (nki-library's where it has one),
//! layout and dtype is one [`TensorSpec`] constant in its contract module, which the input
//! checks, the catalog (`moekit list`, the README's table), the by-name binding of `moekit
//! run`, the output dtypes and the `neuron` backend's NEFF binding all read.

use std::fmt;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The dtypes a tensor of a contract takes or is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DTypeSpec {
    /// An input in f32 or bf16.
    Float,
    /// Indices or counts, i32.
    Index,
    /// An input in f32, bf16 or i32 (read as numbers, or compared with zero).
    Any,
    /// An output in the dtype of the input it belongs to (nki-library's), or f32 with
    /// [`super::OutputDType::Float32`].
    Like(&'static TensorSpec),
    /// An output that is f32 whatever the inputs.
    F32,
    /// An input that must be bf16 (its bits carry more than a value), or an output nki-library
    /// writes in bf16 whatever the inputs (f32 with [`super::OutputDType::Float32`]).
    BF16,
}

impl fmt::Display for DTypeSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Float => f.pad("f32|bf16"),
            Self::Index => f.pad("i32"),
            Self::Any => f.pad("f32|bf16|i32"),
            Self::Like(input) => f.pad(&format!("like {}", input.name)),
            Self::F32 => f.pad("f32"),
            Self::BF16 => f.pad("bf16"),
        }
    }
}

/// One tensor of a kernel contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: &'static str,
    /// Layout in contract units, e.g. `"[E, H, 2, I]"`.
    pub shape: &'static str,
    pub dtype: DTypeSpec,
    /// Inputs: must be present. Outputs: always produced.
    pub required: bool,
}

impl TensorSpec {
    /// A required tensor.
    pub const fn new(name: &'static str, shape: &'static str, dtype: DTypeSpec) -> Self {
        Self {
            name,
            shape,
            dtype,
            required: true,
        }
    }

    /// The same tensor, optional (an input a call may omit, an output some calls produce).
    pub const fn optional(self) -> Self {
        Self {
            required: false,
            ..self
        }
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` {}", self.name, self.shape)
    }
}

/// A float input.
pub(crate) const fn float(name: &'static str, shape: &'static str) -> TensorSpec {
    TensorSpec::new(name, shape, DTypeSpec::Float)
}

/// An input of any dtype.
pub(crate) const fn any(name: &'static str, shape: &'static str) -> TensorSpec {
    TensorSpec::new(name, shape, DTypeSpec::Any)
}

/// An i32 input or output.
pub(crate) const fn index(name: &'static str, shape: &'static str) -> TensorSpec {
    TensorSpec::new(name, shape, DTypeSpec::Index)
}

/// A float output in the dtype of input `input`.
pub(crate) const fn like(
    name: &'static str,
    shape: &'static str,
    input: &'static TensorSpec,
) -> TensorSpec {
    TensorSpec::new(name, shape, DTypeSpec::Like(input))
}

/// A kernel's tensors, by their specs: what a validated call lends a backend (inputs) or a
/// backend returns (outputs), in contract order; absent optional tensors are left out.
pub type Named<'a> = Vec<(&'static TensorSpec, &'a Tensor)>;

/// The tensor `spec` names in `named`.
pub fn find<'a>(named: &Named<'a>, spec: &TensorSpec) -> Option<&'a Tensor> {
    named
        .iter()
        .find(|(s, _)| s.name == spec.name)
        .map(|&(_, tensor)| tensor)
}

/// How an allocation error names output `spec`: "output `name`".
pub(crate) fn output(spec: &TensorSpec) -> String {
    output_named(spec.name)
}

/// How an allocation error names the output called `name`: "output `name`".
pub(crate) fn output_named(name: &str) -> String {
    format!("output `{name}`")
}

/// The input `spec` that `get` finds, or the error naming it as missing.
pub(crate) fn required<'a>(
    get: &impl Fn(&TensorSpec) -> Option<&'a Tensor>,
    spec: &TensorSpec,
) -> Result<&'a Tensor> {
    get(spec).ok_or_else(|| Error::MissingTensor(spec.name.to_owned()))
}
