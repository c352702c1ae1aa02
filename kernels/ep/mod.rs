//! Expert parallelism: experts sharded over R ranks, tokens exchanged between them.
//!
//! - [`Communicator`]: the collective operations a rank group offers (variable all-to-all of
//!   bytes, of words read in place ([`Received`]), and of rows taken where they lie
//!   ([`RowsToSend`]); all-reduce; barrier) and [`agree`], which turns one rank's error into
//!   every rank's.
//! - [`LocalComm`]: R ranks as threads of one process over shared memory; a receiver copies
//!   rows straight from the senders' buffers.
//! - `MpiComm` (feature `mpi`): R ranks as MPI processes, launched with `mpirun -n R`; rows
//!   travel point to point through derived datatypes, without packing.
//! - [`dispatch`] / [`combine`] and their backward passes: token rows to the ranks that own
//!   their experts and the expert outputs back (the NKI library's a2av permute/unpermute).
//! - [`ExpertParallelMoe`]: router → dispatch → permute → blockwise_mm → combine, forward and
//!   backward, on any backend and any communicator.
//!
//! On Trainium the same seam is where Neuron's collectives plug in (the all-to-all-v of the
//! NKI a2av kernels runs inside the NEFF); over processes it is MPI's.

mod comm;
mod exchange;
mod layer;
mod local;
#[cfg(feature = "mpi")]
mod mpi;

pub use comm::{
    Communicator, Received, RowChunks, RowsToSend, agree, agree_with_values, all_to_all_v_values,
};
pub use exchange::{
    DispatchParams, Dispatched, Route, combine, combine_bwd, dispatch, dispatch_bwd,
};
pub use layer::{
    EpGrads, EpInputs, EpParams, EpSaved, ExpertParallelMoe, ShardedExperts, ShardedSaved,
};
pub use local::LocalComm;
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
