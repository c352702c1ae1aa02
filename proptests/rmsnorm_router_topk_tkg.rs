//! `rmsnorm_router_topk_tkg` (nki-library's fused decode RMSNorm + router) and its backward
//! (moekit's own) against an oracle of their own: the RMSNorm and the ACT2 router written out
//! in f64 from the contract's formulas, the backward's gradients derived by hand and that
//! derivation checked by central finite differences. Both backends, every option
//! (`[B, S, H]` and `[T, H]`, f32 and bf16 inputs, `router_mm_dtype`, SOFTMAX and SIGMOID,
//! scattered and eager affinities, the bias, `hidden_actual`, `eps`, `d_norm_output`), the
//! dtypes nki-library writes, bit-identity across thread counts, edge cases and every input
//! error.

#![allow(clippy::needless_range_loop)] // the oracle indexes by token, column and expert

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

/// One call's sizes, options and values.
#[derive(Clone, Debug)]
struct Case {
    t: usize,
    h: usize,
    e: usize,
    k: usize,
    /// `hidden_states [B, S, H]` with this B (T = B·S), else `[T, H]`.
    batch: Option<usize>,
    x_bf16: bool,
    gamma_bf16: bool,
    /// `router_mm_dtype = bfloat16` (`router_weights` bf16), else float32.
    mm_bf16: bool,
    softmax: bool,
    eager: bool,
    bias: bool,
    /// The bias as `[E]` rather than `[1, E]`.
    flat_bias: bool,
    hidden_actual: Option<usize>,
    eps: f32,
    x: Vec<f64>,
    gamma: Vec<f64>,
    w: Vec<f64>,
    b: Vec<f64>,
    /// `[T, E]`, or `[T, K]` when eager.
    d_affinities: Vec<f64>,
    d_norm: Option<Vec<f64>>,
}

impl Case {
    fn build(
        (t, h, e): (usize, usize, usize),
        k: usize,
        flags: [bool; 10],
        hidden_actual: Option<usize>,
        seed: u64,
    ) -> Self {
        let [
            x_bf16,
            gamma_bf16,
            mm_bf16,
            softmax,
            eager,
            bias,
            flat_bias,
            batched,
            d_norm,
            tiny,
        ] = flags;
        let mut rng = SeededRng::new(seed);
        let width = if eager { k } else { e };
        let batch = (batched && t % 2 == 0).then_some(2);
        Self {
            t,
            h,
            e,
            k,
            batch,
            x_bf16,
            gamma_bf16,
            mm_bf16,
            softmax,
            eager,
            bias,
            flat_bias,
            hidden_actual: hidden_actual.map(|a| a.min(h)),
            eps: if tiny { 1e-6 } else { 0.25 },
            x: rng.values(t * h, 2.0),
            gamma: rng.values(h, 1.5),
            w: rng.values(h * e, 1.0),
            b: rng.values(e, 1.0),
            d_affinities: rng.values(t * width, 1.0),
            d_norm: d_norm.then(|| rng.values(t * h, 1.0)),
        }
    }

    fn hidden_shape(&self) -> Vec<usize> {
        match self.batch {
            Some(b) => vec![b, self.t / b, self.h],
            None => vec![self.t, self.h],
        }
    }

    /// The forward's tensors and parameters (`output_dtype = float32`).
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let float = |shape: &[usize], v: &[f64], bf16: bool| {
            let tensor = f32_tensor(shape, v);
            if bf16 { tensor.to_bf16() } else { tensor }
        };
        let mut tensors = BTreeMap::new();
        let mut put = |name: &str, tensor: Tensor| {
            tensors.insert(name.to_owned(), tensor);
        };
        put(
            "hidden_states",
            float(&self.hidden_shape(), &self.x, self.x_bf16),
        );
        put("gamma", float(&[1, self.h], &self.gamma, self.gamma_bf16));
        put(
            "router_weights",
            float(&[self.h, self.e], &self.w, self.mm_bf16),
        );
        if self.bias {
            let shape: &[usize] = if self.flat_bias {
                &[self.e]
            } else {
                &[1, self.e]
            };
            put("router_bias", float(shape, &self.b, self.mm_bf16));
        }
        let mut params = Params::default();
        let mut set = |name: &str, value: &str| params.set(name, value).unwrap();
        set("top_k", &self.k.to_string());
        set("eps", &self.eps.to_string());
        set(
            "router_mm_dtype",
            if self.mm_bf16 { "bfloat16" } else { "float32" },
        );
        set(
            "router_act_fn",
            if self.softmax { "SOFTMAX" } else { "SIGMOID" },
        );
        set("store_eager_affi_only", &self.eager.to_string());
        if let Some(actual) = self.hidden_actual {
            set("hidden_actual", &actual.to_string());
        }
        set("output_dtype", "float32");
        (tensors, params)
    }

    /// The backward's tensors: the forward's, `expert_index` and the gradients.
    fn bwd_tensors(&self, expert_index: &Tensor) -> (BTreeMap<String, Tensor>, Params) {
        let (mut tensors, params) = self.tensors();
        tensors.insert("expert_index".to_owned(), expert_index.clone());
        let width = if self.eager { self.k } else { self.e };
        tensors.insert(
            "d_expert_affinities".to_owned(),
            f32_tensor(&[self.t, width], &self.d_affinities),
        );
        if let Some(d) = &self.d_norm {
            tensors.insert("d_norm_output".to_owned(), f32_tensor(&[self.t, self.h], d));
        }
        (tensors, params)
    }

    fn divisor(&self) -> f64 {
        self.hidden_actual.unwrap_or(self.h) as f64
    }
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=9, 1usize..=40, 1usize..=12)
        .prop_flat_map(|(t, h, e)| {
            (
                Just((t, h, e)),
                1..=e.min(8),
                proptest::array::uniform10(any::<bool>()),
                proptest::option::of(1..=h),
                any::<u64>(),
            )
        })
        .prop_map(|(dims, k, flags, actual, seed)| Case::build(dims, k, flags, actual, seed))
}

/// The case's values as its tensors hold them (bf16 ones rounded).
struct Values {
    x: Vec<f64>,
    gamma: Vec<f64>,
    w: Vec<f64>,
    /// Zeros without a bias.
    b: Vec<f64>,
}

fn values(c: &Case) -> Values {
    let (tensors, _) = c.tensors();
    Values {
        x: tensors["hidden_states"].to_f64_vec(),
        gamma: tensors["gamma"].to_f64_vec(),
        w: tensors["router_weights"].to_f64_vec(),
        b: tensors
            .get("router_bias")
            .map_or_else(|| vec![0.0; c.e], Tensor::to_f64_vec),
    }
}

/// `1 / sqrt(Σ_h x² / divisor + eps)` per token.
fn inverse_rms(c: &Case, x: &[f64]) -> Vec<f64> {
    x.chunks(c.h)
        .map(|row| {
            let mean_square = row.iter().map(|v| v * v).sum::<f64>() / c.divisor();
            1.0 / (mean_square + f64::from(c.eps)).sqrt()
        })
        .collect()
}

/// `[T, H]`: `x / rms ⊙ gamma`.
fn norm(c: &Case, x: &[f64], gamma: &[f64]) -> Vec<f64> {
    let r = inverse_rms(c, x);
    (0..c.t * c.h)
        .map(|i| x[i] * r[i / c.h] * gamma[i % c.h])
        .collect()
}

/// `[T, E]`: `router_input · w + b`.
fn logits(c: &Case, router_input: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let mut z = vec![0.0; c.t * c.e];
    for t in 0..c.t {
        for e in 0..c.e {
            z[t * c.e + e] = b[e]
                + (0..c.h)
                    .map(|h| router_input[t * c.h + h] * w[h * c.e + e])
                    .sum::<f64>();
        }
    }
    z
}

/// The activation of one token's selected logits: a softmax over them, or each one's sigmoid.
fn activate(c: &Case, selected: &[f64]) -> Vec<f64> {
    if c.softmax {
        let max = selected.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let exp: Vec<f64> = selected.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = exp.iter().sum();
        exp.iter().map(|v| v / sum).collect()
    } else {
        selected.iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect()
    }
}

/// The value `norm_output` rounds to in `router_mm_dtype`: what the router reads.
fn router_input(c: &Case, norm_output: &Tensor) -> Vec<f64> {
    let f32_norm = f32_tensor(&[c.t, c.h], &norm_output.to_f64_vec());
    if c.mm_bf16 {
        f32_norm.to_bf16().to_f64_vec()
    } else {
        f32_norm.to_f64_vec()
    }
}

fn run(
    kernel: Kernel,
    backend: BackendKind,
    tensors: &BTreeMap<String, Tensor>,
    params: &Params,
) -> Result<BTreeMap<&'static str, Tensor>, Error> {
    Ok(kernel
        .run(backend.create().as_ref(), tensors, params)?
        .into_iter()
        .collect())
}

fn forward(backend: BackendKind, c: &Case) -> BTreeMap<&'static str, Tensor> {
    let (tensors, params) = c.tensors();
    run(Kernel::RmsNormRouterTopkTkg, backend, &tensors, &params).unwrap()
}

/// Checks one backend's forward against the oracle; returns its `expert_index`.
fn check_forward(backend: BackendKind, c: &Case, rtol: f64) -> Result<Tensor, TestCaseError> {
    let v = values(c);
    let out = forward(backend, c);
    let norm_output = &out["norm_output"];
    prop_assert_eq!(norm_output.shape(), &[c.t, c.h]);
    let want_norm = norm(c, &v.x, &v.gamma);
    assert_close(
        &format!("{backend} norm_output"),
        &f32s(norm_output),
        &want_norm,
        rtol,
        rtol * scale(&want_norm),
    )?;
    // The router part from what the backend's router read.
    let z = logits(c, &router_input(c, norm_output), &v.w, &v.b);
    let index = &out["expert_index"];
    prop_assert_eq!(index.shape(), &[c.t, c.k]);
    let ids = index.as_i32().unwrap();
    let affinities = f32s(&out["expert_affinities"]);
    let width = if c.eager { c.k } else { c.e };
    prop_assert_eq!(out["expert_affinities"].shape(), &[c.t, width]);
    for t in 0..c.t {
        let row = &z[t * c.e..(t + 1) * c.e];
        let tol = rtol * scale(row);
        let chosen: Vec<usize> = ids[t * c.k..(t + 1) * c.k]
            .iter()
            .map(|&id| id as usize)
            .collect();
        // K distinct experts, in descending logit, none below an expert left out.
        for (slot, &e) in chosen.iter().enumerate() {
            prop_assert!(
                e < c.e && !chosen[..slot].contains(&e),
                "token {t}: {chosen:?}"
            );
            if slot > 0 {
                prop_assert!(row[e] <= row[chosen[slot - 1]] + tol, "token {t}: order");
            }
        }
        let lowest = chosen.iter().map(|&e| row[e]).fold(f64::INFINITY, f64::min);
        for e in (0..c.e).filter(|e| !chosen.contains(e)) {
            prop_assert!(row[e] <= lowest + tol, "token {t}: expert {e} left out");
        }
        // Clear of near-ties, the choice is the oracle's exactly (ties to the lower id).
        let mut order: Vec<usize> = (0..c.e).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let margin = order
            .windows(2)
            .take(c.k)
            .map(|pair| row[pair[0]] - row[pair[1]])
            .fold(f64::INFINITY, f64::min);
        if margin > 10.0 * tol {
            prop_assert_eq!(&chosen[..], &order[..c.k], "token {}", t);
        }
        let selected: Vec<f64> = chosen.iter().map(|&e| row[e]).collect();
        let a = activate(c, &selected);
        let mut want = vec![0.0; width];
        for (slot, &e) in chosen.iter().enumerate() {
            want[if c.eager { slot } else { e }] = a[slot];
        }
        // An error in the logits moves the affinities by as much (at most).
        assert_close(
            &format!("{backend} expert_affinities, token {t}"),
            &affinities[t * width..(t + 1) * width],
            &want,
            rtol,
            tol,
        )?;
    }
    Ok(index.clone())
}

/// The gradients by hand, in f64, at the backend's `norm_output` (`forward_norm`) where the
/// router reads it (rounded to `router_mm_dtype`, passed straight through), and at the exact
/// norm for the RMSNorm's own derivative. Returns `d_hidden_states, d_gamma,
/// d_router_weights, d_router_bias`, flat.
fn oracle_gradients(c: &Case, ids: &[i32], router_input: &[f64]) -> [Vec<f64>; 4] {
    let v = values(c);
    let (t_, h_, e_, k_) = (c.t, c.h, c.e, c.k);
    let z = logits(c, router_input, &v.w, &v.b);
    let mut dz = vec![0.0; t_ * e_];
    for t in 0..t_ {
        let chosen: Vec<usize> = ids[t * k_..(t + 1) * k_]
            .iter()
            .map(|&i| i as usize)
            .collect();
        let selected: Vec<f64> = chosen.iter().map(|&e| z[t * e_ + e]).collect();
        let a = activate(c, &selected);
        let d_a: Vec<f64> = (0..k_)
            .map(|slot| {
                if c.eager {
                    c.d_affinities[t * k_ + slot]
                } else {
                    c.d_affinities[t * e_ + chosen[slot]]
                }
            })
            .collect();
        let weighted: f64 = a.iter().zip(&d_a).map(|(a, d)| a * d).sum();
        for slot in 0..k_ {
            dz[t * e_ + chosen[slot]] = if c.softmax {
                a[slot] * (d_a[slot] - weighted)
            } else {
                d_a[slot] * a[slot] * (1.0 - a[slot])
            };
        }
    }
    let mut d_b = vec![0.0; e_];
    let mut d_w = vec![0.0; h_ * e_];
    let mut d_n = vec![0.0; t_ * h_];
    for t in 0..t_ {
        for e in 0..e_ {
            d_b[e] += dz[t * e_ + e];
            for h in 0..h_ {
                d_w[h * e_ + e] += router_input[t * h_ + h] * dz[t * e_ + e];
                d_n[t * h_ + h] += dz[t * e_ + e] * v.w[h * e_ + e];
            }
        }
    }
    if let Some(d) = &c.d_norm {
        for (acc, d) in d_n.iter_mut().zip(d) {
            *acc += d;
        }
    }
    let r = inverse_rms(c, &v.x);
    let mut d_x = vec![0.0; t_ * h_];
    let mut d_gamma = vec![0.0; h_];
    for t in 0..t_ {
        let along: f64 = (0..h_)
            .map(|h| d_n[t * h_ + h] * v.gamma[h] * v.x[t * h_ + h])
            .sum();
        for h in 0..h_ {
            let x = v.x[t * h_ + h];
            d_x[t * h_ + h] =
                r[t] * v.gamma[h] * d_n[t * h_ + h] - x * r[t].powi(3) * along / c.divisor();
            d_gamma[h] += d_n[t * h_ + h] * x * r[t];
        }
    }
    [d_x, d_gamma, d_w, d_b]
}

/// The loss whose gradients the backward returns, in f64 without any rounding, with the
/// selection `ids` fixed: `Σ d_affinities ⊙ affinities + Σ d_norm ⊙ norm`, as a function of
/// `hidden_states, gamma, router_weights, router_bias` flattened in that order.
fn loss(c: &Case, ids: &[i32], params: &[f64]) -> f64 {
    let (t_, h_, e_, k_) = (c.t, c.h, c.e, c.k);
    let (x, rest) = params.split_at(t_ * h_);
    let (gamma, rest) = rest.split_at(h_);
    let (w, b) = rest.split_at(h_ * e_);
    let n = norm(c, x, gamma);
    let z = logits(c, &n, w, b);
    let mut total = 0.0;
    for t in 0..t_ {
        let chosen = &ids[t * k_..(t + 1) * k_];
        let selected: Vec<f64> = chosen.iter().map(|&e| z[t * e_ + e as usize]).collect();
        for (slot, a) in activate(c, &selected).into_iter().enumerate() {
            let d = if c.eager {
                c.d_affinities[t * k_ + slot]
            } else {
                c.d_affinities[t * e_ + chosen[slot] as usize]
            };
            total += d * a;
        }
    }
    if let Some(d) = &c.d_norm {
        total += dot(d, &n);
    }
    total
}

const GRADIENTS: [&str; 4] = [
    "d_hidden_states",
    "d_gamma",
    "d_router_weights",
    "d_router_bias",
];

fn backward(
    backend: BackendKind,
    c: &Case,
    expert_index: &Tensor,
) -> BTreeMap<&'static str, Tensor> {
    let (tensors, params) = c.bwd_tensors(expert_index);
    run(Kernel::RmsNormRouterTopkTkgBwd, backend, &tensors, &params).unwrap()
}

/// Both backends' gradients against [`oracle_gradients`], and their shapes.
fn check_backward(c: &Case) -> Result<(), TestCaseError> {
    let index = forward(BackendKind::Reference, c)["expert_index"].clone();
    let ids = index.as_i32().unwrap();
    for (backend, rtol) in [(BackendKind::Reference, 1e-5), (BackendKind::Cpu, 1e-4)] {
        let router_read = router_input(c, &forward(backend, c)["norm_output"]);
        let want = oracle_gradients(c, ids, &router_read);
        let grads = backward(backend, c, &index);
        let bias_shape = if c.bias && c.flat_bias {
            vec![c.e]
        } else {
            vec![1, c.e]
        };
        let shapes = [c.hidden_shape(), vec![1, c.h], vec![c.h, c.e], bias_shape];
        for ((name, want), shape) in GRADIENTS.iter().zip(&want).zip(&shapes) {
            prop_assert_eq!(grads[name].shape(), &shape[..], "{}", name);
            assert_close(
                &format!("{backend} {name}"),
                &f32s(&grads[name]),
                want,
                rtol,
                rtol * scale(want),
            )?;
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn forward_matches_the_oracle_on_both_backends(c in case()) {
        check_forward(BackendKind::Reference, &c, 1e-6)?;
        check_forward(BackendKind::Cpu, &c, 1e-5)?;
    }

    #[test]
    fn backward_matches_the_hand_derived_gradients(c in case()) {
        check_backward(&c)?;
    }

    #[test]
    fn outputs_take_the_dtypes_nki_library_writes(c in case()) {
        let (tensors, mut params) = c.tensors();
        params.set("output_dtype", "input").unwrap();
        let mm = if c.mm_bf16 { DType::BF16 } else { DType::F32 };
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let f32_outputs = forward(backend, &c);
            let nki = run(Kernel::RmsNormRouterTopkTkg, backend, &tensors, &params).unwrap();
            for (name, dtype) in [("norm_output", mm), ("expert_affinities", DType::BF16)] {
                let rounded = f32_outputs[name].clone().into_float_dtype(name, dtype).unwrap();
                prop_assert_eq!(&rounded, &nki[name], "{} {}", backend, name);
            }
            prop_assert_eq!(&f32_outputs["expert_index"], &nki["expert_index"]);
            let index = f32_outputs["expert_index"].clone();
            let (tensors, mut params) = c.bwd_tensors(&index);
            params.set("output_dtype", "input").unwrap();
            let f32_grads = backward(backend, &c, &index);
            let nki = run(Kernel::RmsNormRouterTopkTkgBwd, backend, &tensors, &params).unwrap();
            for (name, input) in GRADIENTS.into_iter().zip(
                ["hidden_states", "gamma", "router_weights", "router_weights"],
            ) {
                let dtype = tensors[input].dtype();
                let rounded = f32_grads[name].clone().into_float_dtype(name, dtype).unwrap();
                prop_assert_eq!(&rounded, &nki[name], "{} {}", backend, name);
            }
        }
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// The hand derivation itself, where nothing is rounded between the norm and the router
    /// (f32 router operands, read in f64 by the oracle): central finite differences.
    #[test]
    fn hand_derived_gradients_equal_finite_differences(c in case()) {
        let ids = forward(BackendKind::Reference, &c)["expert_index"].as_i32().unwrap().to_vec();
        let v = values(&c);
        let exact_norm = norm(&c, &v.x, &v.gamma);
        let analytic = oracle_gradients(&c, &ids, &exact_norm);
        let at: Vec<f64> = [v.x, v.gamma, v.w, v.b].concat();
        let numeric = finite_differences(&at, FD_STEP, |p| loss(&c, &ids, p));
        let analytic: Vec<f64> = analytic.concat();
        let tol = FD_TOL * 100.0 * scale(&numeric);
        assert_close("gradients", &analytic, &numeric, 1e-5, tol)?;
    }

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(c in case()) {
        let bytes = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let out = forward(BackendKind::Cpu, &c);
                let grads = backward(BackendKind::Cpu, &c, &out["expert_index"]);
                out.values().chain(grads.values()).flat_map(Tensor::to_le_bytes).collect::<Vec<u8>>()
            })
        };
        let one = bytes(1);
        prop_assert!(bytes(2) == one && bytes(3) == one);
    }
}

/// A case without randomness in its shape: T tokens, H, E, K, SOFTMAX or not.
fn plain(t: usize, h: usize, e: usize, k: usize, softmax: bool) -> Case {
    let mut flags = [false; 10];
    flags[3] = softmax;
    Case::build((t, h, e), k, flags, None, 7)
}

#[test]
fn a_single_expert_per_token_under_softmax_has_affinity_one() {
    for e in [1, 5, 13] {
        let c = plain(1, 16, e, 1, true);
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let out = forward(backend, &c);
            let affinities = f32s(&out["expert_affinities"]);
            let chosen = out["expert_index"].as_i32().unwrap()[0] as usize;
            for (expert, a) in affinities.iter().enumerate() {
                assert_eq!(
                    *a,
                    if expert == chosen { 1.0 } else { 0.0 },
                    "{backend}, E = {e}"
                );
            }
        }
    }
}

/// Rows of H' values padded with zeros to H under `hidden_actual = H'` give the unpadded
/// norm (and zeros in the padding), whatever the router weights of the padding rows.
#[test]
fn hidden_actual_makes_zero_padding_invisible() {
    let (t, actual, h, e) = (3, 12, 16, 6);
    let unpadded = plain(t, actual, e, 2, false);
    let mut padded = plain(t, h, e, 2, false);
    padded.hidden_actual = Some(actual);
    for token in 0..t {
        for j in 0..h {
            padded.x[token * h + j] = if j < actual {
                unpadded.x[token * actual + j]
            } else {
                0.0
            };
        }
    }
    padded.gamma[..actual].copy_from_slice(&unpadded.gamma);
    padded.w[..actual * e].copy_from_slice(&unpadded.w);
    padded.b = unpadded.b.clone();
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let want = forward(backend, &unpadded);
        let got = forward(backend, &padded);
        let got_norm = f32s(&got["norm_output"]);
        let want_norm = f32s(&want["norm_output"]);
        for token in 0..t {
            assert_close(
                &format!("{backend} norm_output, token {token}"),
                &got_norm[token * h..token * h + actual],
                &want_norm[token * actual..(token + 1) * actual],
                1e-6,
                1e-6,
            )
            .unwrap();
            assert!(
                got_norm[token * h + actual..(token + 1) * h]
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
        assert_eq!(got["expert_index"], want["expert_index"], "{backend}");
    }
}

/// `[B, S, H]` is `[B·S, H]` by another shape: the same outputs, and gradients of the same
/// values in the input's shape.
#[test]
fn batched_hidden_states_are_their_rows() {
    let mut c = plain(6, 24, 9, 3, true);
    c.d_norm = Some(vec![0.25; 6 * 24]);
    let mut batched = c.clone();
    batched.batch = Some(3);
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let (flat, three) = (forward(backend, &c), forward(backend, &batched));
        assert_eq!(flat, three, "{backend}");
        let (flat, three) = (
            backward(backend, &c, &flat["expert_index"]),
            backward(backend, &batched, &three["expert_index"]),
        );
        assert_eq!(three["d_hidden_states"].shape(), &[3, 2, 24]);
        assert_eq!(
            three["d_hidden_states"].to_f64_vec(),
            flat["d_hidden_states"].to_f64_vec()
        );
    }
}

/// Runs `kernel` on `c` with `edit` applied on both backends; both must fail with the same
/// message, containing every one of `expected`.
fn fails(
    kernel: Kernel,
    c: &Case,
    edit: impl Fn(&mut BTreeMap<String, Tensor>, &mut Params),
    expected: &[&str],
) {
    let index = forward(BackendKind::Reference, c)["expert_index"].clone();
    let (mut tensors, mut params) = c.bwd_tensors(&index);
    edit(&mut tensors, &mut params);
    let messages: Vec<String> = [BackendKind::Reference, BackendKind::Cpu]
        .into_iter()
        .map(|backend| match run(kernel, backend, &tensors, &params) {
            Ok(_) => panic!("{backend} accepted it; expected {expected:?}"),
            Err(e) => e.to_string(),
        })
        .collect();
    assert_eq!(messages[0], messages[1]);
    for part in expected {
        assert!(messages[0].contains(part), "{}: no `{part}`", messages[0]);
    }
}

#[test]
fn bad_inputs_are_errors_naming_what_is_wrong() {
    let c = plain(4, 8, 5, 2, false);
    let both = [
        Kernel::RmsNormRouterTopkTkg,
        Kernel::RmsNormRouterTopkTkgBwd,
    ];
    let put = |name: &'static str, tensor: Tensor| {
        move |t: &mut BTreeMap<String, Tensor>, _: &mut Params| {
            t.insert(name.to_owned(), tensor.clone());
        }
    };
    let set = |name: &'static str, value: &'static str| {
        move |_: &mut BTreeMap<String, Tensor>, p: &mut Params| p.set(name, value).unwrap()
    };
    for kernel in both {
        fails(
            kernel,
            &c,
            |t, _| drop(t.remove("gamma")),
            &["missing input tensor `gamma`"],
        );
        fails(
            kernel,
            &c,
            put("hidden_states", f32_tensor(&[32], &[0.5; 32])),
            &["`hidden_states`", "[B, S, H]|[T, H]", "[32]"],
        );
        fails(
            kernel,
            &c,
            put("hidden_states", f32_tensor(&[4, 8], &[f64::NAN; 32])),
            &["`hidden_states`", "non-finite"],
        );
        fails(
            kernel,
            &c,
            put("gamma", f32_tensor(&[1, 7], &[1.0; 7])),
            &["`gamma`", "[1, H] or [H]", "[1, 7]"],
        );
        fails(
            kernel,
            &c,
            put("router_weights", f32_tensor(&[8, 5], &[0.5; 40]).to_bf16()),
            &[
                "`router_weights`",
                "f32 (router_mm_dtype = float32)",
                "bf16",
            ],
        );
        fails(
            kernel,
            &c,
            put("router_weights", f32_tensor(&[7, 5], &[0.5; 35])),
            &["`router_weights`", "[H, E]"],
        );
        fails(
            kernel,
            &c,
            put("router_bias", f32_tensor(&[2, 5], &[0.5; 10])),
            &["`router_bias`", "[1, E] or [E]"],
        );
        fails(
            kernel,
            &c,
            put("router_bias", f32_tensor(&[1, 5], &[0.5; 5]).to_bf16()),
            &["`router_bias`", "f32 (router_mm_dtype = float32)", "bf16"],
        );
        fails(kernel, &c, set("eps", "0"), &["`eps`", "positive"]);
        fails(
            kernel,
            &c,
            set("hidden_actual", "9"),
            &["`hidden_actual`", "1..=8"],
        );
        fails(
            kernel,
            &c,
            set("hidden_actual", "0"),
            &["`hidden_actual`", "1..=8"],
        );
    }
    let fwd = Kernel::RmsNormRouterTopkTkg;
    fails(fwd, &c, set("top_k", "6"), &["`top_k`", "1..=5"]);
    fails(fwd, &c, set("top_k", "0"), &["`top_k`", "1..=5"]);
    fails(
        fwd,
        &c,
        set("quantization_type", "MX"),
        &["`quantization_type`", "MX", "NONE"],
    );
    let bwd = Kernel::RmsNormRouterTopkTkgBwd;
    fails(
        bwd,
        &c,
        put(
            "expert_index",
            i32_tensor(&[4, 2], &[0, 0, 1, 2, 3, 4, 0, 1]),
        ),
        &["`expert_index`", "appears twice"],
    );
    fails(
        bwd,
        &c,
        put(
            "expert_index",
            i32_tensor(&[4, 2], &[0, 5, 1, 2, 3, 4, 0, 1]),
        ),
        &["`expert_index`", "outside [0, 5)"],
    );
    fails(
        bwd,
        &c,
        put("d_expert_affinities", f32_tensor(&[4, 2], &[0.5; 8])),
        &["`d_expert_affinities`", "[T, E]", "[4, 2]"],
    );
    fails(
        bwd,
        &c,
        |t, p| {
            p.set("store_eager_affi_only", "true").unwrap();
            drop(t.remove("d_norm_output"));
        },
        &[
            "`d_expert_affinities`",
            "[T, K] (store_eager_affi_only)",
            "[4, 5]",
        ],
    );
    fails(
        bwd,
        &c,
        put("d_norm_output", f32_tensor(&[4, 7], &[0.5; 28])),
        &["`d_norm_output`", "[T, H]"],
    );
    // Parameter values are refused where they are read.
    let mut params = Params::default();
    for (name, value, expected) in [
        ("router_mm_dtype", "float16", "bfloat16 or float32"),
        ("router_act_fn", "RELU", "SOFTMAX or SIGMOID"),
        ("quantization_type", "ROW", "NONE or MX"),
        ("eps", "inf", "finite"),
    ] {
        let message = params.set(name, value).unwrap_err().to_string();
        assert!(
            message.contains(name) && message.contains(expected),
            "{message}"
        );
    }
}
