"""Every kernel through Python gives what `moekit run` gives, bit for bit, on the same backend."""

import subprocess

import ml_dtypes
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


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gate_and_up_weights_apart_give_the_stacked_weights_outputs(backend):
    """`up_proj_weight`: under the linear layout, the gate's `[E, I, H]` in
    `gate_up_proj_weight` and the up's apart give what the stacked `[E, 2, I, H]` gives."""
    T, H, E, I, K, B = 5, 8, 3, 4, 2, 2
    rng = np.random.default_rng(0)
    index = np.array([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], np.int32)
    affinities = rng.random((T, K)).astype(np.float32)
    plan = moekit.permute(index, affinities, num_experts=E, block_size=B, skip_token=True)
    gate_up = rng.standard_normal((E, 2, I, H)).astype(np.float32)
    common = dict(
        hidden_states=rng.standard_normal((T, H)).astype(np.float32),
        expert_affinities_masked=plan["expert_affinities_masked"],
        down_proj_weight=rng.standard_normal((E, H, I)).astype(np.float32),
        token_position_to_id=plan["token_position_to_id"],
        block_to_expert=plan["block_to_expert"],
        weight_layout="linear",
        skip_token=True,
        checkpoint_activation=True,
        backend=backend,
    )
    gate, up = (np.ascontiguousarray(gate_up[:, which]) for which in (0, 1))
    stacked = moekit.blockwise_mm(gate_up_proj_weight=gate_up, **common)
    apart = moekit.blockwise_mm(gate_up_proj_weight=gate, up_proj_weight=up, **common)
    assert sorted(apart) == sorted(stacked)
    # The reference stacks the two in f64: the same sums; the cpu kernels' products per half
    # may sum in another order.
    for name in stacked:
        if backend == "reference":
            np.testing.assert_array_equal(apart[name], stacked[name])
        else:
            np.testing.assert_allclose(apart[name], stacked[name], rtol=1e-6, atol=1e-6)
    with pytest.raises(moekit.ContractError, match="up_proj_weight.*\\[3, 3, 8\\]"):
        moekit.blockwise_mm(gate_up_proj_weight=gate, up_proj_weight=up[:, :3].copy(), **common)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_compute_dtype_rounds_the_operands_only_when_it_is_bfloat16(backend):
    """`compute_dtype`, nki-library's parameter: f32 tokens compute in f32 unless told
    `bfloat16`; bf16 tokens compute in bf16 unless told `float32`, which then gives exactly
    what f32 tokens holding the same values give."""
    T, H, E, I, K, B = 6, 16, 3, 8, 2, 2
    rng = np.random.default_rng(1)
    index = np.array([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]], np.int32)
    affinities = rng.random((T, K)).astype(np.float32)
    plan = moekit.permute(index, affinities, num_experts=E, block_size=B, skip_token=True)
    bf16 = ml_dtypes.bfloat16
    tokens = rng.standard_normal((T, H)).astype(bf16)
    common = dict(
        expert_affinities_masked=plan["expert_affinities_masked"],
        gate_up_proj_weight=rng.standard_normal((E, H, 2, I)).astype(np.float32),
        down_proj_weight=rng.standard_normal((E, I, H)).astype(np.float32),
        token_position_to_id=plan["token_position_to_id"],
        block_to_expert=plan["block_to_expert"],
        skip_token=True,
        output_dtype="float32",
        backend=backend,
    )
    f32_tokens = tokens.astype(np.float32)
    plain = moekit.blockwise_mm(hidden_states=f32_tokens, **common)["output"]
    as_f32 = moekit.blockwise_mm(hidden_states=f32_tokens, compute_dtype="float32", **common)
    np.testing.assert_array_equal(as_f32["output"], plain)
    rounded = moekit.blockwise_mm(hidden_states=f32_tokens, compute_dtype="bfloat16", **common)
    assert not np.array_equal(rounded["output"], plain)
    bf16_default = moekit.blockwise_mm(hidden_states=tokens, **common)["output"]
    np.testing.assert_array_equal(bf16_default, rounded["output"])
    bf16_as_f32 = moekit.blockwise_mm(hidden_states=tokens, compute_dtype="float32", **common)
    np.testing.assert_array_equal(bf16_as_f32["output"], plain)
    with pytest.raises(moekit.ContractError, match="compute_dtype.*bfloat16 or float32"):
        moekit.blockwise_mm(hidden_states=tokens, compute_dtype="float16", **common)
