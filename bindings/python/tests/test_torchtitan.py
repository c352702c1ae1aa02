"""moekit.torchtitan: the override that puts torchtitan's GroupedExperts on moekit, enabled by
configuration, against the stock GroupedExperts, forward and backward.

torchtitan 0.3.0's trainer cannot run here: it imports `DataParallelMeshDims` from
`torch.distributed.fsdp`, which torch 2.11 does not have (0.3.0 is built against a newer torch),
so neither `torchtitan.train` nor `torchtitan.models.qwen3` import. The override's module is
tested in isolation and in torchtitan's MoE layer, whose modules import with torch 2.11.

Tolerance: both compute with bfloat16 operands and round their outputs to bfloat16 (torchtitan
also rounds SiLU(gate)·up to bfloat16 before the down projection, moekit does not), so results
agree to a few bfloat16 ulps: |got − want| ≤ 2^-6 · max|want|."""

import copy

import pytest
import torch
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import (
    MoE,
    GroupedExperts,
    RoutedExperts,
    TokenChoiceTopKRouter,
)
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from moekit.torchtitan import MoekitGroupedExperts

E, F, D, K = 8, 16, 32, 2
OVERRIDE = "moekit.torchtitan.moekit_grouped_experts"


def assert_close(got, want):
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2**-6 * scale, (got - want).abs().max()


def experts_pair(seed):
    torch.manual_seed(seed)
    stock = GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E).build()
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moekit = MoekitGroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E).build()
    moekit.load_state_dict(stock.state_dict())
    return stock, moekit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_module_computes_what_grouped_experts_computes(dtype):
    stock, moekit = experts_pair(0)
    counts = torch.tensor([3, 0, 5, 2, 1, 0, 4, 2])
    rows = int(counts.sum()) + 3  # 3 rows of capacity padding
    x = torch.randn(rows, D, dtype=dtype, requires_grad=True)
    want, got = stock(x, counts), moekit(x, counts)
    assert got.dtype == dtype and got.shape == (rows, D)
    routed = int(counts.sum())
    assert_close(got[:routed].float(), want[:routed].float())
    assert torch.count_nonzero(got[routed:]) == 0
    d_out = torch.randn(rows, D, dtype=dtype)
    d_out[routed:] = 0
    want_grads = torch.autograd.grad(want, [x, *stock.parameters()], d_out)
    got_grads = torch.autograd.grad(got, [x, *moekit.parameters()], d_out)
    # (torch's grouped_mm leaves the padding rows' input gradient undefined.)
    assert_close(got_grads[0][:routed].float(), want_grads[0][:routed].float())
    for g, w in zip(got_grads[1:], want_grads[1:]):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(g.float(), w.float())


def test_checkpoints_are_interchangeable():
    stock, moekit = experts_pair(1)
    assert stock.state_dict().keys() == moekit.state_dict().keys()


def moe_config():
    return MoE.Config(
        num_experts=E,
        load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E,
            gate=Linear.Config(in_features=D, out_features=E),
            top_k=K,
            score_func="softmax",
            route_norm=True,
        ),
    )


def test_the_override_is_enabled_by_configuration_and_trains_like_the_stock_layer():
    stock_config, config = moe_config(), moe_config()
    replaced = apply_overrides(OverrideConfig(imports=[OVERRIDE]), config)
    assert replaced == [
        f"[Override] {OVERRIDE}: routed_experts.inner_experts GroupedExperts.Config -> "
        "MoekitGroupedExperts.Config"
    ]
    torch.manual_seed(2)
    stock = stock_config.build()
    for p in stock.parameters():
        torch.nn.init.normal_(p, std=0.2)
    layer = config.build()
    assert isinstance(layer.routed_experts.inner_experts, MoekitGroupedExperts)
    layer.load_state_dict(stock.state_dict())

    x = torch.randn(2, 12, D)
    target = torch.randn(2, 12, D)
    losses = {}
    for name, module in (("stock", stock), ("moekit", layer)):
        module = copy.deepcopy(module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        losses[name] = []
        for _ in range(5):
            loss = torch.nn.functional.mse_loss(module(x), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[name].append(loss.item())
    assert losses["stock"][-1] < losses["stock"][0]
    torch.testing.assert_close(torch.tensor(losses["moekit"]), torch.tensor(losses["stock"]),
                               rtol=2**-6, atol=0)


def test_override_kwargs_choose_the_backend_and_block_size():
    config = moe_config()
    apply_overrides(
        OverrideConfig(imports=[(OVERRIDE, {"backend": "reference", "block_size": 4})]), config
    )
    experts = config.build().routed_experts.inner_experts
    assert (experts.backend, experts.block_size) == ("reference", 4)
