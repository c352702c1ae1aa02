//! The machine's own limits, measured: the f32 FMA peak of all cores and the streaming memory
//! bandwidth. Benchmarks report their throughput as a share of these.

use std::hint::black_box;
use std::time::Instant;

use moekit::backend::Device;
use moekit::cpu::isa::Isa;
use rayon::prelude::*;

/// Limits of the device a benchmark runs on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MachineLimits {
    /// f32 FMA peak of all threads of the current rayon pool, GFLOP/s (one FMA = 2 FLOP); on an
    /// accelerator its documented peak.
    pub fma_gflops: f64,
    /// STREAM-triad bandwidth (`a = b + s·c`, 12 bytes per f32 element), GB/s; on an
    /// accelerator its documented memory bandwidth.
    pub stream_gbps: f64,
    /// Threads both were measured with.
    pub threads: usize,
    pub device: Device,
}

impl MachineLimits {
    /// The limits of `device`: measured on the host (about a second), documented for an
    /// accelerator.
    pub fn of(device: Device) -> Self {
        match device {
            Device::Host => Self::measure(),
            Device::Accelerator(limits) => Self {
                fma_gflops: limits.peak_gflops,
                stream_gbps: limits.memory_gbps,
                threads: 1,
                device,
            },
        }
    }

    /// Measures both limits of the host (about a second).
    pub fn measure() -> Self {
        Self {
            fma_gflops: fma_peak_gflops(),
            stream_gbps: stream_triad_gbps(),
            threads: rayon::current_num_threads(),
            device: Device::Host,
        }
    }

    /// The higher of two measurements of each limit. On a virtual machine a limit can read low
    /// when the host briefly shares a core; the higher reading is the machine's capability.
    pub fn max(self, other: Self) -> Self {
        Self {
            fma_gflops: self.fma_gflops.max(other.fma_gflops),
            stream_gbps: self.stream_gbps.max(other.stream_gbps),
            threads: self.threads.max(other.threads),
            device: self.device,
        }
    }
}

/// Independent accumulator chains: enough to cover FMA latency × issue width on current cores,
/// few enough to stay in registers (16 spilled one chain to the stack and lost a third).
const CHAINS: usize = 12;
/// FMA steps per chain per call.
const STEPS: usize = 1 << 22;

/// FLOP performed by one call of a kernel: chains × steps × lanes × 2.
fn flop(lanes: usize) -> f64 {
    (CHAINS * STEPS * lanes * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{CHAINS, STEPS};

    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_avx512(seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        let a = _mm512_set1_ps(0.999_999);
        let b = _mm512_set1_ps(1e-7);
        for _ in 0..STEPS {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_avx2(seed: f32) -> f32 {
        let mut acc = [_mm256_set1_ps(seed); CHAINS];
        let a = _mm256_set1_ps(0.999_999);
        let b = _mm256_set1_ps(1e-7);
        for _ in 0..STEPS {
            for v in acc.iter_mut() {
                *v = _mm256_fmadd_ps(*v, a, b);
            }
        }
        let mut lanes = [0.0f32; 8];
        let mut total = 0.0;
        for v in acc {
            // SAFETY: `lanes` holds exactly the 8 f32 that one unaligned store writes.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
            total += lanes.iter().sum::<f32>();
        }
        total
    }
}

/// One thread's FMA run: `(flop, result)` on the widest FMA the CPU has.
fn fma_one_thread(seed: f32) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        if Isa::detected() >= Isa::Avx512 {
            // SAFETY: AVX-512 F was detected on this CPU.
            return (flop(16), unsafe { x86::fma_avx512(seed) });
        }
        if Isa::detected() >= Isa::Avx2 {
            // SAFETY: AVX2 and FMA were detected on this CPU.
            return (flop(8), unsafe { x86::fma_avx2(seed) });
        }
    }
    let mut acc = [seed; CHAINS];
    for _ in 0..STEPS {
        for v in acc.iter_mut() {
            *v = v.mul_add(0.999_999, 1e-7);
        }
    }
    (flop(1), acc.iter().sum())
}

/// f32 FMA peak over every thread of the current rayon pool (each thread runs the loop once,
/// concurrently), best of five runs, GFLOP/s.
pub fn fma_peak_gflops() -> f64 {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            let flop: f64 = rayon::broadcast(|ctx| {
                let (flop, result) = fma_one_thread(black_box(1.0 + ctx.index() as f32));
                black_box(result);
                flop
            })
            .into_iter()
            .sum();
            flop / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

/// STREAM triad over arrays far larger than the caches (each at least 128 MiB and twice the
/// last-level cache), best of five runs, GB/s.
pub fn stream_triad_gbps() -> f64 {
    const MIN_LEN: usize = 1 << 25;
    const CHUNK: usize = 1 << 16;
    let len =
        usize::try_from(super::cold::eviction_bytes() / 4).map_or(MIN_LEN, |l| l.max(MIN_LEN));
    let b = vec![1.0f32; len];
    let c = vec![2.0f32; len];
    let mut a = vec![0.0f32; len];
    (0..5)
        .map(|_| {
            let start = Instant::now();
            a.par_chunks_mut(CHUNK)
                .zip(b.par_chunks(CHUNK))
                .zip(c.par_chunks(CHUNK))
                .for_each(|((a, b), c)| {
                    for ((a, &b), &c) in a.iter_mut().zip(b).zip(c) {
                        *a = b + 3.0 * c;
                    }
                });
            black_box(&a);
            (len * 12) as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}
