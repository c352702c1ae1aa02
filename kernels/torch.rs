//! Conversions between moekit tensors and libtorch tensors (feature `libtorch`), for the peer
//! benchmarks and for callers that run moekit kernels on tensors they hold in libtorch.
//!
//! Both directions copy. bf16 travels as raw bytes with `Kind::BFloat16`, because tch's
//! `Element` impl for `half::bf16` maps to Half.

use half::bf16;
use tch::{Device, Kind};

use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

/// A moekit tensor as a contiguous CPU libtorch tensor of the same shape and dtype.
pub fn to_tch(tensor: &Tensor) -> tch::Tensor {
    let shape: Vec<i64> = tensor.shape().iter().map(|&d| d as i64).collect();
    let kind = match tensor.storage() {
        Storage::F32(_) => Kind::Float,
        Storage::BF16(_) => Kind::BFloat16,
        Storage::I32(_) => Kind::Int,
    };
    tch::Tensor::from_data_size(&tensor.to_le_bytes(), &shape, kind)
}

/// A libtorch tensor (any device, any strides) as a moekit tensor: f32 and bf16 keep their
/// dtype, i32 and i64 become i32 (an i64 value outside i32 is an error), anything else is an
/// error naming `name`.
pub fn from_tch(name: &str, tensor: &tch::Tensor) -> Result<Tensor> {
    let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
    let host = tensor.to_device(Device::Cpu).contiguous();
    let numel = host.numel();
    let storage = match host.kind() {
        Kind::Float => {
            let mut data = vec![0f32; numel];
            host.copy_data(&mut data, numel);
            Storage::F32(data)
        }
        Kind::BFloat16 => {
            let mut bytes = vec![0u8; numel * 2];
            host.copy_data_u8(&mut bytes, numel);
            Storage::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            )
        }
        Kind::Int => {
            let mut data = vec![0i32; numel];
            host.copy_data(&mut data, numel);
            Storage::I32(data)
        }
        Kind::Int64 => {
            let mut wide = vec![0i64; numel];
            host.copy_data(&mut wide, numel);
            let narrow = wide
                .iter()
                .map(|&v| i32::try_from(v))
                .collect::<std::result::Result<Vec<i32>, _>>()
                .map_err(|_| {
                    Error::invalid(name, "an int64 value does not fit in the i32 index dtype")
                })?;
            Storage::I32(narrow)
        }
        other => {
            return Err(Error::invalid(
                name,
                format!("libtorch dtype {other:?} has no moekit equivalent (f32, bf16, i32, i64)"),
            ));
        }
    };
    Tensor::new(shape, storage)
}
