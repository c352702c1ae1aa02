//! The allocator policy of `moekit::memory`: after `retain_freed_buffers`, a large buffer that
//! is freed and allocated again reuses the process's pages instead of faulting in fresh ones,
//! also when the buffers freed together exceed 2 GiB (one Qwen3-30B-A3B backward's outputs).
//! The control half shows the faults the policy removes. Page faults are process-wide, so this
//! file runs one check, on the main thread (whose allocations glibc serves from the main heap),
//! without the test harness's threads.

#![cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(dead_code))]

use std::hint::black_box;

const BYTES: usize = 96 << 20;
const PAGES: i64 = (BYTES / 4096) as i64;
/// Three buffers freed together, 2.25 GiB in all.
const LARGE: [usize; 3] = [768 << 20; 3];

fn minor_faults() -> i64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct it is given.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        assert_eq!(libc::getrusage(libc::RUSAGE_SELF, &mut usage), 0);
        usage
    };
    usage.ru_minflt
}

/// Faults taken by `rounds` allocations of fresh buffers of `sizes` bytes (alive together),
/// each page written.
fn faults_of_rounds(rounds: usize, sizes: &[usize]) -> i64 {
    let before = minor_faults();
    for round in 0..rounds {
        let buffers: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&bytes| {
                let mut buffer = vec![0u8; bytes];
                for page in buffer.chunks_mut(4096) {
                    page[0] = round as u8 + 1;
                }
                buffer
            })
            .collect();
        black_box(&buffers);
    }
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    // Default policy: every round maps fresh memory and faults in each page (4 KiB pages, or
    // fewer faults where transparent huge pages back the mapping).
    let default = faults_of_rounds(4, &[BYTES]);
    assert!(
        default >= 4 * (PAGES / 512),
        "the control faulted {default} times in 4 rounds of {PAGES} pages"
    );

    assert!(moekit::memory::retain_freed_buffers());
    faults_of_rounds(1, &[BYTES]);
    let retained = faults_of_rounds(4, &[BYTES]);
    assert!(
        retained * 10 < default,
        "with freed buffers retained, 4 rounds faulted {retained} times (default policy: {default})"
    );
    faults_of_rounds(1, &LARGE);
    let large = faults_of_rounds(2, &LARGE);
    let large_pages = (LARGE.iter().sum::<usize>() / 4096) as i64;
    assert!(
        large * 10 < large_pages,
        "2.25 GiB freed together and allocated again faulted {large} times in 2 rounds"
    );
    println!(
        "memory: freed 96 MiB buffers reused: {retained} page faults in 4 rounds (default policy: {default}); 2.25 GiB freed together: {large} in 2 rounds"
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {
    assert!(!moekit::memory::retain_freed_buffers());
}
