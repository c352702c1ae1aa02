//! Compiles `shim.c` with MPI's compiler wrapper (`$MPICC`, else `mpicc`) and links the MPI
//! library it names (`mpicc --showme:link`, Open MPI's spelling, else `mpicc -link-info`,
//! MPICH's). No bindings are generated: `src/lib.rs` declares the shim's ABI.

use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=shim.c");
    println!("cargo:rerun-if-changed=shim.h");
    println!("cargo:rerun-if-env-changed=MPICC");
    let mpicc = env::var("MPICC").unwrap_or_else(|_| "mpicc".to_owned());
    let link = link_flags(&mpicc).unwrap_or_else(|message| {
        panic!(
            "moekit-mpi-sys (feature `mpi`) needs an MPI compiler wrapper: {message}. \
             Install Open MPI (Debian: libopenmpi-dev openmpi-bin; scripts/setup.sh does) or \
             set MPICC"
        )
    });
    cc::Build::new()
        .compiler(&mpicc)
        .file("shim.c")
        .flag("-std=c11")
        .warnings(true)
        .extra_warnings(true)
        .compile("moekit_mpi_shim");
    for flag in &link {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        } else if let Some(library) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib={library}");
        } else if let Some(path) = flag.strip_prefix("-Wl,-rpath,") {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{path}");
        }
    }
}

/// The linker flags `mpicc` would add, split on whitespace.
fn link_flags(mpicc: &str) -> Result<Vec<String>, String> {
    for args in [&["--showme:link"][..], &["-link-info"][..]] {
        let Ok(output) = Command::new(mpicc).args(args).output() else {
            return Err(format!("cannot run `{mpicc}`"));
        };
        if output.status.success() {
            let text = String::from_utf8_lossy(&output.stdout);
            // MPICH's -link-info prints the whole command line, compiler first.
            let flags = text
                .split_whitespace()
                .filter(|flag| flag.starts_with('-'))
                .map(str::to_owned)
                .collect();
            return Ok(flags);
        }
    }
    Err(format!("`{mpicc}` names no MPI library to link"))
}
