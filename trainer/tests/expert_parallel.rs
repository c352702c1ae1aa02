//! Expert- and data-parallel training under `mpirun` (run by `scripts/test.sh` with `-n 2`
//! and `-n 4`), in the layouts (R, D) of the rank count: (2, 1) and (1, 2) with 2 ranks, (4, 1)
//! and (2, 2) with 4.
//!
//! - default: every rank trains the debug model with its experts sharded over the R ranks of
//!   its replica, each on its slice of every batch; rank 0 then trains the same model in one
//!   process on the whole batches (R·D × batch_size sequences) and compares. With the auxiliary
//!   loss off (each rank's aux loss pools only its own tokens, so it differs from the single
//!   process's) the runs optimise the same objective: their losses agree within 1e-5 relative
//!   at every step, on the `cpu` kernels (and the `reference` ones with D = 1). A run resumed
//!   from its rank-sharded checkpoint repeats the uninterrupted run's steps exactly; the
//!   checkpoint resumes on its layout only; its export equals the single process's.
//! - `mismatch`: rank 1 loads a different seed; every rank must stop with the same message.

mod common;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use common::metrics_lines;
use moekit::ep::{Communicator, MpiComm};
use moekit_trainer::config::JobConfig;
use moekit_trainer::train::train;

/// Writes one line to stderr in a single `write`, so lines of different ranks do not
/// interleave.
fn report(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn config(dump: &Path, overrides: &[(&str, String)]) -> JobConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/qwen3_moe_debug.toml");
    let mut all: Vec<(String, String)> = vec![
        ("job.dump_folder".into(), dump.display().to_string()),
        ("training.steps".into(), "6".into()),
        ("training.seq_len".into(), "32".into()),
        ("lr_scheduler.warmup_steps".into(), "2".into()),
        ("model.router_aux_loss_coef".into(), "0.0".into()),
        ("metrics.log_freq".into(), "3".into()),
    ];
    all.extend(overrides.iter().map(|(k, v)| (k.to_string(), v.clone())));
    JobConfig::load(&path, &all).expect("the test config loads")
}

/// The dump folder of one run: the same on every rank (only rank 0 writes into it).
fn scratch(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("expert_parallel")
        .join(name)
}

/// One line of a run's metrics.jsonl: the step, its loss and gradient norm, and each MoE
/// layer's total assignments.
#[derive(Debug, PartialEq)]
struct StepLine {
    step: u64,
    loss: f64,
    grad_norm: f64,
    assignments: Vec<f64>,
}

/// The lines rank 0 wrote to `dump`'s metrics.jsonl.
fn metrics(dump: &Path) -> Result<Vec<StepLine>, String> {
    metrics_lines(dump)?
        .into_iter()
        .map(|m| {
            let parsed = || {
                Some(StepLine {
                    step: m["step"].as_u64()?,
                    loss: m["loss"].as_f64()?,
                    grad_norm: m["grad_norm"].as_f64()?,
                    assignments: m["expert_load"]
                        .as_array()?
                        .iter()
                        .map(|layer| layer["total"].as_f64())
                        .collect::<Option<_>>()?,
                })
            };
            parsed().ok_or_else(|| format!("{}: malformed line {m}", dump.display()))
        })
        .collect()
}

/// R ranks per replica and D replicas.
#[derive(Clone, Copy)]
struct Layout {
    r: usize,
    d: usize,
}

impl Layout {
    fn name(self) -> String {
        format!("R{}-D{}", self.r, self.d)
    }

    /// The config keys of the layout.
    fn keys(self) -> [(&'static str, String); 2] {
        [
            ("parallelism.expert_parallel_degree", self.r.to_string()),
            ("parallelism.data_parallel_degree", self.d.to_string()),
        ]
    }
}

/// Trains with the layout's ranks, then (rank 0) in one process, and compares the losses.
fn parity(comm: &Rc<MpiComm>, layout: Layout) -> Result<(), String> {
    let rank = comm.rank();
    let ranks = layout.r * layout.d;
    let batch = 2;
    let impls: &[&str] = match layout.d {
        1 => &["reference", "cpu"],
        _ => &["cpu"],
    };
    let ranks_label = layout.name();
    for &moe in impls {
        let mut pairs = vec![
            ("kernels.moe", moe.to_owned()),
            ("training.batch_size", batch.to_string()),
        ];
        pairs.extend(layout.keys());
        let sharded = config(&scratch(&format!("ep-{moe}-{ranks_label}")), &pairs);
        train(&sharded, Some(Rc::clone(comm)))
            .map_err(|err| format!("{ranks_label} {moe}: {err:#}"))?;
        if rank != 0 {
            continue;
        }
        let single = config(
            &scratch(&format!("single-{moe}-for-{ranks_label}")),
            &[
                ("kernels.moe", moe.into()),
                ("training.batch_size", (batch * ranks).to_string()),
            ],
        );
        train(&single, None).map_err(|err| format!("R=1 {moe}: {err:#}"))?;
        let ep = metrics(&sharded.job.dump_folder)?;
        let one = metrics(&single.job.dump_folder)?;
        if ep.len() != one.len() {
            return Err(format!(
                "{moe}: {} steps with {ranks_label}, {} with R=1",
                ep.len(),
                one.len()
            ));
        }
        let mut largest: f64 = 0.0;
        for (a, b) in ep.iter().zip(&one) {
            let relative = (a.loss - b.loss).abs() / b.loss.abs();
            largest = largest.max(relative);
            if relative > 1e-5 || !a.loss.is_finite() {
                return Err(format!(
                    "{moe}, step {}: loss {} with {ranks_label}, {} with R=1 (relative difference {relative:.2e})",
                    a.step, a.loss, b.loss
                ));
            }
            if a.assignments != b.assignments {
                return Err(format!(
                    "{moe}, step {}: expert assignments per layer {:?} with {ranks_label}, {:?} with R=1",
                    a.step, a.assignments, b.assignments
                ));
            }
        }
        let (first, last) = (&ep[0], &ep[ep.len() - 1]);
        if last.loss >= first.loss {
            return Err(format!(
                "{moe}: the loss did not fall ({} → {})",
                first.loss, last.loss
            ));
        }
        report(format!(
            "rank 0 of {ranks_label}: {moe}: {} steps, losses equal R=1's within \
             {largest:.1e} relative (first {:.5}, last {:.5})",
            ep.len(),
            first.loss,
            last.loss
        ));
    }
    Ok(())
}

fn max_abs_difference(a: &Path, b: &Path) -> Result<(f64, usize), String> {
    let read = |dir: &Path| {
        moekit_tools::golden::TensorFile::read(&dir.join("model.safetensors"))
            .map_err(|err| err.to_string())
    };
    let (a, b) = (read(a)?, read(b)?);
    if a.tensors.keys().ne(b.tensors.keys()) {
        return Err("the exports hold different tensor names".to_owned());
    }
    let mut largest: f64 = 0.0;
    for (name, ta) in &a.tensors {
        let tb = &b.tensors[name];
        if ta.shape() != tb.shape() {
            return Err(format!(
                "`{name}`: shapes {:?} and {:?}",
                ta.shape(),
                tb.shape()
            ));
        }
        for (x, y) in ta.to_f64_vec().iter().zip(tb.to_f64_vec()) {
            largest = largest.max((x - y).abs());
        }
    }
    Ok((largest, a.tensors.len()))
}

/// Rank-sharded checkpoints: a run resumed from its step-3 checkpoint repeats steps 4–6 of the
/// uninterrupted run bit for bit; the export of the sharded checkpoint is a standard Hugging
/// Face directory with every expert, matching the single process's export; and starting R
/// ranks from that directory gives the single process's first loss.
fn checkpoints(comm: &Rc<MpiComm>, layout: Layout) -> Result<(), String> {
    let rank = comm.rank();
    let (r, d) = (layout.r, layout.d);
    let ranks = r * d;
    let label = layout.name();
    let batch = 2;
    let sharded = |dump: &Path, extra: &[(&str, String)]| {
        let mut pairs = vec![
            ("training.batch_size", batch.to_string()),
            ("checkpoint.enable", "true".into()),
            ("checkpoint.interval", "3".into()),
        ];
        pairs.extend(layout.keys());
        pairs.extend(extra.iter().cloned());
        config(dump, &pairs)
    };
    let single = |dump: &Path, extra: &[(&str, String)]| {
        let mut pairs = vec![
            ("training.batch_size", (batch * ranks).to_string()),
            ("checkpoint.enable", "true".into()),
            ("checkpoint.interval", "3".into()),
        ];
        pairs.extend(extra.iter().cloned());
        config(dump, &pairs)
    };
    let barrier = || comm.barrier().map_err(|err| err.to_string());
    let dump = scratch(&format!("ckpt-{label}"));
    if rank == 0 {
        let _ = std::fs::remove_dir_all(&dump);
    }
    barrier()?;
    train(&sharded(&dump, &[]), Some(Rc::clone(comm))).map_err(|e| format!("{e:#}"))?;
    let checkpoints = dump.join("checkpoints");
    barrier()?;
    // Rank 0 writes metrics.jsonl; the resumed run cuts it back to step 3 and appends.
    let full = if rank == 0 {
        metrics(&dump)?
    } else {
        Vec::new()
    };
    if rank == 0 {
        let step6 = checkpoints.join("step-00000006");
        // The first replica's R shards (one file without sharding).
        let shard = match r {
            1 => "model.safetensors".to_owned(),
            _ => format!("model-rank{}-of-{r}.safetensors", r - 1),
        };
        for file in ["state.json", "config.json", &shard] {
            if !step6.join(&file).is_file() {
                return Err(format!("{} has no {file}", step6.display()));
            }
        }
        std::fs::remove_dir_all(&step6).map_err(|e| e.to_string())?;
    }
    barrier()?;
    let taken = train(&sharded(&dump, &[]), Some(Rc::clone(comm))).map_err(|e| format!("{e:#}"))?;
    if taken != 3 {
        return Err(format!("the resumed run took {taken} steps, not 3"));
    }
    if rank == 0 {
        let resumed = metrics(&dump)?;
        if full.len() != 6 || resumed != full {
            return Err(format!(
                "uninterrupted run's metrics {full:?}, resumed run's {resumed:?}"
            ));
        }
    }
    barrier()?;
    let exported = scratch(&format!("export-{label}"));
    let single_dump = scratch(&format!("ckpt-R1-for-{label}"));
    let single_export = scratch(&format!("export-R1-for-{label}"));
    if rank == 0 {
        for dir in [&exported, &single_dump, &single_export] {
            let _ = std::fs::remove_dir_all(dir);
        }
        moekit_trainer::eval::export(&checkpoints.join("step-00000006"), &exported)
            .map_err(|e| format!("export: {e:#}"))?;
        train(&single(&single_dump, &[]), None).map_err(|e| format!("R=1: {e:#}"))?;
        moekit_trainer::eval::export(
            &single_dump.join("checkpoints/step-00000006"),
            &single_export,
        )
        .map_err(|e| format!("R=1 export: {e:#}"))?;
        let (largest, tensors) = max_abs_difference(&exported, &single_export)?;
        if largest > 1e-4 {
            return Err(format!("the exports differ by up to {largest:.2e}"));
        }
        // A sharded checkpoint resumes on the same layout only.
        let err = train(&single(&dump, &[]), None).expect_err("R=1 cannot resume R ranks' shards");
        let expected = format!(
            "was saved by {d} replica(s) of {r} rank(s); resume it with \
             parallelism.expert_parallel_degree = {r} and data_parallel_degree = {d}"
        );
        if !format!("{err:#}").contains(&expected) {
            return Err(format!("resuming on R=1: {err:#}"));
        }
        report(format!(
            "rank 0 of {label}: resume repeats steps 4-6 exactly; the sharded export's \
             {tensors} tensors equal the single process's within {largest:.1e}"
        ));
    }
    barrier()?;
    // Every rank loads its experts of the single process's export.
    let start = [
        (
            "checkpoint.initial_load_path",
            single_export.display().to_string(),
        ),
        ("training.steps", "1".into()),
        ("lr_scheduler.warmup_steps", "0".into()),
        ("checkpoint.enable", "false".into()),
    ];
    let from_hf = scratch(&format!("from-hf-{label}"));
    train(&sharded(&from_hf, &start), Some(Rc::clone(comm)))
        .map_err(|e| format!("from HF: {e:#}"))?;
    if rank == 0 {
        let one = scratch(&format!("from-hf-R1-for-{label}"));
        train(&single(&one, &start), None).map_err(|e| format!("R=1 from HF: {e:#}"))?;
        let (from_hf, one) = (&metrics(&from_hf)?[0], &metrics(&one)?[0]);
        let relative = (from_hf.loss - one.loss).abs() / one.loss;
        if relative > 1e-5 {
            return Err(format!(
                "from the export: first loss {} with {label}, {} with R=1",
                from_hf.loss, one.loss
            ));
        }
        report(format!(
            "rank 0 of {label}: started from a Hugging Face directory, the first loss equals R=1's within {relative:.1e}"
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let comm = match MpiComm::init() {
        Ok(comm) => Rc::new(comm),
        Err(err) => {
            report(format!("cannot initialise MPI: {err}"));
            return ExitCode::FAILURE;
        }
    };
    let (rank, ranks) = (comm.rank(), comm.size());
    if std::env::args().any(|a| a == "mismatch") {
        let seed = if rank == 1 { "1" } else { "0" };
        let config = config(
            &scratch("mismatch"),
            &[
                ("job.seed", seed.into()),
                ("parallelism.expert_parallel_degree", ranks.to_string()),
            ],
        );
        return match train(&config, Some(Rc::clone(&comm))) {
            Ok(_) => {
                report(format!("rank {rank}: a mismatched config was not reported"));
                ExitCode::SUCCESS
            }
            Err(err) => {
                report(format!("rank {rank} stops: {err:#}"));
                // Every rank saw the mismatch (it is checked collectively): wait until all
                // have reported it, since mpirun kills the job at the first non-zero exit.
                let _ = comm.barrier();
                ExitCode::FAILURE
            }
        };
    }
    if ranks < 2 {
        report("run under `mpirun -n R` with R ≥ 2 (see scripts/test.sh)".to_owned());
        return ExitCode::FAILURE;
    }
    // Experts over every rank, then D = 2 replicas of R = ranks / 2.
    let layouts = [Layout { r: ranks, d: 1 }, Layout { r: ranks / 2, d: 2 }];
    let result = layouts
        .into_iter()
        .try_for_each(|layout| parity(&comm, layout).and_then(|()| checkpoints(&comm, layout)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            report(format!("rank {rank}: {message}"));
            ExitCode::FAILURE
        }
    }
}
