"""The `neuron` backend from Python, on the fake Neuron runtime the Rust tests use (host
emulation of libnrt that runs text stand-ins for NEFFs): the kernels it runs equal `moekit run
--backend neuron` bit for bit and the reference within its tolerance; the others are errors."""

import os
import pathlib
import subprocess

import numpy as np
import pytest

import moekit
from conftest import inputs_of, load_safetensors, make_layer, save_safetensors

LAYER = make_layer(np.float32, seed=3)


def neuron_inputs(kernel):
    """The kernel's inputs as nki-library's kernel takes them (blockwise_mm_bwd's expert_index,
    for moekit's own d_topk_affinities, is not one of them)."""
    inputs = inputs_of(kernel, LAYER)
    if kernel == "blockwise_mm_bwd":
        del inputs["expert_index"]
    return inputs

DTYPES = {"float32": "f32", "bfloat16": "bf16", "int32": "i32"}


@pytest.fixture(scope="module")
def fake_runtime():
    path = os.environ.get("MOEKIT_FAKE_NRT")
    if not path or not pathlib.Path(path).is_file():
        pytest.fail("set MOEKIT_FAKE_NRT to the fake runtime (libnrt_fake.so of moekit-nrt-fake)")
    return path


def neff(kernel, inputs, outputs):
    """A fake NEFF declaring `inputs` and `outputs` (name → array) for `kernel`."""
    lines = ["moekit-fake-neff 1", f"kernel {kernel}"]
    for usage, tensors in (("input", inputs), ("output", outputs)):
        for name, array in tensors.items():
            dims = " ".join(str(d) for d in array.shape)
            lines.append(f"{usage} {name} {DTYPES[array.dtype.name]} {dims}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def neuron(fake_runtime, tmp_path_factory):
    """The NEFFs and manifest of router_topk, blockwise_mm and blockwise_mm_bwd at the test
    layer's shapes, with the runtime and manifest set in the environment."""
    directory = tmp_path_factory.mktemp("neuron")
    calls = {"router_topk": {"k": 2}, "blockwise_mm": {}, "blockwise_mm_bwd": {}}
    manifest = []
    for kernel, params in calls.items():
        inputs = neuron_inputs(kernel)
        outputs = moekit.run(kernel, backend="reference", **inputs, **params)
        if kernel == "router_topk":
            del outputs["topk_affinities"]
        (directory / f"{kernel}.neff").write_text(neff(kernel, inputs, outputs))
        manifest.append(f'[[kernel]]\nname = "{kernel}"\nneff = "{kernel}.neff"\nt = 13\n')
    (directory / "kernels.toml").write_text("\n".join(manifest))
    environment = {
        "NEURON_RT_LIB": fake_runtime,
        "MOEKIT_NEURON_MANIFEST": str(directory / "kernels.toml"),
    }
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    yield directory, calls
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def test_the_kernels_neuron_runs_equal_moekit_run_and_the_reference(neuron, cli, tmp_path):
    directory, calls = neuron
    for kernel, params in calls.items():
        inputs = neuron_inputs(kernel)
        got = moekit.run(kernel, backend="neuron", **inputs, **params)
        save_safetensors(tmp_path / "in.safetensors", inputs)
        args = [cli, "run", kernel, "--backend", "neuron", "--inputs", tmp_path / "in.safetensors",
                "--output", tmp_path / "out.safetensors", "--manifest",
                directory / "kernels.toml"]
        for name, value in params.items():
            args += ["--param", f"{name}={value}"]
        subprocess.run([str(a) for a in args], check=True, capture_output=True)
        want = load_safetensors(tmp_path / "out.safetensors")
        assert sorted(got) == sorted(want), kernel
        reference = moekit.run(kernel, backend="reference", **inputs, **params)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), (kernel, name)
            np.testing.assert_allclose(got[name], reference[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"{kernel} {name}")


def test_kernels_neuron_does_not_run_and_unknown_shapes_are_errors(neuron):
    inputs = inputs_of("permute", LAYER)
    with pytest.raises(moekit.Error, match=r"backend `neuron` does not run `permute`"):
        moekit.permute(**inputs, num_experts=6, block_size=4, backend="neuron")
    x, w = LAYER["x"], LAYER["w"]
    with pytest.raises(moekit.Error, match=r"kernels.toml"):
        moekit.router_topk(x[:5], w, k=2, backend="neuron")
