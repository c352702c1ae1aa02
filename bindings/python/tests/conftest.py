"""Shared fixtures: a routed MoE layer holding a valid input for every kernel, and the `moekit`
command the Python results are compared with."""

import json
import os
import pathlib
import struct

import ml_dtypes
import numpy as np
import pytest

import moekit

ROOT = pathlib.Path(__file__).resolve().parents[3]

# A small layer: T tokens, H hidden, E experts (divisible by the R ranks of a2av_routing), K
# top-k, I intermediate, B block size.
T, H, E, K, I, B, R = 13, 16, 6, 2, 8, 4, 2

# Every kernel's parameters for that layer.
PARAMS = {
    "router_topk": {"k": K},
    "router_topk_bwd": {},
    "load_balancing_loss": {},
    "load_balancing_loss_bwd": {},
    "permute": {"num_experts": E, "block_size": B},
    "permute_bwd": {"num_experts": E},
    "blockwise_mm": {"checkpoint_activation": True},
    "blockwise_mm_bwd": {},
    "a2av_routing": {"num_experts": E, "expert_parallel_degree": R},
    "moe_tkg": {"is_all_expert": False, "expert_affinities_scaling_mode": "POST_SCALE"},
    "rmsnorm_router_topk_tkg": {"top_k": K, "router_act_fn": "SOFTMAX"},
    "rmsnorm_router_topk_tkg_bwd": {"router_act_fn": "SOFTMAX"},
    "moe_block_tkg": {
        "top_k": K,
        "router_act_fn": "SOFTMAX",
        "norm_topk_prob": True,
        "expert_affinities_scaling_mode": "POST_SCALE",
    },
    "topk": {"k": K},
    "topk_reduce": {"T": T, "K": K},
    "find_nonzero_indices": {},
    # Each expert's token list laid out back to back (f_len 1: T = 13 has no other divisor).
    "indexed_flatten": {"f_len": 1, "output_len": T * K},
}

# Inputs a kernel takes under a name that another kernel's tensor has in the layer: the
# decode-time router's `hidden_states` and the decode block's `inp` are the tokens `x`
# (blockwise_mm's `hidden_states` are `[T+1, H]`); the top-k runs over the router's logits;
# the combine over the plan's rows as an exchange returns them, the nonzero search over the
# routed affinities `[T, E]` and the flatten over the token lists it finds.
RENAMED = {
    "rmsnorm_router_topk_tkg": {"hidden_states": "x"},
    "rmsnorm_router_topk_tkg_bwd": {"hidden_states": "x"},
    "moe_block_tkg": {"inp": "x"},
    "topk": {"inp": "router_logits"},
    "topk_reduce": {"input": "exchanged_rows"},
    "find_nonzero_indices": {"input_tensor": "routed_affinities"},
    "indexed_flatten": {"input_tensor": "token_lists"},
}


def exchanged_rows(hidden_states, token_position_to_id):
    """`topk_reduce`'s input for a plan: slot s holds the hidden state of its token, tagged
    with the token's 1-indexed id (−1 for padding) in the bits of the last two bf16 columns."""
    t = hidden_states.shape[0] - 1
    ids = np.where(token_position_to_id < t, token_position_to_id + 1, -1).astype("<i4")
    rows = hidden_states[np.minimum(token_position_to_id, t)].astype(ml_dtypes.bfloat16)
    tags = ids.reshape(-1, 1).view("<u2").view(ml_dtypes.bfloat16)
    return np.concatenate([rows, tags], axis=1)


def make_layer(dtype, seed=0):
    """Every input of every kernel (name → NumPy array), floats in `dtype` (float32 or
    bfloat16): random tokens and weights routed, planned and run forward by the reference."""
    rng = np.random.default_rng(seed)

    def floats(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)

    x = floats(T, H)
    w = floats(H, E)
    routed = moekit.router_topk(x, w, k=K, backend="reference")
    plan = moekit.permute(
        routed["expert_index"], routed["topk_affinities"], num_experts=E, block_size=B,
        backend="reference",
    )
    hidden_states = np.concatenate([x, np.zeros((1, H), dtype)])
    gate_up = floats(E, H, 2, I, scale=0.3)
    down = floats(E, I, H, scale=0.3)
    layer = {
        "x": x,
        "w": w,
        "router_logits": routed["router_logits"],
        "expert_index": routed["expert_index"],
        "topk_affinities": routed["topk_affinities"],
        "d_topk_affinities": floats(T, K),
        "d_aux_loss": floats(1),
        "hidden_states": hidden_states,
        "gate_up_proj_weight": gate_up,
        "down_proj_weight": down,
        # moe_tkg decodes the same tokens through the same experts.
        "hidden_input": x,
        "expert_gate_up_weights": gate_up,
        "expert_down_weights": down,
        "expert_affinities": routed["expert_affinities"],
        # The decode-time RMSNorm and router, its operands in bf16 (router_mm_dtype's default).
        "gamma": floats(1, H),
        "router_weights": w.astype(ml_dtypes.bfloat16),
        "d_expert_affinities": floats(T, E),
        "token_position_to_id": plan["token_position_to_id"],
        "block_to_expert": plan["block_to_expert"],
        "expert_affinities_masked": plan["expert_affinities_masked"],
    }
    forward = moekit.blockwise_mm(**_inputs_of("blockwise_mm", layer), backend="reference",
                                  checkpoint_activation=True)
    grad = floats(T + 1, H)
    grad[T] = 0
    layer.update(
        gate_up_proj_act_checkpoint_T=forward["gate_up_activations_T"],
        down_proj_act_checkpoint=forward["down_activations"],
        output_hidden_states_grad=grad,
    )
    backward = moekit.blockwise_mm_bwd(**_inputs_of("blockwise_mm_bwd", layer),
                                       backend="reference")
    layer["expert_affinities_masked_grad"] = backward["expert_affinities_masked_grad"]
    layer["exchanged_rows"] = exchanged_rows(hidden_states, plan["token_position_to_id"])
    layer["routed_affinities"] = plan["expert_affinities_masked"].reshape(T + 1, E)[:T]
    found = moekit.find_nonzero_indices(layer["routed_affinities"], backend="reference")
    layer["token_lists"] = found["indices"]
    counts = found["nonzero_counts"]
    layer["row_offsets"] = (np.cumsum(counts) - counts).astype(np.int32)
    return layer


def _inputs_of(kernel, layer):
    names = moekit.Kernel.named(kernel).input_names
    source = RENAMED.get(kernel, {})
    return {name: layer[source.get(name, name)] for name in names if source.get(name, name) in layer}


def inputs_of(kernel, layer):
    """The inputs of `kernel` in `layer`, every required one present."""
    spec = moekit.Kernel.named(kernel)
    source = RENAMED.get(kernel, {})
    missing = [
        t.name for t in spec.inputs if t.required and source.get(t.name, t.name) not in layer
    ]
    assert not missing, f"the test layer lacks {missing} for {kernel}"
    return _inputs_of(kernel, layer)


@pytest.fixture(scope="session", params=[np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def layer(request):
    return make_layer(request.param)


@pytest.fixture(scope="session")
def cli():
    """The `moekit` command built from this checkout (MOEKIT_CLI, else target/debug)."""
    path = pathlib.Path(os.environ.get("MOEKIT_CLI", ROOT / "target" / "debug" / "moekit"))
    if not path.is_file():
        pytest.fail(f"{path} not found: build it (cargo build -p moekit-tools) or set MOEKIT_CLI")
    return path


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "int32": "I32"}


def save_safetensors(path, tensors):
    """Writes `tensors` (name → NumPy array) in the safetensors format."""
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[array.dtype.name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def load_safetensors(path):
    """The tensors of a safetensors file, as NumPy arrays."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    dtypes = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "I32": np.int32}
    body = data[8 + length :]
    tensors = {}
    for name, entry in header.items():
        start, end = entry["data_offsets"]
        array = np.frombuffer(body[start:end], dtype=dtypes[entry["dtype"]])
        tensors[name] = array.reshape(entry["shape"])
    return tensors
