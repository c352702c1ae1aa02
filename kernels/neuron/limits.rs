//! Trainium2's limits: a NeuronCore's documented throughput ([`NEURONCORE_V3`]), and
//! nki-library's hardware limits on the shapes its MoE kernels take (as its kernels assert them
//! at tag 2.29), checked against a manifest entry's shape. The shape limits are warnings about a
//! NEFF's shapes, not rules of moekit's contracts: the host backends take any shape.

use super::manifest::{Entry, Value};
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

/// The limits `entry`'s shape breaks, each as a sentence naming the key, its value and what
/// nki-library's kernel needs. Keys the entry leaves out are not checked.
pub fn broken_limits(entry: &Entry) -> Vec<String> {
    let limits = match entry.kernel {
        Kernel::RouterTopk => ROUTER_TOPK,
        Kernel::BlockwiseMm => MOE_CTE,
        Kernel::BlockwiseMmBwd => BLOCKWISE_MM_BWD,
        Kernel::MoeTkg => MOE_TKG,
        Kernel::RmsNormRouterTopkTkg => RMSNORM_ROUTER_TOPK_TKG,
        Kernel::MoeBlockTkg => MOE_BLOCK_TKG,
        _ => &[],
    };
    limits
        .iter()
        .filter_map(|limit| match entry.params.get(limit.key) {
            Some(&Value::Int(value)) if !(limit.passes)(value) => Some(format!(
                "`{}` = {value}: nki-library's {} needs {} on Trainium2",
                limit.key,
                entry.kernel.name(),
                limit.needs
            )),
            _ => None,
        })
        .collect()
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
}
