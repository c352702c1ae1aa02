//! Helpers the trainer's integration tests share: scratch folders and running `moekit-train`.

#![allow(dead_code)] // Each test binary uses its own subset.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// The lines of a run's `metrics.jsonl` in `dump`, each parsed; an error names the file or
/// the line.
pub fn metrics_lines(dump: &Path) -> Result<Vec<Value>, String> {
    let path = dump.join("metrics.jsonl");
    let text =
        std::fs::read_to_string(&path).map_err(|err| format!("{}: {err}", path.display()))?;
    text.lines()
        .map(|line| {
            serde_json::from_str(line).map_err(|err| format!("{}: {line}: {err}", path.display()))
        })
        .collect()
}

/// An empty folder for `test` of this test binary under the system's temporary folder.
pub fn scratch(test: &str) -> PathBuf {
    let suite = env!("CARGO_CRATE_NAME");
    let dir = std::env::temp_dir().join(format!("moekit-{suite}-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `moekit-train args`.
pub fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moekit-train"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `moekit-train args`, which must succeed: its stdout.
pub fn succeed(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs `moekit-train args`, which must fail with `expected` in its stderr and no panic.
pub fn fail(args: &[&str], expected: &str) {
    let out = run(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(
        stderr.contains(expected),
        "{args:?}: `{stderr}` lacks `{expected}`"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A Hugging Face `tokenizer.json` with a word-level model over `vocab` (word → id), splitting on
/// whitespace and punctuation, `unk` for unknown words, and no other processing.
pub fn word_level_tokenizer(vocab: serde_json::Map<String, Value>, unk: &str) -> Value {
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": unk}
    })
}
