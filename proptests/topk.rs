//! `topk` (nki-library's top-k over a long last axis) against an oracle of its own: for each
//! row, every position counted by how many values beat it (greater, or equal at a lower
//! position), the K with counts below K chosen. Both backends, every option (rank 2 and 3,
//! f32 and bf16, sorted or not, both methods), rows long enough to be split into chunks, ties
//! (values drawn from a handful, ±0 among them), K = V, the dtypes nki-library writes,
//! bit-identity across thread counts and every input error.

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Case {
    /// `inp`'s shape, rank 2 or 3.
    shape: Vec<usize>,
    k: usize,
    bf16: bool,
    sorted: bool,
    scanning: bool,
    values: Vec<f64>,
}

impl Case {
    fn v(&self) -> usize {
        *self.shape.last().unwrap()
    }

    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let inp = f32_tensor(&self.shape, &self.values);
        let inp = if self.bf16 { inp.to_bf16() } else { inp };
        let tensors = BTreeMap::from([("inp".to_owned(), inp)]);
        let mut params = Params::default();
        params.set("k", &self.k.to_string()).unwrap();
        params.set("sorted_flag", &self.sorted.to_string()).unwrap();
        let method = if self.scanning {
            "SCANNING"
        } else {
            "ROTATIONAL"
        };
        params.set("method", method).unwrap();
        (tensors, params)
    }
}

/// Values with ties: a few distinct values (±0 among them), or spread ones.
fn row_values(rng: &mut SeededRng, n: usize, tied: bool) -> Vec<f64> {
    if tied {
        const FEW: [f64; 6] = [-1.5, -0.0, 0.0, 0.25, 2.0, 3.5];
        (0..n)
            .map(|_| FEW[rng.next_u64() as usize % FEW.len()])
            .collect()
    } else {
        rng.values(n, 100.0)
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        (1usize..=4, proptest::option::of(1usize..=3), 1usize..=300),
        any::<[bool; 5]>(),
        any::<u64>(),
    )
        .prop_flat_map(|((rows, batch, v), flags, seed)| {
            (Just((rows, batch, v, flags, seed)), 1..=v)
        })
        .prop_map(|((rows, batch, v, flags, seed), k)| {
            let [bf16, sorted, scanning, tied, long] = flags;
            // Some rows longer than a chunk of the cpu backend (16384 positions).
            let v = if long { v + 40_000 } else { v };
            let k = if long { k.min(300) } else { k };
            let shape = match batch {
                Some(b) => vec![b, rows, v],
                None => vec![rows, v],
            };
            let n = shape.iter().product();
            let mut rng = SeededRng::new(seed);
            Case {
                shape,
                k,
                bf16,
                sorted,
                scanning,
                values: row_values(&mut rng, n, tied),
            }
        })
}

/// The positions `[rows, K]` in output order, by counting for each position the values that
/// beat it.
fn oracle(c: &Case, stored: &[f64]) -> Vec<i32> {
    let (v, k) = (c.v(), c.k);
    let mut out = Vec::new();
    for row in stored.chunks(v) {
        if k == v {
            out.extend(0..v as i32);
            continue;
        }
        // rank[p]: how many values come before position p in the contract's order.
        let beats = |q: usize, p: usize| row[q] > row[p] || (row[q] == row[p] && q < p);
        let rank: Vec<usize> = (0..v)
            .map(|p| (0..v).filter(|&q| beats(q, p)).count())
            .collect();
        let mut chosen: Vec<usize> = (0..v).filter(|&p| rank[p] < k).collect();
        if c.sorted {
            chosen.sort_by_key(|&p| rank[p]);
        }
        out.extend(chosen.into_iter().map(|p| p as i32));
    }
    out
}

/// The oracle for long rows: the same order by a sort (the counting oracle is quadratic).
fn sorted_oracle(c: &Case, stored: &[f64]) -> Vec<i32> {
    let (v, k) = (c.v(), c.k);
    let mut out = Vec::new();
    for row in stored.chunks(v) {
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        order.truncate(k);
        if !c.sorted {
            order.sort_unstable();
        }
        out.extend(order.into_iter().map(|p| p as i32));
    }
    out
}

fn run(
    backend: BackendKind,
    tensors: &BTreeMap<String, Tensor>,
    params: &Params,
) -> Result<BTreeMap<&'static str, Tensor>, Error> {
    Ok(Kernel::Topk
        .run(backend.create().as_ref(), tensors, params)?
        .into_iter()
        .collect())
}

fn check(backend: BackendKind, c: &Case) -> Result<(), TestCaseError> {
    let (tensors, params) = c.tensors();
    let out = run(backend, &tensors, &params).unwrap();
    let stored = tensors["inp"].to_f64_vec();
    let mut shape = c.shape.clone();
    *shape.last_mut().unwrap() = c.k;
    let (values, indices) = (&out["topk_values"], &out["topk_indices"]);
    prop_assert_eq!(values.shape(), &shape[..]);
    prop_assert_eq!(indices.shape(), &shape[..]);
    prop_assert_eq!(values.dtype(), tensors["inp"].dtype());
    let want = if c.v() > 400 {
        sorted_oracle(c, &stored)
    } else {
        oracle(c, &stored)
    };
    prop_assert_eq!(indices.as_i32().unwrap(), &want[..], "{}", backend);
    // The values are inp's at those positions, bit for bit.
    let gathered: Vec<f64> = want
        .iter()
        .enumerate()
        .map(|(slot, &p)| stored[(slot / c.k) * c.v() + p as usize])
        .collect();
    let got = values.to_f64_vec();
    for (g, w) in got.iter().zip(&gathered) {
        prop_assert_eq!(g.to_bits(), w.to_bits(), "{} values", backend);
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

    /// `output_dtype = float32` widens the values; the indices stay i32.
    #[test]
    fn float32_outputs_widen_the_values(c in case()) {
        let (tensors, mut params) = c.tensors();
        let nki = run(BackendKind::Cpu, &tensors, &params).unwrap();
        params.set("output_dtype", "float32").unwrap();
        let wide = run(BackendKind::Cpu, &tensors, &params).unwrap();
        prop_assert_eq!(wide["topk_values"].dtype(), DType::F32);
        prop_assert_eq!(wide["topk_values"].to_f64_vec(), nki["topk_values"].to_f64_vec());
        prop_assert_eq!(&wide["topk_indices"], &nki["topk_indices"]);
    }

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(c in case()) {
        let (tensors, params) = c.tensors();
        let runs: Vec<BTreeMap<&str, Tensor>> = [1, 2, 3]
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

/// K = V returns `inp` as given, unsorted even with `sorted_flag`, positions `0..V`.
#[test]
fn the_whole_row_is_the_input_as_given() {
    let values = [3.0, -1.0, 7.0, 0.5, 7.0, 2.0];
    for backend in [BackendKind::Reference, BackendKind::Cpu] {
        let c = Case {
            shape: vec![2, 3],
            k: 3,
            bf16: false,
            sorted: true,
            scanning: false,
            values: values.to_vec(),
        };
        let (tensors, params) = c.tensors();
        let out = run(backend, &tensors, &params).unwrap();
        assert_eq!(out["topk_values"], tensors["inp"]);
        assert_eq!(out["topk_indices"].as_i32().unwrap(), &[0, 1, 2, 0, 1, 2]);
    }
}

/// A row with one value repeated: the lowest positions, in order, whatever the order flag.
#[test]
fn equal_values_go_by_position() {
    for sorted in [true, false] {
        for backend in [BackendKind::Reference, BackendKind::Cpu] {
            let c = Case {
                shape: vec![1, 20_000],
                k: 5,
                bf16: true,
                sorted,
                scanning: true,
                values: vec![1.0; 20_000],
            };
            let (tensors, params) = c.tensors();
            let out = run(backend, &tensors, &params).unwrap();
            assert_eq!(out["topk_indices"].as_i32().unwrap(), &[0, 1, 2, 3, 4]);
        }
    }
}

/// Runs `topk` with `edit` applied on both backends; both must fail with the same message,
/// containing every one of `expected`.
fn fails(edit: impl Fn(&mut BTreeMap<String, Tensor>, &mut Params), expected: &[&str]) {
    let c = Case {
        shape: vec![2, 5],
        k: 2,
        bf16: false,
        sorted: true,
        scanning: false,
        values: (0..10).map(f64::from).collect(),
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
            t.insert("inp".to_owned(), tensor.clone());
        }
    };
    fails(|t, _| drop(t.remove("inp")), &["inp"]);
    fails(|_, p| p.k = None, &["k", "required"]);
    fails(|_, p| p.set("k", "0").unwrap(), &["k", "1..=5"]);
    fails(|_, p| p.set("k", "6").unwrap(), &["k", "1..=5"]);
    fails(
        |_, p| p.set("method", "CASCADED").unwrap(),
        &["method", "CASCADED"],
    );
    fails(put(f32_tensor(&[5], &[1.0; 5])), &["inp", "rank 2"]);
    fails(put(f32_tensor(&[0, 5], &[])), &["inp", "rows"]);
    fails(put(i32_tensor(&[2, 5], &[0; 10])), &["inp", "i32"]);
    fails(
        put(f32_tensor(
            &[2, 5],
            &[0.0, 1.0, f64::NAN, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        )),
        &["inp", "non-finite", "[0, 2]"],
    );
    let mut params = Params::default();
    let err = params.set("method", "FAST").unwrap_err().to_string();
    assert!(
        err.contains("method") && err.contains("ROTATIONAL"),
        "{err}"
    );
}
