//! Expert parallelism: experts sharded over R ranks, tokens exchanged between them.
//!
//! - [`Communicator`]: the collective operations a rank group offers (variable all-to-all,
//!   all-reduce, barrier) and [`agree`], which turns one rank's error into every rank's.
//! - [`LocalComm`]: R ranks as threads of one process over shared memory.
//!
//! On Trainium the same seam is where Neuron's collectives plug in (the all-to-all-v of the
//! NKI a2av kernels runs inside the NEFF); over processes it is MPI's.

mod comm;
mod local;

pub use comm::{Communicator, agree, all_to_all_v_f32, all_to_all_v_i32};
pub use local::LocalComm;
