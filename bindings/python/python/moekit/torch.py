"""The routed experts of an MoE layer as a PyTorch autograd function, on moekit's kernels.

Forward: the block plan (`permute`), then `blockwise_mm` (gate_up projection, SiLU(gate)·up,
down projection, scaled by each token's routing weight and summed over its K experts), keeping
its checkpoints when a gradient is needed; backward: `blockwise_mm_bwd`. Gradients flow to the
hidden states, the routing weights and both expert weights.

The expert weights come in three layouts, one function each:

- `experts`: moekit's (nki-library's) `gate_up_proj_weight [E, H, 2, I]`,
  `down_proj_weight [E, I, H]`, or with `weight_layout="linear"` `torch.nn.Linear`'s
  `[E, 2, I, H]` and `[E, H, I]`, read in place.
- `transformers_experts`: Hugging Face transformers v5's `gate_up_proj [E, 2·I, H]` (gate rows
  first) and `down_proj [E, H, I]`: the linear layout, read in place (no copy, no transpose).
- `torchtitan_experts`: torchtitan's `w1 [E, F, D]` (gate), `w3 [E, F, D]` (up) and
  `w2 [E, D, F]` (down): the linear layout with the gate and up projections in two tensors
  (the kernels' `up_proj_weight`), all three read in place.

The weight gradients come back in the caller's layout (`w1`'s and `w3`'s as views of one
`[E, 2, F, D]` gradient).

Tensors are CPU tensors, float32 or bfloat16 (the weights in the hidden states' dtype); expert
ids int32 or int64 `[T, K]`. Results are bit-identical whatever the number of threads.
"""

import torch

from . import _moekit
from ._arrays import _capsule
from .errors import ContractError

# The block plan's B where a caller gives none.
DEFAULT_BLOCK_SIZE = _moekit.DEFAULT_BLOCK_SIZE

# One `Experts` per (backend, block size, weight layout): they hold no state between calls.
_EXPERTS = {}


def _experts(backend, block_size, weight_layout):
    key = (backend, block_size, weight_layout)
    if key not in _EXPERTS:
        _EXPERTS[key] = _moekit.Experts(
            backend=backend, block_size=block_size, weight_layout=weight_layout
        )
    return _EXPERTS[key]


def _cpu_capsule(name, tensor):
    if tensor.device.type != "cpu":
        raise ContractError(
            f"tensor `{name}`: on {tensor.device}; moekit reads tensors in CPU memory (.cpu())"
        )
    return _capsule(tensor.detach())


class RoutedExperts(torch.autograd.Function):
    """`output [T, H]` of `hidden_states [T, H]` through each token's K experts, weights in
    the layout of `experts`, a `moekit._moekit.Experts`. `apply(experts, hidden_states,
    expert_index, topk_affinities, gate_up_proj_weight, down_proj_weight, up_proj_weight)`,
    `up_proj_weight` None unless the up projection lies apart from the gate's."""

    @staticmethod
    def forward(ctx, experts, hidden_states, expert_index, topk_affinities, gate_up, down, up):
        record = any(ctx.needs_input_grad[1:])
        named = {
            "hidden_states": hidden_states,
            "expert_index": expert_index,
            "topk_affinities": topk_affinities,
            "gate_up_proj_weight": gate_up,
            "down_proj_weight": down,
        }
        capsules = [_cpu_capsule(name, tensor) for name, tensor in named.items()]
        up_capsule = None if up is None else _cpu_capsule("up_proj_weight", up)
        output, saved = experts.forward(*capsules, record, up_capsule)
        ctx.experts, ctx.saved, ctx.apart = experts, saved, up is not None
        return torch.from_dlpack(output)

    @staticmethod
    def backward(ctx, d_output):
        if ctx.saved is None:
            raise RuntimeError("moekit: this forward kept no checkpoints for a backward")
        grads = dict(ctx.experts.backward(ctx.saved, _cpu_capsule("d_output", d_output.contiguous())))
        # The checkpoints are needed once.
        ctx.saved = None
        d_gate_up = torch.from_dlpack(grads["d_gate_up_proj_weight"])
        # Apart, the gradient `[E, 2, I, H]` holds the gate's and the up's: a view of each.
        d_gate_up, d_up = (d_gate_up[:, 0], d_gate_up[:, 1]) if ctx.apart else (d_gate_up, None)
        return (
            None,
            torch.from_dlpack(grads["d_hidden_states"]),
            None,
            torch.from_dlpack(grads["d_topk_affinities"]),
            d_gate_up,
            torch.from_dlpack(grads["d_down_proj_weight"]),
            d_up,
        )


def experts(
    hidden_states,
    expert_index,
    topk_affinities,
    gate_up_proj_weight,
    down_proj_weight,
    *,
    backend="cpu",
    block_size=DEFAULT_BLOCK_SIZE,
    weight_layout="nki",
):
    """`output [T, H]`: `hidden_states [T, H]` through the experts `expert_index [T, K]` names,
    weighted by `topk_affinities [T, K]` and summed; weights `gate_up_proj_weight [E, H, 2, I]`
    and `down_proj_weight [E, I, H]` (`weight_layout="nki"`) or `[E, 2, I, H]` and
    `[E, H, I]` (`"linear"`), read in place. Differentiable in everything but the ids.
    `block_size` is the block plan's B."""
    return RoutedExperts.apply(
        _experts(backend, block_size, weight_layout),
        hidden_states,
        expert_index,
        topk_affinities,
        gate_up_proj_weight,
        down_proj_weight,
        None,
    )


def transformers_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, **options
):
    """`experts` with transformers v5's weights, read in place: `gate_up_proj [E, 2·I, H]`
    (gate rows first), `down_proj [E, H, I]`."""
    e, two_i, h = gate_up_proj.shape
    gate_up = gate_up_proj.reshape(e, 2, two_i // 2, h)
    return experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        gate_up,
        down_proj,
        weight_layout="linear",
        **options,
    )


def torchtitan_experts(
    x, top_k_index, top_k_weights, w1, w2, w3, *, backend="cpu", block_size=DEFAULT_BLOCK_SIZE
):
    """`experts` with torchtitan's weights, all read in place: `w1 [E, F, D]` (gate) and
    `w3 [E, F, D]` (up), two tensors (the kernels' `up_proj_weight`), and `w2 [E, D, F]`
    (down)."""
    return RoutedExperts.apply(
        _experts(backend, block_size, "linear"), x, top_k_index, top_k_weights, w1, w2, w3
    )
