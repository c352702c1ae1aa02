//! `topk`: nki-library's top-k over a long last axis (`core/topk`: the `topk` entry point and
//! the `rotational_topk` kernel it launches), with its tensor names, shapes, parameters and
//! defaults.
//!
//! Per row `r` of `inp` (`[..., V]`, rank ≥ 2; its leading axes are the rows, `BxS` of them):
//! `topk_values[r] [K]` are the `K = k` largest of `inp[r, :]` and `topk_indices[r] [K]` their
//! positions along the last axis (`inp[r, topk_indices[r, j]] == topk_values[r, j]`), shaped
//! `inp.shape[:-1] + [K]`; values keep `inp`'s dtype (they are copied, not computed), indices
//! are i32 (nki-library's uint32; V fits either).
//!
//! Order: with `sorted_flag` (the default) descending; without it, in ascending position
//! (nki-library then returns its folds' runs in fold order, an order its tests do not check).
//! Between equal values the lower position comes first (nki-library leaves tie order
//! unspecified: its tests compare sorted values and the values the indices gather). Where
//! `K = V` nki-library returns `inp` itself with positions `0..V`, unsorted even with
//! `sorted_flag`; moekit does the same.
//!
//! `method` is nki-library's `SupportedTopkMethods`: ROTATIONAL (the default) and SCANNING
//! give the same result (how the device finds it differs); CASCADED, which nki-library maps to
//! no implementation, is refused. Its device limits (a fold of at most 16384 elements, indices
//! exact below 2^24) bound its compiled kernel, not the host backends. Values must be finite.

use std::fmt;
use std::str::FromStr;

use super::OutputDType;
use super::spec::{self, Named, TensorSpec};
use super::tensors::topk as tk;
use super::validate;
use crate::error::{Error, Result};
use crate::tensor::{Floats, Tensor};

/// nki-library's `SupportedTopkMethods`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TopkMethod {
    Scanning,
    /// nki-library has no implementation of it: refused.
    Cascaded,
    /// The default.
    #[default]
    Rotational,
}

impl TopkMethod {
    /// The parameter's name.
    pub const PARAM: &'static str = "method";
}

impl FromStr for TopkMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "SCANNING" => Ok(Self::Scanning),
            "CASCADED" => Ok(Self::Cascaded),
            "ROTATIONAL" => Ok(Self::Rotational),
            other => Err(Error::param(
                Self::PARAM,
                format!(
                    "expected ROTATIONAL, SCANNING or CASCADED (SupportedTopkMethods), got \
                     `{other}`"
                ),
            )),
        }
    }
}

impl fmt::Display for TopkMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Scanning => "SCANNING",
            Self::Cascaded => "CASCADED",
            Self::Rotational => "ROTATIONAL",
        })
    }
}

/// `topk`'s parameters, nki-library's names and defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopkParams {
    /// K, required: `1 ≤ K ≤ V`.
    pub k: usize,
    /// Descending (true, the default) or in ascending position.
    pub sorted_flag: bool,
    pub method: TopkMethod,
}

impl TopkParams {
    /// `k`, every other parameter at nki-library's default.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            sorted_flag: true,
            method: TopkMethod::default(),
        }
    }
}

/// Inputs of [`Topk`].
#[derive(Clone, Copy, Debug)]
pub struct TopkInputs<'a> {
    /// `[..., V]`, rank ≥ 2, f32 or bf16.
    pub inp: &'a Tensor,
}

impl<'a> TopkInputs<'a> {
    /// The inputs by their specs ([`tk::INPUTS`]).
    pub fn named(&self) -> Named<'a> {
        vec![(&tk::INP, self.inp)]
    }

    /// The inputs `get` finds by spec; a missing required one is an error naming it.
    pub fn from_named(get: impl Fn(&TensorSpec) -> Option<&'a Tensor>) -> Result<Self> {
        Ok(Self {
            inp: spec::required(&get, &tk::INP)?,
        })
    }
}

/// The sizes of a `topk` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopkDims {
    /// Rows: the product of `inp`'s leading axes (nki-library's `BxS`).
    pub rows: usize,
    /// V, the last axis.
    pub v: usize,
    pub k: usize,
}

/// A validated `topk` call.
///
/// Fields are private: a call can only come from `new`, which validates it, and cannot be
/// altered afterwards.
#[derive(Clone, Copy, Debug)]
pub struct Topk<'a> {
    inputs: TopkInputs<'a>,
    values: Floats<'a>,
    params: TopkParams,
    dims: TopkDims,
    output_dtype: OutputDType,
}

impl<'a> Topk<'a> {
    /// Checks `inp` (rank ≥ 2, non-empty, finite), `k` and `method`.
    pub fn new(inputs: TopkInputs<'a>, params: TopkParams) -> Result<Self> {
        if params.method == TopkMethod::Cascaded {
            return Err(Error::param(
                TopkMethod::PARAM,
                "CASCADED has no implementation in nki-library's topk (it maps only SCANNING \
                 and ROTATIONAL); use ROTATIONAL",
            ));
        }
        let shape = inputs.inp.shape();
        let Some((&v, leading)) = shape
            .split_last()
            .filter(|(_, leading)| !leading.is_empty())
        else {
            return Err(Error::shape(
                tk::INP.name,
                "[..., V] of rank 2 or more",
                shape,
            ));
        };
        let rank = shape.len();
        validate::float_tensor(tk::INP.name, inputs.inp, tk::INP.shape, &vec![None; rank])?;
        let rows = leading.iter().product();
        validate::non_empty(tk::INP.name, "the rows (its leading axes)", rows)?;
        validate::non_empty(tk::INP.name, "V (its last axis)", v)?;
        if i32::try_from(v).is_err() {
            return Err(Error::shape(
                tk::INP.name,
                format!("[..., V] with V ≤ {} (positions are i32)", i32::MAX),
                shape,
            ));
        }
        if !(1..=v).contains(&params.k) {
            return Err(Error::param(
                "k",
                format!("must be in 1..={v} (V, inp's last axis), got {}", params.k),
            ));
        }
        Ok(Self {
            values: validate::floats(tk::INP.name, inputs.inp)?,
            inputs,
            params,
            dims: TopkDims {
                rows,
                v,
                k: params.k,
            },
            output_dtype: OutputDType::default(),
        })
    }

    pub fn inputs(&self) -> TopkInputs<'a> {
        self.inputs
    }

    /// `inp`'s values as stored, `[rows, V]`.
    pub fn values(&self) -> Floats<'a> {
        self.values
    }

    pub fn params(&self) -> TopkParams {
        self.params
    }

    pub fn dims(&self) -> TopkDims {
        self.dims
    }

    /// The outputs' shape, `inp.shape[:-1] + [K]`.
    pub fn output_shape(&self) -> Vec<usize> {
        let shape = self.inputs.inp.shape();
        let mut out = shape[..shape.len() - 1].to_vec();
        out.push(self.dims.k);
        out
    }

    /// Whether K = V, where the values are `inp` as given and the indices `0..V`.
    pub fn is_whole_row(&self) -> bool {
        self.dims.k == self.dims.v
    }

    /// The outputs from the chosen positions `[rows, K]` (in output order): the values
    /// gathered from `inp` as stored, the positions as i32.
    pub fn outputs_at(&self, positions: Vec<i32>) -> Result<TopkOutputs> {
        let TopkDims { v, k, .. } = self.dims;
        let gathered = |row_slot: usize, position: i32| (row_slot / k) * v + position as usize;
        let shape = self.output_shape();
        let topk_values = match self.values {
            Floats::F32(values) => Tensor::from_f32(
                shape.clone(),
                positions
                    .iter()
                    .enumerate()
                    .map(|(slot, &p)| values[gathered(slot, p)])
                    .collect(),
            )?,
            Floats::BF16(values) => Tensor::from_bf16(
                shape.clone(),
                positions
                    .iter()
                    .enumerate()
                    .map(|(slot, &p)| values[gathered(slot, p)])
                    .collect(),
            )?,
        };
        self.cast_outputs(TopkOutputs {
            topk_values,
            topk_indices: Tensor::from_i32(shape, positions)?,
        })
    }
}

output_dtype_accessors!(Topk, TopkOutputs);

/// Outputs of `topk`.
#[derive(Clone, Debug, PartialEq)]
pub struct TopkOutputs {
    /// `[..., K]` in `inp`'s dtype.
    pub topk_values: Tensor,
    /// `[..., K]` i32, positions along `inp`'s last axis.
    pub topk_indices: Tensor,
}

impl TopkOutputs {
    /// The outputs by their specs ([`tk::OUTPUTS`]).
    pub fn into_named(self) -> Vec<(&'static TensorSpec, Tensor)> {
        vec![
            (&tk::TOPK_VALUES, self.topk_values),
            (&tk::TOPK_INDICES, self.topk_indices),
        ]
    }

    /// Every output through `f`, with its spec.
    pub fn try_map(
        self,
        mut f: impl FnMut(&'static TensorSpec, Tensor) -> Result<Tensor>,
    ) -> Result<Self> {
        Ok(Self {
            topk_values: f(&tk::TOPK_VALUES, self.topk_values)?,
            topk_indices: f(&tk::TOPK_INDICES, self.topk_indices)?,
        })
    }
}
