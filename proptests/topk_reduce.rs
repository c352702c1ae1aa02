//! `topk_reduce` (nki-library's combine after an expert-parallel exchange) against an oracle of
//! its own: the rows are built per token (1 to K + 2 rows tagged `token_base_index + t`, with
//! the default base 1, base 0 or others, and padding rows tagged with other ids, bit patterns
//! that read as NaN among them), shuffled, and each token's sum taken over its rows sorted by
//! position, the first K. Both backends, f32 and bf16 outputs, H = 0, T = 1, K = 1,
//! bit-identity across thread counts and every input error.

mod common;

use std::collections::BTreeMap;

use common::*;
use half::bf16;
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

/// Ids a padding row may carry (those that are not a token's): −1 is all ones (a NaN in both
/// halves), 0x7fc0_0000 a NaN in the high half.
const PADDING_IDS: [i32; 7] = [-1, 0, 10, 11, i32::MIN, i32::MAX, 0x7fc0_0000];

#[derive(Clone, Debug)]
struct Case {
    t: usize,
    k: usize,
    h: usize,
    /// `token_base_index`, nki-library's 1 where not given.
    base: Option<i32>,
    /// Each row's token id and H values.
    rows: Vec<(i32, Vec<f64>)>,
}

impl Case {
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let mut elements = Vec::new();
        for (id, values) in &self.rows {
            elements.extend(values.iter().map(|&v| bf16::from_f64(v)));
            // The id's low 16 bits in column H, its high 16 in column H + 1.
            let bits = *id as u32;
            elements.push(bf16::from_bits((bits & 0xffff) as u16));
            elements.push(bf16::from_bits((bits >> 16) as u16));
        }
        let input = Tensor::from_bf16([self.rows.len(), self.h + 2], elements).unwrap();
        let mut params = Params::default();
        params.set("T", &self.t.to_string()).unwrap();
        params.set("K", &self.k.to_string()).unwrap();
        if let Some(base) = self.base {
            params.set("token_base_index", &base.to_string()).unwrap();
        }
        (BTreeMap::from([("input".to_owned(), input)]), params)
    }

    fn id(&self, token: usize) -> i32 {
        self.base.unwrap_or(1) + token as i32
    }

    /// `[T, H]`: each token's rows in position order, the first K (or all, if fewer) summed
    /// (exactly: bf16 values, few terms).
    fn oracle(&self) -> Vec<f64> {
        let mut out = Vec::new();
        for token in 0..self.t {
            let mut mine: Vec<usize> = (0..self.rows.len())
                .filter(|&r| self.rows[r].0 == self.id(token))
                .collect();
            mine.sort_unstable();
            mine.truncate(self.k);
            for col in 0..self.h {
                out.push(mine.iter().map(|&r| self.rows[r].1[col]).sum());
            }
        }
        out
    }
}

fn case() -> impl Strategy<Value = Case> {
    let base = prop_oneof![
        Just(None),
        Just(Some(0)),
        Just(Some(1)),
        Just(Some(-3)),
        Just(Some(12)),
    ];
    (
        (1usize..=9, 1usize..=4, 0usize..=33, 0usize..=6),
        base,
        any::<u64>(),
    )
        .prop_map(|((t, k, h, padding), base, seed)| {
            let mut rng = SeededRng::new(seed);
            let mut c = Case {
                t,
                k,
                h,
                base,
                rows: Vec::new(),
            };
            let round = |v: f64| f64::from(bf16::from_f64(v));
            for token in 0..t {
                // 1 to K rows of its own, sometimes up to two more that are not summed.
                let n = 1 + (rng.next_u64() % (k as u64 + 2)) as usize;
                for _ in 0..n {
                    let values = rng.values(h, 8.0).into_iter().map(round).collect();
                    c.rows.push((c.id(token), values));
                }
            }
            let ids = c.id(0)..c.id(t);
            let others: Vec<i32> = PADDING_IDS
                .into_iter()
                .filter(|id| !ids.contains(id))
                .collect();
            for _ in 0..padding {
                let id = others[(rng.next_u64() % others.len() as u64) as usize];
                let values = rng.values(h, 8.0).into_iter().map(round).collect();
                c.rows.push((id, values));
            }
            // Fisher–Yates over the seeded stream.
            for i in (1..c.rows.len()).rev() {
                c.rows.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            c
        })
}

fn run(
    backend: BackendKind,
    tensors: &BTreeMap<String, Tensor>,
    params: &Params,
) -> Result<Tensor, Error> {
    let mut out = Kernel::TopkReduce.run(backend.create().as_ref(), tensors, params)?;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, "output");
    Ok(out.remove(0).1)
}

fn check(backend: BackendKind, c: &Case) -> Result<(), TestCaseError> {
    let (tensors, mut params) = c.tensors();
    params.set("output_dtype", "float32").unwrap();
    let output = run(backend, &tensors, &params).unwrap();
    prop_assert_eq!(output.shape(), &[c.t, c.h][..]);
    prop_assert_eq!(output.dtype(), DType::F32);
    let want = c.oracle();
    match backend {
        // The f64 sum is exact here, so rounding it once is the reference's output.
        BackendKind::Reference => {
            let rounded: Vec<f64> = want.iter().map(|&w| f64::from(w as f32)).collect();
            prop_assert_eq!(output.to_f64_vec(), rounded);
        }
        // f32 partial sums: within K roundings of the magnitude summed.
        _ => {
            let got = output.to_f64_vec();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let bound = c.k as f64 * f64::from(f32::EPSILON) * 8.0 * c.k as f64;
                prop_assert!(
                    (g - w).abs() <= bound,
                    "{}: output[{}] {} vs {}",
                    backend,
                    i,
                    g,
                    w
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn both_backends_match_the_oracle(c in case()) {
        check(BackendKind::Reference, &c)?;
        check(BackendKind::Cpu, &c)?;
    }

    /// nki-library's dtype (`input`'s, bf16) is the f32 output rounded once.
    #[test]
    fn bf16_outputs_are_the_f32_outputs_rounded(c in case()) {
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let (tensors, mut params) = c.tensors();
            let nki = run(backend, &tensors, &params).unwrap();
            params.set("output_dtype", "float32").unwrap();
            let wide = run(backend, &tensors, &params).unwrap();
            prop_assert_eq!(nki.dtype(), DType::BF16);
            prop_assert_eq!(wide.into_float_dtype("output", DType::BF16).unwrap(), nki);
        }
    }

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(c in case()) {
        let (tensors, params) = c.tensors();
        let runs: Vec<Tensor> = [1, 2, 3]
            .into_iter()
            .map(|threads| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| run(BackendKind::Cpu, &tensors, &params).unwrap())
            })
            .collect();
        prop_assert!(runs[1] == runs[0] && runs[2] == runs[0]);
    }
}

/// One token, one row, one padding row: the row itself; rows past the K-th are not summed.
#[test]
fn the_smallest_call_and_rows_past_k() {
    let one = Case {
        t: 1,
        k: 1,
        h: 2,
        base: None,
        // id 0 is not token 0's: ids are 1-indexed by default.
        rows: vec![
            (-1, vec![5.0, 5.0]),
            (0, vec![5.0, 5.0]),
            (1, vec![1.5, -2.0]),
            (1, vec![4.0, 4.0]),
        ],
    };
    let none = Case {
        h: 0,
        rows: one.rows.iter().map(|(id, _)| (*id, Vec::new())).collect(),
        ..one.clone()
    };
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let (tensors, params) = one.tensors();
        let output = run(backend, &tensors, &params).unwrap();
        assert_eq!(output.to_f64_vec(), vec![1.5, -2.0]);
        let (tensors, params) = none.tensors();
        assert_eq!(run(backend, &tensors, &params).unwrap().shape(), &[1, 0]);
    }
}

/// Runs `topk_reduce` with `edit` applied on both backends; both must fail with the same
/// message, containing every one of `expected`.
fn fails(edit: impl Fn(&mut BTreeMap<String, Tensor>, &mut Params), expected: &[&str]) {
    let c = Case {
        t: 2,
        k: 2,
        h: 3,
        base: None,
        rows: [1, 2, -1, 2, 1]
            .into_iter()
            .map(|id| (id, vec![1.0, 2.0, 3.0]))
            .collect(),
    };
    let (mut tensors, mut params) = c.tensors();
    edit(&mut tensors, &mut params);
    let messages: Vec<String> = [BackendKind::Reference, BackendKind::Cpu]
        .into_iter()
        .map(|backend| match run(backend, &tensors, &params) {
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
    let put = |tensor: Tensor| {
        move |t: &mut BTreeMap<String, Tensor>, _: &mut Params| {
            t.insert("input".to_owned(), tensor.clone());
        }
    };
    fails(|t, _| drop(t.remove("input")), &["input"]);
    fails(|_, p| p.token_count = None, &["T", "required"]);
    fails(|_, p| p.rows_per_token = None, &["K", "required"]);
    fails(|_, p| p.set("T", "0").unwrap(), &["T", "at least 1"]);
    fails(|_, p| p.set("K", "0").unwrap(), &["K", "at least 1"]);
    // Token 2 (id 3) has no row.
    fails(
        |_, p| p.set("T", "3").unwrap(),
        &["input", "token 2", "id 3"],
    );
    // Under the 0-indexed convention token 0 (id 0) has none.
    fails(
        |_, p| p.set("token_base_index", "0").unwrap(),
        &["input", "token 0", "id 0"],
    );
    fails(
        |_, p| p.set("T", "6").unwrap(),
        &["input", "5 rows", "T = 6"],
    );
    // T beyond the rows is refused before anything is sized by it.
    fails(
        |_, p| p.set("T", &usize::MAX.to_string()).unwrap(),
        &["input", "5 rows"],
    );
    fails(
        |_, p| p.set("token_base_index", &i32::MAX.to_string()).unwrap(),
        &["token_base_index", "i32"],
    );
    fails(put(f32_tensor(&[5, 5], &[0.0; 25])), &["input", "bf16"]);
    fails(
        put(f32_tensor(&[10], &[0.0; 10]).to_bf16()),
        &["input", "[TK_padded, H+2]", "[10]"],
    );
    fails(
        put(f32_tensor(&[5, 1], &[0.0; 5]).to_bf16()),
        &["input", "H+2"],
    );
    let mut with_nan = f32_tensor(&[5, 5], &[0.0; 25]).to_bf16().to_f64_vec();
    with_nan[7] = f64::NAN;
    fails(
        put(f32_tensor(&[5, 5], &with_nan).to_bf16()),
        &["input", "non-finite", "[1, 2]"],
    );
}
