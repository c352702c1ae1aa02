//! moekit's MPI shim (`shim.c`): the MPI operations moekit's `MpiComm` uses, on
//! `MPI_COMM_WORLD` or communicators split from it, behind a C ABI of plain integers and
//! opaque handles. The shim is compiled
//! with `mpicc`, so MPI's own headers define its handle types; this crate declares the shim's
//! functions by hand (`shim.h` is their C declaration) and needs no bindings generator.
//!
//! Every function returns 0 on success, an MPI error code, or one of the `MOEKIT_MPI_*` codes.
//! Element kinds name the datatype of a buffer: [`BYTES`], [`F32`], [`U64`]. A request is
//! freed when [`moekit_mpi_test`] reports it complete; a message when [`moekit_mpi_imrecv`]
//! turns it into a request.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};

/// Element kind: bytes (`MPI_BYTE`).
pub const BYTES: c_int = 0;
/// Element kind: `f32` (`MPI_FLOAT`).
pub const F32: c_int = 1;
/// Element kind: `u64` (`MPI_UINT64_T`).
pub const U64: c_int = 2;

/// `moekit_mpi_init`: MPI was initialised before in this process.
pub const MOEKIT_MPI_ALREADY_INITIALISED: c_int = -1;
/// A request or message handle could not be allocated.
pub const MOEKIT_MPI_NO_MEMORY: c_int = -2;

/// A communicator (an `MPI_Comm` the shim allocated): `MPI_COMM_WORLD`'s from
/// [`moekit_mpi_comm_world`], or one from [`moekit_mpi_comm_split`]; freed by
/// [`moekit_mpi_comm_free`].
#[repr(C)]
pub struct moekit_mpi_comm {
    _opaque: [u8; 0],
}

/// A pending non-blocking operation (an `MPI_Request` the shim allocated).
#[repr(C)]
pub struct moekit_mpi_request {
    _opaque: [u8; 0],
}

/// A matched, not yet received message (an `MPI_Message` the shim allocated).
#[repr(C)]
pub struct moekit_mpi_message {
    _opaque: [u8; 0],
}

unsafe extern "C" {
    /// `MPI_Init`, or [`MOEKIT_MPI_ALREADY_INITIALISED`].
    pub fn moekit_mpi_init() -> c_int;
    /// `MPI_Finalize`.
    pub fn moekit_mpi_finalize() -> c_int;
    /// A handle on `MPI_COMM_WORLD`, in `out`.
    pub fn moekit_mpi_comm_world(out: *mut *mut moekit_mpi_comm) -> c_int;
    /// `MPI_Comm_split` of `parent` (collective over its ranks): the ranks of one `color`,
    /// ordered by `key`, in `out`.
    pub fn moekit_mpi_comm_split(
        parent: *const moekit_mpi_comm,
        color: c_int,
        key: c_int,
        out: *mut *mut moekit_mpi_comm,
    ) -> c_int;
    /// `MPI_Comm_free` (not of `MPI_COMM_WORLD`), and the handle freed.
    pub fn moekit_mpi_comm_free(comm: *mut moekit_mpi_comm) -> c_int;
    /// This process's rank of `comm`.
    pub fn moekit_mpi_rank(comm: *const moekit_mpi_comm, rank: *mut c_int) -> c_int;
    /// The size of `comm`.
    pub fn moekit_mpi_size(comm: *const moekit_mpi_comm, size: *mut c_int) -> c_int;
    /// `MPI_Abort` of every process of `MPI_COMM_WORLD`; does not return.
    pub fn moekit_mpi_abort(code: c_int) -> !;
    /// `MPI_Isend` on `comm` of `count` elements of `kind` from `buffer`; the request in `out`.
    pub fn moekit_mpi_isend(
        comm: *const moekit_mpi_comm,
        buffer: *const c_void,
        count: c_int,
        kind: c_int,
        dst: c_int,
        tag: c_int,
        out: *mut *mut moekit_mpi_request,
    ) -> c_int;
    /// `MPI_Isend` of `rows` rows of `row_words` f32 each, row r starting `row_byte_offsets[r]`
    /// bytes after `source` (an `MPI_Type_create_hindexed_block` datatype): sent where they
    /// lie, without packing.
    pub fn moekit_mpi_isend_rows(
        comm: *const moekit_mpi_comm,
        source: *const f32,
        rows: c_int,
        row_byte_offsets: *const i64,
        row_words: c_int,
        dst: c_int,
        tag: c_int,
        out: *mut *mut moekit_mpi_request,
    ) -> c_int;
    /// `MPI_Irecv` of at most `count` elements of `kind` into `buffer`.
    pub fn moekit_mpi_irecv(
        comm: *const moekit_mpi_comm,
        buffer: *mut c_void,
        count: c_int,
        kind: c_int,
        src: c_int,
        tag: c_int,
        out: *mut *mut moekit_mpi_request,
    ) -> c_int;
    /// `MPI_Test`: `done` set when the request completed (it is then freed), with `count`, the
    /// elements of `kind` it received (−1 if not a whole number of them).
    pub fn moekit_mpi_test(
        request: *mut moekit_mpi_request,
        kind: c_int,
        done: *mut c_int,
        count: *mut i64,
    ) -> c_int;
    /// `MPI_Improbe` from `src` with `tag`: `found` set when a message is there, with the
    /// message in `message` and its length in elements of `kind` in `count` (−1 if not whole).
    pub fn moekit_mpi_improbe(
        comm: *const moekit_mpi_comm,
        src: c_int,
        tag: c_int,
        kind: c_int,
        found: *mut c_int,
        message: *mut *mut moekit_mpi_message,
        count: *mut i64,
    ) -> c_int;
    /// `MPI_Imrecv` of `message` (freed) into `buffer`, `count` elements of `kind`.
    pub fn moekit_mpi_imrecv(
        buffer: *mut c_void,
        count: c_int,
        kind: c_int,
        message: *mut moekit_mpi_message,
        out: *mut *mut moekit_mpi_request,
    ) -> c_int;
}
