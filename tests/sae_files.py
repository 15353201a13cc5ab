"""SAEs as SAELens writes them (the hub is unreachable): ``write_sae`` saves a directory like
``SAE.save_model`` (``cfg.json`` with the config and a ``metadata`` block, ``sae_weights.safetensors``),
or like older SAELens versions (``legacy``: hook_name at the top, a top-k SAE as
``activation_fn_str: "topk"``, JumpReLU's ``log_threshold``); ``saelens_encode`` encodes as SAELens's
inference SAEs do, in torch, written from their classes (the independent reference)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file


def write_sae(directory: Path, architecture: str, d_in: int, d_sae: int, hook_name: str, k: int = 16,
              normalize: str = "none", apply_b_dec_to_input: bool = True, legacy: bool = False,
              seed: int = 0) -> Path:
    """A random SAE whose features are sparse on rows of about unit scale."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    w_dec = rng.standard_normal((d_sae, d_in)).astype(np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    tensors = {"W_enc": (w_dec.T * 2.0).copy(), "b_enc": rng.normal(-0.1, 0.05, d_sae).astype(np.float32),
               "W_dec": w_dec, "b_dec": rng.normal(0, 0.02, d_in).astype(np.float32)}
    cfg = {"architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": apply_b_dec_to_input, "normalize_activations": normalize,
           "reshape_activations": "none"}
    if architecture == "jumprelu":
        threshold = rng.uniform(0.02, 0.1, d_sae).astype(np.float32)
        tensors["log_threshold" if legacy else "threshold"] = np.log(threshold) if legacy else threshold
    if architecture == "topk":
        cfg.update({"architecture": "standard", "activation_fn_str": "topk", "activation_fn_kwargs": {"k": k}}
                   if legacy else {"k": k})
    if legacy:
        cfg.update(hook_name=hook_name, hook_layer=int(hook_name.split(".")[1]), model_name="tiny")
    else:
        cfg["metadata"] = {"model_name": "tiny", "hook_name": hook_name, "sae_lens_version": "6.12.1"}
    (directory / "cfg.json").write_text(json.dumps(cfg))
    save_file(tensors, str(directory / "sae_weights.safetensors"))
    return directory


@torch.no_grad()
def saelens_encode(directory: Path, x: np.ndarray) -> np.ndarray:
    """Feature activations [rows, d_sae] as SAELens's inference SAE of this directory computes them."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(directory) / "cfg.json").read_text())
    w = load_file(str(Path(directory) / "sae_weights.safetensors"))
    if "log_threshold" in w:
        w["threshold"] = torch.exp(w["log_threshold"])
    sae_in = torch.from_numpy(np.asarray(x, np.float32))
    if cfg.get("normalize_activations") == "constant_norm_rescale":
        sae_in = sae_in * (cfg["d_in"] ** 0.5) / sae_in.norm(dim=-1, keepdim=True)
    elif cfg.get("normalize_activations") == "layer_norm":
        sae_in = sae_in - sae_in.mean(dim=-1, keepdim=True)
        sae_in = sae_in / (sae_in.std(dim=-1, keepdim=True) + 1e-5)
    sae_in = sae_in - w["b_dec"] * cfg.get("apply_b_dec_to_input", True)
    hidden_pre = sae_in @ w["W_enc"] + w["b_enc"]
    if cfg["architecture"] == "topk" or cfg.get("activation_fn_str") == "topk":
        top = torch.topk(hidden_pre, k=cfg.get("k") or cfg["activation_fn_kwargs"]["k"], dim=-1)
        return torch.zeros_like(hidden_pre).scatter_(-1, top.indices, torch.relu(top.values)).numpy()
    acts = torch.relu(hidden_pre)
    if cfg["architecture"] == "jumprelu":
        acts = acts * (hidden_pre > w["threshold"]).to(acts.dtype)
    return acts.numpy()
