//! Build script: compiles `csrc/shim.cpp` (what the trainer needs from libtorch that `tch`
//! lacks: backpropagation from given gradients, tensors over memory handed over) against the
//! libtorch `tch` links (`$LIBTORCH`, set by `scripts/libtorch.sh`), and gives `moekit-train`
//! and the trainer's tests an rpath to that libtorch (`$LIBTORCH/lib`), so they run from
//! `target/release/` without `LD_LIBRARY_PATH`.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let libtorch = PathBuf::from(std::env::var("LIBTORCH").expect(
        "LIBTORCH names the libtorch to build against: `eval \"$(bash scripts/libtorch.sh)\"`",
    ));
    println!(
        "cargo:rustc-link-arg=-Wl,-rpath,{}",
        libtorch.join("lib").display()
    );
    // The C++ ABI libtorch was built with, as `torch-sys` reads it (PyPI's wheels: the new one).
    let cxx11_abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let mut build = cc::Build::new();
    // libtorch's headers as system headers: the warnings are this file's own.
    for headers in ["include", "include/torch/csrc/api/include"] {
        build
            .flag("-isystem")
            .flag(libtorch.join(headers).display().to_string());
    }
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi.as_str())
        .file("csrc/shim.cpp")
        .compile("moekit_shim");
}
