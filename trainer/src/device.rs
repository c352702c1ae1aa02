//! Where training runs: `training.device = "cpu"` (the default) or `"cuda"` (GPU 0).
//!
//! libtorch registers its CUDA backend when `libtorch_cuda.so` is loaded, and the binary does
//! not link it (the linker drops a library no symbol is taken from). So before the first CUDA
//! query the trainer loads `libtorch_cuda.so` from the folder of the `libtorch_cpu.so` this
//! process runs on, whichever that is (the build's rpath, or `LD_LIBRARY_PATH` pointing at
//! another installation of torch 2.11): the CUDA library always matches the CPU one.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// `training.device`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TrainDevice {
    #[default]
    Cpu,
    /// The first CUDA device libtorch sees.
    Cuda,
}

impl TrainDevice {
    pub fn name(self) -> &'static str {
        match self {
            TrainDevice::Cpu => "cpu",
            TrainDevice::Cuda => "cuda",
        }
    }

    /// The libtorch device, after making sure it can be used: for CUDA, libtorch's CUDA
    /// library is loaded and a device must be visible, else the error says which part is
    /// missing.
    pub fn resolve(self) -> Result<tch::Device> {
        match self {
            TrainDevice::Cpu => Ok(tch::Device::Cpu),
            TrainDevice::Cuda => {
                let library = load_libtorch_cuda()?;
                if !tch::Cuda::is_available() {
                    bail!(
                        "training.device = \"cuda\": libtorch ({}) sees no CUDA device \
                         (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
                        library.display()
                    );
                }
                Ok(tch::Device::Cuda(0))
            }
        }
    }
}

/// The folder of the `libtorch_cpu.so` mapped into this process, from `/proc/self/maps`.
fn libtorch_folder() -> Result<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").context("cannot read /proc/self/maps")?;
    // Each line: address, permissions, offset, device, inode, then the path (which may hold
    // spaces) to the end of the line.
    maps.lines()
        .filter_map(|line| line.splitn(6, char::is_whitespace).nth(5))
        .map(|path| Path::new(path.trim_start()))
        .find(|path| {
            path.file_name()
                .is_some_and(|name| name == "libtorch_cpu.so")
        })
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .context("libtorch_cpu.so is not loaded in this process")
}

/// Loads the `libtorch_cuda.so` beside the running `libtorch_cpu.so` (once; later calls find it
/// loaded) and returns its path.
fn load_libtorch_cuda() -> Result<PathBuf> {
    let path = libtorch_folder()?.join("libtorch_cuda.so");
    if !path.is_file() {
        bail!(
            "training.device = \"cuda\": {} does not exist: this libtorch is a CPU-only build \
             (install the CUDA build of torch 2.11)",
            path.display()
        );
    }
    let c_path = CString::new(path.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{} contains a NUL byte", path.display()))?;
    // SAFETY: dlopen with a valid C string; the handle is kept for the process's lifetime (never
    // closed), as libtorch's CUDA backend must stay registered.
    let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let reason = unsafe {
            let err = libc::dlerror();
            if err.is_null() {
                "unknown error".to_owned()
            } else {
                std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned()
            }
        };
        bail!(
            "training.device = \"cuda\": cannot load {}: {reason} (the CUDA libraries torch \
             2.11 depends on must be installed, e.g. `pip install torch==2.11.0`)",
            path.display()
        );
    }
    Ok(path)
}
