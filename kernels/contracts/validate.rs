//! Shared input checks. Every backend runs the same checks (through the validated call types),
//! so error messages are identical whichever backend is chosen.

use crate::error::{Error, Result};
use crate::tensor::{DType, Storage, Tensor};

/// Requires an f32 or bf16 tensor of rank `dims.len()` whose extents match; `None` entries in
/// `dims` are free and are returned as read. `layout` is the human form, e.g. `"[T, H]"`.
pub(crate) fn float_tensor(
    name: &str,
    tensor: &Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
    if tensor.dtype() == DType::I32 {
        return Err(Error::DType {
            tensor: name.to_owned(),
            expected: "f32 or bf16".to_owned(),
            actual: tensor.dtype(),
        });
    }
    let shape = extents(name, tensor, layout, dims)?;
    finite(name, tensor)?;
    Ok(shape)
}

/// Requires an i32 tensor with the given extents (see [`float_tensor`]).
pub(crate) fn index_tensor<'t>(
    name: &str,
    tensor: &'t Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<(Vec<usize>, &'t [i32])> {
    let Some(values) = tensor.as_i32() else {
        return Err(Error::DType {
            tensor: name.to_owned(),
            expected: "i32".to_owned(),
            actual: tensor.dtype(),
        });
    };
    Ok((extents(name, tensor, layout, dims)?, values))
}

fn extents(
    name: &str,
    tensor: &Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
    let shape = tensor.shape();
    let matches = shape.len() == dims.len()
        && shape
            .iter()
            .zip(dims)
            .all(|(&actual, expected)| expected.is_none_or(|e| e == actual));
    if !matches {
        let concrete: Vec<String> = dims
            .iter()
            .map(|d| d.map_or_else(|| "_".to_owned(), |d| d.to_string()))
            .collect();
        let concrete = format!("[{}]", concrete.join(", "));
        let expected = if concrete == layout {
            concrete
        } else {
            format!("{layout} = {concrete}")
        };
        return Err(Error::shape(name, expected, shape));
    }
    Ok(shape.to_vec())
}

/// Requires every element of a floating-point tensor to be finite.
pub(crate) fn finite(name: &str, tensor: &Tensor) -> Result<()> {
    let bad = match tensor.storage() {
        Storage::F32(v) => v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i])),
        Storage::BF16(v) => v
            .iter()
            .position(|x| !x.is_finite())
            .map(|i| (i, v[i].to_f32())),
        Storage::I32(_) => None,
    };
    match bad {
        None => Ok(()),
        Some((index, value)) => Err(Error::NonFinite {
            tensor: name.to_owned(),
            position: position(tensor.shape(), index),
            value,
        }),
    }
}

/// Formats a flat row-major index as `[i, j, ...]`.
pub(crate) fn position(shape: &[usize], mut flat: usize) -> String {
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

/// Requires a dimension to be at least one.
pub(crate) fn non_empty(tensor: &str, what: &str, extent: usize) -> Result<()> {
    if extent == 0 {
        return Err(Error::invalid(
            tensor,
            format!("{what} must be at least 1, got 0"),
        ));
    }
    Ok(())
}

/// Checks an `expert_index [rows, K]` buffer: every id in `[0, E)` and no id twice in a row.
pub(crate) fn expert_ids(name: &str, ids: &[i32], shape: &[usize], experts: usize) -> Result<()> {
    check_ids(name, ids, shape, experts, false)
}

/// [`expert_ids`], where [`SKIP`](crate::contracts::SKIP) (−1) also marks a slot with no
/// assignment; the other ids are distinct per row.
pub(crate) fn expert_ids_or_skip(
    name: &str,
    ids: &[i32],
    shape: &[usize],
    experts: usize,
) -> Result<()> {
    check_ids(name, ids, shape, experts, true)
}

fn check_ids(name: &str, ids: &[i32], shape: &[usize], experts: usize, skip: bool) -> Result<()> {
    let k = *shape.last().unwrap_or(&1);
    for (row, chunk) in ids.chunks(k.max(1)).enumerate() {
        for (slot, &id) in chunk.iter().enumerate() {
            if skip && id == crate::contracts::SKIP {
                continue;
            }
            if id < 0 || id as usize >= experts {
                let allowed = if skip {
                    " (or -1 to skip the slot)"
                } else {
                    ""
                };
                return Err(Error::invalid(
                    name,
                    format!(
                        "expert id {id} at {} is outside [0, {experts}){allowed}",
                        position(shape, row * k + slot)
                    ),
                ));
            }
            if chunk[..slot].contains(&id) {
                return Err(Error::invalid(
                    name,
                    format!(
                        "expert id {id} appears twice in row {}",
                        position(&shape[..shape.len() - 1], row)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Accepts an `expert_affinities_masked`-style tensor of `[(T+1)·E]` or `[(T+1)·E, 1]` (the NKI
/// layout) and returns its length.
pub(crate) fn masked_affinities(name: &str, tensor: &Tensor, len: Option<usize>) -> Result<usize> {
    let flat = match *tensor.shape() {
        [n] | [n, 1] if len.is_none_or(|l| l == n) => n,
        _ => {
            let expected = len.map_or_else(|| "_".to_owned(), |l| l.to_string());
            return Err(Error::shape(
                name,
                format!("[(T+1)·E] = [{expected}] or [(T+1)·E, 1]"),
                tensor.shape(),
            ));
        }
    };
    if tensor.dtype() == DType::I32 {
        return Err(Error::DType {
            tensor: name.to_owned(),
            expected: "f32 or bf16".to_owned(),
            actual: tensor.dtype(),
        });
    }
    finite(name, tensor)?;
    Ok(flat)
}
