//! The Qwen3 causal language model: Qwen3-MoE, or the dense Qwen3 whose every layer has the
//! dense MLP ([`super::ModelName`]).
//!
//! Parameters live in a `tch` var store under Hugging Face's names
//! (`model.layers.{l}.self_attn.q_proj.weight`, `model.layers.{l}.mlp.gate.weight`, ...), except
//! the experts, which stay fused in the kernels' layout:
//! `model.layers.{l}.mlp.experts.gate_up_proj [E, H, 2, I]` and
//! `model.layers.{l}.mlp.experts.down_proj [E, I, H]`. With expert parallelism a rank holds
//! only its shard of each (see [`ExpertShard`]): `[E/R, H, 2, I]` and `[E/R, I, H]`.

use anyhow::{Result, ensure};
use moekit_tools::torch_moe::hf_router;
use tch::{Kind, Tensor, nn};

use super::ModelConfig;
use super::layers::{DenseMlp, RmsNorm, apply_rope, linear_weight, rope_tables};
use crate::moe::Experts;
use crate::tape::Tape;

/// Qwen3-MoE or dense Qwen3: token embeddings, decoder layers, final norm, language-model head.
pub struct Qwen3Model {
    config: ModelConfig,
    /// `[V, H]`.
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `[V, H]`; `None` when tied to the embeddings.
    lm_head: Option<Tensor>,
}

/// The outputs of [`Qwen3Model::forward`].
pub struct ForwardOutput {
    /// `[B, S, V]`.
    pub logits: Tensor,
    /// Per MoE layer, `[B·S, E]` router logits (for the auxiliary loss).
    pub router_logits: Vec<Tensor>,
    /// Per MoE layer, `[B·S, K]` i64 chosen experts (for load statistics).
    pub expert_index: Vec<Tensor>,
}

/// The experts of every MoE layer that one rank holds: rank `rank` of `ranks` holds experts
/// `[rank·E/R, (rank+1)·E/R)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShard {
    pub rank: usize,
    pub ranks: usize,
}

impl ExpertShard {
    /// Every expert, on a single process.
    pub const ALL: ExpertShard = ExpertShard { rank: 0, ranks: 1 };

    /// `(first expert, experts held)` of `num_experts`.
    pub fn range(self, num_experts: usize) -> (usize, usize) {
        let local = num_experts / self.ranks;
        (self.rank * local, local)
    }
}

impl Qwen3Model {
    /// Creates the parameters under `vs` with Hugging Face's initialisation: linear, embedding
    /// and expert weights ~ N(0, `initializer_range`), norm weights 1.
    pub fn new(vs: &nn::Path, config: &ModelConfig) -> Self {
        Self::new_sharded(vs, config, ExpertShard::ALL)
    }

    /// As [`Qwen3Model::new`], holding only `shard`'s experts. Every rank draws the whole
    /// model's initial values in the same order, so each shard holds exactly the values of the
    /// single-process model's experts (E/R must divide E; the config checks it).
    pub fn new_sharded(vs: &nn::Path, config: &ModelConfig, shard: ExpertShard) -> Self {
        let model = vs.sub("model");
        let std = config.initializer_range;
        let (v, h) = (config.vocab_size as i64, config.hidden_size as i64);
        let layers = (0..config.num_hidden_layers)
            .map(|l| DecoderLayer::new(&model.sub("layers").sub(l), config, l, shard))
            .collect();
        Self {
            config: config.clone(),
            embed_tokens: model.sub("embed_tokens").randn("weight", &[v, h], 0.0, std),
            layers,
            norm: RmsNorm::new(model.sub("norm"), h, config.rms_norm_eps),
            lm_head: (!config.tie_word_embeddings).then(|| linear_weight(vs, "lm_head", v, h, std)),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The MoE layers' selection biases, `model.layers.{l}.mlp.expert_bias [E]` f32, by name.
    pub fn expert_biases(&self) -> Vec<(String, Tensor)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(l, layer)| match &layer.mlp {
                Mlp::Moe(moe) => Some((
                    format!("model.layers.{l}.mlp.expert_bias"),
                    moe.expert_bias.shallow_clone(),
                )),
                Mlp::Dense(_) => None,
            })
            .collect()
    }

    /// Logits for `input_ids [B, S]` (i64, each in `[0, V)`), with a causal mask and positions
    /// `0..S`. MoE layers run on `experts`; kernels outside autograd record their backward on
    /// `tape`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        experts: &dyn Experts,
        tape: &mut Tape,
    ) -> Result<ForwardOutput> {
        self.forward_at(input_ids, None, experts, tape)
    }

    /// The forward pass of `input_ids [B, S]` continuing the sequences whose keys and values
    /// `cache` holds (`P` positions): positions `P..P+S`, each attending to every cached
    /// position and causally to the new ones; the new keys and values are appended to `cache`.
    /// Logits `[B, S, V]` are those [`Self::forward`] gives for the last S positions of the whole
    /// sequence (incremental decoding, as transformers' `past_key_values`).
    pub fn forward_cached(
        &self,
        input_ids: &Tensor,
        cache: &mut KvCache,
        experts: &dyn Experts,
        tape: &mut Tape,
    ) -> Result<ForwardOutput> {
        ensure!(
            cache.layers.len() == self.layers.len(),
            "the KV cache has {} layers, the model {}",
            cache.layers.len(),
            self.layers.len()
        );
        self.forward_at(input_ids, Some(cache), experts, tape)
    }

    fn forward_at(
        &self,
        input_ids: &Tensor,
        mut cache: Option<&mut KvCache>,
        experts: &dyn Experts,
        tape: &mut Tape,
    ) -> Result<ForwardOutput> {
        let (batch, seq) = input_ids.size2()?;
        ensure!(
            input_ids.kind() == Kind::Int64,
            "input_ids must be int64, got {:?}",
            input_ids.kind()
        );
        ensure!(batch > 0 && seq > 0, "input_ids is empty: [{batch}, {seq}]");
        let past = cache.as_ref().map_or(0, |cache| cache.len);
        if let Some(cache) = &cache {
            ensure!(
                past == 0 || cache.batch == batch,
                "input_ids holds {batch} sequences, the KV cache {}",
                cache.batch
            );
        }
        ensure!(
            (past + seq) as usize <= self.config.max_position_embeddings,
            "sequence length {} exceeds max_position_embeddings {}",
            past + seq,
            self.config.max_position_embeddings
        );
        let (min, max) = (
            input_ids.min().int64_value(&[]),
            input_ids.max().int64_value(&[]),
        );
        ensure!(
            min >= 0 && max < self.config.vocab_size as i64,
            "input_ids holds token id {} outside the vocabulary [0, {})",
            if min < 0 { min } else { max },
            self.config.vocab_size
        );

        let mut hidden = Tensor::embedding(&self.embed_tokens, input_ids, -1, false, false);
        let (cos, sin) = rope_tables(
            past + seq,
            self.config.head_dim as i64,
            self.config.rope_theta,
            hidden.kind(),
        );
        let (cos, sin) = (
            cos.narrow(0, past, seq).to_device(hidden.device()),
            sin.narrow(0, past, seq).to_device(hidden.device()),
        );
        let mut router_logits = Vec::new();
        let mut expert_index = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let kv = cache.as_mut().map(|cache| &mut cache.layers[l]);
            hidden = hidden.shallow_clone()
                + layer
                    .self_attn
                    .forward(&layer.input_layernorm.forward(&hidden), &cos, &sin, kv);
            hidden = match &layer.mlp {
                Mlp::Dense(mlp) => {
                    hidden.shallow_clone()
                        + mlp.forward(&layer.post_attention_layernorm.forward(&hidden))
                }
                Mlp::Moe(moe) => {
                    let hidden = tape.cut(hidden);
                    let routed = moe.forward(
                        &layer.post_attention_layernorm.forward(&hidden),
                        experts,
                        tape,
                    )?;
                    router_logits.push(routed.router_logits);
                    expert_index.push(routed.expert_index);
                    hidden + routed.output
                }
            };
        }
        if let Some(cache) = cache {
            cache.len = past + seq;
            cache.batch = batch;
        }
        let hidden = self.norm.forward(&hidden);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(ForwardOutput {
            logits: hidden.linear(head, None::<Tensor>),
            router_logits,
            expert_index,
        })
    }
}

/// The keys and values of the positions a model has seen, per layer, for incremental decoding
/// ([`Qwen3Model::forward_cached`]).
pub struct KvCache {
    /// Per layer, keys and values `[B, kv_heads, P, D]` after `k_norm` and RoPE; `None` before
    /// the first forward.
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// `P`, the positions held.
    len: i64,
    /// `B`, the sequences held.
    batch: i64,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &Qwen3Model) -> Self {
        Self {
            layers: (0..model.layers.len()).map(|_| None).collect(),
            len: 0,
            batch: 0,
        }
    }

    /// The positions held.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn new(vs: &nn::Path, config: &ModelConfig, layer: usize, shard: ExpertShard) -> Self {
        let h = config.hidden_size as i64;
        let std = config.initializer_range;
        let mlp_path = vs.sub("mlp");
        let mlp = if config.is_moe_layer(layer) {
            Mlp::Moe(MoeBlock::new(&mlp_path, config, shard))
        } else {
            Mlp::Dense(DenseMlp::new(
                &mlp_path,
                h,
                config.intermediate_size as i64,
                std,
            ))
        };
        Self {
            input_layernorm: RmsNorm::new(vs.sub("input_layernorm"), h, config.rms_norm_eps),
            self_attn: Attention::new(&vs.sub("self_attn"), config),
            post_attention_layernorm: RmsNorm::new(
                vs.sub("post_attention_layernorm"),
                h,
                config.rms_norm_eps,
            ),
            mlp,
        }
    }
}

enum Mlp {
    Dense(DenseMlp),
    Moe(MoeBlock),
}

/// Grouped-query causal self-attention with per-head `q_norm`/`k_norm` before RoPE.
struct Attention {
    /// `[heads·D, H]`.
    q_proj: Tensor,
    /// `[kv_heads·D, H]`.
    k_proj: Tensor,
    /// `[kv_heads·D, H]`.
    v_proj: Tensor,
    /// `[H, heads·D]`.
    o_proj: Tensor,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(vs: &nn::Path, config: &ModelConfig) -> Self {
        let h = config.hidden_size as i64;
        let (heads, kv_heads, head_dim) = (
            config.num_attention_heads as i64,
            config.num_key_value_heads as i64,
            config.head_dim as i64,
        );
        let std = config.initializer_range;
        Self {
            q_proj: linear_weight(vs, "q_proj", heads * head_dim, h, std),
            k_proj: linear_weight(vs, "k_proj", kv_heads * head_dim, h, std),
            v_proj: linear_weight(vs, "v_proj", kv_heads * head_dim, h, std),
            o_proj: linear_weight(vs, "o_proj", h, heads * head_dim, std),
            q_norm: RmsNorm::new(vs.sub("q_norm"), head_dim, config.rms_norm_eps),
            k_norm: RmsNorm::new(vs.sub("k_norm"), head_dim, config.rms_norm_eps),
            heads,
            kv_heads,
            head_dim,
        }
    }

    /// `x [B, S, H]` → `[B, S, H]`, at the positions `cos`, `sin` `[S, D]` stand for. With
    /// `cache` (keys and values `[B, kv_heads, P, D]` of the P positions before these), the new
    /// keys and values are appended to it and the queries attend to all P + S positions.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Tensor {
        let (batch, seq) = (x.size()[0], x.size()[1]);
        let heads = |weight: &Tensor, count: i64| {
            x.linear(weight, None::<Tensor>)
                .view([batch, seq, count, self.head_dim])
        };
        let q = self
            .q_norm
            .forward(&heads(&self.q_proj, self.heads))
            .transpose(1, 2);
        let k = self
            .k_norm
            .forward(&heads(&self.k_proj, self.kv_heads))
            .transpose(1, 2);
        let v = heads(&self.v_proj, self.kv_heads).transpose(1, 2);
        let (q, k) = (apply_rope(&q, cos, sin), apply_rope(&k, cos, sin));
        let (k, v) = match cache {
            None => (k, v),
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((past_k, past_v)) => {
                        (Tensor::cat(&[past_k, k], 2), Tensor::cat(&[past_v, v], 2))
                    }
                    None => (k, v),
                };
                *slot = Some((k.shallow_clone(), v.shallow_clone()));
                (k, v)
            }
        };
        let past = k.size()[2] - seq;
        let groups = self.heads / self.kv_heads;
        let (k, v) = (
            k.repeat_interleave_self_int(groups, 1, None),
            v.repeat_interleave_self_int(groups, 1, None),
        );
        let scale = (self.head_dim as f64).powf(-0.5);
        // Query i (position P + i) sees keys 0..=P + i: the causal mask when P = 0, nothing to
        // mask for a single query, else the lower triangle shifted by P.
        let (mask, causal) = match (past, seq) {
            (0, _) => (None, true),
            (_, 1) => (None, false),
            _ => {
                let visible = Tensor::ones([seq, past + seq], (Kind::Bool, x.device()));
                (Some(visible.tril(past)), false)
            }
        };
        Tensor::scaled_dot_product_attention(&q, &k, &v, mask, 0.0, causal, scale, false)
            .transpose(1, 2)
            .reshape([batch, seq, self.heads * self.head_dim])
            .linear(&self.o_proj, None::<Tensor>)
    }
}

/// The sparse MoE block: softmax router with top-K (optionally renormalised), then the
/// experts on the configured implementation.
struct MoeBlock {
    /// `[E, H]`.
    gate: Tensor,
    /// `[E]` f32 selection bias for aux-loss-free balancing: added to the probabilities to
    /// choose the top K, never to the affinities. Not a trainable parameter; zeros unless
    /// training updates it.
    expert_bias: Tensor,
    /// `[E, H, 2, I]`.
    gate_up_proj: Tensor,
    /// `[E, I, H]`.
    down_proj: Tensor,
    top_k: i64,
    norm_topk_prob: bool,
}

struct Routed {
    /// `[B, S, H]`.
    output: Tensor,
    /// `[B·S, E]`.
    router_logits: Tensor,
    /// `[B·S, K]` i64.
    expert_index: Tensor,
}

impl MoeBlock {
    fn new(vs: &nn::Path, config: &ModelConfig, shard: ExpertShard) -> Self {
        let (e, h, i) = (
            config.num_experts as i64,
            config.hidden_size as i64,
            config.moe_intermediate_size as i64,
        );
        let std = config.initializer_range;
        let experts = vs.sub("experts");
        let (first, local) = shard.range(config.num_experts);
        // The whole tensor is drawn (as `nn::Path::randn` draws it) and this shard's experts
        // kept, so the random stream and the values match the single-process model's.
        let sharded = |name: &str, dims: &[i64]| {
            if shard == ExpertShard::ALL {
                return experts.randn(name, dims, 0.0, std);
            }
            let full = Tensor::randn(dims, (Kind::Float, vs.device())) * std + 0.0;
            experts.var_copy(name, &full.narrow(0, first as i64, local as i64))
        };
        Self {
            gate: linear_weight(vs, "gate", e, h, std),
            expert_bias: Tensor::zeros([e], (Kind::Float, vs.device())),
            gate_up_proj: sharded("gate_up_proj", &[e, h, 2, i]),
            down_proj: sharded("down_proj", &[e, i, h]),
            top_k: config.num_experts_per_tok as i64,
            norm_topk_prob: config.norm_topk_prob,
        }
    }

    /// `x [B, S, H]`: `p = softmax(x · gateᵀ)` in f32, the top K of `p + expert_bias` (sorted),
    /// their `p` divided by its sum when `norm_topk_prob`, cast back to x's dtype, then the
    /// experts. With a zero bias this is Hugging Face's router exactly.
    fn forward(&self, x: &Tensor, experts: &dyn Experts, tape: &mut Tape) -> Result<Routed> {
        let shape = x.size();
        // With kernels outside autograd, the tensors that feed both a kernel and another
        // consumer (the router, the auxiliary loss) are cut, so each graph node is
        // backpropagated exactly once (see `Tape`).
        let flat = tape.cut(x.reshape([-1, shape[2]]));
        let router_logits = tape.cut(flat.linear(&self.gate, None::<Tensor>));
        let (affinities, expert_index) = hf_router(
            &router_logits,
            self.top_k,
            self.norm_topk_prob,
            Some(&self.expert_bias),
        );
        let affinities = affinities.to_kind(x.kind());
        let output = experts.forward(
            &flat,
            &expert_index,
            &affinities,
            &self.gate_up_proj,
            &self.down_proj,
            tape,
        )?;
        Ok(Routed {
            output: output.view(shape.as_slice()),
            router_logits,
            expert_index,
        })
    }
}
