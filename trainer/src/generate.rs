//! Text generation: the prompt is run once (prefill), then one token at a time on the KV cache
//! ([`KvCache`]), each chosen greedily or sampled, until `max_new_tokens` or a stop token.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use tch::{Kind, Tensor};

use crate::hf::TOKENIZER_FILE;
use moekit::random::SplitMix64;

use crate::data::TextTokenizer;
use crate::model::{KvCache, Qwen3Model};
use crate::moe::Experts;
use crate::tape::Tape;

/// How each next token is chosen from the last position's logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy, the most likely token (transformers' `do_sample=False`; the first on a tie,
    /// as `argmax`). Above 0: a draw from `softmax(logits / temperature)`.
    pub temperature: f64,
    /// Nucleus sampling: the draw is among the most likely tokens whose probabilities reach
    /// `top_p` together (at least one token); 1 keeps them all. Unused when greedy.
    pub top_p: f64,
    /// Seeds the draws: the same seed, prompt and model give the same tokens.
    pub seed: u64,
}

impl Sampling {
    /// Greedy decoding.
    pub const GREEDY: Sampling = Sampling {
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
    };

    /// Checks `temperature` (finite, ≥ 0) and `top_p` (in (0, 1]).
    pub fn new(temperature: f64, top_p: f64, seed: u64) -> Result<Self> {
        ensure!(
            temperature.is_finite() && temperature >= 0.0,
            "the temperature must be a finite number ≥ 0 (0 is greedy), got {temperature}"
        );
        ensure!(
            top_p > 0.0 && top_p <= 1.0,
            "top-p must be in (0, 1], got {top_p}"
        );
        Ok(Self {
            temperature,
            top_p,
            seed,
        })
    }

    /// The next token given `logits [V]`.
    fn choose(&self, logits: &Tensor, rng: &mut SplitMix64) -> Result<i64> {
        if self.temperature == 0.0 {
            return Ok(logits.argmax(0, false).int64_value(&[]));
        }
        let logits = Vec::<f64>::try_from(logits.to_kind(Kind::Double))?;
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        ensure!(
            max.is_finite(),
            "the model produced non-finite logits (largest {max})"
        );
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| ((l - max) / self.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        // The most likely first (ties by token id), kept until their share reaches top_p.
        let mut order: Vec<usize> = (0..weights.len()).collect();
        order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(a.cmp(&b)));
        let mut kept = 0.0;
        let mut nucleus = 0;
        while nucleus < order.len() && (nucleus == 0 || kept < self.top_p * total) {
            kept += weights[order[nucleus]];
            nucleus += 1;
        }
        let mut target = rng.uniform(0.0, kept);
        for &token in &order[..nucleus] {
            target -= weights[token];
            if target < 0.0 {
                return Ok(token as i64);
            }
        }
        // Rounding left a sliver past the last kept token.
        Ok(order[nucleus - 1] as i64)
    }
}

/// What [`generate`] produces and how.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// The most tokens to generate (at least 1).
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Generation ends after any of these (the model's end-of-sequence tokens), included.
    pub stop_ids: Vec<i64>,
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The new tokens, the stop token included when one ended generation.
    pub generated_ids: Vec<i64>,
    /// Wall time of the prefill and every decoding step.
    pub seconds: f64,
}

impl Generation {
    /// New tokens per second of generation, prefill included.
    pub fn tokens_per_second(&self) -> f64 {
        self.generated_ids.len() as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }
}

/// Continues `prompt_ids` (each in `[0, V)`, at least one) with up to `max_new_tokens` tokens,
/// the MoE layers on `experts`. Checks that the whole sequence fits in
/// `max_position_embeddings` before any work.
pub fn generate(
    model: &Qwen3Model,
    prompt_ids: &[i64],
    experts: &dyn Experts,
    options: &GenerateOptions,
) -> Result<Generation> {
    let config = model.config();
    ensure!(!prompt_ids.is_empty(), "the prompt has no tokens");
    ensure!(
        options.max_new_tokens > 0,
        "max_new_tokens must be at least 1"
    );
    if let Some(&id) = prompt_ids
        .iter()
        .find(|&&id| id < 0 || id >= config.vocab_size as i64)
    {
        bail!(
            "the prompt holds token id {id}, outside the model's vocabulary [0, {})",
            config.vocab_size
        );
    }
    let length = prompt_ids.len().saturating_add(options.max_new_tokens);
    ensure!(
        length <= config.max_position_embeddings,
        "{} prompt tokens and {} new ones exceed the model's max_position_embeddings {}",
        prompt_ids.len(),
        options.max_new_tokens,
        config.max_position_embeddings
    );
    tch::no_grad(|| {
        let start = Instant::now();
        let mut rng = SplitMix64::new(options.sampling.seed);
        let mut cache = KvCache::new(model);
        let mut input = Tensor::from_slice(prompt_ids).view([1, -1]);
        let mut generated_ids = Vec::with_capacity(options.max_new_tokens);
        while generated_ids.len() < options.max_new_tokens {
            let out = model.forward_cached(&input, &mut cache, experts, &mut Tape::new(false))?;
            let last = out.logits.get(0).get(-1);
            let next = options.sampling.choose(&last, &mut rng)?;
            generated_ids.push(next);
            if options.stop_ids.contains(&next) {
                break;
            }
            input = Tensor::from_slice(&[next]).view([1, 1]);
        }
        Ok(Generation {
            generated_ids,
            seconds: start.elapsed().as_secs_f64(),
        })
    })
}

/// The tokenizer of a model directory (Hugging Face or training checkpoint): its
/// `tokenizer.json`, byte level where it has none.
pub fn directory_tokenizer(dir: &Path) -> Result<TextTokenizer> {
    let file = dir.join(TOKENIZER_FILE);
    match file.is_file() {
        true => TextTokenizer::load(&file.to_string_lossy()),
        false => Ok(TextTokenizer::Byte),
    }
}

/// The end-of-sequence tokens a model directory names: `eos_token_id` (one id or a list) of
/// its `generation_config.json`, else of its `config.json`, as transformers' `generate` reads
/// them; none when neither names any (a training checkpoint).
pub fn stop_ids(dir: &Path) -> Result<Vec<i64>> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        let json: Value = serde_json::from_slice(&crate::files::read_bytes(&path)?)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let ids = match json.get("eos_token_id") {
            None | Some(Value::Null) => continue,
            Some(Value::Array(ids)) => ids.iter().map(Value::as_i64).collect(),
            Some(id) => id.as_i64().map(|id| vec![id]),
        };
        return ids.with_context(|| {
            format!(
                "{}: eos_token_id must be a token id or a list of them, got {}",
                path.display(),
                json["eos_token_id"]
            )
        });
    }
    Ok(Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share of `draws` choices of each of `probs.len()` tokens.
    fn frequencies(sampling: Sampling, probs: &[f64], draws: usize) -> Vec<f64> {
        let logits = Tensor::from_slice(&probs.iter().map(|p| p.ln() as f32).collect::<Vec<_>>());
        let mut rng = SplitMix64::new(sampling.seed);
        let mut counts = vec![0usize; probs.len()];
        for _ in 0..draws {
            counts[sampling.choose(&logits, &mut rng).unwrap() as usize] += 1;
        }
        counts.iter().map(|&c| c as f64 / draws as f64).collect()
    }

    fn assert_close(got: &[f64], expected: &[f64]) {
        // 40 000 draws: a share's standard deviation is at most 0.0025; 0.012 is ~5 of them.
        for (g, e) in got.iter().zip(expected) {
            assert!((g - e).abs() < 0.012, "{got:?} vs {expected:?}");
        }
    }

    #[test]
    fn draws_follow_the_tempered_nucleus_distribution() {
        let probs = [0.5, 0.3, 0.15, 0.05];
        let draws = 40_000;
        // Temperature 1: the model's distribution.
        assert_close(
            &frequencies(Sampling::new(1.0, 1.0, 1).unwrap(), &probs, draws),
            &probs,
        );
        // Temperature 0.5 squares the probabilities (then renormalised).
        let squared: Vec<f64> = probs.iter().map(|p| p * p).collect();
        let total: f64 = squared.iter().sum();
        let tempered: Vec<f64> = squared.iter().map(|p| p / total).collect();
        assert_close(
            &frequencies(Sampling::new(0.5, 1.0, 2).unwrap(), &probs, draws),
            &tempered,
        );
        // top-p 0.7: 0.5 alone falls short, 0.5 + 0.3 reaches it; those two, renormalised.
        assert_close(
            &frequencies(Sampling::new(1.0, 0.7, 3).unwrap(), &probs, draws),
            &[0.625, 0.375, 0.0, 0.0],
        );
        // Greedy: always the most likely.
        assert_eq!(
            frequencies(Sampling::GREEDY, &probs, 100),
            [1.0, 0.0, 0.0, 0.0]
        );
    }
}
