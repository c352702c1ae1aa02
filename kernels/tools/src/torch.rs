//! Conversions between moekit tensors and libtorch tensors (feature `libtorch`), for the peer
//! benchmarks and for callers that run moekit kernels on tensors they hold in libtorch.
//!
//! Both directions copy the elements once, except where one side lends its memory to the
//! other for reading: [`borrow_as_tch`] (moekit's to libtorch) and [`lend_to_moekit`]
//! (libtorch's to moekit). bf16 travels as raw bytes with `Kind::BFloat16`, because tch's
//! `Element` impl for `half::bf16` maps to Half.

use std::any::Any;
use std::sync::Arc;

use tch::{Device, Kind};

use moekit::buffer::Buffer;
use moekit::error::{Error, Result};
use moekit::tensor::{Storage, Tensor};

/// A moekit tensor as a contiguous CPU libtorch tensor of the same shape and dtype (one copy of
/// the elements).
pub fn to_tch(tensor: &Tensor) -> tch::Tensor {
    // SAFETY: the borrowed tensor is only read, by the copy below, and dropped before this
    // function returns, while `tensor` lives unchanged.
    let borrowed = unsafe { borrow_as_tch(tensor) };
    let mut copy = borrowed.empty_like();
    copy.copy_(&borrowed);
    copy
}

/// `tensor`'s memory as a contiguous CPU libtorch tensor of the same shape and dtype, without
/// a copy: for reading a kernel's result in libtorch ops whose results are new tensors (an
/// in-place add into another tensor, a product).
///
/// # Safety
///
/// The returned tensor, and every libtorch tensor that comes to share its storage (views,
/// shallow clones, tensors autograd saved), must be dropped before `tensor` is dropped or
/// modified, and nothing may write through them.
pub unsafe fn borrow_as_tch(tensor: &Tensor) -> tch::Tensor {
    let shape: Vec<i64> = tensor.shape().iter().map(|&d| d as i64).collect();
    let mut strides = vec![1i64; shape.len()];
    for axis in (1..shape.len()).rev() {
        strides[axis - 1] = strides[axis] * shape[axis];
    }
    let (data, kind) = match tensor.storage() {
        Storage::F32(v) => (v.as_ptr().cast::<u8>(), Kind::Float),
        Storage::BF16(v) => (v.as_ptr().cast::<u8>(), Kind::BFloat16),
        Storage::I32(v) => (v.as_ptr().cast::<u8>(), Kind::Int),
    };
    // SAFETY: `data` points at the tensor's `numel` elements of `kind`, row-major as the
    // strides describe; the caller keeps them alive and unwritten while libtorch holds them.
    unsafe { tch::Tensor::from_blob(data, &shape, &strides, kind, Device::Cpu) }
}

/// A libtorch tensor (any device, any strides) as a moekit tensor: f32 and bf16 keep their
/// dtype, i32 and i64 become i32 (an i64 value outside i32 is an error), anything else is an
/// error naming `name`. A contiguous CPU tensor is copied once.
pub fn from_tch(name: &str, tensor: &tch::Tensor) -> Result<Tensor> {
    let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
    let host = tensor.to_device(Device::Cpu).contiguous();
    let storage = match host.kind() {
        Kind::Float => Storage::F32(host_elements(&host).into()),
        Kind::BFloat16 => Storage::BF16(host_elements(&host).into()),
        Kind::Int => Storage::I32(host_elements(&host).into()),
        Kind::Int64 => Storage::I32(
            host_elements::<i64>(&host)
                .into_iter()
                .map(i32::try_from)
                .collect::<std::result::Result<Vec<i32>, _>>()
                .map_err(|_| {
                    Error::invalid(name, "an int64 value does not fit in the i32 index dtype")
                })?
                .into(),
        ),
        other => {
            return Err(Error::invalid(
                name,
                format!("libtorch dtype {other:?} has no moekit equivalent (f32, bf16, i32, i64)"),
            ));
        }
    };
    Tensor::new(shape, storage)
}

/// A libtorch tensor as a moekit tensor that reads libtorch's memory where it lies when it
/// can: a contiguous CPU tensor of f32, bf16 or i32 is lent, not copied (the moekit tensor
/// keeps libtorch's storage alive); any other is converted as [`from_tch`] converts it.
///
/// # Safety
///
/// Nothing may write to `tensor`'s elements (through it, or through any tensor that shares its
/// storage, such as an optimizer updating a parameter in place) while the returned tensor or
/// a clone of it exists.
pub unsafe fn lend_to_moekit(name: &str, tensor: &tch::Tensor) -> Result<Tensor> {
    let kind = tensor.kind();
    let lendable = tensor.device() == Device::Cpu
        && tensor.is_contiguous()
        && matches!(kind, Kind::Float | Kind::BFloat16 | Kind::Int);
    if !lendable {
        return from_tch(name, tensor);
    }
    let shape: Vec<usize> = tensor.size().iter().map(|&d| d as usize).collect();
    let (start, len) = (tensor.data_ptr(), tensor.numel());
    let owner: Arc<dyn Any + Send + Sync> = Arc::new(Lender {
        _storage: tensor.shallow_clone(),
    });
    // SAFETY: a contiguous CPU tensor's `numel` elements of its dtype lie consecutively from
    // `data_ptr` (which includes the storage offset, and is aligned for the dtype); `owner`
    // holds a reference to the storage, so they live as long as the buffer, and the caller
    // promises that nothing writes to them meanwhile.
    let storage = unsafe {
        match kind {
            Kind::Float => Storage::F32(Buffer::lent(start.cast(), len, owner)),
            Kind::BFloat16 => Storage::BF16(Buffer::lent(start.cast(), len, owner)),
            _ => Storage::I32(Buffer::lent(start.cast(), len, owner)),
        }
    };
    Tensor::new(shape, storage)
}

/// Keeps a lent libtorch storage alive; only ever dropped.
struct Lender {
    _storage: tch::Tensor,
}

// SAFETY: the tensor is never used through a shared reference, only dropped, and libtorch
// counts a storage's references atomically, so dropping it on any thread is sound.
unsafe impl Sync for Lender {}

/// The elements of `host`, a contiguous CPU tensor whose dtype is `T`'s (the caller matched
/// its kind), copied into a vector.
fn host_elements<T: bytemuck::Pod>(host: &tch::Tensor) -> Vec<T> {
    let numel = host.numel();
    if numel == 0 {
        return Vec::new();
    }
    // SAFETY: `host` is contiguous and on the CPU, so its `numel` elements of type `T` lie
    // consecutively from `data_ptr` (which includes the storage offset, and is aligned for the
    // dtype); `host` outlives the borrow, and nothing writes to it meanwhile.
    unsafe { std::slice::from_raw_parts(host.data_ptr().cast::<T>(), numel) }.to_vec()
}
