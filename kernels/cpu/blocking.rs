//! How the packed-panel products (`cpu::streamed`) cut the weights into panels and bring
//! them in from memory, and how many rows of a small product run on register tiles instead
//! ([`Blocking::register_tiles_for`]): choices that depend on the microarchitecture, made once
//! per process from the CPU's vendor, or set by [`BLOCKING_VARIABLE`] for reproducible runs
//! and to test either choice on any CPU.
//!
//! Measured with `moekit bench` (Qwen3-30B-A3B f32 `blockwise_mm` / `blockwise_mm_bwd`, 2 vCPUs,
//! BENCHMARKS.md): on an AMD Zen 4, narrow panels whose successor is prefetched into L2 while
//! the current one is multiplied hide the memory latency behind the arithmetic; on an Intel
//! Xeon (Emerald Rapids class) the same prefetches stall the core, and panels read in memory
//! order, left to the hardware prefetchers, run 25% (T = 512) and 5% (T = 2048) faster.

use std::sync::OnceLock;

use super::f32_tiles::TileShape;
use crate::error::{Error, Result};

/// The environment variable that sets the blocking: one of [`Blocking::name`]'s values.
pub const BLOCKING_VARIABLE: &str = "MOEKIT_CPU_BLOCKING";

/// How the packed-panel products read the weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Blocking {
    /// Panels of 64 columns over 512 rows of `b` (128 KiB in f32, held in L2), the next one
    /// prefetched into L2 in shares spread over the current one's microkernel calls (chosen on
    /// AMD CPUs).
    Prefetched,
    /// Panels read in memory order, without software prefetches: row-major `b` in panels of
    /// every column (up to 512 KiB) over 64 rows (256 where more than 64 rows of `a` meet
    /// them), each 64-column strip multiplied by all of `a`'s row tiles while it sits in L1;
    /// `b` stored transposed in panels of 64 whole stored rows (up to 4096 values each; chosen
    /// on other CPUs).
    Sequential,
}

/// One product's panels: `kc` rows of `b` by `cols` columns, whether the next panel is
/// prefetched, and whether each strip meets every row tile before the next strip
/// (`strips_outer`) or each row tile every strip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub kc: usize,
    pub cols: usize,
    pub prefetch: bool,
    pub strips_outer: bool,
}

/// Bytes of f32 in one [`Blocking::Sequential`] panel of row-major `b`: about a quarter of an
/// L2 cache of 2 MiB, beside the rows of `a` and of the product it meets.
const SEQUENTIAL_PANEL_BYTES: usize = 512 << 10;

/// Longest run of a stored row of transposed `b` in one [`Blocking::Sequential`] panel: 64 of
/// them take 1 MiB in f32.
const SEQUENTIAL_STORED_ROW_MAX: usize = 4096;

impl Blocking {
    /// Both blockings.
    pub const ALL: [Blocking; 2] = [Blocking::Prefetched, Blocking::Sequential];

    /// The name [`BLOCKING_VARIABLE`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Blocking::Prefetched => "prefetched",
            Blocking::Sequential => "sequential",
        }
    }

    /// The blocking named `name`, if any.
    pub fn from_name(name: &str) -> Option<Blocking> {
        Blocking::ALL.into_iter().find(|b| b.name() == name)
    }

    /// The blocking for this CPU: [`Blocking::Prefetched`] on AMD's, [`Blocking::Sequential`]
    /// on every other.
    pub fn detected() -> Blocking {
        match cpu_vendor().as_deref() {
            Some("AuthenticAMD") => Blocking::Prefetched,
            _ => Blocking::Sequential,
        }
    }

    /// [`BLOCKING_VARIABLE`]'s value, read once per process; `None` when unset.
    pub fn requested() -> Option<&'static str> {
        static REQUESTED: OnceLock<Option<String>> = OnceLock::new();
        REQUESTED
            .get_or_init(|| {
                std::env::var_os(BLOCKING_VARIABLE).map(|v| v.to_string_lossy().into_owned())
            })
            .as_deref()
    }

    /// The blocking this process uses: [`BLOCKING_VARIABLE`]'s if set, else
    /// [`Blocking::detected`].
    ///
    /// # Errors
    /// If the variable names no blocking.
    pub fn selected() -> Result<Blocking> {
        let Some(requested) = Blocking::requested() else {
            return Ok(Blocking::detected());
        };
        Blocking::from_name(requested).ok_or_else(|| Error::Environment {
            variable: BLOCKING_VARIABLE.into(),
            value: requested.into(),
            message: format!(
                "not a blocking; blockings: {}",
                Blocking::ALL.map(Blocking::name).join(", ")
            ),
        })
    }

    /// The blocking the products use: [`Blocking::selected`], or the detected one where the
    /// variable is invalid (which the backend's entry points report as an error first).
    pub fn active() -> Blocking {
        static ACTIVE: OnceLock<Blocking> = OnceLock::new();
        *ACTIVE.get_or_init(|| Blocking::selected().unwrap_or_else(|_| Blocking::detected()))
    }

    /// The panels of `a [m, k] · b [k, n]`, `b` row-major or (`transposed`) stored as its
    /// transpose, for microkernels `strip` columns wide.
    pub fn geometry(
        self,
        transposed: bool,
        (m, n, k): (usize, usize, usize),
        strip: usize,
    ) -> Geometry {
        match (self, transposed) {
            (Blocking::Prefetched, _) => Geometry {
                kc: 512,
                cols: 64,
                prefetch: true,
                strips_outer: false,
            },
            (Blocking::Sequential, false) => {
                let kc = if m <= 64 { 64 } else { 256 };
                let widest = (SEQUENTIAL_PANEL_BYTES / (4 * kc) / strip * strip).max(strip);
                Geometry {
                    kc,
                    cols: n.next_multiple_of(strip).min(widest),
                    prefetch: false,
                    strips_outer: true,
                }
            }
            (Blocking::Sequential, true) => Geometry {
                kc: k.clamp(1, SEQUENTIAL_STORED_ROW_MAX),
                cols: 64,
                prefetch: false,
                strips_outer: true,
            },
        }
    }
}

impl Blocking {
    /// Whether `cpu::matmul` multiplies `m` rows of `a` on its register tiles, which read both
    /// operands where they lie, rather than on packed panels, where the inner dimension and
    /// the output are small enough for the tiles (the other half of that choice, made there).
    ///
    /// Measured single-threaded (f32, `m × 256 × 256`, operands in cache): on an Intel Xeon
    /// (Emerald Rapids class) the panels run 164 GFLOP/s against the tiles' 147 at m = 256, the
    /// same from m = 24 to 64, and 88 against 144 at m = 12; on an AMD Zen 4 the tiles win at
    /// every m (96 against 54–64 GFLOP/s at m = 256). So the tiles take every m on
    /// [`Blocking::Prefetched`] CPUs and one tile's 12 rows on the others.
    pub fn register_tiles_for(self, m: usize) -> bool {
        match self {
            Blocking::Prefetched => true,
            Blocking::Sequential => m <= TILE_ROWS,
        }
    }

    /// The register tiles (`cpu::f32_tiles`) of a product whose `b` (an expert's weights)
    /// streams through them one strip at a time over a short inner dimension: 6 × 64 on
    /// [`Blocking::Prefetched`] CPUs, 12 × 32 on the others.
    ///
    /// The wide tiles cut `b` into half as many strips, so each row of `a` passes `b` half as
    /// often. Measured on Zen 4 with the two shapes on alternate calls of one process
    /// (`blockwise_mm` timed per call, 120 calls each): inside `moekit-train bench --config
    /// configs/qwen3_moe_small.toml` 10.72 against 10.90 and 10.56 against 10.82 ms; in `moekit
    /// bench --shape qwen3-moe-small --tokens 2048 --block-size 32` 10.93 against 11.33 and
    /// 11.44 against 11.83 ms. The gain is the shape's: the wide tiles start whole strips at
    /// column 0, but the tall ones lose nothing by their head strip (without it, 10.52 and
    /// 10.53 against 10.44 and 10.36 ms). At a long k (Qwen3-30B-A3B's H = 2048, 32 rows) a
    /// wide strip is 512 KiB, which with the next one prefetched fills a 1 MiB L2, and they
    /// lose (239 against 215 ms), so long k keeps the tall tiles. Not measured on the Intel
    /// Xeon, whose blocking gives the tiles one tall tile's rows at most.
    pub(crate) fn streamed_tile_shape(self) -> TileShape {
        match self {
            Blocking::Prefetched => TileShape::Wide,
            Blocking::Sequential => TileShape::Tall,
        }
    }
}

/// The rows of one tall register tile of `cpu::f32_tiles`.
const TILE_ROWS: usize = super::tile_walk::MR;

/// Bytes of one core's L2 cache as the OS reports it (Linux: sysfs, read once per process by
/// the `gemm` crate's detection), or that crate's default of 512 KiB where it reports none.
pub fn l2_cache_bytes() -> usize {
    gemm_common::cache::CACHE_INFO[1].cache_bytes
}

impl std::fmt::Display for Blocking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, …), where the CPU reports one.
pub fn cpu_vendor() -> Option<String> {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0 (the vendor) exists on every x86-64 CPU.
        let leaf = std::arch::x86_64::__cpuid(0);
        let bytes: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_detected_blocking_follows_the_vendor() {
        for blocking in Blocking::ALL {
            assert_eq!(Blocking::from_name(blocking.name()), Some(blocking));
        }
        assert_eq!(Blocking::from_name("fast"), None);
        let amd = cpu_vendor().as_deref() == Some("AuthenticAMD");
        assert_eq!(Blocking::detected() == Blocking::Prefetched, amd);
    }

    #[test]
    fn sequential_panels_of_row_major_b_cover_whole_rows_within_their_bytes() {
        let g = Blocking::Sequential.geometry(false, (32, 1536, 2048), 64);
        assert_eq!((g.kc, g.cols), (64, 1536));
        let g = Blocking::Sequential.geometry(false, (256, 2048, 768), 64);
        assert_eq!((g.kc, g.cols), (256, 512));
        assert!(g.kc * g.cols * 4 <= SEQUENTIAL_PANEL_BYTES);
        let g = Blocking::Sequential.geometry(true, (32, 2048, 1536), 64);
        assert_eq!((g.kc, g.cols), (1536, 64));
    }
}
