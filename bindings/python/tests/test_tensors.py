"""How tensors cross into the kernels and back: read in place, strided views, dtypes, PyTorch,
and bad input as errors naming the tensor or parameter."""

import ml_dtypes
import numpy as np
import pytest
import torch

import moekit
from moekit import _moekit
from moekit._arrays import export
from conftest import inputs_of, make_layer

F32_LAYER = make_layer(np.float32, seed=1)


def address(name, value):
    capsule, bf16_bits, _ = export(name, value)
    return _moekit.input_address(name, capsule, bf16_bits)


def test_contiguous_inputs_are_read_in_place():
    x = F32_LAYER["x"]
    assert address("x", x) == (x.ctypes.data, True)
    t = torch.from_numpy(F32_LAYER["gate_up_proj_weight"]).bfloat16()
    assert address("gate_up_proj_weight", t) == (t.data_ptr(), True)
    b = F32_LAYER["w"].astype(ml_dtypes.bfloat16)
    assert address("w", b) == (b.ctypes.data, True)
    # A row slice is contiguous, read where it lies (DLPack's byte offset or data pointer).
    rows = F32_LAYER["hidden_states"][2:5]
    assert address("hidden_states", rows) == (rows.ctypes.data, True)


def test_strided_and_wide_index_inputs_are_copied():
    x = F32_LAYER["x"]
    view = np.asfortranarray(x)
    got_address, lent = address("x", view)
    assert not lent and got_address != view.ctypes.data
    indices = F32_LAYER["expert_index"].astype(np.int64)
    assert not address("expert_index", indices)[1]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_non_contiguous_inputs_give_the_contiguous_result(backend):
    inputs = inputs_of("blockwise_mm_bwd", F32_LAYER)
    want = moekit.blockwise_mm_bwd(**inputs, backend=backend)
    strided = dict(inputs)
    # The same values through transposed, reversed and every-other-element views.
    w = inputs["gate_up_proj_weight"]
    strided["gate_up_proj_weight"] = np.ascontiguousarray(w.transpose(3, 2, 1, 0)).transpose(3, 2, 1, 0)
    doubled = np.repeat(inputs["hidden_states"], 2, axis=1)
    strided["hidden_states"] = doubled[:, ::2]
    reversed_rows = np.ascontiguousarray(inputs["down_proj_weight"][:, ::-1])
    strided["down_proj_weight"] = reversed_rows[:, ::-1]
    strided["token_position_to_id"] = inputs["token_position_to_id"].astype(np.int64)
    assert not strided["hidden_states"].flags.c_contiguous
    assert not strided["gate_up_proj_weight"].flags.c_contiguous
    assert strided["down_proj_weight"].strides[1] < 0
    got = moekit.blockwise_mm_bwd(**strided, backend=backend)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_torch_tensors_in_torch_tensors_out():
    inputs = {n: torch.from_numpy(a) for n, a in inputs_of("router_topk", F32_LAYER).items()}
    inputs["x"].requires_grad_(True)
    out = moekit.router_topk(**inputs, k=2)
    assert all(isinstance(t, torch.Tensor) for t in out.values())
    want = moekit.router_topk(**inputs_of("router_topk", F32_LAYER), k=2)
    for name in want:
        np.testing.assert_array_equal(out[name].numpy(), want[name])
    # bf16 in, bf16 out, equal to the NumPy bfloat16 path.
    bf16 = {n: t.detach().bfloat16() for n, t in inputs.items()}
    out = moekit.router_topk(**bf16, k=2)
    assert out["router_logits"].dtype == torch.bfloat16
    numpy_bf16 = moekit.router_topk(
        **{n: a.astype(ml_dtypes.bfloat16) for n, a in inputs_of("router_topk", F32_LAYER).items()},
        k=2,
    )
    assert numpy_bf16["router_logits"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        out["router_logits"].view(torch.int16).numpy(),
        numpy_bf16["router_logits"].view(np.int16),
    )


def test_outputs_are_the_callers_to_keep():
    out = moekit.router_topk(**inputs_of("router_topk", F32_LAYER), k=2)
    logits = out["router_logits"]
    assert logits.flags.writeable and logits.flags.c_contiguous
    logits[:] = 0
    again = moekit.router_topk(**inputs_of("router_topk", F32_LAYER), k=2)
    assert np.any(again["router_logits"] != 0)


def test_read_only_arrays_are_accepted():
    inputs = inputs_of("router_topk", F32_LAYER)
    frozen = {n: a.copy() for n, a in inputs.items()}
    for a in frozen.values():
        a.flags.writeable = False
    got = moekit.router_topk(**frozen, k=2)
    want = moekit.router_topk(**inputs, k=2)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def expect_error(cls, match, call):
    with pytest.raises(cls, match=match) as info:
        call()
    return info.value


def test_bad_input_raises_naming_the_tensor_or_parameter():
    inputs = inputs_of("router_topk", F32_LAYER)
    x, w = inputs["x"], inputs["w"]
    cases = [
        (lambda: moekit.router_topk(x, x, k=2), r"tensor `w`: expected shape \[H, E\]"),
        (lambda: moekit.router_topk(x.astype(np.float64), w, k=2), r"tensor `x`: has dtype float64"),
        (lambda: moekit.router_topk(x, w.astype(np.int32), k=2), r"tensor `w`: expected dtype"),
        (lambda: moekit.run("router_topk", w=w, k=2), r"missing input tensor `x`"),
        (lambda: moekit.run("router_topk", x=x, w=w), r"param `k`: required"),
        (lambda: moekit.run("router_topk", x=x, w=w, k=2, top_p=3), r"`top_p` is neither an input nor a parameter of `router_topk`"),
        (lambda: moekit.run("router_topk", x=x, w=w, k="two"), r"param `k`: expected an integer"),
        (lambda: moekit.run("router_topk", x=x, w=w, k=2, act_fn="TANH"), r"TANH"),
        (lambda: moekit.run("router_topk", x=x, w=w, k=[2]), r"param `k`: a list is not a parameter value"),
        (lambda: moekit.run("router_topk", x=[[1.0]], w=w, k=2), r"tensor `x`: a list is not a tensor"),
        (lambda: moekit.run("route", x=x), r"unknown kernel `route`; known kernels: router_topk"),
        (lambda: moekit.run("router_topk", backend="gpu", x=x, w=w, k=2), r"unknown backend `gpu`"),
        (lambda: moekit.router_topk(np.where(x > 0, np.nan, x), w, k=2), r"tensor `x`: non-finite value NaN"),
        (lambda: moekit.router_topk(x, w, k=2, x_hbm_layout=3), r"x_hbm_layout"),
    ]
    for call, match in cases:
        error = expect_error(moekit.ContractError, match, call)
        assert isinstance(error, ValueError) and isinstance(error, moekit.Error)
    big = np.array([[2**40, 0]], dtype=np.int64)
    expect_error(moekit.ContractError, r"tensor `expert_index`: int64 value 1099511627776 at \[0, 0\]",
                 lambda: moekit.permute(big, np.ones((1, 2), np.float32), num_experts=4, block_size=2))


def test_an_allocation_too_large_is_an_error_not_an_abort():
    # One token, H = 2^20, one block of B = 2^22 padding slots: the checkpoint
    # `down_activations` [N, B, H] would be 2^42 floats.
    h, b = 2**20, 2**22
    error = expect_error(
        moekit.AllocationError,
        r"cannot allocate output `down_activations` of shape \[1, 4194304, 1048576\]",
        lambda: moekit.blockwise_mm(
            np.zeros((2, h), np.float32), np.zeros((2, 1), np.float32),
            np.zeros((1, h, 2, 1), np.float32), np.zeros((1, 1, h), np.float32),
            np.ones(b, np.int32), np.zeros((1, 1), np.int32), checkpoint_activation=True,
        ),
    )
    assert isinstance(error, MemoryError)


def test_kernels_run_with_the_gil_released():
    import threading

    inputs = inputs_of("blockwise_mm_bwd", F32_LAYER)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(moekit.blockwise_mm_bwd(**inputs)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for result in results[1:]:
        for name in result:
            np.testing.assert_array_equal(result[name], results[0][name])
