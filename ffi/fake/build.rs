//! Compiles `fake_nrt.c` into `libnrt_fake.so` and `libnrt_fake_partial.so` (without
//! `nrt_execute_repeat`) and exports their paths as `MOEKIT_FAKE_NRT` and
//! `MOEKIT_FAKE_NRT_PARTIAL`. Only tests depend on this crate, so only test builds compile it.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=fake_nrt.c");
    println!("cargo:rerun-if-changed=../nrt.h");
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
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
            .arg("-I..")
            .arg("fake_nrt.c")
            .arg("-o")
            .arg(&library)
            .arg("-lm")
            .status()
            .unwrap_or_else(|err| panic!("running the C compiler for {name}: {err}"));
        assert!(status.success(), "compiling {name} failed: {status}");
        println!("cargo:rustc-env={var}={}", library.display());
    }
}
