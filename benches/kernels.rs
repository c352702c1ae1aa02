//! Criterion benchmarks of the `cpu` backend: every kernel of one MoE layer, forward and
//! backward, at the tiny shape and at Qwen3-30B-A3B with T = 512 (f32 and bf16 storage).
//!
//! `cargo bench --bench kernels`. `moekit bench` reports the same kernels against the machine's
//! measured limits; BENCHMARKS.md records both.

use criterion::{Criterion, criterion_group, criterion_main};
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

criterion_group!(benches, layer_kernels);
criterion_main!(benches);
