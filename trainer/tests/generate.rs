//! Generation: the KV cache gives the logits of the whole sequence's forward pass; greedy
//! generation equals the argmax of full forward passes over the growing sequence (no cache: the
//! oracle) and stops at a stop token; sampling is reproducible by seed and keeps to the nucleus;
//! `moekit-train generate` gives the library's tokens, reads the directory's tokenizer and
//! end-of-sequence tokens, and refuses bad flags with clear errors.

mod common;

use std::path::Path;
use std::sync::Mutex;

use common::{fail, scratch, succeed, word_level_tokenizer};
use moekit_trainer::generate::{GenerateOptions, Sampling, generate};
use moekit_trainer::hf::export_hf;
use moekit_trainer::model::{KvCache, ModelConfig, ModelName, Qwen3Model};
use moekit_trainer::moe::MoeImpl;
use moekit_trainer::tape::Tape;
use serde_json::Value;
use tch::{Device, Kind, Tensor, nn};

/// libtorch's generator is global and tests run in parallel: hold this while seeding and drawing.
static RNG: Mutex<()> = Mutex::new(());

fn tiny(name: ModelName) -> ModelConfig {
    ModelConfig {
        name,
        vocab_size: 300,
        hidden_size: 32,
        intermediate_size: 40,
        moe_intermediate_size: 16,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 12,
        num_experts: 6,
        num_experts_per_tok: 2,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
        norm_topk_prob: true,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        max_position_embeddings: 40,
        tie_word_embeddings: false,
        router_aux_loss_coef: 0.01,
        // Large enough that every layer shapes the logits (and the greedy choices).
        initializer_range: 0.2,
    }
}

fn model(config: &ModelConfig) -> (nn::VarStore, Qwen3Model) {
    let vars = nn::VarStore::new(Device::Cpu);
    let _rng = RNG.lock().unwrap();
    tch::manual_seed(3);
    let model = Qwen3Model::new(&vars.root(), config);
    (vars, model)
}

fn random_ids(shape: [i64; 2], vocab: usize) -> Tensor {
    let _rng = RNG.lock().unwrap();
    tch::manual_seed(5);
    Tensor::randint(vocab as i64, shape, (Kind::Int64, Device::Cpu))
}

fn max_abs(t: &Tensor) -> f64 {
    t.abs().max().double_value(&[])
}

#[test]
fn cached_forward_equals_the_whole_sequence_forward() {
    for name in [ModelName::Qwen3Moe, ModelName::Qwen3] {
        let config = tiny(name);
        let (_vars, model) = model(&config);
        let ids = random_ids([2, 12], config.vocab_size);
        for moe in [MoeImpl::Torch, MoeImpl::Cpu] {
            let experts = moe.create(4).unwrap();
            tch::no_grad(|| {
                let full = model
                    .forward(&ids, experts.as_ref(), &mut Tape::new(false))
                    .unwrap()
                    .logits;
                // A prefill, a single token, then chunks that need the shifted causal mask.
                let mut cache = KvCache::new(&model);
                let mut pieces = Vec::new();
                let mut start = 0;
                for len in [5, 1, 4, 2] {
                    let chunk = ids.narrow(1, start, len);
                    let out = model
                        .forward_cached(&chunk, &mut cache, experts.as_ref(), &mut Tape::new(false))
                        .unwrap();
                    pieces.push(out.logits);
                    start += len;
                    assert_eq!(cache.len(), start as usize);
                }
                let cached = Tensor::cat(&pieces, 1);
                let scale = max_abs(&full);
                let diff = max_abs(&(&cached - &full));
                assert!(scale > 0.1, "{name:?}: logits trivially small");
                assert!(
                    diff <= 1e-5 * scale,
                    "{name:?}, {moe:?}: cached logits differ by {diff:e} (largest {scale})"
                );
            });
        }
    }
}

/// The greedy continuation by full forward passes over the growing sequence, no cache.
fn greedy_without_cache(model: &Qwen3Model, prompt: &[i64], new: usize) -> Vec<i64> {
    let experts = MoeImpl::Torch.create(4).unwrap();
    let mut ids = prompt.to_vec();
    tch::no_grad(|| {
        for _ in 0..new {
            let input = Tensor::from_slice(&ids).view([1, -1]);
            let logits = model
                .forward(&input, experts.as_ref(), &mut Tape::new(false))
                .unwrap()
                .logits;
            ids.push(logits.get(0).get(-1).argmax(0, false).int64_value(&[]));
        }
    });
    ids.split_off(prompt.len())
}

fn options(max_new_tokens: usize, sampling: Sampling, stop_ids: Vec<i64>) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling,
        stop_ids,
    }
}

#[test]
fn greedy_generation_is_the_argmax_of_full_forward_passes_and_stops_at_a_stop_token() {
    let prompt = [17, 4, 250, 99, 3];
    for name in [ModelName::Qwen3Moe, ModelName::Qwen3] {
        let config = tiny(name);
        let (_vars, model) = model(&config);
        let expected = greedy_without_cache(&model, &prompt, 12);
        for moe in [MoeImpl::Torch, MoeImpl::Cpu, MoeImpl::Reference] {
            let experts = moe.create(4).unwrap();
            let greedy = options(12, Sampling::GREEDY, vec![]);
            let generated = generate(&model, &prompt, experts.as_ref(), &greedy).unwrap();
            assert_eq!(generated.generated_ids, expected, "{name:?}, {moe:?}");
            assert!(generated.tokens_per_second() > 0.0);

            // A stop token ends generation at its first occurrence, itself included.
            let stop = expected[5];
            let first = expected.iter().position(|&t| t == stop).unwrap();
            let stopping = options(12, Sampling::GREEDY, vec![1000, stop]);
            let generated = generate(&model, &prompt, experts.as_ref(), &stopping).unwrap();
            assert_eq!(
                generated.generated_ids,
                expected[..=first],
                "{name:?}, {moe:?}"
            );
        }
    }
}

#[test]
fn sampling_is_reproducible_by_seed_and_keeps_to_the_nucleus() {
    let config = tiny(ModelName::Qwen3Moe);
    let (_vars, model) = model(&config);
    let experts = MoeImpl::Cpu.create(4).unwrap();
    let prompt = [1, 2, 3];
    let run = |temperature, top_p, seed| {
        let sampling = Sampling::new(temperature, top_p, seed).unwrap();
        generate(
            &model,
            &prompt,
            experts.as_ref(),
            &options(16, sampling, vec![]),
        )
        .unwrap()
        .generated_ids
    };
    assert_eq!(run(1.0, 1.0, 7), run(1.0, 1.0, 7));
    let draws: Vec<_> = (0..4).map(|seed| run(1.0, 1.0, seed)).collect();
    assert!(
        draws.iter().any(|d| d != &draws[0]),
        "four seeds drew the same 16 tokens: {draws:?}"
    );
    // A nucleus too small for two tokens holds only the most likely one: greedy, any seed.
    let greedy = greedy_without_cache(&model, &prompt, 16);
    for seed in 0..3 {
        assert_eq!(run(1.0, 1e-9, seed), greedy);
    }
}

#[test]
fn sampling_options_out_of_range_are_errors() {
    for (temperature, top_p, expected) in [
        (-0.5, 1.0, "temperature must be a finite number ≥ 0"),
        (f64::NAN, 1.0, "temperature must be a finite number ≥ 0"),
        (
            f64::INFINITY,
            1.0,
            "temperature must be a finite number ≥ 0",
        ),
        (1.0, 0.0, "top-p must be in (0, 1]"),
        (1.0, 1.5, "top-p must be in (0, 1]"),
        (1.0, f64::NAN, "top-p must be in (0, 1]"),
    ] {
        let err = Sampling::new(temperature, top_p, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{err}");
    }
}

/// Saves a tiny random model as a Hugging Face directory at `dir`.
fn save_hf(config: &ModelConfig, dir: &Path) -> Qwen3Model {
    let (vars, model) = model(config);
    let mut params: Vec<(String, Tensor)> = vars.variables().into_iter().collect();
    params.sort_by(|a, b| a.0.cmp(&b.0));
    params.extend(model.expert_biases());
    export_hf(dir, config, &params, None).unwrap();
    model
}

fn generate_json(args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    serde_json::from_str(succeed(&args).trim()).unwrap()
}

fn ids(value: &Value) -> Vec<i64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_i64().unwrap())
        .collect()
}

#[test]
fn the_command_generates_the_librarys_tokens_through_the_directorys_tokenizer() {
    let dir = scratch("cli");
    let hf = dir.join("hf");
    let config = tiny(ModelName::Qwen3Moe);
    let model = save_hf(&config, &hf);
    let hf_str = hf.to_str().unwrap();
    let prompt = [104i64, 105, 33];
    let expected = greedy_without_cache(&model, &prompt, 8);

    // Token ids in, token ids out, as the library generates them on every implementation.
    for moe in ["torch", "cpu"] {
        let record = generate_json(&[
            "generate",
            "--model",
            hf_str,
            "--prompt-ids",
            "104,105,33",
            "--max-new-tokens",
            "8",
            "--kernels.moe",
            moe,
        ]);
        assert_eq!(ids(&record["prompt_ids"]), prompt, "{moe}");
        assert_eq!(ids(&record["generated_ids"]), expected, "{moe}");
        assert!(record["tokens_per_second"].as_f64().unwrap() > 0.0);
        // Byte level (the directory has no tokenizer.json): ids above 255 show as U+FFFD.
        let bytes: Vec<u8> = expected
            .iter()
            .flat_map(|&id| match u8::try_from(id) {
                Ok(byte) => vec![byte],
                Err(_) => "\u{FFFD}".as_bytes().to_vec(),
            })
            .collect();
        assert_eq!(
            record["text"].as_str().unwrap(),
            String::from_utf8_lossy(&bytes)
        );
    }

    // Text in: byte level, the same tokens; the plain output is the prompt and continuation.
    let text = generate_json(&[
        "generate",
        "--model",
        hf_str,
        "--prompt",
        "hi!",
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(ids(&text["generated_ids"]), expected);
    let plain = succeed(&[
        "generate",
        "--model",
        hf_str,
        "--prompt",
        "hi!",
        "--max-new-tokens",
        "8",
    ]);
    assert!(plain.starts_with("hi!"), "{plain}");
    assert!(plain.contains(text["text"].as_str().unwrap()), "{plain}");

    // The directory's eos_token_id (generation_config.json first, as transformers) ends it.
    let stop = expected[3];
    let first = expected.iter().position(|&t| t == stop).unwrap();
    std::fs::write(
        hf.join("generation_config.json"),
        format!("{{\"eos_token_id\": [299, {stop}]}}"),
    )
    .unwrap();
    let stopped = generate_json(&[
        "generate",
        "--model",
        hf_str,
        "--prompt-ids",
        "104,105,33",
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(ids(&stopped["generated_ids"]), expected[..=first]);
    std::fs::write(
        hf.join("generation_config.json"),
        "{\"eos_token_id\": \"two\"}",
    )
    .unwrap();
    fail(
        &["generate", "--model", hf_str, "--prompt-ids", "1"],
        "eos_token_id must be a token id or a list of them, got \"two\"",
    );
    std::fs::remove_file(hf.join("generation_config.json")).unwrap();

    // A tokenizer.json in the directory encodes the prompt and decodes the continuation.
    let vocab: serde_json::Map<String, Value> = (0..config.vocab_size)
        .map(|id| (format!("w{id}"), Value::from(id)))
        .collect();
    let tokenizer = word_level_tokenizer(vocab, "w0");
    std::fs::write(hf.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let words = generate_json(&[
        "generate",
        "--model",
        hf_str,
        "--prompt",
        "w104 w105 w33",
        "--max-new-tokens",
        "8",
    ]);
    assert_eq!(ids(&words["prompt_ids"]), prompt);
    assert_eq!(ids(&words["generated_ids"]), expected);
    let expected_words: Vec<String> = expected.iter().map(|id| format!("w{id}")).collect();
    assert_eq!(words["text"].as_str().unwrap(), expected_words.join(" "));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_generate_flags_are_clear_errors() {
    let dir = scratch("flags");
    let hf = dir.join("hf");
    save_hf(&tiny(ModelName::Qwen3), &hf);
    let hf_str = hf.to_str().unwrap();
    let with = |extra: &[&'static str]| {
        let mut args = vec!["generate", "--model", hf_str];
        args.extend_from_slice(extra);
        args
    };
    for (extra, expected) in [
        (&[][..], "missing `--prompt TEXT` or `--prompt-ids 1,2,3`"),
        (
            &["--prompt", "a", "--prompt-ids", "1"],
            "give --prompt or --prompt-ids, not both",
        ),
        (
            &["--prompt-ids", "1,x,3"],
            "--prompt-ids must be comma-separated token ids, got `x`",
        ),
        (&["--prompt", ""], "the prompt has no tokens"),
        (
            &["--prompt-ids", "1,300"],
            "the prompt holds token id 300, outside the model's vocabulary [0, 300)",
        ),
        (
            &["--prompt-ids", "-2"],
            "the prompt holds token id -2, outside the model's vocabulary [0, 300)",
        ),
        (
            &["--prompt", "a", "--max-new-tokens", "0"],
            "--max-new-tokens must be a positive integer, got `0`",
        ),
        (
            &["--prompt", "a", "--max-new-tokens", "-3"],
            "--max-new-tokens must be a positive integer, got `-3`",
        ),
        (
            &["--prompt", "abc", "--max-new-tokens", "38"],
            "3 prompt tokens and 38 new ones exceed the model's max_position_embeddings 40",
        ),
        (
            &["--prompt", "a", "--temperature", "hot"],
            "--temperature must be a number, got `hot`",
        ),
        (
            &["--prompt", "a", "--temperature", "-1"],
            "the temperature must be a finite number ≥ 0",
        ),
        (
            &["--prompt", "a", "--top-p", "2"],
            "top-p must be in (0, 1], got 2",
        ),
        (
            &["--prompt", "a", "--seed", "-1"],
            "--seed must be a non-negative integer, got `-1`",
        ),
        (
            &["--prompt", "a", "--json", "maybe"],
            "--json must be true or false, got `maybe`",
        ),
        (
            &["--prompt", "a", "--kernels.moe", "fast"],
            "unknown MoE implementation `fast`",
        ),
        (
            &["--prompt", "a", "--top-k", "5"],
            "unknown option `--top-k`",
        ),
    ] {
        fail(&with(extra), expected);
    }
    fail(
        &[
            "generate",
            "--model",
            dir.join("absent").to_str().unwrap(),
            "--prompt",
            "a",
        ],
        "absent",
    );
    std::fs::remove_dir_all(dir).unwrap();
}
