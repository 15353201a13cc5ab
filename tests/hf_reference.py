"""Hugging Face transformers as the independent reference for captured activations."""

from __future__ import annotations

import functools

import numpy as np
import torch


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    from transformers import AutoModelForCausalLM

    # eager attention: the reference computes what the config says (sdpa would drop Gemma 2's soft cap)
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                attn_implementation="eager").eval()


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
    out = load(str(model_dir))(torch.tensor([token_ids]), output_attentions=True)
    return [a[0].numpy() for a in out.attentions]


@torch.no_grad()
def direct_logit_attribution(model_dir, components: np.ndarray, final_residual: np.ndarray) -> np.ndarray:
    """TransformerLens's convention, written out: a component's rows, centred if the final norm is a
    LayerNorm, times the norm's weight, divided by the final residual's norm scale, through lm_head's
    weight (no bias). [rows, vocab]. For Llama/Qwen2 (RMSNorm) and GPT-2 (LayerNorm) final norms."""
    model = load(str(model_dir))
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    c, r = torch.from_numpy(components).double(), torch.from_numpy(final_residual).double()
    centred = isinstance(norm, torch.nn.LayerNorm)
    eps = norm.eps if centred else norm.variance_epsilon
    if centred:
        c, r = c - c.mean(-1, keepdim=True), r - r.mean(-1, keepdim=True)
    scale = torch.sqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return ((c * norm.weight.double() / scale) @ model.lm_head.weight.double().T).numpy()
