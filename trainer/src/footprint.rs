//! The host memory a training step ([`StepFootprint`]) or an evaluation
//! ([`evaluation_bytes`]) needs, estimated before anything is allocated, and the limit it is
//! checked against ([`host_memory_limit`]), so that work that cannot fit is refused with the
//! estimate in the message instead of growing until libtorch's allocator fails.
//!
//! Activations are what autograd keeps for the backward pass, per token of a micro-batch
//! (`training.batch_size × training.seq_len` tokens on each rank), counted tensor by tensor
//! from the model's forward ([`crate::model`]): attention runs through
//! `scaled_dot_product_attention`, whose CPU kernel keeps no `[S, S]` scores, so every term is
//! linear in the tokens. One more layer's worth covers the gradients the backward holds while
//! it walks a layer. The peaks measured on the debug and small configs (trainer/README.md)
//! lie 5–23% below the estimate, which leaves out only libtorch's own ~120 MB.

use anyhow::{Result, ensure};
use moekit::BackendKind;

use crate::config::{JobConfig, ParamDtype};
use crate::model::ModelConfig;

/// Bytes of an f32.
const F32: u128 = 4;
/// Bytes of an i32.
const I32: u128 = 4;
/// Bytes of an f64.
const F64: u128 = 8;

/// A step's peak host memory, by what holds it (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepFootprint {
    /// The parameters this process holds, their gradients and AdamW state (with f32 master
    /// copies for bf16 training).
    pub state: u128,
    /// What autograd keeps of the decoder layers for the backward, plus one layer's gradients.
    pub activations: u128,
    /// The `[tokens, vocab_size]` logits in the training dtype and in f32, their log-softmax
    /// and its gradient.
    pub logits: u128,
    /// moekit's kernels (`kernels.moe` reference, cpu or neuron) lay each expert's tokens out in
    /// blocks of `kernels.block_size` slots: up to E blocks of padding per MoE layer, each
    /// slot kept like a token's copy.
    pub block_padding: u128,
}

/// Bytes a token's activations take in each kind of decoder layer, with activations of
/// `act` bytes (the training dtype's).
struct LayerBytes {
    /// The embedding output and the final norm, outside the layers.
    outside: u128,
    /// The attention block (with its norm).
    attention: u128,
    /// An MoE block (with its norm).
    moe: u128,
    /// A dense MLP block (with its norm).
    dense: u128,
    /// One of the K copies of a token in the experts, or one padding slot of a block.
    slot: u128,
    moe_layers: u128,
    dense_layers: u128,
}

impl LayerBytes {
    fn of(model: &ModelConfig, act: u128) -> Self {
        let h = model.hidden_size as u128;
        let q = model.num_attention_heads as u128 * model.head_dim as u128;
        let kv = model.num_key_value_heads as u128 * model.head_dim as u128;
        let (e, k, i) = (
            model.num_experts as u128,
            model.num_experts_per_tok as u128,
            model.moe_intermediate_size as u128,
        );
        // An RMSNorm keeps its input, its f32 copy and the normalised f32 values.
        let norm = |width: u128| width * (act + 2 * F32);
        // q, k, v projections; q_norm and k_norm; RoPE (the rotated halves); k and v repeated
        // to every head; the attention output and its o_proj input; the log-sum-exp per head.
        let attention = norm(h)
            + (q + 2 * kv) * act
            + norm(q + kv)
            + 2 * (q + kv) * act
            + 2 * q * act
            + 2 * q * act
            + model.num_attention_heads as u128 * F32;
        // The router's f32 logits, probabilities and top-K; each of the K copies of a token:
        // its gathered row, gate_up, the activation's inputs and output, down's output (the
        // moekit kernels keep these in f32 whatever the dtype).
        let slot = (2 * h + 5 * i) * F32;
        let moe_layers = model.moe_layer_count() as u128;
        Self {
            outside: h * act + norm(h),
            attention,
            moe: norm(h) + 3 * e * F32 + k * slot + h * act,
            dense: norm(h) + 4 * model.intermediate_size as u128 * act + h * act,
            slot,
            moe_layers,
            dense_layers: model.num_hidden_layers as u128 - moe_layers,
        }
    }

    /// The largest layer there is.
    fn widest(&self) -> u128 {
        let moe = if self.moe_layers > 0 { self.moe } else { 0 };
        let dense = if self.dense_layers > 0 { self.dense } else { 0 };
        self.attention + moe.max(dense)
    }

    /// Every layer's, as autograd keeps them all for the backward.
    fn all(&self) -> u128 {
        (self.moe_layers + self.dense_layers) * self.attention
            + self.moe_layers * self.moe
            + self.dense_layers * self.dense
    }
}

impl StepFootprint {
    /// The footprint of one micro-batch of `config` on a process of an `ranks`-way expert
    /// parallel run (1 without one).
    pub fn of(config: &JobConfig, ranks: usize) -> Self {
        let model = &config.model;
        let act = config.training.dtype.kind().elt_size_in_bytes() as u128;
        let tokens = config.training.batch_size as u128 * config.training.seq_len as u128;
        let layers = LayerBytes::of(model, act);
        let per_token = layers.all() + layers.widest() + layers.outside;
        let vocab = model.vocab_size as u128;
        let padding_slots = match config.kernels.moe.kernel_backend() {
            Some(_) => {
                layers.moe_layers * model.num_experts as u128 * config.kernels.block_size as u128
            }
            None => 0,
        };
        Self {
            state: state_bytes(config, ranks),
            activations: tokens.saturating_mul(per_token),
            logits: tokens.saturating_mul(vocab * (act + 3 * F32)),
            block_padding: padding_slots.saturating_mul(layers.slot),
        }
    }

    /// The whole estimate.
    pub fn total(&self) -> u128 {
        self.state
            .saturating_add(self.activations)
            .saturating_add(self.logits)
            .saturating_add(self.block_padding)
    }

    /// "parameters, gradients and AdamW state 1.2 GiB, activations 3.4 GiB, logits 0.5 GiB",
    /// then ", MoE block padding 0.1 GiB" where there is any.
    pub fn describe(&self) -> String {
        let mut parts = format!(
            "parameters, gradients and AdamW state {}, activations {}, logits {}",
            gib(self.state),
            gib(self.activations),
            gib(self.logits)
        );
        if self.block_padding > 0 {
            parts.push_str(&format!(", MoE block padding {}", gib(self.block_padding)));
        }
        parts
    }
}

/// The host memory that evaluating `tokens` tokens in one forward pass in f32 without
/// autograd takes beyond the loaded model, where each tensor is freed once the next is made:
/// the residual stream and its norm, the largest working set of a block (attention's
/// projections, RoPE'd and repeated heads and output; the experts' K copies of each token with
/// the router's f32 values, and with moekit's kernels (`kernels`: the backend and the block
/// size) one layer's E blocks of padding, each slot an i32 id on `cpu` (which without
/// checkpoints keeps only the routed rows) and also its f64 expert outputs and gate/up values on
/// `reference` (which keeps every slot's); the dense MLP's gate, up and product), and the
/// `[tokens, vocab_size]` logits with their log-softmax, plus with `output` the logits' copies
/// for the file.
pub fn evaluation_bytes(
    model: &ModelConfig,
    tokens: u128,
    output: bool,
    kernels: Option<(BackendKind, usize)>,
) -> u128 {
    let h = model.hidden_size as u128;
    let q = model.num_attention_heads as u128 * model.head_dim as u128;
    let kv = model.num_key_value_heads as u128 * model.head_dim as u128;
    let layers = LayerBytes::of(model, F32);
    let attention = (5 * q + 2 * kv) * F32;
    let moe = if layers.moe_layers > 0 {
        model.num_experts_per_tok as u128 * layers.slot + 3 * model.num_experts as u128 * F32
    } else {
        0
    };
    let dense = if layers.dense_layers > 0 {
        3 * model.intermediate_size as u128 * F32
    } else {
        0
    };
    let logits_copies = if output { 4 } else { 2 };
    let per_token = 3 * h * F32
        + attention.max(moe).max(dense)
        + logits_copies * model.vocab_size as u128 * F32;
    let padding = match kernels {
        Some((backend, b)) if layers.moe_layers > 0 => {
            let slot = match backend {
                BackendKind::Reference => I32 + (h + 2 * model.moe_intermediate_size as u128) * F64,
                _ => I32,
            };
            model.num_experts as u128 * b as u128 * slot
        }
        _ => 0,
    };
    tokens.saturating_mul(per_token).saturating_add(padding)
}

/// `bytes` in GiB, one decimal.
pub fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The parameters a process of a `ranks`-way run holds (its `1/ranks` of the experts and
/// everything else), with gradients and AdamW state.
fn state_bytes(config: &JobConfig, ranks: usize) -> u128 {
    let per_param = match config.training.dtype {
        // parameter + gradient + two moments
        ParamDtype::Float32 => 4 + 4 + 8,
        // bf16 parameter + gradient, f32 master + two moments
        ParamDtype::Bfloat16 => 2 + 2 + 12,
    };
    held_parameters(config, ranks).saturating_mul(per_param)
}

/// The parameters a process of a `ranks`-way run holds.
pub fn held_parameters(config: &JobConfig, ranks: usize) -> u128 {
    let model = &config.model;
    let expert = 3 * model.hidden_size as u128 * model.moe_intermediate_size as u128;
    let elsewhere = model.num_experts as u128 - (model.num_experts / ranks) as u128;
    model.parameter_count() - model.moe_layer_count() as u128 * elsewhere * expert
}

/// The most host memory the work about to start may take, and what sets it: the machine's
/// physical memory or the cgroup's `memory.max` (a container's limit), both totals, or what
/// the address-space limit (`ulimit -v`, `RLIMIT_AS`) leaves above the process's present
/// size, whichever is least. The totals are compared with estimates that count what the
/// process has already built (a training step's parameters) or, for evaluation, with what
/// comes on top of a model small against them. `None` where none of them can be read.
pub fn host_memory_limit() -> Option<(u128, String)> {
    let mut limits = Vec::new();
    // SAFETY: sysconf only reads system configuration values.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages > 0 && page_size > 0 {
        let physical = pages as u128 * page_size as u128;
        limits.push((
            physical,
            format!("this machine's {} of memory", gib(physical)),
        ));
    }
    if let Some(cgroup) = cgroup_memory_max() {
        limits.push((
            cgroup,
            format!("the cgroup's memory.max of {}", gib(cgroup)),
        ));
    }
    if let Some((limit, used)) = address_space() {
        let left = limit.saturating_sub(used);
        limits.push((
            left,
            format!(
                "the {} that the address-space limit of {} (ulimit -v) leaves this process",
                gib(left),
                gib(limit)
            ),
        ));
    }
    limits.into_iter().min_by_key(|&(bytes, _)| bytes)
}

/// Refuses `bytes` of host memory beyond [`host_memory_limit`], before libtorch would fail
/// allocating them; `what` says what needs them (the message goes on "… {bytes} GiB, more
/// than …").
pub fn ensure_fits_in_host_memory(bytes: u128, what: impl FnOnce() -> String) -> Result<()> {
    if let Some((limit, source)) = host_memory_limit() {
        ensure!(
            bytes <= limit,
            "{} {}, more than {source}",
            what(),
            gib(bytes)
        );
    }
    Ok(())
}

/// This process's cgroup (v2) memory limit, where one is set.
fn cgroup_memory_max() -> Option<u128> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = cgroup.lines().find_map(|line| line.strip_prefix("0::"))?;
    let max = std::fs::read_to_string(format!("/sys/fs/cgroup{path}/memory.max")).ok()?;
    max.trim().parse().ok()
}

/// The address-space limit and the process's present virtual size, where a limit is set.
fn address_space() -> Option<(u128, u128)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u128 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmSize:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some((limit.rlim_cur as u128, kib * 1024))
}
