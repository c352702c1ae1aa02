//! The `neuron` backend: kernel contracts executed as NEFFs on NeuronCores through libnrt.
//!
//! Each call picks its NEFF from the manifest (see [`super::manifest`]) by kernel name and
//! shape, loads it once, and binds tensors **by contract name**: the NEFF's inputs must be the
//! contract's input names (`x`, `w`, `hidden_states`, …) and its outputs the contract's output
//! names. Before anything runs, every NEFF tensor is checked against the call: a name the
//! contract does not have, an input the call provides that the NEFF ignores, an input the NEFF
//! needs that the call lacks, a shape or a dtype that differs — each is an [`Error::Neff`]
//! naming the NEFF and the tensor. Shapes compare with unit dimensions dropped (`[T·E, 1]` and
//! `[T·E]` are the same bytes); dtypes compare exactly for inputs (f32, bf16, i32), float
//! outputs may be f32 or bf16 (returned widened to f32, as the contracts produce), and an output
//! that copies an input (`indexed_flatten`'s `flattened_array`) must have that input's dtype.
//!
//! `router_topk` NEFFs may leave out `topk_affinities` (the NKI kernel does): it is then gathered
//! from `expert_affinities` at `expert_index`. Likewise `blockwise_mm_bwd`'s `d_topk_affinities`
//! is gathered on the host from the NEFF's `expert_affinities_masked_grad`. Which kernels run is listed by
//! [`super::manifest::supported_kernels`]; the others are an [`Error::Unsupported`].
//!
//! The runtime is opened on the first call (the library from `NEURON_RT_LIB` or the default
//! paths, the manifest from `MOEKIT_NEURON_MANIFEST` or `./kernels.toml`), so creating the
//! backend never fails; its errors arrive with the first call, or ahead of every call with
//! [`Backend::prepare`], which also loads the NEFFs a caller's planned calls need
//! ([`manifest_entry`] writes the manifest entry of each). The runtime is one per process:
//! keep one `neuron` backend at a time.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use half::bf16;

use super::limits::{NEURONCORE_V3, broken_limits};
use super::manifest::{Entry, Manifest, Value, entry_toml, supported_kernels};
use super::runtime::{Library, Model, NrtDType, Placement, Runtime, TensorInfo, Usage};
use crate::backend::{Backend, Device, FixedShapes, KernelCall, PlannedCall, Tolerance};
use crate::contracts::spec::{DTypeSpec, Named, TensorSpec};
use crate::contracts::tensors::{
    blockwise_mm as fwd, blockwise_mm_bwd as bwd, find_nonzero_indices as fni,
    indexed_flatten as ifl, moe_block_tkg as block, moe_tkg as tkg,
    rmsnorm_router_topk_tkg as fused, router_topk as router, topk as tk, topk_reduce as tr,
};
use crate::contracts::{
    A2avRouting, A2avRoutingOutputs, BlockwiseDims, BlockwiseMm, BlockwiseMmBwd,
    BlockwiseMmBwdParams, BlockwiseMmGrads, BlockwiseMmOutputs, BlockwiseMmParams, ClampLimits,
    FindNonzeroIndices, FindNonzeroIndicesOutputs, IndexedFlatten, IndexedFlattenOutputs,
    LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossGrads, LoadBalancingLossOutputs,
    MoeBlockTkg, MoeBlockTkgOutputs, MoeTkg, MoeTkgOutputs, Permute, PermuteBwd, PermuteGrads,
    PermuteOutputs, RmsNormRouterTopkTkg, RmsNormRouterTopkTkgBwd, RmsNormRouterTopkTkgGrads,
    RmsNormRouterTopkTkgOutputs, RouterTopk, RouterTopkBwd, RouterTopkGrads, RouterTopkOutputs,
    Topk, TopkOutputs, TopkReduce, TopkReduceOutputs, WeightLayout,
};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, Param};
use crate::tensor::{DType, Tensor, position};

/// Environment variable naming the manifest; `kernels.toml` in the working directory if unset.
pub const MANIFEST_ENV: &str = "MOEKIT_NEURON_MANIFEST";

/// Where the backend finds the runtime library and its manifest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeuronConfig {
    /// The libnrt to open; `None`: `NEURON_RT_LIB`, else the default paths.
    pub library: Option<PathBuf>,
    pub manifest: PathBuf,
}

impl NeuronConfig {
    /// The default library search and `MOEKIT_NEURON_MANIFEST` (else `./kernels.toml`).
    pub fn from_env() -> Self {
        NeuronConfig {
            library: None,
            manifest: std::env::var_os(MANIFEST_ENV)
                .map_or_else(|| PathBuf::from("kernels.toml"), PathBuf::from),
        }
    }
}

/// The open runtime, the manifest and every NEFF loaded so far.
struct Session {
    // Declared first so models unload before the runtime closes.
    models: HashMap<PathBuf, Model>,
    manifest: Manifest,
    runtime: Runtime,
}

impl Session {
    fn open(config: &NeuronConfig) -> Result<Session> {
        let manifest = Manifest::read(&config.manifest)?;
        let library = match &config.library {
            Some(path) => Library::open(path)?,
            None => Library::open_default()?,
        };
        Ok(Session {
            models: HashMap::new(),
            manifest,
            runtime: Runtime::init(library)?,
        })
    }
}

/// How the backend executes a bound NEFF: once, or repeatedly for timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Execution {
    Once,
    /// `nrt_execute_repeat` with this count.
    Repeat(i32),
}

/// What one call produced: the outputs by contract name, the NEFF that ran, and the mean time
/// of one execution.
struct Ran {
    outputs: BTreeMap<&'static str, Tensor>,
    neff: PathBuf,
    elapsed: Duration,
}

/// The dtypes a NEFF may write an output in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Written {
    /// Indices and counts: i32.
    Index,
    /// Values: f32 or bf16, read back as f32 (the call rounds them into its output dtype).
    Float,
    /// A copy of an input's elements: that input's dtype, read back in it.
    Copied(DType),
}

impl Written {
    fn allows(self, dtype: NrtDType) -> bool {
        match self {
            Written::Index => dtype == NrtDType::I32,
            Written::Float => dtype == NrtDType::F32 || dtype == NrtDType::BF16,
            Written::Copied(copied) => dtype == nrt_dtype(copied),
        }
    }

    /// What [`Written::allows`], in words.
    fn expected(self) -> String {
        match self {
            Written::Index => "i32".to_owned(),
            Written::Float => "f32 or bf16".to_owned(),
            Written::Copied(copied) => format!("{copied} (the dtype of the input it copies)"),
        }
    }
}

/// An output the contract defines, as the backend expects the NEFF to produce it.
struct OutputSpec {
    spec: &'static TensorSpec,
    shape: Vec<usize>,
    required: bool,
    written: Written,
}

impl OutputSpec {
    /// An output the NEFF computes: indices in i32, values in f32 or bf16.
    fn new(spec: &'static TensorSpec, shape: &[usize], required: bool) -> Self {
        let written = if spec.dtype == DTypeSpec::Index {
            Written::Index
        } else {
            Written::Float
        };
        OutputSpec {
            spec,
            shape: shape.to_vec(),
            required,
            written,
        }
    }

    /// A required output that copies elements of an input of dtype `dtype`.
    fn copy(spec: &'static TensorSpec, shape: &[usize], dtype: DType) -> Self {
        OutputSpec {
            spec,
            shape: shape.to_vec(),
            required: true,
            written: Written::Copied(dtype),
        }
    }

    fn name(&self) -> &'static str {
        self.spec.name
    }
}

/// One kernel call in the backend's terms: the manifest key, the inputs the call gives the
/// NEFF and the outputs it reads.
struct Call<'a> {
    kernel: Kernel,
    key: Vec<(&'static str, Value)>,
    inputs: Named<'a>,
    outputs: Vec<OutputSpec>,
}

/// The `neuron` backend. See the module docs.
pub struct NeuronBackend {
    config: NeuronConfig,
    session: Mutex<Option<Session>>,
}

impl NeuronBackend {
    /// The name that selects it.
    pub const NAME: &'static str = "neuron";

    /// Its error bound: NeuronCores multiply bf16 (or fp32 as bf16 passes) and accumulate in
    /// fp32 PSUM.
    pub const TOLERANCE: Tolerance = Tolerance {
        rtol: 2e-2,
        atol: 2e-2,
    };

    pub fn new(config: NeuronConfig) -> Self {
        NeuronBackend {
            config,
            session: Mutex::new(None),
        }
    }

    pub fn config(&self) -> &NeuronConfig {
        &self.config
    }

    /// `f` on the session, opening the runtime and reading the manifest on first use.
    fn with_session<R>(&self, f: impl FnOnce(&mut Session) -> Result<R>) -> Result<R> {
        let mut guard = self.session.lock().unwrap_or_else(PoisonError::into_inner);
        let session = match guard.take() {
            Some(session) => guard.insert(session),
            None => guard.insert(Session::open(&self.config)?),
        };
        f(session)
    }

    /// Runs `call`'s NEFF: loads it once, checks and binds the tensors, executes, and reads the
    /// outputs back by name.
    fn run(&self, call: &Call<'_>, execution: Execution) -> Result<Ran> {
        self.with_session(|session| {
            let neff = session.load(call.kernel, &call.key)?;
            let model = &session.models[&neff];
            let (outputs, elapsed) = execute(&session.runtime, model, &neff, call, execution)?;
            Ok(Ran {
                outputs,
                neff,
                elapsed,
            })
        })
    }
}

impl Session {
    /// The NEFF the manifest registers for `kernel` with `key`, loaded once.
    fn load(&mut self, kernel: Kernel, key: &[(&'static str, Value)]) -> Result<PathBuf> {
        let neff = self.manifest.find(kernel, key)?.neff.clone();
        if !self.models.contains_key(&neff) {
            // On core 0, where the tensors are allocated; the runtime picks how many cores.
            let model = self.runtime.load_file(&neff, 0, -1)?;
            self.models.insert(neff.clone(), model);
        }
        Ok(neff)
    }
}

/// The manifest key of a planned call.
fn planned_key(call: &PlannedCall) -> Vec<(&'static str, Value)> {
    match call {
        // moekit's planned calls take no biases.
        PlannedCall::BlockwiseMm { dims, params } => blockwise_mm_key(dims, params, [false, false]),
        PlannedCall::BlockwiseMmBwd { dims, params } => blockwise_mm_bwd_key(dims, params),
    }
}

/// The `[[kernel]]` table of a manifest that registers a NEFF for `call`, naming the NEFF
/// after its kernel and sizes (`blockwise_mm_t512_h2048_e128_i768_b128_n159_checkpoint.neff`):
/// what a user compiles, and lists, for the calls a job will make. Each nki-library limit the
/// shape breaks precedes it as a `#` comment.
pub fn manifest_entry(call: &PlannedCall) -> String {
    let (dims, checkpoint) = match call {
        PlannedCall::BlockwiseMm { dims, params } => (dims, params.checkpoint_activation),
        PlannedCall::BlockwiseMmBwd { dims, .. } => (dims, false),
    };
    let neff = format!(
        "{}_t{}_h{}_e{}_i{}_b{}_n{}{}.neff",
        call.kernel().name(),
        dims.t,
        dims.h,
        dims.e,
        dims.i,
        dims.b,
        dims.n,
        if checkpoint { "_checkpoint" } else { "" }
    );
    let key = planned_key(call);
    let entry = Entry {
        kernel: call.kernel(),
        neff: PathBuf::from(neff),
        params: key
            .iter()
            .map(|(name, value)| ((*name).to_owned(), value.clone()))
            .collect(),
    };
    let warnings: String = broken_limits(&entry)
        .iter()
        .map(|warning| format!("# {warning}\n"))
        .collect();
    warnings + &entry_toml(entry.kernel, &entry.neff, &key)
}

fn neff_error(neff: &std::path::Path, message: String) -> Error {
    Error::Neff {
        neff: neff.to_path_buf(),
        message,
    }
}

/// A shape without its unit dimensions: the byte layout it describes.
fn squeezed(shape: &[usize]) -> Vec<usize> {
    shape.iter().copied().filter(|&d| d != 1).collect()
}

fn nrt_dtype(dtype: DType) -> NrtDType {
    match dtype {
        DType::F32 => NrtDType::F32,
        DType::BF16 => NrtDType::BF16,
        DType::I32 => NrtDType::I32,
    }
}

/// Checks the NEFF's tensors against the call (see the module docs).
fn check_tensors(neff: &std::path::Path, tensors: &[TensorInfo], call: &Call<'_>) -> Result<()> {
    let kernel = call.kernel.name();
    for info in tensors {
        let what = match info.usage {
            Usage::Input => "input",
            Usage::Output => "output",
        };
        let element_bytes = match info.dtype {
            NrtDType::BF16 => 2,
            _ => 4,
        };
        let expected_bytes = info
            .shape
            .iter()
            .try_fold(element_bytes, |bytes: usize, &d| bytes.checked_mul(d))
            .ok_or_else(|| {
                neff_error(
                    neff,
                    format!(
                        "{what} `{}`: shape {:?} overflows the address space",
                        info.name, info.shape
                    ),
                )
            })?;
        match info.usage {
            Usage::Input => {
                if !call
                    .kernel
                    .spec()
                    .inputs
                    .iter()
                    .any(|spec| spec.name == info.name)
                {
                    return Err(neff_error(
                        neff,
                        format!(
                            "declares input `{}`, which is not a {kernel} input",
                            info.name
                        ),
                    ));
                }
                let given = call.inputs.iter().find(|(spec, _)| spec.name == info.name);
                let Some(&(_, tensor)) = given else {
                    return Err(neff_error(
                        neff,
                        format!(
                            "needs input `{}`, which this {kernel} call does not provide",
                            info.name
                        ),
                    ));
                };
                if squeezed(&info.shape) != squeezed(tensor.shape()) {
                    return Err(neff_error(
                        neff,
                        format!(
                            "input `{}`: the NEFF has shape {:?}, the call {:?}",
                            info.name,
                            info.shape,
                            tensor.shape()
                        ),
                    ));
                }
                if info.dtype != nrt_dtype(tensor.dtype()) {
                    return Err(neff_error(
                        neff,
                        format!(
                            "input `{}`: the NEFF takes {}, the call gives {}",
                            info.name,
                            info.dtype.name(),
                            tensor.dtype()
                        ),
                    ));
                }
            }
            Usage::Output => {
                let Some(spec) = call.outputs.iter().find(|spec| spec.name() == info.name) else {
                    return Err(neff_error(
                        neff,
                        format!(
                            "declares output `{}`, which is not a {kernel} output",
                            info.name
                        ),
                    ));
                };
                if squeezed(&info.shape) != squeezed(&spec.shape) {
                    return Err(neff_error(
                        neff,
                        format!(
                            "output `{}`: the NEFF has shape {:?}, the contract {:?}",
                            info.name, info.shape, spec.shape
                        ),
                    ));
                }
                if !spec.written.allows(info.dtype) {
                    return Err(neff_error(
                        neff,
                        format!(
                            "output `{}`: the NEFF produces {}, the contract needs {}",
                            info.name,
                            info.dtype.name(),
                            spec.written.expected()
                        ),
                    ));
                }
            }
        }
        if matches!(info.dtype, NrtDType::F32 | NrtDType::BF16 | NrtDType::I32)
            && info.size != expected_bytes
        {
            return Err(neff_error(
                neff,
                format!(
                    "{what} `{}`: declares {} bytes for shape {:?} {}",
                    info.name,
                    info.size,
                    info.shape,
                    info.dtype.name()
                ),
            ));
        }
    }
    for (spec, _) in &call.inputs {
        let declared = tensors
            .iter()
            .any(|info| info.usage == Usage::Input && info.name == spec.name);
        if !declared {
            return Err(neff_error(
                neff,
                format!(
                    "the call provides input `{}`, which the NEFF does not take (it would be ignored)",
                    spec.name
                ),
            ));
        }
    }
    for spec in call.outputs.iter().filter(|spec| spec.required) {
        if !tensors
            .iter()
            .any(|info| info.usage == Usage::Output && info.name == spec.name())
        {
            return Err(neff_error(
                neff,
                format!("does not produce output `{}`", spec.name()),
            ));
        }
    }
    Ok(())
}

/// Decodes an output's bytes into a contract tensor (values as f32, indices as i32, a copy in
/// its input's dtype).
fn decode(info: &TensorInfo, spec: &OutputSpec, bytes: &[u8]) -> Result<Tensor> {
    let shape = spec.shape.clone();
    if info.dtype == NrtDType::I32 {
        let values = bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        return Tensor::from_i32(shape, values.collect());
    }
    let values: Vec<f32> = if info.dtype == NrtDType::BF16 {
        let values = bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])));
        if spec.written == Written::Copied(DType::BF16) {
            return Tensor::from_bf16(shape, values.collect());
        }
        values.map(bf16::to_f32).collect()
    } else {
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    Tensor::from_f32(shape, values)
}

/// Allocates, writes, executes and reads back one call of `model`.
fn execute(
    runtime: &Runtime,
    model: &Model,
    neff: &std::path::Path,
    call: &Call<'_>,
    execution: Execution,
) -> Result<(BTreeMap<&'static str, Tensor>, Duration)> {
    check_tensors(neff, model.tensors(), call)?;
    let device: Vec<_> = model
        .tensors()
        .iter()
        .map(|info| runtime.allocate(Placement::Device, 0, info.size, &info.name))
        .collect::<Result<_>>()?;
    let mut inputs = runtime.tensor_set()?;
    let mut outputs = runtime.tensor_set()?;
    for (info, tensor) in model.tensors().iter().zip(&device) {
        match info.usage {
            Usage::Input => {
                let given = call
                    .inputs
                    .iter()
                    .find_map(|(spec, given)| (spec.name == info.name).then_some(*given))
                    .ok_or_else(|| neff_error(neff, format!("input `{}` vanished", info.name)))?;
                tensor.write(&given.to_le_bytes(), 0)?;
                inputs.add(&info.name, tensor)?;
            }
            Usage::Output => outputs.add(&info.name, tensor)?,
        }
    }
    let start = Instant::now();
    let executions = match execution {
        Execution::Once => {
            model.execute(&inputs, &outputs)?;
            1
        }
        Execution::Repeat(repeat) => {
            model.execute_repeat(&inputs, &outputs, repeat)?;
            repeat.max(1) as u32
        }
    };
    let elapsed = start.elapsed() / executions;
    let mut results = BTreeMap::new();
    for (info, tensor) in model.tensors().iter().zip(&device) {
        if info.usage != Usage::Output {
            continue;
        }
        let Some(spec) = call.outputs.iter().find(|spec| spec.name() == info.name) else {
            continue;
        };
        let mut bytes = vec![0u8; info.size];
        tensor.read(&mut bytes, 0)?;
        results.insert(spec.name(), decode(info, spec, &bytes)?);
    }
    Ok((results, elapsed))
}

fn router_topk_call<'a>(call: &RouterTopk<'a>) -> Call<'a> {
    let (inputs, dims) = (call.inputs(), call.dims());
    let pipeline = call.params().pipeline;
    let (t, e, k) = (dims.t, dims.e, dims.k);
    Call {
        kernel: Kernel::RouterTopk,
        key: vec![
            ("t", Value::Int(t)),
            ("h", Value::Int(dims.h)),
            ("e", Value::Int(e)),
            (Param::K.name(), Value::Int(k)),
            (Param::ActFn.name(), Value::Str(pipeline.act_fn.to_string())),
            (
                Param::RouterPreNorm.name(),
                Value::Bool(pipeline.router_pre_norm),
            ),
            (
                Param::NormTopkProb.name(),
                Value::Bool(pipeline.norm_topk_prob),
            ),
            (
                Param::XHbmLayout.name(),
                Value::Int(pipeline.x_hbm_layout.value()),
            ),
            (router::W_BIAS.name, Value::Bool(inputs.w_bias.is_some())),
            (
                router::SELECTION_BIAS.name,
                Value::Bool(inputs.selection_bias.is_some()),
            ),
        ],
        inputs: inputs.named(),
        outputs: vec![
            OutputSpec::new(&router::ROUTER_LOGITS, &[t, e], true),
            OutputSpec::new(&router::EXPERT_INDEX, &[t, k], true),
            OutputSpec::new(&router::TOPK_AFFINITIES, &[t, k], false),
            OutputSpec::new(&router::EXPERT_AFFINITIES, &[t, e], true),
        ],
    }
}

/// The size keys both blockwise kernels' entries share.
fn size_keys(dims: &BlockwiseDims) -> [(&'static str, Value); 6] {
    [
        ("t", Value::Int(dims.t)),
        ("h", Value::Int(dims.h)),
        ("e", Value::Int(dims.e)),
        ("i", Value::Int(dims.i)),
        (Param::BlockSize.name(), Value::Int(dims.b)),
        ("num_blocks", Value::Int(dims.n)),
    ]
}

/// The manifest key of a `blockwise_mm` call of `dims` and `params`, with or without each bias
/// (`gate_and_up_proj_bias`, `down_proj_bias`).
fn blockwise_mm_key(
    dims: &BlockwiseDims,
    params: &BlockwiseMmParams,
    biases: [bool; 2],
) -> Vec<(&'static str, Value)> {
    let [gate_up_bias, down_bias] = biases;
    size_keys(dims)
        .into_iter()
        .chain([
            (
                Param::ActivationFunction.name(),
                Value::Str(params.activation_function.to_string()),
            ),
            (
                Param::ExpertAffinitiesScalingMode.name(),
                Value::Str(params.expert_affinities_scaling_mode.to_string()),
            ),
            (
                Param::CheckpointActivation.name(),
                Value::Bool(params.checkpoint_activation),
            ),
            (fwd::GATE_AND_UP_PROJ_BIAS.name, Value::Bool(gate_up_bias)),
            (fwd::DOWN_PROJ_BIAS.name, Value::Bool(down_bias)),
            (
                Param::SkipToken.name(),
                Value::Bool(params.skip_dma.skip_token),
            ),
            (
                Param::IsTensorUpdateAccumulating.name(),
                Value::Bool(params.is_tensor_update_accumulating),
            ),
        ])
        .chain(limit_keys(
            [
                Param::GateClampLowerLimit,
                Param::GateClampUpperLimit,
                Param::UpClampLowerLimit,
                Param::UpClampUpperLimit,
            ],
            params.clamp,
        ))
        .collect()
}

fn blockwise_mm_call<'a>(call: &BlockwiseMm<'a>) -> Call<'a> {
    let (inputs, dims, params) = (call.inputs(), call.dims(), call.params());
    let checkpoint = params.checkpoint_activation;
    let (h, i, b, n) = (dims.h, dims.i, dims.b, dims.n);
    let biases = [
        inputs.gate_and_up_proj_bias.is_some(),
        inputs.down_proj_bias.is_some(),
    ];
    Call {
        kernel: Kernel::BlockwiseMm,
        key: blockwise_mm_key(&dims, &params, biases),
        inputs: inputs.named(),
        outputs: vec![
            OutputSpec::new(&fwd::OUTPUT, &[dims.rows, h], true),
            OutputSpec::new(&fwd::GATE_UP_ACTIVATIONS_T, &[n, 2, i, b], checkpoint),
            OutputSpec::new(&fwd::DOWN_ACTIVATIONS, &[n, b, h], checkpoint),
        ],
    }
}

/// The manifest key of a `blockwise_mm_bwd` call of `dims` and `params`.
fn blockwise_mm_bwd_key(
    dims: &BlockwiseDims,
    params: &BlockwiseMmBwdParams,
) -> Vec<(&'static str, Value)> {
    size_keys(dims)
        .into_iter()
        .chain([
            (
                Param::ActivationType.name(),
                Value::Str(params.activation_type.to_string()),
            ),
            (
                Param::ExpertAffinitiesScalingMode.name(),
                Value::Str(params.expert_affinities_scaling_mode.to_string()),
            ),
            (Param::Bias.name(), Value::Bool(params.bias)),
            (
                Param::SkipToken.name(),
                Value::Bool(params.skip_dma.skip_token),
            ),
            (
                Param::IsTensorUpdateAccumulating.name(),
                Value::Bool(params.is_tensor_update_accumulating),
            ),
        ])
        .chain(limit_keys(
            [
                Param::NonLinearClampLowerLimit,
                Param::NonLinearClampUpperLimit,
                Param::LinearClampLowerLimit,
                Param::LinearClampUpperLimit,
            ],
            params.clamp,
        ))
        .collect()
}

fn blockwise_mm_bwd_call<'a>(call: &BlockwiseMmBwd<'a>) -> Call<'a> {
    let (inputs, dims, params) = (call.inputs(), call.dims(), call.params());
    let bias = params.bias;
    let (h, e, i) = (dims.h, dims.e, dims.i);
    Call {
        kernel: Kernel::BlockwiseMmBwd,
        key: blockwise_mm_bwd_key(&dims, &params),
        // nki-library's backward takes neither the biases (the checkpoints hold their effect)
        // nor `expert_index` (moekit's own, which maps the affinity gradient on the host).
        inputs: inputs
            .named()
            .into_iter()
            .filter(|(spec, _)| {
                ![
                    bwd::EXPERT_INDEX,
                    bwd::GATE_AND_UP_PROJ_BIAS,
                    bwd::DOWN_PROJ_BIAS,
                ]
                .iter()
                .any(|host| host.name == spec.name)
            })
            .collect(),
        outputs: vec![
            OutputSpec::new(&bwd::HIDDEN_STATES_GRAD, &[dims.rows, h], true),
            OutputSpec::new(
                &bwd::EXPERT_AFFINITIES_MASKED_GRAD,
                &[dims.rows * e, 1],
                true,
            ),
            OutputSpec::new(&bwd::GATE_UP_PROJ_WEIGHT_GRAD, &[e, h, 2, i], true),
            OutputSpec::new(&bwd::DOWN_PROJ_WEIGHT_GRAD, &[e, i, h], true),
            OutputSpec::new(&bwd::GATE_AND_UP_PROJ_BIAS_GRAD, &[e, 2, i], bias),
            OutputSpec::new(&bwd::DOWN_PROJ_BIAS_GRAD, &[e, h], bias),
        ],
    }
}

/// The manifest key of a `moe_tkg` call.
fn moe_tkg_key(call: &MoeTkg<'_>) -> Vec<(&'static str, Value)> {
    let (inputs, dims, params) = (call.inputs(), call.dims(), call.params());
    [
        ("t", Value::Int(dims.t)),
        ("h", Value::Int(dims.h)),
        ("e", Value::Int(dims.e)),
        ("e_local", Value::Int(dims.e_local)),
        (Param::K.name(), Value::Int(dims.k)),
        ("i", Value::Int(dims.i)),
        (Param::IsAllExpert.name(), Value::Bool(params.is_all_expert)),
        (
            Param::ExpertAffinitiesScalingMode.name(),
            Value::Str(params.expert_affinities_scaling_mode.to_string()),
        ),
        (
            Param::ActivationFn.name(),
            Value::Str(params.activation_fn.to_string()),
        ),
        (
            Param::MaskUnselectedExperts.name(),
            Value::Bool(params.mask_unselected_experts),
        ),
        (
            tkg::EXPERT_GATE_UP_BIAS.name,
            Value::Bool(inputs.expert_gate_up_bias.is_some()),
        ),
        (
            tkg::EXPERT_DOWN_BIAS.name,
            Value::Bool(inputs.expert_down_bias.is_some()),
        ),
        (
            tkg::EXPERT_AFFINITIES_EAGER.name,
            Value::Bool(inputs.expert_affinities_eager.is_some()),
        ),
    ]
    .into_iter()
    .chain(limit_keys(
        [
            Param::GateClampLowerLimit,
            Param::GateClampUpperLimit,
            Param::UpClampLowerLimit,
            Param::UpClampUpperLimit,
        ],
        params.clamp,
    ))
    .collect()
}

fn moe_tkg_call<'a>(call: &MoeTkg<'a>) -> Call<'a> {
    let (dims, params) = (call.dims(), call.params());
    // nki-library's kernel reads `rank_id` in all-expert POST_SCALE only (and requires it there).
    let takes_rank = params.is_all_expert && params.scales();
    Call {
        kernel: Kernel::MoeTkg,
        key: moe_tkg_key(call),
        inputs: call
            .inputs()
            .named()
            .into_iter()
            .filter(|(spec, _)| takes_rank || spec.name != tkg::RANK_ID.name)
            .collect(),
        outputs: vec![OutputSpec::new(&tkg::OUTPUT, &[dims.t, dims.h], true)],
    }
}

/// The manifest key of an `rmsnorm_router_topk_tkg` call.
fn rmsnorm_router_topk_tkg_key(call: &RmsNormRouterTopkTkg<'_>) -> Vec<(&'static str, Value)> {
    let (dims, params) = (call.dims(), call.params());
    let shared = params.shared;
    vec![
        ("t", Value::Int(dims.t)),
        ("h", Value::Int(dims.h)),
        ("e", Value::Int(dims.e)),
        (Param::TopK.name(), Value::Int(dims.k)),
        (Param::Eps.name(), Value::number(shared.eps)),
        (
            Param::HiddenActual.name(),
            Value::Int(call.rmsnorm().divisor),
        ),
        (
            Param::RouterMmDType.name(),
            Value::Str(shared.router_mm_dtype.to_string()),
        ),
        (
            Param::RouterActFn.name(),
            Value::Str(shared.router_act_fn.to_string()),
        ),
        (
            Param::StoreEagerAffiOnly.name(),
            Value::Bool(shared.store_eager_affi_only),
        ),
        (
            fused::ROUTER_BIAS.name,
            Value::Bool(call.inputs().router_bias.is_some()),
        ),
    ]
}

fn rmsnorm_router_topk_tkg_call<'a>(call: &RmsNormRouterTopkTkg<'a>) -> Call<'a> {
    let dims = call.dims();
    let width = if call.params().shared.store_eager_affi_only {
        dims.k
    } else {
        dims.e
    };
    Call {
        kernel: Kernel::RmsNormRouterTopkTkg,
        key: rmsnorm_router_topk_tkg_key(call),
        inputs: call.inputs().named(),
        outputs: vec![
            OutputSpec::new(&fused::NORM_OUTPUT, &[dims.t, dims.h], true),
            OutputSpec::new(&fused::EXPERT_INDEX, &[dims.t, dims.k], true),
            OutputSpec::new(&fused::EXPERT_AFFINITIES, &[dims.t, width], true),
        ],
    }
}

/// The manifest key of a `moe_block_tkg` call.
fn moe_block_tkg_key(call: &MoeBlockTkg<'_>) -> Vec<(&'static str, Value)> {
    let (inputs, dims, params) = (call.inputs(), call.dims(), call.params());
    let present = |tensor: Option<&Tensor>| Value::Bool(tensor.is_some());
    [
        ("t", Value::Int(dims.t)),
        ("h", Value::Int(dims.h)),
        ("e", Value::Int(dims.e)),
        ("e_local", Value::Int(dims.e_local)),
        ("i", Value::Int(dims.i)),
        (Param::TopK.name(), Value::Int(dims.k)),
        (Param::Eps.name(), Value::number(params.eps)),
        (
            Param::HiddenActual.name(),
            Value::Int(call.rmsnorm().divisor),
        ),
        (
            Param::RouterMmDType.name(),
            Value::Str(params.router_mm_dtype.to_string()),
        ),
        (
            Param::RouterActFn.name(),
            Value::Str(params.router_act_fn.to_string()),
        ),
        (
            Param::RouterPreNorm.name(),
            Value::Bool(params.router_pre_norm),
        ),
        (
            Param::NormTopkProb.name(),
            Value::Bool(params.norm_topk_prob),
        ),
        (
            Param::ExpertAffinitiesScalingMode.name(),
            Value::Str(params.expert_affinities_scaling_mode.to_string()),
        ),
        (
            Param::HiddenActFn.name(),
            Value::Str(params.hidden_act_fn.to_string()),
        ),
        (Param::IsAllExpert.name(), Value::Bool(params.is_all_expert)),
        (
            Param::SkipRouterLogits.name(),
            Value::Bool(params.skip_router_logits),
        ),
        (block::ROUTER_BIAS.name, present(inputs.router_bias)),
        (
            block::EXPERT_GATE_UP_BIAS.name,
            present(inputs.expert_gate_up_bias),
        ),
        (
            block::EXPERT_DOWN_BIAS.name,
            present(inputs.expert_down_bias),
        ),
    ]
    .into_iter()
    .chain(limit_keys(
        [
            Param::GateClampLowerLimit,
            Param::GateClampUpperLimit,
            Param::UpClampLowerLimit,
            Param::UpClampUpperLimit,
        ],
        params.clamp,
    ))
    .collect()
}

fn moe_block_tkg_call<'a>(call: &MoeBlockTkg<'a>) -> Call<'a> {
    let (dims, params) = (call.dims(), call.params());
    Call {
        kernel: Kernel::MoeBlockTkg,
        key: moe_block_tkg_key(call),
        // nki-library's kernel reads `rank_id` in all-expert mode only (and requires it there).
        inputs: call
            .inputs()
            .named()
            .into_iter()
            .filter(|(spec, _)| params.is_all_expert || spec.name != block::RANK_ID.name)
            .collect(),
        outputs: vec![
            OutputSpec::new(&block::OUT, &[dims.t, dims.h], true),
            OutputSpec::new(
                &block::ROUTER_LOGITS,
                &[dims.t, dims.e],
                !params.skip_router_logits,
            ),
        ],
    }
}

fn topk_call<'a>(call: &Topk<'a>) -> Call<'a> {
    let (dims, params) = (call.dims(), call.params());
    let shape = call.output_shape();
    Call {
        kernel: Kernel::Topk,
        key: vec![
            ("rows", Value::Int(dims.rows)),
            ("v", Value::Int(dims.v)),
            (Param::K.name(), Value::Int(dims.k)),
            (Param::SortedFlag.name(), Value::Bool(params.sorted_flag)),
            (Param::Method.name(), Value::Str(params.method.to_string())),
        ],
        inputs: call.inputs().named(),
        outputs: vec![
            OutputSpec::new(&tk::TOPK_VALUES, &shape, true),
            OutputSpec::new(&tk::TOPK_INDICES, &shape, true),
        ],
    }
}

fn topk_reduce_call<'a>(call: &TopkReduce<'a>) -> Call<'a> {
    let dims = call.dims();
    Call {
        kernel: Kernel::TopkReduce,
        key: vec![
            ("t", Value::Int(dims.t)),
            ("h", Value::Int(dims.h)),
            ("k", Value::Int(dims.k)),
            ("tk_padded", Value::Int(dims.rows)),
            (
                Param::TokenBaseIndex.name(),
                Value::Signed(dims.token_base_index),
            ),
        ],
        inputs: call.inputs().named(),
        outputs: vec![OutputSpec::new(&tr::OUTPUT, &[dims.t, dims.h], true)],
    }
}

fn find_nonzero_indices_call<'a>(call: &FindNonzeroIndices<'a>) -> Call<'a> {
    let (inputs, dims) = (call.inputs(), call.dims());
    Call {
        kernel: Kernel::FindNonzeroIndices,
        key: vec![
            ("t", Value::Int(dims.t)),
            ("c_full", Value::Int(dims.c_full)),
            (Param::NCols.name(), Value::Int(dims.c)),
            (
                fni::COL_START_ID.name,
                Value::Bool(inputs.col_start_id.is_some()),
            ),
        ],
        inputs: inputs.named(),
        outputs: vec![
            OutputSpec::new(&fni::INDICES, &[dims.c, dims.t], true),
            OutputSpec::new(&fni::NONZERO_COUNTS, &[dims.c], true),
        ],
    }
}

fn indexed_flatten_call<'a>(call: &IndexedFlatten<'a>) -> Call<'a> {
    let (inputs, dims, params) = (call.inputs(), call.dims(), call.params());
    Call {
        kernel: Kernel::IndexedFlatten,
        key: vec![
            ("e", Value::Int(dims.e)),
            ("t", Value::Int(dims.t)),
            ("n", Value::Int(inputs.row_offsets.shape().iter().product())),
            (Param::FLen.name(), Value::Int(dims.f_len)),
            (Param::OutputLen.name(), Value::Int(dims.output_len)),
            (Param::PaddingVal.name(), Value::Signed(params.padding_val)),
            (
                ifl::ROW_OFFSETS_START.name,
                Value::Bool(inputs.row_offsets_start.is_some()),
            ),
        ],
        inputs: inputs.named(),
        // nki-library's kernel copies input_tensor's elements, in its dtype.
        outputs: vec![OutputSpec::copy(
            &ifl::FLATTENED_ARRAY,
            &[dims.output_len],
            inputs.input_tensor.dtype(),
        )],
    }
}

/// Index output `spec` (`expert_index`, `topk_indices`) as produced by a NEFF, checked to hold
/// indices in `[0, bound)`.
fn checked_indices(
    neff: &std::path::Path,
    spec: &TensorSpec,
    index: &Tensor,
    bound: usize,
) -> Result<Vec<usize>> {
    index
        .as_i32()
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(at, &id)| {
            usize::try_from(id)
                .ok()
                .filter(|&id| id < bound)
                .ok_or_else(|| {
                    neff_error(
                        neff,
                        format!(
                            "output `{}` holds {id} at {}, outside [0, {bound})",
                            spec.name,
                            position(index.shape(), at)
                        ),
                    )
                })
        })
        .collect()
}

fn take(outputs: &mut BTreeMap<&'static str, Tensor>, spec: &TensorSpec) -> Result<Tensor> {
    outputs
        .remove(spec.name)
        .ok_or_else(|| Error::MissingTensor(spec.name.to_owned()))
}

/// The manifest keys of the four clamp limits (gate lower, gate upper, up lower, up upper, by
/// the kernel's `names`): each limit, or `none`.
fn limit_keys(
    names: [Param; 4],
    clamp: ClampLimits,
) -> impl Iterator<Item = (&'static str, Value)> {
    let limits = [
        clamp.gate.lower,
        clamp.gate.upper,
        clamp.up.lower,
        clamp.up.upper,
    ];
    names
        .into_iter()
        .zip(limits)
        .map(|(name, limit)| (name.name(), Value::limit(limit)))
}

/// nki-library's blockwise kernels, which the NEFFs are compiled from, take their weights in
/// nki's layout only.
fn nki_weights(layout: WeightLayout) -> Result<()> {
    match layout {
        WeightLayout::Nki => Ok(()),
        other => Err(Error::param(
            WeightLayout::PARAM,
            format!(
                "is `{other}`, but the neuron backend runs nki-library's kernels, which take \
                 gate_up_proj_weight {} and down_proj_weight {} (`{}`)",
                WeightLayout::Nki.gate_up_shape(),
                WeightLayout::Nki.down_shape(),
                WeightLayout::Nki,
            ),
        )),
    }
}

fn unsupported(kernel: Kernel) -> Error {
    Error::Unsupported {
        backend: "neuron",
        kernel: kernel.name(),
        message: format!("it runs {}", supported_kernels().join(", ")),
    }
}

impl Backend for NeuronBackend {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    /// The kernels the manifest registers a NEFF for.
    fn supports(&self, kernel: Kernel) -> Result<bool> {
        let manifest = Manifest::read(&self.config.manifest)?;
        Ok(manifest.entries.iter().any(|entry| entry.kernel == kernel))
    }

    fn tolerance(&self, _dtype: DType) -> Tolerance {
        Self::TOLERANCE
    }

    fn device(&self) -> Device {
        Device::Accelerator(NEURONCORE_V3)
    }

    /// `nrt_execute_repeat` of the call's NEFF on device-resident inputs: the mean time of one
    /// execution.
    fn time_repeated(&self, call: KernelCall<'_, '_>, repeats: u32) -> Result<Option<Duration>> {
        let call = match call {
            KernelCall::RouterTopk(call) => router_topk_call(call),
            KernelCall::BlockwiseMm(call) => {
                nki_weights(call.params().weight_layout)?;
                blockwise_mm_call(call)
            }
            KernelCall::BlockwiseMmBwd(call) => {
                nki_weights(call.params().weight_layout)?;
                blockwise_mm_bwd_call(call)
            }
            KernelCall::MoeTkg(call) => moe_tkg_call(call),
            KernelCall::RmsNormRouterTopkTkg(call) => rmsnorm_router_topk_tkg_call(call),
            KernelCall::MoeBlockTkg(call) => moe_block_tkg_call(call),
            KernelCall::Topk(call) => topk_call(call),
            KernelCall::TopkReduce(call) => topk_reduce_call(call),
            KernelCall::FindNonzeroIndices(call) => find_nonzero_indices_call(call),
            KernelCall::IndexedFlatten(call) => indexed_flatten_call(call),
            other => return Err(unsupported(other.kernel())),
        };
        let repeats = i32::try_from(repeats)
            .map_err(|_| Error::param("repeats", format!("at most {}, got {repeats}", i32::MAX)))?;
        Ok(Some(self.run(&call, Execution::Repeat(repeats))?.elapsed))
    }

    fn fixed_shapes(&self) -> Result<Option<FixedShapes>> {
        Ok(Some(Manifest::read(&self.config.manifest)?.fixed_shapes()?))
    }

    /// Opens the runtime, and finds and loads the NEFF of every call: a missing runtime,
    /// manifest, entry or NEFF file is an error naming it (and, for an entry, what the manifest
    /// registers).
    fn prepare(&self, calls: &[PlannedCall]) -> Result<()> {
        self.with_session(|session| {
            for call in calls {
                nki_weights(call.weight_layout())?;
                session.load(call.kernel(), &planned_key(call))?;
            }
            Ok(())
        })
    }

    fn router_topk(&self, call: &RouterTopk<'_>) -> Result<RouterTopkOutputs> {
        let Ran {
            outputs: mut out,
            neff,
            ..
        } = self.run(&router_topk_call(call), Execution::Once)?;
        let dims = call.dims();
        let expert_index = take(&mut out, &router::EXPERT_INDEX)?;
        let expert_affinities = take(&mut out, &router::EXPERT_AFFINITIES)?;
        let ids = checked_indices(&neff, &router::EXPERT_INDEX, &expert_index, dims.e)?;
        let topk_affinities = match out.remove(router::TOPK_AFFINITIES.name) {
            Some(topk) => topk,
            None => {
                let dense = expert_affinities.f32_values();
                let gathered = ids
                    .iter()
                    .enumerate()
                    .map(|(position, &expert)| dense[(position / dims.k) * dims.e + expert])
                    .collect();
                Tensor::from_f32([dims.t, dims.k], gathered)?
            }
        };
        call.cast_outputs(RouterTopkOutputs {
            router_logits: take(&mut out, &router::ROUTER_LOGITS)?,
            expert_index,
            topk_affinities,
            expert_affinities,
        })
    }

    fn router_topk_bwd(&self, _call: &RouterTopkBwd<'_>) -> Result<RouterTopkGrads> {
        Err(unsupported(Kernel::RouterTopkBwd))
    }

    fn load_balancing_loss(
        &self,
        _call: &LoadBalancingLoss<'_>,
    ) -> Result<LoadBalancingLossOutputs> {
        Err(unsupported(Kernel::LoadBalancingLoss))
    }

    fn load_balancing_loss_bwd(
        &self,
        _call: &LoadBalancingLossBwd<'_>,
    ) -> Result<LoadBalancingLossGrads> {
        Err(unsupported(Kernel::LoadBalancingLossBwd))
    }

    fn permute(&self, _call: &Permute<'_>) -> Result<PermuteOutputs> {
        Err(unsupported(Kernel::Permute))
    }

    fn a2av_routing(&self, _call: &A2avRouting<'_>) -> Result<A2avRoutingOutputs> {
        Err(unsupported(Kernel::A2avRouting))
    }

    fn moe_tkg(&self, call: &MoeTkg<'_>) -> Result<MoeTkgOutputs> {
        let mut out = self.run(&moe_tkg_call(call), Execution::Once)?.outputs;
        call.cast_outputs(MoeTkgOutputs {
            output: take(&mut out, &tkg::OUTPUT)?,
        })
    }

    fn permute_bwd(&self, _call: &PermuteBwd<'_>) -> Result<PermuteGrads> {
        Err(unsupported(Kernel::PermuteBwd))
    }

    fn rmsnorm_router_topk_tkg(
        &self,
        call: &RmsNormRouterTopkTkg<'_>,
    ) -> Result<RmsNormRouterTopkTkgOutputs> {
        let Ran {
            outputs: mut out,
            neff,
            ..
        } = self.run(&rmsnorm_router_topk_tkg_call(call), Execution::Once)?;
        let expert_index = take(&mut out, &fused::EXPERT_INDEX)?;
        checked_indices(&neff, &fused::EXPERT_INDEX, &expert_index, call.dims().e)?;
        call.cast_outputs(RmsNormRouterTopkTkgOutputs {
            norm_output: take(&mut out, &fused::NORM_OUTPUT)?,
            expert_index,
            expert_affinities: take(&mut out, &fused::EXPERT_AFFINITIES)?,
        })
    }

    /// moekit's own kernel: nki-library has no NEFF of it.
    fn rmsnorm_router_topk_tkg_bwd(
        &self,
        _call: &RmsNormRouterTopkTkgBwd<'_>,
    ) -> Result<RmsNormRouterTopkTkgGrads> {
        Err(unsupported(Kernel::RmsNormRouterTopkTkgBwd))
    }

    fn topk(&self, call: &Topk<'_>) -> Result<TopkOutputs> {
        let Ran {
            outputs: mut out,
            neff,
            ..
        } = self.run(&topk_call(call), Execution::Once)?;
        let topk_indices = take(&mut out, &tk::TOPK_INDICES)?;
        checked_indices(&neff, &tk::TOPK_INDICES, &topk_indices, call.dims().v)?;
        call.cast_outputs(TopkOutputs {
            topk_values: take(&mut out, &tk::TOPK_VALUES)?,
            topk_indices,
        })
    }

    fn topk_reduce(&self, call: &TopkReduce<'_>) -> Result<TopkReduceOutputs> {
        let mut out = self.run(&topk_reduce_call(call), Execution::Once)?.outputs;
        call.cast_outputs(TopkReduceOutputs {
            output: take(&mut out, &tr::OUTPUT)?,
        })
    }

    fn find_nonzero_indices(
        &self,
        call: &FindNonzeroIndices<'_>,
    ) -> Result<FindNonzeroIndicesOutputs> {
        let mut out = self
            .run(&find_nonzero_indices_call(call), Execution::Once)?
            .outputs;
        Ok(FindNonzeroIndicesOutputs {
            indices: take(&mut out, &fni::INDICES)?,
            nonzero_counts: take(&mut out, &fni::NONZERO_COUNTS)?,
        })
    }

    fn indexed_flatten(&self, call: &IndexedFlatten<'_>) -> Result<IndexedFlattenOutputs> {
        let mut out = self
            .run(&indexed_flatten_call(call), Execution::Once)?
            .outputs;
        Ok(IndexedFlattenOutputs {
            flattened_array: take(&mut out, &ifl::FLATTENED_ARRAY)?,
        })
    }

    fn moe_block_tkg(&self, call: &MoeBlockTkg<'_>) -> Result<MoeBlockTkgOutputs> {
        let mut out = self
            .run(&moe_block_tkg_call(call), Execution::Once)?
            .outputs;
        let router_logits = if call.params().skip_router_logits {
            None
        } else {
            Some(take(&mut out, &block::ROUTER_LOGITS)?)
        };
        call.cast_outputs(MoeBlockTkgOutputs {
            out: take(&mut out, &block::OUT)?,
            router_logits,
        })
    }

    fn blockwise_mm(&self, call: &BlockwiseMm<'_>) -> Result<BlockwiseMmOutputs> {
        nki_weights(call.params().weight_layout)?;
        let mut out = self.run(&blockwise_mm_call(call), Execution::Once)?.outputs;
        let checkpoint = call.params().checkpoint_activation;
        call.cast_outputs(BlockwiseMmOutputs {
            output: take(&mut out, &fwd::OUTPUT)?,
            gate_up_activations_t: out
                .remove(fwd::GATE_UP_ACTIVATIONS_T.name)
                .filter(|_| checkpoint),
            down_activations: out
                .remove(fwd::DOWN_ACTIVATIONS.name)
                .filter(|_| checkpoint),
        })
    }

    fn blockwise_mm_bwd(&self, call: &BlockwiseMmBwd<'_>) -> Result<BlockwiseMmGrads> {
        nki_weights(call.params().weight_layout)?;
        let bias = call.params().bias;
        let mut out = self
            .run(&blockwise_mm_bwd_call(call), Execution::Once)?
            .outputs;
        let expert_affinities_masked_grad = take(&mut out, &bwd::EXPERT_AFFINITIES_MASKED_GRAD)?;
        // As `permute_bwd` maps it: slot (t, k) reads the gradient of (t, expert_index[t, k]),
        // 0 for a skipped slot. The contract has validated the ids against E.
        let e = call.dims().e;
        let d_topk_affinities = call
            .expert_ids()
            .map(|(ids, k)| {
                let grad = expert_affinities_masked_grad.f32_values();
                let values = ids
                    .iter()
                    .enumerate()
                    .map(|(slot, &id)| {
                        usize::try_from(id).map_or(0.0, |id| grad[(slot / k) * e + id])
                    })
                    .collect();
                Tensor::from_f32([ids.len() / k, k], values)
            })
            .transpose()?;
        call.cast_outputs(BlockwiseMmGrads {
            hidden_states_grad: take(&mut out, &bwd::HIDDEN_STATES_GRAD)?,
            expert_affinities_masked_grad,
            gate_up_proj_weight_grad: take(&mut out, &bwd::GATE_UP_PROJ_WEIGHT_GRAD)?,
            down_proj_weight_grad: take(&mut out, &bwd::DOWN_PROJ_WEIGHT_GRAD)?,
            d_topk_affinities,
            gate_and_up_proj_bias_grad: out
                .remove(bwd::GATE_AND_UP_PROJ_BIAS_GRAD.name)
                .filter(|_| bias),
            down_proj_bias_grad: out.remove(bwd::DOWN_PROJ_BIAS_GRAD.name).filter(|_| bias),
        })
    }
}

impl std::fmt::Debug for NeuronBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NeuronBackend")
            .field("config", &self.config)
            .finish()
    }
}
