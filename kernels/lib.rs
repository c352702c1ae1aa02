//! # moekit
//!
//! Mixture-of-Experts kernels whose tensor contracts follow the AWS Neuron NKI library kernels
//! (`router_topk`, the MoE blockwise matmul and its backward), so the same tensors can be fed to
//! an NKI kernel on Trainium2 and to moekit and compared.
//!
//! Units: T tokens, H hidden size, E experts, K top-k, I expert intermediate size, B block size,
//! N blocks, L layers. Layouts are row-major and written outermost first, e.g. `[E, H, 2, I]`.
//!
//! - [`contracts`]: names, shapes, semantics and validation of every kernel.
//! - [`backend`]: the [`Backend`] trait.
//! - [`backends`]: the backends this build provides ([`BackendKind`]), selected by name.
//! - [`mod@reference`]: the f64 oracle backend.
//! - [`cpu`]: the tuned CPU backend (packed GEMMs, SIMD, rayon), deterministic across threads.
//! - [`experts`]: the [`Experts`](experts::Experts) interface, the routed experts composed of
//!   the kernels, forward and backward, for every caller (moekit's own); its sharded
//!   implementation is [`ep::ShardedExperts`].
//! - [`fallback`]: each kernel on a primary backend where it runs it, else on another.
//! - [`ep`]: expert parallelism: rank groups and their collectives.
//! - [`kernel`]: the kernel catalog, and running any kernel by name on named tensors
//!   ([`Kernel::run`](kernel::Kernel::run)).
//! - [`files`]: reading input files (NEFFs, tensor files) of untrusted size.
//! - [`memory`]: the process-wide allocator policy the binaries set for large buffers.
//! - [`neuron`]: the Neuron runtime (libnrt) bound at run time, and the `neuron` backend that
//!   runs NEFFs named in a kernel manifest.
//! - [`random`]: SplitMix64, the seeded generator of the checks, benchmarks and tests.
//!
//! The `moekit` command, the benchmark and check harnesses, named-tensor files and the libtorch
//! conversions live in the `moekit-tools` crate (`kernels/tools/`), outside the library.
//!
//! ## An MoE layer forward: route, plan, expert matmul
//!
//! ```
//! use moekit::contracts::*;
//! use moekit::{BackendKind, Tensor};
//!
//! # fn main() -> moekit::Result<()> {
//! let (t, h, e, k, i) = (4, 8, 4, 2, 16);
//! let backend = BackendKind::Reference.create();
//! let values = |n: usize| (0..n).map(|j| ((j * 37 % 11) as f32 - 5.0) / 10.0).collect();
//! let x = Tensor::from_f32([t, h], values(t * h))?;
//! let w = Tensor::from_f32([h, e], values(h * e))?;
//!
//! let routed = backend.router_topk(&RouterTopk::new(
//!     RouterTopkInputs { x: &x, w: &w, w_bias: None, selection_bias: None },
//!     RouterTopkParams { k, pipeline: RouterPipeline::QWEN3_MOE },
//! )?)?;
//! let plan = backend.permute(&Permute::new(
//!     PermuteInputs {
//!         expert_index: &routed.expert_index,
//!         topk_affinities: &routed.topk_affinities,
//!     },
//!     PermuteParams::new(e, 2),
//! )?)?;
//!
//! // hidden_states carries the all-zero padding token as row T.
//! let mut padded = x.as_f32().unwrap().to_vec();
//! padded.extend(vec![0.0; h]);
//! let hidden_states = Tensor::from_f32([t + 1, h], padded)?;
//! let gate_up = Tensor::from_f32([e, h, 2, i], values(e * h * 2 * i))?;
//! let down = Tensor::from_f32([e, i, h], values(e * i * h))?;
//! let out = backend.blockwise_mm(&BlockwiseMm::new(
//!     BlockwiseMmInputs {
//!         hidden_states: &hidden_states,
//!         expert_affinities_masked: &plan.expert_affinities_masked,
//!         gate_up_proj_weight: &gate_up,
//!         down_proj_weight: &down,
//!         token_position_to_id: &plan.token_position_to_id,
//!         block_to_expert: &plan.block_to_expert,
//!         gate_and_up_proj_bias: None,
//!         down_proj_bias: None,
//!         up_proj_weight: None,
//!     },
//!     BlockwiseMmParams::default(),
//! )?)?;
//! // output [T+1, H], as nki-library's kernels write it: row T is the padding token's (zero).
//! assert_eq!(out.output.shape(), &[t + 1, h]);
//!
//! // Invalid input is an error naming the tensor, never a panic.
//! let err = RouterTopk::new(
//!     RouterTopkInputs { x: &x, w: &x, w_bias: None, selection_bias: None },
//!     RouterTopkParams { k, pipeline: RouterPipeline::QWEN3_MOE },
//! )
//! .unwrap_err();
//! assert!(err.to_string().starts_with("tensor `w`: expected shape [H, E] = [8, _]"));
//! # Ok(())
//! # }
//! ```

pub mod backend;
pub mod backends;
pub mod buffer;
mod composed;
pub mod contracts;
pub mod cpu;
mod dispatch;
pub mod ep;
pub mod error;
pub mod experts;
pub mod fallback;
pub mod files;
pub mod kernel;
pub mod memory;
pub mod neuron;
pub mod random;
pub mod reference;
pub mod tensor;
pub mod threads;
mod uninit;

pub use backend::Backend;
pub use backends::BackendKind;
pub use buffer::Buffer;
pub use error::{Error, Result};
pub use tensor::{DType, Floats, Storage, Tensor};

/// This build: the crate version, the target triple and the Cargo profile, e.g.
/// `0.1.0 (x86_64-unknown-linux-gnu, release)`, so reports can state what was measured.
pub const BUILD: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("MOEKIT_BUILD_TARGET"),
    ", ",
    env!("MOEKIT_BUILD_PROFILE"),
    ")"
);
