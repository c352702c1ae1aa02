//! Shared input checks. Every backend runs the same checks (through the validated call types),
//! so error messages are identical whichever backend is chosen.

use half::bf16;
use rayon::prelude::*;

use super::SkipMode;
use super::spec::TensorSpec;
use crate::error::{Error, Result};
use crate::tensor::{DType, Floats, Storage, Tensor, position};

/// Requires an f32 or bf16 tensor of rank `dims.len()` whose extents match; `None` entries in
/// `dims` are free and are returned as read. `layout` is the human form, e.g. `"[T, H]"`.
pub(crate) fn float_tensor(
    name: &str,
    tensor: &Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
    let shape = float_tensor_shape(name, tensor, layout, dims)?;
    finite(name, tensor)?;
    Ok(shape)
}

/// The elements of float tensor `name`, or the dtype error naming it.
pub(crate) fn floats<'t>(name: &str, tensor: &'t Tensor) -> Result<Floats<'t>> {
    tensor.floats().ok_or_else(|| Error::DType {
        tensor: name.to_owned(),
        expected: "f32 or bf16".to_owned(),
        actual: tensor.dtype(),
    })
}

/// [`float_tensor`] for the contract tensor `spec`, in its declared layout.
pub(crate) fn float_input(
    spec: &TensorSpec,
    tensor: &Tensor,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
    float_tensor(spec.name, tensor, spec.shape, dims)
}

/// [`index_tensor`] for the contract tensor `spec`, in its declared layout.
pub(crate) fn index_input<'t>(
    spec: &TensorSpec,
    tensor: &'t Tensor,
    dims: &[Option<usize>],
) -> Result<(Vec<usize>, &'t [i32])> {
    index_tensor(spec.name, tensor, spec.shape, dims)
}

/// [`float_tensor`] without the finiteness check, for a kernel that checks finiteness in a
/// pass it makes over the values anyway.
pub(crate) fn float_tensor_shape(
    name: &str,
    tensor: &Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
    floats(name, tensor)?;
    extents(name, tensor, layout, dims)
}

/// Requires a tensor of any dtype with the given extents, finite where it holds floats (see
/// [`float_tensor`]).
pub(crate) fn any_tensor(
    name: &str,
    tensor: &Tensor,
    layout: &str,
    dims: &[Option<usize>],
) -> Result<Vec<usize>> {
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
        Storage::F32(v) => first_non_finite_f32(v).map(|i| (i, v[i])),
        Storage::BF16(v) => first_non_finite_bf16(v).map(|i| (i, v[i].to_f32())),
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

/// Index of the first infinity or NaN of `values` (see [`first_non_finite`]).
pub(crate) fn first_non_finite_f32(values: &[f32]) -> Option<usize> {
    first_non_finite(values, |x| x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
}

/// Index of the first infinity or NaN of `values` (see [`first_non_finite`]).
pub(crate) fn first_non_finite_bf16(values: &[bf16]) -> Option<usize> {
    first_non_finite(values, |x| x.to_bits() & 0x7f80 == 0x7f80)
}

/// Index of the first infinity or NaN of `values`, the elements whose exponent bits are all
/// set (`special`). Validation reads every input of every call, so whole chunks are screened
/// branch-free (an OR of the elements' tests, which vectorises at every instruction-set
/// level), in parallel for large tensors, and only a failing chunk is searched element by
/// element.
fn first_non_finite<T: Copy + Sync>(
    values: &[T],
    special: impl Fn(T) -> bool + Sync,
) -> Option<usize> {
    const CHUNK: usize = 1 << 14;
    let screen = |(c, chunk): (usize, &[T])| {
        let any = chunk.iter().fold(false, |any, &x| any | special(x));
        any.then(|| chunk.iter().position(|&x| special(x)))
            .flatten()
            .map(|i| c * CHUNK + i)
    };
    if values.len() >= 16 * CHUNK {
        values.par_chunks(CHUNK).enumerate().find_map_first(screen)
    } else {
        values.chunks(CHUNK).enumerate().find_map(screen)
    }
}

/// Requires a float parameter row of N elements, `[N]` or `[1, N]` (as nki-library takes its
/// biases and norm weights); `layout` is the human form.
pub(crate) fn row_tensor(name: &str, tensor: &Tensor, n: usize, layout: &str) -> Result<()> {
    let dims: &[Option<usize>] = if tensor.shape().len() == 2 {
        &[Some(1), Some(n)]
    } else {
        &[Some(n)]
    };
    float_tensor(name, tensor, layout, dims).map(drop)
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

/// Checks that every id of an `expert_index [rows, K]` buffer lies in `[0, E)`, where a row may
/// name an expert twice (`moe_tkg` sums a repeated expert each time); `experts_are` says what
/// the E experts are, for the message.
pub(crate) fn repeatable_expert_ids(
    name: &str,
    ids: &[i32],
    shape: &[usize],
    (experts, experts_are): (usize, &str),
) -> Result<()> {
    match ids.iter().position(|&id| id < 0 || id as usize >= experts) {
        None => Ok(()),
        Some(index) => Err(Error::invalid(
            name,
            format!(
                "expert id {} at {} is outside [0, {experts}) ({experts_are})",
                ids[index],
                position(shape, index)
            ),
        )),
    }
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

/// Requires row T of a `[T+1, width]` tensor (the padding token's row, as the NKI kernels lay
/// it out) to be zero.
pub(crate) fn zero_padding_row(name: &str, tensor: &Tensor, t: usize, width: usize) -> Result<()> {
    let start = t * width;
    match (start..start + width).find(|&j| tensor.get_f64(j).is_some_and(|v| v != 0.0)) {
        None => Ok(()),
        Some(j) => Err(Error::invalid(
            name,
            format!(
                "row T = {t} belongs to the padding token and must be zero; column {} is not",
                j - start
            ),
        )),
    }
}

/// Accepts an `expert_affinities_masked`-style tensor of `len` = `(T+1)·E` values (`T·E` with
/// `skip_token`), `[len]` or `[len, 1]` (the NKI layout).
pub(crate) fn masked_affinities(
    name: &str,
    tensor: &Tensor,
    len: usize,
    skip_dma: SkipMode,
) -> Result<()> {
    if !matches!(*tensor.shape(), [n] | [n, 1] if n == len) {
        let rows = if skip_dma.skip_token { "T" } else { "(T+1)" };
        return Err(Error::shape(
            name,
            format!("[{rows}·E] = [{len}] or [{rows}·E, 1]"),
            tensor.shape(),
        ));
    }
    if tensor.dtype() == DType::I32 {
        return Err(Error::DType {
            tensor: name.to_owned(),
            expected: "f32 or bf16".to_owned(),
            actual: tensor.dtype(),
        });
    }
    finite(name, tensor)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain search the chunked, parallel one must agree with.
    fn first_by_scan(values: &[f32]) -> Option<usize> {
        values.iter().position(|x| !x.is_finite())
    }

    #[test]
    fn the_first_non_finite_element_is_found_in_every_chunk_and_path() {
        // Below and above the parallel threshold, bad values at chunk edges, two bad values
        // (the first counts), and every kind of non-finite value with either sign.
        for len in [0usize, 1, 100, (1 << 14) + 3, (16 << 14) + 5, 40 << 14] {
            let positions = [0, 1, (1 << 14) - 1, 1 << 14, len / 2, len.saturating_sub(1)];
            for bad in [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for &at in positions.iter().filter(|&&p| p < len) {
                    let mut values: Vec<f32> = (0..len).map(|i| i as f32 - 7.5).collect();
                    values[at] = bad;
                    if at + 3 < len {
                        values[len - 1] = f32::NAN;
                    }
                    let tensor = Tensor::from_f32([len], values.clone()).unwrap();
                    let err = finite("x", &tensor).unwrap_err();
                    let expected = first_by_scan(&values).unwrap();
                    assert_eq!(
                        err.to_string(),
                        Error::NonFinite {
                            tensor: "x".into(),
                            position: format!("[{expected}]"),
                            value: values[expected],
                        }
                        .to_string()
                    );
                    let bf16s = values.iter().map(|&v| bf16::from_f32(v)).collect();
                    let tensor = Tensor::from_bf16([len], bf16s).unwrap();
                    let err = finite("x", &tensor).unwrap_err().to_string();
                    assert!(err.contains(&format!("[{expected}]")), "{err}");
                }
            }
            let values: Vec<f32> = (0..len).map(|i| f32::MAX - i as f32).collect();
            assert!(finite("x", &Tensor::from_f32([len], values).unwrap()).is_ok());
        }
    }
}
