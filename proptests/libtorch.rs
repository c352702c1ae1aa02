//! The libtorch peers of the benchmarks (feature `libtorch`): every expert path computes the
//! same layer as `blockwise_mm`, and `moekit bench` reports them beside its own rows.

mod common;

use std::process::Command;

use common::*;
use moekit::bench::{Layer, LayerInputs, MoeShape, libtorch};
use moekit::{BackendKind, DType};

#[test]
fn every_expert_path_computes_the_blockwise_mm_output() {
    let cpu = BackendKind::Cpu.create();
    for tokens in [1, 7, 64] {
        let shape: MoeShape = "tiny".parse().unwrap();
        let layer = Layer::new(
            cpu.as_ref(),
            LayerInputs::new(shape, tokens, DType::F32, 4).unwrap(),
        )
        .unwrap();
        let ours = layer.checkpoints.output.to_f64_vec();
        let outputs = libtorch::expert_outputs(&layer.inputs, &layer.routed);
        assert_eq!(
            outputs.len(),
            2,
            "both the loop and torch._grouped_mm run on CPU"
        );
        for (name, theirs) in outputs {
            let theirs: Vec<f64> = theirs.iter().map(|&v| f64::from(v)).collect();
            assert_close(name, &theirs, &ours, 1e-4, 1e-4 * scale(&ours))
                .unwrap_or_else(|e| panic!("T={tokens}: {e}"));
        }
    }
}

#[test]
fn bench_reports_libtorch_times_and_ratios() {
    let out = Command::new(env!("CARGO_BIN_EXE_moekit"))
        .args([
            "bench",
            "--shape",
            "tiny",
            "--tokens",
            "32",
            "--min-time-ms",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    for kernel in [
        "router_topk",
        "router_topk_bwd",
        "permute",
        "blockwise_mm",
        "blockwise_mm_bwd",
        "moe_layer_fwd_bwd",
    ] {
        let row = text
            .lines()
            .find(|l| l.contains(&format!("\"kernel\":\"{kernel}\"")))
            .unwrap_or_else(|| panic!("no row for {kernel}"));
        assert!(!row.contains("\"libtorch_ms\":null"), "{row}");
        assert!(!row.contains("\"vs_libtorch\":null"), "{row}");
    }
}
