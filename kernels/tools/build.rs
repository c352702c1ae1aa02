//! Build script: with the `libtorch` feature, gives the `moekit` binary and the tests an rpath to
//! the libtorch they were linked against (`$LIBTORCH/lib`, set by `scripts/libtorch.sh`) so they
//! run without `LD_LIBRARY_PATH`.

use std::env;

fn main() {
    if let (Some(_), Ok(libtorch)) = (env::var_os("CARGO_FEATURE_LIBTORCH"), env::var("LIBTORCH")) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}
