//! The building blocks of a Qwen3-MoE decoder layer, with Hugging Face's numerics.

use tch::{Kind, Tensor, nn};

/// RMSNorm over the last axis: `weight · (x₃₂ · rsqrt(mean(x₃₂²) + eps))` cast back to x's
/// dtype before the scale, as Hugging Face's `Qwen3MoeRMSNorm`.
pub struct RmsNorm {
    /// `[D]`, initialised to ones.
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(vs: nn::Path, dim: i64, eps: f64) -> Self {
        Self {
            weight: vs.ones("weight", &[dim]),
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let x32 = x.to_kind(Kind::Float);
        let variance = x32.square().mean_dim(-1, true, Kind::Float);
        let normed = (x32 * (variance + self.eps).rsqrt()).to_kind(x.kind());
        &self.weight * normed
    }
}

/// A bias-free linear layer, `x · Wᵀ` with `W [out, in]` ~ N(0, std).
pub fn linear_weight(vs: &nn::Path, name: &str, out: i64, inp: i64, std: f64) -> Tensor {
    vs.sub(name).randn("weight", &[out, inp], 0.0, std)
}

/// Rotary position embedding tables for positions `0..seq_len`: `cos`, `sin` `[S, D]` with
/// `inv_freq = 1 / theta^(arange(0, D, 2) / D)` in f32 and the frequencies repeated
/// (`cat(freqs, freqs)`), as Hugging Face's default rotary embedding.
pub fn rope_tables(seq_len: i64, head_dim: i64, theta: f64, kind: Kind) -> (Tensor, Tensor) {
    let exponent = Tensor::arange_start_step(0, head_dim, 2, (Kind::Int64, tch::Device::Cpu))
        .to_kind(Kind::Float)
        / head_dim as f64;
    let inv_freq = Tensor::pow_scalar(theta, &exponent).reciprocal();
    let positions = Tensor::arange(seq_len, (Kind::Float, tch::Device::Cpu));
    let freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

/// `x · cos + rotate_half(x) · sin` for `x [B, heads, S, D]` and tables `[S, D]`, where
/// `rotate_half(x) = cat(−x[..., D/2:], x[..., :D/2])`.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let rotated = Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
    x * cos + rotated * sin
}

/// The dense SwiGLU MLP of non-MoE layers: `down(silu(gate(x)) ⊙ up(x))`.
pub struct DenseMlp {
    /// `[I, H]`.
    gate_proj: Tensor,
    /// `[I, H]`.
    up_proj: Tensor,
    /// `[H, I]`.
    down_proj: Tensor,
}

impl DenseMlp {
    pub fn new(vs: &nn::Path, hidden: i64, intermediate: i64, std: f64) -> Self {
        Self {
            gate_proj: linear_weight(vs, "gate_proj", intermediate, hidden, std),
            up_proj: linear_weight(vs, "up_proj", intermediate, hidden, std),
            down_proj: linear_weight(vs, "down_proj", hidden, intermediate, std),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let act = x.linear(&self.gate_proj, None::<Tensor>).silu()
            * x.linear(&self.up_proj, None::<Tensor>);
        act.linear(&self.down_proj, None::<Tensor>)
    }
}
