//! `moekit`: the kernel-developer command line.
//!
//! - `moekit list`: every kernel with its tensor contract.
//! - `moekit bench [--backend NAME] [--shape NAME] [--tokens T] [--dtype f32|bf16] [--json]`:
//!   times every kernel of one MoE layer against the machine's measured limits.
//! - `moekit run <kernel> --inputs in.safetensors --output out.safetensors [--backend NAME]
//!   [--param name=value ...]`: runs one kernel on named golden tensors.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use moekit::bench::exchange::{self, ExchangeRow};
use moekit::bench::limits::MachineLimits;
use moekit::bench::{BenchConfig, MoeShape};
use moekit::ep::{Communicator, LocalComm};
use moekit::golden::TensorFile;
use moekit::kernel::{Kernel, Params, catalog_table};
use moekit::{BackendKind, DType, Result};
use std::time::Duration;

/// Metadata keys that are known not to be parameters: PyTorch's `format`, and the `kernel` and
/// `backend` that moekit writes into its own outputs.
const NON_PARAM_METADATA: [&str; 3] = ["format", "kernel", "backend"];

#[derive(Parser)]
#[command(
    name = "moekit",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("MOEKIT_BUILD_TARGET"), ", ", env!("MOEKIT_BUILD_PROFILE"), ")"),
    about = "Mixture-of-Experts kernels with NKI-compatible contracts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every kernel with its tensor contract and the available backends.
    List,
    /// Run one kernel on tensors read by contract name from a safetensors file.
    Run {
        /// Kernel name, e.g. `router_topk` or `blockwise_mm_bwd` (see `moekit list`).
        kernel: String,
        /// Input tensors (f32, bf16, i32), named as in the contract.
        #[arg(long)]
        inputs: PathBuf,
        /// Where to write every output by name (f32 values, i32 indices).
        #[arg(long)]
        output: PathBuf,
        /// Backend to run on.
        #[arg(long, default_value = "reference")]
        backend: String,
        /// Kernel parameter `name=value`; overrides the inputs file's metadata.
        #[arg(long = "param", value_name = "NAME=VALUE")]
        params: Vec<String>,
    },
    /// Time every kernel of one MoE layer, forward and backward, against the machine's
    /// measured FMA peak and stream bandwidth.
    Bench {
        /// Backend to measure.
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Layer shape: tiny, qwen3-30b-a3b or qwen3-235b-a22b.
        #[arg(long, default_value = "qwen3-30b-a3b")]
        shape: String,
        /// Tokens T (repeat for several).
        #[arg(long = "tokens", default_values_t = [512])]
        tokens: Vec<usize>,
        /// Storage of float inputs: f32 or bf16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Block size B of the plan.
        #[arg(long, default_value_t = 128)]
        block_size: usize,
        /// Minimum time per kernel, milliseconds.
        #[arg(long, default_value_t = 1000)]
        min_time_ms: u64,
        /// One JSON object per row instead of the table.
        #[arg(long)]
        json: bool,
        /// Skip the libtorch paths (in builds with the `libtorch` feature).
        #[arg(long)]
        no_libtorch: bool,
    },
    /// Time the expert-parallel exchange (dispatch + combine) against the raw all-to-all of
    /// the same bytes. `--comm local` runs R ranks as threads; `--comm mpi` (builds with the
    /// `mpi` feature) runs under `mpirun -n R`.
    EpBench {
        /// Communicator: local or mpi.
        #[arg(long, default_value = "local")]
        comm: String,
        /// Ranks R (local only; under MPI, mpirun's -n).
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Layer shape: tiny, qwen3-moe-small, qwen3-30b-a3b or qwen3-235b-a22b.
        #[arg(long, default_value = "qwen3-30b-a3b")]
        shape: String,
        /// Tokens per rank (repeat for several).
        #[arg(long = "tokens", default_values_t = [512])]
        tokens: Vec<usize>,
        /// Timed iterations (the median is reported).
        #[arg(long, default_value_t = 20)]
        iterations: usize,
    },
}

/// `moekit ep-bench`: rank 0 prints the table.
fn ep_bench(
    comm: &str,
    ranks: usize,
    shape: &str,
    tokens: &[usize],
    iterations: usize,
) -> Result<()> {
    let shape: MoeShape = shape.parse()?;
    let measure = |comm: &dyn Communicator| -> Result<Vec<ExchangeRow>> {
        tokens
            .iter()
            .map(|&t| exchange::run(comm, shape, t, iterations.max(1)))
            .collect()
    };
    match comm {
        "local" => {
            let comms = LocalComm::group(ranks)?;
            let results: Vec<Result<Vec<ExchangeRow>>> = std::thread::scope(|scope| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .map(|comm| scope.spawn(move || measure(&comm)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a benchmark rank panicked"))
                    .collect()
            });
            let mut results = results.into_iter();
            let rows = results.next().expect("at least one rank")?;
            results.try_for_each(|r| r.map(drop))?;
            print!(
                "{}",
                exchange::table("LocalComm (threads, memcpy)", shape, &rows)
            );
        }
        "mpi" => mpi_bench(&measure, shape)?,
        other => {
            return Err(moekit::Error::Param {
                param: "comm".to_owned(),
                message: format!("unknown communicator `{other}`; use local or mpi"),
            });
        }
    }
    Ok(())
}

#[cfg(feature = "mpi")]
fn mpi_bench(
    measure: &dyn Fn(&dyn Communicator) -> Result<Vec<ExchangeRow>>,
    shape: MoeShape,
) -> Result<()> {
    let comm = moekit::ep::MpiComm::init()?;
    let rows = measure(&comm)?;
    if comm.rank() == 0 {
        print!(
            "{}",
            exchange::table("MpiComm (Open MPI, MPI_Alltoallv)", shape, &rows)
        );
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn mpi_bench(_: &dyn Fn(&dyn Communicator) -> Result<Vec<ExchangeRow>>, _: MoeShape) -> Result<()> {
    Err(moekit::Error::Param {
        param: "comm".to_owned(),
        message: "this moekit was built without the `mpi` feature (cargo build --features mpi)"
            .to_owned(),
    })
}

#[allow(clippy::too_many_arguments)] // one per command-line option
fn bench(
    backend: &str,
    shape: &str,
    tokens: &[usize],
    dtype: &str,
    block_size: usize,
    min_time_ms: u64,
    json: bool,
    libtorch: bool,
) -> Result<()> {
    let dtype = match dtype {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => {
            return Err(moekit::Error::Param {
                param: "dtype".to_owned(),
                message: format!("expected f32 or bf16, got `{other}`"),
            });
        }
    };
    let backend: BackendKind = backend.parse()?;
    let shape: MoeShape = shape.parse()?;
    let limits = MachineLimits::measure();
    let mut results = Vec::new();
    for &tokens in tokens {
        let config = BenchConfig {
            backend,
            shape,
            tokens,
            dtype,
            block_size,
            min_time: Duration::from_millis(min_time_ms),
            libtorch,
        };
        results.push(moekit::bench::run(&config)?);
    }
    // Measured before and after the kernels: the higher reading of each limit counts.
    let limits = limits.max(MachineLimits::measure());
    if json {
        for row in results.iter().flat_map(|r| &r.rows) {
            println!("{}", row.to_json(&limits));
        }
    } else {
        print!("{}", moekit::bench::table(&results, &limits));
    }
    Ok(())
}

fn run(
    kernel: &str,
    inputs: &Path,
    output: &Path,
    backend: &str,
    overrides: &[String],
) -> Result<usize> {
    let kernel: Kernel = kernel.parse()?;
    let backend = backend.parse::<BackendKind>()?.create();
    let file = TensorFile::read(inputs)?;
    let (mut params, ignored) =
        Params::from_metadata(file.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    for key in ignored
        .iter()
        .filter(|key| !NON_PARAM_METADATA.contains(key))
    {
        eprintln!("warning: metadata key `{key}` is not a kernel parameter; ignored");
    }
    for item in overrides {
        let (name, value) = item.split_once('=').ok_or_else(|| moekit::Error::Param {
            param: item.clone(),
            message: "expected NAME=VALUE".to_owned(),
        })?;
        params.set(name.trim(), value)?;
    }
    let outputs = kernel.run(backend.as_ref(), &file.tensors, &params)?;
    let written = TensorFile {
        tensors: outputs
            .into_iter()
            .map(|(name, tensor)| (name.to_owned(), tensor))
            .collect(),
        metadata: [
            ("kernel".to_owned(), kernel.name().to_owned()),
            ("backend".to_owned(), backend.name().to_owned()),
        ]
        .into(),
    };
    written.write(output)?;
    Ok(written.tensors.len())
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::List => {
            print!("{}", catalog_table());
            let backends: Vec<&str> = BackendKind::ALL.iter().map(|b| b.name()).collect();
            println!("Backends: {}", backends.join(", "));
            ExitCode::SUCCESS
        }
        Command::Run {
            kernel,
            inputs,
            output,
            backend,
            params,
        } => match run(&kernel, &inputs, &output, &backend, &params) {
            Ok(count) => {
                println!("{kernel}: wrote {count} tensors to {}", output.display());
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        },
        Command::EpBench {
            comm,
            ranks,
            shape,
            tokens,
            iterations,
        } => match ep_bench(&comm, ranks, &shape, &tokens, iterations) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        },
        Command::Bench {
            backend,
            shape,
            tokens,
            dtype,
            block_size,
            min_time_ms,
            json,
            no_libtorch,
        } => match bench(
            &backend,
            &shape,
            &tokens,
            &dtype,
            block_size,
            min_time_ms,
            json,
            !no_libtorch,
        ) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {err}");
                ExitCode::FAILURE
            }
        },
    }
}
