//! Job configs: the shipped ones load, the published architectures have their published
//! parameter counts, overrides apply, and every bad key, value or combination is a clear error.

mod common;

use std::path::{Path, PathBuf};

use moekit_trainer::config::JobConfig;
use moekit_trainer::model::{ModelConfig, ModelName, Qwen3Model};
use moekit_trainer::moe::MoeImpl;
use tch::{Device, nn};

use common::scratch;

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

fn shipped(name: &str) -> PathBuf {
    configs_dir().join(name)
}

fn overrides(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The error chain of loading `shipped(name)` with `pairs` as overrides.
fn load_error(name: &str, pairs: &[(&str, &str)]) -> String {
    let err = JobConfig::load(&shipped(name), &overrides(pairs)).unwrap_err();
    format!("{err:#}")
}

/// A scratch folder unique to this test.
/// Each `(overrides, expected)` of `cases` fails to load `name` with a message containing
/// `expected`.
fn assert_load_errors(name: &str, cases: &[(&[(&str, &str)], &str)]) {
    for (pairs, expected) in cases {
        let message = load_error(name, pairs);
        assert!(
            message.contains(expected),
            "{pairs:?}: `{message}` lacks `{expected}`"
        );
    }
}

#[test]
fn shipped_configs_load() {
    for name in [
        "qwen3_moe_debug.toml",
        "qwen3_moe_small.toml",
        "qwen3_moe_30b_a3b.toml",
        "qwen3_moe_235b_a22b.toml",
        "qwen3_debug.toml",
        "qwen3_4b_instruct_2507.toml",
    ] {
        let config =
            JobConfig::load(&shipped(name), &[]).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(config.kernels.moe, MoeImpl::Cpu, "{name}");
        let dense = name.starts_with("qwen3_") && !name.starts_with("qwen3_moe");
        let expected = if dense {
            ModelName::Qwen3
        } else {
            ModelName::Qwen3Moe
        };
        assert_eq!(config.model.name, expected, "{name}");
    }
}

#[test]
fn published_architectures_have_their_published_parameter_counts() {
    // The `total_size` of the Hub checkpoints' safetensors index (bf16 bytes) / 2.
    for (name, published, layers) in [
        ("qwen3_moe_30b_a3b.toml", 30_532_122_624u128, 48),
        ("qwen3_moe_235b_a22b.toml", 235_093_634_560, 94),
        // Dense, tied: 8,044,936,192 bytes of bf16 in the Hub's index.
        ("qwen3_4b_instruct_2507.toml", 4_022_468_096, 0),
    ] {
        let model = JobConfig::load(&shipped(name), &[]).unwrap().model;
        assert_eq!(model.parameter_count(), published, "{name}");
        assert_eq!(model.moe_layer_count(), layers, "{name}");
    }
}

#[test]
fn dense_parameter_count_equals_the_instantiated_model() {
    for pairs in [
        vec![],
        vec![("model.tie_word_embeddings", "true")],
        vec![("model.num_key_value_heads", "1"), ("model.head_dim", "24")],
    ] {
        let config = JobConfig::load(&shipped("qwen3_debug.toml"), &overrides(&pairs)).unwrap();
        let vars = nn::VarStore::new(Device::Cpu);
        let _model = Qwen3Model::new(&vars.root(), &config.model);
        let numel: usize = vars.trainable_variables().iter().map(|v| v.numel()).sum();
        assert_eq!(config.model.parameter_count(), numel as u128, "{pairs:?}");
        assert_eq!(config.model.moe_layer_count(), 0, "{pairs:?}");
        assert!(config.model.moe_layers().is_empty(), "{pairs:?}");
    }
}

#[test]
fn parameter_count_equals_the_instantiated_model() {
    for pairs in [
        vec![],
        vec![("model.tie_word_embeddings", "true")],
        vec![
            ("model.decoder_sparse_step", "2"),
            ("model.mlp_only_layers", "[1]"),
        ],
        // Layers 1 and 3 are every second; 3 is named dense (twice), 0 is dense anyway.
        vec![
            ("model.num_hidden_layers", "5"),
            ("model.decoder_sparse_step", "2"),
            ("model.mlp_only_layers", "[0, 3, 3]"),
        ],
    ] {
        let config = JobConfig::load(&shipped("qwen3_moe_debug.toml"), &overrides(&pairs)).unwrap();
        let vars = nn::VarStore::new(Device::Cpu);
        let _model = Qwen3Model::new(&vars.root(), &config.model);
        let numel: usize = vars.trainable_variables().iter().map(|v| v.numel()).sum();
        assert_eq!(config.model.parameter_count(), numel as u128, "{pairs:?}");
        assert_eq!(
            config.model.moe_layer_count(),
            config.model.moe_layers().len(),
            "{pairs:?}"
        );
    }
}

#[test]
fn overrides_replace_values_of_any_type() {
    let config = JobConfig::load(
        &shipped("qwen3_moe_debug.toml"),
        &overrides(&[
            ("training.steps", "70"),
            ("kernels.moe", "grouped_mm"),
            ("optimizer.betas", "[0.8, 0.9]"),
            ("model.norm_topk_prob", "false"),
            ("job.dump_folder", "elsewhere"),
        ]),
    )
    .unwrap();
    assert_eq!(config.training.steps, 70);
    assert_eq!(config.kernels.moe, MoeImpl::GroupedMm);
    assert_eq!(config.optimizer.betas, [0.8, 0.9]);
    assert!(!config.model.norm_topk_prob);
    assert_eq!(config.job.dump_folder, PathBuf::from("elsewhere"));
}

#[test]
fn bad_keys_values_and_combinations_are_clear_errors() {
    let debug = "qwen3_moe_debug.toml";
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[("training.stepz", "3")], "unknown field `stepz`"),
        (&[("trainer.steps", "3")], "unknown section `[trainer]`"),
        (&[("training.steps", "many")], "in section [training]"),
        (
            &[("training.steps", "0")],
            "training.steps must be at least 1",
        ),
        (&[("kernels.moe", "magic")], "unknown variant `magic`"),
        (
            &[("model.num_experts_per_tok", "9")],
            "num_experts_per_tok (9) exceeds model.num_experts (8)",
        ),
        (
            &[("model.num_key_value_heads", "3")],
            "must be a multiple of model.num_key_value_heads (3)",
        ),
        (&[("model.head_dim", "15")], "head_dim must be even"),
        (
            &[("model.mlp_only_layers", "[2]")],
            "names layer 2, but the model has 2 layers",
        ),
        (
            &[("model.vocab_size", "100")],
            "byte tokenizer needs model.vocab_size >= 256",
        ),
        (
            &[("training.seq_len", "1024")],
            "exceeds model.max_position_embeddings (512)",
        ),
        (
            &[("lr_scheduler.warmup_steps", "500")],
            "warmup_steps (500) exceeds training.steps (200)",
        ),
        (
            &[("optimizer.lr", "-1.0")],
            "optimizer.lr must be a positive finite number",
        ),
        (
            &[("optimizer.betas", "[0.9, 1.0]")],
            "optimizer.betas[1] must be in [0, 1)",
        ),
        (
            &[("optimizer.name", "SGD")],
            "optimizer.name \"SGD\" is not supported",
        ),
        (
            &[("data.files", "[\"no/such/file.txt\"]")],
            "does not exist",
        ),
        (
            &[("data.tokenizer", "gpt2")],
            "gpt2 is neither \"byte\" nor an existing tokenizer.json file",
        ),
        (
            &[("model.config_json", "config.json")],
            "cannot be set beside it",
        ),
        (&[("job.dump_folder", "")], "job.dump_folder is empty"),
        (&[("training", "3")], "must name a section and a key"),
        (
            &[("training.load_balance_coeff", "-1.0")],
            "training.load_balance_coeff must be a non-negative finite number",
        ),
        (
            &[
                ("kernels.moe", "grouped_mm"),
                ("model.moe_intermediate_size", "30"),
            ],
            "needs moe_intermediate_size to be a multiple of 4 with 4-byte elements",
        ),
        (
            &[
                ("kernels.moe", "grouped_mm"),
                ("training.dtype", "bfloat16"),
                ("model.moe_intermediate_size", "20"),
            ],
            "needs moe_intermediate_size to be a multiple of 8 with 2-byte elements",
        ),
        (
            &[("checkpoint.interval", "0")],
            "checkpoint.interval must be at least 1",
        ),
        (
            &[("checkpoint.initial_load_path", "no/such/dir")],
            "no/such/dir is not a Hugging Face model directory",
        ),
    ];
    assert_load_errors(debug, cases);
    let validation: &[(&[(&str, &str)], &str)] = &[
        (
            &[("data.validation_fraction", "1.0")],
            "data.validation_fraction must be in [0, 1), got 1",
        ),
        (
            &[("data.validation_fraction", "nan")],
            "data.validation_fraction must be in [0, 1), got NaN",
        ),
        (
            &[("data.validation_files", "[\"no/such/held_out.txt\"]")],
            "data.validation_files: ",
        ),
        (
            &[
                ("data.validation_fraction", "0"),
                ("metrics.eval_interval", "5"),
            ],
            "metrics.eval_interval = 5 needs a validation split to evaluate: set \
             data.validation_files or data.validation_fraction",
        ),
        (
            &[("metrics.eval_batches", "0")],
            "metrics.eval_batches must be at least 1",
        ),
        // The debug config holds out a fraction already.
        (
            &[("data.validation_files", "[\"qwen3_moe_small.toml\"]")],
            "data.validation_files and data.validation_fraction = 0.1 both name a validation split",
        ),
    ];
    assert_load_errors(debug, validation);
    // The dense Qwen3 has no experts: their keys are errors, not silently ignored.
    let dense: &[(&[(&str, &str)], &str)] = &[
        (
            &[("model.num_experts", "8")],
            "model.num_experts = 8 configures experts, but model.name = \"qwen3\"",
        ),
        (
            &[("model.mlp_only_layers", "[0]")],
            "model.mlp_only_layers = [0] configures experts",
        ),
        (
            &[("model.norm_topk_prob", "true")],
            "model.norm_topk_prob = true configures experts",
        ),
        (
            &[("parallelism.expert_parallel_degree", "2")],
            "shards experts, but model.name = \"qwen3\" is the dense Qwen3",
        ),
        (&[("model.name", "llama")], "unknown variant `llama`"),
    ];
    assert_load_errors("qwen3_debug.toml", dense);
    // And a Qwen3-MoE needs them.
    let message = load_error(
        debug,
        &[("model.name", "qwen3_moe"), ("model.num_experts", "0")],
    );
    assert!(
        message.contains("model.num_experts must be at least 1"),
        "{message}"
    );
    let missing = JobConfig::load(Path::new("no/such/config.toml"), &[]).unwrap_err();
    assert!(format!("{missing:#}").contains("cannot read job config no/such/config.toml"));
}

const HUB_CONFIG: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
  "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
  "norm_topk_prob": true, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
  "max_position_embeddings": 128, "tie_word_embeddings": false, "router_aux_loss_coef": 0.001,
  "initializer_range": 0.02, "rope_scaling": null, "torch_dtype": "bfloat16"
}"#;

#[test]
fn hf_config_json_in_hub_and_transformers_v5_forms() {
    let hub: serde_json::Value = serde_json::from_str(HUB_CONFIG).unwrap();
    let from_hub = ModelConfig::from_hf_json(&hub).unwrap();
    assert_eq!(from_hub.num_experts, 8);
    assert_eq!(from_hub.rope_theta, 1e6);
    assert_eq!(from_hub.mlp_only_layers, [0]);

    let mut v5 = hub.clone();
    let object = v5.as_object_mut().unwrap();
    object.remove("num_experts");
    object.remove("rope_theta");
    object.remove("rope_scaling");
    object.insert("num_local_experts".into(), 8.into());
    object.insert(
        "rope_parameters".into(),
        serde_json::json!({"rope_theta": 1000000.0, "rope_type": "default"}),
    );
    assert_eq!(ModelConfig::from_hf_json(&v5).unwrap(), from_hub);

    let mut broken = hub.clone();
    broken["num_local_experts"] = 4.into();
    let err = ModelConfig::from_hf_json(&broken).unwrap_err().to_string();
    assert!(err.contains("disagree"), "{err}");
    let mut scaled = hub.clone();
    scaled["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0});
    let err = ModelConfig::from_hf_json(&scaled).unwrap_err().to_string();
    assert!(err.contains("rope_scaling is not supported"), "{err}");
    let mut gelu = hub.clone();
    gelu["hidden_act"] = "gelu".into();
    let err = ModelConfig::from_hf_json(&gelu).unwrap_err().to_string();
    assert!(
        err.contains("hidden_act \"gelu\" is not supported"),
        "{err}"
    );
    let mut other = hub.clone();
    other["model_type"] = "llama".into();
    let err = ModelConfig::from_hf_json(&other).unwrap_err().to_string();
    assert!(err.contains("expected \"qwen3_moe\" or \"qwen3\""), "{err}");

    // A dense Qwen3's config.json has no MoE keys; a Qwen3-MoE's must have them.
    let mut dense = hub.clone();
    let object = dense.as_object_mut().unwrap();
    for key in [
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
        "router_aux_loss_coef",
    ] {
        object.remove(key);
    }
    object.insert("model_type".into(), "qwen3".into());
    object.insert(
        "architectures".into(),
        serde_json::json!(["Qwen3ForCausalLM"]),
    );
    let config = ModelConfig::from_hf_json(&dense).unwrap();
    assert_eq!(config.name, ModelName::Qwen3);
    assert_eq!(
        (config.num_experts, config.moe_layer_count()),
        (0, 0),
        "{config:?}"
    );
    assert_eq!(config.hidden_size, from_hub.hidden_size);
    let mut moe = dense;
    moe["model_type"] = "qwen3_moe".into();
    let err = ModelConfig::from_hf_json(&moe).unwrap_err().to_string();
    assert!(err.contains("missing `num_experts`"), "{err}");
}

#[test]
fn a_job_config_can_take_its_model_from_config_json() {
    let dir = scratch("config-json");
    std::fs::write(dir.join("config.json"), HUB_CONFIG).unwrap();
    let debug = std::fs::read_to_string(shipped("qwen3_moe_debug.toml")).unwrap();
    let start = debug.find("[model]").unwrap();
    let end = debug.find("[kernels]").unwrap();
    let job = format!(
        "{}[model]\nconfig_json = \"config.json\"\n\n{}",
        &debug[..start],
        &debug[end..]
    );
    std::fs::write(dir.join("job.toml"), job).unwrap();
    let config = JobConfig::load(&dir.join("job.toml"), &[]).unwrap();
    let hub: serde_json::Value = serde_json::from_str(HUB_CONFIG).unwrap();
    assert_eq!(config.model, ModelConfig::from_hf_json(&hub).unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn cuda_training_needs_a_libtorch_moe_implementation() {
    for moe in ["cpu", "reference"] {
        let err = JobConfig::load(
            &shipped("qwen3_moe_debug.toml"),
            &overrides(&[("training.device", "cuda"), ("kernels.moe", moe)]),
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains(&format!(
                "kernels.moe = \"{moe}\" runs on the host CPU; with training.device = \"cuda\" choose torch or grouped_mm"
            )),
            "{err:#}"
        );
    }
    for moe in ["torch", "grouped_mm"] {
        let config = JobConfig::load(
            &shipped("qwen3_moe_debug.toml"),
            &overrides(&[("training.device", "cuda"), ("kernels.moe", moe)]),
        )
        .unwrap();
        assert_eq!(config.training.device.name(), "cuda");
    }
    let err = JobConfig::load(
        &shipped("qwen3_moe_debug.toml"),
        &overrides(&[("training.device", "tpu")]),
    )
    .unwrap_err();
    assert!(format!("{err:#}").contains("tpu"), "{err:#}");
}

#[test]
fn training_on_cuda_without_a_usable_gpu_says_what_is_missing() {
    if moekit_trainer::device::TrainDevice::Cuda.resolve().is_ok() {
        return; // a machine with a GPU trains on it instead
    }
    let config = JobConfig::load(
        &shipped("qwen3_moe_debug.toml"),
        &overrides(&[("training.device", "cuda"), ("kernels.moe", "torch")]),
    )
    .unwrap();
    let err = moekit_trainer::train::Trainer::new(&config, None)
        .err()
        .expect("no CUDA device here");
    let message = format!("{err:#}");
    assert!(
        message.starts_with("training.device = \"cuda\": "),
        "{message}"
    );
    assert!(
        message.contains("sees no CUDA device") || message.contains("cannot load"),
        "{message}"
    );
    assert!(message.contains("libtorch_cuda.so"), "{message}");
}

#[test]
fn expert_parallelism_needs_divisible_experts_moekit_kernels_and_mpi() {
    let load = |pairs: &[(&str, &str)]| {
        JobConfig::load(&shipped("qwen3_moe_debug.toml"), &overrides(pairs))
    };
    let err = load(&[("parallelism.expert_parallel_degree", "3")]).unwrap_err();
    assert!(
        format!("{err:#}").contains("expert_parallel_degree = 3 must divide model.num_experts = 8"),
        "{err:#}"
    );
    let err = load(&[
        ("parallelism.expert_parallel_degree", "2"),
        ("kernels.moe", "grouped_mm"),
    ])
    .unwrap_err();
    assert!(
        format!("{err:#}").contains("kernels.moe must be reference, cpu or neuron, got grouped_mm"),
        "{err:#}"
    );
    let err = load(&[("parallelism.expert_parallel_degree", "0")]).unwrap_err();
    assert!(format!("{err:#}").contains("at least 1"), "{err:#}");
    let err = load(&[("parallelism.ranks", "2")]).unwrap_err();
    assert!(format!("{err:#}").contains("ranks"), "{err:#}");
    let err = load(&[("parallelism.collective_timeout_s", "0")]).unwrap_err();
    assert!(
        format!("{err:#}").contains("parallelism.collective_timeout_s must be at least 1, got 0"),
        "{err:#}"
    );
    let config = load(&[("parallelism.collective_timeout_s", "5")]).unwrap();
    assert_eq!(config.parallelism.collective_timeout_s, 5);

    let err = load(&[("parallelism.data_parallel_degree", "0")]).unwrap_err();
    assert!(
        format!("{err:#}").contains("parallelism.data_parallel_degree must be at least 1"),
        "{err:#}"
    );
    let huge = usize::MAX / 2;
    let err = load(&[
        ("parallelism.data_parallel_degree", &huge.to_string()),
        ("parallelism.expert_parallel_degree", "4"),
    ])
    .unwrap_err();
    assert!(format!("{err:#}").contains("overflows"), "{err:#}");

    for (key, ranks) in [
        ("parallelism.expert_parallel_degree", 2),
        ("parallelism.data_parallel_degree", 2),
    ] {
        let config = load(&[(key, "2")]).unwrap();
        assert_eq!(config.parallelism.ranks().unwrap(), ranks);
        let err = moekit_trainer::train::Trainer::new(&config, None)
            .err()
            .expect("two ranks need MPI");
        assert!(
            format!("{err:#}")
                .contains("2 ranks, which need MPI: launch with `mpirun -n 2 moekit-train ...`"),
            "{err:#}"
        );
    }
}

/// Fuzzing the config parser: whatever the file or the overrides hold, `JobConfig::load`
/// returns a config or an error, never a panic, a hang or an allocation sized by a value; a
/// config it returns serialises and has a memory estimate. Bounded: a fixed number of cases
/// (`PROPTEST_CASES` overrides it).
mod fuzz {
    use proptest::prelude::*;

    use super::*;
    use moekit_trainer::footprint::StepFootprint;

    /// TOML values of every kind, the hostile ones included: extreme and negative integers,
    /// non-finite floats, empty and odd strings, arrays, inline tables.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|v| v.to_string()),
            prop::sample::select(vec![
                "0",
                "-1",
                "1",
                "2147483647",
                "2147483648",
                "4294967296",
                "9223372036854775807",
                "18446744073709551615",
            ])
            .prop_map(str::to_owned),
            any::<f64>().prop_map(|v| format!("{v:?}")),
            prop::sample::select(vec!["nan", "inf", "-inf", "1e308", "-0.0", "5e-324"])
                .prop_map(str::to_owned),
            "[a-z_./]{0,12}".prop_map(|s| format!("{s:?}")),
            prop::sample::select(vec![
                "true", "false", "[]", "[1, 2]", "[[1]]", "{}", "{a = 1}"
            ])
            .prop_map(str::to_owned),
            prop::sample::select(vec![
                "\"cpu\"",
                "\"cuda\"",
                "\"bfloat16\"",
                "\"\"",
                "\"../x\""
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// The debug config's lines with edits: `(line, value, kind)` replaces the line's value,
    /// deletes it, duplicates it, or puts a stray header there.
    fn edited_debug_config(edits: &[(prop::sample::Index, String, u8)]) -> String {
        let text = std::fs::read_to_string(shipped("qwen3_moe_debug.toml")).unwrap();
        let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
        for (at, value, kind) in edits {
            let i = at.index(lines.len());
            match kind % 4 {
                0 => {
                    if let Some((key, _)) = lines[i].split_once('=') {
                        lines[i] = format!("{key}= {value}");
                    }
                }
                1 => {
                    lines.remove(i);
                }
                2 => lines.insert(i, lines[i].clone()),
                _ => lines.insert(i, format!("[{}]", value.trim_matches('"'))),
            }
            if lines.is_empty() {
                break;
            }
        }
        lines.join("\n")
    }

    /// Every key of the shipped debug config, as overrides name them.
    fn known_keys() -> Vec<String> {
        let config = JobConfig::load(&shipped("qwen3_moe_debug.toml"), &[]).unwrap();
        config
            .entries()
            .unwrap()
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    /// Loads `text` as a config file in `dir` with `overrides`, then removes `dir`; a config
    /// that loads must serialise and have a memory estimate.
    fn load_text(dir: &Path, text: &[u8], overrides: &[(String, String)]) {
        let path = dir.join("job.toml");
        std::fs::write(&path, text).unwrap();
        if let Ok(config) = JobConfig::load(&path, overrides) {
            config.entries().unwrap();
            assert!(StepFootprint::of(&config, 1).total() > 0);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256)
        ))]

        #[test]
        fn arbitrary_bytes_load_or_are_refused(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let dir = scratch("fuzz-bytes");
            load_text(&dir, &bytes, &[]);
        }

        #[test]
        fn edited_configs_load_or_are_refused(
            edits in prop::collection::vec((any::<prop::sample::Index>(), value(), any::<u8>()), 1..6)
        ) {
            let dir = scratch("fuzz-edits");
            load_text(&dir, edited_debug_config(&edits).as_bytes(), &[]);
        }

        #[test]
        fn arbitrary_overrides_apply_or_are_refused(
            overrides in prop::collection::vec(
                (any::<prop::sample::Index>(), "[a-z_.]{0,20}", value(), any::<bool>()),
                1..5,
            )
        ) {
            let keys = known_keys();
            let overrides: Vec<(String, String)> = overrides
                .into_iter()
                .map(|(at, stray, value, known)| {
                    let key = if known { keys[at.index(keys.len())].clone() } else { stray };
                    (key, value)
                })
                .collect();
            let text = std::fs::read(shipped("qwen3_moe_debug.toml")).unwrap();
            let dir = scratch("fuzz-overrides");
            load_text(&dir, &text, &overrides);
        }
    }
}
