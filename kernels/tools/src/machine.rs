//! The host as the cpu backend sees it, for `moekit info` and the benchmarks' reports: the CPU
//! model, its caches, the instruction-set level detected and the one the kernels use, and the
//! blocking of their packed-panel products.

use std::fmt;
use std::fs;
use std::path::Path;

use moekit::cpu::blocking::{self, BLOCKING_VARIABLE, Blocking};
use moekit::cpu::calibrate::{self, PAIR_DOT_MIN_SPEEDUP};
use moekit::cpu::isa::{ISA_VARIABLE, Isa};

/// One cache of the first CPU, as Linux reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cache {
    /// 1, 2, 3.
    pub level: u32,
    /// `Data`, `Instruction` or `Unified`.
    pub kind: String,
    /// Size in bytes.
    pub bytes: u64,
    /// How many CPUs share it.
    pub shared_by: usize,
}

/// The host's CPU.
#[derive(Clone, Debug)]
pub struct Host {
    /// The model name (`/proc/cpuinfo`), or `unknown`.
    pub model: String,
    /// Threads of the current rayon pool.
    pub threads: usize,
    /// The caches of CPU 0, by level (empty where the system does not say).
    pub caches: Vec<Cache>,
    /// The widest level the CPU supports.
    pub detected: Isa,
    /// The level the cpu backend's kernels run at, or why [`ISA_VARIABLE`] is unusable.
    pub selected: Result<Isa, String>,
    /// Whether [`ISA_VARIABLE`] chose the level.
    pub requested: bool,
    /// bf16 pair dot products' multiply-adds per second over f32 FMAs', where measured.
    pub pair_dot_speedup: Option<f64>,
    /// The CPU's vendor (CPUID), or `unknown`.
    pub vendor: String,
    /// The blocking the packed-panel products use, or why [`BLOCKING_VARIABLE`] is unusable.
    pub blocking: Result<Blocking, String>,
    /// Whether [`BLOCKING_VARIABLE`] chose the blocking.
    pub blocking_requested: bool,
    /// One core's L2 cache in bytes as the kernels read it ([`blocking::l2_cache_bytes`]): the
    /// register tiles walk row tiles outer over operands in cache up to half of it.
    pub l2_bytes: usize,
}

impl Host {
    /// Reads the host's description (Linux's `/proc` and `/sys`; elsewhere the model and
    /// caches are unknown).
    pub fn describe() -> Self {
        Self {
            model: cpu_model().unwrap_or_else(|| "unknown".to_owned()),
            threads: rayon::current_num_threads(),
            caches: caches(Path::new("/sys/devices/system/cpu/cpu0/cache")),
            detected: Isa::detected(),
            selected: Isa::selected().map_err(|e| e.to_string()),
            requested: Isa::requested().is_some(),
            pair_dot_speedup: calibrate::pair_dot_speedup(),
            vendor: blocking::cpu_vendor().unwrap_or_else(|| "unknown".to_owned()),
            blocking: Blocking::selected().map_err(|e| e.to_string()),
            blocking_requested: Blocking::requested().is_some(),
            l2_bytes: blocking::l2_cache_bytes(),
        }
    }

    /// One line for a benchmark's header: which cpu kernels ran, on which panels.
    pub fn kernels_line(&self) -> String {
        let detected = self.detected;
        let level = match &self.selected {
            Err(message) => return format!("cpu kernels: unusable: {message}"),
            Ok(isa) if self.requested => format!("{isa} ({ISA_VARIABLE}; detected: {detected})"),
            Ok(isa) if *isa == detected => format!("{isa} (detected)"),
            Ok(isa) => format!(
                "{isa} (calibrated: bf16 pair dot products below {PAIR_DOT_MIN_SPEEDUP}× the f32 \
                 FMA rate; detected: {detected})"
            ),
        };
        let panels = match &self.blocking {
            Err(message) => return format!("cpu kernels: unusable: {message}"),
            Ok(blocking) if self.blocking_requested => format!(
                "{blocking} ({BLOCKING_VARIABLE}; detected: {})",
                Blocking::detected()
            ),
            Ok(blocking) => format!("{blocking} (detected: {})", self.vendor),
        };
        format!(
            "cpu kernels: {level}; panels: {panels}; L2 {} KiB",
            self.l2_bytes >> 10
        )
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "cpu: {}", self.model)?;
        writeln!(f, "threads: {}", self.threads)?;
        for cache in &self.caches {
            writeln!(
                f,
                "L{} {}: {} KiB, shared by {} CPU(s)",
                cache.level,
                cache.kind.to_lowercase(),
                cache.bytes / 1024,
                cache.shared_by
            )?;
        }
        let levels: Vec<&str> = Isa::ALL
            .iter()
            .filter(|&&isa| isa <= self.detected)
            .map(|isa| isa.name())
            .collect();
        writeln!(f, "instruction-set levels: {}", levels.join(", "))?;
        if let Some(speedup) = self.pair_dot_speedup {
            writeln!(
                f,
                "bf16 pair dot products: {speedup:.2}× the f32 FMA's multiply-adds per second \
                 (used from {PAIR_DOT_MIN_SPEEDUP}×)"
            )?;
        }
        writeln!(f, "{}", self.kernels_line())
    }
}

/// The size of CPU 0's largest data or unified cache (its last level), in bytes, where Linux
/// reports it.
pub fn last_level_cache_bytes() -> Option<u64> {
    caches(Path::new("/sys/devices/system/cpu/cpu0/cache"))
        .into_iter()
        .filter(|cache| cache.kind != "Instruction")
        .max_by_key(|cache| cache.level)
        .map(|cache| cache.bytes)
}

/// The first `model name` of `/proc/cpuinfo`.
fn cpu_model() -> Option<String> {
    let info = fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map(|(_, name)| name.trim().to_owned())
}

/// The caches listed under `dir` (`index0`, `index1`, …, as Linux's sysfs lays them out),
/// ordered by level; entries that do not parse are left out.
fn caches(dir: &Path) -> Vec<Cache> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut caches: Vec<Cache> = entries
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let read = |name: &str| fs::read_to_string(path.join(name)).ok();
            Some(Cache {
                level: read("level")?.trim().parse().ok()?,
                kind: read("type")?.trim().to_owned(),
                bytes: parse_size(read("size")?.trim())?,
                shared_by: read("shared_cpu_list").map_or(1, |list| cpu_count(list.trim())),
            })
        })
        .collect();
    caches.sort_by(|a, b| (a.level, &a.kind).cmp(&(b.level, &b.kind)));
    caches
}

/// `48K`, `2048K`, `32M` or a plain byte count, in bytes.
fn parse_size(size: &str) -> Option<u64> {
    let (digits, unit) = match size.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => size.split_at(i),
        None => (size, ""),
    };
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits.parse::<u64>().ok()?.checked_mul(scale)
}

/// The number of CPUs in a list such as `0-3,8,10-11`.
fn cpu_count(list: &str) -> usize {
    list.split(',')
        .filter_map(|part| match part.split_once('-') {
            Some((lo, hi)) => Some(hi.parse::<usize>().ok()? + 1 - lo.parse::<usize>().ok()?),
            None => part.parse::<usize>().ok().map(|_| 1),
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_size("48K"), Some(48 * 1024));
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("12Q"), None);
        assert_eq!(cpu_count("0-3,8,10-11"), 7);
        assert_eq!(cpu_count("1"), 1);
    }

    #[test]
    fn caches_are_read_from_a_sysfs_layout() {
        let dir = std::env::temp_dir().join(format!("moekit-caches-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        for (index, level, kind, size, shared) in [
            ("index0", "1", "Data", "32K", "0"),
            ("index2", "2", "Unified", "1024K", "0-1"),
            ("index3", "3", "Unified", "32M", "0-7"),
        ] {
            let path = dir.join(index);
            fs::create_dir(&path).unwrap();
            for (name, value) in [
                ("level", level),
                ("type", kind),
                ("size", size),
                ("shared_cpu_list", shared),
            ] {
                fs::write(path.join(name), format!("{value}\n")).unwrap();
            }
        }
        // An entry without a size is left out.
        fs::create_dir(dir.join("index1")).unwrap();
        fs::write(dir.join("index1/level"), "1\n").unwrap();
        let got = caches(&dir);
        fs::remove_dir_all(&dir).unwrap();
        let summary: Vec<(u32, &str, u64, usize)> = got
            .iter()
            .map(|c| (c.level, c.kind.as_str(), c.bytes, c.shared_by))
            .collect();
        assert_eq!(
            summary,
            [
                (1, "Data", 32 << 10, 1),
                (2, "Unified", 1 << 20, 2),
                (3, "Unified", 32 << 20, 8)
            ]
        );
    }
}
