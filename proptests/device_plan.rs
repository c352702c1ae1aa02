//! nki-library's device-side plan subkernels against oracles of their own:
//! `find_nonzero_indices` (each column's nonzero rows, compared value by value in f64, −0
//! being zero) and `indexed_flatten` (each output block's last writer found per block, not per
//! row). Both backends, every dtype, column ranges, offsets that overlap, fall before the start
//! or past the end, `row_offsets_start`, columns longer than the cpu backend's row chunk,
//! bit-identity across thread counts, every input error, and the two chained as the device
//! chains them: over a routing's affinities `[T, E]`, they give `permute`'s
//! `token_position_to_id` (with `skip_token`).

mod common;

use std::collections::BTreeMap;

use common::*;
use moekit::kernel::{Kernel, Params};
use moekit::{BackendKind, DType, Error, Tensor};
use proptest::prelude::*;

const BACKENDS: [BackendKind; 2] = [BackendKind::Reference, BackendKind::Cpu];

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

/// `values` stored as `dtype` (bf16 and i32 values are drawn representable).
fn tensor(dtype: DType, shape: &[usize], values: &[f64]) -> Tensor {
    match dtype {
        DType::F32 => f32_tensor(shape, values),
        DType::BF16 => f32_tensor(shape, values).to_bf16(),
        DType::I32 => i32_tensor(shape, &values.iter().map(|&v| v as i32).collect::<Vec<_>>()),
    }
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::BF16), Just(DType::I32)]
}

#[derive(Clone, Debug)]
struct SearchCase {
    t: usize,
    c_full: usize,
    dtype: DType,
    /// Small integers, about half zero (−0 among them).
    values: Vec<f64>,
    /// `col_start_id[0]` and `n_cols`.
    range: Option<(usize, usize)>,
    chunk_size: Option<usize>,
}

impl SearchCase {
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let input = tensor(self.dtype, &[self.t, self.c_full], &self.values);
        let mut tensors = BTreeMap::from([("input_tensor".to_owned(), input)]);
        let mut params = Params::default();
        if let Some((start, n_cols)) = self.range {
            tensors.insert("col_start_id".to_owned(), i32_tensor(&[1], &[start as i32]));
            params.set("n_cols", &n_cols.to_string()).unwrap();
        }
        if let Some(chunk) = self.chunk_size {
            params.set("chunk_size", &chunk.to_string()).unwrap();
        }
        (tensors, params)
    }

    /// `indices [C, T]` and `nonzero_counts [C]`, column by column.
    fn oracle(&self) -> (Vec<i32>, Vec<i32>) {
        let (first, c) = self.range.unwrap_or((0, self.c_full));
        let (mut indices, mut counts) = (Vec::new(), Vec::new());
        for col in first..first + c {
            let rows: Vec<i32> = (0..self.t)
                .filter(|&row| self.values[row * self.c_full + col] != 0.0)
                .map(|row| row as i32)
                .collect();
            counts.push(rows.len() as i32);
            indices.extend(&rows);
            indices.extend(std::iter::repeat_n(-1, self.t - rows.len()));
        }
        (indices, counts)
    }
}

fn search_case() -> impl Strategy<Value = SearchCase> {
    (
        (1usize..=40, 1usize..=10, any::<bool>()),
        dtype(),
        any::<(bool, bool, u64)>(),
    )
        .prop_map(|((t, c_full, long), dtype, (ranged, chunked, seed))| {
            // Some columns longer than the cpu backend's chunk of 2048 rows.
            let t = if long { t * 150 } else { t };
            let mut rng = SeededRng::new(seed);
            let values = (0..t * c_full)
                .map(|_| match rng.next_u64() % 8 {
                    0..=2 => 0.0,
                    3 => -0.0,
                    n => (n as f64 - 5.5).round() * 3.0,
                })
                .collect();
            let range = ranged.then(|| {
                let start = (rng.next_u64() % c_full as u64) as usize;
                (
                    start,
                    (rng.next_u64() % (c_full - start + 1) as u64) as usize,
                )
            });
            let divisors: Vec<usize> = (1..=t).filter(|d| t.is_multiple_of(*d)).collect();
            let chunk_size =
                chunked.then(|| divisors[(rng.next_u64() % divisors.len() as u64) as usize]);
            SearchCase {
                t,
                c_full,
                dtype,
                values,
                range,
                chunk_size,
            }
        })
}

#[derive(Clone, Debug)]
struct FlattenCase {
    e: usize,
    t: usize,
    f_len: usize,
    output_len: usize,
    dtype: DType,
    values: Vec<f64>,
    /// `row_offsets [N]`, and `row_offsets_start[0]` where given.
    offsets: Vec<i32>,
    start: Option<usize>,
    padding_val: Option<i32>,
}

impl FlattenCase {
    fn tensors(&self) -> (BTreeMap<String, Tensor>, Params) {
        let mut tensors = BTreeMap::from([
            (
                "input_tensor".to_owned(),
                tensor(self.dtype, &[self.e, self.t], &self.values),
            ),
            (
                "row_offsets".to_owned(),
                i32_tensor(&[self.offsets.len()], &self.offsets),
            ),
        ]);
        if let Some(start) = self.start {
            tensors.insert(
                "row_offsets_start".to_owned(),
                i32_tensor(&[1], &[start as i32]),
            );
        }
        let mut params = Params::default();
        params.set("f_len", &self.f_len.to_string()).unwrap();
        params
            .set("output_len", &self.output_len.to_string())
            .unwrap();
        if let Some(pad) = self.padding_val {
            params.set("padding_val", &pad.to_string()).unwrap();
        }
        (tensors, params)
    }

    /// `flattened_array`: for each output block, the last row with a block landing there.
    fn oracle(&self) -> Vec<f64> {
        let start = self.start.unwrap_or(0);
        let per_row = self.t / self.f_len;
        let pad = f64::from(self.padding_val.unwrap_or(-1));
        let mut out = Vec::new();
        for block in 0..(self.output_len / self.f_len) as i64 {
            let writer = (0..self.e).rev().find_map(|row| {
                let p = block - i64::from(self.offsets[start + row]);
                (0..per_row as i64)
                    .contains(&p)
                    .then_some((row, p as usize))
            });
            match writer {
                Some((row, p)) => {
                    let from = row * self.t + p * self.f_len;
                    out.extend_from_slice(&self.values[from..from + self.f_len]);
                }
                None => out.extend(std::iter::repeat_n(pad, self.f_len)),
            }
        }
        out
    }
}

fn flatten_case() -> impl Strategy<Value = FlattenCase> {
    (
        (1usize..=6, 1usize..=4, 1usize..=4, 0usize..=14),
        dtype(),
        any::<(bool, bool, u64)>(),
    )
        .prop_map(
            |((e, f_len, per_row, out_blocks), dtype, (started, padded, seed))| {
                let mut rng = SeededRng::new(seed);
                let t = f_len * per_row;
                let values = (0..e * t)
                    .map(|_| (rng.next_u64() % 41) as f64 - 20.0)
                    .collect();
                let start = started.then(|| (rng.next_u64() % 4) as usize);
                let n = start.map_or(e, |s| s + e + (rng.next_u64() % 3) as usize);
                // Offsets from before the start to past the end, overlapping one another.
                let offsets = (0..n)
                    .map(|_| (rng.next_u64() % (out_blocks as u64 + 6)) as i32 - 3)
                    .collect();
                let padding_val = padded.then(|| (rng.next_u64() % 11) as i32 - 5);
                FlattenCase {
                    e,
                    t,
                    f_len,
                    output_len: out_blocks * f_len,
                    dtype,
                    values,
                    offsets,
                    start,
                    padding_val,
                }
            },
        )
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn find_nonzero_indices_matches_the_oracle(c in search_case()) {
        let (tensors, params) = c.tensors();
        let (indices, counts) = c.oracle();
        let c_searched = counts.len();
        for backend in BACKENDS {
            let out = run(Kernel::FindNonzeroIndices, backend, &tensors, &params).unwrap();
            prop_assert_eq!(out["indices"].shape(), &[c_searched, c.t][..]);
            prop_assert_eq!(out["indices"].as_i32().unwrap(), &indices[..], "{}", backend);
            prop_assert_eq!(out["nonzero_counts"].as_i32().unwrap(), &counts[..]);
        }
    }

    #[test]
    fn indexed_flatten_matches_the_oracle(c in flatten_case()) {
        let (tensors, params) = c.tensors();
        let want = c.oracle();
        for backend in BACKENDS {
            let out = run(Kernel::IndexedFlatten, backend, &tensors, &params).unwrap();
            let flat = &out["flattened_array"];
            prop_assert_eq!(flat.shape(), &[c.output_len][..]);
            prop_assert_eq!(flat.dtype(), c.dtype);
            prop_assert_eq!(flat.to_f64_vec(), want.clone(), "{}", backend);
        }
    }

    #[test]
    fn cpu_results_do_not_depend_on_the_thread_count(
        search in search_case(),
        flatten in flatten_case(),
    ) {
        for (kernel, (tensors, params)) in [
            (Kernel::FindNonzeroIndices, search.tensors()),
            (Kernel::IndexedFlatten, flatten.tensors()),
        ] {
            let runs: Vec<BTreeMap<&str, Tensor>> = [1, 2, 3]
                .into_iter()
                .map(|threads| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    pool.install(|| run(kernel, BackendKind::Cpu, &tensors, &params).unwrap())
                })
                .collect();
            prop_assert!(runs[1] == runs[0] && runs[2] == runs[0]);
        }
    }

    /// The device's plan: `find_nonzero_indices` over the routed affinities `[T, E]`, then
    /// `indexed_flatten` of the token lists in blocks of B, each expert's ⌈count / B⌉ blocks
    /// after the previous experts', is `permute`'s `token_position_to_id` (−1 padding) over
    /// its used blocks.
    #[test]
    fn the_chained_subkernels_build_permutes_plan(
        routing in routing(),
        (e, k) in (1usize..=9).prop_flat_map(|e| (Just(e), 1..=e.min(4))),
        (b, blocks) in (1usize..=6, 1usize..=4),
        seed in any::<u64>(),
    ) {
        let t = b * blocks;
        let mut rng = SeededRng::new(seed);
        let index = expert_index(&mut rng, routing, t, e, k);
        let affinities: Vec<f64> = (0..t * k).map(|_| 0.5 + rng.values(1, 0.25)[0]).collect();
        let mut permute_params = Params::default();
        for (name, value) in [("num_experts", e), ("block_size", b)] {
            permute_params.set(name, &value.to_string()).unwrap();
        }
        permute_params.set("skip_token", "true").unwrap();
        let routed = BTreeMap::from([
            ("expert_index".to_owned(), i32_tensor(&[t, k], &index)),
            ("topk_affinities".to_owned(), f32_tensor(&[t, k], &affinities)),
        ]);
        for backend in BACKENDS {
            let plan = run(Kernel::Permute, backend, &routed, &permute_params).unwrap();
            let masked = plan["expert_affinities_masked"].clone().reshaped([t, e]).unwrap();
            let search = BTreeMap::from([("input_tensor".to_owned(), masked)]);
            let found = run(Kernel::FindNonzeroIndices, backend, &search, &Params::default())
                .unwrap();
            let counts = found["nonzero_counts"].as_i32().unwrap();
            prop_assert_eq!(counts, plan["expert_counts"].as_i32().unwrap());
            let mut offsets = Vec::new();
            let mut used = 0;
            for &count in counts {
                offsets.push(used as i32);
                used += (count as usize).div_ceil(b);
            }
            let flatten = BTreeMap::from([
                ("input_tensor".to_owned(), found["indices"].clone()),
                ("row_offsets".to_owned(), i32_tensor(&[e], &offsets)),
            ]);
            let mut params = Params::default();
            params.set("f_len", &b.to_string()).unwrap();
            params.set("output_len", &(used * b).to_string()).unwrap();
            let flat = run(Kernel::IndexedFlatten, backend, &flatten, &params).unwrap();
            let positions = plan["token_position_to_id"].as_i32().unwrap();
            prop_assert_eq!(
                flat["flattened_array"].as_i32().unwrap(),
                &positions[..used * b],
                "{}",
                backend
            );
        }
    }
}

/// Runs `kernel` on `tensors` and `params` with `edit` applied, on both backends; both must
/// fail with the same message, containing every one of `expected`.
type Edit<'a> = &'a dyn Fn(&mut BTreeMap<String, Tensor>, &mut Params);

fn fails(
    kernel: Kernel,
    (mut tensors, mut params): (BTreeMap<String, Tensor>, Params),
    edit: Edit<'_>,
    expected: &[&str],
) {
    edit(&mut tensors, &mut params);
    let messages: Vec<String> = BACKENDS
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
fn bad_search_inputs_are_errors_naming_what_is_wrong() {
    let case = SearchCase {
        t: 4,
        c_full: 3,
        dtype: DType::F32,
        values: (0..12).map(f64::from).collect(),
        range: Some((1, 2)),
        chunk_size: None,
    };
    let search = |edit: Edit<'_>, expected: &[&str]| {
        fails(Kernel::FindNonzeroIndices, case.tensors(), edit, expected)
    };
    search(&|t, _| drop(t.remove("input_tensor")), &["input_tensor"]);
    search(
        &|t, _| drop(t.remove("col_start_id")),
        &["n_cols", "col_start_id"],
    );
    search(&|_, p| p.n_cols = None, &["n_cols", "col_start_id"]);
    search(
        &|_, p| p.set("n_cols", "3").unwrap(),
        &["col_start_id", "C_full = 3"],
    );
    search(
        &|t, _| drop(t.insert("col_start_id".to_owned(), i32_tensor(&[1], &[-1]))),
        &["col_start_id", "-1"],
    );
    search(
        &|t, _| drop(t.insert("col_start_id".to_owned(), i32_tensor(&[2], &[0, 0]))),
        &["col_start_id", "[1]"],
    );
    search(
        &|_, p| p.set("chunk_size", "3").unwrap(),
        &["chunk_size", "T = 4"],
    );
    search(&|_, p| p.set("chunk_size", "0").unwrap(), &["chunk_size"]);
    search(
        &|t, _| drop(t.insert("input_tensor".to_owned(), f32_tensor(&[12], &[0.0; 12]))),
        &["input_tensor", "[T, C_full]", "[12]"],
    );
    search(
        &|t, _| {
            let values = [0.0, 1.0, f64::INFINITY, 0.0];
            drop(t.insert("input_tensor".to_owned(), f32_tensor(&[2, 2], &values)))
        },
        &["input_tensor", "non-finite", "[1, 0]"],
    );
    let mut params = Params::default();
    let error = params.set("index_dtype", "int64").unwrap_err().to_string();
    assert!(
        error.contains("index_dtype") && error.contains("int32"),
        "{error}"
    );
    params.set("index_dtype", "int32").unwrap();
}

#[test]
fn bad_flatten_inputs_are_errors_naming_what_is_wrong() {
    let case = FlattenCase {
        e: 2,
        t: 4,
        f_len: 2,
        output_len: 8,
        dtype: DType::I32,
        values: (0..8).map(f64::from).collect(),
        offsets: vec![0, 1, 2],
        start: Some(1),
        padding_val: None,
    };
    let flatten = |edit: Edit<'_>, expected: &[&str]| {
        fails(Kernel::IndexedFlatten, case.tensors(), edit, expected)
    };
    flatten(&|t, _| drop(t.remove("input_tensor")), &["input_tensor"]);
    flatten(&|t, _| drop(t.remove("row_offsets")), &["row_offsets"]);
    flatten(&|_, p| p.f_len = None, &["f_len", "required"]);
    flatten(&|_, p| p.output_len = None, &["output_len", "required"]);
    flatten(&|_, p| p.set("f_len", "3").unwrap(), &["f_len", "T = 4"]);
    flatten(&|_, p| p.set("f_len", "0").unwrap(), &["f_len"]);
    flatten(
        &|_, p| p.set("output_len", "7").unwrap(),
        &["f_len", "output_len = 7"],
    );
    // Without row_offsets_start, N must be E.
    flatten(
        &|t, _| drop(t.remove("row_offsets_start")),
        &["row_offsets", "N = E = 2"],
    );
    flatten(
        &|t, _| drop(t.insert("row_offsets_start".to_owned(), i32_tensor(&[1], &[2]))),
        &["row_offsets_start", "N = 3"],
    );
    flatten(
        &|t, _| drop(t.insert("row_offsets_start".to_owned(), i32_tensor(&[1], &[-1]))),
        &["row_offsets_start"],
    );
    flatten(
        &|t, _| drop(t.insert("row_offsets".to_owned(), f32_tensor(&[3], &[0.0; 3]))),
        &["row_offsets", "i32"],
    );
    // An output too large to allocate is an error naming it.
    flatten(
        &|_, p| p.set("output_len", &(usize::MAX - 1).to_string()).unwrap(),
        &["flattened_array"],
    );
    let error = Params::default()
        .set("padding_val", "1.5")
        .unwrap_err()
        .to_string();
    assert!(error.contains("padding_val"), "{error}");
}
