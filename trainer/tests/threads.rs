//! `release_openmp_workers` ends libtorch's idle OpenMP workers, and libtorch's next parallel
//! region starts new ones that compute as before.

use std::time::{Duration, Instant};

use moekit::threads::release_openmp_workers;
use tch::{Kind, Tensor};

/// The threads of this process.
fn thread_count() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task lists this process's threads")
        .count()
}

/// Waits (up to 10 s) until the process has fewer than `count` threads; returns how many.
fn wait_below(count: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = thread_count();
        if now < count || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `x · factor` in libtorch, on enough elements that libtorch splits it over its threads,
/// checked element by element.
fn scale_in_parallel(x: &Tensor, values: &[f32], factor: f32) {
    let y = Vec::<f32>::try_from(x * f64::from(factor)).expect("f32 elements");
    assert!(y.iter().zip(values).all(|(&y, &v)| y == v * factor));
}

#[test]
fn released_openmp_workers_end_and_come_back_when_libtorch_needs_them() {
    tch::set_num_threads(2);
    let values: Vec<f32> = (0..1 << 21).map(|i| (i % 1000) as f32).collect();
    let x = Tensor::from_slice(&values).to_kind(Kind::Float);

    scale_in_parallel(&x, &values, 2.0);
    let with_workers = thread_count();
    assert!(
        release_openmp_workers(),
        "libtorch's OpenMP runtime released its workers"
    );
    let without_workers = wait_below(with_workers);
    assert!(
        without_workers < with_workers,
        "{with_workers} threads before the release, {without_workers} after"
    );

    scale_in_parallel(&x, &values, 3.0);
    let again = thread_count();
    assert!(
        again > without_workers,
        "libtorch's next parallel region started no worker ({again} threads)"
    );
    assert!(release_openmp_workers());
    assert_eq!(wait_below(again), without_workers);
}
