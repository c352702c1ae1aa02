"""torchtitan's routed experts on moekit's kernels, enabled by configuration only: an override
(torchtitan ≥ 0.3's `torchtitan/config/override.py` registry) that replaces every stock
`GroupedExperts` with `MoekitGroupedExperts`:

    --override.imports moekit.torchtitan.moekit_grouped_experts

(with kwargs: `'moekit.torchtitan.moekit_grouped_experts={"backend": "cpu", "block_size": 64}'`).

`MoekitGroupedExperts` keeps `GroupedExperts`' parameters (`w1_EFD`, `w3_EFD [E, F, D]`,
`w2_EDF [E, D, F]`), its checkpoints and its numerics (bfloat16 operands, the output in the
input's dtype); its forward takes the same rows sorted by expert, `x_RD [R, D]` with
`num_tokens_per_expert_E [E]` (rows past their sum are padding and come out zero), and runs
them through moekit's experts, each row its expert's with weight 1, forward and backward.
The three weights are read where they lie (`w1` and `w3` as two tensors, never stacked) when
they are bfloat16; float32 parameters are cast to bfloat16 per call, as `GroupedExperts`' own
grouped_mm path casts them.
Subclasses of `GroupedExperts` with other semantics (gpt-oss's) are left as they are.
"""

from dataclasses import dataclass

import torch
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts

from .torch import DEFAULT_BLOCK_SIZE, torchtitan_experts

DEFAULT_BACKEND = "cpu"


class MoekitGroupedExperts(GroupedExperts):
    """`GroupedExperts` computed by moekit's kernels."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        backend: str = DEFAULT_BACKEND
        block_size: int = DEFAULT_BLOCK_SIZE

    def __init__(self, config: Config):
        super().__init__(config)
        self.backend = config.backend
        self.block_size = config.block_size

    def forward(self, x_RD, num_tokens_per_expert_E):
        rows = x_RD.shape[0]
        experts = num_tokens_per_expert_E.shape[0]
        ids = torch.repeat_interleave(
            torch.arange(experts, dtype=torch.int32), num_tokens_per_expert_E.cpu()
        )
        routed = ids.shape[0]
        if routed > rows:
            raise ValueError(
                f"num_tokens_per_expert_E sums to {routed}, more than the {rows} rows of x_RD"
            )
        # Padding rows: the last expert with weight 0, so they come out zero.
        expert_index = torch.full((rows, 1), experts - 1, dtype=torch.int32)
        expert_index[:routed, 0] = ids
        weights = torch.zeros(rows, 1, dtype=torch.bfloat16)
        weights[:routed] = 1
        w1, w2, w3 = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        if hasattr(w1, "to_local"):
            w1, w2, w3 = (w.to_local() for w in (w1, w2, w3))
        out = torchtitan_experts(
            x_RD.bfloat16(),
            expert_index,
            weights,
            w1.bfloat16(),
            w2.bfloat16(),
            w3.bfloat16(),
            backend=self.backend,
            block_size=self.block_size,
        )
        return out.type_as(x_RD)


@override(
    target=GroupedExperts.Config,
    description="torchtitan's routed experts (GroupedExperts) on moekit's kernels",
)
def moekit_grouped_experts(cfg, backend=DEFAULT_BACKEND, block_size=DEFAULT_BLOCK_SIZE):
    if type(cfg) is not GroupedExperts.Config:
        return cfg
    return derive(cfg, MoekitGroupedExperts.Config, backend=backend, block_size=block_size)
