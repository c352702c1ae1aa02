//! Which SIMD kernels the cpu backend runs: the instruction-set levels it has kernels for,
//! the level this CPU supports (detected once per process), and the level the process uses:
//! by default the fastest here (the detected one, unless a calibration shows its extra kernels
//! slower: [`Isa::preferred`]), or the level named by [`ISA_VARIABLE`], for reproducible runs
//! and to test the paths of CPUs without the wider instructions on one that has them.
//!
//! Every kernel that has SIMD variants asks [`Isa::active`] and runs the widest variant at or
//! below it. Results are bit-identical across thread counts for any one level; different
//! levels may round differently (a different summation order, or FMA against multiply-add).
//! Products over a transposed left operand (the weight gradients) go through the `gemm` crate's
//! own driver, which picks its microkernel by its own detection; forcing a level does not reach
//! inside it.

use std::sync::OnceLock;

use super::calibrate::{self, PAIR_DOT_MIN_SPEEDUP};
use crate::error::{Error, Result};

/// The environment variable that sets the level the cpu backend uses: one of [`Isa::name`]'s
/// values, at most the detected level.
pub const ISA_VARIABLE: &str = "MOEKIT_CPU_ISA";

/// An instruction-set level the cpu backend has kernels for. Each level includes the ones
/// below it, so they are ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// No SIMD kernel of moekit's own: portable Rust, vectorised by the compiler for the
    /// build target's baseline (SSE2 on x86-64).
    Portable,
    /// AVX2 with FMA: 8-lane f32 kernels (x86-64-v3).
    Avx2,
    /// AVX-512 F (with FMA): 16-lane f32 kernels.
    Avx512,
    /// AVX-512 BW and BF16 besides: bf16 pair dot products (`vdpbf16ps`).
    Avx512Bf16,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16];

    /// The level's name, as [`ISA_VARIABLE`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The level named `name`, if any.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name() == name)
    }

    /// The widest level this CPU supports (every feature of it and of the levels below).
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(detect)
    }

    /// The level this process uses: [`ISA_VARIABLE`]'s if set, else [`Isa::preferred`].
    ///
    /// # Errors
    /// If the variable names no level, or one above the detected level (whose instructions
    /// this CPU lacks).
    pub fn selected() -> Result<Isa> {
        select(Isa::requested())
    }

    /// [`ISA_VARIABLE`]'s value, read once per process; `None` when unset.
    pub fn requested() -> Option<&'static str> {
        static REQUESTED: OnceLock<Option<String>> = OnceLock::new();
        REQUESTED
            .get_or_init(|| {
                std::env::var_os(ISA_VARIABLE).map(|v| v.to_string_lossy().into_owned())
            })
            .as_deref()
    }

    /// The fastest level here: the detected one, except that `avx512bf16` falls back to
    /// `avx512` (bf16 widened to f32) where the pair dot products measure below
    /// [`PAIR_DOT_MIN_SPEEDUP`] times the f32 FMA rate ([`calibrate::pair_dot_speedup`]).
    pub fn preferred() -> Isa {
        preferred(Isa::detected(), calibrate::pair_dot_speedup())
    }

    /// The level the kernels run at: [`Isa::selected`], or the detected level where the
    /// variable is invalid (which the backend's entry points report as an error first).
    /// Never above [`Isa::detected`], so every kernel it enables has its instructions.
    pub fn active() -> Isa {
        static ACTIVE: OnceLock<Isa> = OnceLock::new();
        *ACTIVE.get_or_init(|| Isa::selected().unwrap_or_else(|_| Isa::detected()))
    }

    /// Whether the kernels run at this level or a wider one.
    pub fn enabled(self) -> bool {
        Isa::active() >= self
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The level for [`ISA_VARIABLE`]'s value `requested` (unset: `None`) on this CPU.
fn select(requested: Option<&str>) -> Result<Isa> {
    let detected = Isa::detected();
    let Some(requested) = requested else {
        return Ok(Isa::preferred());
    };
    let invalid = |message: String| Error::Environment {
        variable: ISA_VARIABLE.into(),
        value: requested.into(),
        message,
    };
    let names = || Isa::ALL.map(Isa::name).join(", ");
    match Isa::from_name(requested) {
        None => Err(invalid(format!("not a level; levels: {}", names()))),
        Some(isa) if isa > detected => Err(invalid(format!(
            "this CPU supports levels up to `{detected}`"
        ))),
        Some(isa) => Ok(isa),
    }
}

/// [`Isa::preferred`] for a CPU of level `detected` whose pair dot products measured
/// `pair_dot_speedup` times the f32 FMA rate.
fn preferred(detected: Isa, pair_dot_speedup: Option<f64>) -> Isa {
    match pair_dot_speedup {
        Some(speedup) if detected == Isa::Avx512Bf16 && speedup < PAIR_DOT_MIN_SPEEDUP => {
            Isa::Avx512
        }
        _ => detected,
    }
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let levels = [
            (
                Isa::Avx2,
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            ),
            (Isa::Avx512, is_x86_feature_detected!("avx512f")),
            (
                Isa::Avx512Bf16,
                is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16"),
            ),
        ];
        levels
            .into_iter()
            .take_while(|&(_, present)| present)
            .last()
            .map_or(Isa::Portable, |(isa, _)| isa)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_in_ascending_order() {
        for pair in Isa::ALL.windows(2) {
            assert!(pair[0] < pair[1]);
        }
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name("sse2"), None);
    }

    #[test]
    fn slow_pair_dot_products_fall_back_to_widening() {
        use Isa::*;
        assert_eq!(preferred(Avx512Bf16, Some(2.0)), Avx512Bf16);
        assert_eq!(
            preferred(Avx512Bf16, Some(PAIR_DOT_MIN_SPEEDUP)),
            Avx512Bf16
        );
        assert_eq!(preferred(Avx512Bf16, Some(0.5)), Avx512);
        for isa in [Portable, Avx2, Avx512] {
            assert_eq!(preferred(isa, None), isa);
        }
    }

    #[test]
    fn detection_agrees_with_the_cpu_features() {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
            assert_eq!(Isa::detected() >= Isa::Avx2, avx2);
            if Isa::detected() >= Isa::Avx512 {
                assert!(is_x86_feature_detected!("avx512f"));
            }
            if Isa::detected() == Isa::Avx512Bf16 {
                assert!(is_x86_feature_detected!("avx512bf16"));
            }
        }
    }

    #[test]
    fn a_request_selects_a_level_up_to_the_detected_one() {
        let detected = Isa::detected();
        assert_eq!(select(None).unwrap(), Isa::preferred());
        for isa in Isa::ALL {
            let got = select(Some(isa.name()));
            if isa <= detected {
                assert_eq!(got.unwrap(), isa);
            } else {
                let message = got.unwrap_err().to_string();
                assert!(
                    message.contains(&format!("MOEKIT_CPU_ISA={isa}"))
                        && message.contains(&format!("up to `{detected}`")),
                    "{message}"
                );
            }
        }
        let message = select(Some("avx3")).unwrap_err().to_string();
        assert!(
            message.contains("MOEKIT_CPU_ISA=avx3")
                && message.contains("portable, avx2, avx512, avx512bf16"),
            "{message}"
        );
    }
}
