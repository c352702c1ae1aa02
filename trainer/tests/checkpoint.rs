//! Checkpoints end to end through `moekit-train`: resuming equals an uninterrupted run, old
//! checkpoints are rotated, exports are Hugging Face directories that evaluate like the
//! checkpoint they came from, and corrupt or mismatched checkpoints are clear errors that
//! leave every file as it was.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;

use common::{fail, metrics_lines, run, scratch, succeed};

fn debug_config() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs/qwen3_moe_debug.toml")
        .to_str()
        .unwrap()
        .to_owned()
}

/// Trains the debug config for `steps` steps into `dump` with checkpoints every `interval`.
fn train_args<'a>(dump: &'a str, config: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--config",
        config,
        "--job.dump_folder",
        dump,
        "--training.steps",
        "20",
        "--lr_scheduler.warmup_steps",
        "5",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "10",
        "--checkpoint.keep_latest_k",
        "0",
    ];
    args.extend_from_slice(extra);
    args
}

fn metrics(dump: &Path) -> Vec<Value> {
    metrics_lines(dump).unwrap()
}

fn losses(lines: &[Value]) -> Vec<(u64, f64, f64)> {
    lines
        .iter()
        .map(|m| {
            (
                m["step"].as_u64().unwrap(),
                m["loss"].as_f64().unwrap(),
                m["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// `eval --model MODEL --tokens TOKENS`.
fn eval_args<'a>(model: &'a Path, tokens: &'a Path) -> [&'a str; 5] {
    [
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--tokens",
        tokens.to_str().unwrap(),
    ]
}

/// `export --checkpoint CHECKPOINT --out OUT`.
fn export_args<'a>(checkpoint: &'a Path, out: &'a Path) -> [&'a str; 5] {
    [
        "export",
        "--checkpoint",
        checkpoint.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]
}

/// Trains the debug config for 10 steps into the scratch folder of `test` and exports the
/// step-10 checkpoint: the folder (also the run's dump folder), the checkpoint and the export.
fn trained_and_exported(test: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = scratch(test);
    let config = debug_config();
    succeed(&train_args(
        dir.to_str().unwrap(),
        &config,
        &["--training.steps", "10"],
    ));
    let ckpt = dir.join("checkpoints/step-00000010");
    let hf = dir.join("hf");
    succeed(&export_args(&ckpt, &hf));
    (dir, ckpt, hf)
}

fn write_tokens(path: &Path, ids: &[i64], shape: [usize; 2]) {
    let bytes: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::I64, shape.to_vec(), &bytes).unwrap();
    safetensors::serialize_to_file([("input_ids", view)], None, path).unwrap();
}

fn eval_json(args: &[&str]) -> Value {
    serde_json::from_str(succeed(args).trim()).unwrap()
}

#[test]
fn resume_equals_uninterrupted_and_exports_evaluate_identically() {
    let dir = scratch("resume");
    let config = debug_config();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let (a_str, b_str) = (a.to_str().unwrap(), b.to_str().unwrap());

    // Uninterrupted: 20 steps, checkpoints after steps 10 and 20.
    // Validation every 4 steps: twice before the checkpoint the run resumes from, three
    // times after it.
    let every_4 = ["--metrics.eval_interval", "4"];
    succeed(&train_args(a_str, &config, &every_4));
    let step10 = a.join("checkpoints/step-00000010");
    let step20 = a.join("checkpoints/step-00000020");
    assert!(step10.is_dir() && step20.is_dir());

    // Interrupted after step 16 (the last checkpoint at 10), with a torn metrics line: the
    // folder holds that checkpoint and the metrics logged up to the crash.
    copy_dir(&step10, &b.join("checkpoints/step-00000010"));
    let logged = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap();
    let crashed: Vec<&str> = logged.lines().take(16).collect();
    std::fs::write(
        b.join("metrics.jsonl"),
        format!("{}\n{{\"step\": 17, \"lo", crashed.join("\n")),
    )
    .unwrap();
    let stdout = succeed(&train_args(b_str, &config, &every_4));
    assert!(stdout.contains("resumed after step 10"), "{stdout}");
    let whole = losses(&metrics(&a));
    // Steps 11-16 are not logged twice and the torn line is gone; 11-20 equal the
    // uninterrupted run's.
    assert_eq!(losses(&metrics(&b)), whole, "steps 1-20 after resuming");
    // The resumed run evaluates the same validation batches: the same validation loss.
    let validation = |dump: &Path| -> Vec<(u64, f64)> {
        metrics(dump)
            .iter()
            .filter_map(|m| Some((m["step"].as_u64()?, m["val_loss"].as_f64()?)))
            .collect()
    };
    let steps: Vec<u64> = validation(&a).iter().map(|&(step, _)| step).collect();
    assert_eq!(
        steps,
        [4, 8, 12, 16, 20],
        "the debug config holds out a validation split"
    );
    assert_eq!(
        validation(&b),
        validation(&a),
        "validation losses after resuming"
    );

    // The resumed run's final checkpoint holds the same parameters as the uninterrupted one.
    let read = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert_eq!(read(&step20), read(&b.join("checkpoints/step-00000020")));

    // Export to a Hugging Face directory.
    let hf = dir.join("hf");
    let hf_str = hf.to_str().unwrap();
    succeed(&export_args(&step20, &hf));
    let config_json: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config_json["model_type"], "qwen3_moe");
    assert_eq!(config_json["num_experts"], 8);
    let bytes = std::fs::read(hf.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let shape = |key: &str| tensors.tensor(key).unwrap().shape().to_vec();
    assert_eq!(
        shape("model.layers.1.mlp.experts.7.gate_proj.weight"),
        [32, 64]
    );
    assert_eq!(
        shape("model.layers.1.mlp.experts.7.up_proj.weight"),
        [32, 64]
    );
    assert_eq!(
        shape("model.layers.1.mlp.experts.7.down_proj.weight"),
        [64, 32]
    );
    assert_eq!(shape("model.layers.0.mlp.gate.weight"), [8, 64]);
    assert_eq!(shape("model.layers.0.self_attn.q_norm.weight"), [16]);
    assert_eq!(shape("lm_head.weight"), [256, 64]);
    // 8 experts × 3 + gate per MoE layer, 4 projections + 2 head norms + 2 layer norms.
    assert_eq!(tensors.len(), 2 * (8 * 3 + 1 + 4 + 2 + 2) + 3);

    // The export and the checkpoint evaluate identically, on every implementation.
    let tokens = dir.join("tokens.safetensors");
    let text = b"the cat sees the river in the morning.\na dog finds a long letter at night.\n";
    let ids: Vec<i64> = text[..64].iter().map(|&b| i64::from(b)).collect();
    write_tokens(&tokens, &ids, [2, 32]);
    let tokens_str = tokens.to_str().unwrap();
    let from_hf = eval_json(&["eval", "--model", hf_str, "--tokens", tokens_str]);
    let from_ckpt = eval_json(&[
        "eval",
        "--model",
        step20.to_str().unwrap(),
        "--tokens",
        tokens_str,
    ]);
    assert_eq!(from_hf, from_ckpt);
    let loss = from_hf["loss"].as_f64().unwrap();
    // Untrained, the loss is ln 256 = 5.55; 20 steps bring it to about 3.
    assert!(
        loss < 4.0,
        "a trained model predicts the corpus: loss {loss}"
    );
    let total = from_hf["total_loss"].as_f64().unwrap();
    let aux = from_hf["aux_loss"].as_f64().unwrap();
    assert!((total - (loss + 0.001 * aux)).abs() < 1e-12);
    for moe in ["grouped_mm", "reference", "cpu"] {
        let other = eval_json(&[
            "eval",
            "--model",
            hf_str,
            "--tokens",
            tokens_str,
            "--kernels.moe",
            moe,
            "--kernels.block_size",
            "3",
        ]);
        let other_loss = other["loss"].as_f64().unwrap();
        assert!(
            (other_loss - loss).abs() < 1e-5 * loss,
            "{moe}: {other_loss} vs {loss}"
        );
    }

    // Logits are written as [batch, seq, vocab] f32.
    let logits = dir.join("logits.safetensors");
    succeed(&[
        "eval",
        "--model",
        hf_str,
        "--tokens",
        tokens_str,
        "--output",
        logits.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&logits).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let view = file.tensor("logits").unwrap();
    assert_eq!(
        (view.shape(), view.dtype()),
        (&[2, 32, 256][..], Dtype::F32)
    );

    // Starting a new run from the export begins where the checkpoint left off.
    let c = dir.join("c");
    succeed(&[
        "--config",
        &config,
        "--job.dump_folder",
        c.to_str().unwrap(),
        "--training.steps",
        "1",
        "--lr_scheduler.warmup_steps",
        "1",
        "--checkpoint.initial_load_path",
        hf_str,
    ]);
    let first = losses(&metrics(&c))[0].1;
    assert!(first < 4.0, "first loss from the export is {first}");

    // Exporting over an existing directory is refused and leaves it untouched.
    let before = std::fs::read(hf.join("model.safetensors")).unwrap();
    fail(&export_args(&step10, &hf), "already exists");
    assert_eq!(std::fs::read(hf.join("model.safetensors")).unwrap(), before);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let dir = scratch("rotate");
    let config = debug_config();
    let dump = dir.to_str().unwrap();
    // What a run killed while saving or drawing leaves behind: a staging folder and a plot's
    // temporary, of a process that is gone; and files of other kinds, which stay.
    let mut child = Command::new("true").spawn().unwrap();
    child.wait().unwrap();
    let gone = child.id();
    let staging = dir.join("checkpoints/step-00000012.tmp");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::write(staging.join("model.safetensors"), b"half").unwrap();
    let plot = dir.join(format!(".loss.tmp-{gone}.png"));
    std::fs::write(&plot, b"half").unwrap();
    let kept = [
        dir.join("checkpoints/notes.tmp"),
        dir.join(".loss.tmp-x.png"),
    ];
    for file in &kept {
        std::fs::write(file, b"keep").unwrap();
    }
    succeed(&train_args(
        dump,
        &config,
        &[
            "--checkpoint.interval",
            "4",
            "--checkpoint.keep_latest_k",
            "2",
        ],
    ));
    let mut names: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["notes.tmp", "step-00000016", "step-00000020"]);
    assert!(!plot.exists());
    for file in &kept {
        assert_eq!(std::fs::read(file).unwrap(), b"keep");
    }

    // An export's folder temporary of a killed process goes; the export lands.
    let out = dir.join("hf");
    let stale = dir.join(format!("hf.tmp-{gone}"));
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("config.json"), b"{").unwrap();
    succeed(&export_args(&dir.join("checkpoints/step-00000020"), &out));
    assert!(!stale.exists() && out.join("model.safetensors").is_file());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn corrupt_and_mismatched_checkpoints_are_errors_that_change_nothing() {
    let (dir, ckpt, hf) = trained_and_exported("corrupt");
    let config = debug_config();
    let dump = dir.to_str().unwrap();
    let snapshot = |path: &Path| -> Vec<(String, Vec<u8>)> {
        let mut files: Vec<_> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        files.sort();
        files
    };

    // A different model or batch shape than the checkpoint's.
    let before = snapshot(&ckpt);
    fail(
        &train_args(dump, &config, &["--model.num_experts", "4"]),
        "different [model] config",
    );
    fail(
        &train_args(dump, &config, &["--training.seq_len", "32"]),
        "training.seq_len = 64, the config says 32",
    );
    fail(
        &train_args(
            dump,
            &config,
            &["--training.gradient_accumulation_steps", "2"],
        ),
        "training.gradient_accumulation_steps = 1, the config says 2",
    );
    fail(
        &train_args(dump, &config, &["--training.dtype", "bfloat16"]),
        "training.dtype = Float32, the config says Bfloat16",
    );
    let text = dir.join("other.txt");
    // Long enough for the tenth the debug config holds out to fill a validation batch.
    std::fs::write(&text, "other training text. ".repeat(4000)).unwrap();
    fail(
        &train_args(
            dump,
            &config,
            &["--data.files", &format!("[\"{}\"]", text.display())],
        ),
        "the checkpoint was trained on other data",
    );
    assert_eq!(snapshot(&ckpt), before);

    // A truncated tensor file, in the only checkpoint: nothing to resume from, nothing moved.
    let model = ckpt.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    let before = snapshot(&ckpt);
    fail(&train_args(dump, &config, &[]), "no checkpoint in");
    fail(
        &train_args(dump, &config, &[]),
        "model.safetensors is damaged",
    );
    fail(
        &export_args(&ckpt, &dir.join("x")),
        "model.safetensors is damaged",
    );
    assert!(!dir.join("x").exists());
    assert_eq!(snapshot(&ckpt), before);

    // Without its manifest (a checkpoint written before checksums), the same file is read and
    // refused by the safetensors reader.
    let manifest = std::fs::read(ckpt.join("checksums.json")).unwrap();
    std::fs::remove_file(ckpt.join("checksums.json")).unwrap();
    fail(
        &train_args(dump, &config, &[]),
        "not a valid safetensors file",
    );
    std::fs::write(ckpt.join("checksums.json"), manifest).unwrap();

    // A missing state file.
    std::fs::write(&model, &bytes).unwrap();
    std::fs::remove_file(ckpt.join("state.json")).unwrap();
    fail(
        &train_args(dump, &config, &[]),
        "state.json`, listed in checksums.json, is missing",
    );

    // Evaluation inputs: token ids outside the vocabulary, a wrong dtype, a missing model.
    let tokens = dir.join("tokens.safetensors");
    write_tokens(&tokens, &[1, 2, 300, 4], [1, 4]);
    std::fs::write(ckpt.join("state.json"), b"{}").unwrap();
    fail(&eval_args(&ckpt, &tokens), "state.json is damaged");
    std::fs::remove_file(ckpt.join("checksums.json")).unwrap();
    fail(&eval_args(&ckpt, &tokens), "is not a valid training state");
    fail(
        &eval_args(&hf, &tokens),
        "token id 300 outside the vocabulary [0, 256)",
    );
    write_tokens(&tokens, &[1], [1, 1]);
    fail(
        &eval_args(&hf, &tokens),
        "at least one sequence of 2 or more tokens",
    );
    let floats = dir.join("floats.safetensors");
    let bytes: Vec<u8> = [1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, vec![1, 2], &bytes).unwrap();
    safetensors::serialize_to_file([("input_ids", view)], None, &floats).unwrap();
    fail(&eval_args(&hf, &floats), "input_ids must be i64 or i32");
    fail(
        &eval_args(&dir.join("none"), &floats),
        "cannot read model config",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_newest_good_one() {
    let dir = scratch("damaged");
    let config = debug_config();
    let (damaged, clean) = (dir.join("damaged"), dir.join("clean"));
    for run in [&damaged, &clean] {
        succeed(&train_args(run.to_str().unwrap(), &config, &[]));
    }
    let folder = damaged.join("checkpoints");
    let newest = folder.join("step-00000020");
    // One flipped bit in the last tensor's data: the file still parses.
    let model = newest.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 0x10;
    std::fs::write(&model, &bytes).unwrap();
    fail(
        &export_args(&newest, &dir.join("x")),
        "model.safetensors is damaged",
    );

    // Resuming to step 30 starts from step 10, keeps the damaged checkpoint aside, untouched,
    // and trains steps 11 to 30 exactly as a run resumed from the same good checkpoint does.
    let out = run(&train_args(
        damaged.to_str().unwrap(),
        &config,
        &["--training.steps", "30"],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("model.safetensors is damaged")
            && stderr.contains("step-00000010 (step 10)")
            && stderr.contains("step-00000020.damaged"),
        "{stderr}"
    );
    let aside = folder.join("step-00000020.damaged");
    assert_eq!(
        std::fs::read(aside.join("model.safetensors")).unwrap(),
        bytes
    );
    for step in ["step-00000010", "step-00000020", "step-00000030"] {
        assert!(folder.join(step).join("checksums.json").is_file(), "{step}");
    }
    std::fs::remove_dir_all(clean.join("checkpoints/step-00000020")).unwrap();
    succeed(&train_args(
        clean.to_str().unwrap(),
        &config,
        &["--training.steps", "30"],
    ));
    let tail = |run: &Path| {
        let all = losses(&metrics(run));
        all[all.len() - 20..].to_vec()
    };
    assert_eq!(tail(&damaged), tail(&clean));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bf16_balanced_runs_learn_and_resume_exactly_with_master_weights_and_biases() {
    let dir = scratch("bf16");
    let config = debug_config();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let bf16 = [
        "--training.dtype",
        "bfloat16",
        "--training.load_balance_coeff",
        "0.001",
    ];
    succeed(&train_args(a.to_str().unwrap(), &config, &bf16));
    copy_dir(
        &a.join("checkpoints/step-00000010"),
        &b.join("checkpoints/step-00000010"),
    );
    succeed(&train_args(b.to_str().unwrap(), &config, &bf16));
    let whole = losses(&metrics(&a));
    assert_eq!(
        losses(&metrics(&b)),
        whole[10..],
        "steps 11-20 after resuming"
    );
    assert!(
        whole[19].1 < whole[0].1 - 1.0,
        "bf16 loss falls: {} -> {}",
        whole[0].1,
        whole[19].1
    );
    // The checkpoint stores bf16 parameters and their f32 master copies.
    let bytes = std::fs::read(a.join("checkpoints/step-00000020/optimizer.safetensors")).unwrap();
    let state = SafeTensors::deserialize(&bytes).unwrap();
    let master = state.tensor("master.model.norm.weight").unwrap();
    assert_eq!(master.dtype(), Dtype::F32);
    let bytes = std::fs::read(a.join("checkpoints/step-00000020/model.safetensors")).unwrap();
    let model = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        model.tensor("model.norm.weight").unwrap().dtype(),
        Dtype::BF16
    );
    // The aux-loss-free selection biases moved, are saved in f32, and are restored on resume
    // (the resumed losses above depend on them).
    let bias = model.tensor("model.layers.1.mlp.expert_bias").unwrap();
    assert_eq!((bias.dtype(), bias.shape()), (Dtype::F32, &[8][..]));
    assert!(bias.data().iter().any(|&b| b != 0));
    // The Hugging Face export leaves them out, and says so.
    let out = run(&export_args(
        &a.join("checkpoints/step-00000020"),
        &dir.join("hf"),
    ));
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("selection biases"));
    let bytes = std::fs::read(dir.join("hf/model.safetensors")).unwrap();
    let export = SafeTensors::deserialize(&bytes).unwrap();
    assert!(export.names().iter().all(|n| !n.contains("expert_bias")));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Writes the tensors of the Hugging Face directory `hf` (bf16) into `sharded` split over two
/// shards with an index, as large Hub checkpoints are: the index.
fn write_sharded(hf: &Path, sharded: &Path) -> Value {
    std::fs::create_dir_all(sharded).unwrap();
    std::fs::copy(hf.join("config.json"), sharded.join("config.json")).unwrap();
    let bytes = std::fs::read(hf.join("model.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut names = file.names();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (shard, part) in [
        (1, &names[..names.len() / 2]),
        (2, &names[names.len() / 2..]),
    ] {
        let shard_name = format!("model-0000{shard}-of-00002.safetensors");
        let views: Vec<(String, TensorView<'_>)> = part
            .iter()
            .map(|name| {
                let t = file.tensor(name).unwrap();
                assert_eq!(t.dtype(), Dtype::BF16, "{name}");
                (
                    name.to_string(),
                    TensorView::new(t.dtype(), t.shape().to_vec(), t.data()).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &sharded.join(&shard_name)).unwrap();
        for name in part {
            weight_map.insert(name.to_string(), shard_name.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();
    index
}

/// Trains `config` for 5 steps in bf16 into `dir/run` with checkpoints and exports the step-5
/// checkpoint to `dir/hf`: the checkpoint, the export and its `config.json`.
fn trained_bf16_export(dir: &Path, config: &str) -> (PathBuf, PathBuf, Value) {
    let dump = dir.join("run");
    succeed(&train_args(
        dump.to_str().unwrap(),
        config,
        &["--training.steps", "5", "--training.dtype", "bfloat16"],
    ));
    let ckpt = dump.join("checkpoints/step-00000005");
    let hf = dir.join("hf");
    succeed(&export_args(&ckpt, &hf));
    let config_json: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    (ckpt, hf, config_json)
}

#[test]
fn dense_qwen3_exports_and_sharded_directories_load_like_their_checkpoint() {
    let dir = scratch("dense-shards");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3_debug.toml");
    let (ckpt, hf, config_json) = trained_bf16_export(&dir, config.to_str().unwrap());
    assert_eq!(config_json["model_type"], "qwen3");
    let sharded = dir.join("sharded");
    write_sharded(&hf, &sharded);
    let tokens = dir.join("tokens.safetensors");
    let ids: Vec<i64> = b"a dog finds the old map"
        .iter()
        .map(|&b| i64::from(b))
        .collect();
    write_tokens(&tokens, &ids, [1, ids.len()]);
    let from_ckpt = eval_json(&eval_args(&ckpt, &tokens));
    assert_eq!(eval_json(&eval_args(&hf, &tokens)), from_ckpt);
    assert_eq!(eval_json(&eval_args(&sharded, &tokens)), from_ckpt);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bf16_and_sharded_hugging_face_directories_load_like_their_checkpoint() {
    let dir = scratch("shards");
    let (ckpt, hf, config_json) = trained_bf16_export(&dir, &debug_config());
    assert_eq!(config_json["torch_dtype"], "bfloat16");

    // The same tensors split over two shards with an index, as large Hub checkpoints are.
    let sharded = dir.join("sharded");
    let index = write_sharded(&hf, &sharded);

    let tokens = dir.join("tokens.safetensors");
    let ids: Vec<i64> = b"the red fox paints a long letter at night."[..40]
        .iter()
        .map(|&b| i64::from(b))
        .collect();
    write_tokens(&tokens, &ids, [2, 20]);
    let eval = |model: &Path| {
        eval_json(&[
            "eval",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            tokens.to_str().unwrap(),
        ])
    };
    let from_ckpt = eval(&ckpt);
    assert_eq!(eval(&hf), from_ckpt);
    assert_eq!(eval(&sharded), from_ckpt);

    // An index naming a tensor its shard lacks is an error.
    let mut broken = index.clone();
    broken["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors".into();
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_string(&broken).unwrap(),
    )
    .unwrap();
    fail(
        &eval_args(&sharded, &tokens),
        "`model.extra.weight` is not in its shard",
    );

    // An index may only name files of its own directory.
    for outside in [
        "../hf/model.safetensors",
        "/etc/passwd",
        "sub/model.safetensors",
    ] {
        let mut escaping = index.clone();
        escaping["weight_map"]["model.embed_tokens.weight"] = outside.into();
        std::fs::write(
            sharded.join("model.safetensors.index.json"),
            serde_json::to_string(&escaping).unwrap(),
        )
        .unwrap();
        fail(
            &eval_args(&sharded, &tokens),
            &format!("shard `{outside}` is not a file name"),
        );
    }

    // A tensor the model does not have loads with a warning naming it.
    let mut tensors = read_raw(&hf.join("model.safetensors"));
    let extra = tensors[0].clone();
    tensors.push((
        "model.unknown_extra.weight".to_owned(),
        extra.1,
        extra.2,
        extra.3,
    ));
    write_raw(&hf.join("model.safetensors"), &tensors);
    let out = run(&eval_args(&hf, &tokens));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "1 tensor(s) the model does not have, not loaded: model.unknown_extra.weight"
        ),
        "{stderr}"
    );
    let loaded: Value =
        serde_json::from_str(String::from_utf8(out.stdout).unwrap().trim()).unwrap();
    assert_eq!(loaded, from_ckpt);
    std::fs::remove_dir_all(dir).unwrap();
}

/// A safetensors file's tensors: name, dtype, shape and bytes, in name order.
type RawTensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn read_raw(path: &Path) -> RawTensors {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: RawTensors = file
        .tensors()
        .into_iter()
        .map(|(name, t)| (name, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

fn write_raw(path: &Path, tensors: &RawTensors) {
    let views = tensors.iter().map(|(name, dtype, shape, bytes)| {
        (
            name.clone(),
            TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
        )
    });
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// `tensors` with `edit` applied to the tensor called `name` (which must exist).
fn edited(
    tensors: &RawTensors,
    name: &str,
    edit: impl Fn(&mut (String, Dtype, Vec<usize>, Vec<u8>)),
) -> RawTensors {
    let mut tensors = tensors.clone();
    edit(tensors.iter_mut().find(|t| t.0 == name).unwrap());
    tensors
}

#[test]
fn malformed_tensors_and_configs_are_errors_before_anything_is_built_from_them() {
    let (dir, ckpt, hf) = trained_and_exported("malformed");
    let config = debug_config();
    let dump = dir.to_str().unwrap();
    let tokens = dir.join("tokens.safetensors");
    write_tokens(&tokens, &[1, 2, 3, 4], [1, 4]);

    // Hugging Face directories: per-expert tensors of other shapes, integer parameters and
    // extents libtorch cannot hold.
    let weights = hf.join("model.safetensors");
    let original = read_raw(&weights);
    let gate = "model.layers.0.mlp.experts.1.gate_proj.weight";
    let down = "model.layers.1.mlp.experts.0.down_proj.weight";
    let flattened = |t: &mut (String, Dtype, Vec<usize>, Vec<u8>)| t.2 = vec![t.2.iter().product()];
    let cases = [
        (
            edited(&original, gate, flattened),
            format!("tensor `{gate}` has shape [2048], the model expects [32, 64]"),
        ),
        (
            edited(&original, down, flattened),
            format!("tensor `{down}` has shape [2048], the model expects [64, 32]"),
        ),
        (
            edited(&original, "model.embed_tokens.weight", |t| t.1 = Dtype::I32),
            "tensor for `model.embed_tokens.weight` holds Int values".to_owned(),
        ),
        (
            [
                original.clone(),
                vec![("extra".to_owned(), Dtype::F32, vec![0, 1 << 63], vec![])],
            ]
            .concat(),
            "tensor `extra`: shape [0, 9223372036854775808] is too large".to_owned(),
        ),
    ];
    for (tensors, expected) in &cases {
        write_raw(&weights, tensors);
        fail(&eval_args(&hf, &tokens), expected);
    }
    write_raw(&weights, &original);
    let config_json = hf.join("config.json");
    let original_config = std::fs::read_to_string(&config_json).unwrap();
    let mut value: Value = serde_json::from_str(&original_config).unwrap();
    for (vocab_size, expected) in [
        (1u64 << 63, "model.vocab_size must be at most 2147483647"),
        (2_000_000_000, "GiB, more than "),
    ] {
        value["vocab_size"] = vocab_size.into();
        std::fs::write(&config_json, value.to_string()).unwrap();
        fail(&eval_args(&hf, &tokens), expected);
    }
    std::fs::write(&config_json, &original_config).unwrap();
    let baseline = eval_json(&eval_args(&hf, &tokens));

    // The same checkpoint split as two ranks save it merges back into the same model; a rank
    // whose experts have another shape is an error.
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&sharded).unwrap();
    let mut state: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json")).unwrap()).unwrap();
    state["expert_parallel_degree"] = 2.into();
    std::fs::write(sharded.join("state.json"), state.to_string()).unwrap();
    let is_expert = |name: &str| {
        name.ends_with("mlp.experts.gate_up_proj") || name.ends_with("mlp.experts.down_proj")
    };
    for file in ["model", "optimizer"] {
        let whole = read_raw(&ckpt.join(format!("{file}.safetensors")));
        for rank in 0..2 {
            let part: RawTensors = whole
                .iter()
                .map(|(name, dtype, shape, bytes)| {
                    if !is_expert(name) {
                        return (name.clone(), *dtype, shape.clone(), bytes.clone());
                    }
                    let half = bytes.len() / 2;
                    let mut shape = shape.clone();
                    shape[0] /= 2;
                    let bytes = bytes[rank * half..(rank + 1) * half].to_vec();
                    (name.clone(), *dtype, shape, bytes)
                })
                .collect();
            write_raw(
                &sharded.join(format!("{file}-rank{rank}-of-2.safetensors")),
                &part,
            );
        }
    }
    assert_eq!(eval_json(&eval_args(&sharded, &tokens)), baseline);
    let merged = dir.join("merged");
    succeed(&export_args(&sharded, &merged));
    assert_eq!(read_raw(&merged.join("model.safetensors")), original);

    let rank1 = sharded.join("model-rank1-of-2.safetensors");
    let name = "model.layers.0.mlp.experts.gate_up_proj";
    let fewer = edited(&read_raw(&rank1), name, |t| {
        t.2[0] /= 2;
        t.3.truncate(t.3.len() / 2);
    });
    write_raw(&rank1, &fewer);
    fail(
        &eval_args(&sharded, &tokens),
        &format!("rank 1's `{name}` has shape [2, 64, 2, 32], rank 0's has [4, 64, 2, 32]"),
    );

    // Optimizer state of another dtype stops a resume: as damage to the checkpoint, and, with
    // no manifest to catch it, when the state is read.
    let optimizer = ckpt.join("optimizer.safetensors");
    let moments = read_raw(&optimizer);
    let key = moments[0].0.clone();
    write_raw(&optimizer, &edited(&moments, &key, |t| t.1 = Dtype::I32));
    fail(
        &train_args(dump, &config, &[]),
        "optimizer.safetensors is damaged",
    );
    std::fs::remove_file(ckpt.join("checksums.json")).unwrap();
    fail(
        &train_args(dump, &config, &[]),
        &format!("optimizer state `{key}` holds Int values"),
    );
    std::fs::remove_dir_all(dir).unwrap();
}
