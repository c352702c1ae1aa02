//! `router_topk` forward against a direct softmax/sigmoid + sort formulation in every
//! nki-library mode (ACT1 with dense or renormalised affinities, ACT2, SOFTMAX and SIGMOID,
//! `x [T, H]` and `[H, T]`, `w_bias`), its backward against central finite differences,
//! tie-breaking, edge cases and error paths (logits too large to allocate included).

#![allow(clippy::needless_range_loop)] // test oracles index by expert, token and slot

mod common;

use common::*;
use moekit::contracts::{
    ComputeDType, OutputDType, RouterActFnType, RouterPipeline, RouterTopk, RouterTopkBwd,
    RouterTopkBwdInputs, RouterTopkBwdParams, RouterTopkInputs, RouterTopkParams, XHbmLayout,
};
use moekit::reference::router::{router_backward, router_forward};
use moekit::{Backend, BackendKind, DType, Error, Tensor, reference::ReferenceBackend};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    t: usize,
    h: usize,
    e: usize,
    params: RouterTopkParams,
    /// `[T, H]`, whatever the layout the tensors are given in.
    x: Vec<f64>,
    w: Vec<f64>,
    bias: Option<Vec<f64>>,
    selection_bias: Option<Vec<f64>>,
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..7, 1usize..7, 1usize..9)
        .prop_flat_map(|(t, h, e)| {
            (
                Just((t, h, e)),
                1..=e,
                prop_oneof![
                    Just(RouterActFnType::Softmax),
                    Just(RouterActFnType::Sigmoid)
                ],
                any::<(bool, bool, bool)>(),
                any::<bool>(),
                any::<bool>(),
                any::<u64>(),
            )
        })
        .prop_map(
            |((t, h, e), k, act_fn, (router_pre_norm, norm_topk_prob, h_t), bias, sel, seed)| {
                let mut rng = SeededRng::new(seed);
                Case {
                    t,
                    h,
                    e,
                    params: RouterTopkParams {
                        k,
                        pipeline: RouterPipeline {
                            act_fn,
                            router_pre_norm,
                            norm_topk_prob,
                            x_hbm_layout: if h_t { XHbmLayout::HT } else { XHbmLayout::TH },
                        },
                    },
                    x: rng.values(t * h, 2.0),
                    w: rng.values(h * e, 1.0),
                    bias: bias.then(|| rng.values(e, 1.0)),
                    selection_bias: sel.then(|| rng.values(e, 0.3)),
                }
            },
        )
}

struct Oracle {
    logits: Vec<f64>,
    /// `[T, E]` selection scores.
    scores: Vec<f64>,
    expert_index: Vec<usize>,
    topk: Vec<f64>,
    /// `[T, E]`.
    expert_affinities: Vec<f64>,
}

fn activate(act_fn: RouterActFnType, logits: &[f64]) -> Vec<f64> {
    match act_fn {
        RouterActFnType::Softmax => {
            let max = logits.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            logits.iter().map(|l| (l - max).exp() / z).collect()
        }
        RouterActFnType::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
    }
}

/// Direct formulation of nki-library's two pipelines: logits by explicit dot products,
/// activations by the textbook formulas, selection by a full stable sort on (score descending,
/// expert id ascending). ACT1 activates all E and selects by affinity; ACT2 selects by logit
/// and activates the K selected logits.
fn oracle(c: &Case) -> Oracle {
    let (t, h, e, k) = (c.t, c.h, c.e, c.params.k);
    let p = c.params.pipeline;
    let mut o = Oracle {
        logits: vec![],
        scores: vec![],
        expert_index: vec![],
        topk: vec![],
        expert_affinities: vec![],
    };
    for token in 0..t {
        let logits: Vec<f64> = (0..e)
            .map(|ex| {
                let mut acc = c.bias.as_ref().map_or(0.0, |b| b[ex]);
                for j in (0..h).rev() {
                    acc += c.x[token * h + j] * c.w[j * e + ex];
                }
                acc
            })
            .collect();
        let probs = activate(p.act_fn, &logits);
        let by = if p.router_pre_norm { &probs } else { &logits };
        let scores: Vec<f64> = (0..e)
            .map(|ex| by[ex] + c.selection_bias.as_ref().map_or(0.0, |b| b[ex]))
            .collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let topk: Vec<f64> = if p.router_pre_norm {
            let sum: f64 = chosen.iter().map(|&ex| probs[ex]).sum();
            let norm = if p.norm_topk_prob { sum } else { 1.0 };
            chosen.iter().map(|&ex| probs[ex] / norm).collect()
        } else {
            let selected: Vec<f64> = chosen.iter().map(|&ex| logits[ex]).collect();
            activate(p.act_fn, &selected)
        };
        let mut affinities = vec![0.0; e];
        if p.router_pre_norm && !p.norm_topk_prob {
            affinities.copy_from_slice(&probs);
        } else {
            for (&ex, &a) in chosen.iter().zip(&topk) {
                affinities[ex] = a;
            }
        }
        o.topk.extend(topk);
        o.expert_affinities.extend(affinities);
        o.expert_index.extend_from_slice(chosen);
        o.logits.extend(logits);
        o.scores.extend(scores);
    }
    o
}

/// Smallest gap between consecutive scores among the top K+1 of any row (∞ if E = K = 1).
fn selection_margin(scores: &[f64], e: usize, k: usize) -> f64 {
    scores
        .chunks(e)
        .map(|row| {
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted[..(k + 1).min(e)]
                .windows(2)
                .map(|w| w[0] - w[1])
                .fold(f64::INFINITY, f64::min)
        })
        .fold(f64::INFINITY, f64::min)
}

/// `values [T, H]` laid out as `layout` says.
fn in_layout(values: &[f64], (t, h): (usize, usize), layout: XHbmLayout) -> Tensor {
    let tokens_major = f32_tensor(&[t, h], values);
    layout.from_tokens_major(tokens_major).unwrap()
}

fn tensors(c: &Case) -> (Tensor, Tensor, Option<Tensor>, Option<Tensor>) {
    (
        in_layout(&c.x, (c.t, c.h), c.params.pipeline.x_hbm_layout),
        f32_tensor(&[c.h, c.e], &c.w),
        c.bias.as_ref().map(|b| f32_tensor(&[c.e], b)),
        c.selection_bias.as_ref().map(|b| f32_tensor(&[c.e], b)),
    )
}

fn run(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    selection_bias: Option<&Tensor>,
    params: RouterTopkParams,
) -> moekit::Result<moekit::contracts::RouterTopkOutputs> {
    let call = RouterTopk::new(
        RouterTopkInputs {
            x,
            w,
            w_bias: bias,
            selection_bias,
        },
        params,
    )?;
    // Every output f32, to compare with the f64 oracles (`proptests/cpu.rs` checks the
    // nki-library dtypes).
    ReferenceBackend.router_topk(&call.with_output_dtype(OutputDType::Float32))
}

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn forward_matches_direct_formulation(c in case()) {
        let o = oracle(&c);
        prop_assume!(selection_margin(&o.scores, c.e, c.params.k) > 1e-9);
        let (x, w, bias, sel) = tensors(&c);
        let out = run(&x, &w, bias.as_ref(), sel.as_ref(), c.params).unwrap();
        let k = c.params.k;
        prop_assert_eq!(out.expert_index.shape(), &[c.t, k]);
        let ids: Vec<usize> = out.expert_index.as_i32().unwrap().iter().map(|&i| i as usize).collect();
        prop_assert_eq!(&ids, &o.expert_index);
        assert_close("router_logits", &f32s(&out.router_logits), &o.logits, 1e-6, 1e-6)?;
        assert_close("topk_affinities", &f32s(&out.topk_affinities), &o.topk, 1e-6, 1e-7)?;
        assert_close("expert_affinities", &f32s(&out.expert_affinities), &o.expert_affinities, 1e-6, 1e-7)?;
        if c.params.pipeline.renormalises() {
            for row in f32s(&out.topk_affinities).chunks(k) {
                prop_assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn bf16_inputs_equal_f32_inputs_of_the_same_values(c in case()) {
        let (x, w, bias, sel) = tensors(&c);
        let (xb, wb) = (x.to_bf16(), w.to_bf16());
        let (bias_b, sel_b) = (bias.as_ref().map(Tensor::to_bf16), sel.as_ref().map(Tensor::to_bf16));
        // The same bf16-representable values, stored as f32.
        let widen = |t: &Tensor| f32_tensor(t.shape(), &t.to_f64_vec());
        let from_bf16 = run(&xb, &wb, bias_b.as_ref(), sel_b.as_ref(), c.params).unwrap();
        let from_f32 = run(&widen(&xb), &widen(&wb), bias_b.as_ref().map(widen).as_ref(),
            sel_b.as_ref().map(widen).as_ref(), c.params).unwrap();
        prop_assert_eq!(from_bf16, from_f32);
    }

    #[test]
    fn ties_go_to_the_lower_expert_id(seed in any::<u64>(), t in 1usize..6, h in 1usize..5, e in 2usize..7) {
        let mut rng = SeededRng::new(seed);
        let x = rng.values(t * h, 1.0);
        let mut w = rng.values(h * e, 1.0);
        // Column `hi` duplicates column `lo`, so their logits are bitwise equal.
        let lo = rng.below(e - 1);
        let hi = lo + 1 + rng.below(e - 1 - lo);
        for j in 0..h {
            w[j * e + hi] = w[j * e + lo];
        }
        for (act_fn, router_pre_norm) in [
            (RouterActFnType::Softmax, true),
            (RouterActFnType::Sigmoid, true),
            (RouterActFnType::Softmax, false),
        ] {
            for k in 1..=e {
                let pipeline = RouterPipeline { act_fn, router_pre_norm, ..RouterPipeline::default() };
                let params = RouterTopkParams { k, pipeline };
                let out = run(&f32_tensor(&[t, h], &x), &f32_tensor(&[h, e], &w), None, None, params).unwrap();
                for row in out.expert_index.as_i32().unwrap().chunks(k) {
                    let pos = |id: usize| row.iter().position(|&r| r as usize == id);
                    match (pos(lo), pos(hi)) {
                        (Some(a), Some(b)) => prop_assert!(a < b, "row {:?}: {} after {}", row, lo, hi),
                        (None, Some(_)) => prop_assert!(false, "row {:?} took {} without {}", row, hi, lo),
                        _ => {}
                    }
                }
            }
        }
    }

    #[test]
    fn backward_matches_finite_differences(c in case(), seed in any::<u64>(), with_d_logits in any::<bool>()) {
        let o = oracle(&c);
        prop_assume!(selection_margin(&o.scores, c.e, c.params.k) > 1e-3);
        let (t, h, e, k) = (c.t, c.h, c.e, c.params.k);
        let pipeline = c.params.pipeline;
        let mut rng = SeededRng::new(seed);
        let d_topk = rng.values(t * k, 1.0);
        let d_logits = with_d_logits.then(|| rng.values(t * e, 1.0));
        let bias = c.bias.clone().unwrap_or_else(|| vec![0.0; e]);
        let sel = c.selection_bias.as_deref();
        // L(x, w, bias) = Σ d_topk ⊙ topk_affinities + Σ d_logits ⊙ router_logits.
        let loss = |x: &[f64], w: &[f64], b: &[f64]| {
            let f = router_forward(x, w, Some(b), sel, (t, h, e, k), pipeline).unwrap();
            dot(&d_topk, &f.topk_affinities) + d_logits.as_ref().map_or(0.0, |d| dot(d, &f.logits))
        };
        let bwd_params = RouterTopkBwdParams { pipeline, compute_dtype: None };
        let fwd = router_forward(&c.x, &c.w, Some(&bias), sel, (t, h, e, k), pipeline).unwrap();
        let grads = router_backward(&c.x, &c.w, &fwd.logits, &fwd.expert_index, &d_topk,
            d_logits.as_deref(), (t, h, e, k), (pipeline, DType::F32));
        let fd_x = finite_differences(&c.x, FD_STEP, |x| loss(x, &c.w, &bias));
        let fd_w = finite_differences(&c.w, FD_STEP, |w| loss(&c.x, w, &bias));
        let fd_b = finite_differences(&bias, FD_STEP, |b| loss(&c.x, &c.w, b));
        assert_close("d_x", &grads.d_x, &fd_x, FD_TOL, FD_TOL)?;
        assert_close("d_w", &grads.d_w, &fd_w, FD_TOL, FD_TOL)?;
        assert_close("d_w_bias", &grads.d_w_bias, &fd_b, FD_TOL, FD_TOL)?;

        // The f32 kernel returns the same gradients, rounded once, d_x in x's layout.
        let x = in_layout(&c.x, (t, h), pipeline.x_hbm_layout);
        let w = f32_tensor(&[h, e], &c.w);
        let out = run(&x, &w, Some(&f32_tensor(&[1, e], &bias)),
            c.selection_bias.as_ref().map(|b| f32_tensor(&[e], b)).as_ref(), c.params).unwrap();
        let d_topk_t = f32_tensor(&[t, k], &d_topk);
        let d_logits_t = d_logits.as_ref().map(|d| f32_tensor(&[t, e], d));
        let call = RouterTopkBwd::new(RouterTopkBwdInputs {
            x: &x, w: &w, router_logits: &out.router_logits, expert_index: &out.expert_index,
            d_topk_affinities: &d_topk_t, d_router_logits: d_logits_t.as_ref(),
        }, bwd_params).unwrap();
        let g = ReferenceBackend.router_topk_bwd(&call).unwrap();
        // router_logits passed through f32: allow for that rounding.
        prop_assert_eq!(g.d_x.shape(), x.shape());
        let d_x = f32s(&in_layout(&grads.d_x, (t, h), pipeline.x_hbm_layout));
        assert_close("d_x (f32)", &f32s(&g.d_x), &d_x, 1e-5, 1e-5)?;
        assert_close("d_w (f32)", &f32s(&g.d_w), &grads.d_w, 1e-5, 1e-5)?;
        assert_close("d_w_bias (f32)", &f32s(&g.d_w_bias), &grads.d_w_bias, 1e-5, 1e-5)?;
    }

    #[test]
    fn bf16_compute_rounds_the_products_operands(c in case(), seed in any::<u64>()) {
        // With d_topk_affinities zero, d_logits is d_router_logits itself, so the operands the
        // products read under compute_dtype = bfloat16 are known beforehand: x, w and
        // d_router_logits rounded to bf16. Rounded ahead and given in f32, they must give
        // the same gradients computed in f32.
        let (t, e, k) = (c.t, c.e, c.params.k);
        let (x, w, bias, sel) = tensors(&c);
        let out = run(&x, &w, bias.as_ref(), sel.as_ref(), c.params).unwrap();
        let zeros = f32_tensor(&[t, k], &vec![0.0; t * k]);
        let d_logits = f32_tensor(&[t, e], &SeededRng::new(seed).values(t * e, 1.0));
        let rounded = |v: &Tensor| f32_tensor(v.shape(), &v.to_bf16().to_f64_vec());
        let grads = |backend: BackendKind, (x, w, d): (&Tensor, &Tensor, &Tensor), dtype| {
            let call = RouterTopkBwd::new(RouterTopkBwdInputs {
                x, w, router_logits: &out.router_logits, expert_index: &out.expert_index,
                d_topk_affinities: &zeros, d_router_logits: Some(d),
            }, RouterTopkBwdParams { pipeline: c.params.pipeline, compute_dtype: Some(dtype) })
            .unwrap()
            .with_output_dtype(OutputDType::Float32);
            backend.create().router_topk_bwd(&call).unwrap().into_named()
        };
        let given = (&x, &w, &d_logits);
        let (x16, w16, d16) = (rounded(&x), rounded(&w), rounded(&d_logits));
        let want = grads(BackendKind::Reference, (&x16, &w16, &d16), ComputeDType::FLOAT32);
        // The f64 oracle rounds the same values: the same gradients, to the bit.
        let oracle = grads(BackendKind::Reference, given, ComputeDType::BFLOAT16);
        prop_assert_eq!(&oracle, &want);
        // The cpu backend (pair dot products where the CPU has them) to its f32 tolerance.
        let cpu = grads(BackendKind::Cpu, given, ComputeDType::BFLOAT16);
        for ((name, got), (_, want)) in cpu.iter().zip(&want) {
            let want = want.to_f64_vec();
            let atol = 1e-5 * want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            assert_close(name.name, &got.to_f64_vec(), &want, 1e-4, atol)?;
        }
        // And in f32 the unrounded operands give other gradients.
        let exact = grads(BackendKind::Reference, given, ComputeDType::FLOAT32);
        prop_assert_ne!(&exact, &want);
    }
}

#[test]
fn one_expert_gets_everything() {
    for act_fn in [RouterActFnType::Softmax, RouterActFnType::Sigmoid] {
        let x = f32_tensor(&[3, 2], &[0.5, -1.0, 2.0, 0.25, -0.75, 1.5]);
        let w = f32_tensor(&[2, 1], &[0.3, -0.2]);
        let params = RouterTopkParams {
            k: 1,
            pipeline: RouterPipeline {
                act_fn,
                norm_topk_prob: true,
                ..RouterPipeline::default()
            },
        };
        let out = run(&x, &w, None, None, params).unwrap();
        assert_eq!(out.expert_index.as_i32().unwrap(), &[0, 0, 0]);
        assert_eq!(out.topk_affinities.as_f32().unwrap(), &[1.0, 1.0, 1.0]);
    }
}

#[test]
fn extreme_sigmoid_logits_renormalise_without_nan() {
    // σ(−200) and σ(−300) underflow in f32 (and their sum in a naive f32 kernel); the
    // renormalised pair is still exactly 1 : e^−100.
    let x = f32_tensor(&[1, 1], &[1.0]);
    let w = f32_tensor(&[1, 3], &[-200.0, -300.0, -1000.0]);
    let params = RouterTopkParams {
        k: 2,
        pipeline: RouterPipeline {
            act_fn: RouterActFnType::Sigmoid,
            norm_topk_prob: true,
            ..RouterPipeline::default()
        },
    };
    let out = run(&x, &w, None, None, params).unwrap();
    assert_eq!(out.expert_index.as_i32().unwrap(), &[0, 1]);
    assert_eq!(
        out.topk_affinities.as_f32().unwrap(),
        &[1.0, (-100f64).exp() as f32]
    );
}

fn expect_err(result: moekit::Result<impl std::fmt::Debug>, needles: &[&str]) {
    let message = result.expect_err("expected an error").to_string();
    for needle in needles {
        assert!(message.contains(needle), "`{message}` lacks `{needle}`");
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    let x = f32_tensor(&[2, 3], &[0.1; 6]);
    let w = f32_tensor(&[3, 4], &[0.2; 12]);
    let p = |k| RouterTopkParams {
        k,
        pipeline: RouterPipeline::QWEN3_MOE,
    };
    expect_err(run(&x, &w, None, None, p(0)), &["`k`", "1..=4", "got 0"]);
    expect_err(run(&x, &w, None, None, p(5)), &["`k`", "got 5"]);
    // x [H, T] with x_hbm_layout = 0: the [2, 3] x reads as T = 3 tokens of H = 2.
    let h_t = RouterTopkParams {
        k: 2,
        pipeline: RouterPipeline {
            x_hbm_layout: XHbmLayout::HT,
            ..RouterPipeline::QWEN3_MOE
        },
    };
    expect_err(run(&x, &w, None, None, h_t), &["`w`", "[H, E] = [2, _]"]);
    let x_h_t = f32_tensor(&[3, 2], &[0.1; 6]);
    assert_eq!(
        run(&x_h_t, &w, None, None, h_t)
            .unwrap()
            .router_logits
            .shape(),
        &[2, 4]
    );
    expect_err(run(&x, &w, None, None, h_t), &["`w`", "[H, E]"]);
    // w_bias is [E] or [1, E].
    let bias_row = f32_tensor(&[1, 4], &[0.5, 0.0, 0.0, 0.0]);
    let bias_flat = f32_tensor(&[4], &[0.5, 0.0, 0.0, 0.0]);
    assert_eq!(
        run(&x, &w, Some(&bias_row), None, p(2)).unwrap(),
        run(&x, &w, Some(&bias_flat), None, p(2)).unwrap()
    );
    expect_err(
        run(&x, &w, Some(&f32_tensor(&[2, 4], &[0.0; 8])), None, p(2)),
        &["`w_bias`", "[E] or [1, E]"],
    );
    let w_bad = f32_tensor(&[2, 4], &[0.2; 8]);
    expect_err(
        run(&x, &w_bad, None, None, p(2)),
        &["`w`", "[H, E]", "[2, 4]"],
    );
    let bias = f32_tensor(&[3], &[0.0; 3]);
    expect_err(run(&x, &w, Some(&bias), None, p(2)), &["`w_bias`", "[E]"]);
    expect_err(run(&x, &w, None, Some(&bias), p(2)), &["`selection_bias`"]);
    let x_int = i32_tensor(&[2, 3], &[0; 6]);
    let err = run(&x_int, &w, None, None, p(2)).unwrap_err();
    assert!(matches!(err, Error::DType { .. }), "{err}");
    let x_nan = f32_tensor(&[2, 3], &[0.1, 0.2, f64::NAN, 0.0, 0.0, 0.0]);
    expect_err(
        run(&x_nan, &w, None, None, p(2)),
        &["`x`", "non-finite", "[0, 2]"],
    );
    let x_inf = Tensor::from_bf16([1, 3], vec![half::bf16::INFINITY; 3]).unwrap();
    expect_err(run(&x_inf, &w, None, None, p(2)), &["`x`", "non-finite"]);
    let empty = f32_tensor(&[0, 3], &[]);
    expect_err(run(&empty, &w, None, None, p(2)), &["`x`", "T (tokens)"]);
    let huge = f32_tensor(&[1, 3], &[3e38; 3]);
    let w_big = f32_tensor(&[3, 4], &[3e38; 12]);
    expect_err(
        run(&huge, &w_big, None, None, p(2)),
        &["router_logits", "does not fit in f32"],
    );
}

#[test]
fn backward_rejects_inconsistent_inputs() {
    let x = f32_tensor(&[2, 3], &[0.1; 6]);
    let w = f32_tensor(&[3, 4], &[0.2; 12]);
    let logits = f32_tensor(&[2, 4], &[0.0; 8]);
    let d = f32_tensor(&[2, 2], &[1.0; 4]);
    let params = RouterTopkBwdParams::default();
    let bwd = |index: &Tensor, d: &Tensor| {
        RouterTopkBwd::new(
            RouterTopkBwdInputs {
                x: &x,
                w: &w,
                router_logits: &logits,
                expert_index: index,
                d_topk_affinities: d,
                d_router_logits: None,
            },
            params,
        )
        .map(|_| ())
    };
    expect_err(
        bwd(&i32_tensor(&[2, 2], &[0, 4, 1, 2]), &d),
        &["expert_index", "4", "[0, 4)"],
    );
    expect_err(
        bwd(&i32_tensor(&[2, 2], &[1, 1, 1, 2]), &d),
        &["expert_index", "twice"],
    );
    expect_err(
        bwd(
            &i32_tensor(&[2, 2], &[0, 1, 1, 2]),
            &f32_tensor(&[2, 3], &[0.0; 6]),
        ),
        &["d_topk_affinities", "[T, K]"],
    );
    expect_err(
        bwd(&f32_tensor(&[2, 2], &[0.0; 4]), &d),
        &["expert_index", "i32"],
    );
}

#[test]
fn logits_too_large_to_allocate_are_errors_naming_them() {
    // x [2^22, 1] and w [1, 2^20] are 20 MB; their logits [T, E] would be 16 TiB.
    let (t, e) = (1usize << 22, 1usize << 20);
    let x = Tensor::from_f32([t, 1], vec![0.5; t]).unwrap();
    let w = Tensor::from_f32([1, e], vec![0.25; e]).unwrap();
    let call = RouterTopk::new(
        RouterTopkInputs {
            x: &x,
            w: &w,
            w_bias: None,
            selection_bias: None,
        },
        RouterTopkParams {
            k: 1,
            pipeline: RouterPipeline::QWEN3_MOE,
        },
    )
    .unwrap();
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let err = backend.create().router_topk(&call).unwrap_err().to_string();
        assert!(
            err.contains("output `router_logits`") && err.contains("[4194304, 1048576]"),
            "{backend}: {err}"
        );
    }
}
