//! Expert parallelism over MPI ranks (feature `mpi`). Run under `mpirun` (scripts/test.sh runs
//! it with 2 and 4 ranks); every rank checks its own results and the process exits non-zero on
//! any failure, so `mpirun` does too.
//!
//! - `MpiComm`'s all-to-all-v (of bytes, words and rows taken where they lie) delivers every
//!   chunk in rank order; its all-reduce is
//!   bit-identical on every rank and equals the rank-order sum.
//! - `MpiComm::split` into groups by `rank % 2` and into pairs by `rank / 2`, ordered by
//!   descending world rank: each communicator has the ranks it should, in key order, and its
//!   collectives, interleaved with the world's and each other's, meet only its own ranks.
//! - The expert-parallel layer equals the single-rank layer (the same oracle and tolerances as
//!   the `LocalComm` tests), for several routings including all tokens on rank 0.
//! - With the argument `fault`, rank 1 gets a NaN in its tokens: every rank must report that
//!   rank's error, and the binary exits non-zero (the test command checks both).
//! - With the argument `stall`, rank 1 stops itself (SIGSTOP) before a barrier: the others must
//!   end the job after the 1 s timeout, naming rank 1, rather than wait forever (the test
//!   command checks the message and that `mpirun` exits non-zero in time).

mod common;

use std::process::{Command, ExitCode};
use std::rc::Rc;
use std::time::Duration;

use common::ep_layer::{EpCase, ep_data, run_rank, single_rank};
use common::rows_exchange::RowsCase;
use common::*;
use moekit::BackendKind;
use moekit::ep::{Communicator, MpiComm, RowChunks, RowsToSend};

/// The layer on this rank: `(output, d_x, d_w, d_gate_up, d_down)`.
fn run_layer(
    comm: &Rc<MpiComm>,
    c: &EpCase,
    nan_on: Option<usize>,
) -> moekit::Result<[Vec<f64>; 5]> {
    let rank = comm.rank();
    let mut data = ep_data(c);
    if nan_on == Some(rank) {
        let mut x = data.x[rank].to_f64_vec();
        x[0] = f64::NAN;
        data.x[rank] = f32_tensor(&[c.tokens[rank], c.h], &x);
    }
    let (output, grads) = run_rank(comm.clone(), c, &data, BackendKind::Cpu)?;
    Ok([
        output.to_f64_vec(),
        grads.d_x.to_f64_vec(),
        grads.d_w.to_f64_vec(),
        grads.d_gate_up_proj_weight.to_f64_vec(),
        grads.d_down_proj_weight.to_f64_vec(),
    ])
}

/// `what` must have failed on rank 0 with an error `expected` accepts, and succeeded on
/// every other rank.
fn only_rank_0_fails<T: std::fmt::Debug>(
    rank: usize,
    what: &str,
    result: moekit::Result<T>,
    expected: impl Fn(&str) -> bool,
) -> Result<(), String> {
    match (rank, result) {
        (0, Err(err)) if expected(&err.to_string()) => Ok(()),
        (0, result) => Err(format!("{what} gave {result:?}")),
        (_, Err(err)) => Err(format!("{what} failed here: {err}")),
        (_, Ok(_)) => Ok(()),
    }
}

fn check_exchanges(comm: &MpiComm) -> Result<(), String> {
    let (rank, r) = (comm.rank(), comm.size());
    let len = |src: usize, dst: usize| (src * 5 + dst * 3) % 7;
    let chunk = |src: usize, dst: usize| -> Vec<u8> {
        (0..len(src, dst))
            .map(|i| (src * 31 + dst * 7 + i) as u8)
            .collect()
    };
    let send: Vec<u8> = (0..r).flat_map(|dst| chunk(rank, dst)).collect();
    let counts: Vec<usize> = (0..r).map(|dst| len(rank, dst)).collect();
    let (received, recv_counts) = comm
        .all_to_all_v(&send, &counts)
        .map_err(|e| e.to_string())?;
    let expected: Vec<u8> = (0..r).flat_map(|src| chunk(src, rank)).collect();
    if received != expected || recv_counts != (0..r).map(|src| len(src, rank)).collect::<Vec<_>>() {
        return Err(format!(
            "all_to_all_v delivered {received:?}, expected {expected:?}"
        ));
    }
    // Words, borrowed and owned, with the counts exchanged and known.
    let word = |src: usize, dst: usize, i: usize| (src * 100 + dst * 10 + i) as f32;
    let words: Vec<f32> = (0..r)
        .flat_map(|dst| (0..len(rank, dst)).map(move |i| word(rank, dst, i)))
        .collect();
    let known: Vec<usize> = (0..r).map(|src| len(src, rank)).collect();
    let expected: Vec<f32> = (0..r)
        .flat_map(|src| (0..len(src, rank)).map(move |i| word(src, rank, i)))
        .collect();
    for (send, recv_counts) in [
        (std::borrow::Cow::Borrowed(&words[..]), None),
        (std::borrow::Cow::Owned(words.clone()), Some(&known[..])),
    ] {
        let received = comm
            .all_to_all_v_words(send, &counts, recv_counts)
            .map_err(|e| e.to_string())?;
        if received.counts() != known || received.clone().into_values() != expected {
            return Err(format!(
                "all_to_all_v_words delivered {:?}, expected {expected:?}",
                received.into_values()
            ));
        }
    }
    // Rows gathered (in any order, repeated) and consecutive.
    for seed in 0..8u64 {
        for consecutive in [false, true] {
            let case = RowsCase::new(r, seed, consecutive);
            let received = case.run(comm).map_err(|e| e.to_string())?;
            if received != case.expected(rank) {
                return Err(format!(
                    "all_to_all_v_rows of {case:?} delivered {received:?}, expected {:?}",
                    case.expected(rank)
                ));
            }
        }
    }
    // A source that sends fewer rows than expected is reported by the receiver (rank 0
    // expects 2 rows from rank 1, which sends 1); every message is still matched.
    if r >= 2 {
        let selections = vec![vec![0]; r];
        let recv_rows: Vec<usize> = (0..r)
            .map(|src| 1 + usize::from(rank == 0 && src == 1))
            .collect();
        let mut out = vec![std::mem::MaybeUninit::new(0.0); 2 * recv_rows.iter().sum::<usize>()];
        let result = comm.all_to_all_v_rows(
            &[1.0, 2.0],
            2,
            RowsToSend::Gathered(&selections),
            RowChunks::Packed(&recv_rows),
            &mut out,
        );
        only_rank_0_fails(rank, "a short row exchange", result, |err| {
            err == "rank 1: sent 2 words where rank 0 expected 4"
        })?;
    }
    // The same for words with known counts: rank 0 expects one word more from rank 1.
    if r >= 2 {
        let expected: Vec<usize> = (0..r)
            .map(|src| len(src, rank) + usize::from(rank == 0 && src == 1))
            .collect();
        let result = comm.all_to_all_v_words(
            std::borrow::Cow::Borrowed(&words[..]),
            &counts,
            Some(&expected),
        );
        let message = format!(
            "rank 1: sent {} words where rank 0 expected {}",
            len(1, 0),
            len(1, 0) + 1
        );
        only_rank_0_fails(rank, "a short word exchange", result, |err| err == message)?;
    }
    // Counts to itself that disagree are this rank's error after the round, which the
    // others still complete.
    let expected: Vec<usize> = (0..r)
        .map(|src| len(src, rank) + usize::from(rank == 0 && src == 0))
        .collect();
    let result = comm.all_to_all_v_words(
        std::borrow::Cow::Borrowed(&words[..]),
        &counts,
        Some(&expected),
    );
    only_rank_0_fails(rank, "a mismatched own count", result, |err| {
        err.contains("from itself")
    })?;
    let value = |src: usize, j: usize| (src as f32 + 1.0) * 0.1 + j as f32 * 1e-3;
    let mut buffer: Vec<f32> = (0..5).map(|j| value(rank, j)).collect();
    comm.all_reduce_sum(&mut buffer)
        .map_err(|e| e.to_string())?;
    let expected: Vec<f32> = (0..5)
        .map(|j| (0..r).fold(0f32, |sum, src| sum + value(src, j)))
        .collect();
    if buffer
        .iter()
        .map(|v| v.to_bits())
        .ne(expected.iter().map(|v| v.to_bits()))
    {
        return Err(format!(
            "all_reduce_sum gave {buffer:?}, expected {expected:?}"
        ));
    }
    Ok(())
}

fn check_layer(comm: &Rc<MpiComm>) -> Result<(), String> {
    let (rank, r) = (comm.rank(), comm.size());
    for seed in 0..6u64 {
        let c = EpCase {
            r,
            local: 1 + seed as usize % 2,
            k: 1 + seed as usize % 2,
            h: 5,
            i: 3,
            b: 2,
            tokens: (0..r).map(|rr| 1 + (rr + seed as usize) % 4).collect(),
            one_rank: seed % 3 == 2,
            norm_topk_prob: seed % 2 == 0,
            seed,
        };
        let got = run_layer(comm, &c, None).map_err(|e| format!("seed {seed}: {e}"))?;
        let data = ep_data(&c);
        let oracle: Vec<_> = (0..r).map(|rr| single_rank(&c, &data, rr)).collect();
        let sum = |part: usize| -> Vec<f64> {
            let mut total = vec![0.0; oracle[0][part].len()];
            for o in &oracle {
                for (t, v) in total.iter_mut().zip(&o[part]) {
                    *t += v;
                }
            }
            total
        };
        let (per_gate_up, per_down) = (c.local * c.h * 2 * c.i, c.local * c.i * c.h);
        let wanted = [
            oracle[rank][0].clone(),
            oracle[rank][1].clone(),
            sum(2),
            sum(3)[rank * per_gate_up..(rank + 1) * per_gate_up].to_vec(),
            sum(4)[rank * per_down..(rank + 1) * per_down].to_vec(),
        ];
        for (name, (got, want)) in ["output", "d_x", "d_w", "d_gate_up", "d_down"]
            .iter()
            .zip(got.iter().zip(&wanted))
        {
            assert_close(name, got, want, 1e-4, 1e-4 * scale(want))
                .map_err(|e| format!("seed {seed}: {e}"))?;
        }
    }
    Ok(())
}

/// Splits the world two ways and runs collectives on each, interleaved.
fn check_split(world: &MpiComm) -> Result<(), String> {
    let (rank, size) = (world.rank(), world.size());
    let parity = world
        .split(rank % 2, size - rank)
        .map_err(|e| e.to_string())?;
    let pairs = world
        .split(rank / 2, size - rank)
        .map_err(|e| e.to_string())?;
    // Members by world rank, ordered by the key (descending world rank).
    let members = |same: &dyn Fn(usize) -> bool| -> Vec<usize> {
        (0..size).rev().filter(|&other| same(other)).collect()
    };
    for (name, comm, want) in [
        ("parity", &parity, members(&|other| other % 2 == rank % 2)),
        ("pairs", &pairs, members(&|other| other / 2 == rank / 2)),
    ] {
        let position = want.iter().position(|&other| other == rank);
        if comm.size() != want.len() || Some(comm.rank()) != position {
            return Err(format!(
                "{name}: rank {} of {}, expected {position:?} of {}",
                comm.rank(),
                comm.size(),
                want.len()
            ));
        }
        // Each member adds 1 + its world rank; interleaved with a world-wide sum.
        let mut mine = [1.0 + rank as f32];
        comm.all_reduce_sum(&mut mine).map_err(|e| e.to_string())?;
        let mut everyone = [1.0f32];
        world
            .all_reduce_sum(&mut everyone)
            .map_err(|e| e.to_string())?;
        let want_sum: f32 = want.iter().map(|&other| 1.0 + other as f32).sum();
        if mine[0] != want_sum || everyone[0] != size as f32 {
            return Err(format!(
                "{name}: sums {} and {}, expected {want_sum} and {size}",
                mine[0], everyone[0]
            ));
        }
    }
    Ok(())
}

/// Writes one line to stderr in a single `write`, so that lines from different ranks, which
/// `mpirun` forwards through one stream, are never interleaved mid-line.
fn report(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn main() -> ExitCode {
    let comm = match MpiComm::init() {
        Ok(comm) => comm,
        Err(err) => {
            report(err.to_string());
            return ExitCode::FAILURE;
        }
    };
    let rank = comm.rank();
    if std::env::args().any(|a| a == "stall") {
        let comm = comm.with_timeout(Duration::from_secs(1));
        if rank == 1 {
            let pid = std::process::id().to_string();
            if let Err(err) = Command::new("kill").args(["-STOP", &pid]).status() {
                report(format!("rank 1 cannot stop itself: {err}"));
            }
            // Continued only by mpirun ending the job.
            return ExitCode::FAILURE;
        }
        let result = comm.barrier();
        report(format!(
            "rank {rank}: the barrier returned {result:?} although rank 1 was stopped"
        ));
        return ExitCode::FAILURE;
    }
    let comm = Rc::new(comm);
    if std::env::args().any(|a| a == "fault") {
        let c = EpCase {
            r: comm.size(),
            local: 1,
            k: 1,
            h: 3,
            i: 2,
            b: 2,
            tokens: vec![2; comm.size()],
            one_rank: false,
            norm_topk_prob: true,
            seed: 1,
        };
        return match run_layer(&comm, &c, Some(1)) {
            Ok(_) => {
                report(format!(
                    "rank {rank}: invalid input on rank 1 was not reported"
                ));
                ExitCode::SUCCESS
            }
            Err(err) => {
                report(format!("rank {rank} stops: {err}"));
                // Every rank has seen the error (it was agreed collectively); wait until all
                // have reported it before exiting, since mpirun kills the job at the first
                // non-zero exit.
                let _ = comm.barrier();
                ExitCode::FAILURE
            }
        };
    }
    let result = check_exchanges(&comm)
        .and_then(|()| check_split(&comm))
        .and_then(|()| check_layer(&comm));
    match result {
        Ok(()) => {
            println!(
                "rank {rank} of {}: expert parallelism over MPI ok",
                comm.size()
            );
            ExitCode::SUCCESS
        }
        Err(message) => {
            report(format!("rank {rank}: {message}"));
            ExitCode::FAILURE
        }
    }
}
