//! `kernels.moe = "neuron"` end to end on the fake Neuron runtime (`ffi/fake`), which runs
//! stand-in NEFFs of the experts' kernels on the host (in f64): the manifest comes from
//! `moekit-train neffs`, a stand-in is written for each entry, and training with `neuron`
//! must give the losses training with `cpu` gives (within 1e-4 relative: f64 against f32
//! products). Before training starts, a missing manifest, kernel, entry, NEFF or runtime is an
//! error naming it, and no step runs.
//!
//! Run plainly (one process), and with `ep` under `mpirun -n 2` (scripts/test.sh): expert
//! parallelism over two ranks, `neuron` against `cpu`.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::rc::Rc;

use common::metrics_lines;
use moekit::ep::{Communicator, MpiComm};
use moekit::neuron::manifest::{Manifest, Value};
use moekit_nrt_fake::Blockwise;
use moekit_trainer::config::JobConfig;
use moekit_trainer::train::train;

const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../configs/qwen3_moe_debug.toml"
);

/// The debug model for a few short steps, with its validation split (so the validation
/// loss's forward runs too).
fn overrides(dump: &Path, moe: &str, ranks: usize) -> Vec<(String, String)> {
    [
        ("job.dump_folder", dump.display().to_string()),
        ("kernels.moe", moe.to_owned()),
        ("training.steps", "4".to_owned()),
        ("training.batch_size", "2".to_owned()),
        ("training.seq_len", "32".to_owned()),
        ("lr_scheduler.warmup_steps", "1".to_owned()),
        ("metrics.log_freq", "2".to_owned()),
        ("metrics.eval_batches", "1".to_owned()),
        // Each rank's aux loss pools its own tokens: off, so R ranks train one objective.
        ("model.router_aux_loss_coef", "0.0".to_owned()),
        ("parallelism.expert_parallel_degree", ranks.to_string()),
    ]
    .into_iter()
    .map(|(key, value)| (key.to_owned(), value))
    .collect()
}

fn config(overrides: &[(String, String)]) -> JobConfig {
    JobConfig::load(Path::new(CONFIG), overrides).expect("the test config loads")
}

/// `overrides` with `kernels.neuron_manifest` and `kernels.neuron_runtime` set.
fn on_neuron(overrides: &[(String, String)], manifest: &Path, runtime: &str) -> JobConfig {
    let mut all = overrides.to_vec();
    all.push((
        "kernels.neuron_manifest".into(),
        manifest.display().to_string(),
    ));
    all.push(("kernels.neuron_runtime".into(), runtime.to_owned()));
    config(&all)
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("neuron")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `moekit-train neffs` for `overrides`: the manifest text it prints.
fn listed_manifest(overrides: &[(String, String)]) -> Result<String, String> {
    let mut command = Command::new(env!("CARGO_BIN_EXE_moekit-train"));
    command.args(["neffs", "--config", CONFIG]);
    for (key, value) in overrides {
        command.arg(format!("--{key}={value}"));
    }
    let out = command.output().map_err(|err| err.to_string())?;
    if !out.status.success() {
        return Err(format!(
            "moekit-train neffs failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    String::from_utf8(out.stdout).map_err(|err| err.to_string())
}

/// Writes `text` as `dir`'s kernels.toml and a stand-in NEFF for each of its entries (all of
/// them, or all but those of `skip`); returns the manifest's path.
fn write_manifest(dir: &Path, text: &str, skip: Option<&str>) -> Result<PathBuf, String> {
    let path = dir.join("kernels.toml");
    std::fs::write(&path, text).map_err(|err| err.to_string())?;
    let manifest = Manifest::read(&path).map_err(|err| err.to_string())?;
    for entry in &manifest.entries {
        if Some(entry.kernel.name()) == skip {
            continue;
        }
        let int = |key: &str| match entry.params.get(key) {
            Some(Value::Int(v)) => Ok(*v),
            _ => Err(format!("entry {} lacks `{key}`", entry.neff.display())),
        };
        let text = |key: &str| match entry.params.get(key) {
            Some(Value::Str(v)) => Ok(v.as_str()),
            _ => Err(format!("entry {} lacks `{key}`", entry.neff.display())),
        };
        let flag = |key: &str| matches!(entry.params.get(key), Some(Value::Bool(true)));
        let backward = entry.kernel.name() == "blockwise_mm_bwd";
        let activation = match backward {
            true => text("activation_type")?,
            false => text("activation_function")?,
        };
        let stand_in = Blockwise {
            t: int("t")?,
            h: int("h")?,
            e: int("e")?,
            i: int("i")?,
            b: int("block_size")?,
            n: int("num_blocks")?,
            activation,
            scaling: text("expert_affinities_scaling_mode")?,
            skip_token: flag("skip_token"),
            checkpoint: backward || flag("checkpoint_activation"),
        };
        let neff = match backward {
            true => stand_in.backward_neff(),
            false => stand_in.forward_neff(),
        };
        std::fs::write(&entry.neff, neff).map_err(|err| err.to_string())?;
    }
    Ok(path)
}

/// The (step, loss) lines of a run's metrics.jsonl.
fn losses(dump: &Path) -> Result<Vec<(u64, f64)>, String> {
    metrics_lines(dump)?
        .into_iter()
        .map(|m| {
            Ok((
                m["step"].as_u64().ok_or("no step")?,
                m["loss"].as_f64().ok_or("no loss")?,
            ))
        })
        .collect()
}

/// The neuron run's losses equal the cpu run's within 1e-4 relative, at every step.
fn same_losses(neuron: &Path, cpu: &Path) -> Result<f64, String> {
    let (neuron, cpu) = (losses(neuron)?, losses(cpu)?);
    if neuron.len() != cpu.len() || neuron.is_empty() {
        return Err(format!(
            "{} loss lines with neuron, {} with cpu",
            neuron.len(),
            cpu.len()
        ));
    }
    let mut largest: f64 = 0.0;
    for (&(step, a), &(_, b)) in neuron.iter().zip(&cpu) {
        let relative = (a - b).abs() / b.abs();
        largest = largest.max(relative);
        if relative > 1e-4 || !relative.is_finite() {
            return Err(format!(
                "step {step}: loss {a} with neuron, {b} with cpu ({relative:.1e} relative)"
            ));
        }
    }
    Ok(largest)
}

/// Training `config` fails before its first step, with an error containing every needle.
fn fails_before_training(config: &JobConfig, needles: &[&str]) -> Result<(), String> {
    let err = match train(config, None) {
        Ok(_) => return Err(format!("training succeeded; expected {needles:?}")),
        Err(err) => format!("{err:#}"),
    };
    if let Some(missing) = needles.iter().find(|needle| !err.contains(*needle)) {
        return Err(format!("the error lacks `{missing}`: {err}"));
    }
    if config.job.dump_folder.join("metrics.jsonl").exists() {
        return Err(format!("a step ran before the error: {err}"));
    }
    Ok(())
}

fn one_process() -> Result<(), String> {
    let dir = scratch("one_process");
    let listed = listed_manifest(&overrides(&dir.join("unused"), "neuron", 1))?;
    let fake = moekit_nrt_fake::LIBRARY;
    let neuron_dump = dir.join("neuron");
    let neuron = overrides(&neuron_dump, "neuron", 1);

    // What is missing, named before training starts.
    let nowhere = dir.join("nowhere.toml");
    fails_before_training(&on_neuron(&neuron, &nowhere, fake), &["nowhere.toml"])?;
    let forward_only: String = listed
        .split("\n\n")
        .filter(|table| !table.contains("\"blockwise_mm_bwd\""))
        .collect::<Vec<_>>()
        .join("\n\n");
    let manifest = write_manifest(&dir, &forward_only, None)?;
    fails_before_training(
        &on_neuron(&neuron, &manifest, fake),
        &["registers no blockwise_mm_bwd NEFF", "moekit-train neffs"],
    )?;
    let manifest = write_manifest(&dir, &listed, Some("blockwise_mm_bwd"))?;
    fails_before_training(
        &on_neuron(&neuron, &manifest, fake),
        &["blockwise_mm_bwd_t64_h64_e8_i32_b16_n15.neff"],
    )?;
    let manifest = write_manifest(&dir, &listed, None)?;
    let no_runtime = dir.join("libnrt-missing.so");
    fails_before_training(
        &on_neuron(&neuron, &manifest, &no_runtime.display().to_string()),
        &["libnrt-missing.so"],
    )?;
    let shorter = [("training.seq_len".to_owned(), "16".to_owned())];
    fails_before_training(
        &on_neuron(&[neuron.as_slice(), &shorter].concat(), &manifest, fake),
        &["no NEFF for blockwise_mm with t=32"],
    )?;

    // The listed manifest runs: the losses of cpu.
    let cpu_dump = dir.join("cpu");
    train(&config(&overrides(&cpu_dump, "cpu", 1)), None).map_err(|err| format!("cpu: {err:#}"))?;
    train(&on_neuron(&neuron, &manifest, fake), None).map_err(|err| format!("neuron: {err:#}"))?;
    let largest = same_losses(&neuron_dump, &cpu_dump)?;
    eprintln!("neuron (fake runtime) trains with cpu's losses within {largest:.1e} relative");
    Ok(())
}

/// Expert parallelism over `comm`'s ranks: `neuron` against `cpu`. Every rank runs the same
/// config (dump folder and manifest included, as the ranks check); rank 0 writes the files.
fn expert_parallel(comm: &Rc<MpiComm>) -> Result<(), String> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let name = format!("expert_parallel_{ranks}");
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("neuron")
        .join(&name);
    let neuron_dump = dir.join("neuron");
    let neuron = overrides(&neuron_dump, "neuron", ranks);
    let manifest = dir.join("kernels.toml");
    let written = match rank {
        0 => {
            scratch(&name);
            listed_manifest(&neuron).and_then(|text| write_manifest(&dir, &text, None))
        }
        _ => Ok(manifest.clone()),
    };
    // Every rank learns whether rank 0 wrote the files before any trains.
    let mut failed = [f32::from(u8::from(written.is_err()))];
    comm.all_reduce_sum(&mut failed)
        .map_err(|err| err.to_string())?;
    written?;
    if failed[0] > 0.0 {
        return Err("rank 0 could not write the manifest and its NEFFs".to_owned());
    }
    let cpu_dump = dir.join("cpu");
    let cpu = config(&overrides(&cpu_dump, "cpu", ranks));
    train(&cpu, Some(Rc::clone(comm))).map_err(|err| format!("cpu: {err:#}"))?;
    let on_fake = on_neuron(&neuron, &manifest, moekit_nrt_fake::LIBRARY);
    train(&on_fake, Some(Rc::clone(comm))).map_err(|err| format!("neuron: {err:#}"))?;
    if rank == 0 {
        let largest = same_losses(&neuron_dump, &cpu_dump)?;
        eprintln!(
            "R={ranks}: neuron (fake runtime) trains with cpu's losses within {largest:.1e} relative"
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = if std::env::args().any(|arg| arg == "ep") {
        match MpiComm::init() {
            Ok(comm) => {
                let comm = Rc::new(comm);
                expert_parallel(&comm).map_err(|err| format!("rank {}: {err}", comm.rank()))
            }
            Err(err) => Err(format!("cannot initialise MPI: {err}")),
        }
    } else {
        one_process()
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}
