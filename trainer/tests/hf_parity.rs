//! Hugging Face parity, against transformers itself (`tests/hf_parity.py`, run with the
//! project venv's Python, set up by `scripts/transformers.sh`):
//!
//! - transformers creates small random Qwen3-MoE models (with `norm_topk_prob` on and off,
//!   `decoder_sparse_step` > 1, `mlp_only_layers`, tied embeddings) and dense Qwen3 models
//!   (`Qwen3ForCausalLM`: tied and untied, GQA ratios 2 and 4, `head_dim` ≠ hidden / heads),
//!   saves them and computes logits and losses on fixed tokens and the greedy continuation
//!   (`generate(do_sample=False)`) of one row; `moekit-train eval` loads each directory and
//!   matches the logits and losses with every MoE implementation, and `moekit-train generate`
//!   continues the row with the same tokens;
//! - a checkpoint trained and exported by moekit, Qwen3-MoE or dense, loads in transformers'
//!   `AutoModelForCausalLM.from_pretrained` as the class its `model_type` names and gives
//!   moekit's logits.
//!
//! Tolerance: both sides compute in f32 with different summation orders (SDPA and fused
//! experts in transformers); logits agree within 1e-4 absolute (observed about 1e-6) and
//! losses within 1e-5 relative.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;

use common::{scratch, succeed as moekit};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    let python = repo().join(".venv/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run `bash scripts/transformers.sh` (scripts/test.sh does)",
        python.display()
    );
    python
}

fn hf(args: &[&str]) {
    let script = repo().join("trainer/tests/hf_parity.py");
    let out = Command::new(python())
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hf_parity.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The `logits` tensor of a safetensors file: shape and f32 values.
fn logits(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let view = file.tensor("logits").unwrap();
    assert_eq!(view.dtype(), Dtype::F32, "{}", path.display());
    let values = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (view.shape().to_vec(), values)
}

fn assert_logits_match(ours: &Path, theirs: &Path, what: &str) {
    let (shape, a) = logits(ours);
    let (expected_shape, b) = logits(theirs);
    assert_eq!(shape, expected_shape, "{what}");
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0f32, f32::max);
    assert!(
        scale > 0.1,
        "{what}: logits are not trivially small ({scale})"
    );
    assert!(
        diff <= 1e-4,
        "{what}: logits differ by {diff:e} (largest {scale})"
    );
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * b.abs()
}

#[test]
fn moekit_loads_transformers_models_and_matches_their_logits_losses_and_greedy_tokens() {
    for case in [
        "default",
        "no_norm_topk_prob",
        "sparse_step_2",
        "mlp_only_layers",
        "tied",
        "dense",
        "dense_tied",
        "dense_gqa4",
    ] {
        let dir = scratch(case);
        hf(&["make", s(&dir), case]);
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap())
                .unwrap();
        // A dense model has no experts: one implementation stands for all.
        let implementations: &[&str] = match case.starts_with("dense") {
            true => &["cpu"],
            false => &["torch", "grouped_mm", "reference", "cpu"],
        };
        for &moe in implementations {
            let what = format!("{case}, {moe}");
            let ours = dir.join(format!("{moe}.safetensors"));
            let line = moekit(&[
                "eval",
                "--model",
                s(&dir.join("hf")),
                "--tokens",
                s(&dir.join("tokens.safetensors")),
                "--output",
                s(&ours),
                "--kernels.moe",
                moe,
                "--kernels.block_size",
                "4",
            ]);
            assert_logits_match(&ours, &dir.join("expected.safetensors"), &what);
            let losses: Value = serde_json::from_str(line.trim()).unwrap();
            for key in ["total_loss", "aux_loss"] {
                let (a, b) = (
                    losses[key].as_f64().unwrap(),
                    expected[key].as_f64().unwrap(),
                );
                assert!(close(a, b), "{what}: {key} {a} vs transformers' {b}");
            }
            let prompt: Vec<String> = expected["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| id.to_string())
                .collect();
            let generated: Value = serde_json::from_str(
                moekit(&[
                    "generate",
                    "--model",
                    s(&dir.join("hf")),
                    "--prompt-ids",
                    &prompt.join(","),
                    "--max-new-tokens",
                    "12",
                    "--json",
                    "--kernels.moe",
                    moe,
                    "--kernels.block_size",
                    "4",
                ])
                .trim(),
            )
            .unwrap();
            assert_eq!(
                generated["generated_ids"], expected["generated_ids"],
                "{what}: greedy tokens"
            );
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn transformers_loads_moekit_exports_with_the_same_logits() {
    for (name, config, extra) in [
        ("untied", "qwen3_moe_debug.toml", "false"),
        ("tied", "qwen3_moe_debug.toml", "true"),
        ("dense", "qwen3_debug.toml", "false"),
        ("dense-tied", "qwen3_debug.toml", "true"),
    ] {
        let config = repo().join("configs").join(config);
        let dir = scratch(&format!("export-{name}"));
        moekit(&[
            "--config",
            s(&config),
            "--job.dump_folder",
            s(&dir),
            "--training.steps",
            "5",
            "--lr_scheduler.warmup_steps",
            "1",
            "--checkpoint.enable",
            "true",
            "--model.tie_word_embeddings",
            extra,
        ]);
        let export = dir.join("hf");
        moekit(&[
            "export",
            "--checkpoint",
            s(&dir.join("checkpoints/step-00000005")),
            "--out",
            s(&export),
        ]);
        let text = b"a farmer visits the wooden bridge before dinner.\nthe cat sees";
        let bytes: Vec<u8> = text[..60]
            .iter()
            .flat_map(|&b| i64::from(b).to_le_bytes())
            .collect();
        let tokens = dir.join("tokens.safetensors");
        let view = TensorView::new(Dtype::I64, vec![3, 20], &bytes).unwrap();
        safetensors::serialize_to_file([("input_ids", view)], None, &tokens).unwrap();
        let (ours, theirs) = (dir.join("ours.safetensors"), dir.join("theirs.safetensors"));
        moekit(&[
            "eval",
            "--model",
            s(&export),
            "--tokens",
            s(&tokens),
            "--output",
            s(&ours),
        ]);
        hf(&["eval", s(&export), s(&tokens), s(&theirs)]);
        assert_logits_match(&ours, &theirs, name);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
