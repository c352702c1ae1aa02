//! Criterion benchmarks of the `cpu` backend: every kernel of one MoE layer, forward and
//! backward, at the tiny shape and at Qwen3-30B-A3B with T = 512 (f32 and bf16 storage); and
//! the blockwise calls' validation at the trainer's small layer.
//!
//! `cargo bench -p moekit-tools --bench kernels`. `moekit bench` reports the same kernels against the machine's
//! measured limits; BENCHMARKS.md records both.

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use moekit::contracts::{BlockwiseMmBwd, OutputDType, WeightLayout};
use moekit::experts::{Experts, LocalExperts};
use moekit::{Backend, BackendKind, DType};
use moekit_tools::layer::{Layer, LayerInputs, MoeShape};

fn layer_kernels(c: &mut Criterion) {
    // As the `moekit` binary does: freed outputs are reused rather than faulted in again.
    moekit::memory::retain_freed_buffers();
    let backend = BackendKind::Cpu.create();
    let backend: &dyn Backend = backend.as_ref();
    for (shape, tokens, dtype) in [
        ("tiny", 512, DType::F32),
        ("qwen3-30b-a3b", 512, DType::F32),
        ("qwen3-30b-a3b", 512, DType::BF16),
    ] {
        let shape: MoeShape = shape.parse().expect("known shape");
        let inputs = LayerInputs::new(shape, tokens, dtype, 128).expect("inputs");
        let layer = Layer::new(backend, inputs).expect("routed layer");
        let mut group = c.benchmark_group(format!("{}/T={tokens}/{dtype}", shape.name));
        group.sample_size(10);

        let call = layer.inputs.router_topk().expect("valid");
        group.bench_function("router_topk", |b| b.iter(|| backend.router_topk(&call)));
        let call = layer.router_topk_bwd().expect("valid");
        group.bench_function("router_topk_bwd", |b| {
            b.iter(|| backend.router_topk_bwd(&call))
        });
        let call = layer.load_balancing_loss().expect("valid");
        group.bench_function("load_balancing_loss", |b| {
            b.iter(|| backend.load_balancing_loss(&call))
        });
        let call = layer.load_balancing_loss_bwd().expect("valid");
        group.bench_function("load_balancing_loss_bwd", |b| {
            b.iter(|| backend.load_balancing_loss_bwd(&call))
        });
        let call = layer.permute().expect("valid");
        group.bench_function("permute", |b| b.iter(|| backend.permute(&call)));
        let call = layer.permute_bwd().expect("valid");
        group.bench_function("permute_bwd", |b| b.iter(|| backend.permute_bwd(&call)));
        let call = layer.blockwise_mm().expect("valid");
        group.bench_function("blockwise_mm", |b| b.iter(|| backend.blockwise_mm(&call)));
        let call = layer.blockwise_mm_bwd().expect("valid");
        group.bench_function("blockwise_mm_bwd", |b| {
            b.iter(|| backend.blockwise_mm_bwd(&call))
        });
        group.finish();
    }
}

/// What the trainer's experts check per layer (the small config: qwen3-moe-small, T = 8 × 256
/// tokens): the forward's validation, and the backward's, in full or after its validated forward
/// (`BlockwiseMmBwd::of_forward`, what `moekit::experts` runs).
fn validation(c: &mut Criterion) {
    let backend: Arc<dyn Backend> = Arc::from(BackendKind::Cpu.create());
    let shape: MoeShape = "qwen3-moe-small".parse().expect("known shape");
    let inputs = LayerInputs::new(shape, 2048, DType::F32, 128).expect("inputs");
    let layer = Layer::new(backend.as_ref(), inputs).expect("routed layer");
    let mut group = c.benchmark_group("validation/qwen3-moe-small/T=2048/f32");
    group.bench_function("blockwise_mm", |b| b.iter(|| layer.blockwise_mm()));
    group.bench_function("blockwise_mm_bwd, in full", |b| {
        b.iter(|| layer.blockwise_mm_bwd())
    });
    let forward = layer.blockwise_mm().expect("valid");
    let added = layer.blockwise_mm_bwd_added().expect("checkpoints");
    group.bench_function("blockwise_mm_bwd, after its forward", |b| {
        b.iter(|| BlockwiseMmBwd::of_forward(&forward, added, false))
    });
    group.finish();

    // The experts' backward as the trainer ran it before `moekit::experts` (the full
    // validation, the padded layout) and as it runs it now.
    let mut group = c.benchmark_group("experts backward/qwen3-moe-small/T=2048/f32");
    group.sample_size(20);
    group.bench_function("blockwise_mm_bwd::new + kernel", |b| {
        b.iter(|| backend.blockwise_mm_bwd(&layer.blockwise_mm_bwd().expect("valid")))
    });
    let experts = LocalExperts {
        backend: Arc::clone(&backend),
        block_size: 128,
        output_dtype: OutputDType::Input,
        weight_layout: WeightLayout::Nki,
    };
    let inputs = layer.experts_inputs();
    let (_, saved) = experts.forward(inputs, true).expect("forward");
    let saved = saved.expect("recorded");
    let d_output = layer.experts_output_grad().expect("[T, H]");
    group.bench_function("LocalExperts::backward", |b| {
        b.iter(|| experts.backward(inputs, &saved, &d_output))
    });
    group.finish();
}

criterion_group!(benches, layer_kernels, validation);
criterion_main!(benches);
