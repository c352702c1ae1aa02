//! Kernel benchmarks on any backend: one MoE layer's kernels, forward and backward, at model
//! shapes, each reported as time, throughput and share of the machine's measured limit
//! ([`limits::MachineLimits`]). `moekit bench` prints these rows; `BENCHMARKS.md` records them.

pub mod limits;

use std::fmt::Write as _;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::backend::BackendKind;
use crate::contracts::*;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use limits::MachineLimits;

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
        Self::ALL
            .iter()
            .copied()
            .find(|shape| shape.name == s)
            .ok_or_else(|| {
                let known: Vec<&str> = Self::ALL.iter().map(|shape| shape.name).collect();
                Error::param(
                    "shape",
                    format!("unknown shape `{s}`; known: {}", known.join(", ")),
                )
            })
    }
}

/// What to benchmark.
#[derive(Clone, Copy, Debug)]
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
    /// Share of the machine's limit for this kind of throughput, percent.
    pub pct_of_peak: f64,
}

impl BenchRow {
    /// One JSON object with the fields `kernel`, `backend`, `shape`, `tokens`, `dtype`, `ms`,
    /// `gflops` or `gbps`, `pct_of_peak`, `libtorch_ms`, `vs_libtorch` (the last two `null`:
    /// no libtorch peer was measured in this run).
    pub fn to_json(&self) -> String {
        let (key, value) = match self.throughput {
            Throughput::Gflops(v) => ("gflops", v),
            Throughput::Gbps(v) => ("gbps", v),
        };
        format!(
            "{{\"kernel\":\"{}\",\"backend\":\"{}\",\"shape\":\"{}\",\"tokens\":{},\"dtype\":\"{}\",\"ms\":{:.4},\"{key}\":{value:.2},\"pct_of_peak\":{:.1},\"libtorch_ms\":null,\"vs_libtorch\":null}}",
            self.kernel,
            self.backend,
            self.shape,
            self.tokens,
            self.dtype,
            self.ms,
            self.pct_of_peak
        )
    }
}

/// Median time of `f` after one warm-up run, repeating for at least `min_time` and 3 runs.
fn time<T>(min_time: Duration, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    let first = Instant::now();
    f()?;
    let warm_up = first.elapsed();
    let runs = (min_time.as_secs_f64() / warm_up.as_secs_f64().max(1e-9)).ceil() as usize;
    let mut times = Vec::with_capacity(runs.max(3));
    for _ in 0..runs.clamp(3, 1000) {
        let start = Instant::now();
        f()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Deterministic pseudo-random values uniform in `[-scale, scale)`.
fn uniform(len: usize, scale: f32, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn float_tensor(shape: &[usize], values: Vec<f32>, dtype: DType) -> Result<Tensor> {
    let tensor = Tensor::from_f32(shape, values)?;
    Ok(if dtype == DType::BF16 {
        tensor.to_bf16()
    } else {
        tensor
    })
}

/// Runs every kernel of one MoE layer, forward and backward, and measures each.
pub fn run(config: &BenchConfig, limits: &MachineLimits) -> Result<Vec<BenchRow>> {
    let BenchConfig {
        shape,
        tokens: t,
        dtype,
        ..
    } = *config;
    let MoeShape { h, i, e, k, .. } = shape;
    if t == 0 {
        return Err(Error::param("tokens", "must be at least 1, got 0"));
    }
    let backend = config.backend.create();
    let backend = backend.as_ref();
    let scale = 1.0 / (h as f32).sqrt();
    let x_values = uniform(t * h, 1.0, 1);
    let x = float_tensor(&[t, h], x_values.clone(), dtype)?;
    let w = float_tensor(&[h, e], uniform(h * e, scale, 2), dtype)?;
    let mut padded = x_values;
    padded.extend(std::iter::repeat_n(0.0, h));
    let hidden_states = float_tensor(&[t + 1, h], padded, dtype)?;
    let gate_up = float_tensor(&[e, h, 2, i], uniform(e * h * 2 * i, scale, 3), dtype)?;
    let down = float_tensor(
        &[e, i, h],
        uniform(e * i * h, 1.0 / (i as f32).sqrt(), 4),
        dtype,
    )?;
    let d_output = float_tensor(&[t, h], uniform(t * h, 1.0, 5), dtype)?;

    let mut rows = Vec::new();
    let row = |kernel: &str, ms: f64, throughput: Throughput| {
        let pct_of_peak = match throughput {
            Throughput::Gflops(v) => 100.0 * v / limits.fma_gflops,
            Throughput::Gbps(v) => 100.0 * v / limits.stream_gbps,
        };
        BenchRow {
            kernel: kernel.to_owned(),
            backend: config.backend,
            shape: shape.name,
            tokens: t,
            dtype,
            ms,
            throughput,
            pct_of_peak,
        }
    };
    let gflops = |flop: f64, ms: f64| Throughput::Gflops(flop / ms / 1e6);
    let gbps = |bytes: f64, ms: f64| Throughput::Gbps(bytes / ms / 1e6);
    let (tf, hf, ef, kf, if_) = (t as f64, h as f64, e as f64, k as f64, i as f64);

    let router = RouterTopk::new(
        RouterTopkInputs {
            x: &x,
            w: &w,
            bias: None,
            selection_bias: None,
        },
        RouterTopkParams {
            top_k: k,
            activation: Activation::Softmax,
            norm_topk_prob: true,
        },
    )?;
    let ms = time(config.min_time, || backend.router_topk(&router))?;
    rows.push(row("router_topk", ms, gflops(2.0 * tf * hf * ef, ms)));
    let routed = backend.router_topk(&router)?;

    let d_topk = Tensor::from_f32([t, k], uniform(t * k, 1.0, 6))?;
    let router_bwd = RouterTopkBwd::new(
        RouterTopkBwdInputs {
            x: &x,
            w: &w,
            router_logits: &routed.router_logits,
            expert_index: &routed.expert_index,
            d_topk_affinities: &d_topk,
            d_router_logits: None,
        },
        RouterTopkBwdParams {
            activation: Activation::Softmax,
            norm_topk_prob: true,
        },
    )?;
    let ms = time(config.min_time, || backend.router_topk_bwd(&router_bwd))?;
    rows.push(row("router_topk_bwd", ms, gflops(4.0 * tf * hf * ef, ms)));

    let lbl = LoadBalancingLoss::new(LoadBalancingLossInputs {
        router_logits: &routed.router_logits,
        expert_index: &routed.expert_index,
    })?;
    let ms = time(config.min_time, || backend.load_balancing_loss(&lbl))?;
    rows.push(row(
        "load_balancing_loss",
        ms,
        gbps(tf * (ef + kf) * 4.0, ms),
    ));
    let d_aux = Tensor::from_f32([1], vec![1.0])?;
    let lbl_bwd = LoadBalancingLossBwd::new(LoadBalancingLossBwdInputs {
        router_logits: &routed.router_logits,
        expert_index: &routed.expert_index,
        d_aux_loss: &d_aux,
    })?;
    let ms = time(config.min_time, || {
        backend.load_balancing_loss_bwd(&lbl_bwd)
    })?;
    rows.push(row(
        "load_balancing_loss_bwd",
        ms,
        gbps(tf * (2.0 * ef + kf) * 4.0, ms),
    ));

    let permute = Permute::new(
        PermuteInputs {
            expert_index: &routed.expert_index,
            topk_affinities: &routed.topk_affinities,
        },
        PermuteParams {
            num_experts: e,
            block_size: config.block_size,
        },
    )?;
    let ms = time(config.min_time, || backend.permute(&permute))?;
    let PermuteDims { n, b, .. } = permute.dims();
    let plan_bytes = tf * kf * 8.0 + (n * b + n + e) as f64 * 4.0 + (tf + 1.0) * ef * 4.0;
    rows.push(row("permute", ms, gbps(plan_bytes, ms)));
    let plan = backend.permute(&permute)?;

    let inputs = BlockwiseMmInputs {
        hidden_states: &hidden_states,
        expert_affinities_masked: &plan.expert_affinities_masked,
        gate_up_proj_weight: &gate_up,
        down_proj_weight: &down,
        token_position_to_id: &plan.token_position_to_id,
        block_to_expert: &plan.block_to_expert,
    };
    let forward = BlockwiseMm::new(
        inputs,
        BlockwiseMmParams {
            checkpoint_activations: true,
        },
    )?;
    let ms = time(config.min_time, || backend.blockwise_mm(&forward))?;
    let expert_flop = 6.0 * tf * kf * hf * if_;
    rows.push(row("blockwise_mm", ms, gflops(expert_flop, ms)));
    let checkpoints = backend.blockwise_mm(&forward)?;
    let (Some(gate_up_t), Some(down_act)) = (
        &checkpoints.gate_up_activations_t,
        &checkpoints.down_activations,
    ) else {
        return Err(Error::invalid(
            "blockwise_mm",
            "checkpoints were requested but not returned",
        ));
    };
    let backward = BlockwiseMmBwd::new(BlockwiseMmBwdInputs {
        forward: inputs,
        gate_up_activations_t: gate_up_t,
        down_activations: down_act,
        output_hidden_states_grad: &d_output,
        expert_index: Some(&routed.expert_index),
    })?;
    let ms = time(config.min_time, || backend.blockwise_mm_bwd(&backward))?;
    rows.push(row("blockwise_mm_bwd", ms, gflops(2.0 * expert_flop, ms)));

    let permute_bwd = PermuteBwd::new(
        PermuteBwdInputs {
            expert_index: &routed.expert_index,
            expert_affinities_masked_grad: &plan.expert_affinities_masked,
        },
        PermuteBwdParams { num_experts: e },
    )?;
    let ms = time(config.min_time, || backend.permute_bwd(&permute_bwd))?;
    rows.push(row("permute_bwd", ms, gbps(tf * kf * 12.0, ms)));

    // The whole layer: every kernel above once, forward and backward.
    let layer_ms: f64 = rows.iter().map(|r| r.ms).sum();
    let layer_flop = expert_flop * 3.0 + 6.0 * tf * hf * ef;
    rows.push(row(
        "moe_layer_fwd_bwd",
        layer_ms,
        gflops(layer_flop, layer_ms),
    ));
    Ok(rows)
}

/// The rows as the table `moekit bench` prints.
pub fn table(rows: &[BenchRow], limits: &MachineLimits) -> String {
    let mut out = format!(
        "machine: {} threads, f32 FMA peak {:.1} GFLOP/s, stream triad {:.1} GB/s\n",
        limits.threads, limits.fma_gflops, limits.stream_gbps
    );
    let _ = writeln!(
        out,
        "{:<24} {:<9} {:<16} {:>6} {:<5} {:>10} {:>14} {:>8}",
        "kernel", "backend", "shape", "T", "dtype", "ms", "throughput", "% peak"
    );
    for r in rows {
        let throughput = match r.throughput {
            Throughput::Gflops(v) => format!("{v:.1} GFLOP/s"),
            Throughput::Gbps(v) => format!("{v:.1} GB/s"),
        };
        let _ = writeln!(
            out,
            "{:<24} {:<9} {:<16} {:>6} {:<5} {:>10.3} {:>14} {:>7.1}%",
            r.kernel, r.backend, r.shape, r.tokens, r.dtype, r.ms, throughput, r.pct_of_peak
        );
    }
    out
}
