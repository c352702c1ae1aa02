//! Short measurements, run once per process, for the choices a CPU's reported features do not
//! decide: whether AVX-512 BF16 pair dot products (`vdpbf16ps`, two bf16 multiply-adds per f32
//! lane) outrun f32 FMAs on bf16 data widened first. On Zen 4 they do 2.0× the multiply-adds
//! per second; on an Intel Emerald Rapids VM about half, where widening wins.
//!
//! Each measurement times independent accumulator chains of one instruction (enough chains to
//! cover its latency), best of five short runs: about a millisecond in all.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::isa::Isa;

/// How many times the f32 FMA's multiply-adds per second the pair dot products must reach to be
/// used: their kernels also spend a permute per 16 columns interleaving pairs, so parity is not
/// enough; the CPUs measured so far sit far from it on either side (2.0 and about 0.5).
pub const PAIR_DOT_MIN_SPEEDUP: f64 = 1.5;

/// Timed runs per instruction; the fastest counts (a VM's neighbours only ever slow a run).
const RUNS: usize = 5;

/// Multiply-adds per second of bf16 pair dot products over those of f32 FMAs, both 512 bits
/// wide, measured once on the calling thread; `None` where the CPU lacks AVX-512 BF16.
pub fn pair_dot_speedup() -> Option<f64> {
    static SPEEDUP: OnceLock<Option<f64>> = OnceLock::new();
    *SPEEDUP.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if Isa::detected() == Isa::Avx512Bf16 {
            // SAFETY: AVX-512 F, BW and BF16 were detected on this CPU.
            return Some(unsafe { x86::pair_dot_speedup() });
        }
        None
    })
}

/// The fastest of [`RUNS`] runs of `run`, which returns the multiply-adds it did.
fn best_rate(mut run: impl FnMut() -> f64) -> f64 {
    (0..RUNS)
        .map(|_| {
            let start = Instant::now();
            let work = run();
            work / start.elapsed().max(Duration::from_nanos(1)).as_secs_f64()
        })
        .fold(0.0, f64::max)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    use super::best_rate;

    /// Independent chains: enough to cover either instruction's latency at two per cycle.
    const CHAINS: usize = 12;
    /// Steps per chain per run: 12 · 4096 instructions, tens of microseconds.
    const STEPS: usize = 4096;

    /// # Safety
    /// The CPU must support AVX-512 F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn pair_dot_speedup() -> f64 {
        let work = (CHAINS * STEPS * 16) as f64;
        // (The closures inherit this function's target features.)
        let fma = best_rate(|| {
            black_box(fma_chains(black_box(1.0)));
            work
        });
        let pair_dot = best_rate(|| {
            black_box(pair_dot_chains(black_box(1.0)));
            2.0 * work
        });
        pair_dot / fma
    }

    #[target_feature(enable = "avx512f")]
    fn fma_chains(seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        let (a, b) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..STEPS {
            for v in acc.iter_mut() {
                *v = _mm512_fmadd_ps(*v, a, b);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn pair_dot_chains(seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        // Pairs of bf16 1/1024 (0x3A80): each step adds 2⁻¹⁹ per lane.
        // SAFETY: `__m512bh` is 32 bf16 in the bits of a `__m512i`.
        let pairs: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(0x3A80_3A80)) };
        for _ in 0..STEPS {
            for v in acc.iter_mut() {
                *v = _mm512_dpbf16_ps(*v, pairs, pairs);
            }
        }
        acc.iter().map(|&v| _mm512_reduce_add_ps(v)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_rate_is_the_fastest_run() {
        let mut calls = 0u32;
        // The first run sleeps; the rest return at once.
        let rate = best_rate(|| {
            calls += 1;
            if calls == 1 {
                std::thread::sleep(Duration::from_millis(20));
            }
            1e3
        });
        assert_eq!(calls, RUNS as u32);
        assert!(rate > 1e3 / 0.020, "{rate}");
    }

    #[test]
    fn pair_dots_are_measured_exactly_where_the_cpu_has_them() {
        let speedup = pair_dot_speedup();
        assert_eq!(speedup.is_some(), Isa::detected() == Isa::Avx512Bf16);
        if let Some(speedup) = speedup {
            // Whichever way it decides, a measured ratio of two issue rates.
            assert!(
                speedup.is_finite() && speedup > 0.05 && speedup < 20.0,
                "{speedup}"
            );
        }
    }
}
