//! The `moekit` binary end to end: golden-tensor files in, outputs by name out, params from
//! metadata and `--param`, a full forward + backward pipeline through files, and every error path
//! exiting non-zero with a message that names the problem.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;
use moekit::contracts::{
    RouterPipeline, RouterTopk, RouterTopkInputs, RouterTopkParams, WeightLayout,
};
use moekit::cpu::blocking::{BLOCKING_VARIABLE, Blocking};
use moekit::cpu::isa::{ISA_VARIABLE, Isa};
use moekit::kernel::{Kernel, Params};
use moekit::reference::ReferenceBackend;
use moekit::{Backend, Tensor};
use moekit_tools::catalog::catalog_markdown;
use moekit_tools::golden::TensorFile;

/// A scratch directory under the target dir, fresh per test.
fn scratch(test: &str) -> PathBuf {
    scratch_dir("cli", test)
}

fn moekit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moekit"))
        .args(args)
        .output()
        .expect("run moekit")
}

fn write(path: &Path, tensors: &[(&str, &Tensor)], metadata: &[(&str, &str)]) {
    TensorFile {
        tensors: tensors
            .iter()
            .map(|(n, t)| (n.to_string(), (*t).clone()))
            .collect(),
        metadata: metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
    .write(path)
    .unwrap();
}

fn run_ok(kernel: &str, inputs: &Path, output: &Path, params: &[&str]) -> BTreeMap<String, Tensor> {
    let mut args = vec![
        "run",
        kernel,
        "--inputs",
        inputs.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    for p in params {
        args.extend(["--param", p]);
    }
    let out = moekit(&args);
    assert!(
        out.status.success(),
        "moekit {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    TensorFile::read(output).unwrap().tensors
}

/// Runs moekit, which must succeed; returns its stdout.
fn moekit_ok(args: &[&str]) -> String {
    let out = moekit(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "moekit {args:?} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The arguments of `moekit check` on the neuron backend (the fake runtime) over `manifest`,
/// then `extra`.
fn check_args<'a>(manifest: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "check",
        "--backend",
        "neuron",
        "--manifest",
        manifest,
        "--library",
        FAKE_NRT,
    ];
    args.extend_from_slice(extra);
    args
}

fn run_err(args: &[&str], needles: &[&str]) {
    let out = moekit(args);
    assert!(!out.status.success(), "moekit {args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "stderr `{stderr}` lacks `{needle}`"
        );
    }
}

fn router_inputs(seed: u64) -> (Tensor, Tensor) {
    let mut rng = SeededRng::new(seed);
    (
        f32_tensor(&[5, 4], &rng.values(20, 1.0)),
        f32_tensor(&[4, 6], &rng.values(24, 1.0)),
    )
}

#[test]
fn list_prints_every_kernel_contract() {
    let out = moekit(&["list"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    // One section per kernel: its name on a line of its own, then its tensors and params.
    let sections: Vec<&str> = text.split("\n\n").collect();
    for kernel in Kernel::ALL {
        let spec = kernel.spec();
        let section = sections
            .iter()
            .find(|s| s.lines().next() == Some(spec.name))
            .unwrap_or_else(|| panic!("no section for {}", spec.name));
        for t in spec.inputs.iter().chain(spec.outputs) {
            let line = section
                .lines()
                .find(|l| l.split_whitespace().next() == Some(t.name))
                .unwrap_or_else(|| panic!("{}: no line for {}", spec.name, t.name));
            assert!(
                line.contains(t.shape) && line.contains(&t.dtype.to_string()),
                "{line}"
            );
            assert_eq!(line.contains("(optional)"), !t.required, "{line}");
        }
        for (param, _) in spec.params {
            assert!(
                section
                    .lines()
                    .any(|l| l.trim_start().starts_with(param.name()))
            );
        }
    }
    assert!(text.contains("Backends: reference"));

    let out = moekit(&["list", "--markdown"]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), catalog_markdown());
}

#[test]
fn router_topk_from_file_equals_the_library_call() {
    let dir = scratch("router");
    let (x, w) = router_inputs(1);
    let inputs = dir.join("in.safetensors");
    let output = dir.join("out.safetensors");
    write(
        &inputs,
        &[("x", &x), ("w", &w)],
        &[("k", "2"), ("norm_topk_prob", "true"), ("format", "pt")],
    );
    let got = run_ok("router_topk", &inputs, &output, &[]);
    let expected = ReferenceBackend
        .router_topk(
            &RouterTopk::new(
                RouterTopkInputs {
                    x: &x,
                    w: &w,
                    w_bias: None,
                    selection_bias: None,
                },
                RouterTopkParams {
                    k: 2,
                    pipeline: RouterPipeline::QWEN3_MOE,
                },
            )
            .unwrap(),
        )
        .unwrap();
    assert_eq!(got["router_logits"], expected.router_logits);
    assert_eq!(got["expert_index"], expected.expert_index);
    assert_eq!(got["topk_affinities"], expected.topk_affinities);
    assert_eq!(got["expert_affinities"], expected.expert_affinities);

    // A metadata key that is not a parameter is reported, and the run goes on.
    write(
        &inputs,
        &[("x", &x), ("w", &w)],
        &[("k", "2"), ("norm_topk", "true")],
    );
    let out = moekit(&[
        "run",
        "router_topk",
        "--inputs",
        inputs.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: metadata key `norm_topk` is not a kernel parameter"),
        "{stderr}"
    );

    // --param overrides metadata.
    let got = run_ok("router_topk", &inputs, &output, &["k=3", "act_fn=SIGMOID"]);
    assert_eq!(got["expert_index"].shape(), &[5, 3]);
}

#[test]
fn bf16_inputs_unused_tensors_and_unused_params_are_accepted() {
    let dir = scratch("bf16");
    let (x, w) = router_inputs(2);
    let (xb, wb) = (x.to_bf16(), w.to_bf16());
    let unused = i32_tensor(&[2], &[7, 7]);
    let inputs = dir.join("in.safetensors");
    write(
        &inputs,
        &[("x", &xb), ("w", &wb), ("something_else", &unused)],
        &[],
    );
    let got = run_ok(
        "router_topk",
        &inputs,
        &dir.join("out.safetensors"),
        &["k=2", "block_size=64", "checkpoint_activation=true"],
    );
    let tensors: BTreeMap<String, Tensor> = [("x".to_owned(), xb), ("w".to_owned(), wb)].into();
    let mut params = Params::default();
    params.set("k", "2").unwrap();
    let expected = Kernel::RouterTopk
        .run(&ReferenceBackend, &tensors, &params)
        .unwrap();
    for (name, tensor) in expected {
        assert_eq!(got[name], tensor, "{name}");
    }
}

#[test]
fn forward_and_backward_pipeline_through_files() {
    let dir = scratch("pipeline");
    let (t, h, e, k, i, b) = (5usize, 4usize, 6usize, 2usize, 3usize, 2usize);
    let mut rng = SeededRng::new(3);
    let (x, w) = router_inputs(3);
    let step = |name: &str, tensors: &[(&str, &Tensor)], params: &[&str]| {
        let inputs = dir.join(format!("{name}.in.safetensors"));
        write(&inputs, tensors, &[]);
        run_ok(
            name,
            &inputs,
            &dir.join(format!("{name}.out.safetensors")),
            params,
        )
    };
    let router = step(
        "router_topk",
        &[("x", &x), ("w", &w)],
        &["k=2", "norm_topk_prob=true"],
    );
    let plan = step(
        "permute",
        &[
            ("expert_index", &router["expert_index"]),
            ("topk_affinities", &router["topk_affinities"]),
        ],
        &[&format!("num_experts={e}"), &format!("block_size={b}")],
    );
    let mut padded = x.to_f64_vec();
    padded.extend(vec![0.0; h]);
    let hidden = f32_tensor(&[t + 1, h], &padded);
    let gate_up = f32_tensor(&[e, h, 2, i], &rng.values(e * h * 2 * i, 1.0));
    let down = f32_tensor(&[e, i, h], &rng.values(e * i * h, 1.0));
    let mm_inputs = [
        ("hidden_states", &hidden),
        (
            "expert_affinities_masked",
            &plan["expert_affinities_masked"],
        ),
        ("gate_up_proj_weight", &gate_up),
        ("down_proj_weight", &down),
        ("token_position_to_id", &plan["token_position_to_id"]),
        ("block_to_expert", &plan["block_to_expert"]),
    ];
    let fwd = step("blockwise_mm", &mm_inputs, &["checkpoint_activation=true"]);
    assert_eq!(fwd["output"].shape(), &[t + 1, h]);
    // The gradient of `output [T+1, H]`, zero in the padding row.
    let mut grad = rng.values(t * h, 1.0);
    grad.extend(vec![0.0; h]);
    let grad = f32_tensor(&[t + 1, h], &grad);
    let mut bwd_inputs = mm_inputs.to_vec();
    bwd_inputs.extend([
        (
            "gate_up_proj_act_checkpoint_T",
            &fwd["gate_up_activations_T"],
        ),
        ("down_proj_act_checkpoint", &fwd["down_activations"]),
        ("output_hidden_states_grad", &grad),
        ("expert_index", &router["expert_index"]),
    ]);
    let bwd = step("blockwise_mm_bwd", &bwd_inputs, &[]);

    // The same chain through the library.
    let lib = |kernel: Kernel, tensors: &[(&str, &Tensor)], params: &[(&str, &str)]| {
        let map: BTreeMap<String, Tensor> = tensors
            .iter()
            .map(|(n, t)| (n.to_string(), (*t).clone()))
            .collect();
        let mut p = Params::default();
        for (n, v) in params {
            p.set(n, v).unwrap();
        }
        kernel.run(&ReferenceBackend, &map, &p).unwrap()
    };
    for (name, tensor) in lib(Kernel::BlockwiseMmBwd, &bwd_inputs, &[]) {
        assert_eq!(bwd[name], tensor, "{name}");
    }
    assert_eq!(bwd["d_topk_affinities"].shape(), &[t, k]);

    // `--param weight_layout=linear` (moekit's own): the same weights stored `[E, 2, I, H]`
    // and `[E, H, I]` give the same output and the weight gradients in that layout.
    let (nki, linear) = (WeightLayout::Nki, WeightLayout::Linear);
    let linear_gate_up = relayout_gate_up(&gate_up, (e, h, i), nki, linear);
    let linear_down = relayout_down(&down, (e, h, i), nki, linear);
    let linear_inputs: Vec<(&str, &Tensor)> = bwd_inputs
        .iter()
        .map(|&(name, tensor)| match name {
            "gate_up_proj_weight" => (name, &linear_gate_up),
            "down_proj_weight" => (name, &linear_down),
            _ => (name, tensor),
        })
        .collect();
    let inputs = dir.join("linear.in.safetensors");
    write(&inputs, &linear_inputs, &[("weight_layout", "linear")]);
    let linear_fwd = run_ok(
        "blockwise_mm",
        &inputs,
        &dir.join("linear_fwd.out.safetensors"),
        &[],
    );
    assert_eq!(linear_fwd["output"], fwd["output"]);
    let mut linear_bwd = run_ok(
        "blockwise_mm_bwd",
        &inputs,
        &dir.join("linear_bwd.out.safetensors"),
        &[],
    );
    let grad = linear_bwd.remove("gate_up_proj_weight_grad").unwrap();
    let grad = relayout_gate_up(&grad, (e, h, i), linear, nki);
    linear_bwd.insert("gate_up_proj_weight_grad".to_owned(), grad);
    let grad = linear_bwd.remove("down_proj_weight_grad").unwrap();
    let grad = relayout_down(&grad, (e, h, i), linear, nki);
    linear_bwd.insert("down_proj_weight_grad".to_owned(), grad);
    assert_eq!(linear_bwd, bwd);

    let router_bwd = step(
        "router_topk_bwd",
        &[
            ("x", &x),
            ("w", &w),
            ("router_logits", &router["router_logits"]),
            ("expert_index", &router["expert_index"]),
            ("d_topk_affinities", &bwd["d_topk_affinities"]),
        ],
        &["norm_topk_prob=true"],
    );
    assert_eq!(router_bwd["d_w"].shape(), &[h, e]);
    let lbl = step(
        "load_balancing_loss_bwd",
        &[
            ("router_logits", &router["router_logits"]),
            ("expert_index", &router["expert_index"]),
            ("d_aux_loss", &f32_tensor(&[1], &[1.0])),
        ],
        &[],
    );
    assert_eq!(lbl["d_router_logits"].shape(), &[t, e]);
    let pb = step(
        "permute_bwd",
        &[
            ("expert_index", &router["expert_index"]),
            (
                "expert_affinities_masked_grad",
                &bwd["expert_affinities_masked_grad"],
            ),
        ],
        &[&format!("num_experts={e}")],
    );
    assert_eq!(pb["d_topk_affinities"], bwd["d_topk_affinities"]);
}

#[test]
fn errors_exit_non_zero_with_a_clear_message() {
    let dir = scratch("errors");
    let (x, w) = router_inputs(4);
    let inputs = dir.join("in.safetensors");
    let output = dir.join("out.safetensors");
    let (i, o) = (inputs.to_str().unwrap(), output.to_str().unwrap());
    write(&inputs, &[("x", &x), ("w", &w)], &[]);
    let run = |kernel: &str, extra: &[&str]| {
        let mut args = vec!["run", kernel, "--inputs", i, "--output", o];
        args.extend(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let check = |args: Vec<String>, needles: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_err(&args, needles);
    };
    check(run("router_topk", &[]), &["`k`", "required"]);
    check(
        run("router_topk", &["--param", "k=9"]),
        &["`k`", "1..=6", "got 9"],
    );
    check(run("router_topk", &["--param", "k=two"]), &["`k`", "`two`"]);
    check(
        run("router_topk", &["--param", "topk=2"]),
        &["topk", "unknown parameter"],
    );
    check(run("router_topk", &["--param", "k"]), &["NAME=VALUE"]);
    check(
        run("router_topk", &["--param", "act_fn=relu"]),
        &["act_fn", "relu", "SOFTMAX or SIGMOID"],
    );
    // Enum values are nki-library's member names, spelled as it spells them.
    check(
        run("router_topk", &["--param", "activation_function=silu"]),
        &[
            "activation_function",
            "`silu`",
            "SiLU, GELU, GELU_Tanh_Approx",
        ],
    );
    check(
        run("router_topk", &["--param", "x_hbm_layout=2"]),
        &["x_hbm_layout", "0 ([H, T]) or 1 ([T, H])"],
    );
    check(
        run("router_topk", &["--param", "k=2", "--backend", "gpu"]),
        &["unknown backend `gpu`", "reference"],
    );
    check(
        run("router_top_k", &[]),
        &["unknown kernel `router_top_k`", "router_topk"],
    );
    check(
        run(
            "permute",
            &["--param", "num_experts=4", "--param", "block_size=2"],
        ),
        &["missing input tensor `expert_index`"],
    );
    assert!(!output.exists(), "no output may be written on failure");

    // A failing run leaves an existing output untouched.
    std::fs::write(&output, b"precious").unwrap();
    check(
        run("blockwise_mm", &[]),
        &["missing input tensor `hidden_states`"],
    );
    assert_eq!(std::fs::read(&output).unwrap(), b"precious");

    // Wrong shape and dtype in the file.
    write(
        &inputs,
        &[("x", &x), ("w", &f32_tensor(&[3, 6], &[0.0; 18]))],
        &[],
    );
    check(
        run("router_topk", &["--param", "k=2"]),
        &["`w`", "[H, E]", "[3, 6]"],
    );
    write(
        &inputs,
        &[("x", &i32_tensor(&[5, 4], &[0; 20])), ("w", &w)],
        &[],
    );
    check(
        run("router_topk", &["--param", "k=2"]),
        &["`x`", "f32 or bf16", "i32"],
    );

    // Unsupported dtypes, extents past i64::MAX (which safetensors accepts in a tensor without
    // elements), corrupt and missing files.
    let write_x = |dtype, shape: Vec<usize>, bytes: &[u8]| {
        let view = safetensors::tensor::TensorView::new(dtype, shape, bytes).unwrap();
        std::fs::write(
            &inputs,
            safetensors::serialize([("x", view)], None).unwrap(),
        )
        .unwrap();
    };
    let f64_bytes: Vec<u8> = [1.0f64, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    write_x(safetensors::Dtype::F64, vec![2], &f64_bytes);
    check(
        run("router_topk", &["--param", "k=2"]),
        &["tensor `x`", "F64"],
    );
    write_x(safetensors::Dtype::F32, vec![0, 1 << 63], &[]);
    check(
        run("router_topk", &["--param", "k=2"]),
        &["in.safetensors", "tensor `x`", "i64::MAX"],
    );
    std::fs::write(&inputs, b"definitely not safetensors").unwrap();
    check(
        run("router_topk", &["--param", "k=2"]),
        &["in.safetensors", "not a valid safetensors file"],
    );
    std::fs::remove_file(&inputs).unwrap();
    check(run("router_topk", &["--param", "k=2"]), &["in.safetensors"]);

    // An output directory that does not exist.
    write(&inputs, &[("x", &x), ("w", &w)], &[]);
    let missing = dir.join("no-such-dir").join("out.safetensors");
    run_err(
        &[
            "run",
            "router_topk",
            "--inputs",
            i,
            "--output",
            missing.to_str().unwrap(),
            "--param",
            "k=2",
        ],
        &["no-such-dir"],
    );
    // An output path that cannot be replaced (a directory): the temporary file written beside
    // it is removed and the directory is untouched.
    let blocked = dir.join("blocked");
    std::fs::create_dir(&blocked).unwrap();
    run_err(
        &[
            "run",
            "router_topk",
            "--inputs",
            i,
            "--output",
            blocked.to_str().unwrap(),
            "--param",
            "k=2",
        ],
        &["blocked"],
    );
    assert!(blocked.is_dir());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn bench_reports_every_kernel_as_json_rows() {
    let out = moekit(&[
        "bench",
        "--backend",
        "cpu",
        "--shape",
        "tiny",
        "--tokens",
        "16",
        "--tokens",
        "33",
        "--dtype",
        "bf16",
        "--min-time-ms",
        "1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    // Every kernel, the whole layer and the experts composed, at each token count.
    let names: Vec<&str> = Kernel::ALL
        .iter()
        .map(|kernel| kernel.name())
        .chain(["moe_layer_fwd_bwd", "experts_fwd_bwd"])
        .collect();
    assert_eq!(rows.len(), 2 * names.len(), "{text}");
    for name in names {
        assert!(
            rows.iter()
                .any(|r| r.contains(&format!("\"kernel\":\"{name}\""))),
            "no {name} row: {text}"
        );
    }
    for row in &rows {
        assert!(row.starts_with('{') && row.ends_with('}'), "{row}");
        for field in [
            "\"backend\":\"cpu\"",
            "\"shape\":\"tiny\"",
            "\"dtype\":\"bf16\"",
            "\"ms\":",
            "\"pct_of_peak\":",
            "\"libtorch_ms\":null",
            "\"vs_libtorch\":null",
            &format!("\"cpu_isa\":\"{}\"", Isa::preferred()),
        ] {
            assert!(row.contains(field), "{row} lacks {field}");
        }
        assert!(
            row.contains("\"gflops\":") != row.contains("\"gbps\":"),
            "{row}"
        );
        assert!(
            row.contains("\"tokens\":16") || row.contains("\"tokens\":33"),
            "{row}"
        );
    }
}

/// `moekit` run with `MOEKIT_CPU_ISA=isa`.
fn moekit_at(isa: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moekit"))
        .env(ISA_VARIABLE, isa)
        .args(args)
        .output()
        .expect("run moekit")
}

#[test]
fn info_and_bench_report_the_instruction_set_level_in_use() {
    let detected = Isa::detected();
    let info = moekit_ok(&["info"]);
    // Without the variable: the detected level, or the one below where the calibration
    // finds bf16 pair dot products slow.
    let preferred = Isa::preferred();
    assert!(
        info.contains(&format!("cpu kernels: {preferred} (detected)"))
            || info.contains(&format!("cpu kernels: {preferred} (calibrated:")),
        "{info}"
    );
    for isa in Isa::ALL {
        if isa <= detected {
            let out = moekit_at(isa.name(), &["info"]);
            let info = String::from_utf8_lossy(&out.stdout);
            let expected = format!("cpu kernels: {isa} (MOEKIT_CPU_ISA; detected: {detected})");
            assert!(out.status.success() && info.contains(&expected), "{info}");
            let bench = moekit_at(
                isa.name(),
                &[
                    "bench", "--shape", "tiny", "--tokens", "8", "--kernel", "permute",
                ],
            );
            let table = String::from_utf8_lossy(&bench.stdout);
            assert!(
                bench.status.success() && table.contains(&expected),
                "{table}"
            );
        } else {
            // A level this CPU lacks: every cpu kernel is an error naming the variable.
            let out = moekit_at(isa.name(), &["check", "--backend", "cpu", "--cases", "1"]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success()
                    && stderr.contains(&format!("MOEKIT_CPU_ISA={isa}: this CPU supports")),
                "{stderr}"
            );
        }
    }
    let out = moekit_at("sse9", &["bench", "--shape", "tiny", "--tokens", "8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("MOEKIT_CPU_ISA=sse9: not a level"),
        "{stderr}"
    );
}

/// `moekit bench --json` on the tiny shape at T = 16, reporting the rows `kernels` names.
fn bench_rows(kernels: &[&str]) -> String {
    let mut args = vec!["bench", "--shape", "tiny", "--tokens", "16"];
    for kernel in kernels {
        args.extend(["--kernel", kernel]);
    }
    args.extend(["--min-time-ms", "1", "--json"]);
    moekit_ok(&args)
}

#[test]
fn bench_reports_only_the_rows_asked_for() {
    let stdout = bench_rows(&["permute", "blockwise_mm_bwd"]);
    let kernels: Vec<&str> = stdout
        .lines()
        .map(|row| {
            let start = row.find("\"kernel\":\"").expect("a kernel field") + 10;
            &row[start..start + row[start..].find('"').unwrap()]
        })
        .collect();
    assert_eq!(kernels, ["permute", "blockwise_mm_bwd"], "{stdout}");
    // The layer row alone still times (and sums) every kernel.
    let stdout = bench_rows(&["moe_layer_fwd_bwd"]);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.contains("\"kernel\":\"moe_layer_fwd_bwd\""),
        "{stdout}"
    );
    // The experts composed: one row, with the forward's and the backward's useful work.
    let stdout = bench_rows(&["experts_fwd_bwd"]);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(
        stdout.contains("\"kernel\":\"experts_fwd_bwd\""),
        "{stdout}"
    );
    assert!(stdout.contains("\"gflops\":"), "{stdout}");
}

#[test]
fn bench_rejects_unknown_shapes_backends_dtypes_and_rows() {
    run_err(
        &["bench", "--shape", "qwen9"],
        &["unknown shape `qwen9`", "qwen3-30b-a3b"],
    );
    run_err(
        &["bench", "--backend", "tpu", "--shape", "tiny"],
        &["unknown backend `tpu`"],
    );
    run_err(
        &["bench", "--dtype", "f16", "--shape", "tiny"],
        &["dtype", "f16"],
    );
    run_err(
        &["bench", "--tokens", "0", "--shape", "tiny"],
        &["tokens", "at least 1"],
    );
    run_err(
        &["bench", "--shape", "tiny", "--kernel", "permut"],
        &["unknown row `permut`", "permute_bwd", "moe_layer_fwd_bwd"],
    );
    // Token counts whose inputs cannot be allocated, and rank counts that cannot split E.
    let max = usize::MAX.to_string();
    run_err(
        &["bench", "--shape", "tiny", "--tokens", &max],
        &["cannot allocate benchmark input `x`"],
    );
    run_err(
        &["ep-bench", "--shape", "tiny", "--tokens", &max],
        &["cannot allocate benchmark input `x`"],
    );
    run_err(
        &["ep-bench", "--shape", "tiny", "--ranks", "100000"],
        &["ranks", "must divide E"],
    );
}

#[test]
fn check_reports_every_output_and_fails_outside_the_tolerance() {
    let stdout = moekit_ok(&["check", "--backend", "cpu", "--cases", "2", "--seed", "3"]);
    for kernel in Kernel::ALL {
        assert!(
            stdout.contains(kernel.name()),
            "{} missing:\n{stdout}",
            kernel.name()
        );
    }
    assert!(stdout.contains("gate_up_proj_weight_grad"), "{stdout}");
    assert!(
        stdout.lines().last().unwrap().starts_with("PASS: "),
        "{stdout}"
    );

    // Nothing to check is an error, not a pass.
    run_err(
        &["check", "--backend", "cpu", "--cases", "0"],
        &["cases", "at least 1"],
    );

    // f32 accumulation cannot match the f64 reference to the last bit: zero tolerance fails.
    let out = moekit(&[
        "check",
        "--backend",
        "cpu",
        "--kernel",
        "blockwise_mm",
        "--cases",
        "1",
        "--rtol",
        "0",
        "--atol",
        "0",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(stdout.contains("FAIL ("), "{stdout}");
    assert!(
        stdout.lines().last().unwrap().starts_with("FAIL: "),
        "{stdout}"
    );

    let out = moekit(&["check", "--backend", "cpu", "--kernel", "nope"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown kernel `nope`"));
}

const FAKE_NRT: &str = moekit_nrt_fake::LIBRARY;

#[test]
fn neuron_info_reports_the_runtime_or_why_it_cannot() {
    let stdout = moekit_ok(&["neuron", "info", "--library", FAKE_NRT]);
    assert!(stdout.contains(&format!("library: {FAKE_NRT}")), "{stdout}");
    assert!(
        stdout.contains("runtime version: 2.0.0.0 (moekit fake runtime"),
        "{stdout}"
    );
    assert!(
        stdout.contains("NeuronCores (virtual): 2 visible of 2"),
        "{stdout}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_moekit"))
        .args(["neuron", "info"])
        .env("NEURON_RT_LIB", "/nonexistent/libnrt.so.1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("NEURON_RT_LIB") && stderr.contains("/nonexistent/libnrt.so.1"),
        "{stderr}"
    );
}

#[test]
fn check_runs_the_neuron_backend_on_every_manifest_entry() {
    let dir = scratch("neuron-check");
    // router_topk at T=6, H=5, E=4, K=2; blockwise_mm at T=6, H=5, E=4, I=3, B=2 (K=2: N=8).
    let router = "moekit-fake-neff 1\nkernel router_topk\nparam act_fn SOFTMAX\nparam norm_topk_prob 1\n\
        input x f32 6 5\ninput w f32 5 4\noutput router_logits f32 6 4\noutput expert_index i32 6 2\n\
        output expert_affinities f32 6 4\n";
    let blockwise = "moekit-fake-neff 1\nkernel blockwise_mm\ninput hidden_states f32 7 5\n\
        input expert_affinities_masked f32 28 1\ninput gate_up_proj_weight f32 4 5 2 3\n\
        input down_proj_weight f32 4 3 5\ninput token_position_to_id i32 16\ninput block_to_expert i32 8 1\n\
        output output f32 7 5\n";
    let blockwise_bwd = "moekit-fake-neff 1\nkernel blockwise_mm_bwd\ninput hidden_states f32 7 5\n\
        input expert_affinities_masked f32 28\ninput gate_up_proj_weight f32 4 5 2 3\n\
        input down_proj_weight f32 4 3 5\ninput token_position_to_id i32 16\ninput block_to_expert i32 8\n\
        input gate_up_proj_act_checkpoint_T f32 8 2 3 2\ninput down_proj_act_checkpoint f32 8 2 5\n\
        input output_hidden_states_grad f32 7 5\noutput hidden_states_grad f32 7 5\n\
        output expert_affinities_masked_grad f32 28\noutput gate_up_proj_weight_grad f32 4 5 2 3\n\
        output down_proj_weight_grad f32 4 3 5\n";
    std::fs::write(dir.join("router.neff"), router).unwrap();
    std::fs::write(dir.join("blockwise.neff"), blockwise).unwrap();
    std::fs::write(dir.join("blockwise_bwd.neff"), blockwise_bwd).unwrap();
    let manifest = dir.join("kernels.toml");
    std::fs::write(
        &manifest,
        "[[kernel]]\nname = \"router_topk\"\nneff = \"router.neff\"\nt = 6\nh = 5\ne = 4\nk = 2\n\
         act_fn = \"SOFTMAX\"\nnorm_topk_prob = true\n\n\
         [[kernel]]\nname = \"blockwise_mm\"\nneff = \"blockwise.neff\"\nt = 6\nh = 5\ne = 4\ni = 3\n\
         block_size = 2\nnum_blocks = 8\n\n\
         [[kernel]]\nname = \"blockwise_mm_bwd\"\nneff = \"blockwise_bwd.neff\"\nt = 6\nh = 5\ne = 4\n\
         i = 3\nblock_size = 2\nnum_blocks = 8\n",
    )
    .unwrap();
    let manifest = manifest.to_str().unwrap();
    let stdout = moekit_ok(&check_args(manifest, &["--cases", "2"]));
    assert!(stdout.starts_with("neuron vs reference"), "{stdout}");
    for needle in [
        "router_topk",
        "topk_affinities",
        "blockwise_mm",
        "output",
        "blockwise_mm_bwd",
        "gate_up_proj_weight_grad",
        "t=6 h=5 e=4 k=2 i=3 b=2",
    ] {
        assert!(stdout.contains(needle), "{needle} missing:\n{stdout}");
    }
    assert!(
        stdout.lines().last().unwrap().starts_with("PASS: 20 of 20"),
        "{stdout}"
    );
    // These shapes are far below what nki-library's kernels take on Trainium2: warnings about
    // the NEFFs, on stderr, while the check itself passes.
    let out = moekit(&check_args(
        manifest,
        &["--kernel", "blockwise_mm", "--cases", "1"],
    ));
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "warning: kernel entry 2 (",
        "blockwise.neff): `h` = 5: nki-library's blockwise_mm needs 512 ≤ H ≤ 8192",
        "`block_size` = 2",
        "warning: kernel entry 1 (",
        "`h` = 5: nki-library's router_topk needs H a multiple of 128",
    ] {
        assert!(stderr.contains(needle), "{needle} missing:\n{stderr}");
    }

    let stdout = moekit_ok(&[
        "neuron",
        "tensors",
        dir.join("blockwise.neff").to_str().unwrap(),
        "--library",
        FAKE_NRT,
    ]);
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 7, "{stdout}");
    assert_eq!(
        rows[1],
        [
            "input",
            "expert_affinities_masked",
            "f32",
            "[28,",
            "1]",
            "112"
        ],
        "{stdout}"
    );
    assert_eq!(
        rows[6],
        ["output", "output", "f32", "[7,", "5]", "140"],
        "{stdout}"
    );
    let out = moekit(&[
        "neuron",
        "tensors",
        dir.join("absent.neff").to_str().unwrap(),
        "--library",
        FAKE_NRT,
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("absent.neff"));

    // A kernel the manifest has no entry for is an error, not a pass of nothing.
    let blockwise_only = dir.join("blockwise_only.toml");
    std::fs::write(
        &blockwise_only,
        "[[kernel]]\nname = \"blockwise_mm\"\nneff = \"blockwise.neff\"\nt = 6\nh = 5\ne = 4\ni = 3\n\
         block_size = 2\nnum_blocks = 8\n",
    )
    .unwrap();
    run_err(
        &check_args(
            blockwise_only.to_str().unwrap(),
            &["--kernel", "router_topk"],
        ),
        &["blockwise_only.toml", "no kernel entry runs `router_topk`"],
    );

    // A NEFF compiled for bf16 inputs, checked with f32 ones: the mismatch is named.
    std::fs::write(
        dir.join("router.neff"),
        router.replace("input x f32", "input x bf16"),
    )
    .unwrap();
    let out = moekit(&check_args(manifest, &["--kernel", "router_topk"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("router.neff: input `x`: the NEFF takes bf16, the call gives f32"),
        "{stderr}"
    );
}

#[test]
fn check_feeds_a_skip_token_neff_the_layout_it_declares() {
    // SkipMode(skip_token=True) at T=6, H=5, E=4, I=3, B=2: hidden_states [T, H], affinities
    // [T·E, 1], output [T, H], −1 in padding slots.
    let dir = scratch("neuron-check-skip-token");
    let forward = "moekit-fake-neff 1\nkernel blockwise_mm\nparam skip_token 1\n\
        input hidden_states f32 6 5\ninput expert_affinities_masked f32 24 1\n\
        input gate_up_proj_weight f32 4 5 2 3\ninput down_proj_weight f32 4 3 5\n\
        input token_position_to_id i32 16\ninput block_to_expert i32 8 1\noutput output f32 6 5\n";
    let backward = "moekit-fake-neff 1\nkernel blockwise_mm_bwd\nparam skip_token 1\n\
        input hidden_states f32 6 5\ninput expert_affinities_masked f32 24 1\n\
        input gate_up_proj_weight f32 4 5 2 3\ninput down_proj_weight f32 4 3 5\n\
        input token_position_to_id i32 16\ninput block_to_expert i32 8 1\n\
        input gate_up_proj_act_checkpoint_T f32 8 2 3 2\ninput down_proj_act_checkpoint f32 8 2 5\n\
        input output_hidden_states_grad f32 6 5\noutput hidden_states_grad f32 6 5\n\
        output expert_affinities_masked_grad f32 24 1\noutput gate_up_proj_weight_grad f32 4 5 2 3\n\
        output down_proj_weight_grad f32 4 3 5\n";
    std::fs::write(dir.join("forward.neff"), forward).unwrap();
    std::fs::write(dir.join("backward.neff"), backward).unwrap();
    let manifest = dir.join("kernels.toml");
    let entry = "t = 6\nh = 5\ne = 4\ni = 3\nblock_size = 2\nnum_blocks = 8\nskip_token = true\n";
    std::fs::write(
        &manifest,
        format!(
            "[[kernel]]\nname = \"blockwise_mm\"\nneff = \"forward.neff\"\n{entry}\n\
             [[kernel]]\nname = \"blockwise_mm_bwd\"\nneff = \"backward.neff\"\n{entry}"
        ),
    )
    .unwrap();
    let stdout = moekit_ok(&check_args(manifest.to_str().unwrap(), &["--cases", "2"]));
    for needle in [
        "blockwise_mm",
        "hidden_states_grad",
        "t=6 h=5 e=4 k=2 i=3 b=2",
    ] {
        assert!(stdout.contains(needle), "{needle} missing:\n{stdout}");
    }
    assert!(
        stdout.lines().last().unwrap().starts_with("PASS"),
        "{stdout}"
    );
    // Storing instead of adding needs one slot per token: N = 8 is top-2's plan.
    let storing = dir.join("storing.toml");
    std::fs::write(
        &storing,
        format!(
            "[[kernel]]\nname = \"blockwise_mm\"\nneff = \"forward.neff\"\n{entry}\
             is_tensor_update_accumulating = false\n"
        ),
    )
    .unwrap();
    run_err(
        &check_args(storing.to_str().unwrap(), &["--cases", "1"]),
        &[
            "kernel entry 1",
            "is_tensor_update_accumulating = false",
            "needs top-k 1, but num_blocks = 8 is the plan of top-k 2",
        ],
    );
}

#[test]
fn bench_times_the_neuron_kernels_on_the_device_against_its_documented_limits() {
    let dir = scratch("neuron-bench");
    // The `tiny` shape (H=64, I=32, E=8, K=2) at T=8, B=4: N = 10 blocks.
    let decls = |lines: &[(&str, &str, &str)]| -> String {
        lines
            .iter()
            .map(|(usage, name, rest)| format!("{usage} {name} {rest}\n"))
            .collect()
    };
    let router = String::from(
        "moekit-fake-neff 1\nkernel router_topk\nparam act_fn SOFTMAX\nparam norm_topk_prob 1\n",
    ) + &decls(&[
        ("input", "x", "f32 8 64"),
        ("input", "w", "f32 64 8"),
        ("output", "router_logits", "f32 8 8"),
        ("output", "expert_index", "i32 8 2"),
        ("output", "expert_affinities", "f32 8 8"),
    ]);
    // The forward's inputs and checkpoints; the backward takes both plus the output gradient.
    let forward_inputs = decls(&[
        ("input", "hidden_states", "f32 9 64"),
        ("input", "expert_affinities_masked", "f32 72"),
        ("input", "gate_up_proj_weight", "f32 8 64 2 32"),
        ("input", "down_proj_weight", "f32 8 32 64"),
        ("input", "token_position_to_id", "i32 40"),
        ("input", "block_to_expert", "i32 10"),
    ]);
    let blockwise = String::from("moekit-fake-neff 1\nkernel blockwise_mm\n")
        + &forward_inputs
        + &decls(&[
            ("output", "output", "f32 9 64"),
            ("output", "gate_up_activations_T", "f32 10 2 32 4"),
            ("output", "down_activations", "f32 10 4 64"),
        ]);
    let blockwise_bwd = String::from("moekit-fake-neff 1\nkernel blockwise_mm_bwd\n")
        + &forward_inputs
        + &decls(&[
            ("input", "gate_up_proj_act_checkpoint_T", "f32 10 2 32 4"),
            ("input", "down_proj_act_checkpoint", "f32 10 4 64"),
            ("input", "output_hidden_states_grad", "f32 9 64"),
            ("output", "hidden_states_grad", "f32 9 64"),
            ("output", "expert_affinities_masked_grad", "f32 72"),
            ("output", "gate_up_proj_weight_grad", "f32 8 64 2 32"),
            ("output", "down_proj_weight_grad", "f32 8 32 64"),
        ]);
    std::fs::write(dir.join("router.neff"), router).unwrap();
    std::fs::write(dir.join("blockwise.neff"), blockwise).unwrap();
    std::fs::write(dir.join("blockwise_bwd.neff"), blockwise_bwd).unwrap();
    let manifest = dir.join("kernels.toml");
    std::fs::write(
        &manifest,
        "[[kernel]]\nname = \"router_topk\"\nneff = \"router.neff\"\nt = 8\n\n\
         [[kernel]]\nname = \"blockwise_mm\"\nneff = \"blockwise.neff\"\nt = 8\ncheckpoint_activation = true\n\n\
         [[kernel]]\nname = \"blockwise_mm_bwd\"\nneff = \"blockwise_bwd.neff\"\nt = 8\n",
    )
    .unwrap();
    let stdout = moekit_ok(&[
        "bench",
        "--backend",
        "neuron",
        "--shape",
        "tiny",
        "--tokens",
        "8",
        "--block-size",
        "4",
        "--min-time-ms",
        "20",
        "--no-libtorch",
        "--manifest",
        manifest.to_str().unwrap(),
        "--library",
        FAKE_NRT,
    ]);
    assert!(
        stdout.starts_with("device: one Trainium2 NeuronCore-v3, bf16 peak 79000 GFLOP/s"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout.lines().skip(2).collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    for (row, kernel) in rows
        .iter()
        .zip(["router_topk", "blockwise_mm", "blockwise_mm_bwd"])
    {
        let fields: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &fields[..5],
            &[kernel, "neuron", "tiny", "8", "f32"],
            "{row}"
        );
        let ms: f64 = fields[5].parse().unwrap();
        assert!(ms > 0.0 && ms.is_finite(), "{row}");
    }
}

#[test]
fn lenient_arguments_and_endless_inputs_are_errors() {
    let dir = scratch("lenient");
    let inputs = dir.join("inputs.safetensors");
    let index = Tensor::from_i32([2, 1], vec![0, 1]).unwrap();
    let affinities = Tensor::from_f32([2, 1], vec![1.0, 1.0]).unwrap();
    write(
        &inputs,
        &[("expert_index", &index), ("topk_affinities", &affinities)],
        &[],
    );
    let output = dir.join("out.safetensors");
    let (inputs, output) = (inputs.to_str().unwrap(), output.to_str().unwrap());
    for (args, needle) in [
        (
            vec!["check", "--backend", "reference"],
            "compares a backend against the reference",
        ),
        (
            vec!["check", "--rtol", "NaN"],
            "finite number of at least 0",
        ),
        (vec!["check", "--atol=-1"], "finite number of at least 0"),
        (vec!["ep-bench", "--tokens", "0"], "at least 1"),
        (vec!["ep-bench", "--iterations", "0"], "at least 1"),
        (
            vec![
                "run",
                "permute",
                "--inputs",
                inputs,
                "--output",
                output,
                "--param",
                "num_experts=2",
                "--param",
                "block_size=1",
                "--param",
                "num_experts=3",
            ],
            "param `num_experts`: given twice with --param",
        ),
        (
            vec![
                "run",
                "permute",
                "--inputs",
                "/dev/zero",
                "--output",
                output,
            ],
            "not a regular file",
        ),
    ] {
        let out = moekit(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_moekit"))
        .args(["neuron", "tensors", "/dev/zero"])
        .env("NEURON_RT_LIB", FAKE_NRT)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("not a regular file"),
        "{stderr}"
    );
}

/// `moekit` with its address space limited to `bytes` (`ulimit -v`).
fn moekit_limited(args: &[&str], bytes: u64) -> Output {
    use std::os::unix::process::CommandExt;
    let mut command = Command::new(env!("CARGO_BIN_EXE_moekit"));
    // Each thread reserves address space (its stack, a malloc arena): few, whatever the host.
    command.args(args).env("RAYON_NUM_THREADS", "2");
    // SAFETY: the closure only calls setrlimit, which is async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            match libc::setrlimit(libc::RLIMIT_AS, &limit) {
                0 => Ok(()),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
    }
    command.output().expect("run moekit")
}

#[test]
fn blockwise_mm_without_checkpoints_allocates_only_the_routed_rows() {
    // Two blocks of 2^19 slots, 4 tokens in all: the slots' expert outputs `[N, B, H]` in f32
    // would take 4 GiB, the routed rows 16 KiB. Under a 2 GiB address space the forward must
    // run without checkpoints, and say what it cannot allocate with them.
    let dir = scratch("padding_heavy_plan");
    let (t, h, e, i, b) = (4usize, 1024usize, 2usize, 16usize, 1usize << 19);
    let mut rng = SeededRng::new(11);
    let mut hidden = rng.values(t * h, 1.0);
    hidden.extend(vec![0.0; h]);
    let hidden = f32_tensor(&[t + 1, h], &hidden);
    let gate_up = f32_tensor(&[e, h, 2, i], &rng.values(e * h * 2 * i, 0.1));
    let down = f32_tensor(&[e, i, h], &rng.values(e * i * h, 0.1));
    // Tokens 0, 1 on expert 0 and 2, 3 on expert 1, affinity 1 - t/8.
    let mut affinities = vec![0.0; (t + 1) * e];
    for token in 0..t {
        affinities[token * e + token / 2] = 1.0 - token as f64 / 8.0;
    }
    let affinities = f32_tensor(&[(t + 1) * e, 1], &affinities);
    let plan = |b: usize| {
        let mut ids = vec![t as i32; 2 * b];
        ids[..2].copy_from_slice(&[0, 1]);
        ids[b..b + 2].copy_from_slice(&[2, 3]);
        (
            Tensor::from_i32([2 * b], ids).unwrap(),
            Tensor::from_i32([2, 1], vec![0, 1]).unwrap(),
        )
    };
    let (ids, experts) = plan(b);
    let inputs = dir.join("inputs.safetensors");
    let tensors = |ids, experts| {
        [
            ("hidden_states", &hidden),
            ("expert_affinities_masked", &affinities),
            ("gate_up_proj_weight", &gate_up),
            ("down_proj_weight", &down),
            ("token_position_to_id", ids),
            ("block_to_expert", experts),
        ]
    };
    write(&inputs, &tensors(&ids, &experts), &[]);
    let output = dir.join("out.safetensors");
    let args = |checkpoint: &'static str| {
        [
            "run",
            "blockwise_mm",
            "--backend",
            "cpu",
            "--inputs",
            inputs.to_str().unwrap(),
            "--output",
            output.to_str().unwrap(),
            "--param",
            checkpoint,
        ]
        .map(str::to_owned)
    };
    let limit = 2 << 30;

    let with = moekit_limited(
        &args("checkpoint_activation=true")
            .each_ref()
            .map(String::as_str),
        limit,
    );
    let stderr = String::from_utf8_lossy(&with.stderr);
    assert!(
        !with.status.success(),
        "4 GiB of checkpoints fit under 2 GiB"
    );
    assert!(stderr.contains("cannot allocate output `"), "{stderr}");

    let without = moekit_limited(
        &args("checkpoint_activation=false")
            .each_ref()
            .map(String::as_str),
        limit,
    );
    assert!(
        without.status.success(),
        "{}",
        String::from_utf8_lossy(&without.stderr)
    );
    // The same routing in blocks of 2 slots, on the reference backend.
    let (small_ids, experts) = plan(2);
    let call = Kernel::BlockwiseMm;
    let small: BTreeMap<String, Tensor> = tensors(&small_ids, &experts)
        .into_iter()
        .map(|(name, tensor)| (name.to_owned(), tensor.clone()))
        .collect();
    let expected = call
        .run(&ReferenceBackend, &small, &Params::default())
        .unwrap();
    let expected = &expected
        .iter()
        .find(|(name, _)| *name == "output")
        .unwrap()
        .1;
    let got = TensorFile::read(&output).unwrap().tensors;
    assert_close("output", &f32s(&got["output"]), &f32s(expected), 1e-5, 1e-6).unwrap();
}

/// `moekit check` runs the selection and plan kernels' NEFFs (the fake runtime's stand-ins) on
/// inputs of the shapes and parameters their entries name: a 0-based `token_base_index`, a
/// `col_start_id` window, a fixed `f_len`, `output_len` and `padding_val`.
#[test]
fn check_runs_the_selection_and_plan_neffs_at_their_entries_parameters() {
    let dir = scratch("neuron-check-plan");
    let neffs = [
        (
            "topk.neff",
            "kernel topk\nparam sorted_flag 0\ninput inp f32 3 20\noutput topk_values f32 3 4\n\
             output topk_indices i32 3 4\n",
            "name = \"topk\"\nrows = 3\nv = 20\nk = 4\nsorted_flag = false\n",
        ),
        (
            "reduce.neff",
            "kernel topk_reduce\nparam K 2\nparam token_base_index 0\ninput input bf16 8 7\n\
             output output bf16 4 5\n",
            "name = \"topk_reduce\"\nt = 4\nh = 5\nk = 2\ntk_padded = 8\ntoken_base_index = 0\n",
        ),
        (
            "nonzero.neff",
            "kernel find_nonzero_indices\ninput input_tensor f32 8 6\ninput col_start_id i32 1\n\
             output indices i32 4 8\noutput nonzero_counts i32 4\n",
            "name = \"find_nonzero_indices\"\nt = 8\nc_full = 6\nn_cols = 4\ncol_start_id = true\n",
        ),
        (
            "flatten.neff",
            "kernel indexed_flatten\nparam f_len 2\nparam padding_val 0\ninput input_tensor i32 4 8\n\
             input row_offsets i32 4\noutput flattened_array i32 32\n",
            "name = \"indexed_flatten\"\ne = 4\nt = 8\nf_len = 2\noutput_len = 32\npadding_val = 0\n",
        ),
    ];
    let mut manifest = String::new();
    for (file, neff, entry) in neffs {
        std::fs::write(dir.join(file), format!("moekit-fake-neff 1\n{neff}")).unwrap();
        manifest += &format!("[[kernel]]\nneff = \"{file}\"\n{entry}\n");
    }
    let path = dir.join("kernels.toml");
    std::fs::write(&path, manifest).unwrap();
    let out = moekit(&check_args(path.to_str().unwrap(), &["--cases", "2"]));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}{stderr}");
    for needle in [
        "topk_values",
        "topk_indices",
        "topk_reduce",
        "nonzero_counts",
        "flattened_array",
    ] {
        assert!(stdout.contains(needle), "{needle} missing:\n{stdout}");
    }
    // Every output of every kernel, in both cases, passes.
    assert!(
        stdout.lines().last().unwrap().starts_with("PASS: 12 of 12"),
        "{stdout}"
    );
    // The shapes nki-library's kernels refuse on Trainium2 are warned of, by entry.
    for needle in [
        "reduce.neff): `h` = 5: nki-library's topk_reduce needs H even",
        "nonzero.neff): `t` = 8: nki-library's find_nonzero_indices needs T a multiple of 128",
        "flatten.neff): `output_len` = 32",
        "`t` / `f_len` = 4",
    ] {
        assert!(stderr.contains(needle), "{needle} missing:\n{stderr}");
    }
}

/// `moekit` run with `MOEKIT_CPU_BLOCKING=blocking`.
fn moekit_blocked(blocking: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moekit"))
        .env(BLOCKING_VARIABLE, blocking)
        .args(args)
        .output()
        .expect("run moekit")
}

#[test]
fn info_and_bench_report_the_blocking_in_use_and_refuse_an_unknown_one() {
    let detected = Blocking::detected();
    let info = moekit_ok(&["info"]);
    assert!(
        info.contains(&format!("; panels: {detected} (detected: ")),
        "{info}"
    );
    for blocking in Blocking::ALL {
        let bench = moekit_blocked(
            blocking.name(),
            &[
                "bench",
                "--shape",
                "tiny",
                "--tokens",
                "8",
                "--kernel",
                "blockwise_mm",
                "--min-time-ms",
                "1",
            ],
        );
        let table = String::from_utf8_lossy(&bench.stdout);
        let expected = format!("; panels: {blocking} (MOEKIT_CPU_BLOCKING; detected: {detected})");
        assert!(
            bench.status.success() && table.contains(&expected),
            "{table}"
        );
    }
    let out = moekit_blocked("wide", &["check", "--backend", "cpu", "--cases", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("MOEKIT_CPU_BLOCKING=wide: not a blocking"),
        "{stderr}"
    );
}
