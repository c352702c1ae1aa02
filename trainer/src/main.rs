//! `moekit-train`: trains a Qwen3-MoE model from a job config.
//!
//! ```text
//! moekit-train --config configs/qwen3_moe_debug.toml [--section.key VALUE]...
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use moekit_trainer::config::JobConfig;
use moekit_trainer::train::train;

const USAGE: &str = "\
usage: moekit-train --config FILE [--section.key VALUE]...

Trains a Qwen3-MoE model as the job config (TOML) describes. Any key of the config can be
overridden: `--training.steps 20`, `--kernels.moe cpu`, `--optimizer.lr=1e-3`.";

/// What the command line asks for.
enum Request {
    Help,
    /// Train from the config at this path with these `section.key = value` overrides.
    Train {
        config: PathBuf,
        overrides: Vec<(String, String)>,
    },
}

fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Request> {
    let mut config = None;
    let mut overrides = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(Request::Help);
        }
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
        if key == "config" {
            config = Some(PathBuf::from(value));
        } else {
            overrides.push((key, value));
        }
    }
    let config = config.with_context(|| format!("missing `--config FILE`\n\n{USAGE}"))?;
    Ok(Request::Train { config, overrides })
}

fn run() -> Result<()> {
    match parse_args(std::env::args().skip(1))? {
        Request::Help => println!("{USAGE}"),
        Request::Train { config, overrides } => {
            train(&JobConfig::load(&config, &overrides)?)?;
        }
    }
    Ok(())
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
