"""Hugging Face side of the trainer's parity test (driven by tests/hf_parity.rs).

    python hf_parity.py make DIR CASE   # a random tiny Qwen3-MoE (or, for the dense_* cases,
                                        # Qwen3) saved to DIR/hf, fixed tokens
                                        # in DIR/tokens.safetensors, transformers' logits in
                                        # DIR/expected.safetensors, losses and the greedy
                                        # continuation of the first row in DIR/expected.json
    python hf_parity.py eval MODEL TOKENS OUT   # transformers' logits of MODEL on TOKENS -> OUT

Everything runs in float32 on the CPU with transformers' default attention (SDPA) and experts.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

CASES = {
    "default": {},
    "no_norm_topk_prob": {"norm_topk_prob": False},
    "sparse_step_2": {"decoder_sparse_step": 2},
    "mlp_only_layers": {"mlp_only_layers": [0, 2]},
    "tied": {"tie_word_embeddings": True},
}

# Dense Qwen3ForCausalLM: untied, tied, and a GQA ratio of 4 with head_dim != hidden / heads.
DENSE_CASES = {
    "dense": {},
    "dense_tied": {"tie_word_embeddings": True},
    "dense_gqa4": {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 12},
}


# Tokens `generate(do_sample=False)` adds to the first row of the fixed tokens.
NEW_TOKENS = 12


def greedy(model, input_ids: torch.Tensor) -> dict:
    """transformers' greedy continuation of input_ids[0] (it stops early at an eos token)."""
    prompt = input_ids[:1]
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return {"prompt_ids": prompt[0].tolist(), "generated_ids": out[0, prompt.shape[1]:].tolist()}


def make_dense(out_dir: str, case: str) -> None:
    torch.manual_seed(0)
    settings = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        rope_theta=1_000_000.0,
        initializer_range=0.2,
    )
    config = Qwen3Config(**{**settings, **DENSE_CASES[case]})
    model = Qwen3ForCausalLM(config).float().eval()
    model.save_pretrained(f"{out_dir}/hf")
    input_ids = torch.randint(0, config.vocab_size, (2, 11), dtype=torch.int64)
    save_file({"input_ids": input_ids}, f"{out_dir}/tokens.safetensors")
    with torch.no_grad():
        out = model(input_ids, labels=input_ids)
    save_file({"logits": out.logits.contiguous()}, f"{out_dir}/expected.safetensors")
    with open(f"{out_dir}/expected.json", "w") as f:
        # No router: no auxiliary loss.
        json.dump({"total_loss": out.loss.item(), "aux_loss": 0.0, **greedy(model, input_ids)}, f)


def make(out_dir: str, case: str) -> None:
    if case in DENSE_CASES:
        make_dense(out_dir, case)
        return
    torch.manual_seed(0)
    settings = dict(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        max_position_embeddings=128,
        rope_theta=1_000_000.0,
        # Large enough that routing and every layer matter to the logits.
        initializer_range=0.2,
        router_aux_loss_coef=0.01,
    )
    config = Qwen3MoeConfig(**{**settings, **CASES[case]})
    model = Qwen3MoeForCausalLM(config).float().eval()
    model.save_pretrained(f"{out_dir}/hf")
    input_ids = torch.randint(0, config.vocab_size, (2, 11), dtype=torch.int64)
    save_file({"input_ids": input_ids}, f"{out_dir}/tokens.safetensors")
    with torch.no_grad():
        out = model(input_ids, labels=input_ids, output_router_logits=True)
    save_file({"logits": out.logits.contiguous()}, f"{out_dir}/expected.safetensors")
    with open(f"{out_dir}/expected.json", "w") as f:
        # transformers' `loss` already includes router_aux_loss_coef * aux_loss.
        json.dump(
            {
                "total_loss": out.loss.item(),
                "aux_loss": out.aux_loss.item(),
                **greedy(model, input_ids),
            },
            f,
        )


def evaluate(model_dir: str, tokens: str, out: str) -> None:
    # Qwen3MoeForCausalLM or Qwen3ForCausalLM, as config.json's model_type says.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = {"qwen3_moe": Qwen3MoeForCausalLM, "qwen3": Qwen3ForCausalLM}[model.config.model_type]
    assert isinstance(model, expected), type(model)
    input_ids = load_file(tokens)["input_ids"].to(torch.int64)
    with torch.no_grad():
        logits = model(input_ids).logits
    save_file({"logits": logits.contiguous()}, out)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"make": make, "eval": evaluate}[command](*args)
