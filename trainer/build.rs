//! Build script: gives `moekit-train` and the trainer's tests an rpath to the libtorch they were
//! linked against (`$LIBTORCH/lib`, set by `scripts/libtorch.sh`), so they run from
//! `target/release/` without `LD_LIBRARY_PATH`.

fn main() {
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}
