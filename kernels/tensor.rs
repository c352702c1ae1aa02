//! A minimal row-major tensor: a shape and a typed buffer, owned or lent for reading
//! ([`Buffer`]).
//!
//! Kernels read floating-point inputs as f32 or bf16 (`half::bf16`) and indices as i32; they
//! write values as f32 or bf16 (see [`crate::contracts::OutputDType`]) and indices/counts as
//! i32.

use std::borrow::Cow;
use std::fmt;

use half::bf16;
use rayon::prelude::*;

use crate::buffer::Buffer;
use crate::error::{Error, Result};

/// The elements of a tensor of `shape`, all `value`, or the error naming it ([`try_capacity`])
/// instead of an abort: for buffers whose size comes from a parameter (`num_experts`,
/// `block_size`) or grows past the inputs, rather than from tensors already in memory.
pub fn try_filled<T: Clone>(what: &str, shape: &[usize], value: T) -> Result<Vec<T>> {
    let mut v = try_capacity(what, shape)?;
    v.resize(shape.iter().product(), value);
    Ok(v)
}

/// An empty vector with room for the elements of a tensor of `shape`, or an error naming it
/// (`what`: "output `down_activations`") when its element count overflows or the memory cannot
/// be had: for tensors whose size no input bounds (the forward's checkpoints grow with N·B, a
/// benchmark's inputs with `--tokens`), whose allocation must fail as an error rather than
/// abort the process.
pub fn try_capacity<T>(what: &str, shape: &[usize]) -> Result<Vec<T>> {
    // An overflowing count asks for usize::MAX elements, which `try_reserve_exact` refuses.
    let len = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .unwrap_or(usize::MAX);
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|error| Error::Allocation {
            what: format!("{what} of shape {shape:?}"),
            error,
        })?;
    Ok(v)
}

/// Element type of a [`Tensor`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    I32,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        })
    }
}

/// The typed element buffer of a [`Tensor`].
#[derive(Clone, Debug, PartialEq)]
pub enum Storage {
    F32(Buffer<f32>),
    BF16(Buffer<bf16>),
    I32(Buffer<i32>),
}

impl Storage {
    fn len(&self) -> usize {
        match self {
            Storage::F32(v) => v.len(),
            Storage::BF16(v) => v.len(),
            Storage::I32(v) => v.len(),
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
            Storage::I32(_) => DType::I32,
        }
    }
}

/// The elements of a floating-point tensor as stored: what a validated call hands a backend,
/// so that it never matches an index dtype it cannot be given.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    BF16(&'a [bf16]),
}

impl<'a> Floats<'a> {
    /// The number of elements.
    pub fn len(self) -> usize {
        match self {
            Floats::F32(v) => v.len(),
            Floats::BF16(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// The dtype they are stored in.
    pub fn dtype(self) -> DType {
        match self {
            Floats::F32(_) => DType::F32,
            Floats::BF16(_) => DType::BF16,
        }
    }

    /// Element `i` widened exactly to f32, or `None` past the end.
    pub fn get(self, i: usize) -> Option<f32> {
        match self {
            Floats::F32(v) => v.get(i).copied(),
            Floats::BF16(v) => v.get(i).map(|x| x.to_f32()),
        }
    }

    /// The elements `range`, as stored.
    pub fn slice(self, range: std::ops::Range<usize>) -> Floats<'a> {
        match self {
            Floats::F32(v) => Floats::F32(&v[range]),
            Floats::BF16(v) => Floats::BF16(&v[range]),
        }
    }

    /// Writes the elements, widened exactly to f32, into `dst` (of the same length).
    pub fn write_f32(self, dst: &mut [f32]) {
        match self {
            Floats::F32(v) => dst.copy_from_slice(v),
            Floats::BF16(v) => {
                for (d, x) in dst.iter_mut().zip(v) {
                    *d = x.to_f32();
                }
            }
        }
    }

    /// The elements widened exactly to f32: borrowed when already f32.
    pub fn to_f32(self) -> Cow<'a, [f32]> {
        match self {
            Floats::F32(v) => Cow::Borrowed(v),
            Floats::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        }
    }

    /// The values in bf16: borrowed when stored so, else rounded to the nearest (ties to even).
    pub fn to_bf16(self) -> Cow<'a, [bf16]> {
        match self {
            Floats::BF16(v) => Cow::Borrowed(v),
            Floats::F32(v) => Cow::Owned(
                v.par_iter()
                    .with_min_len(CAST_TASK_LEN)
                    .map(|&x| bf16_nearest(x))
                    .collect(),
            ),
        }
    }
}

/// Elements per parallel task of a cast between float dtypes (an output of nki-library's
/// `output_dtype`): a whole `[T, H]` gradient is megabytes, fewer than this are not worth a task.
const CAST_TASK_LEN: usize = 1 << 16;

/// `x` rounded to the nearest bf16, ties to even, as `bf16::from_f32` rounds it (a NaN stays a
/// quiet NaN), without branching on the value, so that converting a buffer vectorises.
fn bf16_nearest(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = (bits >> 16) as u16 | 0x0040;
    bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded })
}

/// A row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    storage: Storage,
}

impl Tensor {
    /// Builds a tensor, checking that the buffer length equals the product of `shape` and that
    /// every extent fits in an i64 (the index type of libtorch and safetensors), which an
    /// extent of a tensor without elements need not.
    pub fn new(shape: impl Into<Vec<usize>>, storage: Storage) -> Result<Self> {
        let shape = shape.into();
        let extents_fit = shape.iter().all(|&d| i64::try_from(d).is_ok());
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let Some(expected) = elements.filter(|_| extents_fit) else {
            return Err(Error::ShapeOverflow { shape });
        };
        if storage.len() != expected {
            return Err(Error::ElementCount {
                shape,
                len: storage.len(),
                expected,
            });
        }
        Ok(Self { shape, storage })
    }

    /// An f32 tensor.
    pub fn from_f32(shape: impl Into<Vec<usize>>, data: Vec<f32>) -> Result<Self> {
        Self::new(shape, Storage::F32(data.into()))
    }

    /// A bf16 tensor.
    pub fn from_bf16(shape: impl Into<Vec<usize>>, data: Vec<bf16>) -> Result<Self> {
        Self::new(shape, Storage::BF16(data.into()))
    }

    /// An i32 tensor.
    pub fn from_i32(shape: impl Into<Vec<usize>>, data: Vec<i32>) -> Result<Self> {
        Self::new(shape, Storage::I32(data.into()))
    }

    /// The extents, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.storage.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.storage.len()
    }

    /// The typed buffer.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The typed buffer, taken out of the tensor (row-major in [`Self::shape`], read first).
    pub fn into_storage(self) -> Storage {
        self.storage
    }

    /// The buffer if the tensor is f32.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.storage {
            Storage::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements if the tensor is f32 or bf16.
    pub fn floats(&self) -> Option<Floats<'_>> {
        match &self.storage {
            Storage::F32(v) => Some(Floats::F32(v)),
            Storage::BF16(v) => Some(Floats::BF16(v)),
            Storage::I32(_) => None,
        }
    }

    /// The buffer if the tensor is i32.
    pub fn as_i32(&self) -> Option<&[i32]> {
        match &self.storage {
            Storage::I32(v) => Some(v),
            _ => None,
        }
    }

    /// Element `index` (row-major) widened exactly to f64, or `None` past the end.
    pub fn get_f64(&self, index: usize) -> Option<f64> {
        match &self.storage {
            Storage::F32(v) => v.get(index).map(|&x| f64::from(x)),
            Storage::BF16(v) => v.get(index).map(|&x| f64::from(x)),
            Storage::I32(v) => v.get(index).map(|&x| f64::from(x)),
        }
    }

    /// The elements as f32: borrowed when already f32, widened exactly from bf16, converted from
    /// i32.
    pub fn f32_values(&self) -> Cow<'_, [f32]> {
        match &self.storage {
            Storage::F32(v) => Cow::Borrowed(v),
            Storage::BF16(v) => Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
            Storage::I32(v) => Cow::Owned(v.iter().map(|&x| x as f32).collect()),
        }
    }

    /// Every element widened exactly to f64 (f32, bf16 and i32 all embed in f64).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.storage {
            Storage::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Storage::BF16(v) => v.iter().map(|&x| f64::from(x)).collect(),
            Storage::I32(v) => v.iter().map(|&x| f64::from(x)).collect(),
        }
    }

    /// The same values stored as bf16 (round to nearest even). Indices are left unchanged.
    pub fn to_bf16(&self) -> Tensor {
        let storage = match &self.storage {
            Storage::F32(v) => Storage::BF16(
                v.iter()
                    .map(|&x| bf16_nearest(x))
                    .collect::<Vec<_>>()
                    .into(),
            ),
            other => other.clone(),
        };
        Tensor {
            shape: self.shape.clone(),
            storage,
        }
    }

    /// The same values in float dtype `dtype` (f32 or bf16), for output `name`: moved unchanged
    /// when already in it, widened exactly from bf16, rounded to nearest even from f32. An f32
    /// value beyond bf16's range is an error naming the output and the position, not an
    /// infinity. Index tensors are returned unchanged.
    pub fn into_float_dtype(self, name: &str, dtype: DType) -> Result<Tensor> {
        let storage = match (self.storage, dtype) {
            (Storage::F32(v), DType::BF16) => {
                let rounded: Vec<bf16> = v
                    .par_iter()
                    .with_min_len(CAST_TASK_LEN)
                    .map(|&x| bf16_nearest(x))
                    .collect();
                // Screened whole (an OR per task, which vectorises), searched only when one is
                // there.
                let infinite = |x: &bf16| x.to_bits() & 0x7fff == 0x7f80;
                let any_infinite = rounded
                    .par_chunks(CAST_TASK_LEN)
                    .any(|chunk| chunk.iter().fold(false, |any, x| any | infinite(x)));
                if let Some(index) = any_infinite
                    .then(|| rounded.iter().position(infinite))
                    .flatten()
                {
                    return Err(Error::invalid(
                        name,
                        format!(
                            "result {} at {} does not fit in bf16",
                            v[index],
                            position(&self.shape, index)
                        ),
                    ));
                }
                Storage::BF16(rounded.into())
            }
            (Storage::BF16(v), DType::F32) => Storage::F32(
                v.par_iter()
                    .with_min_len(CAST_TASK_LEN)
                    .map(|x| x.to_f32())
                    .collect::<Vec<_>>()
                    .into(),
            ),
            (storage, _) => storage,
        };
        Ok(Tensor {
            shape: self.shape,
            storage,
        })
    }

    /// The same elements under `shape`, which must hold as many, without copying.
    pub fn reshaped(self, shape: impl Into<Vec<usize>>) -> Result<Tensor> {
        Self::new(shape, self.storage)
    }

    /// The first `rows` rows of tensor `name` (rank ≥ 1), without copying: e.g. the `[T, H]`
    /// of an `[T+1, H]` kernel output, its padding row T dropped. An error naming the tensor if
    /// it has fewer rows.
    pub fn into_leading_rows(mut self, name: &str, rows: usize) -> Result<Tensor> {
        if self.shape.first().is_none_or(|&available| rows > available) {
            return Err(Error::shape(
                name,
                format!("at least {rows} rows"),
                &self.shape,
            ));
        }
        let row_len: usize = self.shape[1..].iter().product();
        let len = rows * row_len;
        match &mut self.storage {
            Storage::F32(v) => v.truncate(len),
            Storage::BF16(v) => v.truncate(len),
            Storage::I32(v) => v.truncate(len),
        }
        self.shape[0] = rows;
        Ok(self)
    }

    /// The transpose of a 2-D tensor (`[a, b]` becomes `[b, a]`), in the same dtype, copied.
    /// An error naming `name` if the tensor is not 2-D or cannot be allocated.
    pub fn transposed(&self, name: &str) -> Result<Tensor> {
        let &[rows, cols] = self.shape() else {
            return Err(Error::shape(name, "a 2-D tensor", self.shape()));
        };
        fn transpose<T: Copy>(
            name: &str,
            values: &[T],
            rows: usize,
            cols: usize,
        ) -> Result<Vec<T>> {
            let mut out = try_capacity(&format!("the transpose of `{name}`"), &[cols, rows])?;
            out.extend((0..cols).flat_map(|c| (0..rows).map(move |r| values[r * cols + c])));
            Ok(out)
        }
        let storage = match &self.storage {
            Storage::F32(v) => Storage::F32(transpose(name, v, rows, cols)?.into()),
            Storage::BF16(v) => Storage::BF16(transpose(name, v, rows, cols)?.into()),
            Storage::I32(v) => Storage::I32(transpose(name, v, rows, cols)?.into()),
        };
        Tensor::new([cols, rows], storage)
    }

    /// The buffer's little-endian bytes: borrowed on a little-endian machine, copied otherwise.
    pub fn le_bytes(&self) -> Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            Cow::Borrowed(match &self.storage {
                Storage::F32(v) => bytemuck::cast_slice(v),
                Storage::BF16(v) => bytemuck::cast_slice(v),
                Storage::I32(v) => bytemuck::cast_slice(v),
            })
        } else {
            Cow::Owned(self.to_le_bytes())
        }
    }

    /// The raw little-endian bytes of the buffer.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.storage {
            Storage::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Storage::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Formats a flat row-major index as `[i, j, ...]`.
pub fn position(shape: &[usize], mut flat: usize) -> String {
    let mut coords = vec![0; shape.len()];
    for (c, &extent) in coords.iter_mut().zip(shape).rev() {
        if extent > 0 {
            *c = flat % extent;
            flat /= extent;
        }
    }
    let coords: Vec<String> = coords.iter().map(usize::to_string).collect();
    format!("[{}]", coords.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_nearest_rounds_as_the_half_crate_does() {
        let specials = [
            0.0f32,
            -0.0,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN
            f32::from_bits(0x3f80_8000), // a tie, to even (down)
            f32::from_bits(0x3f81_8000), // a tie, to even (up)
            f32::from_bits(0x7f7f_ffff), // rounds up to infinity
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let random = (0..100_000).map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f32::from_bits(state as u32)
        });
        for x in specials.into_iter().chain(random) {
            let (got, want) = (bf16_nearest(x), bf16::from_f32(x));
            if want.is_nan() {
                assert!(got.is_nan() && got.to_bits() & 0x0040 != 0, "{x:e}");
                assert_eq!(got.to_bits() & 0x8000, want.to_bits() & 0x8000, "{x:e}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn leading_rows_drop_the_trailing_ones_and_too_many_is_an_error_naming_the_tensor() {
        let padded = Tensor::from_f32([3, 2], vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.0]).unwrap();
        let rows = padded.clone().into_leading_rows("output", 2).unwrap();
        assert_eq!(
            rows,
            Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap()
        );
        let bf16 = padded.to_bf16().into_leading_rows("output", 0).unwrap();
        assert_eq!(bf16.shape(), &[0, 2]);
        let err = padded
            .into_leading_rows("output", 4)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`output`") && err.contains("at least 4 rows"),
            "{err}"
        );
        let scalar = Tensor::from_f32(Vec::<usize>::new(), vec![1.0]).unwrap();
        assert!(scalar.into_leading_rows("x", 0).is_err());
    }

    #[test]
    fn the_transpose_swaps_rows_and_columns_in_every_dtype() {
        let x = Tensor::from_f32([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let want = Tensor::from_f32([3, 2], vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]).unwrap();
        assert_eq!(x.transposed("x").unwrap(), want);
        assert_eq!(x.to_bf16().transposed("x").unwrap(), want.to_bf16());
        let ids = Tensor::from_i32([1, 2], vec![7, 8]).unwrap();
        assert_eq!(
            ids.transposed("ids").unwrap(),
            Tensor::from_i32([2, 1], vec![7, 8]).unwrap()
        );
        let err = Tensor::from_f32([2], vec![0.0; 2]).unwrap().transposed("x");
        assert!(err.unwrap_err().to_string().contains("`x`"));
    }
}
