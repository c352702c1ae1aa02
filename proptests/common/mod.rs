//! Shared helpers for the property tests: configuration, a seeded generator for tensor data,
//! routing generators, closeness assertions and central finite differences.

#![allow(dead_code)]

pub mod ep_layer;
pub mod rows_exchange;

use moekit::Tensor;
use moekit::contracts::{ActFnType, WeightLayout};
use moekit::random::SplitMix64;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

/// Proptest configuration with `default_cases` cases unless `PROPTEST_CASES` is set. Tests that
/// skip near-tied routings reject a share of their inputs, so the reject budget scales with the
/// case count.
pub fn config(default_cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = default_cases;
    }
    config.max_global_rejects = config
        .max_global_rejects
        .max(config.cases.saturating_mul(4));
    config
}

/// A fresh, empty folder `<target tmp>/<group>/<name>` for one test's files.
pub fn scratch_dir(group: &str, name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(group)
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// moekit's seeded generator ([`SplitMix64`]) with the tests' bulk draws; proptest picks the
/// seed.
pub struct SeededRng(SplitMix64);

impl SeededRng {
    pub fn new(seed: u64) -> Self {
        Self(SplitMix64::new(seed))
    }

    /// `n` values uniform in `[-scale, scale)`, rounded to f32 so f32 tensors hold them exactly.
    pub fn values(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n)
            .map(|_| f64::from(self.0.uniform(-scale, scale) as f32))
            .collect()
    }
}

impl std::ops::Deref for SeededRng {
    type Target = SplitMix64;

    fn deref(&self) -> &SplitMix64 {
        &self.0
    }
}

impl std::ops::DerefMut for SeededRng {
    fn deref_mut(&mut self) -> &mut SplitMix64 {
        &mut self.0
    }
}

/// How tokens pick experts in generated routings.
#[derive(Clone, Copy, Debug)]
pub enum Routing {
    /// K distinct random experts per token.
    Random,
    /// Every token picks experts `0..K`: all load on the same K experts.
    Concentrated,
    /// Tokens only pick among the first `K` or `K+1` experts, leaving the rest with no tokens.
    Sparse,
}

pub fn routing() -> impl Strategy<Value = Routing> {
    prop_oneof![
        2 => Just(Routing::Random),
        1 => Just(Routing::Concentrated),
        1 => Just(Routing::Sparse),
    ]
}

/// Marks a random subset of slots (possibly all of a row, possibly none) as skipped
/// ([`moekit::contracts::SKIP`], affinity 0), as an expert-parallel receiver sees the slots of
/// other ranks' experts.
pub fn skip_slots(rng: &mut SeededRng, index: &mut [i32], affinities: &mut [f64]) {
    for (id, a) in index.iter_mut().zip(affinities.iter_mut()) {
        if rng.uniform(0.0, 1.0) < 0.5 {
            *id = moekit::contracts::SKIP;
            *a = 0.0;
        }
    }
}

/// `expert_index [T, K]` with distinct ids per row.
pub fn expert_index(
    rng: &mut SeededRng,
    routing: Routing,
    t: usize,
    e: usize,
    k: usize,
) -> Vec<i32> {
    let pool = match routing {
        Routing::Random => e,
        Routing::Concentrated => k,
        Routing::Sparse => (k + 1).min(e),
    };
    (0..t)
        .flat_map(|_| {
            rng.permutation(pool)
                .into_iter()
                .take(k)
                .map(|id| id as i32)
                .collect::<Vec<_>>()
        })
        .collect()
}

pub fn f32_tensor(shape: &[usize], values: &[f64]) -> Tensor {
    Tensor::from_f32(shape, values.iter().map(|&v| v as f32).collect()).unwrap()
}

pub fn i32_tensor(shape: &[usize], values: &[i32]) -> Tensor {
    Tensor::from_i32(shape, values.to_vec()).unwrap()
}

pub fn f32s(tensor: &Tensor) -> Vec<f64> {
    assert_eq!(tensor.dtype(), moekit::DType::F32, "outputs are f32");
    tensor.to_f64_vec()
}

/// Asserts `|actual − expected| ≤ atol + rtol·|expected|` elementwise.
pub fn assert_close(
    what: &str,
    actual: &[f64],
    expected: &[f64],
    rtol: f64,
    atol: f64,
) -> Result<(), TestCaseError> {
    prop_assert_eq!(actual.len(), expected.len(), "{}: length", what);
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        prop_assert!(
            (a - e).abs() <= atol + rtol * e.abs(),
            "{}[{}]: got {}, expected {} (rtol {}, atol {})",
            what,
            i,
            a,
            e,
            rtol,
            atol
        );
    }
    Ok(())
}

/// Largest magnitude, at least 1: a scale for absolute tolerances.
pub fn scale(values: &[f64]) -> f64 {
    values.iter().fold(1.0, |m: f64, v| m.max(v.abs()))
}

/// Central finite differences of a scalar function at `at`, step `h` per coordinate.
pub fn finite_differences(at: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let mut point = at.to_vec();
    (0..at.len())
        .map(|i| {
            let x = at[i];
            point[i] = x + h;
            let plus = f(&point);
            point[i] = x - h;
            let minus = f(&point);
            point[i] = x;
            (plus - minus) / (2.0 * h)
        })
        .collect()
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Finite-difference step and tolerance used by every backward test: with h = 1e-5 the
/// truncation error is O(h²·f''') ≈ 1e-10 and the rounding error O(ε/h) ≈ 1e-11, relative to the
/// function's scale; 1e-6 leaves a wide margin while still catching any wrong term.
pub const FD_STEP: f64 = 1e-5;
pub const FD_TOL: f64 = 1e-6;

/// `gate_up_proj_weight` (or its gradient) of E experts, hidden size H and intermediate size I
/// moved from layout `from` to layout `to`, in the same dtype.
pub fn relayout_gate_up(
    weights: &Tensor,
    (e, h, i): (usize, usize, usize),
    from: WeightLayout,
    to: WeightLayout,
) -> Tensor {
    let values = weights.to_f64_vec();
    let mut moved = vec![0.0; values.len()];
    for expert in 0..e {
        for j in 0..h {
            for which in 0..2 {
                for col in 0..i {
                    moved[to.gate_up_offset((h, i), expert, j, which, col)] =
                        values[from.gate_up_offset((h, i), expert, j, which, col)];
                }
            }
        }
    }
    same_dtype(weights, &to.gate_up_dims(e, h, i), &moved)
}

/// The gate and up projections' weights `[E, I, H]` each, in the same dtype, of a
/// `gate_up_proj_weight [E, 2, I, H]` in the linear layout: the tensors of moekit's
/// `up_proj_weight` form (torchtitan's `w1` and `w3`).
pub fn split_gate_up(weights: &Tensor) -> (Tensor, Tensor) {
    let &[e, 2, i, h] = weights.shape() else {
        panic!("not [E, 2, I, H]: {:?}", weights.shape());
    };
    let values = weights.to_f64_vec();
    let half = |which: usize| {
        let rows: Vec<f64> = values
            .chunks(i * h)
            .skip(which)
            .step_by(2)
            .flatten()
            .copied()
            .collect();
        same_dtype(weights, &[e, i, h], &rows)
    };
    (half(0), half(1))
}

/// `down_proj_weight` (or its gradient) moved from layout `from` to layout `to`, as
/// [`relayout_gate_up`].
pub fn relayout_down(
    weights: &Tensor,
    (e, h, i): (usize, usize, usize),
    from: WeightLayout,
    to: WeightLayout,
) -> Tensor {
    let values = weights.to_f64_vec();
    let mut moved = vec![0.0; values.len()];
    for expert in 0..e {
        for row in 0..i {
            for j in 0..h {
                moved[to.down_offset((h, i), expert, row, j)] =
                    values[from.down_offset((h, i), expert, row, j)];
            }
        }
    }
    same_dtype(weights, &to.down_dims(e, h, i), &moved)
}

/// `values` as a tensor of `shape` in `like`'s float dtype (exact: they came from such a tensor).
fn same_dtype(like: &Tensor, shape: &[usize], values: &[f64]) -> Tensor {
    let tensor = f32_tensor(shape, values);
    match like.dtype() {
        moekit::DType::BF16 => tensor.to_bf16(),
        _ => tensor,
    }
}

/// `v` rounded to the nearest bf16, ties to even, in one step from f64 (`half`'s
/// `bf16::from_f64` is not correctly rounded near ties).
pub fn round_bf16(v: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    // bf16 keeps 8 significant bits down to 2⁻¹²⁶, and a step of 2⁻¹³³ below.
    let step = 2f64.powf(v.abs().log2().floor().max(-126.0) - 7.0);
    let rounded = (v / step).round_ties_even() * step;
    if rounded.abs() > half::bf16::MAX.to_f64() {
        f64::INFINITY.copysign(v)
    } else {
        rounded
    }
}

/// The gate activations by their definitions (erf for GELU through libm's f64).
pub fn activate(act_fn: ActFnType, g: f64) -> f64 {
    let sigmoid = |v: f64| 1.0 / (1.0 + (-v).exp());
    match act_fn {
        ActFnType::Silu => g * sigmoid(g),
        ActFnType::Gelu => 0.5 * g * (1.0 + libm::erf(g / 2f64.sqrt())),
        ActFnType::GeluTanhApprox => {
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g * g * g);
            0.5 * g * (1.0 + inner.tanh())
        }
        ActFnType::Swish => g * sigmoid(1.702 * g),
        ActFnType::Relu => g.max(0.0),
        ActFnType::SquaredRelu => g.max(0.0).powi(2),
    }
}
