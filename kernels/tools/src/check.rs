//! Checking a backend against the reference (what `moekit check` runs): random MoE layers go
//! through both backends kernel by kernel, and every output tensor is compared.
//!
//! A case is one routed layer: the reference routes it and builds its block plan and
//! checkpoints, so every kernel of both backends receives identical inputs. For the `cpu`
//! backend the layer sizes are random (seeded); for `neuron` they are those of each manifest
//! entry, since a NEFF runs one shape only.
//!
//! Every kernel runs with `output_dtype=float32` on both sides, so bf16 inputs are compared at
//! the precision the backends compute in, not after rounding into bf16.
//!
//! An element passes when `|got − want| ≤ atol · max(1, max |want|) + rtol · |want|` (i32
//! outputs, indices and counts, only when equal). The default tolerances are the backends' documented error bounds:
//! [`Tolerance::CPU`] and [`Tolerance::NEURON`].

use std::collections::BTreeMap;
use std::fmt::Write as _;

use moekit::backend::Backend;
use moekit::backends::BackendKind;
use moekit::contracts::{
    ActFnType, ExpertAffinityScaleMode, OutputDType, RouterActFnType, XHbmLayout,
    static_block_count, tensors,
};
use moekit::error::{Error, Result};
use moekit::kernel::{Kernel, Params};
use moekit::neuron::manifest::{Manifest, Value};
use moekit::random::SplitMix64;
use moekit::tensor::{DType, Tensor};

use crate::layer::{Layer, LayerInputs, MoeShape};

/// The agreement `check` demands of a backend.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    pub rtol: f64,
    pub atol: f64,
}

impl Tolerance {
    /// The cpu backend accumulates in f32 where the reference uses f64.
    pub const CPU: Tolerance = Tolerance {
        rtol: 1e-4,
        atol: 1e-4,
    };
    /// NeuronCores multiply bf16 (or fp32 as bf16 passes) and accumulate in fp32 PSUM.
    pub const NEURON: Tolerance = Tolerance {
        rtol: 2e-2,
        atol: 2e-2,
    };

    /// The documented tolerance of `backend` (the reference against itself: exact).
    pub fn of(backend: BackendKind) -> Tolerance {
        match backend {
            BackendKind::Reference => Tolerance {
                rtol: 0.0,
                atol: 0.0,
            },
            BackendKind::Cpu => Tolerance::CPU,
            BackendKind::Neuron => Tolerance::NEURON,
        }
    }
}

/// One routed layer and the kernels to check on it.
pub struct CheckCase {
    /// The layer's sizes, e.g. `t=17 h=9 e=5 k=2 i=4 b=3 f32`.
    pub label: String,
    pub kernels: Vec<Kernel>,
    /// Every kernel input, by contract name.
    pub tensors: BTreeMap<String, Tensor>,
    pub params: Params,
}

/// The sizes of one case's layer.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    i: usize,
    b: usize,
}

impl CheckCase {
    fn new(
        sizes: Sizes,
        dtype: DType,
        seed: u64,
        kernels: Vec<Kernel>,
        params: Params,
    ) -> Result<CheckCase> {
        let Sizes { t, h, e, k, i, b } = sizes;
        let shape = MoeShape {
            name: "check",
            h,
            i,
            e,
            k,
        };
        let reference = BackendKind::Reference.create();
        let layer = Layer::new(
            reference.as_ref(),
            LayerInputs::seeded(shape, t, dtype, b, seed)?,
        )?;
        let mut tensors = layer_tensors(layer);
        if params.skip_dma().skip_token {
            without_padding_row(&mut tensors, t, e)?;
        }
        Ok(CheckCase {
            label: format!("t={t} h={h} e={e} k={k} i={i} b={b} {dtype}"),
            kernels,
            tensors,
            // Compared at the precision the backends compute in, whatever the inputs' dtype.
            params: Params {
                output_dtype: Some(OutputDType::Float32),
                ..params
            },
        })
    }
}

/// Every tensor a kernel of the layer may read, by contract name.
fn layer_tensors(layer: Layer) -> BTreeMap<String, Tensor> {
    let Layer {
        inputs,
        routed,
        plan,
        checkpoints,
    } = layer;
    use tensors::{
        blockwise_mm_bwd as bwd, load_balancing_loss_bwd as aux, permute_bwd, router_topk,
    };
    let mut named: BTreeMap<String, Tensor> = [
        (router_topk::X, inputs.x),
        (router_topk::W, inputs.w),
        (bwd::HIDDEN_STATES, inputs.hidden_states),
        (bwd::GATE_UP_PROJ_WEIGHT, inputs.gate_up_proj_weight),
        (bwd::DOWN_PROJ_WEIGHT, inputs.down_proj_weight),
        (
            tensors::router_topk_bwd::D_TOPK_AFFINITIES,
            inputs.d_topk_affinities,
        ),
        (aux::D_AUX_LOSS, inputs.d_aux_loss),
        (
            bwd::OUTPUT_HIDDEN_STATES_GRAD,
            inputs.output_hidden_states_grad,
        ),
        (router_topk::ROUTER_LOGITS, routed.router_logits),
        (router_topk::EXPERT_INDEX, routed.expert_index),
        (router_topk::TOPK_AFFINITIES, routed.topk_affinities),
        (bwd::TOKEN_POSITION_TO_ID, plan.token_position_to_id),
        (bwd::BLOCK_TO_EXPERT, plan.block_to_expert),
        (
            permute_bwd::EXPERT_AFFINITIES_MASKED_GRAD,
            plan.expert_affinities_masked.clone(),
        ),
        (bwd::EXPERT_AFFINITIES_MASKED, plan.expert_affinities_masked),
    ]
    .into_iter()
    .map(|(spec, tensor)| (spec.name.to_owned(), tensor))
    .collect();
    // The forward's checkpoints, under the names the backward takes them by.
    let [(_, gate_up), (_, down)] = bwd::CHECKPOINTS;
    if let Some(t) = checkpoints.gate_up_activations_t {
        named.insert(gate_up.name.to_owned(), t);
    }
    if let Some(t) = checkpoints.down_activations {
        named.insert(down.name.to_owned(), t);
    }
    named
}

/// The blockwise tensors of `tensors` in `SkipMode(skip_token)`'s layout: the padding row T of
/// `hidden_states`, `output_hidden_states_grad` and the masked affinities dropped, padding slots
/// −1.
fn without_padding_row(tensors: &mut BTreeMap<String, Tensor>, t: usize, e: usize) -> Result<()> {
    use tensors::{blockwise_mm_bwd as bwd, permute_bwd};
    for (spec, rows) in [
        (bwd::HIDDEN_STATES, t),
        (bwd::OUTPUT_HIDDEN_STATES_GRAD, t),
        (bwd::EXPERT_AFFINITIES_MASKED, t * e),
        (permute_bwd::EXPERT_AFFINITIES_MASKED_GRAD, t * e),
    ] {
        if let Some(tensor) = tensors.remove(spec.name) {
            let kept = tensor.into_leading_rows(spec.name, rows)?;
            tensors.insert(spec.name.to_owned(), kept);
        }
    }
    if let Some(positions) = tensors.get(bwd::TOKEN_POSITION_TO_ID.name) {
        let Some(ids) = positions.as_i32() else {
            return Err(Error::DType {
                tensor: bwd::TOKEN_POSITION_TO_ID.name.to_owned(),
                expected: "i32".to_owned(),
                actual: positions.dtype(),
            });
        };
        let ids = ids
            .iter()
            .map(|&id| if id as usize == t { -1 } else { id })
            .collect::<Vec<_>>();
        let skipped = Tensor::from_i32([ids.len()], ids)?;
        tensors.insert(bwd::TOKEN_POSITION_TO_ID.name.to_owned(), skipped);
    }
    Ok(())
}

/// `cases` layers of random sizes (T ≤ 64, H ≤ 48, E ≤ 12, I ≤ 32, B ≤ 16, with odd sizes and
/// B > T·K among them), each checking `kernels` with random router parameters.
pub fn random_cases(
    cases: usize,
    seed: u64,
    dtype: DType,
    kernels: &[Kernel],
) -> Result<Vec<CheckCase>> {
    at_least_one_case(cases)?;
    let mut rng = SplitMix64::new(seed);
    (0..cases)
        .map(|case| {
            let mut draw = |lo: usize, hi: usize| lo + rng.below(hi - lo + 1);
            let e = draw(1, 12);
            let sizes = Sizes {
                t: draw(1, 64),
                h: draw(1, 48),
                e,
                k: draw(1, e.min(8)),
                i: draw(1, 32),
                b: draw(1, 16),
            };
            let activation = ActFnType::ALL[draw(0, ActFnType::ALL.len() - 1)];
            // The largest divisor of E up to a drawn bound: the expert-parallel ranks.
            let bound = draw(1, e);
            let ranks = (1..=bound)
                .rev()
                .find(|&r| e.is_multiple_of(r))
                .unwrap_or(1);
            let scaling =
                ExpertAffinityScaleMode::ALL[draw(0, ExpertAffinityScaleMode::ALL.len() - 1)];
            let params = Params {
                k: Some(sizes.k),
                act_fn: Some(if draw(0, 1) == 0 {
                    RouterActFnType::Softmax
                } else {
                    RouterActFnType::Sigmoid
                }),
                router_pre_norm: Some(draw(0, 1) == 1),
                norm_topk_prob: Some(draw(0, 1) == 1),
                x_hbm_layout: Some(XHbmLayout::TH),
                num_experts: Some(sizes.e),
                block_size: Some(sizes.b),
                n_block_per_iter: Some(1),
                checkpoint_activation: Some(true),
                activation_function: Some(activation),
                activation_type: Some(activation),
                scaling_mode: Some(scaling),
                expert_parallel_degree: Some(ranks),
                ..Params::default()
            };
            CheckCase::new(
                sizes,
                dtype,
                seed.wrapping_add(case as u64),
                kernels.to_vec(),
                params,
            )
        })
        .collect()
}

/// `cases` layers per manifest entry (of `kernel`, if given), at the entry's shape. Entries
/// must name every size: `t`, `h`, `e`, `k` (router_topk) or `t`, `h`, `e`, `i`,
/// `block_size`, `num_blocks` (blockwise_mm; K is the smallest top-k whose static block count
/// is `num_blocks`).
pub fn manifest_cases(
    manifest: &Manifest,
    kernel: Option<Kernel>,
    cases: usize,
    seed: u64,
    dtype: DType,
) -> Result<Vec<CheckCase>> {
    at_least_one_case(cases)?;
    let mut out = Vec::new();
    for (index, entry) in manifest.entries.iter().enumerate() {
        if kernel.is_some_and(|k| k != entry.kernel) {
            continue;
        }
        let int = |key: &str| match entry.params.get(key) {
            Some(Value::Int(v)) => Ok(*v),
            _ => Err(Error::Format {
                path: manifest.path.clone(),
                message: format!(
                    "kernel entry {} ({}): `check` needs `{key}`, the size the NEFF was compiled for",
                    index + 1,
                    entry.neff.display()
                ),
            }),
        };
        let flag = |key: &str| matches!(entry.params.get(key), Some(Value::Bool(true)));
        let (sizes, params) = match entry.kernel {
            Kernel::RouterTopk => {
                let act_fn = match entry.params.get("act_fn") {
                    Some(Value::Str(name)) => name.parse()?,
                    _ => RouterActFnType::Softmax,
                };
                let x_hbm_layout = match entry.params.get("x_hbm_layout") {
                    Some(&Value::Int(0)) => XHbmLayout::HT,
                    _ => XHbmLayout::TH,
                };
                let k = int("k")?;
                let sizes = Sizes {
                    t: int("t")?,
                    h: int("h")?,
                    e: int("e")?,
                    k,
                    i: 1,
                    b: 1,
                };
                let params = Params {
                    k: Some(k),
                    act_fn: Some(act_fn),
                    // nki-library's default is ACT1.
                    router_pre_norm: Some(!matches!(
                        entry.params.get("router_pre_norm"),
                        Some(Value::Bool(false))
                    )),
                    norm_topk_prob: Some(flag("norm_topk_prob")),
                    x_hbm_layout: Some(x_hbm_layout),
                    ..Params::default()
                };
                (sizes, params)
            }
            _ => {
                let (t, e, b, n) = (int("t")?, int("e")?, int("block_size")?, int("num_blocks")?);
                let k = top_k_for_blocks(t, e, b, n).ok_or_else(|| Error::Format {
                    path: manifest.path.clone(),
                    message: format!(
                        "kernel entry {} ({}): no top-k gives num_blocks = {n} for t={t} e={e} block_size={b}",
                        index + 1,
                        entry.neff.display()
                    ),
                })?;
                // nki-library's default is to accumulate; storing needs one slot per token.
                let accumulating = !matches!(
                    entry.params.get("is_tensor_update_accumulating"),
                    Some(Value::Bool(false))
                );
                if !accumulating && k != 1 {
                    return Err(Error::Format {
                        path: manifest.path.clone(),
                        message: format!(
                            "kernel entry {} ({}): is_tensor_update_accumulating = false stores \
                             each slot's row, which needs top-k 1, but num_blocks = {n} is the \
                             plan of top-k {k}",
                            index + 1,
                            entry.neff.display()
                        ),
                    });
                }
                let sizes = Sizes {
                    t,
                    h: int("h")?,
                    e,
                    k,
                    i: int("i")?,
                    b,
                };
                let activation = |key: &str| match entry.params.get(key) {
                    Some(Value::Str(name)) => ActFnType::parse(key, name).map(Some),
                    _ => Ok(None),
                };
                let scaling = match entry.params.get("expert_affinities_scaling_mode") {
                    Some(Value::Str(name)) => Some(ExpertAffinityScaleMode::parse(
                        "expert_affinities_scaling_mode",
                        name,
                    )?),
                    _ => None,
                };
                let params = Params {
                    checkpoint_activation: Some(flag("checkpoint_activation")),
                    activation_function: activation("activation_function")?,
                    activation_type: activation("activation_type")?,
                    scaling_mode: scaling,
                    skip_token: Some(flag("skip_token")),
                    is_tensor_update_accumulating: Some(accumulating),
                    ..Params::default()
                };
                (sizes, params)
            }
        };
        for case in 0..cases {
            out.push(CheckCase::new(
                sizes,
                dtype,
                seed.wrapping_add(case as u64),
                vec![entry.kernel],
                params.clone(),
            )?);
        }
    }
    if out.is_empty() {
        return Err(Error::Format {
            path: manifest.path.clone(),
            message: match kernel {
                Some(kernel) => format!("no kernel entry runs `{}`", kernel.name()),
                None => "no kernel entry".to_owned(),
            },
        });
    }
    Ok(out)
}

/// A check of no case would pass without checking anything.
fn at_least_one_case(cases: usize) -> Result<()> {
    if cases == 0 {
        return Err(Error::param("cases", "must be at least 1, got 0"));
    }
    Ok(())
}

/// The smallest K ≤ E whose static block count for T tokens over E experts in blocks of B is N.
fn top_k_for_blocks(t: usize, e: usize, b: usize, n: usize) -> Option<usize> {
    // The count never decreases as K grows (a T·K past usize counts as past N), so the first
    // K that reaches N is found by bisection, whatever the sizes.
    let reaches = |k: usize| {
        t.checked_mul(k)
            .and_then(|m| static_block_count(m, e, b, 1))
            .is_none_or(|count| count >= n)
    };
    let (mut lo, mut hi) = (1, e);
    if lo > hi {
        return None;
    }
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if reaches(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    (t.checked_mul(lo)
        .and_then(|m| static_block_count(m, e, b, 1))
        == Some(n))
    .then_some(lo)
}

/// One output tensor of one kernel of one case.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckRow {
    pub case: usize,
    pub label: String,
    pub kernel: &'static str,
    pub tensor: &'static str,
    pub elements: usize,
    pub max_abs: f64,
    pub max_rel: f64,
    /// Elements outside the tolerance.
    pub failures: usize,
}

impl CheckRow {
    pub fn pass(&self) -> bool {
        self.failures == 0
    }
}

/// Runs every case's kernels on `backend` and on the reference and compares each output.
pub fn check(
    backend: &dyn Backend,
    cases: &[CheckCase],
    tolerance: Tolerance,
) -> Result<Vec<CheckRow>> {
    let reference = BackendKind::Reference.create();
    let mut rows = Vec::new();
    for (index, case) in cases.iter().enumerate() {
        for &kernel in &case.kernels {
            let want = kernel.run(reference.as_ref(), &case.tensors, &case.params)?;
            let got = kernel.run(backend, &case.tensors, &case.params)?;
            for (name, want) in &want {
                let got = got
                    .iter()
                    .find_map(|(got_name, got)| (got_name == name).then_some(got))
                    .ok_or_else(|| Error::MissingTensor((*name).to_owned()))?;
                rows.push(compare(
                    index,
                    &case.label,
                    kernel,
                    name,
                    got,
                    want,
                    tolerance,
                )?);
            }
        }
    }
    Ok(rows)
}

fn compare(
    case: usize,
    label: &str,
    kernel: Kernel,
    tensor: &'static str,
    got: &Tensor,
    want: &Tensor,
    tolerance: Tolerance,
) -> Result<CheckRow> {
    if got.shape() != want.shape() {
        return Err(Error::shape(
            tensor,
            format!("{:?} (the reference's)", want.shape()),
            got.shape(),
        ));
    }
    let exact = want.dtype() == DType::I32;
    let (got, want) = (got.to_f64_vec(), want.to_f64_vec());
    let scale = want
        .iter()
        .filter(|v| v.is_finite())
        .fold(1.0f64, |m, v| m.max(v.abs()));
    let mut row = CheckRow {
        case,
        label: label.to_owned(),
        kernel: kernel.name(),
        tensor,
        elements: want.len(),
        max_abs: 0.0,
        max_rel: 0.0,
        failures: 0,
    };
    for (&g, &w) in got.iter().zip(&want) {
        // Equal values (infinities included) agree; a NaN on either side never does.
        let diff = if g == w { 0.0 } else { (g - w).abs() };
        row.max_abs = nan_max(row.max_abs, diff);
        if w != 0.0 {
            row.max_rel = nan_max(row.max_rel, diff / w.abs());
        }
        let allowed = if exact {
            0.0
        } else {
            tolerance.atol * scale + tolerance.rtol * w.abs()
        };
        let within = diff <= allowed;
        if !within {
            row.failures += 1;
        }
    }
    Ok(row)
}

/// The larger of two errors, NaN if either is (so a NaN output shows in the report).
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// The report `moekit check` prints: one line per output tensor, then a summary.
pub fn table(backend: &str, rows: &[CheckRow], tolerance: Tolerance) -> String {
    let mut out = format!(
        "{backend} vs reference (pass: |got - want| <= {:e} * max(1, max|want|) + {:e} * |want|)\n",
        tolerance.atol, tolerance.rtol
    );
    let _ = writeln!(
        out,
        "{:<5} {:<36} {:<25} {:<30} {:>9} {:>11} {:>11}  result",
        "case", "layer", "kernel", "tensor", "elements", "max abs", "max rel"
    );
    for row in rows {
        let _ = writeln!(
            out,
            "{:<5} {:<36} {:<25} {:<30} {:>9} {:>11.3e} {:>11.3e}  {}",
            row.case,
            row.label,
            row.kernel,
            row.tensor,
            row.elements,
            row.max_abs,
            row.max_rel,
            if row.pass() {
                "PASS".to_owned()
            } else {
                format!("FAIL ({} of {} elements)", row.failures, row.elements)
            }
        );
    }
    let failed = rows.iter().filter(|row| !row.pass()).count();
    let _ = writeln!(
        out,
        "{}: {} of {} output tensors within tolerance",
        if failed == 0 { "PASS" } else { "FAIL" },
        rows.len() - failed,
        rows.len()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_for_blocks_is_the_first_k_with_the_block_count() {
        for t in 1..12 {
            for e in 1..10 {
                for b in 1..6 {
                    for n in 0..40 {
                        let linear =
                            (1..=e).find(|&k| static_block_count(t * k, e, b, 1) == Some(n));
                        assert_eq!(top_k_for_blocks(t, e, b, n), linear, "{t} {e} {b} {n}");
                    }
                }
            }
        }
    }

    #[test]
    fn top_k_for_blocks_answers_at_once_for_sizes_no_loop_could_walk() {
        let huge = usize::MAX / 2;
        // Blocks of one slot: N = T·K, and no K gives an odd N for T = 2.
        assert_eq!(top_k_for_blocks(2, huge, 1, 3), None);
        assert_eq!(top_k_for_blocks(2, huge, 1, 4), Some(2));
        // T·K overflows long before K reaches E.
        assert_eq!(top_k_for_blocks(huge, huge, 1, usize::MAX), None);
        assert_eq!(top_k_for_blocks(3, 0, 1, 0), None);
    }
}
