"""`import moekit.transformers`: moekit's experts in Hugging Face transformers' experts interface,
against transformers' own eager experts on random small models.

Tolerance: float32 models, logits, losses and gradients within rtol = 1e-4, atol = 1e-5 of
eager's (moekit sums in another order; measured differences are about 1e-7)."""

import copy
import os
import subprocess
import sys

import pytest
import torch
from transformers import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import moekit
import moekit.transformers

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
VOCAB = 64

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts_per_tok=2,
    output_router_logits=True,
)


def qwen3_moe(**overrides):
    config = Qwen3MoeConfig(**{**SMALL, "moe_intermediate_size": 16, "num_experts": 8, **overrides})
    return Qwen3MoeForCausalLM(config)


QWEN3_MOE_VARIANTS = {
    "norm_topk_prob": dict(norm_topk_prob=True),
    "no_norm_topk_prob": dict(norm_topk_prob=False),
    "decoder_sparse_step_2": dict(decoder_sparse_step=2, norm_topk_prob=True),
    "mlp_only_layers": dict(mlp_only_layers=[0, 2]),
    "tied_embeddings": dict(tie_word_embeddings=True, norm_topk_prob=True),
}


def other_models():
    """transformers models whose experts keep Qwen3-MoE's layout."""
    olmoe = OlmoeConfig(**{**SMALL, "num_experts": 8, "intermediate_size": 16})
    mixtral = MixtralConfig(**{**SMALL, "num_local_experts": 8, "intermediate_size": 16})
    return {"olmoe": OlmoeForCausalLM(olmoe), "mixtral": MixtralForCausalLM(mixtral)}


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def run(model, implementation, ids):
    """Logits, loss (with the aux loss where the model adds it) and every parameter's
    gradient."""
    model.set_experts_implementation(implementation)
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def assert_same_as_eager(model, implementation="moekit"):
    ids = batch(1)
    logits, loss, grads = run(model, "eager", ids)
    got_logits, got_loss, got_grads = run(model, implementation, ids)
    torch.testing.assert_close(got_logits, logits, **TOLERANCE)
    torch.testing.assert_close(got_loss, loss, **TOLERANCE)
    assert sorted(got_grads) == sorted(grads)
    experts_grads = [name for name in grads if "experts" in name]
    assert experts_grads, "no experts took part"
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("variant", sorted(QWEN3_MOE_VARIANTS))
def test_qwen3_moe_logits_loss_and_every_gradient_match_eager(variant):
    torch.manual_seed(0)
    assert_same_as_eager(qwen3_moe(**QWEN3_MOE_VARIANTS[variant]))


@pytest.mark.parametrize("name", ["olmoe", "mixtral"])
def test_other_models_with_the_same_experts_layout(name):
    torch.manual_seed(0)
    assert_same_as_eager(other_models()[name])


def test_the_reference_backend_is_registered_too():
    torch.manual_seed(0)
    assert_same_as_eager(qwen3_moe(num_hidden_layers=1), "moekit_reference")


def test_five_adamw_steps_give_the_same_losses():
    torch.manual_seed(0)
    model = qwen3_moe(norm_topk_prob=True)
    losses = {}
    for implementation in ("eager", "moekit"):
        trained = copy.deepcopy(model)
        trained.set_experts_implementation(implementation)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        losses[implementation] = []
        for _ in range(5):
            ids = batch(10)
            loss = trained(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses[implementation].append(loss.item())
    assert losses["eager"][-1] < losses["eager"][0]
    torch.testing.assert_close(
        torch.tensor(losses["moekit"]), torch.tensor(losses["eager"]), **TOLERANCE
    )


def test_from_pretrained_takes_the_implementation_by_name(tmp_path):
    torch.manual_seed(0)
    qwen3_moe(norm_topk_prob=True).save_pretrained(tmp_path)
    model = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="moekit")
    assert model.config._experts_implementation == "moekit"
    eager = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    ids = batch(3)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, eager(ids).logits, **TOLERANCE)


def test_other_layouts_are_refused_naming_what_differs():
    torch.manual_seed(0)
    config = GptOssConfig(**{**SMALL, "num_local_experts": 4, "intermediate_size": 16,
                             "layer_types": ["full_attention"] * 3})
    model = GptOssForCausalLM(config)
    model.set_experts_implementation("moekit")
    with pytest.raises(moekit.ContractError, match=r"`GptOssExperts` has is_concatenated=False"):
        model(batch(4))


def test_model_output_is_bit_identical_whatever_the_thread_count():
    script = (
        "import hashlib, torch, moekit.transformers\n"
        "from test_transformers import qwen3_moe, batch\n"
        "torch.set_num_threads(1)\n"
        "torch.manual_seed(0)\n"
        "model = qwen3_moe(norm_topk_prob=True)\n"
        "model.set_experts_implementation('moekit')\n"
        "ids = batch(5)\n"
        "out = model(ids, labels=ids)\n"
        "out.loss.backward()\n"
        "h = hashlib.sha256(out.logits.detach().numpy().tobytes())\n"
        "for p in model.parameters(): h.update(p.grad.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    digests = set()
    for threads in (1, 2, 3):
        env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
        result = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                capture_output=True, text=True, cwd=os.path.dirname(__file__))
        digests.add(result.stdout.strip().splitlines()[-1])
    assert len(digests) == 1
