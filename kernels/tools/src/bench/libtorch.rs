//! libtorch peers (feature `libtorch`): the same MoE layer computed the ways PyTorch runs it,
//! timed in the same process as moekit's kernels.
//!
//! - router: Hugging Face's ([`crate::torch_moe::hf_router`] on `x @ w`).
//! - decode router: Qwen3-MoE's RMSNorm (in f32, the weight applied in the input dtype), then
//!   its router, as `rmsnorm_router_topk_tkg` with SOFTMAX computes them (a softmax over all
//!   experts renormalised over the top K is a softmax over the K).
//! - permute: `argsort(stable)` of the flattened expert ids, `bincount`, `cumsum`.
//! - experts, `loop`: Hugging Face's eager path ([`crate::torch_moe::experts_loop`]), with one
//!   parameter per expert as Hugging Face's per-expert modules hold them.
//! - experts, `grouped_mm`: [`crate::torch_moe::experts_grouped_mm`].
//!
//! Forward passes run with autograd recording (as in training, so activations are saved);
//! backward times are `loss.backward()` alone.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor as Th};

use moekit::contracts::RouterTopkOutputs;
use moekit::error::{Error, Result};

use super::{PeerPath, Stage};
use crate::layer::{LayerInputs, VOCAB_TOP_K};
use crate::torch::to_tch;
use crate::torch_moe::{experts_grouped_mm, experts_loop, hf_router};

fn tch_error(err: tch::TchError) -> Error {
    Error::invalid("libtorch", err.to_string())
}

/// Median milliseconds of `f`, as [`super::time`] measures.
fn time(min_time: Duration, mut f: impl FnMut() -> Result<Th>) -> Result<f64> {
    super::time(min_time, || f().map(drop))
}

/// Median milliseconds of the backward alone, on cold caches: each run records a fresh graph
/// untimed, evicts the caches ([`super::cold::evict`]), then
/// computes the gradients of `leaves` as `torch.autograd.grad` does (returned, not accumulated
/// into `.grad`, so no run pays for a previous run's gradients).
fn time_backward(
    min_time: Duration,
    leaves: &[&Th],
    mut forward: impl FnMut() -> Result<Th>,
) -> Result<f64> {
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed() < min_time && times.len() < 1000) {
        let loss = forward()?;
        // The forward left its operands in the caches; the backward starts cold, as
        // moekit's backward kernels are timed.
        super::cold::evict();
        let t = Instant::now();
        let grads = Th::f_run_backward(&[&loss], leaves, false, false).map_err(tch_error)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        drop(grads);
    }
    Ok(super::median(times))
}

/// The layer's tensors in libtorch, weights split for the loop and fused for `_grouped_mm`.
struct Operands {
    k: i64,
    x: Th,
    w: Th,
    /// `[1, H]`, the RMSNorm's weight.
    gamma: Th,
    /// `[E, H, 2, I]`.
    gate_up: Th,
    /// Per-expert `[H, I]`, `[H, I]`, `[I, H]` leaf tensors, as Hugging Face's per-expert
    /// modules hold them (one parameter per expert, so no expert's gradient touches another's).
    experts: Vec<[Th; 3]>,
    /// `[E, I, H]`.
    down: Th,
    /// `[T, K]` int64 and float.
    expert_index: Th,
    topk: Th,
    d_topk: Th,
    d_output: Th,
}

impl Operands {
    fn new(inputs: &LayerInputs, routed: &RouterTopkOutputs) -> Self {
        let e = inputs.shape.e as i64;
        let grad = |t: Th| t.set_requires_grad(true);
        let gate_up4 = to_tch(&inputs.gate_up_proj_weight); // [E, H, 2, I]
        let down = to_tch(&inputs.down_proj_weight); // [E, I, H]
        let dtype = gate_up4.kind();
        Self {
            k: inputs.shape.k as i64,
            x: grad(to_tch(&inputs.x)),
            w: grad(to_tch(&inputs.w)),
            gamma: grad(to_tch(&inputs.gamma)),
            experts: (0..e)
                .map(|expert| {
                    [
                        grad(gate_up4.get(expert).select(1, 0).copy()),
                        grad(gate_up4.get(expert).select(1, 1).copy()),
                        grad(down.get(expert).copy()),
                    ]
                })
                .collect(),
            gate_up: grad(gate_up4),
            down: grad(down),
            expert_index: to_tch(&routed.expert_index).to_kind(Kind::Int64),
            topk: grad(to_tch(&routed.topk_affinities).to_kind(dtype)),
            d_topk: to_tch(&inputs.d_topk_affinities),
            // `[T+1, H]` without its padding row.
            d_output: to_tch(&inputs.output_hidden_states_grad).narrow(
                0,
                0,
                inputs.x.shape()[0] as i64,
            ),
        }
    }

    /// Hugging Face's router: normalised top-k affinities `[T, K]`.
    fn router(&self) -> Result<Th> {
        let logits = self.x.f_matmul(&self.w).map_err(tch_error)?;
        Ok(hf_router(&logits, self.k, true, None).0)
    }

    /// Qwen3-MoE's decoder-layer RMSNorm (`Qwen3MoeRMSNorm`, eps 1e-6) and router: the
    /// normalised top-k affinities `[T, K]`.
    fn decode_router(&self) -> Result<Th> {
        let x = self.x.to_kind(Kind::Float);
        let mean_square = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = (x * (mean_square + 1e-6).rsqrt()).to_kind(self.x.kind()) * &self.gamma;
        let logits = normed.f_matmul(&self.w).map_err(tch_error)?;
        Ok(hf_router(&logits, self.k, true, None).0)
    }

    /// `argsort` of the flattened ids, and the per-expert offsets.
    fn permute(&self, experts: i64) -> (Th, Th) {
        let flat = self.expert_index.flatten(0, 1);
        let order = flat.argsort_stable(true, 0, false);
        let offsets = flat.bincount(None::<Th>, experts).cumsum(0, Kind::Int);
        (order, offsets)
    }

    /// Hugging Face's eager experts: `[T, H]`.
    fn experts_loop(&self, experts: i64) -> Result<Th> {
        let projections = |expert: i64| {
            let [gate, up, down] = &self.experts[expert as usize];
            (
                gate.shallow_clone(),
                up.shallow_clone(),
                down.shallow_clone(),
            )
        };
        experts_loop(
            &self.x,
            &self.expert_index,
            &self.topk,
            experts,
            projections,
        )
        .map_err(tch_error)
    }

    /// Sorted tokens through `torch._grouped_mm`: `[T, H]`.
    fn experts_grouped(&self, _experts: i64) -> Result<Th> {
        experts_grouped_mm(
            &self.x,
            &self.expert_index,
            &self.topk,
            &self.gate_up,
            &self.down,
        )
        .map_err(tch_error)
    }
}

type ExpertPath = fn(&Operands, i64) -> Result<Th>;

/// The leaf tensors a path differentiates: the activations, the affinities and its weights.
type Leaves = fn(&Operands) -> Vec<&Th>;

const EXPERT_PATHS: [(&str, ExpertPath, Leaves); 2] = [
    ("experts: loop (HF eager)", Operands::experts_loop, |ops| {
        let mut leaves = vec![&ops.x, &ops.topk];
        leaves.extend(ops.experts.iter().flatten());
        leaves
    }),
    (
        "experts: torch._grouped_mm",
        Operands::experts_grouped,
        |ops| vec![&ops.x, &ops.topk, &ops.gate_up, &ops.down],
    ),
];

/// Times every peer path of the `wanted` stages on the layer's inputs and the routing moekit
/// chose. An expert path this libtorch build does not support on this device is left out.
pub fn measure(
    inputs: &LayerInputs,
    routed: &RouterTopkOutputs,
    min_time: Duration,
    wanted: &dyn Fn(Stage) -> bool,
) -> Result<Vec<PeerPath>> {
    let ops = Operands::new(inputs, routed);
    let e = inputs.shape.e as i64;
    let mut paths = Vec::new();
    if wanted(Stage::Router) {
        paths.push(PeerPath {
            name: "router: softmax + topk",
            stage: Stage::Router,
            forward_ms: time(min_time, || ops.router())?,
            backward_ms: Some(time_backward(min_time, &[&ops.x, &ops.w], || {
                Ok((ops.router()? * &ops.d_topk).sum(Kind::Float))
            })?),
        });
    }
    if wanted(Stage::DecodeRouter) {
        paths.push(PeerPath {
            name: "decode router: RMSNorm + softmax + topk",
            stage: Stage::DecodeRouter,
            forward_ms: time(min_time, || ops.decode_router())?,
            backward_ms: Some(time_backward(
                min_time,
                &[&ops.x, &ops.gamma, &ops.w],
                || Ok((ops.decode_router()? * &ops.d_topk).sum(Kind::Float)),
            )?),
        });
    }
    if wanted(Stage::Topk) {
        let logits = to_tch(&inputs.vocabulary_logits()?);
        let k = VOCAB_TOP_K as i64;
        paths.push(PeerPath {
            name: "topk: torch.topk (sorted)",
            stage: Stage::Topk,
            forward_ms: time(min_time, || {
                Ok(logits.f_topk(k, -1, true, true).map_err(tch_error)?.0)
            })?,
            backward_ms: None,
        });
    }
    if wanted(Stage::Permute) {
        paths.push(PeerPath {
            name: "permute: argsort + bincount",
            stage: Stage::Permute,
            forward_ms: time(min_time, || Ok(ops.permute(e).0))?,
            backward_ms: None,
        });
    }
    for (name, path, leaves) in EXPERT_PATHS {
        if !wanted(Stage::Experts) || path(&ops, e).is_err() {
            continue;
        }
        paths.push(PeerPath {
            name,
            stage: Stage::Experts,
            forward_ms: time(min_time, || path(&ops, e))?,
            backward_ms: Some(time_backward(min_time, &leaves(&ops), || {
                Ok((path(&ops, e)? * &ops.d_output).sum(Kind::Float))
            })?),
        });
    }
    Ok(paths)
}

/// The layer output `[T, H]` of each expert path that runs, as f32, with its name: the check
/// that every peer computes the same function as `blockwise_mm`.
pub fn expert_outputs(
    inputs: &LayerInputs,
    routed: &RouterTopkOutputs,
) -> Vec<(&'static str, Vec<f32>)> {
    let ops = Operands::new(inputs, routed);
    let e = inputs.shape.e as i64;
    EXPERT_PATHS
        .into_iter()
        .filter_map(|(name, path, _)| {
            let out = path(&ops, e)
                .ok()?
                .to_kind(Kind::Float)
                .to_device(Device::Cpu)
                .flatten(0, -1);
            Vec::<f32>::try_from(&out).ok().map(|v| (name, v))
        })
        .collect()
}
