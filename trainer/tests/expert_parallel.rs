//! Expert-parallel training under `mpirun` (run by `scripts/test.sh` with `-n 2` and `-n 4`).
//!
//! - default: every rank trains the debug model with its experts sharded over the R ranks,
//!   each on its slice of every batch; rank 0 then trains the same model in one process on
//!   the whole batches (R × batch_size sequences) and compares. With the auxiliary loss off
//!   (each rank's aux loss pools only its own tokens, so it differs from the single process's)
//!   the runs optimise the same objective: their losses agree within 1e-5 relative at every
//!   step, on the `reference` and on the `cpu` kernels.
//! - `mismatch`: rank 1 loads a different seed; every rank must stop with the same message.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

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

/// Trains with R ranks, then (rank 0) in one process, and compares the losses.
fn parity(comm: &Rc<dyn Communicator>) -> Result<(), String> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let batch = 2;
    for moe in ["reference", "cpu"] {
        let sharded = config(
            &scratch(&format!("ep-{moe}")),
            &[
                ("kernels.moe", moe.into()),
                ("training.batch_size", batch.to_string()),
                ("parallelism.expert_parallel_degree", ranks.to_string()),
            ],
        );
        let ep = train(&sharded, Some(Rc::clone(comm)))
            .map_err(|err| format!("R={ranks} {moe}: {err:#}"))?;
        if rank != 0 {
            continue;
        }
        let single = config(
            &scratch(&format!("single-{moe}")),
            &[
                ("kernels.moe", moe.into()),
                ("training.batch_size", (batch * ranks).to_string()),
            ],
        );
        let one = train(&single, None).map_err(|err| format!("R=1 {moe}: {err:#}"))?;
        if ep.len() != one.len() {
            return Err(format!(
                "{moe}: {} steps with R={ranks}, {} with R=1",
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
                    "{moe}, step {}: loss {} with R={ranks}, {} with R=1 (relative difference {relative:.2e})",
                    a.step, a.loss, b.loss
                ));
            }
            let tokens = |m: &moekit_trainer::train::StepMetrics| {
                m.expert_counts
                    .iter()
                    .map(|l| l.iter().sum::<f64>())
                    .sum::<f64>()
            };
            if tokens(a) != tokens(b) {
                return Err(format!(
                    "{moe}, step {}: expert assignments {} with R={ranks}, {} with R=1",
                    a.step,
                    tokens(a),
                    tokens(b)
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
            "rank 0 of {ranks}: {moe}: {} steps, losses equal R=1's within {largest:.1e} \
             relative (first {:.5}, last {:.5})",
            ep.len(),
            first.loss,
            last.loss
        ));
    }
    Ok(())
}

fn main() -> ExitCode {
    let comm: Rc<dyn Communicator> = match MpiComm::init() {
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
    match parity(&comm) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            report(format!("rank {rank}: {message}"));
            ExitCode::FAILURE
        }
    }
}
