//! `indexed_flatten`: nki-library's block scatter of rows into one flat array
//! (`core/subkernels/indexed_flatten.py`), with its tensor names, shapes and parameters; on the
//! device it lays each expert's token list (`find_nonzero_indices`' `indices`) out as a block
//! plan's `token_position_to_id`.
//!
//! Each row `e` of `input_tensor [E, T]` is T / f_len blocks of `f_len` elements; row e's block
//! `p` goes to output block `row_offsets[start + e] + p` (`start = row_offsets_start[0]`, or
//! 0), rows in ascending order so a later row overwrites an earlier one's block; output blocks
//! outside `[0, output_len / f_len)` are skipped, and what no row writes holds `padding_val`:
//! ```text
//! flattened_array[(row_offsets[start + e] + p)·f_len + i] = input_tensor[e, p·f_len + i]
//! ```
//! `flattened_array [output_len]` has `input_tensor`'s dtype (`padding_val` converted to it).
//! `f_len` must divide both T and `output_len`, and `row_offsets [N]` hold the E offsets read
//! (N = E without `row_offsets_start`, `start + E ≤ N` with it), as nki-library asserts or
//! needs. Its other device limits (`output_len` a multiple of 128, T / f_len of 16) bound its
//! compiled kernel, not the host backends. nki-library's two cores each write half the rows
//! and keep the elementwise maximum where both wrote a block, which is the same result where
//! the values are at least `padding_val` and no block is written from both halves (its MoE
//! use); moekit computes the formula.

use half::bf16;

use super::spec::{self, Named, TensorSpec};
use super::tensors::indexed_flatten as ifl;
use super::validate;
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor, try_filled};

/// `indexed_flatten`'s parameters, nki-library's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexedFlattenParams {
    /// Elements per block; divides T and `output_len`.
    pub f_len: usize,
    /// The output's length.
    pub output_len: usize,
    /// What no block writes (−1).
    pub padding_val: i32,
}

impl IndexedFlattenParams {
    pub const DEFAULT_PADDING_VAL: i32 = -1;
}

/// Inputs of [`IndexedFlatten`].
#[derive(Clone, Copy, Debug)]
pub struct IndexedFlattenInputs<'a> {
    /// `[E, T]`, f32, bf16 or i32.
    pub input_tensor: &'a Tensor,
    /// `[N]` i32: each row's first output block.
    pub row_offsets: &'a Tensor,
    /// `[1]` i32: the first entry of `row_offsets` read.
    pub row_offsets_start: Option<&'a Tensor>,
}

impl<'a> IndexedFlattenInputs<'a> {
    /// The inputs by their specs ([`ifl::INPUTS`]), an absent one left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![
            (&ifl::INPUT_TENSOR, self.input_tensor),
            (&ifl::ROW_OFFSETS, self.row_offsets),
        ];
        named.extend(self.row_offsets_start.map(|s| (&ifl::ROW_OFFSETS_START, s)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            input_tensor: spec::required(&get, &ifl::INPUT_TENSOR)?,
            row_offsets: spec::required(&get, &ifl::ROW_OFFSETS)?,
            row_offsets_start: get(&ifl::ROW_OFFSETS_START),
        })
    }
}

/// The sizes of an `indexed_flatten` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexedFlattenDims {
    /// E, rows.
    pub e: usize,
    /// T, elements per row.
    pub t: usize,
    pub f_len: usize,
    pub output_len: usize,
}

/// A validated `indexed_flatten` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Debug)]
pub struct IndexedFlatten<'a> {
    inputs: IndexedFlattenInputs<'a>,
    params: IndexedFlattenParams,
    dims: IndexedFlattenDims,
    /// `[E]`: each row's first output block (`row_offsets[start + e]`).
    offsets: Vec<i64>,
}

impl<'a> IndexedFlatten<'a> {
    /// Checks the tensors, `f_len`, `output_len` and the offsets read.
    pub fn new(inputs: IndexedFlattenInputs<'a>, params: IndexedFlattenParams) -> Result<Self> {
        let shape = validate::any_tensor(
            ifl::INPUT_TENSOR.name,
            inputs.input_tensor,
            ifl::INPUT_TENSOR.shape,
            &[None, None],
        )?;
        let (e, t) = (shape[0], shape[1]);
        let IndexedFlattenParams {
            f_len, output_len, ..
        } = params;
        if f_len == 0 || !t.is_multiple_of(f_len) || !output_len.is_multiple_of(f_len) {
            return Err(Error::param(
                "f_len",
                format!(
                    "must divide T = {t} (input_tensor's row length) and output_len = \
                     {output_len}, got {f_len}"
                ),
            ));
        }
        let (_, offsets) = validate::index_tensor(
            ifl::ROW_OFFSETS.name,
            inputs.row_offsets,
            ifl::ROW_OFFSETS.shape,
            &[None],
        )?;
        let start = match inputs.row_offsets_start {
            None => {
                if offsets.len() != e {
                    return Err(Error::shape(
                        ifl::ROW_OFFSETS.name,
                        format!("[N] with N = E = {e} (input_tensor's rows; no row_offsets_start)"),
                        inputs.row_offsets.shape(),
                    ));
                }
                0
            }
            Some(start) => {
                let (_, start) = validate::index_tensor(
                    ifl::ROW_OFFSETS_START.name,
                    start,
                    ifl::ROW_OFFSETS_START.shape,
                    &[Some(1)],
                )?;
                let first = usize::try_from(start[0])
                    .ok()
                    .filter(|&s| s.checked_add(e).is_some_and(|end| end <= offsets.len()));
                first.ok_or_else(|| {
                    Error::invalid(
                        ifl::ROW_OFFSETS_START.name,
                        format!(
                            "{} + E = {e} rows read past row_offsets' N = {}",
                            start[0],
                            offsets.len()
                        ),
                    )
                })?
            }
        };
        // The output, as large as the caller asks, is allocated by the backend ([`padded`]).
        Ok(Self {
            offsets: offsets[start..start + e]
                .iter()
                .map(|&o| i64::from(o))
                .collect(),
            inputs,
            params,
            dims: IndexedFlattenDims {
                e,
                t,
                f_len,
                output_len,
            },
        })
    }

    pub fn inputs(&self) -> IndexedFlattenInputs<'a> {
        self.inputs
    }

    pub fn params(&self) -> IndexedFlattenParams {
        self.params
    }

    pub fn dims(&self) -> IndexedFlattenDims {
        self.dims
    }

    /// `[E]`: each row's first output block.
    pub fn offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// `input_tensor`'s elements and `padding_val`, in its dtype.
    pub fn source(&self) -> FlattenSource<'a> {
        let pad = self.params.padding_val;
        match self.inputs.input_tensor.storage() {
            Storage::F32(v) => FlattenSource::F32(v, pad as f32),
            Storage::BF16(v) => FlattenSource::BF16(v, bf16::from_f32(pad as f32)),
            Storage::I32(v) => FlattenSource::I32(v, pad),
        }
    }

    /// `[output_len]` elements of `T` holding `padding`, or the error naming the output when
    /// they cannot be allocated (`output_len` is the caller's to choose).
    pub fn padded<T: Clone>(&self, padding: T) -> Result<Vec<T>> {
        try_filled(
            &spec::output(&ifl::FLATTENED_ARRAY),
            &[self.dims.output_len],
            padding,
        )
    }

    /// The output from the laid-out elements (`[output_len]`, `input_tensor`'s dtype).
    pub fn outputs_from(&self, flattened: Storage) -> Result<IndexedFlattenOutputs> {
        Ok(IndexedFlattenOutputs {
            flattened_array: Tensor::new([self.dims.output_len], flattened)?,
        })
    }
}

/// `input_tensor`'s elements and `padding_val` converted to their dtype.
#[derive(Clone, Copy, Debug)]
pub enum FlattenSource<'a> {
    F32(&'a [f32], f32),
    BF16(&'a [bf16], bf16),
    I32(&'a [i32], i32),
}

/// Outputs of `indexed_flatten`.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexedFlattenOutputs {
    /// `[output_len]` in `input_tensor`'s dtype.
    pub flattened_array: Tensor,
}

impl IndexedFlattenOutputs {
    /// The outputs by their specs ([`ifl::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![(&ifl::FLATTENED_ARRAY, self.flattened_array)]
    }
}
