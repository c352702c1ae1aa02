"""moekit from Python against transformers' own experts implementations, in one run.

A Hugging Face transformers Qwen3-MoE shaped like configs/qwen3_moe_small.toml (its [model]
section, and a batch of [training] batch_size × seq_len tokens) is timed, float32 on CPU:

- the experts call alone (one MoE layer's `Qwen3MoeExperts`, forward + backward, on routed
  tokens from that layer's router), and
- a training step (forward + backward + AdamW) of the whole model,

with `experts_implementation` = eager, grouped_mm and moekit. Also the Python-side cost of a
moekit experts call: `moekit.torch.transformers_experts`'s time beyond the extension's forward
and backward on the same tensors (transformers' weights, read in place as
`weight_layout="linear"`; the two interleaved over 3·N repeats, the median of the per-repeat
differences), the extension's time on the same weights rearranged into nki-library's layout,
and `moekit.torch.torchtitan_experts` on the same weights held as torchtitan holds them
(`w1`, `w3 [E, I, H]` two tensors, read in place).

    bash scripts/transformers.sh && bash scripts/python.sh   # torch, transformers, moekit
    .venv/bin/python benches/python_experts.py [--repeats N] [--json]

Times are the median of N repeats after one warm-up; ratios are against moekit's time.
"""

import argparse
import json
import pathlib
import platform
import statistics
import time
import tomllib

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import moekit
import moekit.transformers  # noqa: F401  (registers "moekit")
from moekit import _moekit
from moekit._arrays import _capsule
from moekit.torch import DEFAULT_BLOCK_SIZE, torchtitan_experts, transformers_experts

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "qwen3_moe_small.toml"
IMPLEMENTATIONS = ("eager", "grouped_mm", "moekit")


def model_and_batch():
    config = tomllib.loads(CONFIG.read_text())
    model = config["model"]
    hf = Qwen3MoeConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["hidden_size"],
        intermediate_size=model["intermediate_size"],
        moe_intermediate_size=model["moe_intermediate_size"],
        num_hidden_layers=model["num_hidden_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_key_value_heads"],
        head_dim=model["head_dim"],
        num_experts=model["num_experts"],
        num_experts_per_tok=model["num_experts_per_tok"],
        norm_topk_prob=model["norm_topk_prob"],
        rope_theta=model["rope_theta"],
        max_position_embeddings=model["max_position_embeddings"],
        router_aux_loss_coef=model["router_aux_loss_coef"],
        output_router_logits=True,
    )
    torch.manual_seed(0)
    training = config["training"]
    ids = torch.randint(0, hf.vocab_size, (training["batch_size"], training["seq_len"]))
    return Qwen3MoeForCausalLM(hf), ids


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def routed_tokens(model, ids):
    """Layer 0's MoE input: hidden states [T, H], top-k ids and weights, from its router."""
    layer = model.model.layers[0]
    captured = {}

    def hook(module, args):
        captured["args"] = args

    handle = layer.mlp.experts.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(ids)
    handle.remove()
    hidden, index, weights = captured["args"]
    return layer.mlp.experts, hidden.detach(), index, weights.detach()


def experts_call(experts, hidden, index, weights):
    def call():
        x = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        out = experts(x, index, w)
        out.backward(torch.ones_like(out))

    return call


def training_step(model, ids):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def interleaved_medians(calls, repeats):
    """Median seconds of each of `calls` after one warm-up each, the calls run in turn within
    every repeat (so that a drift of the machine reaches each alike), and the median of each
    repeat's difference between the second call and the first."""
    for call in calls:
        call()
    times = [[] for _ in calls]
    for _ in range(repeats):
        for call, samples in zip(calls, times):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
    difference = statistics.median(b - a for a, b in zip(times[0], times[1]))
    return [statistics.median(samples) for samples in times], difference


def python_overhead(experts, hidden, index, weights, repeats):
    """One experts forward + backward on transformers' weights, interleaved: seconds of (the
    extension's, `moekit.torch.transformers_experts`'s, the extension's on the same weights
    rearranged into nki-library's layout, `moekit.torch.torchtitan_experts`'s on them as
    torchtitan's `w1`, `w2`, `w3`), and the median per-repeat difference between the first
    two (the Python side: the autograd function, DLPack capsules, gradients out)."""
    gate_up_proj = experts.gate_up_proj.detach()
    down_proj = experts.down_proj.detach()
    e, two_i, h = gate_up_proj.shape
    linear = (gate_up_proj.view(e, 2, two_i // 2, h), down_proj)
    nki = (
        linear[0].permute(0, 3, 1, 2).contiguous(),
        down_proj.transpose(1, 2).contiguous(),
    )
    # torchtitan's gate and up weights: two tensors of their own.
    w1, w3 = (half.contiguous() for half in linear[0].unbind(1))
    d_output = torch.ones_like(hidden)

    def extension(weight_layout, gate_up, down):
        raw = _moekit.Experts(
            backend="cpu", block_size=DEFAULT_BLOCK_SIZE, weight_layout=weight_layout
        )

        def call():
            capsules = [_capsule(t) for t in (hidden, index, weights, gate_up, down)]
            output, saved = raw.forward(*capsules, True)
            torch.from_dlpack(output)
            raw.backward(saved, _capsule(d_output))

        return call

    def autograd():
        # New leaves over the same storage (no copy inside the timed call).
        leaves = [t.detach().requires_grad_() for t in (hidden, weights, gate_up_proj, down_proj)]
        out = transformers_experts(leaves[0], index, leaves[1], leaves[2], leaves[3])
        torch.autograd.grad(out, leaves, d_output)

    def torchtitan():
        leaves = [t.detach().requires_grad_() for t in (hidden, weights, w1, down_proj, w3)]
        out = torchtitan_experts(leaves[0], index, *leaves[1:])
        torch.autograd.grad(out, leaves, d_output)

    calls = [extension("linear", *linear), autograd, extension("nki", *nki), torchtitan]
    seconds, overhead_s = interleaved_medians(calls, repeats)
    return (*seconds, overhead_s)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    model, ids = model_and_batch()
    experts, hidden, index, weights = routed_tokens(model, ids)
    rows = {}
    for implementation in IMPLEMENTATIONS:
        model.set_experts_implementation(implementation)
        rows[implementation] = {
            "experts_s": median_time(experts_call(experts, hidden, index, weights), args.repeats),
            "step_s": median_time(training_step(model, ids), max(3, args.repeats // 3)),
        }
    extension_s, autograd_s, nki_extension_s, torchtitan_s, overhead_s = python_overhead(
        experts, hidden, index, weights, 3 * args.repeats
    )
    result = {
        "config": str(CONFIG.relative_to(ROOT)),
        "tokens": int(ids.numel()),
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "moekit": moekit.BUILD,
        "rows": rows,
        "extension_s": extension_s,
        "autograd_s": autograd_s,
        "nki_extension_s": nki_extension_s,
        "torchtitan_s": torchtitan_s,
        "python_side_s": overhead_s,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"transformers Qwen3-MoE ({result['config']}), T = {result['tokens']} tokens, f32, "
        f"torch threads {result['torch_threads']}, moekit {result['moekit']}"
    )
    mine = rows["moekit"]
    print(f"{'experts':<12} {'experts fwd+bwd':>16} {'÷ moekit':>9} {'train step':>12} {'÷ moekit':>9}")
    for implementation, row in rows.items():
        print(
            f"{implementation:<12} {row['experts_s'] * 1e3:>13.1f} ms {row['experts_s'] / mine['experts_s']:>8.2f}x "
            f"{row['step_s'] * 1e3:>9.1f} ms {row['step_s'] / mine['step_s']:>8.2f}x"
        )
    overhead = overhead_s
    print(
        f"moekit experts call on transformers' weights: extension {extension_s * 1e3:.2f} ms, "
        f"transformers_experts {autograd_s * 1e3:.2f} ms (Python side {overhead * 1e3:.2f} ms, "
        f"{overhead / extension_s:.1%}); the extension on nki-layout copies "
        f"{nki_extension_s * 1e3:.2f} ms; torchtitan_experts on w1, w2, w3 "
        f"{torchtitan_s * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
