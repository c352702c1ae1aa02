//! `moekit-train`: trains, evaluates and exports Qwen3-MoE models.
//!
//! ```text
//! moekit-train [train] --config FILE [--section.key VALUE]...
//! moekit-train eval --model DIR --tokens FILE [--output FILE] [--kernels.moe IMPL]
//! moekit-train export --checkpoint DIR --out DIR
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use moekit::golden::TensorFile;
use moekit::torch::from_tch;
use moekit_trainer::config::JobConfig;
use moekit_trainer::eval::{evaluate, export, load_model, read_input_ids};
use moekit_trainer::moe::MoeImpl;
use moekit_trainer::train::train;

const USAGE: &str = "\
usage: moekit-train [train] --config FILE [--section.key VALUE]...
       moekit-train eval --model DIR --tokens FILE [--output FILE] [--kernels.moe IMPL]
                         [--kernels.block_size B]
       moekit-train export --checkpoint DIR --out DIR

train   Trains a Qwen3-MoE model as the job config (TOML) describes. Any key of the config can
        be overridden: `--training.steps 20`, `--kernels.moe cpu`, `--optimizer.lr=1e-3`.
eval    Loads a Hugging Face model directory or a training checkpoint, runs the forward pass on
        `input_ids [batch, seq]` (i64 or i32) from a safetensors file, writes `logits` (f32) to
        --output and prints {\"loss\", \"aux_loss\", \"total_loss\"} as one JSON line.
        IMPL: torch (default), grouped_mm, reference, cpu.
export  Writes a training checkpoint's model as a Hugging Face directory (must not exist).";

/// `--key value` and `--key=value` pairs, in order.
fn flags(mut args: impl Iterator<Item = String>) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    while let Some(arg) = args.next() {
        let Some(flag) = arg.strip_prefix("--") else {
            bail!("unexpected argument `{arg}`\n\n{USAGE}");
        };
        let (key, value) = match flag.split_once('=') {
            Some((key, value)) => (key.to_owned(), value.to_owned()),
            None => {
                let value = args
                    .next()
                    .with_context(|| format!("`--{flag}` needs a value\n\n{USAGE}"))?;
                (flag.to_owned(), value)
            }
        };
        pairs.push((key, value));
    }
    Ok(pairs)
}

/// Flags of a subcommand with a fixed set of keys.
struct Options(Vec<(String, String)>);

impl Options {
    fn new(pairs: Vec<(String, String)>, known: &[&str]) -> Result<Self> {
        if let Some((key, _)) = pairs.iter().find(|(k, _)| !known.contains(&k.as_str())) {
            bail!("unknown option `--{key}`\n\n{USAGE}");
        }
        Ok(Self(pairs))
    }

    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn required(&self, key: &str) -> Result<&str> {
        self.get(key)
            .with_context(|| format!("missing `--{key}`\n\n{USAGE}"))
    }
}

fn run_train(pairs: Vec<(String, String)>) -> Result<()> {
    let (config, overrides): (Vec<_>, Vec<_>) = pairs.into_iter().partition(|(k, _)| k == "config");
    let (_, path) = config
        .into_iter()
        .last()
        .with_context(|| format!("missing `--config FILE`\n\n{USAGE}"))?;
    train(&JobConfig::load(&PathBuf::from(path), &overrides)?)?;
    Ok(())
}

fn run_eval(options: Options) -> Result<()> {
    let moe: MoeImpl = match options.get("kernels.moe") {
        None => MoeImpl::Torch,
        Some(name) => MoeImpl::ALL
            .iter()
            .copied()
            .find(|m| m.name() == name)
            .with_context(|| format!("unknown --kernels.moe `{name}`"))?,
    };
    let block_size = match options.get("kernels.block_size") {
        None => 64,
        Some(b) => b
            .parse::<usize>()
            .ok()
            .filter(|&b| b > 0)
            .with_context(|| {
                format!("--kernels.block_size must be a positive integer, got `{b}`")
            })?,
    };
    let loaded = load_model(&PathBuf::from(options.required("model")?))?;
    let input_ids = read_input_ids(&PathBuf::from(options.required("tokens")?))?;
    let (logits, losses) = evaluate(&loaded.model, &input_ids, moe, block_size)?;
    if let Some(output) = options.get("output") {
        let mut file = TensorFile::default();
        file.tensors
            .insert("logits".to_owned(), from_tch("logits", &logits)?);
        file.write(&PathBuf::from(output))?;
    }
    println!("{}", serde_json::to_string(&losses)?);
    Ok(())
}

fn run() -> Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    if args
        .peek()
        .is_some_and(|a| a == "-h" || a == "--help" || a == "help")
    {
        println!("{USAGE}");
        return Ok(());
    }
    let command = match args.peek().map(String::as_str) {
        Some("train" | "eval" | "export") => args.next(),
        _ => None,
    };
    let pairs = flags(args)?;
    match command.as_deref() {
        Some("eval") => run_eval(Options::new(
            pairs,
            &[
                "model",
                "tokens",
                "output",
                "kernels.moe",
                "kernels.block_size",
            ],
        )?),
        Some("export") => {
            let options = Options::new(pairs, &["checkpoint", "out"])?;
            export(
                &PathBuf::from(options.required("checkpoint")?),
                &PathBuf::from(options.required("out")?),
            )
        }
        _ => run_train(pairs),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
