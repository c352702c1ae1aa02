"""The routed experts of an MoE layer as a PyTorch autograd function, on moekit's kernels.

Forward: the block plan (`permute`), then `blockwise_mm` (gate_up projection, SiLU(gate)·up,
down projection, scaled by each token's routing weight and summed over its K experts), keeping
its checkpoints when a gradient is needed; backward: `blockwise_mm_bwd`. Gradients flow to the
hidden states, the routing weights and both expert weights.

The expert weights come in three layouts, one function each:

- `experts`: moekit's (nki-library's) `gate_up_proj_weight [E, H, 2, I]`,
  `down_proj_weight [E, I, H]`, read in place.
- `transformers_experts`: Hugging Face transformers v5's `gate_up_proj [E, 2·I, H]` (gate rows
  first) and `down_proj [E, H, I]`.
- `torchtitan_experts`: torchtitan's `w1 [E, F, D]` (gate), `w3 [E, F, D]` (up) and
  `w2 [E, D, F]` (down).

The last two are rearranged into moekit's layout by PyTorch (a copy of the weights per call,
differentiable, so their gradients come back in the caller's layout).

Tensors are CPU tensors, float32 or bfloat16 (the weights in the hidden states' dtype); expert
ids int32 or int64 `[T, K]`. Results are bit-identical whatever the number of threads.
"""

import torch

from . import _moekit
from ._arrays import _capsule
from .errors import ContractError

# The block plan's B where a caller gives none.
DEFAULT_BLOCK_SIZE = _moekit.DEFAULT_BLOCK_SIZE

# One `Experts` per (backend, block size): they hold no state between calls.
_EXPERTS = {}


def _experts(backend, block_size):
    key = (backend, block_size)
    if key not in _EXPERTS:
        _EXPERTS[key] = _moekit.Experts(backend=backend, block_size=block_size)
    return _EXPERTS[key]


def _cpu_capsule(name, tensor):
    if tensor.device.type != "cpu":
        raise ContractError(
            f"tensor `{name}`: on {tensor.device}; moekit reads tensors in CPU memory (.cpu())"
        )
    return _capsule(tensor.detach())


class RoutedExperts(torch.autograd.Function):
    """`output [T, H]` of `hidden_states [T, H]` through each token's K experts, weights in
    moekit's layout. `apply(experts, hidden_states, expert_index, topk_affinities,
    gate_up_proj_weight, down_proj_weight)`, `experts` a `moekit._moekit.Experts`."""

    @staticmethod
    def forward(ctx, experts, hidden_states, expert_index, topk_affinities, gate_up, down):
        record = any(ctx.needs_input_grad[1:])
        named = {
            "hidden_states": hidden_states,
            "expert_index": expert_index,
            "topk_affinities": topk_affinities,
            "gate_up_proj_weight": gate_up,
            "down_proj_weight": down,
        }
        capsules = [_cpu_capsule(name, tensor) for name, tensor in named.items()]
        output, saved = experts.forward(*capsules, record)
        ctx.experts, ctx.saved = experts, saved
        return torch.from_dlpack(output)

    @staticmethod
    def backward(ctx, d_output):
        if ctx.saved is None:
            raise RuntimeError("moekit: this forward kept no checkpoints for a backward")
        grads = dict(ctx.experts.backward(ctx.saved, _cpu_capsule("d_output", d_output.contiguous())))
        # The checkpoints are needed once.
        ctx.saved = None
        return (
            None,
            torch.from_dlpack(grads["d_hidden_states"]),
            None,
            torch.from_dlpack(grads["d_topk_affinities"]),
            torch.from_dlpack(grads["d_gate_up_proj_weight"]),
            torch.from_dlpack(grads["d_down_proj_weight"]),
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
):
    """`output [T, H]`: `hidden_states [T, H]` through the experts `expert_index [T, K]` names,
    weighted by `topk_affinities [T, K]` and summed; weights `gate_up_proj_weight [E, H, 2, I]`
    and `down_proj_weight [E, I, H]`, read in place. Differentiable in everything but the ids.
    `block_size` is the block plan's B."""
    return RoutedExperts.apply(
        _experts(backend, block_size),
        hidden_states,
        expert_index,
        topk_affinities,
        gate_up_proj_weight,
        down_proj_weight,
    )


def transformers_experts(
    hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, **options
):
    """`experts` with transformers v5's weights: `gate_up_proj [E, 2·I, H]` (gate rows first),
    `down_proj [E, H, I]`."""
    e, two_i, h = gate_up_proj.shape
    gate_up = gate_up_proj.view(e, 2, two_i // 2, h).permute(0, 3, 1, 2).contiguous()
    down = down_proj.transpose(1, 2).contiguous()
    return experts(hidden_states, top_k_index, top_k_weights, gate_up, down, **options)


def torchtitan_experts(x, top_k_index, top_k_weights, w1, w2, w3, **options):
    """`experts` with torchtitan's weights: `w1 [E, F, D]` (gate), `w3 [E, F, D]` (up),
    `w2 [E, D, F]` (down)."""
    gate_up = torch.stack([w1.transpose(1, 2), w3.transpose(1, 2)], dim=2)
    down = w2.transpose(1, 2).contiguous()
    return experts(x, top_k_index, top_k_weights, gate_up, down, **options)
