//! Build script:
//! - records the target triple and profile so `moekit --version` and benchmark reports can state
//!   exactly what was measured;
//! - with the `libtorch` feature, gives the binaries an rpath to the libtorch they were linked
//!   against so they run without `LD_LIBRARY_PATH`.
//!
//! The Neuron runtime bindings are committed (`ffi/`, crate `moekit-nrt-sys`) and the fake
//! runtime is built only for the tests (`ffi/fake/`, a dev-dependency), so building moekit needs
//! neither libclang nor a C compiler.

use std::env;

fn main() {
    for key in ["TARGET", "PROFILE"] {
        let value = env::var(key).unwrap_or_else(|_| "unknown".to_owned());
        println!("cargo:rustc-env=MOEKIT_BUILD_{key}={value}");
    }
    if let (Some(_), Ok(libtorch)) = (env::var_os("CARGO_FEATURE_LIBTORCH"), env::var("LIBTORCH")) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}
