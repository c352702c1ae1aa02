//! `moekit-train`: trains, evaluates and exports Qwen3-MoE models.
//!
//! ```text
//! moekit-train [train] --config FILE [--section.key VALUE]...
//! moekit-train eval --model DIR --tokens FILE [--output FILE] [--kernels.moe IMPL]
//! moekit-train generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
//!                       [--temperature T] [--top-p P] [--seed S] [--json] [--kernels.moe IMPL]
//! moekit-train export --checkpoint DIR --out DIR
//! moekit-train bench --config FILE [--bench.impls A,B] [--bench.warmup N] [--bench.steps N]
//! moekit-train neffs --config FILE [--section.key VALUE]...
//! ```

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

use anyhow::{Context, Result, bail, ensure};
use moekit::ep::Communicator;
use moekit::neuron::backend::manifest_entry;
use moekit_tools::golden::TensorFile;
use moekit_tools::torch::from_tch;
use moekit_trainer::bench::{self, BenchOptions};
use moekit_trainer::config::JobConfig;
use moekit_trainer::eval::{LoadDtype, evaluate, export, load_model, read_input_ids};
use moekit_trainer::footprint::{ensure_fits_in_host_memory, evaluation_bytes};
use moekit_trainer::generate::{
    GenerateOptions, Sampling, directory_tokenizer, generate, stop_ids,
};
use moekit_trainer::moe::{MoeImpl, planned_calls};
use moekit_trainer::oom;
use moekit_trainer::parallel::init_mpi;
use moekit_trainer::train::train;

const USAGE: &str = "\
usage: moekit-train [train] --config FILE [--section.key VALUE]...
       moekit-train eval --model DIR --tokens FILE [--output FILE] [--kernels.moe IMPL]
                         [--kernels.block_size B]
       moekit-train generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3)
                             [--max-new-tokens 64] [--temperature 0] [--top-p 1] [--seed 0]
                             [--json] [--kernels.moe IMPL] [--kernels.block_size B]
       moekit-train export --checkpoint DIR --out DIR
       moekit-train bench --config FILE [--bench.impls torch,grouped_mm,reference,cpu]
                          [--bench.warmup 3] [--bench.steps 10] [--bench.json true]
                          [--section.key VALUE]...
       moekit-train neffs --config FILE [--section.key VALUE]...

train   Trains a Qwen3-MoE model as the job config (TOML) describes. Any key of the config can
        be overridden: `--training.steps 20`, `--kernels.moe cpu`, `--optimizer.lr=1e-3`.
eval    Loads a Hugging Face model directory or a training checkpoint, runs the forward pass on
        `input_ids [batch, seq]` (i64 or i32) from a safetensors file, writes `logits` (f32) to
        --output and prints {\"loss\", \"aux_loss\", \"total_loss\"} as one JSON line.
        IMPL: torch (default), grouped_mm, reference, cpu, neuron.
generate
        Loads a model as eval does and continues the prompt (text through the directory's
        tokenizer.json, byte level where it has none; or token ids) on a KV cache until
        --max-new-tokens or an end-of-sequence token (eos_token_id of generation_config.json or
        config.json). Temperature 0 is greedy (transformers' do_sample=False); above 0 it
        samples among the most likely tokens whose probabilities reach --top-p, seeded by
        --seed. Prints the prompt and its continuation, and the tokens/s on stderr; with
        --json one object {\"prompt_ids\", \"generated_ids\", \"text\", \"tokens_per_second\"}
        (text: the continuation alone).
export  Writes a training checkpoint's model as a Hugging Face directory (must not exist).
bench   Trains the config with each MoE implementation in one process, steps taken in turn,
        and prints the median step time, tokens/s, model FLOP/s as a share of the measured
        f32 FMA peak, and the ratios to torch and grouped_mm (one JSON object per row with
        --bench.json true).
neffs   Prints the kernel manifest (kernels.toml) of the NEFFs training the config with
        kernels.moe = \"neuron\" needs on each rank: the experts' blockwise_mm (with
        checkpoints, and without for the validation loss) and blockwise_mm_bwd, at the shapes
        the model, training.batch_size, training.seq_len, kernels.block_size and
        parallelism.expert_parallel_degree give. Compile each from nki-library's kernel to the
        file its `neff` names (relative to the manifest).";

/// `--key value` and `--key=value` pairs, in order, where each of `switches` may also stand
/// alone (`--json`, for `--json true`); `None` when `-h`/`--help` stands where a flag would.
fn flags(
    args: impl Iterator<Item = String>,
    switches: &[&str],
) -> Result<Option<Vec<(String, String)>>> {
    let mut args = args.peekable();
    let mut pairs = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        let Some(flag) = arg.strip_prefix("--") else {
            bail!("unexpected argument `{arg}`\n\n{USAGE}");
        };
        let (key, value) = match flag.split_once('=') {
            Some((key, value)) => (key.to_owned(), value.to_owned()),
            None if switches.contains(&flag)
                && args.peek().is_none_or(|next| next.starts_with("--")) =>
            {
                (flag.to_owned(), "true".to_owned())
            }
            None => {
                let value = args
                    .next()
                    .with_context(|| format!("`--{flag}` needs a value\n\n{USAGE}"))?;
                (flag.to_owned(), value)
            }
        };
        pairs.push((key, value));
    }
    Ok(Some(pairs))
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

/// The job config named by `--config`, with every other pair as an override.
fn load_job(pairs: Vec<(String, String)>) -> Result<JobConfig> {
    let (config, overrides): (Vec<_>, Vec<_>) = pairs.into_iter().partition(|(k, _)| k == "config");
    let (_, path) = config
        .into_iter()
        .last()
        .with_context(|| format!("missing `--config FILE`\n\n{USAGE}"))?;
    JobConfig::load(&PathBuf::from(path), &overrides)
}

fn run_train(pairs: Vec<(String, String)>) -> Result<()> {
    let config = load_job(pairs)?;
    // MPI lives as long as training: it is finalised when `comm` is dropped here.
    let Some(comm) = init_mpi(&config)? else {
        train(&config, None)?;
        return Ok(());
    };
    // The other ranks may be waiting in a collective this rank will never join, after an error
    // or a panic (whose message the panic hook has printed): abort the job (mpirun then stops
    // every rank) rather than finalise MPI and leave them hanging.
    let rank_comm = Some(Rc::clone(&comm));
    let training = || oom::catch(|| train(&config, rank_comm));
    match std::panic::catch_unwind(AssertUnwindSafe(training)) {
        Ok(Ok(_)) => {}
        Ok(Err(err)) => {
            eprintln!("error on rank {}: {err:#}", comm.rank());
            comm.abort(1);
        }
        Err(_) => {
            eprintln!("rank {} panicked; aborting the job", comm.rank());
            comm.abort(101);
        }
    }
    Ok(())
}

fn run_bench(pairs: Vec<(String, String)>) -> Result<()> {
    let (bench, rest): (Vec<_>, Vec<_>) = pairs
        .into_iter()
        .partition(|(k, _)| k.starts_with("bench."));
    let bench = Options::new(
        bench,
        &["bench.impls", "bench.warmup", "bench.steps", "bench.json"],
    )?;
    let count = |key: &str, default: usize| -> Result<usize> {
        bench.get(key).map_or(Ok(default), |v| {
            v.parse()
                .with_context(|| format!("--{key} must be a non-negative integer, got `{v}`"))
        })
    };
    let impls = match bench.get("bench.impls") {
        None => vec![
            MoeImpl::Torch,
            MoeImpl::GroupedMm,
            MoeImpl::Reference,
            MoeImpl::Cpu,
        ],
        Some(list) => list
            .split(',')
            .map(|name| parse_moe(name.trim()))
            .collect::<Result<_>>()?,
    };
    let json = match bench.get("bench.json") {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => bail!("--bench.json must be true or false, got `{other}`"),
    };
    let options = BenchOptions {
        impls,
        warmup: count("bench.warmup", 3)?,
        steps: count("bench.steps", 10)?,
    };
    let config = load_job(rest)?;
    let (limits, rows) = bench::bench(&config, &options)?;
    if json {
        for row in &rows {
            println!("{}", serde_json::to_string(row)?);
        }
    } else {
        print!("{}", bench::table(&limits, &rows));
    }
    Ok(())
}

fn run_neffs(pairs: Vec<(String, String)>) -> Result<()> {
    let config = load_job(pairs)?;
    let calls = planned_calls(&config)?;
    ensure!(
        !calls.is_empty(),
        "model.name = \"qwen3\" is the dense Qwen3: it has no experts, so no NEFF to list"
    );
    println!(
        "# The NEFFs of kernels.moe = \"neuron\" for this config (moekit-train neffs), by\n\
         # nki-library's kernel names and parameters; `neff` is relative to this file."
    );
    for call in &calls {
        println!("\n{}", manifest_entry(call).trim_end());
    }
    Ok(())
}

fn parse_moe(name: &str) -> Result<MoeImpl> {
    MoeImpl::ALL
        .iter()
        .copied()
        .find(|m| m.name() == name)
        .with_context(|| {
            let known: Vec<_> = MoeImpl::ALL.iter().map(|m| m.name()).collect();
            format!(
                "unknown MoE implementation `{name}`; known: {}",
                known.join(", ")
            )
        })
}

/// `--kernels.moe` (torch by default) and `--kernels.block_size` (64 by default) of `eval`
/// and `generate`.
fn kernel_options(options: &Options) -> Result<(MoeImpl, usize)> {
    let moe = options
        .get("kernels.moe")
        .map_or(Ok(MoeImpl::Torch), parse_moe)?;
    let block_size = positive(options, "kernels.block_size")?.unwrap_or(64);
    Ok((moe, block_size))
}

/// Parses `--key`'s value, if given, naming the flag and the value on failure.
fn parse_flag<T: std::str::FromStr>(options: &Options, key: &str, what: &str) -> Result<Option<T>> {
    options
        .get(key)
        .map(|v| {
            v.parse()
                .ok()
                .with_context(|| format!("--{key} must be {what}, got `{v}`"))
        })
        .transpose()
}

/// `--key`'s value, if given, as a positive integer.
fn positive(options: &Options, key: &str) -> Result<Option<usize>> {
    let value = parse_flag::<usize>(options, key, "a positive integer")?;
    ensure!(
        value != Some(0),
        "--{key} must be a positive integer, got `0`"
    );
    Ok(value)
}

fn run_generate(options: Options) -> Result<()> {
    let (moe, block_size) = kernel_options(&options)?;
    let max_new_tokens = positive(&options, "max-new-tokens")?.unwrap_or(64);
    let sampling = Sampling::new(
        parse_flag(&options, "temperature", "a number")?.unwrap_or(0.0),
        parse_flag(&options, "top-p", "a number")?.unwrap_or(1.0),
        parse_flag(&options, "seed", "a non-negative integer")?.unwrap_or(0),
    )?;
    let json = parse_flag::<bool>(&options, "json", "true or false")?.unwrap_or(false);
    let dir = PathBuf::from(options.required("model")?);
    let tokenizer = directory_tokenizer(&dir)?;
    // The prompt's text (printed back as given) where it came as text, and its ids.
    let (prompt_text, prompt_ids) = match (options.get("prompt"), options.get("prompt-ids")) {
        (Some(_), Some(_)) => bail!("give --prompt or --prompt-ids, not both"),
        (None, None) => bail!("missing `--prompt TEXT` or `--prompt-ids 1,2,3`\n\n{USAGE}"),
        (Some(text), None) => (Some(text.to_owned()), tokenizer.encode(text)?),
        (None, Some(ids)) => (
            None,
            ids.split(',')
                .map(|id| {
                    id.trim().parse::<i64>().ok().with_context(|| {
                        format!("--prompt-ids must be comma-separated token ids, got `{id}`")
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    let stop_ids = stop_ids(&dir)?;
    let loaded = load_model(&dir, LoadDtype::Float32)?;
    let length = prompt_ids.len().saturating_add(max_new_tokens) as u128;
    ensure_fits_in_host_memory(
        evaluation_bytes(
            loaded.model.config(),
            length,
            false,
            moe.kernel_backend().map(|backend| (backend, block_size)),
        ),
        || format!("generating a sequence of {length} tokens needs, beyond the loaded model,"),
    )?;
    let generate_options = GenerateOptions {
        max_new_tokens,
        sampling,
        stop_ids,
    };
    let experts = moe.create(block_size)?;
    let generation = generate(
        &loaded.model,
        &prompt_ids,
        experts.as_ref(),
        &generate_options,
    )?;
    let text = tokenizer.decode(&generation.generated_ids)?;
    if json {
        let record = serde_json::json!({
            "prompt_ids": prompt_ids,
            "generated_ids": generation.generated_ids,
            "text": text,
            "tokens_per_second": generation.tokens_per_second(),
        });
        println!("{record}");
    } else {
        let prompt = match prompt_text {
            Some(text) => text,
            None => tokenizer.decode(&prompt_ids)?,
        };
        println!("{prompt}{text}");
        eprintln!(
            "{} tokens in {:.3} s: {:.1} tokens/s",
            generation.generated_ids.len(),
            generation.seconds,
            generation.tokens_per_second()
        );
    }
    Ok(())
}

fn run_eval(options: Options) -> Result<()> {
    let (moe, block_size) = kernel_options(&options)?;
    let loaded = load_model(
        &PathBuf::from(options.required("model")?),
        LoadDtype::Float32,
    )?;
    let input_ids = read_input_ids(&PathBuf::from(options.required("tokens")?))?;
    let tokens = input_ids.numel() as u128;
    let output = options.get("output");
    ensure_fits_in_host_memory(
        evaluation_bytes(
            loaded.model.config(),
            tokens,
            output.is_some(),
            moe.kernel_backend().map(|backend| (backend, block_size)),
        ),
        || {
            format!(
                "evaluating {:?} tokens at once needs, beyond the loaded model,",
                input_ids.size()
            )
        },
    )?;
    let (logits, losses) = evaluate(&loaded.model, &input_ids, moe, block_size)?;
    if let Some(output) = output {
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
    let command = match args.peek().map(String::as_str) {
        Some("train" | "eval" | "generate" | "export" | "bench" | "neffs" | "help") => args.next(),
        _ => None,
    };
    let switches: &[&str] = match command.as_deref() {
        Some("generate") => &["json"],
        _ => &[],
    };
    let Some(pairs) = flags(args, switches)?.filter(|_| command.as_deref() != Some("help")) else {
        println!("{USAGE}");
        return Ok(());
    };
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
        Some("generate") => run_generate(Options::new(
            pairs,
            &[
                "model",
                "prompt",
                "prompt-ids",
                "max-new-tokens",
                "temperature",
                "top-p",
                "seed",
                "json",
                "kernels.moe",
                "kernels.block_size",
            ],
        )?),
        Some("bench") => run_bench(pairs),
        Some("neffs") => run_neffs(pairs),
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
    moekit::memory::retain_freed_buffers();
    oom::quiet_allocation_panics();
    match oom::catch(run) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
