//! `moekit-train bench`: training throughput of each MoE implementation on one job config, in
//! one process, against the machine's measured f32 FMA peak.
//!
//! Every implementation gets its own trainer from the same config and seed. Steps are taken
//! round-robin (one step of each implementation in turn), so slow drifts of a shared machine
//! affect all of them alike; each reports the median step time after its warmup steps.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use moekit_tools::bench::limits::MachineLimits;
use moekit_tools::bench::median;
use moekit_tools::machine::Host;
use serde::Serialize;

use crate::config::JobConfig;
use crate::model::ModelConfig;
use crate::moe::MoeImpl;
use crate::train::{StepPhases, Trainer};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub impls: Vec<MoeImpl>,
    /// Untimed steps first (allocator and cache warmup).
    pub warmup: usize,
    /// Timed steps per implementation.
    pub steps: usize,
}

/// One implementation's throughput.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub moe: &'static str,
    /// Median milliseconds per optimizer step.
    pub step_ms: f64,
    pub tokens_per_second: f64,
    /// Model FLOP/s (forward + backward) as a share of the measured f32 FMA peak.
    pub pct_of_peak: f64,
    /// Loss of the last step (the implementations train the same model on the same data).
    pub last_loss: f64,
    /// Throughput relative to `torch` and `grouped_mm` when they were measured.
    pub vs_torch: Option<f64>,
    pub vs_grouped_mm: Option<f64>,
    /// Median milliseconds of each phase of a step ([`StepPhases`]), each its own median.
    pub phases_ms: PhasesMs,
}

/// Median milliseconds per step of each of [`StepPhases`]' phases.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PhasesMs {
    pub forward: f64,
    pub backward: f64,
    pub clip: f64,
    pub optimizer: f64,
}

impl PhasesMs {
    /// Each phase's median over `steps`.
    fn median_of(steps: &[StepPhases]) -> Self {
        let phase = |of: fn(&StepPhases) -> Duration| {
            median(steps.iter().map(|s| of(s).as_secs_f64() * 1e3).collect())
        };
        Self {
            forward: phase(|s| s.forward),
            backward: phase(|s| s.backward),
            clip: phase(|s| s.clip),
            optimizer: phase(|s| s.optimizer),
        }
    }
}

/// Training FLOPs per token (forward + backward = 3 × forward): `6 · active matmul
/// parameters + 12 · layers · heads · head_dim · seq_len` (attention scores and values), with
/// each MoE layer's experts counted `K / E` (only the chosen ones run).
pub fn flops_per_token(model: &ModelConfig, seq_len: usize) -> f64 {
    let layers = model.matrix_params(model.num_experts_per_tok);
    let head = (model.hidden_size * model.vocab_size) as u128;
    let attention_scores = 12.0
        * (model.num_hidden_layers * model.num_attention_heads * model.head_dim * seq_len) as f64;
    6.0 * (layers + head) as f64 + attention_scores
}

/// Measures every implementation of `options` on `config` (checkpointing off).
pub fn bench(config: &JobConfig, options: &BenchOptions) -> Result<(MachineLimits, Vec<BenchRow>)> {
    ensure!(options.steps > 0, "bench.steps must be at least 1");
    ensure!(
        !options.impls.is_empty(),
        "bench.impls names no implementation"
    );
    let total = options
        .warmup
        .checked_add(options.steps)
        .context("bench.warmup + bench.steps overflows")?;
    let limits = MachineLimits::measure();
    let mut trainers = options
        .impls
        .iter()
        .map(|&moe| {
            let mut config = config.clone();
            config.kernels.moe = moe;
            config.checkpoint.enable = false;
            // Steps only: no validation forwards inside the timed steps.
            config.data.validation_files.clear();
            config.data.validation_fraction = 0.0;
            config.training.steps = total;
            config.lr_scheduler.warmup_steps = config.lr_scheduler.warmup_steps.min(total);
            Trainer::new(&config, None)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut times = vec![Vec::new(); trainers.len()];
    let mut phases = vec![Vec::new(); trainers.len()];
    let mut last_loss = vec![0.0; trainers.len()];
    for step in 0..total {
        let measured = trainers
            .iter_mut()
            .zip(&mut times)
            .zip(&mut phases)
            .zip(&mut last_loss);
        for (((trainer, times), phases), loss) in measured {
            let start = Instant::now();
            let metrics = trainer.step()?;
            if step >= options.warmup {
                times.push(start.elapsed().as_secs_f64() * 1e3);
                phases.push(metrics.phases);
            }
            *loss = metrics.loss;
        }
    }
    let limits = limits.max(MachineLimits::measure());
    let training = &config.training;
    let tokens =
        (training.batch_size * training.seq_len * training.gradient_accumulation_steps) as f64;
    let flops = flops_per_token(&config.model, training.seq_len);
    let mut rows: Vec<BenchRow> = options
        .impls
        .iter()
        .zip(times)
        .zip(phases)
        .zip(last_loss)
        .map(|(((moe, times), phases), last_loss)| {
            let step_ms = median(times);
            let tokens_per_second = tokens / (step_ms / 1e3);
            BenchRow {
                moe: moe.name(),
                step_ms,
                tokens_per_second,
                pct_of_peak: 100.0 * tokens_per_second * flops / (limits.fma_gflops * 1e9),
                last_loss,
                vs_torch: None,
                vs_grouped_mm: None,
                phases_ms: PhasesMs::median_of(&phases),
            }
        })
        .collect();
    let rate = |name: &str, rows: &[BenchRow]| {
        rows.iter()
            .find(|r| r.moe == name)
            .map(|r| r.tokens_per_second)
    };
    let (torch, grouped) = (rate("torch", &rows), rate("grouped_mm", &rows));
    for row in &mut rows {
        row.vs_torch = torch.map(|t| row.tokens_per_second / t);
        row.vs_grouped_mm = grouped.map(|g| row.tokens_per_second / g);
    }
    Ok((limits, rows))
}

/// The table `moekit-train bench` prints.
pub fn table(limits: &MachineLimits, rows: &[BenchRow]) -> String {
    let ratio = |r: Option<f64>| r.map_or("-".to_owned(), |r| format!("{r:.2}x"));
    let host = Host::describe();
    let mut out = format!(
        "machine: {}, {} threads, f32 FMA peak {:.0} GFLOP/s, stream {:.1} GB/s\n{}\n\
         {:<12} {:>10} {:>10} {:>9} {:>9} {:>12} {:>10}\n",
        host.model,
        limits.threads,
        limits.fma_gflops,
        limits.stream_gbps,
        host.kernels_line(),
        "moe",
        "ms/step",
        "tok/s",
        "% peak",
        "x torch",
        "x grouped_mm",
        "last loss"
    );
    for row in rows {
        out.push_str(&format!(
            "{:<12} {:>10.1} {:>10.0} {:>8.1}% {:>9} {:>12} {:>10.4}\n",
            row.moe,
            row.step_ms,
            row.tokens_per_second,
            row.pct_of_peak,
            ratio(row.vs_torch),
            ratio(row.vs_grouped_mm),
            row.last_loss
        ));
    }
    out.push_str(&format!(
        "median ms per phase:\n{:<12} {:>10} {:>10} {:>9} {:>9}\n",
        "moe", "forward", "backward", "clip", "AdamW"
    ));
    for row in rows {
        let p = &row.phases_ms;
        out.push_str(&format!(
            "{:<12} {:>10.1} {:>10.1} {:>9.1} {:>9.1}\n",
            row.moe, p.forward, p.backward, p.clip, p.optimizer
        ));
    }
    out
}
