"""Every kernel through Python gives what `moekit run` gives, bit for bit, on the same backend."""

import subprocess

import numpy as np
import pytest

import moekit
from conftest import PARAMS, inputs_of, load_safetensors, save_safetensors

KERNELS = [spec.name for spec in moekit.kernels()]


def test_every_kernel_has_a_test_layer():
    assert sorted(PARAMS) == sorted(KERNELS)


def bits(array):
    """The array's bytes with its dtype and shape: equal only when bit-identical."""
    return array.dtype.name, array.shape, np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_moekit_run(kernel, backend, layer, cli, tmp_path):
    inputs = inputs_of(kernel, layer)
    params = PARAMS[kernel]
    got = moekit.run(kernel, backend=backend, **inputs, **params)
    # The typed function is the same call.
    typed = getattr(moekit, kernel)(**inputs, **params, backend=backend)

    save_safetensors(tmp_path / "in.safetensors", inputs)
    args = [cli, "run", kernel, "--backend", backend, "--inputs", tmp_path / "in.safetensors",
            "--output", tmp_path / "out.safetensors"]
    for name, value in params.items():
        # Python's True and False as the command line spells them; other values as they are.
        text = str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--param", f"{name}={text}"]
    subprocess.run([str(a) for a in args], check=True, capture_output=True)
    want = load_safetensors(tmp_path / "out.safetensors")

    assert sorted(got) == sorted(want)
    for name in want:
        assert bits(got[name]) == bits(want[name]), name
        assert bits(typed[name]) == bits(want[name]), name


def test_outputs_keep_the_input_dtype_unless_float32_is_asked_for(layer):
    inputs = inputs_of("router_topk", layer)
    float_dtype = layer["x"].dtype
    out = moekit.router_topk(**inputs, k=2)
    assert out["router_logits"].dtype == float_dtype
    assert out["expert_index"].dtype == np.int32
    wide = moekit.router_topk(**inputs, k=2, output_dtype="float32")
    assert wide["router_logits"].dtype == np.float32


def test_typed_functions_carry_the_contract():
    spec = moekit.Kernel.named("blockwise_mm")
    doc = moekit.blockwise_mm.__doc__
    for tensor in spec.inputs + spec.outputs:
        assert f"{tensor.name}: {tensor.shape}" in doc
    signature = str(moekit.router_topk.__signature__)
    assert signature.startswith("(x, w, w_bias=None, selection_bias=None, *, k,")
    assert "act_fn: SOFTMAX|SIGMOID, default SOFTMAX" in moekit.router_topk.__doc__
