//! DLPack, the tensor exchange protocol of NumPy, PyTorch, JAX and CuPy: input tensors are read
//! from a producer's capsule in place where they are contiguous and aligned (the kernel sees
//! the caller's memory, kept alive until the kernel's outputs are made), and every output is
//! handed to the caller's array library the same way, without a copy.
//!
//! Both capsule kinds of the protocol are read and written: `dltensor` (DLPack 0.x,
//! `DLManagedTensor`) and `dltensor_versioned` (DLPack ≥ 1.0, `DLManagedTensorVersioned`, which
//! can mark a tensor read-only, as NumPy does for read-only arrays).

use std::ffi::{CStr, c_void};
use std::ptr;
use std::sync::Arc;

use moekit::tensor::{DType, Storage};
use moekit::{Buffer, Error, Tensor};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::errors::IntoPyResult;

/// `DLDeviceType::kDLCPU`.
const DEVICE_CPU: i32 = 1;

/// `DLDataTypeCode`s.
const CODE_INT: u8 = 0;
const CODE_UINT: u8 = 1;
const CODE_FLOAT: u8 = 2;
const CODE_BFLOAT: u8 = 4;

const LEGACY: &CStr = c"dltensor";
const LEGACY_USED: &CStr = c"used_dltensor";
const VERSIONED: &CStr = c"dltensor_versioned";
const VERSIONED_USED: &CStr = c"used_dltensor_versioned";

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    /// `ndim` extents.
    shape: *mut i64,
    /// `ndim` strides in elements, or null for a row-major contiguous tensor.
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// A consumed producer capsule's tensor: the producer's memory stays valid until this is
/// dropped, which calls the producer's deleter.
enum Imported {
    Legacy(*mut DLManagedTensor),
    Versioned(*mut DLManagedTensorVersioned),
}

// SAFETY: DLPack lets the consumer call the deleter from any thread (producers that need the
// GIL take it in their deleter), and the tensor's memory is only read through it.
unsafe impl Send for Imported {}
// SAFETY: as above; shared references only read the pointers.
unsafe impl Sync for Imported {}

impl Imported {
    fn tensor(&self) -> &DLTensor {
        // SAFETY: the producer keeps the managed tensor alive until its deleter runs, which
        // happens only in `drop`.
        unsafe {
            match *self {
                Imported::Legacy(managed) => &(*managed).dl_tensor,
                Imported::Versioned(managed) => &(*managed).dl_tensor,
            }
        }
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a capsule this process consumed (renamed `used_…`), so
        // this is the only call of its deleter, as DLPack requires of the consumer.
        unsafe {
            match *self {
                Imported::Legacy(managed) => {
                    if let Some(deleter) = (*managed).deleter {
                        deleter(managed)
                    }
                }
                Imported::Versioned(managed) => {
                    if let Some(deleter) = (*managed).deleter {
                        deleter(managed)
                    }
                }
            }
        }
    }
}

/// How a tensor's elements are read: what its DLPack dtype says, or bf16 carried as uint16
/// (NumPy cannot export `ml_dtypes.bfloat16` through DLPack, so the package exports the bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bits {
    AsDeclared,
    Bf16AsU16,
}

/// The element types moekit reads.
#[derive(Clone, Copy)]
enum Element {
    F32,
    Bf16,
    I32,
    /// int64 indices (PyTorch's `topk`), narrowed to i32 with a range check.
    I64,
}

impl Element {
    fn size(self) -> usize {
        match self {
            Element::F32 | Element::I32 => 4,
            Element::Bf16 => 2,
            Element::I64 => 8,
        }
    }
}

fn dtype_name(dtype: DLDataType) -> String {
    let kind = match dtype.code {
        CODE_INT => "int",
        CODE_UINT => "uint",
        CODE_FLOAT => "float",
        CODE_BFLOAT => "bfloat",
        3 => "opaque handle ",
        5 => "complex",
        6 => "bool",
        _ => "code ",
    };
    let lanes = if dtype.lanes == 1 {
        String::new()
    } else {
        format!("x{}", dtype.lanes)
    };
    format!("{kind}{}{lanes}", dtype.bits)
}

fn element(name: &str, dtype: DLDataType, bits: Bits) -> Result<Element, Error> {
    let found = match (bits, dtype.code, dtype.bits, dtype.lanes) {
        (Bits::AsDeclared, CODE_FLOAT, 32, 1) => Some(Element::F32),
        (Bits::AsDeclared, CODE_BFLOAT, 16, 1) | (Bits::Bf16AsU16, CODE_UINT, 16, 1) => {
            Some(Element::Bf16)
        }
        (Bits::AsDeclared, CODE_INT, 32, 1) => Some(Element::I32),
        (Bits::AsDeclared, CODE_INT, 64, 1) => Some(Element::I64),
        _ => None,
    };
    found.ok_or_else(|| {
        Error::invalid(
            name,
            format!(
                "has dtype {}; moekit takes float32 or bfloat16 values and int32 or int64 indices",
                dtype_name(dtype)
            ),
        )
    })
}

/// Reads the tensor in `capsule` (a DLPack capsule, which this consumes) as the moekit tensor
/// called `name`: in place when it is row-major contiguous and aligned, else copied (strided
/// views, int64 indices).
pub fn import(name: &str, capsule: &Bound<'_, PyCapsule>, bits: Bits) -> PyResult<Tensor> {
    let py = capsule.py();
    let imported = consume(name, capsule).into_py_result(py)?;
    to_tensor(name, imported, bits).into_py_result(py)
}

/// Takes ownership of the managed tensor in a producer's capsule, renaming the capsule
/// `used_…` so the producer's capsule destructor leaves it to us.
fn consume(name: &str, capsule: &Bound<'_, PyCapsule>) -> Result<Imported, Error> {
    let raw = capsule.as_ptr();
    let not_dlpack = || {
        Error::invalid(
            name,
            "is not a DLPack capsule (`dltensor` or `dltensor_versioned`), or was already consumed",
        )
    };
    // SAFETY: `raw` is a live capsule; IsValid and GetPointer only read it, SetName renames it.
    // Neither leaves a Python exception set when the name matches.
    unsafe {
        if ffi::PyCapsule_IsValid(raw, VERSIONED.as_ptr()) == 1 {
            let managed =
                ffi::PyCapsule_GetPointer(raw, VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if managed.is_null() || ffi::PyCapsule_SetName(raw, VERSIONED_USED.as_ptr()) != 0 {
                return Err(not_dlpack());
            }
            // Dropped (the deleter called) on every path from here. Read-only tensors
            // (`DLPACK_FLAG_BITMASK_READ_ONLY`) need nothing: moekit only reads its inputs.
            let imported = Imported::Versioned(managed);
            let major = (*managed).version.major;
            if major != 1 {
                return Err(Error::invalid(
                    name,
                    format!("DLPack version {major} is not one moekit reads (1)"),
                ));
            }
            Ok(imported)
        } else if ffi::PyCapsule_IsValid(raw, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(raw, LEGACY.as_ptr()) as *mut DLManagedTensor;
            if managed.is_null() || ffi::PyCapsule_SetName(raw, LEGACY_USED.as_ptr()) != 0 {
                return Err(not_dlpack());
            }
            Ok(Imported::Legacy(managed))
        } else {
            Err(not_dlpack())
        }
    }
}

fn to_tensor(name: &str, imported: Imported, bits: Bits) -> Result<Tensor, Error> {
    let dl = imported.tensor();
    if dl.device.device_type != DEVICE_CPU {
        return Err(Error::invalid(
            name,
            format!(
                "is on DLPack device type {} (id {}); moekit reads tensors in CPU memory (.cpu())",
                dl.device.device_type, dl.device.device_id
            ),
        ));
    }
    let element = element(name, dl.dtype, bits)?;
    let ndim = usize::try_from(dl.ndim)
        .map_err(|_| Error::invalid(name, format!("has ndim {}", dl.ndim)))?;
    // SAFETY: a DLTensor's shape holds `ndim` extents and its strides, when not null, `ndim`
    // strides (DLPack's contract with the producer).
    let (extents, strides) = unsafe {
        let extents = if ndim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(dl.shape, ndim)
        };
        let strides = (!dl.strides.is_null() && ndim > 0)
            .then(|| std::slice::from_raw_parts(dl.strides, ndim));
        (extents, strides)
    };
    let shape = extents
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| Error::invalid(name, format!("has a negative extent in {extents:?}")))?;
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n.checked_mul(element.size()).is_some())
        .ok_or_else(|| Error::ShapeOverflow {
            shape: shape.clone(),
        })?;
    let empty = shape.contains(&0);
    let contiguous_strides = row_major_strides(&shape);
    let strides: Vec<i64> = match strides {
        Some(s) => s.to_vec(),
        None => contiguous_strides.clone(),
    };
    // SAFETY: data + byte_offset is the first element (DLPack's contract).
    let first = unsafe { (dl.data as *const u8).add(dl.byte_offset as usize) };
    let aligned = (first as usize).is_multiple_of(element.size().min(8));
    let contiguous = empty
        || shape
            .iter()
            .zip(strides.iter().zip(&contiguous_strides))
            .all(|(&d, (&s, &c))| d == 1 || s == c);
    // Lent in place where the layout allows it, else gathered into a copy.
    let lend = (contiguous && aligned).then_some(imported);
    // SAFETY: `first`, `shape` and `strides` describe the producer's tensor of that element
    // type, which `lend` (or, when copying, the producer until this returns) keeps alive.
    let storage = unsafe {
        match element {
            Element::F32 => Storage::F32(elements(first, &shape, &strides, lend)),
            Element::Bf16 => Storage::BF16(elements(first, &shape, &strides, lend)),
            Element::I32 => Storage::I32(elements(first, &shape, &strides, lend)),
            // Always copied, being narrowed.
            Element::I64 => {
                let wide = elements::<i64>(first, &shape, &strides, None);
                Storage::I32(narrow(name, &shape, &wide)?.into())
            }
        }
    };
    Tensor::new(shape, storage)
}

/// int64 indices as the contract's int32, or the error naming the first that does not fit.
fn narrow(name: &str, shape: &[usize], wide: &[i64]) -> Result<Vec<i32>, Error> {
    wide.iter()
        .enumerate()
        .map(|(flat, &v)| {
            i32::try_from(v).map_err(|_| {
                Error::invalid(
                    name,
                    format!(
                        "int64 value {v} at {} does not fit the contract's int32",
                        moekit::tensor::position(shape, flat)
                    ),
                )
            })
        })
        .collect()
}

fn row_major_strides(shape: &[usize]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1] as i64;
    }
    strides
}

/// The elements of type `T` of a tensor at `first` with `shape` and `strides` (in elements):
/// lent by `lend` where it is given (the tensor is then row-major contiguous and aligned), else
/// gathered into a vector in row-major order.
///
/// # Safety
///
/// Every element the strides reach must be a readable, initialised `T`, for as long as `lend`
/// lives when it is given, else until this returns.
unsafe fn elements<T: Copy>(
    first: *const u8,
    shape: &[usize],
    strides: &[i64],
    lend: Option<Imported>,
) -> Buffer<T> {
    let first = first.cast::<T>();
    let len = shape.iter().product();
    match lend {
        // SAFETY: the caller's contract; `owner` defers the producer's deleter.
        Some(imported) => unsafe { Buffer::lent(first, len, Arc::new(imported)) },
        None => element_offsets(shape, strides)
            // SAFETY: the caller's contract; unaligned reads, as a strided view may be.
            .map(|offset| unsafe { ptr::read_unaligned(first.offset(offset)) })
            .collect::<Vec<T>>()
            .into(),
    }
}

/// The element offsets of a strided tensor, in row-major order of its indices.
fn element_offsets<'a>(shape: &'a [usize], strides: &'a [i64]) -> impl Iterator<Item = isize> + 'a {
    let len: usize = shape.iter().product();
    (0..len).map(move |mut flat| {
        let mut offset = 0isize;
        for (&d, &s) in shape.iter().zip(strides).rev() {
            offset += (flat % d) as isize * s as isize;
            flat /= d;
        }
        offset
    })
}

/// A kernel output on its way to the caller's array library: exported once, by `__dlpack__`
/// (`np.from_dlpack`, `torch.from_dlpack`), which hands over its memory without a copy.
#[pyclass(module = "moekit._moekit", name = "Output")]
pub struct Output {
    /// `None` once exported.
    tensor: Option<Tensor>,
    dtype: DType,
    shape: Vec<usize>,
    /// Export bf16 as uint16 bits (for NumPy, which has no DLPack bfloat16).
    bf16_bits: bool,
}

impl Output {
    pub fn new(tensor: Tensor) -> Self {
        Self {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            tensor: Some(tensor),
            bf16_bits: false,
        }
    }
}

/// A tensor's name for its dtype, as NumPy and PyTorch spell it.
pub fn dtype_str(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::I32 => "int32",
    }
}

#[pymethods]
impl Output {
    /// `float32`, `bfloat16` or `int32`.
    #[getter]
    fn dtype(&self) -> &'static str {
        dtype_str(self.dtype)
    }

    #[getter]
    fn shape(&self) -> Vec<usize> {
        self.shape.clone()
    }

    /// Exports bf16 values as their uint16 bits from now on (NumPy then views them as
    /// `ml_dtypes.bfloat16`); no effect on other dtypes.
    fn bf16_as_bits(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        slf.bf16_bits = true;
        slf
    }

    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &mut self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // CPU memory has no stream to synchronise with, and a fresh output needs no copy.
        let _ = (stream, copy);
        if let Some((device_type, _)) = dl_device
            && device_type != DEVICE_CPU
        {
            return Err(pyo3::exceptions::PyBufferError::new_err(format!(
                "moekit's outputs are in CPU memory; DLPack device type {device_type} was asked for"
            )));
        }
        let tensor = self.tensor.take().ok_or_else(|| {
            pyo3::exceptions::PyBufferError::new_err("this output was already exported")
        })?;
        let exported = Box::new(Exported::new(tensor, self.bf16_bits).into_py_result(py)?);
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        Ok(if versioned {
            exported.into_versioned_capsule(py)?
        } else {
            exported.into_legacy_capsule(py)?
        })
    }

    fn __dlpack_device__(&self) -> (i32, i32) {
        (DEVICE_CPU, 0)
    }
}

/// The memory behind an exported capsule: the output tensor and the extents DLPack points at.
struct Exported {
    tensor: Tensor,
    shape: Vec<i64>,
    dtype: DLDataType,
}

impl Exported {
    fn new(tensor: Tensor, bf16_bits: bool) -> Result<Self, Error> {
        // Consumers may write to what they import: an output that shares an input's lent
        // memory is copied first, so the caller's input is never written.
        let storage = match tensor.storage() {
            Storage::F32(b) if b.is_lent() => Some(Storage::F32(b.to_vec().into())),
            Storage::BF16(b) if b.is_lent() => Some(Storage::BF16(b.to_vec().into())),
            Storage::I32(b) if b.is_lent() => Some(Storage::I32(b.to_vec().into())),
            _ => None,
        };
        let tensor = match storage {
            Some(storage) => Tensor::new(tensor.shape().to_vec(), storage)?,
            None => tensor,
        };
        let dtype = match (tensor.dtype(), bf16_bits) {
            (DType::F32, _) => (CODE_FLOAT, 32),
            (DType::BF16, false) => (CODE_BFLOAT, 16),
            (DType::BF16, true) => (CODE_UINT, 16),
            (DType::I32, _) => (CODE_INT, 32),
        };
        Ok(Self {
            shape: tensor.shape().iter().map(|&d| d as i64).collect(),
            tensor,
            dtype: DLDataType {
                code: dtype.0,
                bits: dtype.1,
                lanes: 1,
            },
        })
    }

    /// The DLTensor of the (boxed, so address-stable) export.
    fn dl_tensor(&mut self) -> DLTensor {
        let data = match self.tensor.storage() {
            Storage::F32(b) => b.as_ptr().cast::<c_void>(),
            Storage::BF16(b) => b.as_ptr().cast::<c_void>(),
            Storage::I32(b) => b.as_ptr().cast::<c_void>(),
        };
        DLTensor {
            data: data.cast_mut(),
            device: DLDevice {
                device_type: DEVICE_CPU,
                device_id: 0,
            },
            ndim: self.shape.len() as i32,
            dtype: self.dtype,
            shape: self.shape.as_mut_ptr(),
            strides: ptr::null_mut(),
            byte_offset: 0,
        }
    }

    fn into_legacy_capsule(mut self: Box<Self>, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let dl_tensor = self.dl_tensor();
        let managed = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor,
            manager_ctx: Box::into_raw(self).cast(),
            deleter: Some(delete_legacy),
        }));
        // SAFETY: `managed` is a valid managed tensor whose ownership passes to the capsule
        // (its destructor deletes it unless a consumer renamed the capsule and took it over).
        unsafe { new_capsule(py, managed.cast(), LEGACY, legacy_capsule_destructor) }.inspect_err(
            |_| {
                // SAFETY: the capsule was not made, so nothing else owns `managed`.
                unsafe { delete_legacy(managed) }
            },
        )
    }

    fn into_versioned_capsule(mut self: Box<Self>, py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
        let dl_tensor = self.dl_tensor();
        let managed = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 0 },
            manager_ctx: Box::into_raw(self).cast(),
            deleter: Some(delete_versioned),
            flags: 0,
            dl_tensor,
        }));
        // SAFETY: as for the legacy capsule.
        unsafe { new_capsule(py, managed.cast(), VERSIONED, versioned_capsule_destructor) }
            .inspect_err(|_| {
                // SAFETY: the capsule was not made, so nothing else owns `managed`.
                unsafe { delete_versioned(managed) }
            })
    }
}

/// A capsule named `name` holding `pointer`, with `destructor`.
///
/// # Safety
///
/// `destructor` must release `pointer` exactly when the capsule still holds it under `name`.
unsafe fn new_capsule<'py>(
    py: Python<'py>,
    pointer: *mut c_void,
    name: &'static CStr,
    destructor: unsafe extern "C" fn(*mut ffi::PyObject),
) -> PyResult<Bound<'py, PyAny>> {
    // SAFETY: a valid pointer, a 'static name and a destructor, with the GIL held.
    let capsule = unsafe { ffi::PyCapsule_New(pointer, name.as_ptr(), Some(destructor)) };
    // SAFETY: PyCapsule_New returns a new reference, or null with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, capsule) }
}

unsafe extern "C" fn delete_legacy(managed: *mut DLManagedTensor) {
    // SAFETY: `managed` and its context were boxed by `into_legacy_capsule`; DLPack calls the
    // deleter once.
    unsafe {
        drop(Box::from_raw((*managed).manager_ctx.cast::<Exported>()));
        drop(Box::from_raw(managed));
    }
}

unsafe extern "C" fn delete_versioned(managed: *mut DLManagedTensorVersioned) {
    // SAFETY: as for `delete_legacy`.
    unsafe {
        drop(Box::from_raw((*managed).manager_ctx.cast::<Exported>()));
        drop(Box::from_raw(managed));
    }
}

/// Deletes the tensor of a capsule no consumer took (still named `dltensor`).
unsafe extern "C" fn legacy_capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: the capsule is being destroyed; under its original name it still owns the
    // managed tensor, under `used_dltensor` its consumer does.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, LEGACY.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, LEGACY.as_ptr());
            delete_legacy(managed.cast());
        }
    }
}

/// Deletes the tensor of a capsule no consumer took (still named `dltensor_versioned`).
unsafe extern "C" fn versioned_capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: as for `legacy_capsule_destructor`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, VERSIONED.as_ptr()) == 1 {
            let managed = ffi::PyCapsule_GetPointer(capsule, VERSIONED.as_ptr());
            delete_versioned(managed.cast());
        }
    }
}
