"""Hugging Face transformers as the independent reference for captured activations."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def _blocks(model):
    inner = getattr(model, "model", None) or model.transformer
    return list(getattr(inner, "layers", None) or inner.h)


@torch.no_grad()
def run(model_dir, token_ids: list[int]) -> dict[str, np.ndarray]:
    """Residual stream after every block, MLP neuron activations and logits for one sequence."""
    model = load(str(model_dir))
    resid, mlp_post = [], []
    handles = []
    for block in _blocks(model):
        handles.append(block.register_forward_hook(
            lambda m, a, out: resid.append((out[0] if isinstance(out, tuple) else out)[0].clone())))
        down = getattr(block.mlp, "down_proj", None) or block.mlp.c_proj
        handles.append(down.register_forward_pre_hook(lambda m, a: mlp_post.append(a[0][0].clone())))
    try:
        out = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return {"resid_post": torch.stack(resid).numpy(), "mlp_post": torch.stack(mlp_post).numpy(),
            "embed_resid": out.hidden_states[0][0].numpy(), "final": out.hidden_states[-1][0].numpy(),
            "logits": out.logits[0].numpy()}


@torch.no_grad()
def attention_patterns(model_dir, token_ids: list[int]) -> list[np.ndarray]:
    """Every layer's attention weights [heads, tokens, tokens] from transformers' eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    out = model(torch.tensor([token_ids]), output_attentions=True)
    return [a[0].numpy() for a in out.attentions]
