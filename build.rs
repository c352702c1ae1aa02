//! Build script: records the target triple and profile so `moekit --version` and benchmark
//! reports can state exactly what was measured.

fn main() {
    for key in ["TARGET", "PROFILE"] {
        let value = std::env::var(key).unwrap_or_else(|_| "unknown".to_owned());
        println!("cargo:rustc-env=MOEKIT_BUILD_{key}={value}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
