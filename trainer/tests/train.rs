//! `moekit-train` end to end: the debug config learns, runs repeat exactly, and bad command
//! lines and diverging runs fail with a message and a non-zero exit.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use common::{fail, metrics_lines, run as train, scratch, succeed, word_level_tokenizer};

fn debug_config() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3_moe_debug.toml")
}

/// Trains the debug config into `dump`, with extra `args`, and returns metrics.jsonl's lines.
fn train_debug(dump: &Path, args: &[&str]) -> Vec<Value> {
    let config = debug_config();
    let mut all = vec![
        "--config",
        config.to_str().unwrap(),
        "--job.dump_folder",
        dump.to_str().unwrap(),
    ];
    all.extend_from_slice(args);
    succeed(&all);
    metrics_lines(dump).unwrap()
}

fn field(metrics: &[Value], name: &str) -> Vec<f64> {
    metrics.iter().map(|m| m[name].as_f64().unwrap()).collect()
}

#[test]
fn the_debug_config_learns_the_builtin_corpus() {
    let dir = scratch("learns");
    let metrics = train_debug(&dir, &[]);
    assert_eq!(metrics.len(), 200);
    let loss = field(&metrics, "loss");
    // An untrained model is close to uniform over the 256 byte values: ln 256 = 5.55.
    assert!(
        (loss[0] - 256f64.ln()).abs() < 0.3,
        "first loss {}",
        loss[0]
    );
    let last = loss[190..].iter().sum::<f64>() / 10.0;
    assert!(last < 1.0, "mean loss of the last 10 steps is {last}");
    // The held-out tenth of the corpus, evaluated every log_freq = 20 steps, falls too.
    let validated: Vec<(usize, f64)> = metrics
        .iter()
        .filter_map(|m| Some((m["step"].as_u64()? as usize, m["val_loss"].as_f64()?)))
        .collect();
    let steps: Vec<usize> = validated.iter().map(|&(step, _)| step).collect();
    assert_eq!(steps, (1..=10).map(|i| 20 * i).collect::<Vec<_>>());
    let (first_val, last_val) = (validated[0].1, validated[9].1);
    assert!(
        last_val < 1.0 && last_val < first_val,
        "validation loss {first_val} at step 20, {last_val} at step 200"
    );
    let load = &metrics[199]["expert_load"];
    assert_eq!(load.as_array().unwrap().len(), 2, "one entry per MoE layer");
    let total: f64 = ["min", "max"]
        .iter()
        .map(|k| load[0][k].as_f64().unwrap())
        .sum();
    assert!(total > 0.0 && load[0]["cv"].as_f64().unwrap() >= 0.0);
    // The plots are PNG images of the stated sizes (width, height from the IHDR chunk).
    for (name, size) in [("loss.png", (900, 520)), ("expert_load.png", (840, 260))] {
        let png = std::fs::read(dir.join(name)).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}");
        let dim = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        assert_eq!((dim(16), dim(20)), size, "{name}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn runs_with_the_same_config_repeat_exactly() {
    let dir = scratch("repeat");
    let args = ["--training.steps", "15", "--lr_scheduler.warmup_steps", "3"];
    let first = train_debug(&dir, &args);
    let second = train_debug(&dir, &args);
    for name in ["loss", "aux_loss", "grad_norm", "lr"] {
        assert_eq!(field(&first, name), field(&second, name), "{name}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn gradient_accumulation_of_equal_halves_matches_one_batch() {
    // Two micro-batches of 8 sequences see the same 16 sequences as one batch of 16 when the
    // data order is the same. The auxiliary loss is off: it is not a mean over sequences.
    let dir = scratch("accumulate");
    let one_step = [
        "--training.steps",
        "1",
        "--lr_scheduler.warmup_steps",
        "0",
        "--model.router_aux_loss_coef",
        "0",
    ];
    let whole = train_debug(&dir, &one_step);
    let halves = train_debug(
        &dir,
        &[
            &one_step[..],
            &[
                "--training.batch_size",
                "8",
                "--training.gradient_accumulation_steps",
                "2",
            ],
        ]
        .concat(),
    );
    let (a, b) = (field(&whole, "loss")[0], field(&halves, "loss")[0]);
    assert!((a - b).abs() < 1e-5 * a, "loss {a} vs {b}");
    let (a, b) = (
        field(&whole, "grad_norm")[0],
        field(&halves, "grad_norm")[0],
    );
    assert!((a - b).abs() < 1e-4 * a, "grad_norm {a} vs {b}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_command_lines_fail_with_a_message() {
    let config = debug_config();
    let config = config.to_str().unwrap();
    let huge = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs/qwen3_moe_235b_a22b.toml")
        .to_str()
        .unwrap()
        .to_owned();
    let help = train(&["--config", config, "--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).starts_with("usage: moekit-train"));
    for (args, expected) in [
        (vec![], "missing `--config FILE`"),
        (
            vec!["--config", config, "--training.steps"],
            "`--training.steps` needs a value",
        ),
        (
            vec!["--config", config, "stray"],
            "unexpected argument `stray`",
        ),
        (
            vec!["--config", config, "--training.steps", "-3"],
            "in section [training]",
        ),
        (
            vec!["--config", "missing.toml"],
            "cannot read job config missing.toml",
        ),
        (
            vec!["--config", "/dev/zero"],
            "cannot read job config /dev/zero: /dev/zero: not a regular file",
        ),
        (vec!["--config", &huge], "GiB, more than "),
    ] {
        fail(&args, expected);
    }
}

#[test]
fn a_diverging_run_stops_with_a_message() {
    let dir = scratch("diverge");
    let config = debug_config();
    let out = train(&[
        "--config",
        config.to_str().unwrap(),
        "--job.dump_folder",
        dir.to_str().unwrap(),
        "--optimizer.lr",
        "1e30",
        "--lr_scheduler.warmup_steps",
        "0",
        "--training.max_norm",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    // The first non-finite value stops the run: the loss, a kernel's validated input, or the
    // gradient norm, whichever the divergence reaches first.
    assert!(stderr.contains("error: step "), "{stderr}");
    assert!(
        ["not finite", "non-finite"]
            .iter()
            .any(|m| stderr.contains(m)),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn aux_loss_free_balancing_evens_out_the_expert_load() {
    // Without the auxiliary loss the router concentrates on a few experts; the selection bias
    // update spreads the load again.
    let mean_cv = |coeff: &str| {
        let dir = scratch(&format!("balance-{coeff}"));
        let metrics = train_debug(
            &dir,
            &[
                "--training.steps",
                "80",
                "--model.router_aux_loss_coef",
                "0",
                "--training.load_balance_coeff",
                coeff,
            ],
        );
        std::fs::remove_dir_all(dir).unwrap();
        let last = &metrics[60..];
        let cvs: Vec<f64> = last
            .iter()
            .flat_map(|m| m["expert_load"].as_array().unwrap().clone())
            .map(|layer| layer["cv"].as_f64().unwrap())
            .collect();
        cvs.iter().sum::<f64>() / cvs.len() as f64
    };
    let (free, balanced) = (mean_cv("0"), mean_cv("0.01"));
    assert!(
        balanced < 0.5 * free,
        "coefficient of variation of the expert load: {balanced} with the bias, {free} without"
    );
}

#[test]
fn a_missing_plot_font_skips_the_plots_with_a_warning() {
    let dir = scratch("no-font");
    let config = debug_config();
    let out = Command::new(env!("CARGO_BIN_EXE_moekit-train"))
        .env("MOEKIT_PLOT_FONT", "/no/such/font.ttf")
        .args([
            "--config",
            config.to_str().unwrap(),
            "--job.dump_folder",
            dir.to_str().unwrap(),
            "--training.steps",
            "3",
            "--lr_scheduler.warmup_steps",
            "1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("plots skipped: no font for the plot labels (tried /no/such/font.ttf"));
    assert!(dir.join("metrics.jsonl").is_file());
    assert!(!dir.join("loss.png").exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// A word-level `tokenizer.json` covering the built-in corpus: one id per word and per
/// punctuation mark, `[UNK]` = 0.
fn word_tokenizer(path: &Path) -> usize {
    let corpus = moekit_trainer::data::builtin_corpus(1 << 16);
    let mut words: Vec<&str> = corpus
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .collect();
    words.sort_unstable();
    words.dedup();
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    vocab.insert(".".into(), 1.into());
    for (id, word) in words.iter().enumerate() {
        vocab.insert((*word).into(), (id + 2).into());
    }
    let size = vocab.len();
    let json = word_level_tokenizer(vocab, "[UNK]");
    std::fs::write(path, serde_json::to_string(&json).unwrap()).unwrap();
    size
}

#[test]
fn a_tokenizer_json_s_own_truncation_and_padding_leave_the_text_whole() {
    let dir = scratch("tokenizer-settings");
    let plain = dir.join("plain.json");
    word_tokenizer(&plain);
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&plain).unwrap()).unwrap();
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0
    });
    json["padding"] = serde_json::json!({
        "strategy": {"Fixed": 512}, "direction": "Right", "pad_to_multiple_of": null,
        "pad_id": 0, "pad_type_id": 0, "pad_token": "[UNK]"
    });
    let shaped = dir.join("shaped.json");
    std::fs::write(&shaped, json.to_string()).unwrap();
    let text = moekit_trainer::data::builtin_corpus(1000);
    let ids = |path: &Path| {
        moekit_trainer::data::TextTokenizer::load(path.to_str().unwrap())
            .unwrap()
            .encode(&text)
            .unwrap()
    };
    let whole = ids(&plain);
    assert!(whole.len() > 100, "{}", whole.len());
    assert_eq!(ids(&shaped), whole);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_hugging_face_tokenizer_json_tokenizes_the_training_text() {
    let dir = scratch("tokenizer");
    let tokenizer = dir.join("tokenizer.json");
    let vocab = word_tokenizer(&tokenizer);
    let tokenizer = tokenizer.to_str().unwrap();
    let metrics = train_debug(
        &dir.join("run"),
        &[
            "--data.tokenizer",
            tokenizer,
            "--training.steps",
            "40",
            "--lr_scheduler.warmup_steps",
            "5",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "40",
        ],
    );
    let loss = field(&metrics, "loss");
    // Words are far more predictable than bytes: the loss falls well below its start.
    assert!(loss[39] < loss[0] - 2.0, "loss {} -> {}", loss[0], loss[39]);

    // The checkpoint and its export carry the tokenizer, so generation reads words in and out.
    let file = std::fs::read(tokenizer).unwrap();
    let checkpoint = dir.join("run/checkpoints/step-00000040");
    let export = dir.join("hf");
    let (checkpoint_str, export_str) = (checkpoint.to_str().unwrap(), export.to_str().unwrap());
    succeed(&[
        "export",
        "--checkpoint",
        checkpoint_str,
        "--out",
        export_str,
    ]);
    let json: Value = serde_json::from_slice(&file).unwrap();
    let word_of: std::collections::HashMap<i64, &str> = json["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(word, id)| (id.as_i64().unwrap(), word.as_str()))
        .collect();
    for model in [&checkpoint, &export] {
        assert_eq!(std::fs::read(model.join("tokenizer.json")).unwrap(), file);
        let model = model.to_str().unwrap();
        let out = succeed(&[
            "generate",
            "--model",
            model,
            "--prompt",
            "the cat",
            "--max-new-tokens",
            "6",
            "--json",
        ]);
        let record: Value = serde_json::from_str(&out).unwrap();
        let ids = |key: &str| -> Vec<i64> {
            record[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| id.as_i64().unwrap())
                .collect()
        };
        let prompt: Vec<&str> = ids("prompt_ids").iter().map(|id| word_of[id]).collect();
        assert_eq!(prompt, ["the", "cat"], "{model}");
        let words: Vec<&str> = ids("generated_ids").iter().map(|id| word_of[id]).collect();
        assert_eq!(record["text"].as_str().unwrap(), words.join(" "), "{model}");
    }

    let config = debug_config();
    let config = config.to_str().unwrap();
    let small = (vocab - 1).to_string();
    for (args, expected) in [
        (
            vec![
                "--data.tokenizer",
                tokenizer,
                "--model.vocab_size",
                small.as_str(),
            ],
            format!("has {vocab} tokens, more than model.vocab_size {small}"),
        ),
        (
            vec!["--data.tokenizer", config],
            format!("cannot load tokenizer {config}"),
        ),
    ] {
        let dump = dir.join("bad");
        let mut all = vec![
            "--config",
            config,
            "--job.dump_folder",
            dump.to_str().unwrap(),
        ];
        all.extend(args);
        let out = train(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(stderr.contains(&expected), "`{stderr}` lacks `{expected}`");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bench_reports_every_implementation_relative_to_the_peers() {
    let config = debug_config();
    let out = succeed(&[
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--bench.warmup",
        "1",
        "--bench.steps",
        "2",
        "--bench.json",
        "true",
    ]);
    let rows: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = rows.iter().map(|r| r["moe"].as_str().unwrap()).collect();
    assert_eq!(names, ["torch", "grouped_mm", "reference", "cpu"]);
    let torch = rows[0]["tokens_per_second"].as_f64().unwrap();
    for row in &rows {
        let rate = row["tokens_per_second"].as_f64().unwrap();
        assert!(rate > 0.0 && row["pct_of_peak"].as_f64().unwrap() > 0.0);
        let vs_torch = row["vs_torch"].as_f64().unwrap();
        assert!((vs_torch - rate / torch).abs() < 1e-9 * vs_torch);
        // Same model, data and seed: the implementations' losses agree.
        let loss = row["last_loss"].as_f64().unwrap();
        let torch_loss = rows[0]["last_loss"].as_f64().unwrap();
        assert!((loss - torch_loss).abs() < 1e-4 * torch_loss, "{row}");
        // Over two steps every median is a mean, so the phases' medians add up to at most
        // the step's; the phases are nearly all of it.
        let phases = ["forward", "backward", "clip", "optimizer"]
            .map(|phase| row["phases_ms"][phase].as_f64().unwrap());
        assert!(phases.iter().all(|&ms| ms >= 0.0) && phases[0] > 0.0 && phases[1] > 0.0);
        let (sum, step) = (phases.iter().sum::<f64>(), row["step_ms"].as_f64().unwrap());
        assert!(sum <= step * (1.0 + 1e-9) && sum >= 0.5 * step, "{row}");
    }
    let out = train(&[
        "bench",
        "--config",
        config.to_str().unwrap(),
        "--bench.impls",
        "numpy",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown MoE implementation `numpy`"));
    let max = u64::MAX.to_string();
    for (flags, expected) in [
        (["--bench.steps", "0"], "bench.steps must be at least 1"),
        (
            ["--bench.warmup", max.as_str()],
            "bench.warmup + bench.steps overflows",
        ),
    ] {
        let mut args = vec!["bench", "--config", config.to_str().unwrap()];
        args.extend(flags);
        fail(&args, expected);
    }
}

/// `moekit-train` with `args` under an address-space limit of `gib` GiB (`ulimit -v`, set in
/// the child only).
fn run_limited(gib: u64, args: &[&str]) -> Output {
    Command::new("sh")
        .arg("-c")
        .arg(r#"ulimit -v "$0" && exec "$@""#)
        .arg((gib << 20).to_string())
        .arg(env!("CARGO_BIN_EXE_moekit-train"))
        .args(args)
        .output()
        .unwrap()
}

/// A step that cannot fit is refused before anything is allocated, with the estimate and the
/// limit in the message, never a libtorch allocation failure: under a 6 GiB address-space
/// limit, 512 × 512 tokens a step of the debug model (activations 5.9 GiB and logits 1.0 GiB
/// by the estimate; measured peak 6.1 GiB above libtorch's own) and 2^22-slot MoE blocks are
/// refused, while the debug config's own step trains under the same limit.
#[test]
fn a_step_beyond_the_memory_limit_is_refused_with_its_estimate() {
    let dump = scratch("memory-limit");
    let config = debug_config();
    let args = vec![
        "train",
        "--config",
        config.to_str().unwrap(),
        "--job.dump_folder",
        dump.to_str().unwrap(),
        "--training.steps",
        "2",
        "--lr_scheduler.warmup_steps",
        "0",
    ];
    let out = run_limited(6, &args);
    assert!(
        out.status.success(),
        "the debug config failed under the limit:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let refused = |extra: &[&str], expected: &[&str]| {
        let all: Vec<&str> = args.iter().chain(extra).copied().collect();
        let out = run_limited(6, &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {stderr}");
        for expected in expected {
            assert!(stderr.contains(expected), "`{stderr}` lacks `{expected}`");
        }
    };
    refused(
        &["--training.batch_size", "512", "--training.seq_len", "512"],
        &[
            "a training step of 512 × 512 tokens (parameters, gradients and AdamW state 0.0 GiB, \
             activations 5.9 GiB, logits 1.0 GiB, MoE block padding 0.0 GiB;",
            "needs 6.9 GiB, more than the ",
            "that the address-space limit of 6.0 GiB (ulimit -v) leaves this process",
        ],
    );
    // 2^22-slot blocks: E = 8 blocks of padding in each of the 2 MoE layers.
    refused(
        &["--kernels.block_size", "4194304"],
        &[
            "MoE block padding 72.0 GiB;",
            "needs 72.0 GiB, more than the ",
        ],
    );
    std::fs::remove_dir_all(&dump).unwrap();
}

/// `eval` checks its estimate too: 2048 × 512 tokens under a 2 GiB address-space limit are
/// refused before the forward, and an endless `--tokens` input is refused, not read.
#[test]
fn evaluation_beyond_the_memory_limit_is_refused_with_its_estimate() {
    let dump = scratch("evaluation-limit");
    train_debug(
        &dump,
        &[
            "--training.steps",
            "2",
            "--lr_scheduler.warmup_steps",
            "0",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
        ],
    );
    let shape = [2048, 512];
    let bytes = vec![0u8; shape[0] * shape[1] * 8];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, shape.to_vec(), &bytes)
            .unwrap();
    let tokens = dump.join("tokens.safetensors");
    safetensors::serialize_to_file([("input_ids", view)], None, &tokens).unwrap();
    let checkpoint = dump.join("checkpoints/step-00000002");
    let eval = |tokens: &Path| {
        run_limited(
            2,
            &[
                "eval",
                "--model",
                checkpoint.to_str().unwrap(),
                "--tokens",
                tokens.to_str().unwrap(),
            ],
        )
    };
    for (tokens, expected) in [
        (
            tokens.as_path(),
            "error: evaluating [2048, 512] tokens at once needs, beyond the loaded model, ",
        ),
        (Path::new("/dev/zero"), "/dev/zero: not a regular file"),
    ] {
        let out = eval(tokens);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.contains(expected), "`{stderr}` lacks `{expected}`");
    }
    std::fs::remove_dir_all(&dump).unwrap();
}
