//! The Neuron runtime binding through the real dynamic-loading path, against the fake runtime
//! (`ffi/fake/fake_nrt.c`, crate `moekit-nrt-fake`): the full lifecycle and every error path.

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use moekit::Error;
use moekit::neuron::{
    Library, Model, NrtDType, Placement, Runtime, Status, Tensor, TensorInfo, TensorSet, Usage,
};

const FAKE: &str = moekit_nrt_fake::LIBRARY;
const FAKE_WITHOUT_EXECUTE_REPEAT: &str = moekit_nrt_fake::LIBRARY_WITHOUT_EXECUTE_REPEAT;

/// One runtime per process: tests that open one take this lock.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn fake() -> Arc<Library> {
    Library::open(FAKE).expect("the fake runtime opens")
}

/// A copy model: `a [2, 3] f32` and `b [4] i32` in, the same bytes out as `a_out` and `b_out`.
const COPY_NEFF: &str = "moekit-fake-neff 1
kernel copy
input a f32 2 3
input b i32 4
output a_out f32 2 3
output b_out i32 4
";

/// One device tensor per tensor of `model`, in its order.
fn allocate_all(runtime: &Runtime, model: &Model) -> Vec<Tensor> {
    model
        .tensors()
        .iter()
        .map(|t| {
            runtime
                .allocate(Placement::Device, 0, t.size, &t.name)
                .unwrap()
        })
        .collect()
}

/// `tensors` (from [`allocate_all`]) bound by name into the model's input and output sets.
fn bind_all<'t>(
    runtime: &Runtime,
    model: &Model,
    tensors: &'t [Tensor],
) -> (TensorSet<'t>, TensorSet<'t>) {
    let (mut inputs, mut outputs) = (runtime.tensor_set().unwrap(), runtime.tensor_set().unwrap());
    for (info, tensor) in model.tensors().iter().zip(tensors) {
        let set = if info.usage == Usage::Input {
            &mut inputs
        } else {
            &mut outputs
        };
        set.add(&info.name, tensor).unwrap();
    }
    (inputs, outputs)
}

fn status_of(err: &Error) -> Option<&str> {
    match err {
        Error::NeuronStatus { status, .. } => Some(status),
        _ => None,
    }
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn the_full_lifecycle_moves_bytes_through_a_model() {
    let _guard = exclusive();
    let library = fake();
    assert_eq!(library.path(), Path::new(FAKE));
    assert_eq!(
        library.total_vnc_count().unwrap(),
        2,
        "callable before init"
    );

    let runtime = Runtime::init(Arc::clone(&library)).unwrap();
    let version = runtime.version().unwrap();
    assert_eq!((version.major, version.minor), (2, 0));
    assert!(version.detail.contains("fake"), "{version}");
    assert_eq!(runtime.visible_vnc_count().unwrap(), 2);

    let model = runtime
        .load(COPY_NEFF.as_bytes(), "copy.neff", -1, -1)
        .unwrap();
    let info = |name: &str, usage, dtype, shape: &[usize], size| TensorInfo {
        name: name.to_owned(),
        usage,
        size,
        dtype,
        shape: shape.to_vec(),
    };
    assert_eq!(
        model.tensors(),
        &[
            info("a", Usage::Input, NrtDType::F32, &[2, 3], 24),
            info("b", Usage::Input, NrtDType::I32, &[4], 16),
            info("a_out", Usage::Output, NrtDType::F32, &[2, 3], 24),
            info("b_out", Usage::Output, NrtDType::I32, &[4], 16),
        ]
    );

    let a = runtime.allocate(Placement::Device, 0, 24, "a").unwrap();
    let b = runtime.allocate(Placement::Host, 0, 16, "b").unwrap();
    let a_out = runtime.allocate(Placement::Device, 1, 24, "a_out").unwrap();
    let b_out = runtime.allocate(Placement::Device, 0, 16, "b_out").unwrap();
    assert_eq!(a.size().unwrap(), 24);
    let a_values = f32_bytes(&[1.5, -2.0, 3.25, 0.0, 7.0, -8.5]);
    let b_values: Vec<u8> = [3i32, -1, 7, 42]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    a.write(&a_values, 0).unwrap();
    b.write(&b_values[..8], 0).unwrap();
    b.write(&b_values[8..], 8).unwrap();

    let mut inputs = runtime.tensor_set().unwrap();
    inputs.add("a", &a).unwrap();
    inputs.add("b", &b).unwrap();
    let mut outputs = runtime.tensor_set().unwrap();
    outputs.add("a_out", &a_out).unwrap();
    outputs.add("b_out", &b_out).unwrap();
    assert_eq!(inputs.get("b").unwrap().name(), "b");

    model.execute(&inputs, &outputs).unwrap();
    let mut read = vec![0u8; 24];
    a_out.read(&mut read, 0).unwrap();
    assert_eq!(read, a_values);
    let mut tail = vec![0u8; 8];
    b_out.read(&mut tail, 8).unwrap();
    assert_eq!(tail, b_values[8..]);

    b.write(&[0u8; 16], 0).unwrap();
    model.execute_repeat(&inputs, &outputs, 3).unwrap();
    let mut zeros = vec![1u8; 16];
    b_out.read(&mut zeros, 0).unwrap();
    assert_eq!(zeros, [0u8; 16]);

    drop((inputs, outputs));
    drop((a, b, a_out, b_out, model));
    runtime.close();
    // The runtime can be opened again once closed.
    Runtime::init(library).unwrap().close();
}

#[test]
fn a_missing_library_is_an_error_naming_its_path() {
    let err = Library::open("/nonexistent/libnrt.so.1").unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::NeuronLibrary(_)), "{message}");
    assert!(message.contains("/nonexistent/libnrt.so.1"), "{message}");
}

#[test]
fn a_missing_symbol_is_an_error_naming_it_and_the_rest_still_works() {
    let _guard = exclusive();
    let library = Library::open(FAKE_WITHOUT_EXECUTE_REPEAT).unwrap();
    let runtime = Runtime::init(library).unwrap();
    let model = runtime
        .load(COPY_NEFF.as_bytes(), "copy.neff", 0, 1)
        .unwrap();
    let tensors = allocate_all(&runtime, &model);
    let (inputs, outputs) = bind_all(&runtime, &model, &tensors);
    model.execute(&inputs, &outputs).unwrap();
    let err = model.execute_repeat(&inputs, &outputs, 2).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::NeuronLibrary(_)), "{message}");
    assert!(message.contains("`nrt_execute_repeat`"), "{message}");
    assert!(message.contains(FAKE_WITHOUT_EXECUTE_REPEAT), "{message}");
}

#[test]
fn corrupt_and_unsupported_neffs_are_refused_with_their_status() {
    let _guard = exclusive();
    let runtime = Runtime::init(fake()).unwrap();
    let cases: &[(&[u8], Status)] = &[
        (b"\x7fELF garbage \x00\x01", Status::INVALID),
        (b"moekit-fake-neff 2\nkernel copy\ninput a f32 1\noutput b f32 1\n", Status::UNSUPPORTED_NEFF_VERSION),
        (b"moekit-fake-neff 1\nkernel copy\ninput a f32 0\noutput b f32 0\n", Status::INVALID),
        (b"moekit-fake-neff 1\nkernel copy\ninput a f32 2\noutput a f32 2\n", Status::INVALID),
        // router_topk whose w does not match x: [H, E] = [8, _] expected.
        (
            b"moekit-fake-neff 1\nkernel router_topk\ninput x f32 4 8\ninput w f32 7 4\n\
              output router_logits f32 4 4\noutput expert_index i32 4 2\noutput expert_affinities f32 4 4\n",
            Status::INVALID,
        ),
    ];
    for (neff, expected) in cases {
        let err = runtime
            .load(neff, "bad.neff", -1, -1)
            .err()
            .expect("the NEFF is refused");
        assert_eq!(status_of(&err), Some(expected.name().as_str()), "{err}");
        assert!(err.to_string().contains("bad.neff"), "{err}");
    }
    let err = runtime
        .load(COPY_NEFF.as_bytes(), "copy.neff", 1, 2)
        .err()
        .unwrap();
    assert_eq!(status_of(&err), Some("NRT_LOAD_NOT_ENOUGH_NC"), "{err}");
    let missing = Path::new("/nonexistent/model.neff");
    let err = runtime.load_file(missing, -1, -1).err().unwrap();
    assert!(err.to_string().contains("/nonexistent/model.neff"), "{err}");
}

#[test]
fn wrong_names_sizes_and_bounds_are_reported_by_status() {
    let _guard = exclusive();
    let runtime = Runtime::init(fake()).unwrap();
    let model = runtime
        .load(COPY_NEFF.as_bytes(), "copy.neff", -1, -1)
        .unwrap();
    let a = runtime.allocate(Placement::Device, 0, 24, "a").unwrap();
    let short_b = runtime.allocate(Placement::Device, 0, 12, "b").unwrap();
    let b = runtime.allocate(Placement::Device, 0, 16, "b").unwrap();
    let a_out = runtime.allocate(Placement::Device, 0, 24, "a_out").unwrap();
    let b_out = runtime.allocate(Placement::Device, 0, 16, "b_out").unwrap();
    let mut outputs = runtime.tensor_set().unwrap();
    outputs.add("a_out", &a_out).unwrap();
    outputs.add("b_out", &b_out).unwrap();

    let mut misnamed = runtime.tensor_set().unwrap();
    misnamed.add("a", &a).unwrap();
    misnamed.add("bee", &b).unwrap();
    let err = model.execute(&misnamed, &outputs).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");
    assert!(err.to_string().contains("copy.neff"), "{err}");
    let err = misnamed.get("b").err().unwrap();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");

    let mut short = runtime.tensor_set().unwrap();
    short.add("a", &a).unwrap();
    short.add("b", &short_b).unwrap();
    let err = model.execute(&short, &outputs).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_EXEC_BAD_INPUT"), "{err}");

    let err = a.write(&[0u8; 8], 20).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");
    assert!(err.to_string().contains("tensor `a`"), "{err}");
    let err = a.read(&mut [0u8; 25], 0).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");
    let err = runtime
        .allocate(Placement::Device, 5, 4, "x")
        .err()
        .unwrap();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");
    let err = model.execute_repeat(&short, &outputs, 0).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_INVALID"), "{err}");
}

#[test]
fn an_out_of_range_token_id_is_the_hardware_out_of_bounds_status() {
    let _guard = exclusive();
    let runtime = Runtime::init(fake()).unwrap();
    // T=2, H=2, E=1, I=1, one block of B=2.
    let neff = "moekit-fake-neff 1
kernel blockwise_mm
input hidden_states f32 3 2
input expert_affinities_masked f32 3
input gate_up_proj_weight f32 1 2 2 1
input down_proj_weight f32 1 1 2
input token_position_to_id i32 2
input block_to_expert i32 1 1
output output f32 3 2
";
    let model = runtime.load(neff.as_bytes(), "bwmm.neff", -1, -1).unwrap();
    let tensors = allocate_all(&runtime, &model);
    let (inputs, outputs) = bind_all(&runtime, &model, &tensors);
    // Token id T = 2 is the padding row; 3 is past the end of hidden_states [T+1, H].
    let ids: Vec<u8> = [0i32, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    inputs
        .get("token_position_to_id")
        .unwrap()
        .write(&ids, 0)
        .unwrap();
    let err = model.execute(&inputs, &outputs).unwrap_err();
    assert_eq!(
        status_of(&err),
        Some(Status::EXEC_OOB.name().as_str()),
        "{err}"
    );
}

#[test]
fn everything_refuses_to_run_after_close_and_only_one_runtime_is_open() {
    let _guard = exclusive();
    let runtime = Runtime::init(fake()).unwrap();
    let err = Runtime::init(fake())
        .err()
        .expect("a second runtime is refused");
    assert!(err.to_string().contains("already open"), "{err}");
    let model = runtime
        .load(COPY_NEFF.as_bytes(), "copy.neff", -1, -1)
        .unwrap();
    let a = runtime.allocate(Placement::Device, 0, 24, "a").unwrap();
    let (inputs, outputs) = (runtime.tensor_set().unwrap(), runtime.tensor_set().unwrap());
    runtime.close();
    let err = model.execute(&inputs, &outputs).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_CLOSED"), "{err}");
    assert!(err.to_string().contains("nrt_execute"), "{err}");
    let err = a.write(&[0u8; 4], 0).unwrap_err();
    assert_eq!(status_of(&err), Some("NRT_CLOSED"), "{err}");
}

#[test]
fn every_documented_status_has_its_name() {
    let names: Vec<String> = Status::all().map(Status::name).collect();
    for expected in [
        "NRT_SUCCESS",
        "NRT_EXEC_BAD_INPUT",
        "NRT_EXEC_OOB",
        "NRT_CLOSED",
        "NRT_NETWORK_PROXY_FAILURE",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing");
    }
    assert_eq!(Status(1006).name(), "NRT_EXEC_OOB");
    assert_eq!(Status(9999).name(), "NRT_STATUS(9999)");
    assert_eq!(names.len(), 28);
}
