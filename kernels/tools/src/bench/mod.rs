//! Kernel benchmarks on any backend: one MoE layer's kernels, forward and backward, at model
//! shapes, each reported as time, throughput and share of the machine's measured limit
//! ([`limits::MachineLimits`]). `moekit bench` prints these rows; `BENCHMARKS.md` records them.

pub mod exchange;
#[cfg(feature = "libtorch")]
pub mod libtorch;
pub mod limits;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use limits::{Device, MachineLimits};
use moekit::backends::BackendKind;
use moekit::error::{Error, Result};
use moekit::kernel::Kernel;
use moekit::neuron::manifest::Manifest;
use moekit::neuron::{NeuronBackend, NeuronConfig};
use moekit::tensor::DType;

use crate::layer::{Layer, LayerInputs, MoeShape};

/// What to benchmark.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    pub backend: BackendKind,
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
    /// Where the `neuron` backend finds libnrt and its manifest.
    pub neuron: NeuronConfig,
}

/// The row that times the whole layer: every kernel once, forward and backward.
pub const LAYER_ROW: &str = "moe_layer_fwd_bwd";

/// The rows a run reports: every row (empty), or the named ones (kernel names, and
/// [`LAYER_ROW`]).
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
            .chain([LAYER_ROW])
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
    pub backend: BackendKind,
    pub shape: &'static str,
    pub tokens: usize,
    pub dtype: DType,
    /// Median wall time, milliseconds.
    pub ms: f64,
    pub throughput: Throughput,
    /// The fastest libtorch path for the same work in the same run, when one was measured.
    pub libtorch_ms: Option<f64>,
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
    /// libtorch peer was measured).
    pub fn to_json(&self, limits: &MachineLimits) -> String {
        let (key, value) = match self.throughput {
            Throughput::Gflops(v) => ("gflops", v),
            Throughput::Gbps(v) => ("gbps", v),
        };
        let optional = |v: Option<f64>| v.map_or_else(|| "null".to_owned(), |v| format!("{v:.4}"));
        format!(
            "{{\"kernel\":\"{}\",\"backend\":\"{}\",\"shape\":\"{}\",\"tokens\":{},\"dtype\":\"{}\",\"ms\":{:.4},\"{key}\":{value:.2},\"pct_of_peak\":{:.1},\"libtorch_ms\":{},\"vs_libtorch\":{}}}",
            self.kernel,
            self.backend,
            self.shape,
            self.tokens,
            self.dtype,
            self.ms,
            self.pct_of_peak(limits),
            optional(self.libtorch_ms),
            optional(self.vs_libtorch()),
        )
    }
}

/// Which part of the layer a libtorch path computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Router,
    Permute,
    Experts,
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

/// Median time of `f` after one warm-up run, repeating for at least `min_time` and 3 runs.
fn time<T>(min_time: Duration, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let first = Instant::now();
    f()?;
    let warm_up = first.elapsed();
    let runs = (min_time.as_secs_f64() / warm_up.as_secs_f64().max(1e-9)).ceil() as usize;
    let runs = runs.clamp(3, 1000);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
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

/// Runs every kernel of one MoE layer, forward and backward, and measures each. On `neuron`,
/// the kernels it runs are timed on the device with `nrt_execute_repeat`.
pub fn run(config: &BenchConfig) -> Result<BenchResult> {
    if config.backend == BackendKind::Neuron {
        return run_on_neuron(config);
    }
    let backend = config.backend.create();
    let backend = backend.as_ref();
    let inputs = LayerInputs::new(config.shape, config.tokens, config.dtype, config.block_size)?;
    let layer = Layer::new(backend, inputs)?;
    let MoeShape { h, i, e, k, .. } = config.shape;
    let (t, n, b) = (
        config.tokens,
        layer.plan.block_to_expert.numel(),
        config.block_size,
    );
    let peers = if config.libtorch {
        peers(&layer, config.min_time)?
    } else {
        Vec::new()
    };
    let (router_fwd, router_bwd) = best(&peers, Stage::Router);
    let (permute_fwd, _) = best(&peers, Stage::Permute);
    let (experts_fwd, experts_bwd) = best(&peers, Stage::Experts);
    let experts_fwd_bwd = peers
        .iter()
        .filter(|p| p.stage == Stage::Experts)
        .filter_map(|p| Some(p.forward_ms + p.backward_ms?))
        .reduce(f64::min);
    // Router forward and backward plus the best expert path: `_grouped_mm` sorts the tokens
    // itself and the loop needs no plan, so the separate argsort is not added again.
    let layer_peer = (|| Some(router_fwd? + router_bwd? + experts_fwd_bwd?))();
    let row = |kernel: &str, ms: f64, throughput: Throughput| BenchRow {
        kernel: kernel.to_owned(),
        backend: config.backend,
        shape: config.shape.name,
        tokens: t,
        dtype: config.dtype,
        ms,
        throughput,
        libtorch_ms: match kernel {
            "router_topk" => router_fwd,
            "router_topk_bwd" => router_bwd,
            "permute" => permute_fwd,
            "blockwise_mm" => experts_fwd,
            "blockwise_mm_bwd" => experts_bwd,
            LAYER_ROW => layer_peer,
            _ => None,
        },
    };
    let gflops = |flop: f64, ms: f64| Throughput::Gflops(flop / ms / 1e6);
    let gbps = |bytes: f64, ms: f64| Throughput::Gbps(bytes / ms / 1e6);
    let (tf, hf, ef, kf, if_) = (t as f64, h as f64, e as f64, k as f64, i as f64);
    let expert_flop = 6.0 * tf * kf * hf * if_;
    let min = config.min_time;

    let mut rows = Vec::new();
    let timed = |name: &str| config.rows.times(name);
    if timed("router_topk") {
        let call = layer.inputs.router_topk()?;
        let ms = time(min, || backend.router_topk(&call))?;
        rows.push(row("router_topk", ms, gflops(2.0 * tf * hf * ef, ms)));
    }
    if timed("router_topk_bwd") {
        let call = layer.router_topk_bwd()?;
        let ms = time(min, || backend.router_topk_bwd(&call))?;
        rows.push(row("router_topk_bwd", ms, gflops(4.0 * tf * hf * ef, ms)));
    }
    if timed("load_balancing_loss") {
        let call = layer.load_balancing_loss()?;
        let ms = time(min, || backend.load_balancing_loss(&call))?;
        let bytes = tf * (ef + kf) * 4.0;
        rows.push(row("load_balancing_loss", ms, gbps(bytes, ms)));
    }
    if timed("load_balancing_loss_bwd") {
        let call = layer.load_balancing_loss_bwd()?;
        let ms = time(min, || backend.load_balancing_loss_bwd(&call))?;
        let bytes = tf * (2.0 * ef + kf) * 4.0;
        rows.push(row("load_balancing_loss_bwd", ms, gbps(bytes, ms)));
    }
    if timed("permute") {
        let call = layer.permute()?;
        let ms = time(min, || backend.permute(&call))?;
        let plan_bytes = tf * kf * 8.0 + (n * b + n + e) as f64 * 4.0 + (tf + 1.0) * ef * 4.0;
        rows.push(row("permute", ms, gbps(plan_bytes, ms)));
    }
    if timed("permute_bwd") {
        let call = layer.permute_bwd()?;
        let ms = time(min, || backend.permute_bwd(&call))?;
        rows.push(row("permute_bwd", ms, gbps(tf * kf * 12.0, ms)));
    }
    if timed("blockwise_mm") {
        let call = layer.blockwise_mm()?;
        let ms = time(min, || backend.blockwise_mm(&call))?;
        rows.push(row("blockwise_mm", ms, gflops(expert_flop, ms)));
    }
    if timed("blockwise_mm_bwd") {
        let call = layer.blockwise_mm_bwd()?;
        let ms = time(min, || backend.blockwise_mm_bwd(&call))?;
        rows.push(row("blockwise_mm_bwd", ms, gflops(2.0 * expert_flop, ms)));
    }

    // The whole layer: every kernel above once, forward and backward.
    if config.rows.shows(LAYER_ROW) {
        let layer_ms: f64 = rows.iter().map(|r| r.ms).sum();
        let layer_flop = expert_flop * 3.0 + 6.0 * tf * hf * ef;
        rows.push(row(LAYER_ROW, layer_ms, gflops(layer_flop, layer_ms)));
    }
    // The routing table an expert-parallel layer would exchange with (not part of the
    // single-rank layer above), at the most ranks up to 8 that divide E.
    if timed("a2av_routing") {
        let ranks = [8, 4, 2, 1]
            .into_iter()
            .find(|r| e.is_multiple_of(*r))
            .unwrap_or(1);
        let call = layer.a2av_routing(ranks)?;
        let ms = time(min, || backend.a2av_routing(&call))?;
        let bytes = tf * (kf + ranks as f64) * 4.0;
        rows.push(row("a2av_routing", ms, gbps(bytes, ms)));
    }
    rows.retain(|row| config.rows.shows(&row.kernel));
    Ok(BenchResult { rows, peers })
}

/// The `neuron` rows: the layer is routed by the reference, then each kernel the manifest
/// registers (`router_topk`, `blockwise_mm` with checkpoints as training calls it,
/// `blockwise_mm_bwd`) is timed with `nrt_execute_repeat` on device-resident inputs: enough
/// repeats to fill `min_time` after a first execution that loads the NEFF. The mean device time
/// per execution is reported.
fn run_on_neuron(config: &BenchConfig) -> Result<BenchResult> {
    let manifest = Manifest::read(&config.neuron.manifest)?;
    let registered = |kernel: Kernel| manifest.entries.iter().any(|entry| entry.kernel == kernel);
    let neuron = NeuronBackend::new(config.neuron.clone());
    let reference = BackendKind::Reference.create();
    let inputs = LayerInputs::new(config.shape, config.tokens, config.dtype, config.block_size)?;
    let layer = Layer::new(reference.as_ref(), inputs)?;
    let MoeShape { h, i, e, k, .. } = config.shape;
    let (tf, hf, ef, kf, if_) = (config.tokens as f64, h as f64, e as f64, k as f64, i as f64);
    let repeats = |first: Duration| {
        (config.min_time.as_secs_f64() / first.as_secs_f64().max(1e-9)).clamp(3.0, 10_000.0) as i32
    };
    let row = |kernel: &str, ms: f64, flop: f64| BenchRow {
        kernel: kernel.to_owned(),
        backend: BackendKind::Neuron,
        shape: config.shape.name,
        tokens: config.tokens,
        dtype: config.dtype,
        ms,
        throughput: Throughput::Gflops(flop / ms / 1e6),
        libtorch_ms: None,
    };
    // Mean time of one execution, ms, timing enough repeats after a first (loading) run.
    let device_ms = |time: &dyn Fn(i32) -> Result<Duration>| -> Result<f64> {
        let first = time(1)?;
        Ok(time(repeats(first))?.as_secs_f64() * 1e3)
    };
    let expert_flop = 6.0 * tf * kf * hf * if_;
    let mut rows = Vec::new();
    let registered = |kernel: Kernel| registered(kernel) && config.rows.shows(kernel.name());
    if registered(Kernel::RouterTopk) {
        let call = layer.inputs.router_topk()?;
        let ms = device_ms(&|repeat| neuron.time_router_topk(&call, repeat))?;
        rows.push(row("router_topk", ms, 2.0 * tf * hf * ef));
    }
    if registered(Kernel::BlockwiseMm) {
        let call = layer.blockwise_mm()?;
        let ms = device_ms(&|repeat| neuron.time_blockwise_mm(&call, repeat))?;
        rows.push(row("blockwise_mm", ms, expert_flop));
    }
    if registered(Kernel::BlockwiseMmBwd) {
        let call = layer.blockwise_mm_bwd()?;
        let ms = device_ms(&|repeat| neuron.time_blockwise_mm_bwd(&call, repeat))?;
        rows.push(row("blockwise_mm_bwd", ms, 2.0 * expert_flop));
    }
    Ok(BenchResult {
        rows,
        peers: Vec::new(),
    })
}

/// The libtorch paths for the same layer, timed in this run.
#[cfg(feature = "libtorch")]
fn peers(layer: &Layer, min_time: Duration) -> Result<Vec<PeerPath>> {
    libtorch::measure(&layer.inputs, &layer.routed, min_time)
}

/// Without the `libtorch` feature no peer is measured.
#[cfg(not(feature = "libtorch"))]
fn peers(_layer: &Layer, _min_time: Duration) -> Result<Vec<PeerPath>> {
    Ok(Vec::new())
}

/// The results as the table `moekit bench` prints: moekit's rows, then the libtorch paths.
pub fn table(results: &[BenchResult], limits: &MachineLimits) -> String {
    let mut out = match limits.device {
        Device::Host => format!(
            "machine: {} threads, f32 FMA peak {:.1} GFLOP/s, stream triad {:.1} GB/s\n",
            limits.threads, limits.fma_gflops, limits.stream_gbps
        ),
        Device::NeuronCore => format!(
            "device: one Trainium2 NeuronCore-v3, bf16 peak {:.0} GFLOP/s, HBM share {:.0} GB/s \
             (documented, not measured); times are nrt_execute_repeat means\n",
            limits.fma_gflops, limits.stream_gbps
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
