//! Kernel benchmarks on any backend: one MoE layer's kernels, forward and backward, at model
//! shapes, each reported as time, throughput and share of the machine's measured limit
//! ([`limits::MachineLimits`]). `moekit bench` prints these rows; `BENCHMARKS.md` records them.

pub mod cold;
pub mod exchange;
#[cfg(feature = "libtorch")]
pub mod libtorch;
pub mod limits;

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use limits::MachineLimits;
use moekit::backend::{Backend, Device, KernelCall};
use moekit::backends::BackendKind;
use moekit::contracts::{
    FindNonzeroIndices, FindNonzeroIndicesInputs, FindNonzeroIndicesParams, IndexedFlatten,
    IndexedFlattenInputs, OutputDType, Topk, TopkInputs, TopkParams, TopkReduce, TopkReduceInputs,
    TopkReduceParams, WeightLayout,
};
use moekit::cpu::CpuBackend;
use moekit::cpu::isa::Isa;
use moekit::error::{Error, Result};
use moekit::experts::{Experts, LocalExperts};
use moekit::kernel::Kernel;
use moekit::tensor::DType;

use crate::layer::{Layer, LayerInputs, MoeShape, VOCAB_TOP_K, flatten_plan};
use crate::machine::Host;

/// What to benchmark.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub shape: MoeShape,
    /// T, tokens.
    pub tokens: usize,
    /// Storage of the float inputs: f32 or bf16.
    pub dtype: DType,
    /// B, the block size of the plan.
    pub block_size: usize,
    /// Each kernel repeats until it has run this long (at least three times).
    pub min_time: Duration,
    /// Also time the libtorch paths (only in builds with the `libtorch` feature).
    pub libtorch: bool,
    /// The rows to measure and report.
    pub rows: RowSelection,
}

/// The row that times the whole layer: every kernel once, forward and backward.
pub const LAYER_ROW: &str = "moe_layer_fwd_bwd";

/// The row that times the experts as the trainer runs them: [`LocalExperts`]' forward
/// (`permute`, `blockwise_mm` with checkpoints) and backward (`blockwise_mm_bwd` on the
/// forward's validated call), validation included.
pub const EXPERTS_ROW: &str = "experts_fwd_bwd";

/// The rows a run reports: every row (empty), or the named ones (kernel names,
/// [`LAYER_ROW`] and [`EXPERTS_ROW`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowSelection(Vec<String>);

impl RowSelection {
    /// Every row.
    pub fn all() -> Self {
        Self::default()
    }

    /// The rows named (every row when `names` is empty); an unknown name is an error listing
    /// the known ones.
    pub fn new(names: &[String]) -> Result<Self> {
        let known: Vec<&str> = Kernel::ALL
            .iter()
            .map(|kernel| kernel.name())
            .chain([LAYER_ROW, EXPERTS_ROW])
            .collect();
        if let Some(name) = names.iter().find(|name| !known.contains(&name.as_str())) {
            return Err(Error::param(
                "kernel",
                format!("unknown row `{name}`; expected one of {}", known.join(", ")),
            ));
        }
        Ok(Self(names.to_vec()))
    }

    /// Whether the row `name` is reported.
    pub fn shows(&self, name: &str) -> bool {
        self.0.is_empty() || self.0.iter().any(|shown| shown == name)
    }

    /// Whether the kernel `name` is timed: its row is reported, or the layer row, which sums
    /// every kernel.
    pub fn times(&self, name: &str) -> bool {
        self.shows(name) || self.shows(LAYER_ROW)
    }
}

/// How a row's throughput is counted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Throughput {
    /// Useful floating-point work (padding excluded), GFLOP/s; compared with the FMA peak.
    Gflops(f64),
    /// Compulsory bytes read and written, GB/s; compared with the stream bandwidth.
    Gbps(f64),
}

/// One measured kernel.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchRow {
    pub kernel: String,
    pub backend: &'static str,
    pub shape: &'static str,
    pub tokens: usize,
    pub dtype: DType,
    /// Median wall time, milliseconds.
    pub ms: f64,
    pub throughput: Throughput,
    /// The fastest libtorch path for the same work in the same run, when one was measured.
    pub libtorch_ms: Option<f64>,
    /// The instruction-set level the cpu backend's kernels ran at, on its rows.
    pub cpu_isa: Option<Isa>,
}

impl BenchRow {
    /// Share of the machine's limit for this kind of throughput, percent.
    pub fn pct_of_peak(&self, limits: &MachineLimits) -> f64 {
        match self.throughput {
            Throughput::Gflops(v) => 100.0 * v / limits.fma_gflops,
            Throughput::Gbps(v) => 100.0 * v / limits.stream_gbps,
        }
    }

    /// How many times faster than the fastest libtorch path (> 1: moekit is faster).
    pub fn vs_libtorch(&self) -> Option<f64> {
        self.libtorch_ms.map(|peer| peer / self.ms)
    }

    /// One JSON object with the fields `kernel`, `backend`, `shape`, `tokens`, `dtype`, `ms`,
    /// `gflops` or `gbps`, `pct_of_peak`, `libtorch_ms` and `vs_libtorch` (`null` when no
    /// libtorch peer was measured), and `cpu_isa` (`null` on other backends' rows).
    pub fn to_json(&self, limits: &MachineLimits) -> String {
        let (key, value) = match self.throughput {
            Throughput::Gflops(v) => ("gflops", v),
            Throughput::Gbps(v) => ("gbps", v),
        };
        let optional = |v: Option<f64>| v.map_or_else(|| "null".to_owned(), |v| format!("{v:.4}"));
        format!(
            "{{\"kernel\":\"{}\",\"backend\":\"{}\",\"shape\":\"{}\",\"tokens\":{},\"dtype\":\"{}\",\"ms\":{:.4},\"{key}\":{value:.2},\"pct_of_peak\":{:.1},\"libtorch_ms\":{},\"vs_libtorch\":{},\"cpu_isa\":{}}}",
            self.kernel,
            self.backend,
            self.shape,
            self.tokens,
            self.dtype,
            self.ms,
            self.pct_of_peak(limits),
            optional(self.libtorch_ms),
            optional(self.vs_libtorch()),
            self.cpu_isa
                .map_or_else(|| "null".to_owned(), |isa| format!("\"{isa}\"")),
        )
    }
}

/// Which part of the layer a libtorch path computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Router,
    /// The decode-time RMSNorm and router.
    DecodeRouter,
    Permute,
    /// The top-k over a vocabulary.
    Topk,
    Experts,
}

impl Stage {
    /// The rows whose libtorch column a path of this stage gives.
    fn rows(self) -> &'static [&'static str] {
        match self {
            Stage::Router => &["router_topk", "router_topk_bwd", LAYER_ROW],
            Stage::DecodeRouter => &[
                "rmsnorm_router_topk_tkg",
                "rmsnorm_router_topk_tkg_bwd",
                "moe_block_tkg",
            ],
            Stage::Permute => &["permute"],
            Stage::Topk => &["topk"],
            Stage::Experts => &[
                "blockwise_mm",
                "blockwise_mm_bwd",
                "moe_tkg",
                "moe_block_tkg",
                LAYER_ROW,
                EXPERTS_ROW,
            ],
        }
    }
}

/// A libtorch path measured in the same run as moekit's kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerPath {
    pub name: &'static str,
    pub stage: Stage,
    pub forward_ms: f64,
    pub backward_ms: Option<f64>,
}

/// Fastest forward and backward among the peer paths of one stage.
fn best(peers: &[PeerPath], stage: Stage) -> (Option<f64>, Option<f64>) {
    let of_stage = || peers.iter().filter(move |p| p.stage == stage);
    let min = |it: &mut dyn Iterator<Item = f64>| {
        it.fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.min(v))))
    };
    (
        min(&mut of_stage().map(|p| p.forward_ms)),
        min(&mut of_stage().filter_map(|p| p.backward_ms)),
    )
}

/// A layer benchmark: moekit's rows and the libtorch paths measured beside them.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchResult {
    pub rows: Vec<BenchRow>,
    pub peers: Vec<PeerPath>,
}

/// Median time of `f` on cold caches ([`cold::evict`] before each run) after one warm-up run,
/// repeating until the runs and their evictions fill `min_time` (at least 3 runs).
fn time<T>(min_time: Duration, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let first = Instant::now();
    f()?;
    cold::evict();
    // The runs fill `min_time` with their evictions.
    let warm_up = first.elapsed();
    let runs = (min_time.as_secs_f64() / warm_up.as_secs_f64().max(1e-9)).ceil() as usize;
    let runs = runs.clamp(3, 1000);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        cold::evict();
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(times))
}

/// The median of at least one value (the mean of the middle two of an even count).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n % 2 {
        1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// Runs every kernel of one MoE layer that `backend` supports, forward and backward, and
/// measures each: by wall time around repeated calls, or by the backend's own timing of repeated
/// executions on its device where it has one ([`Backend::time_repeated`]).
///
/// The layer's routing, plan and checkpoints come from `backend` where it runs all three
/// forward kernels, else from the reference. The layer row is reported only when every kernel
/// of the layer was timed.
pub fn run(backend: &Arc<dyn Backend>, config: &BenchConfig) -> Result<BenchResult> {
    let shared = backend;
    let backend = shared.as_ref();
    let supported = |kernel: Kernel| backend.supports(kernel);
    let reference = BackendKind::Reference.create();
    let builds_layer = [Kernel::RouterTopk, Kernel::Permute, Kernel::BlockwiseMm]
        .into_iter()
        .try_fold(true, |all, kernel| {
            Ok::<_, moekit::Error>(all && supported(kernel)?)
        })?;
    let layer_backend = if builds_layer {
        backend
    } else {
        reference.as_ref()
    };
    let inputs = LayerInputs::new(config.shape, config.tokens, config.dtype, config.block_size)?;
    let layer = Layer::new(layer_backend, inputs)?;
    let MoeShape { h, i, e, k, .. } = config.shape;
    let (t, n, b) = (
        config.tokens,
        layer.plan.block_to_expert.numel(),
        config.block_size,
    );
    let peers = if config.libtorch {
        // Only the paths of the rows shown: the experts' take seconds in bf16 on CPUs.
        let wanted = |stage: Stage| stage.rows().iter().any(|row| config.rows.shows(row));
        peers(&layer, config.min_time, &wanted)?
    } else {
        Vec::new()
    };
    let (router_fwd, router_bwd) = best(&peers, Stage::Router);
    let (decode_router_fwd, decode_router_bwd) = best(&peers, Stage::DecodeRouter);
    let (permute_fwd, _) = best(&peers, Stage::Permute);
    let (topk_fwd, _) = best(&peers, Stage::Topk);
    let (experts_fwd, experts_bwd) = best(&peers, Stage::Experts);
    let experts_fwd_bwd = peers
        .iter()
        .filter(|p| p.stage == Stage::Experts)
        .filter_map(|p| Some(p.forward_ms + p.backward_ms?))
        .reduce(f64::min);
    // Router forward and backward plus the best expert path: `_grouped_mm` sorts the tokens
    // itself and the loop needs no plan, so the separate argsort is not added again.
    let layer_peer = (|| Some(router_fwd? + router_bwd? + experts_fwd_bwd?))();
    // HF's decode step: its RMSNorm and router, then its experts.
    let decode_block_peer = (|| Some(decode_router_fwd? + experts_fwd?))();
    let cpu_isa = (backend.name() == CpuBackend::NAME).then(Isa::active);
    let row = |kernel: &str, ms: f64, throughput: Throughput| BenchRow {
        cpu_isa,
        kernel: kernel.to_owned(),
        backend: backend.name(),
        shape: config.shape.name,
        tokens: t,
        dtype: config.dtype,
        ms,
        throughput,
        libtorch_ms: match kernel {
            "router_topk" => router_fwd,
            "router_topk_bwd" => router_bwd,
            "rmsnorm_router_topk_tkg" => decode_router_fwd,
            "rmsnorm_router_topk_tkg_bwd" => decode_router_bwd,
            "permute" => permute_fwd,
            "topk" => topk_fwd,
            // HF's decode-time experts are its prefill ones on fewer tokens.
            "blockwise_mm" | "moe_tkg" => experts_fwd,
            "blockwise_mm_bwd" => experts_bwd,
            "moe_block_tkg" => decode_block_peer,
            LAYER_ROW => layer_peer,
            EXPERTS_ROW => experts_fwd_bwd,
            _ => None,
        },
    };
    let gflops = |flop: f64, ms: f64| Throughput::Gflops(flop / ms / 1e6);
    let gbps = |bytes: f64, ms: f64| Throughput::Gbps(bytes / ms / 1e6);
    let (tf, hf, ef, kf, if_) = (t as f64, h as f64, e as f64, k as f64, i as f64);
    let expert_flop = 6.0 * tf * kf * hf * if_;
    let min = config.min_time;
    // The layer's kernels that are measured, and whether that is all of them.
    let mut rows = Vec::new();
    let mut whole_layer = true;
    let mut timed = |kernel: Kernel| -> Result<bool> {
        let runs = supported(kernel)?;
        whole_layer &= runs;
        Ok(runs && config.rows.times(kernel.name()))
    };
    if timed(Kernel::RouterTopk)? {
        let call = layer.inputs.router_topk()?;
        let ms = measure(backend, KernelCall::RouterTopk(&call), min)?;
        rows.push(row("router_topk", ms, gflops(2.0 * tf * hf * ef, ms)));
    }
    if timed(Kernel::RouterTopkBwd)? {
        let call = layer.router_topk_bwd()?;
        let ms = measure(backend, KernelCall::RouterTopkBwd(&call), min)?;
        rows.push(row("router_topk_bwd", ms, gflops(4.0 * tf * hf * ef, ms)));
    }
    if timed(Kernel::LoadBalancingLoss)? {
        let call = layer.load_balancing_loss()?;
        let ms = measure(backend, KernelCall::LoadBalancingLoss(&call), min)?;
        let bytes = tf * (ef + kf) * 4.0;
        rows.push(row("load_balancing_loss", ms, gbps(bytes, ms)));
    }
    if timed(Kernel::LoadBalancingLossBwd)? {
        let call = layer.load_balancing_loss_bwd()?;
        let ms = measure(backend, KernelCall::LoadBalancingLossBwd(&call), min)?;
        let bytes = tf * (2.0 * ef + kf) * 4.0;
        rows.push(row("load_balancing_loss_bwd", ms, gbps(bytes, ms)));
    }
    if timed(Kernel::Permute)? {
        let call = layer.permute()?;
        let ms = measure(backend, KernelCall::Permute(&call), min)?;
        let plan_bytes = tf * kf * 8.0 + (n * b + n + e) as f64 * 4.0 + (tf + 1.0) * ef * 4.0;
        rows.push(row("permute", ms, gbps(plan_bytes, ms)));
    }
    if timed(Kernel::PermuteBwd)? {
        let call = layer.permute_bwd()?;
        let ms = measure(backend, KernelCall::PermuteBwd(&call), min)?;
        rows.push(row("permute_bwd", ms, gbps(tf * kf * 12.0, ms)));
    }
    if timed(Kernel::BlockwiseMm)? {
        let call = layer.blockwise_mm()?;
        let ms = measure(backend, KernelCall::BlockwiseMm(&call), min)?;
        rows.push(row("blockwise_mm", ms, gflops(expert_flop, ms)));
    }
    if timed(Kernel::BlockwiseMmBwd)? {
        let call = layer.blockwise_mm_bwd()?;
        let ms = measure(backend, KernelCall::BlockwiseMmBwd(&call), min)?;
        rows.push(row("blockwise_mm_bwd", ms, gflops(2.0 * expert_flop, ms)));
    }

    // The whole layer: every kernel above once, forward and backward.
    if whole_layer && config.rows.shows(LAYER_ROW) {
        let layer_ms: f64 = rows.iter().map(|r| r.ms).sum();
        let layer_flop = expert_flop * 3.0 + 6.0 * tf * hf * ef;
        rows.push(row(LAYER_ROW, layer_ms, gflops(layer_flop, layer_ms)));
    }
    // The experts composed, forward and backward, where the backend runs their kernels.
    let experts_kernels = [Kernel::Permute, Kernel::BlockwiseMm, Kernel::BlockwiseMmBwd];
    let runs_experts = experts_kernels.into_iter().try_fold(true, |all, kernel| {
        Ok::<_, Error>(all && supported(kernel)?)
    })?;
    if runs_experts && config.rows.shows(EXPERTS_ROW) {
        let experts = LocalExperts {
            backend: Arc::clone(shared),
            block_size: b,
            output_dtype: OutputDType::Input,
            weight_layout: WeightLayout::Nki,
        };
        let inputs = layer.experts_inputs();
        let d_output = layer.experts_output_grad()?;
        let ms = time(min, || {
            let (_, saved) = experts.forward(inputs, true)?;
            let saved = saved.ok_or_else(|| Error::invalid("blockwise_mm", "no record kept"))?;
            experts.backward(inputs, &saved, &d_output)
        })?;
        rows.push(row(EXPERTS_ROW, ms, gflops(3.0 * expert_flop, ms)));
    }
    // The routing table an expert-parallel layer would exchange with (not part of the
    // single-rank layer above), at the most ranks up to 8 that divide E.
    if supported(Kernel::A2avRouting)? && config.rows.times(Kernel::A2avRouting.name()) {
        let ranks = [8, 4, 2, 1]
            .into_iter()
            .find(|r| e.is_multiple_of(*r))
            .unwrap_or(1);
        let call = layer.a2av_routing(ranks)?;
        let ms = measure(backend, KernelCall::A2avRouting(&call), min)?;
        let bytes = tf * (kf + ranks as f64) * 4.0;
        rows.push(row("a2av_routing", ms, gbps(bytes, ms)));
    }
    // The same tokens decoded (nki-library's `moe_tkg`, not part of the training layer): a
    // decoding step reads each selected expert's weights once, so its limit is the memory
    // bandwidth, and its compulsory bytes are those weights, the tokens and the output.
    let element = config.dtype.size_in_bytes() as f64;
    if supported(Kernel::MoeTkg)? && config.rows.times(Kernel::MoeTkg.name()) {
        let call = layer.moe_tkg()?;
        let ms = measure(backend, KernelCall::MoeTkg(&call), min)?;
        let mut selected = call.routing().experts.clone();
        selected.sort_unstable();
        selected.dedup();
        let bytes = (selected.len() as f64 * 3.0 * hf * if_ + 2.0 * tf * hf) * element;
        rows.push(row(Kernel::MoeTkg.name(), ms, gbps(bytes, ms)));
    }
    // The same tokens' decode-time RMSNorm and router (nki-library's
    // `rmsnorm_router_topk_tkg`), and moekit's backward of it: a step reads the router weights
    // once, so memory bounds them; the compulsory bytes are the tensors read and written.
    if supported(Kernel::RmsNormRouterTopkTkg)?
        && config.rows.times(Kernel::RmsNormRouterTopkTkg.name())
    {
        let call = layer.rmsnorm_router_topk_tkg()?;
        let ms = measure(backend, KernelCall::RmsNormRouterTopkTkg(&call), min)?;
        // x, gamma, the weights and norm_output; bf16 affinities and i32 ids.
        let bytes = element * (2.0 * tf * hf + hf + hf * ef) + 2.0 * tf * ef + 4.0 * tf * kf;
        rows.push(row(
            Kernel::RmsNormRouterTopkTkg.name(),
            ms,
            gbps(bytes, ms),
        ));
    }
    if supported(Kernel::RmsNormRouterTopkTkgBwd)?
        && config.rows.times(Kernel::RmsNormRouterTopkTkgBwd.name())
    {
        let call = layer.rmsnorm_router_topk_tkg_bwd()?;
        let ms = measure(backend, KernelCall::RmsNormRouterTopkTkgBwd(&call), min)?;
        // x, gamma and the weights read, their gradients written (and the bias's); the f32
        // affinity gradient and the ids read.
        let bytes = element * 2.0 * (tf * hf + hf + hf * ef + ef) + 4.0 * tf * (ef + kf);
        rows.push(row(
            Kernel::RmsNormRouterTopkTkgBwd.name(),
            ms,
            gbps(bytes, ms),
        ));
    }
    // The decode block (nki-library's `moe_block_tkg`: RMSNorm, router and experts): a step
    // reads the router weights and the selected experts' weights once; the compulsory bytes are
    // those, the tokens, `gamma` and the outputs.
    if supported(Kernel::MoeBlockTkg)? && config.rows.times(Kernel::MoeBlockTkg.name()) {
        let call = layer.moe_block_tkg()?;
        let ms = measure(backend, KernelCall::MoeBlockTkg(&call), min)?;
        // The experts it selects: those of the same norm and router (ACT1's top K of the
        // activations are the top K logits), from the reference.
        let routed = reference.rmsnorm_router_topk_tkg(&layer.rmsnorm_router_topk_tkg()?)?;
        let mut selected = routed.expert_index.as_i32().unwrap_or_default().to_vec();
        selected.sort_unstable();
        selected.dedup();
        let weights = selected.len() as f64 * 3.0 * hf * if_ + hf * ef;
        let bytes = element * (weights + 2.0 * tf * hf + hf + tf * ef);
        rows.push(row(Kernel::MoeBlockTkg.name(), ms, gbps(bytes, ms)));
    }
    // nki-library's top-k over a vocabulary (`topk`: Qwen3's 151,936 logits per token, K =
    // 256): one pass over the logits bounds it, so its compulsory bytes are the logits read.
    if supported(Kernel::Topk)? && config.rows.times(Kernel::Topk.name()) {
        let logits = layer.inputs.vocabulary_logits()?;
        let call = Topk::new(TopkInputs { inp: &logits }, TopkParams::new(VOCAB_TOP_K))?;
        let ms = measure(backend, KernelCall::Topk(&call), min)?;
        let bytes = element * logits.numel() as f64;
        rows.push(row(Kernel::Topk.name(), ms, gbps(bytes, ms)));
    }
    // The combine after an expert-parallel exchange (nki-library's `topk_reduce`): K·T rows as K
    // source ranks return them, each token's K summed. One pass over the rows bounds it: the
    // compulsory bytes are the rows read (bf16, their ids too) and the output written.
    if supported(Kernel::TopkReduce)? && config.rows.times(Kernel::TopkReduce.name()) {
        let exchanged = layer.exchanged_rows(TopkReduceParams::DEFAULT_TOKEN_BASE_INDEX)?;
        let params = TopkReduceParams::new(tf as usize, kf as usize);
        let call = TopkReduce::new(TopkReduceInputs { input: &exchanged }, params)?;
        let ms = measure(backend, KernelCall::TopkReduce(&call), min)?;
        let bytes = 2.0 * exchanged.numel() as f64 + element * tf * hf;
        rows.push(row(Kernel::TopkReduce.name(), ms, gbps(bytes, ms)));
    }
    // The device-side plan (nki-library's subkernels): each expert's token list from the
    // routed affinities `[T, E]`, then the lists laid out as blocks. The compulsory bytes are
    // the tensors read and written.
    let affinities = layer.routed_affinities()?;
    let search = FindNonzeroIndices::new(
        FindNonzeroIndicesInputs {
            input_tensor: &affinities,
            col_start_id: None,
        },
        FindNonzeroIndicesParams::default(),
    )?;
    if supported(Kernel::FindNonzeroIndices)?
        && config.rows.times(Kernel::FindNonzeroIndices.name())
    {
        let ms = measure(backend, KernelCall::FindNonzeroIndices(&search), min)?;
        let bytes = element * tf * ef + 4.0 * (ef * tf + ef);
        rows.push(row(Kernel::FindNonzeroIndices.name(), ms, gbps(bytes, ms)));
    }
    if supported(Kernel::IndexedFlatten)? && config.rows.times(Kernel::IndexedFlatten.name()) {
        let found = reference.find_nonzero_indices(&search)?;
        let counts = found.nonzero_counts.as_i32().unwrap_or_default();
        let (row_offsets, params) = flatten_plan(counts, tf as usize, b)?;
        let inputs = IndexedFlattenInputs {
            input_tensor: &found.indices,
            row_offsets: &row_offsets,
            row_offsets_start: None,
        };
        let call = IndexedFlatten::new(inputs, params)?;
        let ms = measure(backend, KernelCall::IndexedFlatten(&call), min)?;
        let bytes = 4.0 * (found.indices.numel() + ef as usize + params.output_len) as f64;
        rows.push(row(Kernel::IndexedFlatten.name(), ms, gbps(bytes, ms)));
    }
    rows.retain(|row| config.rows.shows(&row.kernel));
    Ok(BenchResult { rows, peers })
}

/// The time of one call in milliseconds: the backend's mean over enough repeated executions to
/// fill `min_time` after a first one (which loads what it needs), where it times its device
/// itself; else the median wall time of repeated calls ([`time`]).
fn measure(backend: &dyn Backend, call: KernelCall<'_, '_>, min_time: Duration) -> Result<f64> {
    let Some(first) = backend.time_repeated(call, 1)? else {
        return time(min_time, || call.run_discarding(backend));
    };
    let repeats =
        (min_time.as_secs_f64() / first.as_secs_f64().max(1e-9)).clamp(3.0, 10_000.0) as u32;
    let mean = backend
        .time_repeated(call, repeats)?
        .ok_or_else(|| Error::Unsupported {
            backend: backend.name(),
            kernel: call.kernel().name(),
            message: "it timed one execution but not repeated ones".to_owned(),
        })?;
    Ok(mean.as_secs_f64() * 1e3)
}

/// The libtorch paths for the same layer, timed in this run.
#[cfg(feature = "libtorch")]
fn peers(
    layer: &Layer,
    min_time: Duration,
    wanted: &dyn Fn(Stage) -> bool,
) -> Result<Vec<PeerPath>> {
    libtorch::measure(&layer.inputs, &layer.routed, min_time, wanted)
}

/// Without the `libtorch` feature no peer is measured.
#[cfg(not(feature = "libtorch"))]
fn peers(
    _layer: &Layer,
    _min_time: Duration,
    _wanted: &dyn Fn(Stage) -> bool,
) -> Result<Vec<PeerPath>> {
    Ok(Vec::new())
}

/// The results as the table `moekit bench` prints: moekit's rows, then the libtorch paths.
pub fn table(results: &[BenchResult], limits: &MachineLimits) -> String {
    let mut out = match limits.device {
        Device::Host => {
            let host = Host::describe();
            format!(
                "machine: {}, {} threads, f32 FMA peak {:.1} GFLOP/s, stream triad {:.1} GB/s\n{}\n",
                host.model,
                limits.threads,
                limits.fma_gflops,
                limits.stream_gbps,
                host.kernels_line()
            )
        }
        Device::Accelerator(device) => format!(
            "device: {}, {} peak {:.0} GFLOP/s, memory {:.0} GB/s (documented, not measured); \
             times are the device's means over repeated executions\n",
            device.name, device.peak_dtype, limits.fma_gflops, limits.stream_gbps
        ),
    };
    let _ = writeln!(
        out,
        "{:<24} {:<9} {:<16} {:>6} {:<5} {:>10} {:>14} {:>7} {:>11} {:>8}",
        "kernel",
        "backend",
        "shape",
        "T",
        "dtype",
        "ms",
        "throughput",
        "% peak",
        "libtorch ms",
        "× torch"
    );
    for r in results.iter().flat_map(|result| &result.rows) {
        let throughput = match r.throughput {
            Throughput::Gflops(v) => format!("{v:.1} GFLOP/s"),
            Throughput::Gbps(v) => format!("{v:.1} GB/s"),
        };
        let peer = r
            .libtorch_ms
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.3}"));
        let ratio = r
            .vs_libtorch()
            .map_or_else(|| "-".to_owned(), |v| format!("{v:.2}×"));
        let _ = writeln!(
            out,
            "{:<24} {:<9} {:<16} {:>6} {:<5} {:>10.3} {:>14} {:>6.1}% {:>11} {:>8}",
            r.kernel,
            r.backend,
            r.shape,
            r.tokens,
            r.dtype,
            r.ms,
            throughput,
            r.pct_of_peak(limits),
            peer,
            ratio
        );
    }
    for result in results.iter().filter(|r| !r.peers.is_empty()) {
        let Some(first) = result.rows.first() else {
            continue;
        };
        let _ = writeln!(
            out,
            "libtorch paths, {} T={} {}:",
            first.shape, first.tokens, first.dtype
        );
        for p in &result.peers {
            let backward = p
                .backward_ms
                .map_or_else(|| "-".to_owned(), |v| format!("{v:.3} ms"));
            let _ = writeln!(
                out,
                "  {:<30} forward {:>10.3} ms   backward {:>12}",
                p.name, p.forward_ms, backward
            );
        }
    }
    out
}
