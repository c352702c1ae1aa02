//! `moekit`: the kernel-developer command line.
//!
//! - `moekit list`: every kernel with its tensor contract.
//! - `moekit info`: the host's CPU, caches and the instruction-set level the cpu kernels use.
//! - `moekit bench [--backend NAME] [--shape NAME] [--tokens T] [--dtype f32|bf16] [--json]`:
//!   times every kernel of one MoE layer against the machine's measured limits.
//! - `moekit run <kernel> --inputs in.safetensors --output out.safetensors [--backend NAME]
//!   [--param name=value ...]`: runs one kernel on named golden tensors.
//! - `moekit check --backend cpu|neuron [--kernel K] [--cases N] [--seed S]`: random inputs
//!   through the backend and the reference, max abs/rel error per output, PASS/FAIL.
//! - `moekit neuron info`: the Neuron runtime's version and NeuronCores, or why it is unusable.
//! - `moekit neuron tensors <neff>`: a NEFF's input and output tensors.
//! - `moekit ep-bench [--comm local|mpi] [--ranks R]`: the expert-parallel exchange against
//!   the raw all-to-all of the same bytes.
//!
//! Enumerations are typed arguments (clap value enums, or the library's names, whose errors
//! list the known ones); every error reaches `main`, which prints it and sets the exit status.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use moekit::backend::Tolerance;
use moekit::backends::BackendOptions;
use moekit::ep::{Communicator, LocalComm};
use moekit::kernel::{Kernel, Params};
use moekit::neuron::{Library, NeuronConfig, Runtime, Usage};
use moekit::{Backend, BackendKind, DType, Result};
use moekit_tools::bench::exchange::{self, ExchangeRow};
use moekit_tools::bench::limits::MachineLimits;
use moekit_tools::bench::{BenchConfig, RowSelection};
use moekit_tools::catalog::{catalog_markdown, catalog_table};
use moekit_tools::check::{self, CheckRow};
use moekit_tools::golden::TensorFile;
use moekit_tools::layer::MoeShape;
use moekit_tools::machine::Host;

/// Metadata keys that are known not to be parameters: PyTorch's `format`, and the `kernel` and
/// `backend` that moekit writes into its own outputs.
const NON_PARAM_METADATA: [&str; 3] = ["format", "kernel", "backend"];

#[derive(Parser)]
#[command(
    name = "moekit",
    version = moekit::BUILD,
    about = "Mixture-of-Experts kernels with NKI-compatible contracts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print every kernel with its tensor contract and the available backends.
    List {
        /// Print the kernel table of README.md instead (Markdown).
        #[arg(long)]
        markdown: bool,
    },
    /// Print the host's CPU, its caches, and the instruction-set level the cpu backend's
    /// kernels run at (the fastest detected, or the one MOEKIT_CPU_ISA names).
    Info,
    /// Run one kernel on tensors read by contract name from a safetensors file.
    Run {
        /// Kernel name, e.g. `router_topk` or `blockwise_mm_bwd` (see `moekit list`).
        #[arg(value_parser = named::<Kernel>)]
        kernel: Kernel,
        /// Input tensors (f32, bf16, i32), named as in the contract.
        #[arg(long)]
        inputs: PathBuf,
        /// Where to write every output by name (f32 values, i32 indices).
        #[arg(long)]
        output: PathBuf,
        /// Backend to run on: reference, cpu or neuron.
        #[arg(long, default_value = "reference", value_parser = named::<BackendKind>)]
        backend: BackendKind,
        #[command(flatten)]
        neuron: NeuronArgs,
        /// Kernel parameter `name=value`; overrides the inputs file's metadata.
        #[arg(long = "param", value_name = "NAME=VALUE")]
        params: Vec<String>,
    },
    /// Time every kernel of one MoE layer, forward and backward, against the machine's
    /// measured FMA peak and stream bandwidth (on neuron: the kernels it runs, timed on the
    /// device with nrt_execute_repeat, against a NeuronCore's documented limits).
    Bench {
        /// Backend to measure: reference, cpu or neuron.
        #[arg(long, default_value = "cpu", value_parser = named::<BackendKind>)]
        backend: BackendKind,
        /// Layer shape: tiny, qwen3-moe-small, qwen3-30b-a3b or qwen3-235b-a22b.
        #[arg(long, default_value = "qwen3-30b-a3b", value_parser = named::<MoeShape>)]
        shape: MoeShape,
        /// Tokens T (repeat for several).
        #[arg(long = "tokens", default_values_t = [512])]
        tokens: Vec<usize>,
        /// Storage of float inputs.
        #[arg(long, value_enum, default_value_t = FloatStorage::F32)]
        dtype: FloatStorage,
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
        /// Only this row (a kernel name as printed, e.g. permute or blockwise_mm_bwd; repeat
        /// for several; default: every row). moe_layer_fwd_bwd times every kernel it sums;
        /// experts_fwd_bwd times the experts composed (moekit::experts::LocalExperts).
        #[arg(long = "kernel")]
        kernels: Vec<String>,
        #[command(flatten)]
        neuron: NeuronArgs,
    },
    /// Check a backend against the reference on random inputs: max abs and rel error per
    /// output tensor, PASS/FAIL against the backend's documented tolerance; exits non-zero on
    /// any FAIL. On neuron the cases are the shapes of the manifest's entries.
    Check {
        /// Backend to check: cpu or neuron.
        #[arg(long, default_value = "cpu", value_parser = named::<BackendKind>)]
        backend: BackendKind,
        /// Check one kernel only (default: every kernel the backend runs).
        #[arg(long, value_parser = named::<Kernel>)]
        kernel: Option<Kernel>,
        /// Random cases (per manifest entry on neuron).
        #[arg(long, default_value_t = 8)]
        cases: usize,
        /// Seed of the random sizes and values.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Storage of float inputs.
        #[arg(long, value_enum, default_value_t = FloatStorage::F32)]
        dtype: FloatStorage,
        /// Relative tolerance (default: the backend's documented one).
        #[arg(long, value_parser = tolerance)]
        rtol: Option<f64>,
        /// Absolute tolerance, times max(1, max |reference|) (default: the backend's).
        #[arg(long, value_parser = tolerance)]
        atol: Option<f64>,
        #[command(flatten)]
        neuron: NeuronArgs,
    },
    /// The Neuron runtime.
    Neuron {
        #[command(subcommand)]
        command: NeuronCommand,
    },
    /// Time the expert-parallel exchange (dispatch + combine) against the raw all-to-all of
    /// the same bytes. `--comm local` runs R ranks as threads; `--comm mpi` (builds with the
    /// `mpi` feature) runs under `mpirun -n R`.
    EpBench {
        /// Communicator: threads of this process (local) or MPI processes (mpi).
        #[arg(long, value_enum, default_value_t = Comm::Local)]
        comm: Comm,
        /// Ranks R (local only; under MPI, mpirun's -n).
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// Layer shape: tiny, qwen3-moe-small, qwen3-30b-a3b or qwen3-235b-a22b.
        #[arg(long, default_value = "qwen3-30b-a3b", value_parser = named::<MoeShape>)]
        shape: MoeShape,
        /// Tokens per rank (repeat for several).
        #[arg(long = "tokens", default_values_t = [512], value_parser = at_least_one)]
        tokens: Vec<usize>,
        /// Timed iterations (the median is reported).
        #[arg(long, default_value_t = 20, value_parser = at_least_one)]
        iterations: usize,
    },
}

/// Storage of float inputs (`--dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum FloatStorage {
    F32,
    Bf16,
}

impl FloatStorage {
    fn dtype(self) -> DType {
        match self {
            FloatStorage::F32 => DType::F32,
            FloatStorage::Bf16 => DType::BF16,
        }
    }
}

/// How `ep-bench` runs its ranks (`--comm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Comm {
    /// Threads of this process, exchanging by memcpy.
    Local,
    /// MPI processes (`mpirun -n R`; builds with the `mpi` feature).
    Mpi,
}

/// A value of a type moekit knows by name (backends, kernels, shapes): an unknown name is the
/// library's error, which lists the known ones.
fn named<T: FromStr<Err = moekit::Error>>(value: &str) -> Result<T> {
    value.parse()
}

/// A count of at least 1 (`--tokens`, `--iterations`).
fn at_least_one(value: &str) -> std::result::Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("expected an integer of at least 1, got `{value}`")),
    }
}

/// A tolerance: a finite number of at least 0.
fn tolerance(value: &str) -> std::result::Result<f64, String> {
    match value.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err(format!(
            "expected a finite number of at least 0, got `{value}`"
        )),
    }
}

/// Where the `neuron` backend finds libnrt and its kernel manifest.
#[derive(clap::Args)]
struct NeuronArgs {
    /// neuron: the kernel manifest (default: $MOEKIT_NEURON_MANIFEST, else ./kernels.toml).
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// neuron: the libnrt to open (default: $NEURON_RT_LIB, else
    /// /opt/aws/neuron/lib/libnrt.so.1, else the loader's search path).
    #[arg(long)]
    library: Option<PathBuf>,
}

impl NeuronArgs {
    /// The backend options these flags give (the environment's where not given).
    fn options(&self) -> BackendOptions {
        let defaults = NeuronConfig::from_env();
        BackendOptions {
            neuron: NeuronConfig {
                library: self.library.clone().or(defaults.library),
                manifest: self.manifest.clone().unwrap_or(defaults.manifest),
            },
        }
    }
}

#[derive(Subcommand)]
enum NeuronCommand {
    /// Print the runtime library, its version and the NeuronCores, or why it cannot be used.
    Info {
        /// The libnrt to open (default: $NEURON_RT_LIB, else the SDK's path, else the loader's).
        #[arg(long)]
        library: Option<PathBuf>,
    },
    /// Load a NEFF and print its input and output tensors (name, dtype, shape, bytes): the
    /// names the neuron backend binds by contract name.
    Tensors {
        /// The NEFF file.
        neff: PathBuf,
        /// The libnrt to open (default: $NEURON_RT_LIB, else the SDK's path, else the loader's).
        #[arg(long)]
        library: Option<PathBuf>,
    },
}

/// Opens the libnrt at `path`, or the default one.
fn open_library(path: Option<&Path>) -> Result<std::sync::Arc<Library>> {
    match path {
        Some(path) => Library::open(path),
        None => Library::open_default(),
    }
}

/// `moekit neuron tensors`.
fn neuron_tensors(neff: &Path, library: Option<&Path>) -> Result<()> {
    let runtime = Runtime::init(open_library(library)?)?;
    let model = runtime.load_file(neff, -1, -1)?;
    println!(
        "{:<6} {:<32} {:<6} {:<20} {:>12}",
        "usage", "name", "dtype", "shape", "bytes"
    );
    for info in model.tensors() {
        let usage = match info.usage {
            Usage::Input => "input",
            Usage::Output => "output",
        };
        println!(
            "{usage:<6} {:<32} {:<6} {:<20} {:>12}",
            info.name,
            info.dtype.name(),
            format!("{:?}", info.shape),
            info.size
        );
    }
    Ok(())
}

/// `moekit neuron info`.
fn neuron_info(library: Option<&Path>) -> Result<()> {
    let library = open_library(library)?;
    println!("library: {}", library.path().display());
    println!("bindings: {}", moekit_nrt_sys::SOURCE);
    let total = library.total_vnc_count()?;
    let runtime = Runtime::init(library)?;
    println!("runtime version: {}", runtime.version()?);
    println!(
        "NeuronCores (virtual): {} visible of {total}",
        runtime.visible_vnc_count()?
    );
    Ok(())
}

/// What a command found, for its exit status.
enum Outcome {
    /// Done (a check: every output within its tolerance).
    Pass,
    /// A check with outputs outside their tolerance: its report says which.
    Fail,
}

/// Runs one command; every error reaches [`main`], the one place that prints it and sets the
/// exit status.
fn execute(command: Command) -> Result<Outcome> {
    match command {
        Command::List { markdown: true } => print!("{}", catalog_markdown()),
        Command::Info => print!("{}", Host::describe()),
        Command::List { markdown: false } => {
            print!("{}", catalog_table());
            let backends: Vec<&str> = BackendKind::ALL.iter().map(|b| b.name()).collect();
            println!("Backends: {}", backends.join(", "));
        }
        Command::Run {
            kernel,
            inputs,
            output,
            backend,
            neuron,
            params,
        } => {
            let backend = backend.create_with(neuron.options());
            let count = run(kernel, &inputs, &output, backend.as_ref(), &params)?;
            println!(
                "{}: wrote {count} tensors to {}",
                kernel.name(),
                output.display()
            );
        }
        Command::Check {
            backend,
            kernel,
            cases,
            seed,
            dtype,
            rtol,
            atol,
            neuron,
        } => {
            let args = CheckArgs {
                kernel,
                cases,
                seed,
                dtype: dtype.dtype(),
                rtol,
                atol,
            };
            if !check(backend, neuron.options(), &args)? {
                return Ok(Outcome::Fail);
            }
        }
        Command::Neuron { command } => match command {
            NeuronCommand::Info { library } => neuron_info(library.as_deref())?,
            NeuronCommand::Tensors { neff, library } => neuron_tensors(&neff, library.as_deref())?,
        },
        Command::EpBench {
            comm,
            ranks,
            shape,
            tokens,
            iterations,
        } => ep_bench(comm, ranks, shape, &tokens, iterations)?,
        Command::Bench {
            backend,
            shape,
            tokens,
            dtype,
            block_size,
            min_time_ms,
            json,
            no_libtorch,
            kernels,
            neuron,
        } => {
            let rows = RowSelection::new(&kernels)?;
            let configs: Vec<BenchConfig> = tokens
                .into_iter()
                .map(|tokens| BenchConfig {
                    shape,
                    tokens,
                    dtype: dtype.dtype(),
                    block_size,
                    min_time: Duration::from_millis(min_time_ms),
                    libtorch: !no_libtorch,
                    rows: rows.clone(),
                })
                .collect();
            let backend: Arc<dyn Backend> = Arc::from(backend.create_with(neuron.options()));
            bench(&backend, &configs, json)?;
        }
    }
    Ok(Outcome::Pass)
}

/// The options of `moekit check` beyond the backend.
struct CheckArgs {
    kernel: Option<Kernel>,
    cases: usize,
    seed: u64,
    dtype: DType,
    rtol: Option<f64>,
    atol: Option<f64>,
}

/// `moekit check`: prints the report; `Ok(false)` if any output is outside the tolerance.
fn check(kind: BackendKind, options: BackendOptions, args: &CheckArgs) -> Result<bool> {
    if kind == BackendKind::Reference {
        return Err(moekit::Error::param(
            "backend",
            "`check` compares a backend against the reference; choose cpu or neuron",
        ));
    }
    let backend = kind.create_with(options);
    let defaults = backend.tolerance(args.dtype);
    let tolerance = Tolerance {
        rtol: args.rtol.unwrap_or(defaults.rtol),
        atol: args.atol.unwrap_or(defaults.atol),
    };
    let plan = check::plan(
        backend.as_ref(),
        args.kernel,
        args.cases,
        args.seed,
        args.dtype,
    )?;
    // Shapes the device's own kernel library would refuse: the host checks them anyway, so
    // these are warnings about the compiled kernels.
    for warning in &plan.warnings {
        eprintln!("warning: {warning}");
    }
    let rows = check::check(backend.as_ref(), &plan.cases, tolerance)?;
    print!("{}", check::table(backend.name(), &rows, tolerance));
    Ok(rows.iter().all(CheckRow::pass))
}

/// `moekit ep-bench`: rank 0 prints the table.
fn ep_bench(
    comm: Comm,
    ranks: usize,
    shape: MoeShape,
    tokens: &[usize],
    iterations: usize,
) -> Result<()> {
    let measure = |comm: &dyn Communicator| -> Result<Vec<ExchangeRow>> {
        tokens
            .iter()
            .map(|&t| exchange::run(comm, shape, t, iterations))
            .collect()
    };
    match comm {
        Comm::Local => {
            // Checked before the group is made: each rank holds E/R experts.
            if ranks == 0 || !shape.e.is_multiple_of(ranks) {
                return Err(moekit::Error::param(
                    "ranks",
                    format!(
                        "must divide E = {} (each rank holds E/R experts), got {ranks}",
                        shape.e
                    ),
                ));
            }
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
        Comm::Mpi => mpi_bench(&measure, shape)?,
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
            exchange::table("MpiComm (Open MPI, point-to-point rounds)", shape, &rows)
        );
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn mpi_bench(_: &dyn Fn(&dyn Communicator) -> Result<Vec<ExchangeRow>>, _: MoeShape) -> Result<()> {
    Err(moekit::Error::param(
        "comm",
        "this moekit was built without the `mpi` feature \
         (cargo build -p moekit-tools --features mpi)",
    ))
}

/// `moekit bench`: each of `configs`, as a table or JSON lines.
fn bench(backend: &Arc<dyn Backend>, configs: &[BenchConfig], json: bool) -> Result<()> {
    // An accelerator's kernels are set against its documented limits, the host's against its
    // limits measured before and after the kernels (the higher reading of each counts).
    let measure = || MachineLimits::of(backend.device());
    let limits = measure();
    let results = configs
        .iter()
        .map(|config| moekit_tools::bench::run(backend, config))
        .collect::<Result<Vec<_>>>()?;
    let limits = limits.max(measure());
    if json {
        for row in results.iter().flat_map(|r| &r.rows) {
            println!("{}", row.to_json(&limits));
        }
    } else {
        print!("{}", moekit_tools::bench::table(&results, &limits));
    }
    Ok(())
}

/// `moekit run`: the kernel on the inputs file's tensors, its parameters from the file's
/// metadata and `overrides` (`name=value`); writes every output and returns how many.
fn run(
    kernel: Kernel,
    inputs: &Path,
    output: &Path,
    backend: &dyn Backend,
    overrides: &[String],
) -> Result<usize> {
    let file = TensorFile::read(inputs)?;
    let (mut params, ignored) =
        Params::from_metadata(file.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    for key in ignored
        .iter()
        .filter(|key| !NON_PARAM_METADATA.contains(key))
    {
        eprintln!("warning: metadata key `{key}` is not a kernel parameter; ignored");
    }
    let mut given = std::collections::BTreeSet::new();
    for item in overrides {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| moekit::Error::param(item, "expected NAME=VALUE"))?;
        let name = name.trim();
        if !given.insert(name) {
            return Err(moekit::Error::param(name, "given twice with --param"));
        }
        params.set(name, value)?;
    }
    let outputs = kernel.run(backend, &file.tensors, &params)?;
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
    moekit::memory::retain_freed_buffers();
    match execute(Cli::parse().command) {
        Ok(Outcome::Pass) => ExitCode::SUCCESS,
        Ok(Outcome::Fail) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}
