//! The committed bindings (`src/bindings.rs`) are what bindgen generates now, from `ffi/nrt.h`
//! and from the same declarations laid out as the Neuron SDK installs its headers. Needs
//! libclang (installed by `scripts/setup.sh`). With `MOEKIT_WRITE_BINDINGS=1` the test writes
//! the file instead (`bash scripts/bindgen.sh`).

use std::path::{Path, PathBuf};

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// bindgen's dynamic-loading bindings of moekit's allowlist, from `builder`'s headers.
fn generate(builder: bindgen::Builder) -> String {
    builder
        .allowlist_function(moekit_nrt_sys::FUNCTIONS)
        .allowlist_type(moekit_nrt_sys::TYPES)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .dynamic_library_name(moekit_nrt_sys::LIBRARY_STRUCT)
        .dynamic_link_require_all(false)
        .layout_tests(true)
        .generate()
        .expect("bindgen")
        .to_string()
}

/// From `ffi/nrt.h`.
fn from_project_header() -> String {
    generate(bindgen::Builder::default().header(crate_dir().join("nrt.h").to_str().unwrap()))
}

/// From an include folder laid out as the SDK's (`nrt/nrt.h` = `ffi/nrt.h`, the other two
/// headers empty), included as a program using the SDK includes them.
fn from_sdk_layout() -> String {
    let include = std::env::temp_dir().join(format!("moekit-nrt-sdk-{}", std::process::id()));
    let nrt = include.join("nrt");
    std::fs::create_dir_all(&nrt).unwrap();
    std::fs::copy(crate_dir().join("nrt.h"), nrt.join("nrt.h")).unwrap();
    for empty in ["nrt_experimental.h", "nrt_version.h"] {
        std::fs::write(nrt.join(empty), "").unwrap();
    }
    let bindings = generate(
        bindgen::Builder::default()
            .header_contents(
                "moekit_nrt_sdk.h",
                "#include <nrt/nrt.h>\n#include <nrt/nrt_experimental.h>\n\
                 #include <nrt/nrt_version.h>\n",
            )
            .clang_arg(format!("-I{}", include.display())),
    );
    std::fs::remove_dir_all(&include).unwrap();
    bindings
}

fn committed_path() -> PathBuf {
    crate_dir().join("src/bindings.rs")
}

fn assert_matches_committed(generated: &str, what: &str, committed: &Path) {
    let text = std::fs::read_to_string(committed).unwrap();
    assert!(
        text == generated,
        "{} differs from what bindgen generates from {what}: run `bash scripts/bindgen.sh` and \
         commit the result",
        committed.display()
    );
}

#[test]
fn committed_bindings_are_what_bindgen_generates() {
    let generated = from_project_header();
    let committed = committed_path();
    if std::env::var_os("MOEKIT_WRITE_BINDINGS").is_some_and(|v| v == "1") {
        std::fs::write(&committed, &generated).unwrap();
    }
    assert_matches_committed(&generated, "ffi/nrt.h", &committed);
    assert_matches_committed(
        &from_sdk_layout(),
        "SDK-layout headers (nrt/nrt.h, nrt_experimental.h, nrt_version.h)",
        &committed,
    );
}
