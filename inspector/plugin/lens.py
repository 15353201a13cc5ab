"""The logit lens and direct logit attribution, where the weights are: rows through the model's own
final norm and unembedding (``vllm_compat``: tied embeddings, logit scale, soft-capping and a
vocab-parallel head are the model's business), of which only the top k and the chosen tokens' scores
and ranks leave the device.

The norm is called through ``forward``, not the module's ``__call__``: a hook installed on it (a capture
of ``ln_final.hook_normalized``, an intervention there) must neither see nor change lens rows.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inspector.core.hooks import HookPoint

from . import vllm_compat

CHUNK_ROWS = 256  # rows per unembedding call: a vocabulary of 128k float32 logits is 128 MiB per 256


def final_norm(model: nn.Module, catalogue: dict[str, HookPoint]) -> nn.Module:
    """The model's final norm, found where the catalogue's ``normalized`` point reads."""
    paths = [p.module_path for p in catalogue.values() if p.kind == "normalized"]
    if not paths:
        raise ValueError(f"{type(model).__name__}: no final norm found, so no logit lens")
    return dict(model.named_modules())[paths[0]]


def lens(model: nn.Module, norm: nn.Module, values: np.ndarray, k: int, chosen: np.ndarray | None,
         device: torch.device, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Per row: the top ``k`` token ids and logprobs, and the logprob and rank (0 = the top) of the
    ``chosen`` token; ``values`` are residual-stream rows, [rows, hidden]."""
    def logprobs(x: torch.Tensor, _) -> torch.Tensor | None:
        logits = vllm_compat.logits(model, _normed(norm, x))
        return None if logits is None else torch.log_softmax(logits.float(), dim=-1)

    return _top_tokens(logprobs, values, None, k, chosen, device, dtype, "logprobs")


@torch.inference_mode()
def logits(model: nn.Module, values: np.ndarray | torch.Tensor, device: torch.device,
           dtype: torch.dtype) -> np.ndarray | torch.Tensor | None:
    """The model's own logits (its ``compute_logits``) of final-norm output rows, float32 [rows, vocab],
    in chunks of ``CHUNK_ROWS``; None on a tensor-parallel rank other than the first. Rows given as a
    tensor (a caller in this process) give a tensor on the engine's device, not a host copy."""
    as_tensor = isinstance(values, torch.Tensor)
    out = []
    for start in range(0, len(values), CHUNK_ROWS):
        chunk = values[start:start + CHUNK_ROWS]
        rows = (chunk if as_tensor else torch.from_numpy(np.ascontiguousarray(chunk))).to(device, dtype)
        found = vllm_compat.logits(model, rows)
        if found is None:
            return None
        out.append(found.float() if as_tensor else found.float().cpu().numpy())
    if as_tensor:
        return torch.cat(out) if out else torch.zeros((0, 0), device=device)
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


@torch.inference_mode()
def attribution(model: nn.Module, norm: nn.Module, values: np.ndarray, residual: np.ndarray, k: int,
                chosen: np.ndarray | None, device: torch.device, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Direct logit attribution: per row of a component's output (``values``), what it adds to each
    token's logit through the final norm with its scale frozen at the final ``residual`` of that
    position, and the unembedding (no bias, no soft cap: summed over every component of the residual
    stream, these give the model's logits less those constants). Top ``k`` ids and logits, and the
    ``chosen`` token's logit and rank."""
    centred, eps = norm_kind(norm, device, dtype)

    def spread(x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(-1, keepdim=True) if centred else x
        return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def logits(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor | None:
        frozen = (_normed(norm, x) - _normed(norm, torch.zeros_like(x[:1]))) * (spread(x) / spread(r))
        out = vllm_compat.unembedding(model, frozen)
        return None if out is None else out.float()

    return _top_tokens(logits, values, residual, k, chosen, device, dtype, "logits")


def _normed(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = norm.forward(x)
    return out[0] if isinstance(out, tuple) else out


@torch.inference_mode()
def norm_kind(norm: nn.Module, device: torch.device, dtype: torch.dtype) -> tuple[bool, float]:
    """(centres like LayerNorm, epsilon), asked of the norm itself: a constant row is all offset to a
    centring norm, which maps it to what it maps zero to; an RMS norm scales it. With these, the norm's
    scale of a row is sqrt(mean(x²) + eps) of the row, centred first if it centres."""
    eps = next((float(getattr(norm, a)) for a in ("variance_epsilon", "eps") if hasattr(norm, a)), None)
    if eps is None:
        raise ValueError(f"{type(norm).__name__}: the final norm's epsilon is unknown, so its scale cannot be frozen")
    probe = torch.zeros(2, getattr(norm, "weight").shape[-1], device=device, dtype=dtype)
    probe[1] = 1.0
    out = _normed(norm, probe)
    return bool(torch.allclose(out[0], out[1])), eps


@torch.inference_mode()
def _top_tokens(score, values: np.ndarray, residual: np.ndarray | None, k: int, chosen: np.ndarray | None,
                device: torch.device, dtype: torch.dtype, measure: str) -> dict[str, np.ndarray]:
    """``score(rows, residual rows)`` gives [rows, vocab]; of each row only the top ``k`` and the
    ``chosen`` token's score and rank leave the device, in chunks of ``CHUNK_ROWS``."""
    ids, tops, chosen_scores, chosen_ranks = [], [], [], []

    def rows(array, start):
        return None if array is None else torch.from_numpy(np.ascontiguousarray(array[start:start + CHUNK_ROWS])).to(device, dtype)

    for start in range(0, len(values), CHUNK_ROWS):
        scores = score(rows(values, start), rows(residual, start))
        if scores is None:  # a tensor-parallel rank other than the first: the logits were gathered there
            return {}
        top = torch.topk(scores, k, dim=-1)
        ids.append(top.indices.cpu().numpy())
        tops.append(top.values.cpu().numpy())
        if chosen is not None:
            c = torch.from_numpy(np.asarray(chosen[start:start + CHUNK_ROWS], np.int64)).to(scores.device)
            picked = scores.gather(1, c[:, None])
            chosen_scores.append(picked[:, 0].cpu().numpy())
            chosen_ranks.append((scores > picked).sum(dim=1).cpu().numpy())
    result = {"top_ids": np.concatenate(ids).astype(np.int64), f"top_{measure}": np.concatenate(tops)}
    if chosen is not None:
        result[f"chosen_{measure}"] = np.concatenate(chosen_scores)
        result["chosen_ranks"] = np.concatenate(chosen_ranks).astype(np.int64)
    return result
