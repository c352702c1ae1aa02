//! The dtype of a matmul's operands as nki-library's parameters name it (`router_mm_dtype`,
//! `compute_dtype`): `bfloat16` or `float32`. nki-library also takes `float16`, which moekit
//! refuses: its tensors are f32 or bf16.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};
use crate::tensor::DType;

/// `s` as the operand dtype parameter `param` names it.
pub(crate) fn parse(param: &str, s: &str) -> Result<DType> {
    match s.trim() {
        "bfloat16" => Ok(DType::BF16),
        "float32" => Ok(DType::F32),
        "float16" => Err(Error::param(
            param,
            "float16: moekit's tensors are f32 or bf16; use bfloat16 or float32",
        )),
        other => Err(Error::param(
            param,
            format!("expected bfloat16 or float32, got `{other}`"),
        )),
    }
}

/// The parameter value naming float dtype `dtype`.
pub(crate) fn name(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "bfloat16",
        DType::F32 | DType::I32 => "float32",
    }
}

/// `compute_dtype`: the dtype of the blockwise kernels' matmul operands, `bfloat16` or
/// `float32`. Every operand a kernel forms itself is rounded to it where it is formed, and
/// every later use reads the rounded value: the token rows the gate/up projection reads (after
/// PRE_SCALE), SwiGLU's activations, and in the backward the down projection's output gradient
/// (after POST_SCALE) and the gate and up gradients. Products of bf16 operands are exact in
/// f32; sums are f32 on the cpu backend (f64 on the reference) whatever the dtype. With bf16
/// this is what nki-library's kernels do (their SBUF tiles hold `compute_dtype`, bf16 by
/// default) and what libtorch's bf16 autograd does; with f32 nothing is rounded but the
/// outputs.
///
/// The default is moekit's own: the dtype of `hidden_states`, so bf16 tokens compute as
/// nki-library's default does, and f32 tokens in f32 (nki-library's default would round them).
///
/// `router_topk_bwd` (moekit's own kernel) takes the same parameter for its two products,
/// `d_x = d_logits · wᵀ` and `d_w = xᵀ · d_logits`: with bf16, `d_logits` is rounded where it
/// is formed (the bias gradient sums the rounded values too) and `x` and `w` are read as bf16,
/// as libtorch's bf16 autograd computes a bf16 router; its default is `x`'s dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ComputeDType(DType);

impl ComputeDType {
    /// The parameter's name.
    pub const PARAM: &'static str = "compute_dtype";
    pub const BFLOAT16: Self = Self(DType::BF16);
    pub const FLOAT32: Self = Self(DType::F32);
    /// What the default is, as `moekit list` prints it.
    pub const DEFAULT: &'static str = "the tokens' dtype: hidden_states or x";

    pub fn dtype(self) -> DType {
        self.0
    }

    /// The dtype a call computes in: `given`, or the dtype of its tokens.
    pub(crate) fn resolve(given: Option<Self>, tokens: DType) -> DType {
        given.map_or(tokens, Self::dtype)
    }
}

impl FromStr for ComputeDType {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        parse(Self::PARAM, s).map(Self)
    }
}

impl fmt::Display for ComputeDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(name(self.0))
    }
}
