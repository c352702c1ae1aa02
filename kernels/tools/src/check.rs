//! Checking a backend against the reference (what `moekit check` runs): random MoE layers go
//! through both backends kernel by kernel, and every output tensor is compared.
//!
//! A case is one routed layer: the reference routes it and builds its block plan and
//! checkpoints, so every kernel of both backends receives identical inputs. The layer sizes are
//! random (seeded), or, for a backend of compiled kernels, those of each shape it runs
//! ([`Backend::fixed_shapes`]: a NEFF runs one shape only).
//!
//! Every kernel runs with `output_dtype=float32` on both sides, so bf16 inputs are compared at
//! the precision the backends compute in, not after rounding into bf16.
//!
//! An element passes when `|got − want| ≤ atol · max(1, max |want|) + rtol · |want|` (i32
//! outputs, indices and counts, only when equal). The default tolerance is the backend's
//! documented error bound ([`Backend::tolerance`]).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use moekit::backend::{Backend, LayerSizes, Tolerance};
use moekit::backends::BackendKind;
use moekit::contracts::{
    ActFnType, ExpertAffinityScaleMode, FindNonzeroIndices, FindNonzeroIndicesInputs,
    FindNonzeroIndicesParams, OutputDType, RouterActFnType, RouterMmDType, TopkReduceParams,
    XHbmLayout, tensors,
};
use moekit::error::{Error, Result};
use moekit::kernel::{Kernel, Params};
use moekit::random::SplitMix64;
use moekit::tensor::{DType, Tensor};

use crate::layer::{Layer, LayerInputs, MoeShape, flatten_plan};

/// One routed layer and the kernels to check on it.
pub struct CheckCase {
    /// The layer's sizes, e.g. `t=17 h=9 e=5 k=2 i=4 b=3 f32`.
    pub label: String,
    pub kernels: Vec<Kernel>,
    /// Every kernel input, by contract name (`hidden_states` blockwise_mm's `[T+1, H]`).
    pub tensors: BTreeMap<String, Tensor>,
    /// `rmsnorm_router_topk_tkg`'s `hidden_states [T, H]` and `moe_block_tkg`'s `inp`: the
    /// layer's tokens.
    pub decode_hidden_states: Tensor,
    /// `indexed_flatten`'s `input_tensor [E, T]`: the reference's `find_nonzero_indices` over
    /// the routed affinities (that kernel's `input_tensor`).
    pub token_lists: Tensor,
    /// The case's parameters. Where they give them (a fixed shape's), `topk_reduce`'s rows
    /// carry ids from `token_base_index`, `find_nonzero_indices` searches the last `n_cols`
    /// columns from a `col_start_id`, and `indexed_flatten` takes `f_len` and `output_len`
    /// (else the layer's: [`flatten_plan`]).
    pub params: Params,
}

impl CheckCase {
    fn new(
        sizes: LayerSizes,
        dtype: DType,
        seed: u64,
        kernels: Vec<Kernel>,
        params: Params,
    ) -> Result<CheckCase> {
        let LayerSizes { t, h, e, k, i, b } = sizes;
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
        let decode_hidden_states = layer.inputs.x.clone();
        // The exchange's combine and the device-side plan over the layer's routing.
        let exchanged = layer.exchanged_rows(
            params
                .token_base_index
                .unwrap_or(TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX),
        )?;
        let affinities = layer.routed_affinities()?;
        let found = reference.find_nonzero_indices(&FindNonzeroIndices::new(
            FindNonzeroIndicesInputs {
                input_tensor: &affinities,
                col_start_id: None,
            },
            FindNonzeroIndicesParams::default(),
        )?)?;
        let counts = found.nonzero_counts.as_i32().unwrap_or_default();
        let (row_offsets, flatten) = flatten_plan(counts, t, b)?;
        let mut tensors = layer_tensors(layer);
        for (spec, tensor) in [
            (tensors::topk_reduce::INPUT, exchanged),
            (tensors::find_nonzero_indices::INPUT_TENSOR, affinities),
            (tensors::indexed_flatten::ROW_OFFSETS, row_offsets),
        ] {
            tensors.insert(spec.name.to_owned(), tensor);
        }
        if let Some(n_cols) = params.n_cols {
            let name = tensors::find_nonzero_indices::COL_START_ID.name;
            let first = e.saturating_sub(n_cols);
            let start = i32::try_from(first)
                .map_err(|_| Error::invalid(name, format!("column {first} exceeds i32")))?;
            tensors.insert(name.to_owned(), Tensor::from_i32([1], vec![start])?);
        }
        if params.skip_dma().skip_token {
            without_padding_row(&mut tensors, t, e)?;
        }
        Ok(CheckCase {
            label: format!("t={t} h={h} e={e} k={k} i={i} b={b} {dtype}"),
            kernels,
            tensors,
            decode_hidden_states,
            token_lists: found.indices,
            // Compared at the precision the backends compute in, whatever the inputs' dtype.
            params: Params {
                output_dtype: Some(OutputDType::Float32),
                token_count: Some(t),
                rows_per_token: Some(k),
                f_len: params.f_len.or(Some(flatten.f_len)),
                output_len: params.output_len.or(Some(flatten.output_len)),
                ..params
            },
        })
    }
}

impl CheckCase {
    /// The parameters `kernel` runs with: the case's, except that `moe_tkg` and `moe_block_tkg`,
    /// which take NO_SCALE and POST_SCALE only, run post-scaled where the case draws a
    /// pre-scale mode for the blockwise kernels.
    pub fn params_for(&self, kernel: Kernel) -> Params {
        let pre_scale = self.params.scaling_mode.is_some_and(|s| s.scales_rows());
        match kernel {
            Kernel::MoeTkg if pre_scale => Params {
                scaling_mode: Some(ExpertAffinityScaleMode::PostScale),
                ..self.params.clone()
            },
            // The decode-time router's K and activation are the layer router's, its operands
            // in the router weights' dtype (which it requires them to have).
            Kernel::RmsNormRouterTopkTkg | Kernel::RmsNormRouterTopkTkgBwd => {
                let w = &self.tensors[tensors::router_topk::W.name];
                Params {
                    top_k: self.params.top_k.or(self.params.k),
                    router_act_fn: self
                        .params
                        .router_act_fn
                        .or(Some(self.params.router_pipeline().act_fn)),
                    router_mm_dtype: self
                        .params
                        .router_mm_dtype
                        .or(Some(RouterMmDType::of(w.dtype()))),
                    ..self.params.clone()
                }
            }
            // The decode block routes as the layer's router does (SOFTMAX where the layer's
            // ACT2 router is SIGMOID, which the block refuses), its experts as moe_tkg's.
            Kernel::MoeBlockTkg => {
                let router = self.params.router_pipeline();
                let refused = !router.router_pre_norm && router.act_fn == RouterActFnType::Sigmoid;
                let act_fn = if refused {
                    RouterActFnType::Softmax
                } else {
                    router.act_fn
                };
                Params {
                    router_act_fn: self.params.router_act_fn.or(Some(act_fn)),
                    hidden_act_fn: self.params.hidden_act_fn.or(self.params.activation_fn),
                    scaling_mode: self.params_for(Kernel::MoeTkg).scaling_mode,
                    router_mm_dtype: self
                        .params_for(Kernel::RmsNormRouterTopkTkg)
                        .router_mm_dtype,
                    top_k: self.params.top_k.or(self.params.k),
                    ..self.params.clone()
                }
            }
            _ => self.params.clone(),
        }
    }

    /// The tensors `kernel` runs on: the layer's, with the tokens as `rmsnorm_router_topk_tkg`'s
    /// `hidden_states` and `moe_block_tkg`'s `inp`, and their router weights in the
    /// `router_mm_dtype` they run with ([`CheckCase::params_for`]).
    pub fn tensors_for(&self, kernel: Kernel) -> Result<Cow<'_, BTreeMap<String, Tensor>>> {
        use tensors::rmsnorm_router_topk_tkg as fused;
        match kernel {
            Kernel::RmsNormRouterTopkTkg
            | Kernel::RmsNormRouterTopkTkgBwd
            | Kernel::MoeBlockTkg => {
                let mut tensors = self.tensors.clone();
                let tokens = match kernel {
                    Kernel::MoeBlockTkg => tensors::moe_block_tkg::INP.name,
                    _ => fused::HIDDEN_STATES.name,
                };
                tensors.insert(tokens.to_owned(), self.decode_hidden_states.clone());
                if let Some(mm) = self.params_for(kernel).router_mm_dtype
                    && let Some(w) = tensors.remove(fused::ROUTER_WEIGHTS.name)
                {
                    let w = w.into_float_dtype(fused::ROUTER_WEIGHTS.name, mm.dtype())?;
                    tensors.insert(fused::ROUTER_WEIGHTS.name.to_owned(), w);
                }
                Ok(Cow::Owned(tensors))
            }
            // The top-k over the layer's router logits, `[T, E]`.
            Kernel::Topk => {
                let mut tensors = self.tensors.clone();
                let logits = tensors[tensors::router_topk::ROUTER_LOGITS.name].clone();
                tensors.insert(tensors::topk::INP.name.to_owned(), logits);
                Ok(Cow::Owned(tensors))
            }
            // The token lists the reference found, as the device's plan flattens them.
            Kernel::IndexedFlatten => {
                let mut tensors = self.tensors.clone();
                let name = tensors::indexed_flatten::INPUT_TENSOR.name;
                tensors.insert(name.to_owned(), self.token_lists.clone());
                Ok(Cow::Owned(tensors))
            }
            _ => Ok(Cow::Borrowed(&self.tensors)),
        }
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
        blockwise_mm_bwd as bwd, load_balancing_loss_bwd as aux, moe_tkg, permute_bwd,
        rmsnorm_router_topk_tkg_bwd as fused, router_topk,
    };
    // moe_tkg (decode) on the same tokens, weights and routing, every expert held here: rank 0.
    let rank_id = Tensor::from_i32([1, 1], vec![0]).expect("one element for [1, 1]");
    let decode = [
        (moe_tkg::HIDDEN_INPUT, inputs.x.clone()),
        (
            moe_tkg::EXPERT_GATE_UP_WEIGHTS,
            inputs.gate_up_proj_weight.clone(),
        ),
        (
            moe_tkg::EXPERT_DOWN_WEIGHTS,
            inputs.down_proj_weight.clone(),
        ),
        (moe_tkg::EXPERT_AFFINITIES, routed.expert_affinities),
        (moe_tkg::RANK_ID, rank_id),
        // The decode-time RMSNorm and router (hidden_states: `CheckCase::tensors_for`).
        (fused::GAMMA, inputs.gamma),
        (fused::ROUTER_WEIGHTS, inputs.w.clone()),
        (fused::D_EXPERT_AFFINITIES, inputs.d_expert_affinities),
    ];
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
    .chain(decode)
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

/// What `check` runs on a backend: its cases, and warnings about the shapes it runs.
pub struct CheckPlan {
    pub cases: Vec<CheckCase>,
    /// One line each, e.g. `kernel entry 2 (blockwise.neff): `h` = 5: ...`.
    pub warnings: Vec<String>,
}

/// The cases `check` runs on `backend` (of `kernel`, if given; else of every kernel it runs):
/// `cases` random layers, or, where the backend runs fixed shapes only, `cases` layers at each
/// of its shapes.
pub fn plan(
    backend: &dyn Backend,
    kernel: Option<Kernel>,
    cases: usize,
    seed: u64,
    dtype: DType,
) -> Result<CheckPlan> {
    let Some(fixed) = backend.fixed_shapes()? else {
        let kernels = kernel.map_or_else(|| Kernel::ALL.to_vec(), |k| vec![k]);
        return Ok(CheckPlan {
            cases: random_cases(cases, seed, dtype, &kernels)?,
            warnings: Vec::new(),
        });
    };
    at_least_one_case(cases)?;
    let warnings = fixed
        .shapes
        .iter()
        .flat_map(|shape| {
            let source = &shape.source;
            shape.warnings.iter().map(move |w| format!("{source}: {w}"))
        })
        .collect();
    let mut out = Vec::new();
    for shape in &fixed.shapes {
        if kernel.is_some_and(|k| k != shape.kernel) {
            continue;
        }
        for case in 0..cases {
            out.push(CheckCase::new(
                shape.sizes,
                dtype,
                seed.wrapping_add(case as u64),
                vec![shape.kernel],
                shape.params.clone(),
            )?);
        }
    }
    if out.is_empty() {
        return Err(Error::Format {
            path: fixed.declared_in,
            message: match kernel {
                Some(kernel) => format!("no kernel entry runs `{}`", kernel.name()),
                None => "no kernel entry".to_owned(),
            },
        });
    }
    Ok(CheckPlan {
        cases: out,
        warnings,
    })
}

/// `cases` layers of random sizes (T ≤ 64, H ≤ 48, E ≤ 12, I ≤ 32, B ≤ 16, with odd sizes and
/// B > T·K among them), each checking `kernels` with random router parameters.
fn random_cases(
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
            let sizes = LayerSizes {
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
                is_all_expert: Some(draw(0, 1) == 1),
                activation_fn: Some(activation),
                mask_unselected_experts: Some(draw(0, 1) == 1),
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

/// A check of no case would pass without checking anything.
fn at_least_one_case(cases: usize) -> Result<()> {
    if cases == 0 {
        return Err(Error::param("cases", "must be at least 1, got 0"));
    }
    Ok(())
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
            let (params, tensors) = (case.params_for(kernel), case.tensors_for(kernel)?);
            let want = kernel.run(reference.as_ref(), &tensors, &params)?;
            let got = kernel.run(backend, &tensors, &params)?;
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

/// Compares outputs computed elsewhere (an NKI kernel on the simulator or on Trainium, given
/// `inputs`) with the reference's on the same inputs, computed in f32 whatever the inputs'
/// dtype: one row per output in `outputs`, in contract order. Outputs the caller does not give
/// are not compared; one that is not an output of `kernel` is an error.
pub fn check_outputs(
    kernel: Kernel,
    inputs: &BTreeMap<String, Tensor>,
    params: &Params,
    outputs: &BTreeMap<String, Tensor>,
    tolerance: Tolerance,
) -> Result<Vec<CheckRow>> {
    let spec = kernel.spec();
    let names = || {
        spec.outputs
            .iter()
            .map(|output| output.name)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(unknown) = outputs
        .keys()
        .find(|name| !spec.outputs.iter().any(|output| output.name == *name))
    {
        return Err(Error::invalid(
            unknown,
            format!(
                "is not an output of `{}`; its outputs: {}",
                spec.name,
                names()
            ),
        ));
    }
    if outputs.is_empty() {
        return Err(Error::param(
            "outputs",
            format!("none given; `{}`'s outputs: {}", spec.name, names()),
        ));
    }
    let params = Params {
        output_dtype: Some(OutputDType::Float32),
        ..params.clone()
    };
    let reference = BackendKind::Reference.create();
    let want = kernel.run(reference.as_ref(), inputs, &params)?;
    let mut rows = Vec::new();
    for (name, want) in &want {
        if let Some(got) = outputs.get(*name) {
            rows.push(compare(0, "given", kernel, name, got, want, tolerance)?);
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
