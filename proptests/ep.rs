//! Expert parallelism over `LocalComm` ranks.
//!
//! - The collectives deliver exactly what was sent (row exchanges: the selected rows, leaving a
//!   rank's own chunk to it), reduce bit-identically on every rank, turn
//!   one rank's error into every rank's, and fail instead of hanging when a rank leaves or
//!   never arrives.
//! - The expert-parallel layer (router → dispatch → permute → blockwise_mm → combine) equals
//!   the single-rank layer holding every expert, for R ∈ {1, 2, 4}, random routings (K spanning
//!   several ranks, all tokens on one rank so the others receive nothing): outputs, input and
//!   affinity gradients per rank, the router gradient summed over ranks, each rank's expert
//!   gradients. Tolerance 1e-5 relative to the largest entry on the reference backend (the EP
//!   path adds the ranks' partial outputs in f32), 1e-4 on cpu; runs are bit-identical.
//! - `a2av_routing` builds nki-library's routing table (each token once in the column of every
//!   rank holding one of its experts, ascending, T when empty) on both backends.
//! - `dispatch` delivers `permute_a2av`'s layout (source s's rows at `[s·S, s·S + n_s)` of
//!   `[R·S, H]`, S the largest T, zeros, `SKIP` and 0 past them) with the route of
//!   `a2av_routing`, and `combine` reads `unpermute_a2av`'s input in that layout, for ranks of
//!   different T (0 included).

mod common;

use std::borrow::Cow;
use std::mem::MaybeUninit;
use std::rc::Rc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::ep_layer::{EpCase, EpData, ep_data, run_rank, single_rank};
use common::rows_exchange::RowsCase;
use common::*;
use moekit::contracts::{A2avRouting, A2avRoutingInputs, A2avRoutingParams};
use moekit::ep::{
    Communicator, DispatchParams, Dispatched, EpGrads, LocalComm, RowChunks, RowsToSend,
    ShardedExperts, agree, all_to_all_v_values, combine, combine_bwd, dispatch, dispatch_bwd,
};
use moekit::experts::{Experts, ExpertsInputs};
use moekit::{BackendKind, Error, Tensor};
use proptest::prelude::*;

/// Runs `f(rank, comm)` on every rank of a fresh group, each in its own thread.
fn on_ranks<T: Send>(comms: Vec<LocalComm>, f: impl Fn(usize, &LocalComm) -> T + Sync) -> Vec<T> {
    on_owned_ranks(comms, |rank, comm| f(rank, &comm))
}

/// Runs `f(rank, comm)` on every rank of a fresh group, each in its own thread, which owns its
/// rank.
fn on_owned_ranks<T: Send>(
    comms: Vec<LocalComm>,
    f: impl Fn(usize, LocalComm) -> T + Sync,
) -> Vec<T> {
    thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let f = &f;
                scope.spawn(move || f(rank, comm))
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

/// A communicator with only the required methods, so the trait's default
/// `all_to_all_v_words` (through the byte exchange) runs.
struct BytesOnly<'a>(&'a LocalComm);

impl Communicator for BytesOnly<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_to_all_v(&self, send: &[u8], counts: &[usize]) -> moekit::Result<(Vec<u8>, Vec<usize>)> {
        self.0.all_to_all_v(send, counts)
    }
    fn all_reduce_sum(&self, buffer: &mut [f32]) -> moekit::Result<()> {
        self.0.all_reduce_sum(buffer)
    }
    fn barrier(&self) -> moekit::Result<()> {
        self.0.barrier()
    }
}

/// The word rank `src` sends rank `dst` at position i.
fn word(src: usize, dst: usize, i: usize) -> f32 {
    (src * 1000 + dst * 100 + i) as f32 - 0.5
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn word_exchanges_deliver_every_chunk_in_place_and_in_rank_order(
        (r, lens) in (1usize..6).prop_flat_map(|r| (Just(r), proptest::collection::vec(0usize..40, r * r))),
        owned in any::<bool>(),
        known in any::<bool>(),
        default_impl in any::<bool>(),
    ) {
        let results = on_ranks(LocalComm::group(r).unwrap(), |rank, comm| {
            let bytes_only = BytesOnly(comm);
            let comm: &dyn Communicator = if default_impl { &bytes_only } else { comm };
            let send: Vec<f32> = (0..r)
                .flat_map(|dst| (0..lens[rank * r + dst]).map(move |i| word(rank, dst, i)))
                .collect();
            let counts: Vec<usize> = (0..r).map(|dst| lens[rank * r + dst]).collect();
            let expected_counts: Vec<usize> = (0..r).map(|src| lens[src * r + rank]).collect();
            // Three exchanges in a row: no chunk of one may leak into the next.
            (0..3)
                .map(|_| {
                    let send = if owned { Cow::Owned(send.clone()) } else { Cow::Borrowed(&send[..]) };
                    let received = comm
                        .all_to_all_v_words(send, &counts, known.then_some(&expected_counts[..]))
                        .unwrap();
                    let chunks: Vec<Vec<f32>> = (0..r).map(|src| received.chunk(src).to_vec()).collect();
                    (received.counts(), chunks, received.into_values())
                })
                .collect::<Vec<_>>()
        });
        for (dst, runs) in results.iter().enumerate() {
            let chunks: Vec<Vec<f32>> = (0..r)
                .map(|src| (0..lens[src * r + dst]).map(|i| word(src, dst, i)).collect())
                .collect();
            let counts: Vec<usize> = chunks.iter().map(Vec::len).collect();
            for (recv_counts, received_chunks, values) in runs {
                prop_assert_eq!(recv_counts, &counts);
                prop_assert_eq!(received_chunks, &chunks);
                prop_assert_eq!(values, &chunks.concat());
            }
        }
    }
}

proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn row_exchanges_deliver_the_selected_rows_and_leave_the_own_chunk(
        r in 1usize..6,
        seed in any::<u64>(),
        consecutive in any::<bool>(),
        default_impl in any::<bool>(),
    ) {
        let case = RowsCase::new(r, seed, consecutive);
        let results = on_ranks(LocalComm::group(r).unwrap(), |_, comm| {
            let bytes_only = BytesOnly(comm);
            let comm: &dyn Communicator = if default_impl { &bytes_only } else { comm };
            // Twice in a row: no chunk of one may leak into the next.
            (case.run(comm).unwrap(), case.run(comm).unwrap())
        });
        for (rank, (first, second)) in results.into_iter().enumerate() {
            prop_assert_eq!(&first, &case.expected(rank));
            prop_assert_eq!(&second, &case.expected(rank));
        }
    }
}

#[test]
fn row_exchanges_check_their_arguments_and_counts() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let source = [1.0, 2.0, 3.0, 4.0];
        let mut out = vec![MaybeUninit::new(0.0); 4];
        let selections = [vec![0], vec![1]];
        let rows = RowsToSend::Gathered(&selections);
        let one_each = RowChunks::Packed(&[1, 1]);
        let bad_width = comm.all_to_all_v_rows(&source, 3, rows, one_each, &mut out);
        let bad_row = comm.all_to_all_v_rows(
            &source,
            2,
            RowsToSend::Gathered(&[vec![0], vec![2]]),
            one_each,
            &mut out,
        );
        let bad_out = comm.all_to_all_v_rows(&source, 2, rows, one_each, &mut out[..3]);
        let past_stride = comm.all_to_all_v_rows(
            &source,
            2,
            rows,
            RowChunks::Strided {
                counts: &[1, 2],
                stride: 1,
            },
            &mut out,
        );
        // Rank 0 expects 2 rows from rank 1, which sends it 1.
        let short = comm.all_to_all_v_rows(
            &source,
            2,
            rows,
            RowChunks::Packed(&[1, 1 + (1 - rank)]),
            &mut vec![MaybeUninit::new(0.0); 4 + 2 * (1 - rank)],
        );
        [bad_width, bad_row, bad_out, past_stride, short]
            .map(|result| result.map_err(|e| e.to_string()))
    });
    for (rank, [bad_width, bad_row, bad_out, past_stride, short]) in results.into_iter().enumerate()
    {
        assert!(bad_width.unwrap_err().contains("whole rows"));
        assert!(
            bad_row
                .unwrap_err()
                .contains("selects row 2 of a source of 2 rows")
        );
        assert!(bad_out.unwrap_err().contains("the receive buffer holds 3"));
        let past_stride = past_stride.unwrap_err();
        assert!(
            past_stride.contains("receives 2 rows from rank 1 into chunks of 1 rows"),
            "{past_stride}"
        );
        match rank {
            0 => assert!(short.unwrap_err().contains("expected"), "rank 0"),
            _ => short.unwrap(),
        }
    }
}

#[test]
fn word_exchanges_check_their_counts() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        // Each rank sends 1 word to rank 0 and 2 to rank 1; rank 0 expects 3 from rank 1.
        let expected = if rank == 0 { vec![1, 3] } else { vec![2, 2] };
        comm.all_to_all_v_words(Cow::Owned(vec![1.0, 2.0, 3.0]), &[1, 2], Some(&expected))
            .map(|received| received.into_values())
    });
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("rank 0: expected [1, 3] words from the ranks of the group, received [1, 1]"),
        "{err}"
    );
    assert_eq!(results[1].as_ref().unwrap(), &vec![2.0, 3.0, 2.0, 3.0]);
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let err = comm
        .all_to_all_v_words(Cow::Owned(vec![1.0]), &[2], None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("send counts sum to 2 words, the send buffer holds 1"),
        "{err}"
    );
}

#[test]
fn typed_exchanges_keep_values() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let floats = [rank as f32 + 0.5, -1.25, 3.0];
        let ints = [rank as i32, -7];
        (
            all_to_all_v_values(comm, &floats, &[1, 2]).unwrap(),
            all_to_all_v_values(comm, &ints, &[0, 2]).unwrap(),
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
fn a_row_exchange_met_by_another_collective_fails_on_every_rank() {
    // Rank 0 offers views of its rows while rank 1 runs a word exchange at the same step:
    // both report the mix-up, and rank 0 returns only once rank 1 has let go of its offer.
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let source = vec![1.0f32; 8];
        match rank {
            0 => {
                let selections = [vec![0], vec![1, 2]];
                let mut out = vec![MaybeUninit::new(0.0); 8];
                let rows = RowsToSend::Gathered(&selections);
                comm.all_to_all_v_rows(&source, 2, rows, RowChunks::Packed(&[1, 3]), &mut out)
            }
            _ => comm
                .all_to_all_v_words(Cow::Borrowed(&source[..2]), &[1, 1], None)
                .map(drop),
        }
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("different all-to-alls"), "{message}");
    }
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
    // R² mailbox slots past usize.
    let err = LocalComm::group(1 << 33).err().unwrap().to_string();
    assert!(
        err.contains("8589934592 ranks are too many") && err.contains("LocalComm's mailbox"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// The expert-parallel layer against the single-rank layer.

fn ep_case() -> impl Strategy<Value = EpCase> {
    (
        prop_oneof![Just(1usize), Just(2), Just(4)],
        1usize..4,
        1usize..7,
        1usize..5,
        1usize..6,
    )
        .prop_flat_map(|(r, local, h, i, b)| {
            (
                Just((r, local, h, i, b)),
                1..=(r * local).min(4),
                proptest::collection::vec(1usize..7, r),
                any::<(bool, bool, u64)>(),
            )
        })
        .prop_map(
            |((r, local, h, i, b), k, tokens, (one_rank, norm_topk_prob, seed))| EpCase {
                r,
                local,
                k: if one_rank { k.min(local) } else { k },
                h,
                i,
                b,
                tokens,
                one_rank,
                norm_topk_prob,
                seed,
            },
        )
}

type RankResult = moekit::Result<(Tensor, EpGrads)>;

fn run_ep(c: &EpCase, data: &EpData, backend: BackendKind) -> Vec<RankResult> {
    on_owned_ranks(LocalComm::group(c.r).unwrap(), |_, comm| {
        run_rank(Rc::new(comm), c, data, backend)
    })
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn expert_parallel_layer_equals_the_single_rank_layer(c in ep_case()) {
        let data = ep_data(&c);
        let oracle: Vec<[Vec<f64>; 5]> = (0..c.r).map(|rank| single_rank(&c, &data, rank)).collect();
        let sum = |part: usize| -> Vec<f64> {
            let mut total = vec![0.0; oracle[0][part].len()];
            for o in &oracle {
                for (t, v) in total.iter_mut().zip(&o[part]) {
                    *t += v;
                }
            }
            total
        };
        let (d_w, d_gate_up, d_down) = (sum(2), sum(3), sum(4));
        let per_gate_up = c.local * c.h * 2 * c.i;
        let per_down = c.local * c.i * c.h;
        let results = run_ep(&c, &data, BackendKind::Reference);
        let close = |what: &str, got: &Tensor, want: &[f64]| {
            assert_close(what, &got.to_f64_vec(), want, 1e-5, 1e-5 * scale(want))
        };
        for (rank, result) in results.iter().enumerate() {
            let (output, grads) = result.as_ref().unwrap();
            close("output", output, &oracle[rank][0])?;
            close("d_x", &grads.d_x, &oracle[rank][1])?;
            close("d_w", &grads.d_w, &d_w)?;
            close("d_gate_up", &grads.d_gate_up_proj_weight, &d_gate_up[rank * per_gate_up..(rank + 1) * per_gate_up])?;
            close("d_down", &grads.d_down_proj_weight, &d_down[rank * per_down..(rank + 1) * per_down])?;
        }
        // Bit-identical on a second run, and on the cpu backend within the cpu tolerance.
        let again = run_ep(&c, &data, BackendKind::Reference);
        for (a, b) in results.iter().zip(&again) {
            prop_assert!(a.as_ref().unwrap() == b.as_ref().unwrap(), "runs differ");
        }
        for (rank, result) in run_ep(&c, &data, BackendKind::Cpu).iter().enumerate() {
            let (output, grads) = result.as_ref().unwrap();
            assert_close("cpu output", &output.to_f64_vec(), &oracle[rank][0], 1e-4, 1e-4 * scale(&oracle[rank][0]))?;
            assert_close("cpu d_x", &grads.d_x.to_f64_vec(), &oracle[rank][1], 1e-4, 1e-4 * scale(&oracle[rank][1]))?;
        }
    }
}

#[test]
fn invalid_input_on_one_rank_is_every_ranks_error() {
    let c = EpCase {
        r: 2,
        local: 2,
        k: 2,
        h: 3,
        i: 2,
        b: 2,
        tokens: vec![3, 2],
        one_rank: false,
        norm_topk_prob: true,
        seed: 5,
    };
    let mut data = ep_data(&c);
    let mut bad = data.x[1].to_f64_vec();
    bad[4] = f64::NAN;
    data.x[1] = f32_tensor(&[2, 3], &bad);
    for result in run_ep(&c, &data, BackendKind::Cpu) {
        let message = result.unwrap_err().to_string();
        assert!(
            message.starts_with("rank 1: tensor `x`: non-finite value NaN"),
            "{message}"
        );
    }
}

#[test]
fn a_non_finite_hidden_state_on_one_rank_is_every_ranks_error() {
    // The row of token 2 goes to rank 1 only (expert 3 of E = 4 over R = 2); the value is the
    // first bad one in row-major order, and an infinity follows it.
    for bad in [f64::NAN, f64::NEG_INFINITY] {
        let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
            let mut values = vec![0.5; 4 * 3];
            if rank == 1 {
                values[2 * 3 + 1] = bad;
                values[3 * 3] = f64::INFINITY;
            }
            let x = f32_tensor(&[4, 3], &values);
            let index = i32_tensor(&[4, 2], &[0, 1, 2, 0, 3, 2, 1, 2]);
            dispatch(
                comm,
                &x,
                &index,
                &f32_tensor(&[4, 2], &[0.5; 8]),
                DispatchParams { num_experts: 4 },
            )
            .map(|_| ())
        });
        for result in results {
            let message = result.unwrap_err().to_string();
            assert!(
                message.starts_with(&format!(
                    "rank 1: tensor `hidden_states`: non-finite value {bad} at [2, 1]"
                )),
                "{message}"
            );
        }
    }
}

/// Two ranks' worth of a small dispatch (T = 4, H = 3, E = 4 over R = 2, K = 2): tokens 1, 2
/// and 3 have an expert on rank 1. Returns `(x, expert_index, params, dispatched)`.
fn small_dispatch(comm: &LocalComm) -> (Tensor, Tensor, DispatchParams, Dispatched) {
    let x = f32_tensor(&[4, 3], &[0.5; 12]);
    let index = i32_tensor(&[4, 2], &[0, 1, 2, 0, 3, 2, 1, 2]);
    let params = DispatchParams { num_experts: 4 };
    let affinities = f32_tensor(&[4, 2], &[0.5; 8]);
    let dispatched = dispatch(comm, &x, &index, &affinities, params).unwrap();
    (x, index, params, dispatched)
}

#[test]
fn a_non_finite_expert_output_is_every_ranks_error_naming_its_rank_and_position() {
    // Tokens 1, 2 and 3 of each rank have an expert on rank 1 (E = 4 over R = 2), so rank 1's
    // `expert_output` starts with rank 0's three rows: a NaN in the first of them is found by
    // rank 0 while it adds, an infinity in a later row by rank 1; the first position wins.
    for bad in [f32::NAN, f32::NEG_INFINITY] {
        let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
            let (_, _, _, dispatched) = small_dispatch(comm);
            let mut output = dispatched.hidden_states.as_f32().unwrap().to_vec();
            if rank == 1 {
                output[1] = bad;
                output[4 * 3 + 2] = f32::INFINITY;
            }
            let output = Tensor::from_f32(dispatched.hidden_states.shape().to_vec(), output)?;
            combine(comm, &dispatched.route, &output).map(|_| ())
        });
        for result in results {
            let message = result.unwrap_err().to_string();
            assert!(
                message.starts_with(&format!(
                    "rank 1: tensor `expert_output`: non-finite value {bad} at [0, 1]"
                )),
                "{message}"
            );
        }
    }
}

#[test]
fn routes_outside_nki_library_conventions_are_every_ranks_error() {
    // Each rank breaks its own route one way; every function names the tensor, on both ranks.
    type Break = fn(&mut moekit::ep::Route);
    let breaks: [(Break, &str); 4] = [
        // Column 1 lists its tokens in descending order.
        (
            |route| {
                let mut table = route.send_indices.as_i32().unwrap().to_vec();
                table.swap(2 + 1, 2 * 2 + 1);
                route.send_indices = Tensor::from_i32([4, 2], table).unwrap();
            },
            "column 1 must list send_counts[1] = 3 token ids in [0, 4), ascending, then T = 4",
        ),
        // A count the column does not hold.
        (
            |route| route.send_counts = Tensor::from_i32([1, 2], vec![4, 3]).unwrap(),
            "column 0 must list send_counts[0] = 4 token ids",
        ),
        // More rows from a source than the stride.
        (
            |route| route.stride = 2,
            "receives 3 rows from rank 0, more than the route's stride S = 2",
        ),
        (
            |route| route.recv_counts = Tensor::from_i32([1, 3], vec![1, 1, 1]).unwrap(),
            "tensor `recv_counts`: expected shape [1, R] = [1, 2]",
        ),
    ];
    for (bad, needle) in breaks {
        let results = on_ranks(LocalComm::group(2).unwrap(), |_, comm| {
            let (x, _, _, dispatched) = small_dispatch(comm);
            let mut route = dispatched.route.clone();
            bad(&mut route);
            [
                combine(comm, &route, &dispatched.hidden_states).map(drop),
                combine_bwd(comm, &route, &x).map(drop),
            ]
            .map(|result| result.unwrap_err().to_string())
        });
        for messages in results {
            for message in messages {
                assert!(message.contains(needle), "`{message}` lacks `{needle}`");
            }
        }
    }
}

#[test]
fn routes_that_disagree_across_ranks_are_every_ranks_error() {
    // Rank 1 moves one row of its receive counts from rank 0 to itself: its own route stays
    // consistent with its tensors, but no longer with rank 0's. combine, combine_bwd and
    // dispatch_bwd each report it on both ranks before any row travels.
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let (x, index, params, dispatched) = small_dispatch(comm);
        let mut route = dispatched.route.clone();
        if rank == 1 {
            let mut counts = route.recv_counts.as_i32().unwrap().to_vec();
            counts[0] -= 1;
            counts[1] += 1;
            route.recv_counts = Tensor::from_i32([2], counts).unwrap();
        }
        let m = dispatched.hidden_states.shape()[0];
        [
            combine(comm, &route, &dispatched.hidden_states).map(drop),
            combine_bwd(comm, &route, &x).map(drop),
            dispatch_bwd(
                comm,
                &route,
                &index,
                params,
                &dispatched.hidden_states,
                &f32_tensor(&[m, 2], &vec![0.5; m * 2]),
            )
            .map(drop),
        ]
        .map(|result| result.unwrap_err().to_string())
    });
    for messages in results {
        for message in messages {
            assert!(
                message.starts_with(
                    "rank 1: its route expects 2 rows from rank 0, whose route sends it 3"
                ),
                "{message}"
            );
        }
    }
}

#[test]
fn rows_without_columns_are_every_ranks_error() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |_, comm| {
        let (_, _, _, dispatched) = small_dispatch(comm);
        let m = dispatched.hidden_states.shape()[0];
        let empty = |rows: usize| Tensor::from_f32([rows, 0], Vec::new()).unwrap();
        [
            combine(comm, &dispatched.route, &empty(m)).map(drop),
            combine_bwd(comm, &dispatched.route, &empty(4)).map(drop),
        ]
        .map(|result| result.unwrap_err().to_string())
    });
    for [combined, backward] in results {
        assert!(
            combined.contains("expert_output") && combined.contains("at least 1"),
            "{combined}"
        );
        assert!(
            backward.contains("d_output") && backward.contains("at least 1"),
            "{backward}"
        );
    }
}

#[test]
fn ranks_started_with_different_sizes_are_detected() {
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let h = 3 + rank;
        let x = f32_tensor(&[1, h], &vec![0.5; h]);
        let index = i32_tensor(&[1, 1], &[0]);
        let affinities = f32_tensor(&[1, 1], &[1.0]);
        dispatch(
            comm,
            &x,
            &index,
            &affinities,
            DispatchParams { num_experts: 4 },
        )
        .map(|_| ())
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("H (hidden size) = 4, but rank"),
            "{message}"
        );
    }
    let results = on_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let x = f32_tensor(&[1, 3], &[0.5; 3]);
        let x = if rank == 1 { x.to_bf16() } else { x };
        dispatch(
            comm,
            &x,
            &i32_tensor(&[1, 1], &[0]),
            &f32_tensor(&[1, 1], &[1.0]),
            DispatchParams { num_experts: 4 },
        )
        .map(|_| ())
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(message.contains("rank 1: runs with hidden_states bits (dtype) = 16, but rank 0 runs with hidden_states bits (dtype) = 32"), "{message}");
    }
    let results = on_ranks(LocalComm::group(2).unwrap(), |_, comm| {
        let x = f32_tensor(&[1, 2], &[0.5; 2]);
        dispatch(
            comm,
            &x,
            &i32_tensor(&[1, 1], &[0]),
            &f32_tensor(&[1, 1], &[1.0]),
            DispatchParams { num_experts: 3 },
        )
        .map(|_| ())
    });
    for result in results {
        let message = result.unwrap_err().to_string();
        assert!(
            message.contains("E = 3 experts cannot be sharded evenly over R = 2 ranks"),
            "{message}"
        );
    }
}

/// One rank's dispatch inputs: `(x [T, H], expert_index [T, K], topk_affinities [T, K])`.
type RankInputs = (Vec<f64>, Vec<i32>, Vec<f64>);

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn dispatch_and_combine_use_nki_library_layouts(
        (ranks, local, h, k) in (1usize..5, 1usize..4, 1usize..5, 1usize..4),
        tokens in proptest::collection::vec(0usize..9, 4),
        routing in routing(),
        seed in any::<u64>(),
    ) {
        let e = ranks * local;
        let k = k.min(e);
        let mut rng = SeededRng::new(seed);
        let inputs: Vec<RankInputs> = (0..ranks)
            .map(|rank| {
                let t = tokens[rank];
                let x = (0..t * h).map(|i| (rank * 1000 + i) as f64).collect();
                let index = expert_index(&mut rng, routing, t, e, k);
                (x, index, rng.values(t * k, 1.0))
            })
            .collect();
        let stride = tokens[..ranks].iter().copied().max().unwrap_or(0);
        let results = on_ranks(LocalComm::group(ranks).unwrap(), |rank, comm| {
            let (x, index, affinities) = &inputs[rank];
            let t = tokens[rank];
            let index = i32_tensor(&[t, k], index);
            let dispatched = dispatch(
                comm,
                &f32_tensor(&[t, h], x),
                &index,
                &f32_tensor(&[t, k], affinities),
                DispatchParams { num_experts: e },
            )?;
            // The expert outputs: each received row doubled; the rows past each source's NaN,
            // which combine must not read.
            let received = dispatched.hidden_states.to_f64_vec();
            let ids = dispatched.expert_index.as_i32().unwrap();
            let doubled: Vec<f64> = received
                .iter()
                .enumerate()
                .map(|(i, v)| match ids[(i / h) * k..(i / h + 1) * k].iter().all(|&id| id == moekit::contracts::SKIP) {
                    true => f64::NAN,
                    false => 2.0 * v,
                })
                .collect();
            let combined = combine(comm, &dispatched.route, &f32_tensor(&[received.len() / h, h], &doubled))?;
            let routing = BackendKind::Reference.create().a2av_routing(
                &A2avRouting::new(
                    A2avRoutingInputs { expert_index: &index },
                    A2avRoutingParams { num_experts: e, expert_parallel_degree: ranks },
                )?,
            )?;
            Ok::<_, moekit::Error>((dispatched, combined, routing))
        });
        for (me, result) in results.into_iter().enumerate() {
            let (dispatched, combined, routing) = result.unwrap();
            // The route is the a2av_routing kernel's table, with its counts.
            prop_assert_eq!(&dispatched.route.send_indices, &routing.send_indices);
            prop_assert_eq!(&dispatched.route.send_counts, &routing.send_counts);
            prop_assert_eq!(dispatched.route.stride, stride);
            // The oracle: from each source, its tokens with an expert on `me`, ascending.
            let owned = me * local..(me + 1) * local;
            let mut hidden = vec![0.0; ranks * stride * h];
            let mut ids = vec![moekit::contracts::SKIP; ranks * stride * k];
            let mut affinities = vec![0.0; ranks * stride * k];
            let mut recv_counts = Vec::new();
            for (src, (x, index, a)) in inputs.iter().enumerate() {
                let sent: Vec<usize> = (0..tokens[src])
                    .filter(|&tok| index[tok * k..(tok + 1) * k].iter().any(|&id| owned.contains(&(id as usize))))
                    .collect();
                for (j, &tok) in sent.iter().enumerate() {
                    let row = src * stride + j;
                    hidden[row * h..(row + 1) * h].copy_from_slice(&x[tok * h..(tok + 1) * h]);
                    for slot in 0..k {
                        let id = index[tok * k + slot] as usize;
                        if owned.contains(&id) {
                            ids[row * k + slot] = (id - owned.start) as i32;
                            affinities[row * k + slot] = f64::from(a[tok * k + slot] as f32);
                        }
                    }
                }
                recv_counts.push(sent.len() as i32);
            }
            prop_assert_eq!(dispatched.route.recv_counts.shape(), &[1, ranks]);
            prop_assert_eq!(dispatched.route.recv_counts.as_i32().unwrap(), &recv_counts[..]);
            prop_assert_eq!(dispatched.hidden_states.shape(), &[ranks * stride, h]);
            prop_assert_eq!(dispatched.hidden_states.to_f64_vec(), hidden);
            prop_assert_eq!(dispatched.expert_index.as_i32().unwrap(), &ids[..]);
            prop_assert_eq!(dispatched.topk_affinities.to_f64_vec(), affinities);
            // Each token comes back once from every rank it went to, doubled.
            let (x, index, _) = &inputs[me];
            let visits = |tok: usize| {
                (0..ranks)
                    .filter(|&rank| index[tok * k..(tok + 1) * k].iter().any(|&id| id as usize / local == rank))
                    .count() as f64
            };
            let expected: Vec<f64> = (0..tokens[me] * h).map(|i| 2.0 * visits(i / h) * x[i]).collect();
            prop_assert_eq!(combined.to_f64_vec(), expected);
        }
    }
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn a2av_routing_lists_each_token_once_per_rank_holding_one_of_its_experts(
        (t, ranks, local) in (1usize..40, 1usize..6, 1usize..5),
        k in 1usize..5,
        routing in routing(),
        seed in any::<u64>(),
        skips in any::<bool>(),
    ) {
        let e = ranks * local;
        let k = k.min(e);
        let mut rng = SeededRng::new(seed);
        let mut index = expert_index(&mut rng, routing, t, e, k);
        if skips {
            let mut affinities = vec![0.5; t * k];
            skip_slots(&mut rng, &mut index, &mut affinities);
        }
        let index_tensor = i32_tensor(&[t, k], &index);
        let call = A2avRouting::new(
            A2avRoutingInputs { expert_index: &index_tensor },
            A2avRoutingParams { num_experts: e, expert_parallel_degree: ranks },
        )
        .unwrap();
        let reference = BackendKind::Reference.create().a2av_routing(&call).unwrap();
        let cpu = BackendKind::Cpu.create().a2av_routing(&call).unwrap();
        prop_assert_eq!(&cpu, &reference);
        prop_assert_eq!(reference.send_indices.shape(), &[t, ranks]);
        prop_assert_eq!(reference.send_counts.shape(), &[1, ranks]);
        let table = reference.send_indices.as_i32().unwrap();
        let counts = reference.send_counts.as_i32().unwrap();
        for rank in 0..ranks {
            // The oracle: the tokens with an expert in [rank·E/EP, (rank+1)·E/EP), ascending.
            let owns = |id: i32| id >= 0 && (id as usize) / local == rank;
            let expected: Vec<i32> = (0..t)
                .filter(|&tok| index[tok * k..(tok + 1) * k].iter().any(|&id| owns(id)))
                .map(|tok| tok as i32)
                .collect();
            let column: Vec<i32> = (0..t).map(|row| table[row * ranks + rank]).collect();
            prop_assert_eq!(counts[rank] as usize, expected.len());
            prop_assert_eq!(&column[..expected.len()], &expected[..]);
            prop_assert!(column[expected.len()..].iter().all(|&id| id as usize == t));
        }
    }
}

#[test]
fn a2av_routing_refuses_ranks_that_do_not_divide_the_experts() {
    let index = i32_tensor(&[2, 1], &[0, 5]);
    let run = |num_experts, expert_parallel_degree| {
        A2avRouting::new(
            A2avRoutingInputs {
                expert_index: &index,
            },
            A2avRoutingParams {
                num_experts,
                expert_parallel_degree,
            },
        )
        .map(|_| ())
    };
    run(6, 3).unwrap();
    for (e, r, needles) in [
        (
            6,
            4,
            &["expert_parallel_degree", "divide num_experts = 6", "got 4"][..],
        ),
        (6, 0, &["expert_parallel_degree", "got 0"][..]),
        (0, 1, &["num_experts", "at least 1"][..]),
        (4, 2, &["expert_index", "expert id 5", "[0, 4)"][..]),
    ] {
        let message = run(e, r).unwrap_err().to_string();
        for needle in needles {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`");
        }
    }
}

#[test]
fn sharded_experts_keep_nothing_without_a_record_even_on_a_rank_that_receives_no_rows() {
    // E = 2 over R = 2, every token on expert 0: rank 1 receives no row.
    let results = on_owned_ranks(LocalComm::group(2).unwrap(), |rank, comm| {
        let experts = ShardedExperts {
            backend: Arc::from(BackendKind::Cpu.create()),
            comm: Rc::new(comm),
            num_experts: 2,
            block_size: 2,
        };
        let (t, h, i) = (3, 4, 2);
        let mut rng = SeededRng::new(rank as u64);
        let x = f32_tensor(&[t, h], &rng.values(t * h, 1.0));
        let index = i32_tensor(&[t, 1], &[0, 0, 0]);
        let affinities = f32_tensor(&[t, 1], &[1.0, 0.5, 0.25]);
        let gate_up = f32_tensor(&[1, h, 2, i], &rng.values(h * 2 * i, 0.5));
        let down = f32_tensor(&[1, i, h], &rng.values(i * h, 0.5));
        let inputs = ExpertsInputs {
            hidden_states: &x,
            expert_index: &index,
            topk_affinities: &affinities,
            gate_up_proj_weight: &gate_up,
            down_proj_weight: &down,
            up_proj_weight: None,
        };
        let (recorded, saved) = experts.forward(inputs, true).unwrap();
        let (unrecorded, nothing) = experts.forward(inputs, false).unwrap();
        (saved.is_some(), nothing.is_none(), recorded == unrecorded)
    });
    for (rank, result) in results.into_iter().enumerate() {
        assert_eq!(result, (true, true, true), "rank {rank}");
    }
}
