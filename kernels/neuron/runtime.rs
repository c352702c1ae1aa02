//! A safe layer over the Neuron runtime: raw bindings ([`super::sys`]) → `Result` wrappers →
//! RAII types, in the style of cudarc.
//!
//! - [`Library`]: libnrt opened at run time (`dlopen`); a missing library or function is an
//!   error naming the path or the function, never a panic.
//! - [`Runtime`]: the initialised runtime, one per process; closed on drop or by
//!   [`Runtime::close`].
//! - [`Model`]: a NEFF loaded on virtual NeuronCores, with its input/output [`TensorInfo`].
//! - [`Tensor`]: runtime-owned memory (device or host placement) written and read as bytes.
//! - [`TensorSet`]: tensors bound by name, the inputs or outputs of one execution.
//!
//! Every failed call is an [`Error::NeuronStatus`] carrying the call, the status name and what
//! was being done. After [`Runtime::close`], objects that outlive it refuse every call with
//! `NRT_CLOSED` instead of calling into a closed runtime (each call holds the runtime's read
//! lock, closing takes the write lock), and handles of different runtimes are never mixed.

use std::ffi::{CStr, CString, c_char};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use super::status::Status;
use super::sys;
use crate::error::{Error, Result};

/// Where the runtime library is looked for when `NEURON_RT_LIB` is unset: the SDK's install
/// path, then the dynamic loader's search path.
pub const DEFAULT_LIBRARY_PATHS: &[&str] = &["/opt/aws/neuron/lib/libnrt.so.1", "libnrt.so.1"];

/// The Neuron runtime library, opened at run time.
pub struct Library {
    raw: sys::NrtLibrary,
    path: PathBuf,
}

/// The function pointer `name` of `library`, or an error naming the function and the library.
macro_rules! function {
    ($library:expr, $name:ident) => {
        *$library.raw.$name.as_ref().map_err(|err| {
            Error::NeuronLibrary(format!(
                "{} does not export `{}`: {err}",
                $library.path.display(),
                stringify!($name)
            ))
        })?
    };
}

impl Library {
    /// Opens the library at `path` (a file path, or a bare name for the loader's search path).
    pub fn open(path: impl AsRef<Path>) -> Result<Arc<Library>> {
        let path = path.as_ref().to_path_buf();
        // SAFETY: opening a shared library runs its initialisers; libnrt's (and the fake's) only
        // set up their own state.
        let raw = unsafe { sys::NrtLibrary::new(&path) }.map_err(|err| {
            Error::NeuronLibrary(format!("cannot open {}: {err}", path.display()))
        })?;
        Ok(Arc::new(Library { raw, path }))
    }

    /// Opens `NEURON_RT_LIB` if set, else the first of [`DEFAULT_LIBRARY_PATHS`] that opens;
    /// the error lists every path tried and why each failed.
    pub fn open_default() -> Result<Arc<Library>> {
        if let Some(path) = std::env::var_os("NEURON_RT_LIB") {
            return Library::open(PathBuf::from(path)).map_err(|err| {
                Error::NeuronLibrary(format!("NEURON_RT_LIB is set but unusable: {err}"))
            });
        }
        let mut failures = Vec::new();
        for path in DEFAULT_LIBRARY_PATHS {
            match Library::open(path) {
                Ok(library) => return Ok(library),
                Err(err) => failures.push(err.to_string()),
            }
        }
        Err(Error::NeuronLibrary(format!(
            "no Neuron runtime found (set NEURON_RT_LIB to libnrt.so's path); tried: {}",
            failures.join("; ")
        )))
    }

    /// The path the library was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The number of virtual NeuronCores on the machine; callable before [`Runtime::init`].
    pub fn total_vnc_count(&self) -> Result<u32> {
        let f = function!(self, nrt_get_total_vnc_count);
        let mut count = 0u32;
        // SAFETY: `count` is a valid out-pointer for the call's duration.
        check("nrt_get_total_vnc_count", unsafe { f(&mut count) }, || {
            String::new()
        })?;
        Ok(count)
    }
}

impl std::fmt::Debug for Library {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Library").field("path", &self.path).finish()
    }
}

/// `Ok` for `NRT_SUCCESS`, else the status as an error with `context()`.
fn check(
    call: &'static str,
    status: sys::NRT_STATUS,
    context: impl FnOnce() -> String,
) -> Result<()> {
    if status == sys::NRT_SUCCESS {
        return Ok(());
    }
    Err(Error::NeuronStatus {
        call,
        status: Status(status).name(),
        context: context(),
    })
}

/// Set while a [`Runtime`] of this process is open: the runtime is initialised once per process.
static RUNTIME_OPEN: AtomicBool = AtomicBool::new(false);

/// State shared by a runtime and every object made from it.
struct Shared {
    library: Arc<Library>,
    /// `true` once closed. Every runtime call holds the read lock for its whole duration and
    /// closing takes the write lock, so no call overlaps `nrt_close` or follows it.
    closed: RwLock<bool>,
}

impl Shared {
    /// The read lock of an open runtime, to hold across one runtime call; `NRT_CLOSED` when
    /// the runtime was closed.
    fn open(
        &self,
        call: &'static str,
        context: impl FnOnce() -> String,
    ) -> Result<RwLockReadGuard<'_, bool>> {
        let closed = self.closed.read().unwrap_or_else(PoisonError::into_inner);
        if *closed {
            return Err(Error::NeuronStatus {
                call,
                status: Status::CLOSED.name(),
                context: format!("{} (the runtime was closed)", context()),
            });
        }
        Ok(closed)
    }

    /// As [`Shared::open`] for releasing a handle in `Drop`: `None` once closed (closing
    /// released everything).
    fn open_for_release(&self) -> Option<RwLockReadGuard<'_, bool>> {
        let closed = self.closed.read().unwrap_or_else(PoisonError::into_inner);
        (!*closed).then_some(closed)
    }

    /// `Ok` when `other` belongs to this runtime, else the error for `call`.
    fn same_runtime(&self, other: &Shared, call: &'static str, what: &str) -> Result<()> {
        if std::ptr::eq(self, other) {
            return Ok(());
        }
        Err(Error::NeuronStatus {
            call,
            status: Status::INVALID_HANDLE.name(),
            context: format!("{what} belongs to another runtime"),
        })
    }

    fn close(&self) {
        let mut closed = self.closed.write().unwrap_or_else(PoisonError::into_inner);
        if *closed {
            return;
        }
        if let Ok(close) = self.library.raw.nrt_close.as_ref() {
            // SAFETY: nrt_close takes no arguments; no other call is in flight (write lock).
            unsafe { close() };
        }
        *closed = true;
        RUNTIME_OPEN.store(false, Ordering::Release);
    }
}

/// The runtime's version, from `nrt_get_version`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Version {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    pub maintenance: u64,
    pub detail: String,
    pub git_hash: String,
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}.{}.{} ({}, {})",
            self.major, self.minor, self.patch, self.maintenance, self.detail, self.git_hash
        )
    }
}

/// The initialised Neuron runtime (`nrt_init` … `nrt_close`).
pub struct Runtime {
    shared: Arc<Shared>,
}

impl Runtime {
    /// Initialises the runtime as a framework-less client. Only one runtime may be open per
    /// process; a second `init` before the first is closed is an error.
    pub fn init(library: Arc<Library>) -> Result<Runtime> {
        let init = function!(library, nrt_init);
        if RUNTIME_OPEN.swap(true, Ordering::AcqRel) {
            return Err(Error::NeuronStatus {
                call: "nrt_init",
                status: Status::INVALID.name(),
                context: "a Neuron runtime is already open in this process".to_owned(),
            });
        }
        let version = CString::new(env!("CARGO_PKG_VERSION")).expect("no NUL in a version");
        // SAFETY: both strings are valid NUL-terminated C strings for the call's duration.
        let status = unsafe {
            init(
                sys::NRT_FRAMEWORK_TYPE_NO_FW,
                version.as_ptr(),
                version.as_ptr(),
            )
        };
        if let Err(err) = check("nrt_init", status, || {
            format!("initialising {}", library.path.display())
        }) {
            RUNTIME_OPEN.store(false, Ordering::Release);
            return Err(err);
        }
        Ok(Runtime {
            shared: Arc::new(Shared {
                library,
                closed: RwLock::new(false),
            }),
        })
    }

    pub fn library(&self) -> &Library {
        &self.shared.library
    }

    /// The runtime library's version.
    pub fn version(&self) -> Result<Version> {
        let library = &self.shared.library;
        let get = function!(library, nrt_get_version);
        let _open = self.shared.open("nrt_get_version", String::new)?;
        // SAFETY: nrt_version_t is plain data; all-zero bytes are a valid value.
        let mut raw: sys::nrt_version_t = unsafe { std::mem::zeroed() };
        // SAFETY: `raw` is a valid out-pointer of the size passed.
        let status = unsafe { get(&mut raw, std::mem::size_of::<sys::nrt_version_t>()) };
        check("nrt_get_version", status, String::new)?;
        Ok(Version {
            major: raw.rt_major,
            minor: raw.rt_minor,
            patch: raw.rt_patch,
            maintenance: raw.rt_maintenance,
            detail: c_chars_to_string(&raw.rt_detail),
            git_hash: c_chars_to_string(&raw.git_hash),
        })
    }

    /// The number of virtual NeuronCores this process may use.
    pub fn visible_vnc_count(&self) -> Result<u32> {
        let library = &self.shared.library;
        let f = function!(library, nrt_get_visible_vnc_count);
        let _open = self.shared.open("nrt_get_visible_vnc_count", String::new)?;
        let mut count = 0u32;
        // SAFETY: `count` is a valid out-pointer for the call's duration.
        let status = unsafe { f(&mut count) };
        check("nrt_get_visible_vnc_count", status, String::new)?;
        Ok(count)
    }

    /// Loads a NEFF image on `vnc_count` virtual cores from `start_vnc` (−1 for either: the
    /// runtime chooses). `label` names the NEFF in errors (its path, usually).
    pub fn load(&self, neff: &[u8], label: &str, start_vnc: i32, vnc_count: i32) -> Result<Model> {
        let library = &self.shared.library;
        let load = function!(library, nrt_load);
        let context = || format!("loading NEFF {label} ({} bytes)", neff.len());
        let raw = {
            let _open = self.shared.open("nrt_load", context)?;
            let mut raw = std::ptr::null_mut();
            // SAFETY: `neff` is valid for `neff.len()` bytes and `raw` is a valid out-pointer.
            let status = unsafe {
                load(
                    neff.as_ptr().cast(),
                    neff.len(),
                    start_vnc,
                    vnc_count,
                    &mut raw,
                )
            };
            check("nrt_load", status, context)?;
            raw
        };
        // The lock is released here: should the tensor info fail, dropping the model takes it
        // again to unload (read locks are never nested).
        let model = Model {
            raw,
            shared: Arc::clone(&self.shared),
            label: label.to_owned(),
            tensors: Vec::new(),
        };
        model.with_tensor_info()
    }

    /// Reads the NEFF at `path` and loads it (see [`Runtime::load`]).
    pub fn load_file(&self, path: &Path, start_vnc: i32, vnc_count: i32) -> Result<Model> {
        let neff = crate::files::read_regular_file(path)?;
        self.load(&neff, &path.display().to_string(), start_vnc, vnc_count)
    }

    /// Allocates a tensor of `size` bytes (device placement on core `vnc`, or host memory).
    pub fn allocate(
        &self,
        placement: Placement,
        vnc: i32,
        size: usize,
        name: &str,
    ) -> Result<Tensor> {
        let library = &self.shared.library;
        let allocate = function!(library, nrt_tensor_allocate);
        let context = || {
            format!(
                "allocating tensor `{name}` of {size} bytes ({placement:?} placement, vnc {vnc})"
            )
        };
        let _open = self.shared.open("nrt_tensor_allocate", context)?;
        let c_name = c_string(name, "tensor name")?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `c_name` is a valid C string and `raw` a valid out-pointer.
        let status = unsafe { allocate(placement.raw(), vnc, size, c_name.as_ptr(), &mut raw) };
        check("nrt_tensor_allocate", status, context)?;
        Ok(Tensor {
            raw,
            shared: Arc::clone(&self.shared),
            name: name.to_owned(),
        })
    }

    /// An empty tensor set.
    pub fn tensor_set<'t>(&self) -> Result<TensorSet<'t>> {
        let library = &self.shared.library;
        let allocate = function!(library, nrt_allocate_tensor_set);
        let _open = self.shared.open("nrt_allocate_tensor_set", String::new)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        let status = unsafe { allocate(&mut raw) };
        check("nrt_allocate_tensor_set", status, String::new)?;
        Ok(TensorSet {
            raw,
            shared: Arc::clone(&self.shared),
            bound: Vec::new(),
        })
    }

    /// Closes the runtime (`nrt_close`). Models, tensors and sets that outlive it refuse every
    /// further call with `NRT_CLOSED`.
    pub fn close(self) {
        self.shared.close();
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shared.close();
    }
}

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Device memory (HBM) of one virtual core.
    Device,
    /// Host memory the device reads.
    Host,
}

impl Placement {
    fn raw(self) -> sys::nrt_tensor_placement_t {
        match self {
            Placement::Device => sys::NRT_TENSOR_PLACEMENT_DEVICE,
            Placement::Host => sys::NRT_TENSOR_PLACEMENT_HOST,
        }
    }
}

/// Element type of a NEFF tensor, as `nrt_dtype_t` codes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NrtDType(pub u32);

impl NrtDType {
    pub const BF16: NrtDType = NrtDType(sys::NRT_DTYPE_BFLOAT16);
    pub const F32: NrtDType = NrtDType(sys::NRT_DTYPE_FLOAT32);
    pub const I32: NrtDType = NrtDType(sys::NRT_DTYPE_INT32);

    /// The type's name, e.g. `bf16`, or `nrt_dtype(n)` for a type moekit does not use.
    pub fn name(self) -> String {
        let known = [
            (sys::NRT_DTYPE_FP8_E3, "fp8_e3"),
            (sys::NRT_DTYPE_FP8_E4, "fp8_e4"),
            (sys::NRT_DTYPE_FP8_E5, "fp8_e5"),
            (sys::NRT_DTYPE_FLOAT16, "f16"),
            (sys::NRT_DTYPE_BFLOAT16, "bf16"),
            (sys::NRT_DTYPE_FLOAT32, "f32"),
            (sys::NRT_DTYPE_FP32R, "fp32r"),
            (sys::NRT_DTYPE_UINT8, "u8"),
            (sys::NRT_DTYPE_UINT16, "u16"),
            (sys::NRT_DTYPE_UINT32, "u32"),
            (sys::NRT_DTYPE_UINT64, "u64"),
            (sys::NRT_DTYPE_INT8, "i8"),
            (sys::NRT_DTYPE_INT16, "i16"),
            (sys::NRT_DTYPE_INT32, "i32"),
            (sys::NRT_DTYPE_INT64, "i64"),
        ];
        known.iter().find(|(code, _)| *code == self.0).map_or_else(
            || format!("nrt_dtype({})", self.0),
            |(_, name)| (*name).to_owned(),
        )
    }
}

/// Whether a NEFF tensor is read or written by the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    Input,
    Output,
}

/// One input or output of a loaded NEFF (`nrt_get_model_tensor_info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub usage: Usage,
    /// Size in bytes.
    pub size: usize,
    pub dtype: NrtDType,
    pub shape: Vec<usize>,
}

/// A NEFF loaded on the device (`nrt_load` … `nrt_unload`).
pub struct Model {
    raw: *mut sys::nrt_model_t,
    shared: Arc<Shared>,
    label: String,
    tensors: Vec<TensorInfo>,
}

// SAFETY: a model handle may be used from any thread (one at a time: `Model` is not `Sync`);
// every call holds the runtime's read lock, so none overlaps `nrt_close`.
unsafe impl Send for Model {}

impl Model {
    /// The NEFF's label (its path, usually).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The NEFF's inputs and outputs, in the order the runtime reports them.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Queries the tensor information once, after loading.
    fn with_tensor_info(mut self) -> Result<Model> {
        let library = &self.shared.library;
        let get = function!(library, nrt_get_model_tensor_info);
        let free = function!(library, nrt_free_model_tensor_info);
        let context = || format!("reading the tensor info of NEFF {}", self.label);
        // Released before `self` is dropped on every return, so an unload after a failure
        // never nests the lock.
        let open = self.shared.open("nrt_get_model_tensor_info", context)?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: `self.raw` is a live model and `raw` a valid out-pointer.
        let status = unsafe { get(self.raw, &mut raw) };
        check("nrt_get_model_tensor_info", status, context)?;
        // SAFETY: on success `raw` points to an array of `tensor_count` entries, each with a
        // NUL-terminated name and `ndim` shape entries, valid until it is freed below.
        let tensors = unsafe {
            let count = usize::try_from((*raw).tensor_count).unwrap_or(0);
            (*raw)
                .tensor_array
                .as_slice(count)
                .iter()
                .map(|info| TensorInfo {
                    name: c_chars_to_string(&info.name),
                    usage: if info.usage == sys::NRT_TENSOR_USAGE_INPUT {
                        Usage::Input
                    } else {
                        Usage::Output
                    },
                    size: info.size,
                    dtype: NrtDType(info.dtype),
                    shape: if info.shape.is_null() {
                        Vec::new()
                    } else {
                        std::slice::from_raw_parts(info.shape, info.ndim as usize)
                            .iter()
                            .map(|&d| d as usize)
                            .collect()
                    },
                })
                .collect()
        };
        // SAFETY: `raw` came from nrt_get_model_tensor_info and is freed once.
        check("nrt_free_model_tensor_info", unsafe { free(raw) }, context)?;
        drop(open);
        self.tensors = tensors;
        Ok(self)
    }

    /// Runs the model once: reads `inputs`, writes `outputs`.
    pub fn execute(&self, inputs: &TensorSet<'_>, outputs: &TensorSet<'_>) -> Result<()> {
        let library = &self.shared.library;
        let execute = function!(library, nrt_execute);
        let context = || format!("executing NEFF {}", self.label);
        let _open = self.shared.open("nrt_execute", context)?;
        self.shared
            .same_runtime(&inputs.shared, "nrt_execute", "the input set")?;
        self.shared
            .same_runtime(&outputs.shared, "nrt_execute", "the output set")?;
        // SAFETY: the model and both sets are live; the sets' tensors outlive the call.
        check(
            "nrt_execute",
            unsafe { execute(self.raw, inputs.raw, outputs.raw) },
            context,
        )
    }

    /// Runs the model `repeat` times back to back (for timing).
    pub fn execute_repeat(
        &self,
        inputs: &TensorSet<'_>,
        outputs: &TensorSet<'_>,
        repeat: i32,
    ) -> Result<()> {
        let library = &self.shared.library;
        let execute = function!(library, nrt_execute_repeat);
        let context = || format!("executing NEFF {} {repeat} times", self.label);
        let _open = self.shared.open("nrt_execute_repeat", context)?;
        self.shared
            .same_runtime(&inputs.shared, "nrt_execute_repeat", "the input set")?;
        self.shared
            .same_runtime(&outputs.shared, "nrt_execute_repeat", "the output set")?;
        // SAFETY: as in `execute`.
        let status = unsafe { execute(self.raw, inputs.raw, outputs.raw, repeat) };
        check("nrt_execute_repeat", status, context)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        let Some(_open) = self.shared.open_for_release() else {
            return;
        };
        if let Ok(unload) = self.shared.library.raw.nrt_unload.as_ref() {
            // SAFETY: the model is live and unloaded once; a failure leaves nothing to undo.
            unsafe { unload(self.raw) };
        }
    }
}

/// Runtime-owned tensor memory (`nrt_tensor_allocate` … `nrt_tensor_free`).
pub struct Tensor {
    raw: *mut sys::nrt_tensor_t,
    shared: Arc<Shared>,
    name: String,
}

// SAFETY: a tensor handle may be used from any thread (one at a time: `Tensor` is not `Sync`);
// every call holds the runtime's read lock, so none overlaps `nrt_close`.
unsafe impl Send for Tensor {}

impl Tensor {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Size in bytes (`nrt_tensor_get_size`).
    pub fn size(&self) -> Result<usize> {
        let library = &self.shared.library;
        let size = function!(library, nrt_tensor_get_size);
        let _open = self
            .shared
            .open("nrt_tensor_get_size", || format!("tensor `{}`", self.name))?;
        // SAFETY: the tensor is live.
        Ok(unsafe { size(self.raw) })
    }

    /// Copies `bytes` into the tensor at byte `offset`.
    pub fn write(&self, bytes: &[u8], offset: usize) -> Result<()> {
        let library = &self.shared.library;
        let write = function!(library, nrt_tensor_write);
        let context = || {
            format!(
                "writing {} bytes at offset {offset} of tensor `{}`",
                bytes.len(),
                self.name
            )
        };
        let _open = self.shared.open("nrt_tensor_write", context)?;
        // SAFETY: `bytes` is valid for its length; the runtime checks the tensor's bounds.
        let status = unsafe { write(self.raw, bytes.as_ptr().cast(), offset, bytes.len()) };
        check("nrt_tensor_write", status, context)
    }

    /// Copies `buf.len()` bytes from byte `offset` of the tensor into `buf`.
    pub fn read(&self, buf: &mut [u8], offset: usize) -> Result<()> {
        let library = &self.shared.library;
        let read = function!(library, nrt_tensor_read);
        let len = buf.len();
        let context = || {
            format!(
                "reading {len} bytes at offset {offset} of tensor `{}`",
                self.name
            )
        };
        let _open = self.shared.open("nrt_tensor_read", context)?;
        // SAFETY: `buf` is valid for writes of its length; the runtime checks the bounds.
        let status = unsafe { read(self.raw, buf.as_mut_ptr().cast(), offset, len) };
        check("nrt_tensor_read", status, context)
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        let Some(_open) = self.shared.open_for_release() else {
            return;
        };
        if let Ok(free) = self.shared.library.raw.nrt_tensor_free.as_ref() {
            // SAFETY: the tensor is live and freed once; nrt_tensor_free nulls the handle.
            unsafe { free(&mut self.raw) };
        }
    }
}

/// Tensors bound by name: one execution's inputs or outputs. Borrows its tensors, so none can
/// be freed while the set may still reach it.
pub struct TensorSet<'t> {
    raw: *mut sys::nrt_tensor_set_t,
    shared: Arc<Shared>,
    bound: Vec<(String, &'t Tensor)>,
}

impl<'t> TensorSet<'t> {
    /// Binds `tensor` under `name`, replacing an earlier binding of that name.
    pub fn add(&mut self, name: &str, tensor: &'t Tensor) -> Result<()> {
        let library = &self.shared.library;
        let add = function!(library, nrt_add_tensor_to_tensor_set);
        let context = || format!("binding tensor `{}` as `{name}`", tensor.name);
        let _open = self.shared.open("nrt_add_tensor_to_tensor_set", context)?;
        self.shared.same_runtime(
            &tensor.shared,
            "nrt_add_tensor_to_tensor_set",
            &format!("tensor `{}`", tensor.name),
        )?;
        let c_name = c_string(name, "tensor name")?;
        // SAFETY: the set and the tensor are live; the set keeps a borrow of the tensor.
        let status = unsafe { add(self.raw, c_name.as_ptr(), tensor.raw) };
        check("nrt_add_tensor_to_tensor_set", status, context)?;
        self.bound.retain(|(bound, _)| bound != name);
        self.bound.push((name.to_owned(), tensor));
        Ok(())
    }

    /// The tensor bound under `name` (`nrt_get_tensor_from_tensor_set`).
    pub fn get(&self, name: &str) -> Result<&'t Tensor> {
        let library = &self.shared.library;
        let get = function!(library, nrt_get_tensor_from_tensor_set);
        let context = || format!("looking up `{name}`");
        let _open = self
            .shared
            .open("nrt_get_tensor_from_tensor_set", context)?;
        let c_name = c_string(name, "tensor name")?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the set is live and `raw` a valid out-pointer.
        let status = unsafe { get(self.raw, c_name.as_ptr(), &mut raw) };
        check("nrt_get_tensor_from_tensor_set", status, context)?;
        self.bound
            .iter()
            .find(|(_, tensor)| tensor.raw == raw)
            .map(|&(_, tensor)| tensor)
            .ok_or_else(|| Error::NeuronStatus {
                call: "nrt_get_tensor_from_tensor_set",
                status: Status::INVALID_HANDLE.name(),
                context: format!("`{name}` is bound to a tensor this set did not bind"),
            })
    }
}

impl Drop for TensorSet<'_> {
    fn drop(&mut self) {
        let Some(_open) = self.shared.open_for_release() else {
            return;
        };
        if let Ok(destroy) = self.shared.library.raw.nrt_destroy_tensor_set.as_ref() {
            // SAFETY: the set is live and destroyed once; its tensors stay owned by their
            // `Tensor`s.
            unsafe { destroy(&mut self.raw) };
        }
    }
}

/// `s` as a C string, or an error if it holds a NUL byte.
fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::NeuronLibrary(format!("{what} `{s}` contains a NUL byte")))
}

/// A fixed-size C character array up to its first NUL (all of it if none), lossily decoded.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}
