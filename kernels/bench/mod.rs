//! Kernel benchmarks on any backend: one MoE layer's kernels, forward and backward, at model
//! shapes, each reported as time, throughput and share of the machine's measured limit
//! ([`limits::MachineLimits`]). `moekit bench` prints these rows; `BENCHMARKS.md` records them.

pub mod exchange;
#[cfg(feature = "libtorch")]
pub mod libtorch;
pub mod limits;

use std::fmt::Write as _;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::backends::BackendKind;
use crate::contracts::*;
use crate::error::{Error, Result, find_named};
use crate::kernel::Kernel;
use crate::neuron::manifest::Manifest;
use crate::neuron::{NeuronBackend, NeuronConfig};
use crate::random::SplitMix64;
use crate::tensor::{DType, Tensor, try_capacity};
use limits::{Device, MachineLimits};

/// An MoE layer's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeShape {
    pub name: &'static str,
    pub h: usize,
    pub i: usize,
    pub e: usize,
    pub k: usize,
}

impl MoeShape {
    /// The shapes benchmarks know by name.
    pub const ALL: &'static [MoeShape] = &[
        MoeShape {
            name: "tiny",
            h: 64,
            i: 32,
            e: 8,
            k: 2,
        },
        // The MoE layer of the trainer's benchmark config (configs/qwen3_moe_small.toml).
        MoeShape {
            name: "qwen3-moe-small",
            h: 256,
            i: 128,
            e: 32,
            k: 4,
        },
        MoeShape {
            name: "qwen3-30b-a3b",
            h: 2048,
            i: 768,
            e: 128,
            k: 8,
        },
        MoeShape {
            name: "qwen3-235b-a22b",
            h: 4096,
            i: 1536,
            e: 128,
            k: 8,
        },
    ];
}

impl FromStr for MoeShape {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        find_named(Self::ALL, |shape| shape.name, s)
            .map_err(|known| Error::param("shape", format!("unknown shape `{s}`; known: {known}")))
    }
}

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

/// Deterministic pseudo-random values uniform in `[-scale, scale)` for the benchmark input
/// `name` of `shape`, or the error naming it when they cannot be allocated.
fn uniform(name: &str, shape: &[usize], scale: f32, seed: u64) -> Result<Vec<f32>> {
    let mut values = try_capacity(&format!("benchmark input `{name}`"), shape)?;
    let mut rng = SplitMix64::new(seed);
    let scale = f64::from(scale);
    values.extend((0..shape.iter().product()).map(|_| rng.uniform(-scale, scale) as f32));
    Ok(values)
}

fn float_tensor(shape: &[usize], values: Vec<f32>, dtype: DType) -> Result<Tensor> {
    let tensor = Tensor::from_f32(shape, values)?;
    Ok(if dtype == DType::BF16 {
        tensor.to_bf16()
    } else {
        tensor
    })
}

/// One MoE layer's inputs at a benchmark shape: deterministic activations, weights and
/// gradients.
pub struct LayerInputs {
    pub shape: MoeShape,
    pub block_size: usize,
    pub x: Tensor,
    pub w: Tensor,
    pub hidden_states: Tensor,
    pub gate_up_proj_weight: Tensor,
    pub down_proj_weight: Tensor,
    pub d_topk_affinities: Tensor,
    pub d_aux_loss: Tensor,
    pub output_hidden_states_grad: Tensor,
}

impl LayerInputs {
    pub fn new(shape: MoeShape, tokens: usize, dtype: DType, block_size: usize) -> Result<Self> {
        Self::seeded(shape, tokens, dtype, block_size, 0)
    }

    /// As [`LayerInputs::new`], with values drawn from stream `seed` (`new` is seed 0).
    pub fn seeded(
        shape: MoeShape,
        tokens: usize,
        dtype: DType,
        block_size: usize,
        seed: u64,
    ) -> Result<Self> {
        let MoeShape { h, i, e, k, .. } = shape;
        let uniform = |name, shape: &[usize], scale, stream: u64| {
            uniform(name, shape, scale, seed.wrapping_mul(16) + stream)
        };
        let t = tokens;
        if t == 0 {
            return Err(Error::param("tokens", "must be at least 1, got 0"));
        }
        let scale = 1.0 / (h as f32).sqrt();
        let x_values = uniform("x", &[t, h], 1.0, 1)?;
        // hidden_states [T+1, H]: x, then the zero padding row (T+1 cannot overflow: x holds
        // T rows).
        let padded = with_padding_row("hidden_states", &x_values, [t, h])?;
        let output_grad = uniform("output_hidden_states_grad", &[t, h], 1.0, 5)?;
        Ok(Self {
            shape,
            block_size,
            x: float_tensor(&[t, h], x_values, dtype)?,
            w: float_tensor(&[h, e], uniform("w", &[h, e], scale, 2)?, dtype)?,
            hidden_states: float_tensor(&[t + 1, h], padded, dtype)?,
            gate_up_proj_weight: float_tensor(
                &[e, h, 2, i],
                uniform("gate_up_proj_weight", &[e, h, 2, i], scale, 3)?,
                dtype,
            )?,
            down_proj_weight: float_tensor(
                &[e, i, h],
                uniform("down_proj_weight", &[e, i, h], 1.0 / (i as f32).sqrt(), 4)?,
                dtype,
            )?,
            d_topk_affinities: Tensor::from_f32(
                [t, k],
                uniform("d_topk_affinities", &[t, k], 1.0, 6)?,
            )?,
            d_aux_loss: Tensor::from_f32([1], vec![1.0])?,
            output_hidden_states_grad: float_tensor(
                &[t + 1, h],
                with_padding_row("output_hidden_states_grad", &output_grad, [t, h])?,
                dtype,
            )?,
        })
    }

    pub fn router_topk(&self) -> Result<RouterTopk<'_>> {
        RouterTopk::new(
            RouterTopkInputs {
                x: &self.x,
                w: &self.w,
                w_bias: None,
                selection_bias: None,
            },
            RouterTopkParams {
                k: self.shape.k,
                pipeline: RouterPipeline::QWEN3_MOE,
            },
        )
    }
}

/// `rows [T, H]` followed by the zero padding row T, as the blockwise kernels' `[T+1, H]`
/// tensors hold them (T+1 rows cannot overflow: `rows` holds T).
fn with_padding_row(name: &str, rows: &[f32], [t, h]: [usize; 2]) -> Result<Vec<f32>> {
    let mut padded = try_capacity(&format!("benchmark input `{name}`"), &[t + 1, h])?;
    padded.extend_from_slice(rows);
    padded.extend(std::iter::repeat_n(0.0, h));
    Ok(padded)
}

fn permute_call<'a>(routed: &'a RouterTopkOutputs, inputs: &LayerInputs) -> Result<Permute<'a>> {
    Permute::new(
        PermuteInputs {
            expert_index: &routed.expert_index,
            topk_affinities: &routed.topk_affinities,
        },
        PermuteParams::new(inputs.shape.e, inputs.block_size),
    )
}

fn blockwise_inputs<'a>(
    inputs: &'a LayerInputs,
    plan: &'a PermuteOutputs,
) -> BlockwiseMmInputs<'a> {
    BlockwiseMmInputs {
        hidden_states: &inputs.hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: &inputs.gate_up_proj_weight,
        down_proj_weight: &inputs.down_proj_weight,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
        gate_and_up_proj_bias: None,
        down_proj_bias: None,
    }
}

/// The forward with checkpoints, as training runs it.
fn blockwise_call<'a>(
    inputs: &'a LayerInputs,
    plan: &'a PermuteOutputs,
) -> Result<BlockwiseMm<'a>> {
    BlockwiseMm::new(
        blockwise_inputs(inputs, plan),
        BlockwiseMmParams {
            checkpoint_activation: true,
            ..BlockwiseMmParams::default()
        },
    )
}

/// A routed layer: its inputs plus the router outputs, block plan and checkpoints that the
/// later kernels consume, so each kernel can be called on its own.
pub struct Layer {
    pub inputs: LayerInputs,
    pub routed: RouterTopkOutputs,
    pub plan: PermuteOutputs,
    pub checkpoints: BlockwiseMmOutputs,
}

impl Layer {
    /// Runs the forward kernels once on `backend` to route `inputs`.
    pub fn new(backend: &dyn crate::Backend, inputs: LayerInputs) -> Result<Self> {
        let routed = backend.router_topk(&inputs.router_topk()?)?;
        let plan = backend.permute(&permute_call(&routed, &inputs)?)?;
        let checkpoints = backend.blockwise_mm(&blockwise_call(&inputs, &plan)?)?;
        Ok(Self {
            inputs,
            routed,
            plan,
            checkpoints,
        })
    }

    pub fn router_topk_bwd(&self) -> Result<RouterTopkBwd<'_>> {
        RouterTopkBwd::new(
            RouterTopkBwdInputs {
                x: &self.inputs.x,
                w: &self.inputs.w,
                router_logits: &self.routed.router_logits,
                expert_index: &self.routed.expert_index,
                d_topk_affinities: &self.inputs.d_topk_affinities,
                d_router_logits: None,
            },
            RouterTopkBwdParams {
                pipeline: RouterPipeline::QWEN3_MOE,
            },
        )
    }

    pub fn load_balancing_loss(&self) -> Result<LoadBalancingLoss<'_>> {
        LoadBalancingLoss::new(LoadBalancingLossInputs {
            router_logits: &self.routed.router_logits,
            expert_index: &self.routed.expert_index,
        })
    }

    pub fn load_balancing_loss_bwd(&self) -> Result<LoadBalancingLossBwd<'_>> {
        LoadBalancingLossBwd::new(LoadBalancingLossBwdInputs {
            router_logits: &self.routed.router_logits,
            expert_index: &self.routed.expert_index,
            d_aux_loss: &self.inputs.d_aux_loss,
        })
    }

    pub fn permute(&self) -> Result<Permute<'_>> {
        permute_call(&self.routed, &self.inputs)
    }

    pub fn permute_bwd(&self) -> Result<PermuteBwd<'_>> {
        PermuteBwd::new(
            PermuteBwdInputs {
                expert_index: &self.routed.expert_index,
                expert_affinities_masked_grad: &self.plan.expert_affinities_masked,
            },
            PermuteBwdParams::new(self.inputs.shape.e),
        )
    }

    pub fn blockwise_mm(&self) -> Result<BlockwiseMm<'_>> {
        blockwise_call(&self.inputs, &self.plan)
    }

    /// The routing table of this layer's routing over `ranks` expert-parallel ranks.
    pub fn a2av_routing(&self, ranks: usize) -> Result<A2avRouting<'_>> {
        A2avRouting::new(
            A2avRoutingInputs {
                expert_index: &self.routed.expert_index,
            },
            A2avRoutingParams {
                num_experts: self.inputs.shape.e,
                expert_parallel_degree: ranks,
            },
        )
    }

    pub fn blockwise_mm_bwd(&self) -> Result<BlockwiseMmBwd<'_>> {
        let missing = || Error::invalid("blockwise_mm", "checkpoints were not returned");
        BlockwiseMmBwd::new(
            BlockwiseMmBwdInputs {
                forward: blockwise_inputs(&self.inputs, &self.plan),
                gate_up_proj_act_checkpoint_t: self
                    .checkpoints
                    .gate_up_activations_t
                    .as_ref()
                    .ok_or_else(missing)?,
                down_proj_act_checkpoint: self
                    .checkpoints
                    .down_activations
                    .as_ref()
                    .ok_or_else(missing)?,
                output_hidden_states_grad: &self.inputs.output_hidden_states_grad,
                expert_index: Some(&self.routed.expert_index),
            },
            BlockwiseMmBwdParams::default(),
        )
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
