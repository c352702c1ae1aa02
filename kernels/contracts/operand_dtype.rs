//! The dtype of a matmul's operands as nki-library's parameters name it (`router_mm_dtype`,
//! `compute_dtype`): `bfloat16` or `float32`. nki-library also takes `float16`, which moekit
//! refuses: its tensors are f32 or bf16.

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
