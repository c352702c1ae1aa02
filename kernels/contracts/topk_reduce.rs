//! `topk_reduce`: nki-library's MoE top-K combine after an exchange
//! (`experimental/collectives/topk_reduce.py`), with its tensor names, shapes and parameters.
//!
//! `input [TK_padded, H + 2]` (bf16) holds rows of H values, each followed by its global token
//! id: the bits of columns H (low half) and H + 1 (high half) as one little-endian i32, as an
//! expert-parallel exchange delivers them, in any order and padded. Token `t < T` is the id
//! `token_base_index + t` (1 by default, so ids are 1-indexed and padding rows hold −1, as
//! nki-library's current kernel takes them; `token_base_index = 0` is its earlier 0-indexed
//! convention, and `rank·T + 1` its sequence-parallel one). `output [T, H]` sums, for each
//! token, its first K rows in row order:
//! ```text
//! output[t] = Σ_{the first K rows r with id(r) = token_base_index + t} input[r, :H]
//! ```
//! Rows with other ids are ignored. A token may have from 1 to K rows (fewer where several of
//! its experts live on one rank); a token with none is an error naming it (nki-library's
//! kernel faults on it), and rows past a token's K-th are not summed, as nki-library's kernel
//! gathers K (its torch reference sums them all).
//!
//! moekit sums in f32 (the reference in f64) and rounds once; nki-library rounds each partial
//! sum to bf16 (its tests allow 5e-2). float16, which nki-library also takes, is not a moekit
//! dtype. Its device limits (1 < T ≤ 128, K ≤ 8, H even, 8 ≤ TK_padded ≤ 16384) bound its
//! compiled kernel, not the host backends. The H values must be finite; the id columns are
//! bits.

use half::bf16;

use super::OutputDType;
use super::spec::{self, Named, TensorSpec};
use super::tensors::topk_reduce as tr;
use super::validate;
use crate::error::{Error, Result};
use crate::tensor::{Floats, Tensor, position};

/// `topk_reduce`'s parameters, nki-library's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopkReduceParams {
    /// `T`, output tokens (≥ 1).
    pub t: usize,
    /// `K`, the most rows summed per token (≥ 1).
    pub k: usize,
    /// The id of token 0.
    pub token_base_index: i32,
}

impl TopkReduceParams {
    /// nki-library's default `token_base_index`: ids are 1-indexed.
    pub const DEFAULT_TOKEN_BASE_INDEX: i32 = 1;

    /// `T` and `K` with nki-library's default `token_base_index`.
    pub fn new(t: usize, k: usize) -> Self {
        Self {
            t,
            k,
            token_base_index: Self::DEFAULT_TOKEN_BASE_INDEX,
        }
    }
}

/// Inputs of [`TopkReduce`].
#[derive(Clone, Copy, Debug)]
pub struct TopkReduceInputs<'a> {
    /// `[TK_padded, H + 2]` bf16.
    pub input: &'a Tensor,
}

impl<'a> TopkReduceInputs<'a> {
    /// The inputs by their specs ([`tr::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![(&tr::INPUT, self.input)]
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            input: spec::required(&get, &tr::INPUT)?,
        })
    }
}

/// The sizes of a `topk_reduce` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopkReduceDims {
    /// TK_padded, rows of `input`.
    pub rows: usize,
    pub h: usize,
    pub t: usize,
    pub k: usize,
    /// The id of token 0 (`token_base_index`).
    pub token_base_index: i32,
}

/// A validated `topk_reduce` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Debug)]
pub struct TopkReduce<'a> {
    inputs: TopkReduceInputs<'a>,
    /// `input`'s elements.
    values: &'a [bf16],
    dims: TopkReduceDims,
    /// `[T]`: the rows each token sums (1 to K), in row order.
    gathered: Vec<Vec<usize>>,
    output_dtype: OutputDType,
}

/// The token id that row `row` of `input [rows, H + 2]` carries: the bits of columns H (low
/// half) and H + 1 (high half).
pub fn token_id(input: &[bf16], h: usize, row: usize) -> i32 {
    let at = row * (h + 2) + h;
    let (low, high) = (input[at].to_bits(), input[at + 1].to_bits());
    ((u32::from(high) << 16) | u32::from(low)) as i32
}

/// The last two columns of a row carrying token id `id` (the inverse of [`token_id`]).
pub fn token_id_columns(id: i32) -> [bf16; 2] {
    let bits = id as u32;
    [
        bf16::from_bits(bits as u16),
        bf16::from_bits((bits >> 16) as u16),
    ]
}

impl<'a> TopkReduce<'a> {
    /// Checks `input` (bf16, `[TK_padded, H + 2]`, finite values), `T` and `K`, and that every
    /// token has at least K rows.
    pub fn new(inputs: TopkReduceInputs<'a>, params: TopkReduceParams) -> Result<Self> {
        let name = tr::INPUT.name;
        let Some(Floats::BF16(values)) = inputs.input.floats() else {
            return Err(Error::DType {
                tensor: name.to_owned(),
                expected: "bf16 (the token id is the bits of its last two columns)".to_owned(),
                actual: inputs.input.dtype(),
            });
        };
        let shape =
            validate::float_tensor_shape(name, inputs.input, tr::INPUT.shape, &[None, None])?;
        let (rows, width) = (shape[0], shape[1]);
        if width < 2 {
            return Err(Error::shape(name, "[TK_padded, H+2] with H ≥ 0", &shape));
        }
        let h = width - 2;
        for (what, value) in [("T", params.t), ("K", params.k)] {
            if value == 0 {
                return Err(Error::param(what, "must be at least 1, got 0"));
            }
        }
        let (t, k) = (params.t, params.k);
        // Each token needs a row of its own (so nothing sized by T is allocated before this
        // holds), and its ids must be i32s.
        if t > rows {
            return Err(Error::invalid(
                name,
                format!("has {rows} rows, fewer than the T = {t} tokens that each need one"),
            ));
        }
        let base = i64::from(params.token_base_index);
        if base + t as i64 - 1 > i64::from(i32::MAX) {
            return Err(Error::param(
                "token_base_index",
                format!("{base} + T − 1 = {} is not an i32 id", base + t as i64 - 1),
            ));
        }
        // The values (not the id columns) must be finite.
        for row in 0..rows {
            let row_values = &values[row * width..row * width + h];
            if let Some(col) = row_values.iter().position(|v| !v.is_finite()) {
                return Err(Error::NonFinite {
                    tensor: name.to_owned(),
                    position: position(&shape, row * width + col),
                    value: row_values[col].to_f32(),
                });
            }
        }
        // Token t's rows (at most K each; T ≤ rows, so this is bounded by the input).
        let mut gathered: Vec<Vec<usize>> = vec![Vec::new(); t];
        for row in 0..rows {
            let token = i64::from(token_id(values, h, row)) - base;
            if let Ok(token) = usize::try_from(token)
                && token < t
                && gathered[token].len() < k
            {
                gathered[token].push(row);
            }
        }
        if let Some(token) = gathered.iter().position(Vec::is_empty) {
            return Err(Error::invalid(
                name,
                format!(
                    "no row carries token {token}'s id {} (token_base_index {base} + {token}); \
                     each of the T = {t} tokens needs 1 to K rows",
                    base + token as i64
                ),
            ));
        }
        Ok(Self {
            inputs,
            values,
            dims: TopkReduceDims {
                rows,
                h,
                t,
                k,
                token_base_index: params.token_base_index,
            },
            gathered,
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> TopkReduceInputs<'a> {
        self.inputs
    }

    /// `input`'s elements, `[TK_padded, H + 2]`.
    pub fn values(&self) -> &'a [bf16] {
        self.values
    }

    pub fn dims(&self) -> TopkReduceDims {
        self.dims
    }

    /// The rows of `input` token `token` sums (1 to K), in row order.
    pub fn rows_of(&self, token: usize) -> &[usize] {
        &self.gathered[token]
    }
}

output_dtype_accessors!(TopkReduce, TopkReduceOutputs);

/// Outputs of `topk_reduce`.
#[derive(Clone, Debug, PartialEq)]
pub struct TopkReduceOutputs {
    /// `[T, H]` in `input`'s dtype.
    pub output: Tensor,
}

impl TopkReduceOutputs {
    /// The outputs by their specs ([`tr::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![(&tr::OUTPUT, self.output)]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            output: f(&tr::OUTPUT, self.output)?,
        })
    }
}
