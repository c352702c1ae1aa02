//! Build script:
//! - records the target triple and profile so `moekit --version` and benchmark reports can state
//!   exactly what was measured;
//! - generates the Neuron runtime bindings with bindgen, as run-time-loaded (`dlopen`) bindings so
//!   nothing links against libnrt: from the SDK's headers where `NEURON_RUNTIME_INCLUDE_DIR`
//!   (default `/opt/aws/neuron/include`) holds `nrt/nrt.h`, else from the project's own
//!   declarations in `ffi/nrt.h`;
//! - builds the fake Neuron runtime (`ffi/fake_nrt.c`) as shared libraries for the tests: one
//!   complete, one without `nrt_execute_repeat`;
//! - with the `libtorch` feature, gives the binaries an rpath to the libtorch they were linked
//!   against so they run without `LD_LIBRARY_PATH`.

use std::env;
use std::path::{Path, PathBuf};

/// The runtime calls moekit binds (see `ffi/nrt.h`).
const NRT_FUNCTIONS: &str = "nrt_(init|close|get_version|get_total_vnc_count|get_visible_vnc_count|load|unload|tensor_allocate|tensor_free|tensor_write|tensor_read|tensor_get_size|allocate_tensor_set|destroy_tensor_set|add_tensor_to_tensor_set|get_tensor_from_tensor_set|execute|execute_repeat|get_model_tensor_info|free_model_tensor_info)";

fn main() {
    for key in ["TARGET", "PROFILE"] {
        let value = env::var(key).unwrap_or_else(|_| "unknown".to_owned());
        println!("cargo:rustc-env=MOEKIT_BUILD_{key}={value}");
    }
    if let (Some(_), Ok(libtorch)) = (env::var_os("CARGO_FEATURE_LIBTORCH"), env::var("LIBTORCH")) {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libtorch}/lib");
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bind_neuron_runtime(&out_dir);
    build_fake_runtime(&out_dir);
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}

fn bind_neuron_runtime(out_dir: &Path) {
    println!("cargo:rerun-if-env-changed=NEURON_RUNTIME_INCLUDE_DIR");
    println!("cargo:rerun-if-changed=ffi/nrt.h");
    let sdk_include = env::var_os("NEURON_RUNTIME_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/opt/aws/neuron/include"));
    let (builder, source) = if sdk_include.join("nrt/nrt.h").is_file() {
        println!(
            "cargo:rerun-if-changed={}",
            sdk_include.join("nrt").display()
        );
        let builder = bindgen::Builder::default()
            .header_contents(
                "moekit_nrt_sdk.h",
                "#include <nrt/nrt.h>\n#include <nrt/nrt_experimental.h>\n#include <nrt/nrt_version.h>\n",
            )
            .clang_arg(format!("-I{}", sdk_include.display()));
        let source = format!("the Neuron SDK headers in {}", sdk_include.display());
        (builder, source)
    } else {
        let builder = bindgen::Builder::default().header("ffi/nrt.h");
        (builder, "ffi/nrt.h".to_owned())
    };
    let bindings = builder
        .allowlist_function(NRT_FUNCTIONS)
        .allowlist_type("NRT_STATUS|nrt_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .dynamic_library_name("NrtLibrary")
        .dynamic_link_require_all(false)
        .layout_tests(true)
        .generate()
        .unwrap_or_else(|err| panic!("bindgen over {source} failed: {err}"));
    bindings
        .write_to_file(out_dir.join("nrt_bindings.rs"))
        .expect("write nrt_bindings.rs");
    println!("cargo:rustc-env=MOEKIT_NRT_BINDINGS_SOURCE={source}");
}

/// Compiles `ffi/fake_nrt.c` into `libnrt_fake.so` and `libnrt_fake_partial.so` (without
/// `nrt_execute_repeat`) and exports their paths as `MOEKIT_FAKE_NRT` and
/// `MOEKIT_FAKE_NRT_PARTIAL`.
fn build_fake_runtime(out_dir: &Path) {
    println!("cargo:rerun-if-changed=ffi/fake_nrt.c");
    let compiler = cc::Build::new().get_compiler();
    for (name, defines, var) in [
        ("libnrt_fake.so", &[][..], "MOEKIT_FAKE_NRT"),
        (
            "libnrt_fake_partial.so",
            &["-DFAKE_NRT_OMIT_EXECUTE_REPEAT"][..],
            "MOEKIT_FAKE_NRT_PARTIAL",
        ),
    ] {
        let library = out_dir.join(name);
        let status = compiler
            .to_command()
            .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC"])
            .args(defines)
            .arg("-Iffi")
            .arg("ffi/fake_nrt.c")
            .arg("-o")
            .arg(&library)
            .arg("-lm")
            .status()
            .unwrap_or_else(|err| panic!("running the C compiler for {name}: {err}"));
        assert!(status.success(), "compiling {name} failed: {status}");
        println!("cargo:rustc-env={var}={}", library.display());
    }
}
