//! The libtorch peers of the benchmarks (feature `libtorch`): every expert path computes the
//! same layer as `blockwise_mm`, and `moekit bench` reports them beside its own rows; tensors
//! cross between moekit and libtorch unchanged.

mod common;

use std::process::Command;

use common::*;
use half::bf16;
use moekit::{BackendKind, DType, Storage, Tensor};
use moekit_tools::bench::libtorch;
use moekit_tools::layer::{Layer, LayerInputs, MoeShape};
use moekit_tools::torch::{borrow_as_tch, from_tch, lend_to_moekit, to_tch};
use tch::Kind;

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
        // `output [T+1, H]` without its padding row.
        let mut ours = layer.checkpoints.output.to_f64_vec();
        ours.truncate(tokens * shape.h);
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
        "experts_fwd_bwd",
    ] {
        let row = text
            .lines()
            .find(|l| l.contains(&format!("\"kernel\":\"{kernel}\"")))
            .unwrap_or_else(|| panic!("no row for {kernel}"));
        assert!(!row.contains("\"libtorch_ms\":null"), "{row}");
        assert!(!row.contains("\"vs_libtorch\":null"), "{row}");
    }
}

#[test]
fn tensors_cross_to_libtorch_and_back_unchanged() {
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 4.0).collect();
    let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    let ids: Vec<i32> = (0..24).map(|i| i * 5 - 60).collect();
    for (tensor, kind) in [
        (
            Tensor::from_f32([2, 3, 4], values.clone()).unwrap(),
            Kind::Float,
        ),
        (Tensor::from_bf16([4, 6], halves).unwrap(), Kind::BFloat16),
        (Tensor::from_i32([24], ids).unwrap(), Kind::Int),
    ] {
        let copied = to_tch(&tensor);
        // SAFETY: `borrowed` and everything made from it are dropped within this iteration,
        // while `tensor` lives unchanged.
        let borrowed = unsafe { borrow_as_tch(&tensor) };
        for theirs in [&copied, &borrowed] {
            assert_eq!(theirs.kind(), kind);
            let shape: Vec<i64> = tensor.shape().iter().map(|&d| d as i64).collect();
            assert_eq!(theirs.size(), shape);
            assert!(theirs.is_contiguous());
            // libtorch's own reading of each element, against moekit's.
            for (index, want) in tensor.to_f64_vec().into_iter().enumerate() {
                let got = theirs.reshape([-1]).double_value(&[index as i64]);
                assert_eq!(got, want, "{kind:?} element {index}");
            }
            let back = from_tch("x", theirs).unwrap();
            assert_eq!(back.shape(), tensor.shape());
            assert_eq!(back.storage(), tensor.storage());
        }
        // The copy has its own memory; the borrowed tensor reads moekit's.
        let ours = match tensor.storage() {
            Storage::F32(v) => v.as_ptr() as usize,
            Storage::BF16(v) => v.as_ptr() as usize,
            Storage::I32(v) => v.as_ptr() as usize,
        };
        assert_eq!(borrowed.data_ptr() as usize, ours);
        assert_ne!(copied.data_ptr() as usize, ours);
    }
}

#[test]
fn views_with_strides_and_offsets_are_read_in_logical_order() {
    let base = tch::Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).reshape([4, 6]);
    // A transposed view of rows 1..3: strides (1, 6), storage offset 6.
    let view = base.narrow(0, 1, 2).transpose(0, 1);
    let ours = from_tch("view", &view).unwrap();
    assert_eq!(ours.shape(), &[6, 2]);
    let want: Vec<f32> = (0..6)
        .flat_map(|c| [6.0 + c as f32, 12.0 + c as f32])
        .collect();
    assert_eq!(ours.storage(), &Storage::F32(want.into()));
    // A contiguous view that starts inside its storage (offset 12) is read from its start.
    let tail = from_tch("tail", &base.narrow(0, 2, 2)).unwrap();
    let want: Vec<f32> = (12..24).map(|v| v as f32).collect();
    assert_eq!(tail.storage(), &Storage::F32(want.into()));
    let empty = from_tch("empty", &base.narrow(0, 0, 0)).unwrap();
    assert_eq!(empty.shape(), &[0, 6]);
}

/// Whether the tensor reads memory lent by libtorch.
fn is_lent(tensor: &Tensor) -> bool {
    match tensor.storage() {
        Storage::F32(v) => v.is_lent(),
        Storage::BF16(v) => v.is_lent(),
        Storage::I32(v) => v.is_lent(),
    }
}

#[test]
fn contiguous_cpu_tensors_are_lent_in_place_and_others_copied() {
    let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.37 - 4.0).collect();
    let theirs = tch::Tensor::from_slice(&values).reshape([4, 6]);
    let address = theirs.data_ptr() as usize;
    let copied = from_tch("x", &theirs).unwrap();
    // SAFETY: nothing writes to `theirs` (or any tensor sharing its storage) in this test.
    let lent = unsafe { lend_to_moekit("x", &theirs) }.unwrap();
    drop(theirs);
    assert!(is_lent(&lent) && !is_lent(&copied));
    assert_eq!(lent.as_f32().unwrap().as_ptr() as usize, address);
    // The loan outlives the libtorch tensor it came from, and reads as the copy does.
    assert_eq!(lent, copied);
    assert_eq!(lent.shape(), &[4, 6]);
    assert_eq!(lent.clone(), copied);

    let halves = tch::Tensor::from_slice(&values).to_kind(Kind::BFloat16);
    let ids = tch::Tensor::from_slice(&[3i32, -1, 7]);
    // SAFETY: as above.
    let (halves_lent, ids_lent) =
        unsafe { (lend_to_moekit("h", &halves), lend_to_moekit("ids", &ids)) };
    let (halves_lent, ids_lent) = (halves_lent.unwrap(), ids_lent.unwrap());
    assert!(is_lent(&halves_lent) && is_lent(&ids_lent));
    assert_eq!(halves_lent, from_tch("h", &halves).unwrap());
    assert_eq!(ids_lent.as_i32(), Some(&[3, -1, 7][..]));

    // A strided view, an i64 index and an empty tensor are converted as `from_tch` does.
    let base = tch::Tensor::from_slice(&values).reshape([4, 6]);
    let view = base.narrow(0, 1, 2).transpose(0, 1);
    let wide = tch::Tensor::from_slice(&[5i64, 2]);
    let empty = base.narrow(0, 0, 0);
    for (name, tensor) in [("view", &view), ("wide", &wide), ("empty", &empty)] {
        // SAFETY: as above.
        let ours = unsafe { lend_to_moekit(name, tensor) }.unwrap();
        assert!(!is_lent(&ours), "{name}");
        assert_eq!(ours, from_tch(name, tensor).unwrap(), "{name}");
    }
    // SAFETY: as above.
    let err = unsafe { lend_to_moekit("d", &tch::Tensor::from_slice(&[1.0f64])) }.unwrap_err();
    assert!(err.to_string().contains("Double"), "{err}");
}

#[test]
fn indices_outside_i32_and_foreign_dtypes_are_named_errors() {
    let wide = tch::Tensor::from_slice(&[1i64, 1 << 40]);
    let err = from_tch("expert_index", &wide).unwrap_err().to_string();
    assert!(err.contains("expert_index") && err.contains("i32"), "{err}");
    let ok = from_tch("expert_index", &tch::Tensor::from_slice(&[3i64, -1])).unwrap();
    assert_eq!(ok.storage(), &Storage::I32(vec![3, -1].into()));
    let doubles = tch::Tensor::from_slice(&[1.0f64]);
    let err = from_tch("hidden_states", &doubles).unwrap_err().to_string();
    assert!(
        err.contains("hidden_states") && err.contains("Double"),
        "{err}"
    );
}
