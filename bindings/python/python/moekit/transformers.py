"""moekit's experts in Hugging Face transformers (v5): importing this module registers two
implementations in transformers' experts interface (`ALL_EXPERTS_FUNCTIONS`),

- `"moekit"`: the `cpu` backend's kernels,
- `"moekit_reference"`: the `reference` backend (f64 loops, the oracle; slow),

so that `AutoModelForCausalLM.from_pretrained(path, experts_implementation="moekit")` (or
`model.set_experts_implementation("moekit")`) trains and evaluates with them.

They run the experts of any model whose experts module keeps transformers' default layout:
`gate_up_proj [E, 2·I, H]` (gate rows first, concatenated), `down_proj [E, H, I]`, no biases, a
SiLU gate (`hidden_act = "silu"`), the default gating and no post-expert norm, e.g. Qwen3-MoE,
Qwen2-MoE, OLMoE and Mixtral. Other layouts, and experts under transformers' expert
parallelism, raise a `ContractError` naming what differs.
"""

import functools

import torch
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

from .errors import ContractError
from .torch import transformers_experts

# Registered implementation name → moekit backend.
IMPLEMENTATIONS = {"moekit": "cpu", "moekit_reference": "reference"}

# The flags of `@use_experts_implementation` and the values moekit's kernels compute.
_SUPPORTED_FLAGS = {
    "has_gate": True,
    "is_concatenated": True,
    "is_transposed": False,
    "has_bias": False,
    "has_post_expert_norm": False,
    "_is_expert_parallel": False,
}


def _check_supported(module):
    name = type(module).__name__
    for flag, supported in _SUPPORTED_FLAGS.items():
        if getattr(module, flag, supported) != supported:
            raise ContractError(
                f"moekit's experts: `{name}` has {flag}={not supported}; moekit runs experts with "
                "gate_up_proj [E, 2·I, H] and down_proj [E, H, I], no biases, on one process"
            )
    if not isinstance(module.act_fn, (SiLUActivation, torch.nn.SiLU)):
        raise ContractError(
            f"moekit's experts: `{name}` gates with {type(module.act_fn).__name__}; moekit "
            "computes SiLU(gate)·up"
        )
    if type(module)._apply_gate is not _default_apply_gate:
        raise ContractError(f"moekit's experts: `{name}` overrides the gating (_apply_gate)")


def experts_forward(self, hidden_states, top_k_index, top_k_weights, *, backend):
    """The experts interface's forward: `hidden_states [T, H]`, `top_k_index [T, K]`,
    `top_k_weights [T, K]` → `[T, H]`, on moekit's `backend`."""
    _check_supported(self)
    return transformers_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        backend=backend,
    )


for _name, _backend in IMPLEMENTATIONS.items():
    ALL_EXPERTS_FUNCTIONS.register(_name, functools.partial(experts_forward, backend=_backend))
