//! `find_nonzero_indices`: nki-library's per-column nonzero search
//! (`core/subkernels/find_nonzero_indices.py`), with its tensor names, shapes and parameters;
//! on the device it turns a masked affinity matrix `[T, E]` into each expert's token list.
//!
//! For each searched column `c` of `input_tensor [T, C_full]` (columns `col_start_id[0] +
//! 0..n_cols` where both are given, else all C_full): `indices[c] [T]` holds the rows `t` with
//! `input_tensor[t, column] != 0` in ascending order, then −1 up to T, and `nonzero_counts[c]`
//! how many there are. Values are compared with zero as stored (−0 is zero); floats must be
//! finite.
//!
//! `chunk_size` (T by default) only splits T on the device: it must divide T, as nki-library
//! asserts (its multiple-of-128 rule and the two-core split of C are device limits).
//! `index_dtype` is `int32`, the only one nki-library tests. Where only one of `col_start_id`
//! and `n_cols` is given nki-library silently searches every column; moekit refuses it.

use super::spec::{self, Named, TensorSpec};
use super::tensors::find_nonzero_indices as fni;
use super::validate;
use crate::error::{Error, Result};
use crate::tensor::{Storage, Tensor};

/// `find_nonzero_indices`' parameters, nki-library's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FindNonzeroIndicesParams {
    /// Columns searched from `col_start_id[0]` (with `col_start_id`).
    pub n_cols: Option<usize>,
    /// T by default; must divide T.
    pub chunk_size: Option<usize>,
}

/// `index_dtype`'s only value.
pub const INDEX_DTYPE: &str = "int32";

/// Inputs of [`FindNonzeroIndices`].
#[derive(Clone, Copy, Debug)]
pub struct FindNonzeroIndicesInputs<'a> {
    /// `[T, C_full]`, f32, bf16 or i32.
    pub input_tensor: &'a Tensor,
    /// `[1]` i32: the first column searched.
    pub col_start_id: Option<&'a Tensor>,
}

impl<'a> FindNonzeroIndicesInputs<'a> {
    /// The inputs by their specs ([`fni::INPUTS`]), an absent one left out.
    pub fn named(&self) -> Named<'a> {
        let mut named = vec![(&fni::INPUT_TENSOR, self.input_tensor)];
        named.extend(self.col_start_id.map(|start| (&fni::COL_START_ID, start)));
        named
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            input_tensor: spec::required(&get, &fni::INPUT_TENSOR)?,
            col_start_id: get(&fni::COL_START_ID),
        })
    }
}

/// The sizes of a `find_nonzero_indices` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FindNonzeroIndicesDims {
    /// T, rows searched.
    pub t: usize,
    /// C_full, `input_tensor`'s columns.
    pub c_full: usize,
    /// The first column searched.
    pub first: usize,
    /// C, columns searched.
    pub c: usize,
}

/// A validated `find_nonzero_indices` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct FindNonzeroIndices<'a> {
    inputs: FindNonzeroIndicesInputs<'a>,
    dims: FindNonzeroIndicesDims,
}

impl<'a> FindNonzeroIndices<'a> {
    /// Checks `input_tensor`, the column range and `chunk_size`.
    pub fn new(
        inputs: FindNonzeroIndicesInputs<'a>,
        params: FindNonzeroIndicesParams,
    ) -> Result<Self> {
        let shape = validate::any_tensor(
            fni::INPUT_TENSOR.name,
            inputs.input_tensor,
            fni::INPUT_TENSOR.shape,
            &[None, None],
        )?;
        let (t, c_full) = (shape[0], shape[1]);
        if i32::try_from(t).is_err() {
            return Err(Error::shape(
                fni::INPUT_TENSOR.name,
                format!("[T, C_full] with T ≤ {} (indices are i32)", i32::MAX),
                &shape,
            ));
        }
        let (first, c) = match (inputs.col_start_id, params.n_cols) {
            (None, None) => (0, c_full),
            (Some(start), Some(n_cols)) => {
                let (_, start) = validate::index_tensor(
                    fni::COL_START_ID.name,
                    start,
                    fni::COL_START_ID.shape,
                    &[Some(1)],
                )?;
                let first = usize::try_from(start[0])
                    .ok()
                    .filter(|&f| f.checked_add(n_cols).is_some_and(|end| end <= c_full));
                let Some(first) = first else {
                    return Err(Error::invalid(
                        fni::COL_START_ID.name,
                        format!(
                            "columns {0}..{0} + n_cols = {n_cols} are not within input_tensor's \
                             C_full = {c_full}",
                            start[0]
                        ),
                    ));
                };
                (first, n_cols)
            }
            (Some(_), None) => {
                return Err(Error::param(
                    "n_cols",
                    "col_start_id is given but n_cols is not: give both (to search columns \
                     col_start_id[0] + 0..n_cols) or neither (to search every column)",
                ));
            }
            (None, Some(_)) => {
                return Err(Error::param(
                    "n_cols",
                    "n_cols is given but the tensor col_start_id is not: give both (to search \
                     columns col_start_id[0] + 0..n_cols) or neither (to search every column)",
                ));
            }
        };
        if let Some(chunk) = params.chunk_size
            && (chunk == 0 || !t.is_multiple_of(chunk))
        {
            return Err(Error::param(
                "chunk_size",
                format!("must divide T = {t} (input_tensor's rows), got {chunk}"),
            ));
        }
        Ok(Self {
            inputs,
            dims: FindNonzeroIndicesDims {
                t,
                c_full,
                first,
                c,
            },
        })
    }

    pub fn inputs(&self) -> FindNonzeroIndicesInputs<'a> {
        self.inputs
    }

    pub fn dims(&self) -> FindNonzeroIndicesDims {
        self.dims
    }

    /// Whether element `i` of `input_tensor` (row-major) is nonzero.
    pub fn nonzero(&self) -> impl Fn(usize) -> bool + Sync + 'a {
        let storage = self.inputs.input_tensor.storage();
        move |i| match storage {
            Storage::F32(v) => v[i] != 0.0,
            Storage::BF16(v) => v[i].to_f32() != 0.0,
            Storage::I32(v) => v[i] != 0,
        }
    }

    /// The outputs from each searched column's nonzero rows (ascending).
    pub fn outputs_from(&self, columns: Vec<Vec<i32>>) -> Result<FindNonzeroIndicesOutputs> {
        let FindNonzeroIndicesDims { t, c, .. } = self.dims;
        let mut indices = Vec::with_capacity(c * t);
        let mut counts = Vec::with_capacity(c);
        for rows in columns {
            counts.push(rows.len() as i32);
            indices.extend_from_slice(&rows);
            indices.resize(indices.len() + t - rows.len(), -1);
        }
        Ok(FindNonzeroIndicesOutputs {
            indices: Tensor::from_i32([c, t], indices)?,
            nonzero_counts: Tensor::from_i32([c], counts)?,
        })
    }
}

/// Outputs of `find_nonzero_indices`.
#[derive(Clone, Debug, PartialEq)]
pub struct FindNonzeroIndicesOutputs {
    /// `[C, T]` i32: each column's nonzero rows, ascending, then −1.
    pub indices: Tensor,
    /// `[C]` i32.
    pub nonzero_counts: Tensor,
}

impl FindNonzeroIndicesOutputs {
    /// The outputs by their specs ([`fni::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&fni::INDICES, self.indices),
            (&fni::NONZERO_COUNTS, self.nonzero_counts),
        ]
    }
}
