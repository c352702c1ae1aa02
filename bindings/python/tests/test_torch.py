"""moekit.torch: the routed experts as an autograd function, against a per-token PyTorch loop
(the experts as the Hugging Face eager code computes them), in every weight layout."""

import os
import subprocess
import sys

import pytest
import torch

import moekit.torch as mt
from moekit import _moekit
from moekit._arrays import export

T, H, E, K, I = 37, 32, 8, 2, 16


def routed(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    index = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(dtype).requires_grad_()
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype).requires_grad_()
    return x, index, weights, gate_up, down


def loop_experts(x, index, weights, gate_up, down):
    """Each token through each of its experts, one at a time, in float64."""
    x, weights, gate_up, down = (t.double() for t in (x, weights, gate_up, down))
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(index.shape[1]):
            e = int(index[t, k])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            row = row + weights[t, k] * (down[e] @ (torch.nn.functional.silu(gate) * up))
        rows.append(row)
    return torch.stack(rows)


def grads(output, leaves, d_output):
    return torch.autograd.grad(output, leaves, d_output)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_transformers_layout_matches_the_loop_forward_and_backward(backend, block_size):
    x, index, weights, gate_up, down = routed(0)
    leaves = (x, weights, gate_up, down)
    got = mt.transformers_experts(x, index, weights, gate_up, down, backend=backend,
                                  block_size=block_size)
    want = loop_experts(x, index, weights, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    d_output = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    for g, w in zip(grads(got, leaves, d_output), grads(want, leaves, d_output.double())):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_torchtitan_and_moekit_layouts_give_the_same_results(backend):
    x, index, weights, gate_up, down = routed(2)
    want = mt.transformers_experts(x, index, weights, gate_up, down, backend=backend)
    # torchtitan: w1 (gate) and w3 (up) [E, F, D], w2 [E, D, F].
    w1 = gate_up[:, :I].detach().clone().requires_grad_()
    w3 = gate_up[:, I:].detach().clone().requires_grad_()
    w2 = down.detach().clone().requires_grad_()
    titan = mt.torchtitan_experts(x, index, weights, w1, w2, w3, backend=backend)
    assert torch.equal(titan, want)
    d_output = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
    d_gate_up, d_down = grads(want, (gate_up, down), d_output)
    d_w1, d_w2, d_w3 = grads(titan, (w1, w2, w3), d_output)
    assert torch.equal(d_w1, d_gate_up[:, :I]) and torch.equal(d_w3, d_gate_up[:, I:])
    assert torch.equal(d_w2, d_down)
    # nki-library's layout: [E, H, 2, I] and [E, I, H]. The reference computes the same sums in
    # either layout; the cpu backend's products run in another order: a weight gradient sums up
    # to T * K products in f32, so the layouts agree within that sum's rounding (as in the loop
    # test above), not bit for bit.
    gate_up_nki = gate_up.detach().view(E, 2, I, H).permute(0, 3, 1, 2).contiguous()
    gate_up_nki.requires_grad_()
    down_nki = down.detach().transpose(1, 2).contiguous().requires_grad_()
    own = mt.experts(x, index, weights, gate_up_nki, down_nki, backend=backend)
    d_gate_up_nki, d_down_nki = grads(own, (gate_up_nki, down_nki), d_output)
    pairs = [
        (own, want),
        (d_gate_up_nki, d_gate_up.view(E, 2, I, H).permute(0, 3, 1, 2)),
        (d_down_nki, d_down.transpose(1, 2)),
    ]
    for got, expected in pairs:
        if backend == "reference":
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_transformers_weights_are_read_where_they_lie(monkeypatch):
    """No copy and no transpose: the kernels read transformers' tensors at their addresses."""
    x, index, weights, gate_up, down = routed(6)
    seen = {}
    apply = mt.RoutedExperts.apply

    def spy(experts, *tensors):
        seen["experts"], seen["weights"] = experts, tensors[3:]
        return apply(experts, *tensors)

    monkeypatch.setattr(mt.RoutedExperts, "apply", spy)
    mt.transformers_experts(x, index, weights, gate_up, down)
    assert seen["experts"].weight_layout == "linear"
    for name, passed, weight in zip(
        ("gate_up_proj_weight", "down_proj_weight"), seen["weights"], (gate_up, down)
    ):
        capsule, bf16_bits, _ = export(name, passed.detach())
        assert _moekit.input_address(name, capsule, bf16_bits) == (weight.data_ptr(), True)
    # torchtitan's three, w1 and w3 as two tensors (the kernels' up_proj_weight), unstacked.
    w1, w3 = gate_up[:, :I].detach().clone(), gate_up[:, I:].detach().clone()
    w2 = down.detach()
    mt.torchtitan_experts(x, index, weights, w1, w2, w3)
    assert seen["experts"].weight_layout == "linear"
    for name, passed, weight in zip(
        ("gate_up_proj_weight", "down_proj_weight", "up_proj_weight"),
        seen["weights"],
        (w1, w2, w3),
    ):
        capsule, bf16_bits, _ = export(name, passed)
        assert _moekit.input_address(name, capsule, bf16_bits) == (weight.data_ptr(), True)


def test_bf16_is_computed_in_f32_and_rounded_once():
    x, index, weights, gate_up, down = routed(3, torch.bfloat16)
    got = mt.transformers_experts(x, index, weights, gate_up, down)
    assert got.dtype == torch.bfloat16
    want = loop_experts(x, index, weights, gate_up, down)
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=2**-7)
    d_x, d_gate_up = grads(got, (x, gate_up), torch.ones(T, H, dtype=torch.bfloat16))
    assert d_x.dtype == d_gate_up.dtype == torch.bfloat16
    want_d_x, want_d_gate_up = grads(want, (x, gate_up), torch.ones(T, H, dtype=torch.float64))
    torch.testing.assert_close(d_x.double(), want_d_x.double(), rtol=2**-6, atol=2**-6)
    torch.testing.assert_close(d_gate_up.double(), want_d_gate_up.double(), rtol=2**-6, atol=2**-6)


def test_no_gradient_no_checkpoints_and_errors_name_the_tensor():
    x, index, weights, gate_up, down = routed(4)
    with torch.no_grad():
        out = mt.transformers_experts(x, index, weights, gate_up, down)
    assert out.grad_fn is None
    with pytest.raises(ValueError, match=r"expert_index"):
        mt.transformers_experts(x, index + E, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"tensor `expert_index`: expected shape \[T, K\] = \[36, _\]"):
        mt.transformers_experts(x[:-1], index, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"tensor `gate_up_proj_weight`: expected shape \[E, 2, I, H\] = \[_, 2, _, 31\]"):
        mt.transformers_experts(x[:, :-1], index, weights, gate_up, down)
    with pytest.raises(ValueError, match=r"tensor `down_proj_weight`: expected shape \[E, I, H\] = \[8, 16, 32\]"):
        mt.experts(x, index, weights, gate_up.view(E, 2, I, H).permute(0, 3, 1, 2), down)
    with pytest.raises(ValueError, match=r"weight_layout.*expected one of nki, linear, got `transposed`"):
        mt.experts(x, index, weights, gate_up, down, weight_layout="transposed")
    with pytest.raises(ValueError, match=r"tensor `hidden_states`: on meta"):
        mt.transformers_experts(x.to("meta"), index, weights, gate_up, down)


def test_the_result_is_bit_identical_whatever_the_thread_count():
    script = (
        "import hashlib, torch, moekit.torch as mt\n"
        "from test_torch import routed\n"
        "x, index, weights, gate_up, down = routed(5)\n"
        "out = mt.transformers_experts(x, index, weights, gate_up, down)\n"
        "gs = torch.autograd.grad(out, (x, weights, gate_up, down), torch.ones_like(out))\n"
        "h = hashlib.sha256()\n"
        "for t in (out, *gs): h.update(t.detach().contiguous().numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    digests = set()
    for threads in (1, 2, 3):
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        result = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                capture_output=True, text=True, cwd=os.path.dirname(__file__))
        digests.add(result.stdout.strip())
    assert len(digests) == 1
