//! Which dtype a kernel's floating-point outputs take.
//!
//! nki-library's kernels write each output in the dtype of the input it belongs to: `output` in
//! `hidden_states`' dtype, the checkpoints in their weights', every gradient in its tensor's,
//! `router_logits` and the affinities in `x`'s ([`OutputDType::Input`], the default). moekit
//! adds [`OutputDType::Float32`] (`--param output_dtype=float32`): every floating-point output
//! f32 whatever the inputs, as nki-library's newer `blockwise_mm_bwd` gives with f32
//! `*_grad_out` buffers. Either way moekit accumulates in f32 (f64 on the `reference` backend)
//! and rounds each value once into the output; indices and counts stay i32.

use std::fmt;
use std::str::FromStr;

use super::spec::{self, DTypeSpec, Named, TensorSpec};
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// moekit's own `output_dtype` parameter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutputDType {
    /// `input`: each output in the dtype of the input it belongs to, as nki-library writes it.
    #[default]
    Input,
    /// `float32`: every floating-point output f32.
    Float32,
}

impl OutputDType {
    /// Every value, in the order `moekit list` shows them.
    pub const ALL: [OutputDType; 2] = [OutputDType::Input, OutputDType::Float32];

    /// The parameter's name.
    pub const PARAM: &'static str = "output_dtype";

    pub fn name(self) -> &'static str {
        match self {
            Self::Input => "input",
            Self::Float32 => "float32",
        }
    }

    /// The dtype of an output that belongs to an input of dtype `input`.
    pub fn resolve(self, input: DType) -> DType {
        match self {
            Self::Input => input,
            Self::Float32 => DType::F32,
        }
    }

    /// The dtype this choice gives output `spec` in a call with `inputs`: an output
    /// [`DTypeSpec::Like`] an input takes that input's dtype (or f32), a [`DTypeSpec::BF16`]
    /// one bf16 (or f32), an [`DTypeSpec::F32`] one f32; `None` for outputs whose dtype is not chosen (indices, and floats in the dtype
    /// the kernel computes them in).
    pub fn dtype_of(self, spec: &TensorSpec, inputs: &Named<'_>) -> Option<DType> {
        match spec.dtype {
            DTypeSpec::Like(input) => {
                Some(self.resolve(spec::find(inputs, input).map_or(DType::F32, Tensor::dtype)))
            }
            DTypeSpec::F32 => Some(DType::F32),
            DTypeSpec::BF16 => Some(self.resolve(DType::BF16)),
            DTypeSpec::Float | DTypeSpec::Index | DTypeSpec::Any => None,
        }
    }

    /// `output`, declared by `spec`, in the dtype this choice gives it in a call with `inputs`
    /// ([`Self::dtype_of`]): unchanged when it already has it, else rounded once (to nearest
    /// even). Indices are returned as they are.
    pub fn cast(self, spec: &TensorSpec, output: Tensor, inputs: &Named<'_>) -> Result<Tensor> {
        match self.dtype_of(spec, inputs) {
            Some(dtype) => output.into_float_dtype(spec.name, dtype),
            None => Ok(output),
        }
    }
}

impl FromStr for OutputDType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|value| value.name() == s)
            .ok_or_else(|| {
                Error::param(Self::PARAM, format!("expected input or float32, got `{s}`"))
            })
    }
}

impl fmt::Display for OutputDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::contracts::tensors::router_topk::{EXPERT_INDEX, ROUTER_LOGITS, X};

    #[test]
    fn input_keeps_the_input_dtype_and_float32_widens_exactly() {
        let x = Tensor::from_f32([3], vec![1.0, 1.0 + f32::EPSILON, -2.5]).unwrap();
        let (bf16_x, f32_x) = (x.to_bf16(), x.clone());
        let bf16_inputs: Named<'_> = vec![(&X, &bf16_x)];
        let bf16 = OutputDType::Input
            .cast(&ROUTER_LOGITS, x.clone(), &bf16_inputs)
            .unwrap();
        assert_eq!(bf16, x.to_bf16());
        assert_eq!(bf16.to_f64_vec(), vec![1.0, 1.0, -2.5]);
        let f32 = OutputDType::Float32
            .cast(&ROUTER_LOGITS, bf16.clone(), &bf16_inputs)
            .unwrap();
        assert_eq!(f32.dtype(), DType::F32);
        assert_eq!(f32.to_f64_vec(), bf16.to_f64_vec());
        let f32_inputs: Named<'_> = vec![(&X, &f32_x)];
        assert_eq!(
            OutputDType::Input
                .cast(&ROUTER_LOGITS, x.clone(), &f32_inputs)
                .unwrap(),
            x
        );
        // Indices keep their dtype.
        let ids = Tensor::from_i32([1], vec![3]).unwrap();
        let cast = OutputDType::Float32.cast(&EXPERT_INDEX, ids.clone(), &bf16_inputs);
        assert_eq!(cast.unwrap(), ids);
    }

    #[test]
    fn a_value_beyond_bf16_is_an_error_naming_the_output() {
        let big = Tensor::from_f32([2], vec![0.0, f32::MAX]).unwrap();
        let x = Tensor::from_f32([1], vec![0.0]).unwrap().to_bf16();
        let err = OutputDType::Input
            .cast(&ROUTER_LOGITS, big, &vec![(&X, &x)])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`router_logits`") && err.contains("bf16") && err.contains("[1]"),
            "{err}"
        );
    }

    #[test]
    fn names_round_trip_and_others_are_refused() {
        for value in OutputDType::ALL {
            assert_eq!(value.name().parse::<OutputDType>().unwrap(), value);
        }
        let err = "bfloat16".parse::<OutputDType>().unwrap_err().to_string();
        assert!(
            err.contains("output_dtype") && err.contains("bfloat16"),
            "{err}"
        );
    }
}
