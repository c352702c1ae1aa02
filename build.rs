//! Build script: records the target triple and profile ([`moekit::BUILD`]) so `moekit --version`
//! and benchmark reports can state exactly what was measured.
//!
//! The Neuron runtime bindings are committed (`ffi/`, crate `moekit-nrt-sys`) and the fake
//! runtime is built only for the tests (`ffi/fake/`, a dev-dependency), so building moekit needs
//! neither libclang nor a C compiler; with the `mpi` feature, `mpicc` compiles moekit's MPI shim
//! (`ffi/mpi/`), still without libclang.

use std::env;

fn main() {
    for key in ["TARGET", "PROFILE"] {
        let value = env::var(key).unwrap_or_else(|_| "unknown".to_owned());
        println!("cargo:rustc-env=MOEKIT_BUILD_{key}={value}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
