//! Trainium2's limits: a NeuronCore's documented throughput ([`NEURONCORE_V3`]), and
//! nki-library's hardware limits on the shapes its MoE kernels take (as its kernels assert them
//! at tag 2.29), checked against a manifest entry's shape. The shape limits are warnings about a
//! NEFF's shapes, not rules of moekit's contracts: the host backends take any shape.

use super::manifest::{Entry, Value, ValueKind, implied_default};
use crate::backend::AcceleratorLimits;
use crate::kernel::Kernel;

/// One Trainium2 NeuronCore-v3 as the Neuron documentation states it, not measured: 79 dense
/// bf16 TFLOP/s (the 128×128 TensorEngine at 2.4 GHz) and an eighth of the chip's 2.9 TB/s HBM
/// bandwidth.
pub const NEURONCORE_V3: AcceleratorLimits = AcceleratorLimits {
    name: "one Trainium2 NeuronCore-v3",
    peak_dtype: "bf16",
    peak_gflops: 79_000.0,
    memory_gbps: 2_900.0 / 8.0,
};

/// One limit: the manifest key it reads, whether a value passes, and what nki-library needs.
struct Limit {
    key: &'static str,
    passes: fn(usize) -> bool,
    needs: &'static str,
}

const ROUTER_TOPK: &[Limit] = &[
    Limit {
        key: "k",
        passes: |k| k <= 8,
        needs: "k ≤ 8",
    },
    Limit {
        key: "e",
        passes: |e| e <= 512,
        needs: "E ≤ 512",
    },
    Limit {
        key: "h",
        passes: |h| h % 128 == 0,
        needs: "H a multiple of 128",
    },
];

const MOE_CTE: &[Limit] = &[
    Limit {
        key: "h",
        passes: |h| (512..=8192).contains(&h),
        needs: "512 ≤ H ≤ 8192",
    },
    Limit {
        key: "i",
        passes: |i| i % 16 == 0,
        needs: "I a multiple of 16",
    },
    Limit {
        key: "block_size",
        passes: |b| b % 256 == 0,
        needs: "block_size a multiple of 256 (shard_on_I)",
    },
];

const BLOCKWISE_MM_BWD: &[Limit] = &[Limit {
    key: "block_size",
    passes: |b| matches!(b, 128 | 256 | 512 | 1024),
    needs: "block_size 128, 256, 512 or 1024",
}];

const MOE_TKG: &[Limit] = &[
    Limit {
        key: "t",
        passes: |t| t <= 128,
        needs: "T ≤ 128 (more only in its MX all-expert kernel)",
    },
    Limit {
        key: "k",
        passes: |k| k <= 16,
        needs: "k ≤ 16",
    },
    Limit {
        key: "h",
        passes: |h| h % 128 == 0,
        needs: "H a multiple of 128 (of 256 where its two cores split H)",
    },
];

const RMSNORM_ROUTER_TOPK_TKG: &[Limit] = &[
    Limit {
        key: "top_k",
        passes: |k| k <= 8,
        needs: "top_k ≤ 8",
    },
    Limit {
        key: "e",
        passes: |e| e <= 512,
        needs: "E ≤ 512",
    },
    Limit {
        key: "h",
        passes: |h| h % 128 == 0,
        needs: "H a multiple of 128",
    },
    Limit {
        key: "t",
        passes: |t| t % 128 == 0,
        needs: "T a multiple of 128 (of 256 where its two cores split T) without MX quantisation",
    },
];

const MOE_BLOCK_TKG: &[Limit] = &[
    Limit {
        key: "t",
        passes: |t| t <= 128,
        needs: "T ≤ 128 (more only with MX weights in all-expert mode)",
    },
    Limit {
        key: "top_k",
        passes: |k| k <= 8,
        needs: "top_k ≤ 8",
    },
    Limit {
        key: "e",
        passes: |e| e <= 512,
        needs: "E ≤ 512",
    },
    Limit {
        key: "h",
        passes: |h| h % 256 == 0,
        needs: "H a multiple of 256 (of 128 in its bf16 all-expert mode)",
    },
];

const TOPK: &[Limit] = &[Limit {
    key: "v",
    passes: |v| v <= 1 << 24,
    needs: "V ≤ 2^24 (it tracks positions in f32, exact to 2^24)",
}];

const TOPK_REDUCE: &[Limit] = &[
    Limit {
        key: "t",
        passes: |t| (2..=128).contains(&t),
        needs: "1 < T ≤ 128",
    },
    Limit {
        key: "k",
        passes: |k| k <= 8,
        needs: "K ≤ 8",
    },
    Limit {
        key: "h",
        passes: |h| h % 2 == 0,
        needs: "H even",
    },
    Limit {
        key: "tk_padded",
        passes: |rows| (8..=16384).contains(&rows),
        needs: "8 ≤ TK_padded ≤ 16384",
    },
];

const FIND_NONZERO_INDICES: &[Limit] = &[
    Limit {
        key: "t",
        passes: |t| t % 128 == 0,
        needs: "T a multiple of 128 (as its chunk_size, T by default, must be)",
    },
    Limit {
        key: "n_cols",
        passes: |c| c % 2 == 0,
        needs: "the columns searched (n_cols, or C_full) even (its two cores split them)",
    },
];

const INDEXED_FLATTEN: &[Limit] = &[Limit {
    key: "output_len",
    passes: |len| len % 128 == 0,
    needs: "output_len a multiple of 128",
}];

/// The limits `entry`'s shape breaks, each as a sentence naming the key, its value and what
/// nki-library's kernel needs. A key the entry leaves out is checked at the default the entry
/// then implies (`find_nonzero_indices`' `n_cols`: C_full), else not at all.
pub fn broken_limits(entry: &Entry) -> Vec<String> {
    let limits = match entry.kernel {
        Kernel::RouterTopk => ROUTER_TOPK,
        Kernel::BlockwiseMm => MOE_CTE,
        Kernel::BlockwiseMmBwd => BLOCKWISE_MM_BWD,
        Kernel::MoeTkg => MOE_TKG,
        Kernel::RmsNormRouterTopkTkg => RMSNORM_ROUTER_TOPK_TKG,
        Kernel::MoeBlockTkg => MOE_BLOCK_TKG,
        Kernel::Topk => TOPK,
        Kernel::TopkReduce => TOPK_REDUCE,
        Kernel::FindNonzeroIndices => FIND_NONZERO_INDICES,
        Kernel::IndexedFlatten => INDEXED_FLATTEN,
        _ => &[],
    };
    // `what` is the key and its value, e.g. "`t` = 5".
    let broken = |what: String, needs: &str| {
        format!(
            "{what}: nki-library's {} needs {needs} on Trainium2",
            entry.kernel.name()
        )
    };
    limits
        .iter()
        .filter_map(|limit| {
            let (value, implied) = match entry.params.get(limit.key) {
                Some(value) => (value.clone(), ""),
                None => {
                    // The entry's keys, as a call's, for a default that depends on another.
                    let set: Vec<(&str, Value)> = entry
                        .params
                        .iter()
                        .map(|(name, value)| (name.as_str(), value.clone()))
                        .collect();
                    let value = implied_default(entry.kernel, limit.key, ValueKind::Int, &set)?;
                    (value, " (by default)")
                }
            };
            match value {
                Value::Int(value) if !(limit.passes)(value) => Some(broken(
                    format!("`{}` = {value}{implied}", limit.key),
                    limit.needs,
                )),
                _ => None,
            }
        })
        .chain(indexed_flatten_blocks(entry).map(|blocks| {
            broken(
                format!("`t` / `f_len` = {blocks}"),
                "T / f_len (each row's blocks) a multiple of 16",
            )
        }))
        .collect()
}

/// `indexed_flatten`'s blocks per row, T / f_len, where the entry sets both, f_len divides T
/// and nki-library's kernel would refuse the count (it needs a multiple of 16).
fn indexed_flatten_blocks(entry: &Entry) -> Option<usize> {
    if entry.kernel != Kernel::IndexedFlatten {
        return None;
    }
    let (Some(&Value::Int(t)), Some(&Value::Int(f_len))) =
        (entry.params.get("t"), entry.params.get("f_len"))
    else {
        return None;
    };
    let blocks = t / f_len;
    (t % f_len == 0 && blocks % 16 != 0).then_some(blocks)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn entry(kernel: Kernel, params: &[(&str, usize)]) -> Entry {
        Entry {
            kernel,
            neff: "k.neff".into(),
            params: params
                .iter()
                .map(|&(key, value)| (key.to_owned(), Value::Int(value)))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn shapes_past_nki_librarys_limits_are_named_and_others_pass() {
        let qwen3 = entry(
            Kernel::RouterTopk,
            &[("t", 512), ("h", 2048), ("e", 128), ("k", 8)],
        );
        assert!(broken_limits(&qwen3).is_empty());
        let wide = entry(Kernel::RouterTopk, &[("h", 100), ("e", 1024), ("k", 9)]);
        let broken = broken_limits(&wide);
        assert_eq!(broken.len(), 3, "{broken:?}");
        assert!(broken[0].contains("`k` = 9") && broken[0].contains("k ≤ 8"));
        assert!(broken[1].contains("`e` = 1024") && broken[1].contains("E ≤ 512"));
        assert!(broken[2].contains("`h` = 100") && broken[2].contains("multiple of 128"));

        let cte = entry(
            Kernel::BlockwiseMm,
            &[("h", 2048), ("i", 768), ("block_size", 512)],
        );
        assert!(broken_limits(&cte).is_empty());
        let small = entry(
            Kernel::BlockwiseMm,
            &[("h", 64), ("i", 20), ("block_size", 4)],
        );
        assert_eq!(broken_limits(&small).len(), 3);
        let bwd = entry(Kernel::BlockwiseMmBwd, &[("block_size", 2048)]);
        assert!(broken_limits(&bwd)[0].contains("128, 256, 512 or 1024"));
        // Keys the entry leaves out are not checked.
        assert!(broken_limits(&entry(Kernel::BlockwiseMm, &[])).is_empty());
    }

    #[test]
    fn the_plan_and_selection_kernels_limits_read_implied_defaults_and_derived_sizes() {
        let reduce = entry(
            Kernel::TopkReduce,
            &[("t", 128), ("h", 2048), ("k", 8), ("tk_padded", 16384)],
        );
        assert!(broken_limits(&reduce).is_empty());
        let reduce = entry(
            Kernel::TopkReduce,
            &[("t", 1), ("h", 3), ("k", 9), ("tk_padded", 16385)],
        );
        assert_eq!(broken_limits(&reduce).len(), 4);
        // n_cols left out is C_full: checked at that value, and said to be the default.
        let nonzero = entry(Kernel::FindNonzeroIndices, &[("t", 256), ("c_full", 5)]);
        let broken = broken_limits(&nonzero);
        assert_eq!(broken.len(), 1, "{broken:?}");
        assert!(
            broken[0].starts_with("`n_cols` = 5 (by default): "),
            "{broken:?}"
        );
        let window = entry(
            Kernel::FindNonzeroIndices,
            &[("t", 256), ("c_full", 5), ("n_cols", 4)],
        );
        assert!(broken_limits(&window).is_empty());
        // T / f_len blocks per row, where f_len divides T.
        let flatten = |t| {
            entry(
                Kernel::IndexedFlatten,
                &[("t", t), ("f_len", 4), ("output_len", 128)],
            )
        };
        assert!(broken_limits(&flatten(64)).is_empty());
        assert!(broken_limits(&flatten(32))[0].starts_with("`t` / `f_len` = 8: "));
        assert!(broken_limits(&flatten(30)).is_empty());
        let topk = |v| entry(Kernel::Topk, &[("rows", 1), ("v", v), ("k", 1)]);
        assert!(broken_limits(&topk(1 << 24)).is_empty());
        assert_eq!(broken_limits(&topk((1 << 24) + 1)).len(), 1);
    }
}
