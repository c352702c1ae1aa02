//! `load_balancing_loss` against a literal transcription of Hugging Face's
//! `load_balancing_loss_func`, its backward against central finite differences, and errors.

#![allow(clippy::needless_range_loop)] // test oracles index by expert, token and slot

mod common;

use common::*;
use moekit::contracts::{
    LoadBalancingDims, LoadBalancingLoss, LoadBalancingLossBwd, LoadBalancingLossBwdInputs,
    LoadBalancingLossInputs, LoadBalancingLossOutputs, RouterPipeline, RouterTopk,
    RouterTopkInputs, RouterTopkParams,
};
use moekit::reference::ReferenceBackend;
use moekit::reference::load_balancing::{load_balancing_backward, load_balancing_forward};
use moekit::{Backend, Tensor};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    l: usize,
    t: usize,
    e: usize,
    k: usize,
    logits: Vec<f64>,
    index: Vec<i32>,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..4, 1usize..7, 1usize..9, routing(), any::<u64>())
        .prop_flat_map(|(l, t, e, r, seed)| (Just((l, t, e, r, seed)), 1..=e))
        .prop_map(|((l, t, e, routing, seed), k)| {
            let mut rng = SeededRng::new(seed);
            Case {
                l,
                t,
                e,
                k,
                logits: rng.values(l * t * e, 3.0),
                index: expert_index(&mut rng, routing, l * t, e, k),
            }
        })
}

/// Hugging Face's formulation, step by step: concatenate the layers' logits, softmax,
/// `one_hot(selected) [N, K, E]` averaged over N → `[K, E]`, mean probability `[E]`,
/// `sum(tokens_per_expert * router_prob) * E`.
fn hugging_face(c: &Case) -> f64 {
    let n = c.l * c.t;
    let mut tokens_per_expert = vec![vec![0.0; c.e]; c.k];
    let mut router_prob = vec![0.0; c.e];
    for row in 0..n {
        let logits = &c.logits[row * c.e..(row + 1) * c.e];
        let z: f64 = logits.iter().map(|l| l.exp()).sum();
        for (ex, l) in logits.iter().enumerate() {
            router_prob[ex] += l.exp() / z / n as f64;
        }
        for slot in 0..c.k {
            tokens_per_expert[slot][c.index[row * c.k + slot] as usize] += 1.0 / n as f64;
        }
    }
    let overall: f64 = tokens_per_expert
        .iter()
        .flat_map(|row| row.iter().zip(&router_prob).map(|(f, p)| f * p))
        .sum();
    overall * c.e as f64
}

fn run(logits: &Tensor, index: &Tensor) -> moekit::Result<LoadBalancingLossOutputs> {
    ReferenceBackend.load_balancing_loss(&LoadBalancingLoss::new(LoadBalancingLossInputs {
        router_logits: logits,
        expert_index: index,
    })?)
}

/// Hugging Face's own routing: top-K of the softmax by a full sort (descending, lower id
/// first), as `torch.topk` returns it for distinct values.
fn hugging_face_top_k(logits: &[f64], e: usize, k: usize) -> Vec<i32> {
    logits
        .chunks(e)
        .flat_map(|row| {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.into_iter().take(k).map(|id| id as i32)
        })
        .collect()
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn router_then_aux_loss_matches_hugging_face_end_to_end(c in case()) {
        // HF recomputes the top-k from the logits; here the index comes from moekit's router
        // run on the same logits (x = I, w = logits, so router_logits = logits exactly).
        let n = c.l * c.t;
        let hf = Case { index: hugging_face_top_k(&c.logits, c.e, c.k), ..c.clone() };
        let mut margins = c.logits.chunks(c.e).map(|row| {
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted.windows(2).take(c.k).map(|w| w[0] - w[1]).fold(f64::INFINITY, f64::min)
        });
        prop_assume!(margins.all(|m| m > 1e-6));
        let identity: Vec<f64> = (0..n * n).map(|i| if i % (n + 1) == 0 { 1.0 } else { 0.0 }).collect();
        let (x, w) = (f32_tensor(&[n, n], &identity), f32_tensor(&[n, c.e], &c.logits));
        let routed = ReferenceBackend.router_topk(&RouterTopk::new(
            RouterTopkInputs { x: &x, w: &w, w_bias: None, selection_bias: None },
            RouterTopkParams { k: c.k, pipeline: RouterPipeline::QWEN3_MOE },
        ).unwrap()).unwrap();
        prop_assert_eq!(routed.expert_index.as_i32().unwrap(), &hf.index[..]);
        let logits = f32_tensor(&[c.l, c.t, c.e], &c.logits);
        let index = Tensor::from_i32([c.l, c.t, c.k], routed.expert_index.as_i32().unwrap().to_vec()).unwrap();
        let out = run(&logits, &index).unwrap();
        assert_close("aux_loss", &f32s(&out.aux_loss), &[hugging_face(&hf)], 1e-6, 1e-7)?;
    }

    #[test]
    fn forward_matches_hugging_face(c in case()) {
        let logits = f32_tensor(&[c.l, c.t, c.e], &c.logits);
        let index = i32_tensor(&[c.l, c.t, c.k], &c.index);
        let out = run(&logits, &index).unwrap();
        assert_close("aux_loss", &f32s(&out.aux_loss), &[hugging_face(&c)], 1e-6, 1e-7)?;
        prop_assert_eq!(out.expert_counts.shape(), &[c.l, c.e]);
        let counts = out.expert_counts.as_i32().unwrap();
        for layer in 0..c.l {
            for ex in 0..c.e {
                let direct = c.index[layer * c.t * c.k..(layer + 1) * c.t * c.k]
                    .iter().filter(|&&id| id as usize == ex).count();
                prop_assert_eq!(counts[layer * c.e + ex] as usize, direct);
            }
        }
        if c.l == 1 {
            // One layer may also be given as [T, E] / [T, K].
            let flat = run(&f32_tensor(&[c.t, c.e], &c.logits), &i32_tensor(&[c.t, c.k], &c.index)).unwrap();
            prop_assert_eq!(flat, out);
        }
    }

    #[test]
    fn backward_matches_finite_differences(c in case(), d_loss in -2.0f64..2.0) {
        let ids: Vec<usize> = c.index.iter().map(|&i| i as usize).collect();
        let dims = LoadBalancingDims { l: c.l, t: c.t, e: c.e, k: c.k };
        let grads = load_balancing_backward(&c.logits, &ids, d_loss, dims);
        let fd = finite_differences(&c.logits, FD_STEP, |logits| {
            d_loss * load_balancing_forward(logits, &ids, dims).0
        });
        assert_close("d_router_logits", &grads, &fd, FD_TOL, FD_TOL)?;

        let logits = f32_tensor(&[c.l, c.t, c.e], &c.logits);
        let index = i32_tensor(&[c.l, c.t, c.k], &c.index);
        let d = f32_tensor(&[1], &[d_loss]);
        let out = ReferenceBackend.load_balancing_loss_bwd(&LoadBalancingLossBwd::new(
            LoadBalancingLossBwdInputs { router_logits: &logits, expert_index: &index, d_aux_loss: &d },
        ).unwrap()).unwrap();
        prop_assert_eq!(out.d_router_logits.shape(), logits.shape());
        let expected = load_balancing_backward(&c.logits, &ids, f64::from(d_loss as f32), dims);
        assert_close("d_router_logits (f32)", &f32s(&out.d_router_logits), &expected, 1e-6, 1e-9)?;
    }
}

#[test]
fn perfectly_balanced_routing_gives_k() {
    // T = E tokens, token t picks experts t, t+1, …, t+K−1 (mod E): every expert gets K tokens,
    // and equal logits make every probability 1/E, so E · Σ_e (K/E)(1/E) = K.
    for (e, k) in [(4, 1), (4, 2), (8, 3), (6, 6)] {
        let index: Vec<i32> = (0..e)
            .flat_map(|t| (0..k).map(move |j| ((t + j) % e) as i32))
            .collect();
        let out = run(
            &f32_tensor(&[1, e, e], &vec![0.5; e * e]),
            &i32_tensor(&[1, e, k], &index),
        )
        .unwrap();
        let loss = f32s(&out.aux_loss)[0];
        assert!((loss - k as f64).abs() < 1e-6, "E={e} K={k}: {loss}");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let logits = f32_tensor(&[2, 3, 4], &[0.0; 24]);
    let check = |logits: &Tensor, index: &Tensor, needles: &[&str]| {
        let message = run(logits, index).unwrap_err().to_string();
        for needle in needles {
            assert!(message.contains(needle), "`{message}` lacks `{needle}`");
        }
    };
    check(
        &logits,
        &i32_tensor(&[2, 2, 2], &[0; 8]),
        &["expert_index", "[L, T, K]"],
    );
    check(
        &logits,
        &i32_tensor(&[2, 3, 5], &[0; 30]),
        &["expert_index", "K ≤ E"],
    );
    check(
        &logits,
        &i32_tensor(&[2, 3, 1], &[0, 1, 2, 3, 4, 0]),
        &["expert id 4", "[1, 1, 0]"],
    );
    check(
        &logits,
        &i32_tensor(&[2, 3, 2], &[0, 1, 2, 2, 0, 1, 0, 1, 0, 1, 0, 1]),
        &["twice", "[0, 1]"],
    );
    check(
        &f32_tensor(&[2, 0, 4], &[]),
        &i32_tensor(&[2, 0, 1], &[]),
        &["T (tokens)"],
    );
    let nan = f32_tensor(&[1, 1, 2], &[0.0, f64::INFINITY]);
    check(
        &nan,
        &i32_tensor(&[1, 1, 1], &[0]),
        &["router_logits", "non-finite", "[0, 0, 1]"],
    );
    check(
        &f32_tensor(&[4], &[0.0; 4]),
        &i32_tensor(&[4], &[0; 4]),
        &["router_logits", "[L, T, E]"],
    );
    let d_bad = f32_tensor(&[2], &[1.0, 1.0]);
    let index = i32_tensor(&[2, 3, 1], &[0; 6]);
    let err = LoadBalancingLossBwd::new(LoadBalancingLossBwdInputs {
        router_logits: &logits,
        expert_index: &index,
        d_aux_loss: &d_bad,
    })
    .unwrap_err();
    assert!(err.to_string().contains("d_aux_loss"), "{err}");
}
