//! Rank groups: `LocalComm`'s collectives deliver exactly what was sent, reduce bit-identically
//! on every rank, turn one rank's error into every rank's, and fail instead of hanging when a
//! rank leaves or never arrives.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::*;
use moekit::Error;
use moekit::ep::{Communicator, LocalComm, agree, all_to_all_v_f32, all_to_all_v_i32};
use proptest::prelude::*;

/// Runs `f(rank, comm)` on every rank of a fresh group, each in its own thread.
fn on_ranks<T: Send>(comms: Vec<LocalComm>, f: impl Fn(usize, &LocalComm) -> T + Sync) -> Vec<T> {
    thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let f = &f;
                scope.spawn(move || f(rank, &comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The byte chunk rank `src` sends rank `dst`: its length and contents identify both.
fn chunk(src: usize, dst: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (src * 31 + dst * 7 + i) as u8).collect()
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn all_to_all_v_delivers_every_chunk_in_rank_order(
        (r, lens) in (1usize..6).prop_flat_map(|r| (Just(r), proptest::collection::vec(0usize..40, r * r))),
    ) {
        let results = on_ranks(LocalComm::group(r).unwrap(), |rank, comm| {
            let send: Vec<u8> = (0..r).flat_map(|dst| chunk(rank, dst, lens[rank * r + dst])).collect();
            let counts: Vec<usize> = (0..r).map(|dst| lens[rank * r + dst]).collect();
            // Three exchanges in a row: no chunk of one may leak into the next.
            (0..3).map(|_| comm.all_to_all_v(&send, &counts).unwrap()).collect::<Vec<_>>()
        });
        for (dst, runs) in results.iter().enumerate() {
            let expected: Vec<u8> = (0..r).flat_map(|src| chunk(src, dst, lens[src * r + dst])).collect();
            let counts: Vec<usize> = (0..r).map(|src| lens[src * r + dst]).collect();
            for (received, recv_counts) in runs {
                prop_assert_eq!(received, &expected);
                prop_assert_eq!(recv_counts, &counts);
            }
        }
    }

    #[test]
    fn all_reduce_sums_in_rank_order_bit_identically(r in 1usize..6, n in 0usize..50, seed in any::<u64>()) {
        let mut rng = SeededRng::new(seed);
        let inputs: Vec<Vec<f32>> = (0..r).map(|_| rng.values(n, 100.0).iter().map(|&v| v as f32).collect()).collect();
        let mut expected = vec![0f32; n];
        for input in &inputs {
            for (e, v) in expected.iter_mut().zip(input) {
                *e += v;
            }
        }
        let results = on_ranks(LocalComm::group(r).unwrap(), |rank, comm| {
            let mut buffer = inputs[rank].clone();
            comm.all_reduce_sum(&mut buffer).unwrap();
            buffer
        });
        for result in results {
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&result), bits(&expected));
        }
    }
}

#[test]
fn typed_exchanges_keep_values() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let floats = [rank as f32 + 0.5, -1.25, 3.0];
        let ints = [rank as i32, -7];
        (
            all_to_all_v_f32(comm, &floats, &[1, 2]).unwrap(),
            all_to_all_v_i32(comm, &ints, &[0, 2]).unwrap(),
        )
    });
    assert_eq!(results[0].0, (vec![0.5, 1.5], vec![1, 1]));
    assert_eq!(results[1].0, (vec![-1.25, 3.0, -1.25, 3.0], vec![2, 2]));
    assert_eq!(results[0].1, (vec![], vec![0, 0]));
    assert_eq!(results[1].1, (vec![0, -7, 1, -7], vec![2, 2]));
}

#[test]
fn one_ranks_error_becomes_every_ranks_error() {
    for failing in 0..3 {
        let results = on_ranks(LocalComm::group(3).unwrap(), |rank, comm| {
            let local: moekit::Result<usize> = if rank == failing {
                Err(Error::Collective {
                    rank,
                    message: "expert_index holds expert 99".to_owned(),
                })
            } else {
                Ok(rank)
            };
            agree(comm, local)
        });
        for result in results {
            match result {
                Err(Error::Collective { rank, message }) => {
                    assert_eq!(rank, failing);
                    assert!(
                        message.contains("expert_index holds expert 99"),
                        "{message}"
                    );
                }
                other => panic!("expected the failing rank's error, got {other:?}"),
            }
        }
    }
    let results = on_ranks(LocalComm::group(3).unwrap(), |rank, comm| {
        agree(comm, Ok(rank * 10))
    });
    assert_eq!(
        results.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
        [0, 10, 20]
    );
}

#[test]
fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let start = Instant::now();
    let mut comms = LocalComm::group(3).unwrap();
    drop(comms.pop());
    let results = on_ranks(comms, |_, comm| comm.barrier());
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("rank 2: left the group"), "{message}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_rank_that_never_arrives_times_the_others_out() {
    let comms = LocalComm::group_with_timeout(2, Duration::from_millis(200)).unwrap();
    let results = on_ranks(comms, |rank, comm| {
        if rank == 0 {
            comm.all_to_all_v(&[1, 2], &[1, 1]).map(|_| ())
        } else {
            // Busy elsewhere past the timeout, then too late for the collective.
            thread::sleep(Duration::from_millis(2000));
            comm.barrier()
        }
    });
    let first = results[0].as_ref().unwrap_err().to_string();
    assert!(first.contains("rank 0: waited 200ms"), "{first}");
    let late = results[1].as_ref().unwrap_err().to_string();
    assert!(late.contains("rank 0: waited"), "{late}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let err = comm.all_to_all_v(&[1, 2, 3], &[2]).unwrap_err().to_string();
    assert!(
        err.contains("send counts sum to 2 bytes, the send buffer holds 3"),
        "{err}"
    );
    let err = comm.all_to_all_v(&[1], &[1, 0]).unwrap_err().to_string();
    assert!(err.contains("one send count per rank (1), got 2"), "{err}");
    let err = LocalComm::group(0).err().unwrap().to_string();
    assert!(err.contains("at least 1 rank"), "{err}");
}
