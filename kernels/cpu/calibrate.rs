//! Short measurements, run once per process, for the choices a CPU's reported features do not
//! decide: whether AVX-512 BF16 pair dot products (`vdpbf16ps`, two bf16 multiply-adds per f32
//! lane) outrun f32 FMAs on bf16 data widened first. On Zen 4 they do 2.0× the multiply-adds
//! per second; on an Intel Emerald Rapids VM about half, where widening wins.
//!
//! Each measurement times independent accumulator chains of one instruction (enough chains to
//! cover its latency), written in assembly so that debug and release builds time the same
//! code, best of five short runs: about a millisecond in all.

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
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::best_rate;

    /// Steps per run: each runs one instruction in each of 12 independent accumulator chains
    /// (enough to cover either instruction's latency at two per cycle): 12 · 4096
    /// instructions, tens of microseconds.
    const STEPS: usize = 4096;
    /// The chains per step, as the assembly below spells them out.
    const CHAINS: usize = 12;

    /// # Safety
    /// The CPU must support AVX-512 F, BW and BF16.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn pair_dot_speedup() -> f64 {
        let work = (CHAINS * STEPS * 16) as f64;
        // (The closures inherit this function's target features.)
        let fma = best_rate(|| {
            fma_chains();
            work
        });
        let pair_dot = best_rate(|| {
            pair_dot_chains();
            2.0 * work
        });
        pair_dot / fma
    }

    // The chains are written in assembly, so that what is timed is the same instructions
    // whatever the build's optimisation level: compiled without optimisation, the intrinsics
    // kept their accumulators in memory and measured pair dot products at 0.5× the FMA's rate
    // on a CPU where optimised code measures 2.0×.

    /// [`STEPS`] steps of `$op zmmN, zmm12, zmm13` in each of the 12 chains N = 0..12, which
    /// start from `b`; `a` in zmm12, `b` in zmm13.
    macro_rules! chains {
        ($op:literal, $a:expr, $b:expr) => {
            // SAFETY: the caller enables the instruction's target features; the block touches
            // only the registers it names, no memory and no stack.
            unsafe {
                asm!(
                    "vmovaps zmm0, zmm13", "vmovaps zmm1, zmm13", "vmovaps zmm2, zmm13",
                    "vmovaps zmm3, zmm13", "vmovaps zmm4, zmm13", "vmovaps zmm5, zmm13",
                    "vmovaps zmm6, zmm13", "vmovaps zmm7, zmm13", "vmovaps zmm8, zmm13",
                    "vmovaps zmm9, zmm13", "vmovaps zmm10, zmm13", "vmovaps zmm11, zmm13",
                    "2:",
                    concat!($op, " zmm0, zmm12, zmm13"), concat!($op, " zmm1, zmm12, zmm13"),
                    concat!($op, " zmm2, zmm12, zmm13"), concat!($op, " zmm3, zmm12, zmm13"),
                    concat!($op, " zmm4, zmm12, zmm13"), concat!($op, " zmm5, zmm12, zmm13"),
                    concat!($op, " zmm6, zmm12, zmm13"), concat!($op, " zmm7, zmm12, zmm13"),
                    concat!($op, " zmm8, zmm12, zmm13"), concat!($op, " zmm9, zmm12, zmm13"),
                    concat!($op, " zmm10, zmm12, zmm13"), concat!($op, " zmm11, zmm12, zmm13"),
                    "dec {steps}",
                    "jnz 2b",
                    in("zmm12") $a,
                    in("zmm13") $b,
                    steps = inout(reg) STEPS => _,
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    options(nomem, nostack),
                );
            }
        };
    }

    /// [`STEPS`] steps of one `vfmadd213ps` in each of the 12 chains (`x · 0.999999 + 1e-7`:
    /// normal values throughout).
    #[target_feature(enable = "avx512f")]
    fn fma_chains() {
        chains!(
            "vfmadd213ps",
            _mm512_set1_ps(0.999_999),
            _mm512_set1_ps(1e-7)
        );
    }

    /// [`STEPS`] steps of one `vdpbf16ps` in each of the 12 chains (pairs of bf16 1/1024,
    /// 0x3A80: each adds 2⁻¹⁹ per lane to a normal start).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn pair_dot_chains() {
        let pairs = _mm512_set1_epi32(0x3A80_3A80);
        chains!("vdpbf16ps", pairs, pairs);
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
