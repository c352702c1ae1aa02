//! The training losses, as Hugging Face's `Qwen3MoeForCausalLM` computes them.

use tch::{Kind, Reduction, Tensor};

/// Mean next-token cross-entropy of `logits [B, S, V]` against `input_ids [B, S]` (position s
/// predicts token s+1; B·(S−1) targets), in f32.
pub fn causal_lm_loss(logits: &Tensor, input_ids: &Tensor) -> Tensor {
    let (batch, seq, vocab) = (logits.size()[0], logits.size()[1], logits.size()[2]);
    let predictions = logits
        .narrow(1, 0, seq - 1)
        .to_kind(Kind::Float)
        .reshape([batch * (seq - 1), vocab]);
    let targets = input_ids.narrow(1, 1, seq - 1).reshape([-1]);
    predictions.cross_entropy_loss(&targets, None::<Tensor>, Reduction::Mean, -100, 0.0)
}

/// Hugging Face's `load_balancing_loss_func`: the MoE layers' router logits `[T, E]` are
/// concatenated (pooled over layers), `p = softmax` in f32, the top-K experts one-hot encoded,
/// and `E · Σ_{k,e} mean_t(one_hot)[k, e] · mean_t(p)[e]` returned. Zero without MoE layers.
pub fn load_balancing_loss(router_logits: &[Tensor], top_k: i64) -> Tensor {
    let Some(first) = router_logits.first() else {
        return Tensor::zeros([], (Kind::Float, tch::Device::Cpu));
    };
    let experts = first.size()[1];
    let logits = Tensor::cat(router_logits, 0);
    let probs = logits.softmax(-1, Kind::Float);
    let (_, selected) = probs.topk(top_k, -1, true, true);
    let tokens_per_expert =
        selected
            .one_hot(experts)
            .to_kind(Kind::Float)
            .mean_dim(0, false, Kind::Float); // [K, E]
    let router_prob_per_expert = probs.mean_dim(0, false, Kind::Float); // [E]
    (tokens_per_expert * router_prob_per_expert.unsqueeze(0)).sum(Kind::Float) * experts as f64
}
