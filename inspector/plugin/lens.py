"""The logit lens, where the weights are: residual-stream rows through the model's own final norm and
unembedding (``vllm_compat.logits``: tied embeddings, logit scale, soft-capping and a vocab-parallel
head are the model's business), of which only the top k and the chosen tokens' logprobs and ranks leave.

The norm is called through ``forward``, not the module's ``__call__``: a hook installed on it (a capture
of ``ln_final.hook_normalized``, an intervention there) must neither see nor change lens rows.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from inspector.capture.hooks import HookPoint

from . import vllm_compat

CHUNK_ROWS = 256  # rows per unembedding call: a vocabulary of 128k float32 logits is 128 MiB per 256


def final_norm(model: nn.Module, catalogue: dict[str, HookPoint]) -> nn.Module:
    """The model's final norm, found where the catalogue's ``normalized`` point reads."""
    paths = [p.module_path for p in catalogue.values() if p.kind == "normalized"]
    if not paths:
        raise ValueError(f"{type(model).__name__}: no final norm found, so no logit lens")
    return dict(model.named_modules())[paths[0]]


@torch.inference_mode()
def lens(model: nn.Module, norm: nn.Module, values: np.ndarray, k: int, chosen: np.ndarray | None,
         device: torch.device, dtype: torch.dtype) -> dict[str, np.ndarray]:
    """Per row: the top ``k`` token ids and logprobs, and the logprob and rank (0 = the top) of the
    ``chosen`` token; ``values`` are residual-stream rows, [rows, hidden]."""
    ids, logprobs, chosen_logprobs, chosen_ranks = [], [], [], []
    for start in range(0, len(values), CHUNK_ROWS):
        x = torch.from_numpy(np.ascontiguousarray(values[start:start + CHUNK_ROWS])).to(device, dtype)
        normed = norm.forward(x)
        normed = normed[0] if isinstance(normed, tuple) else normed
        logits = vllm_compat.logits(model, normed)
        if logits is None:  # a tensor-parallel rank other than the first: the logits were gathered there
            return {}
        logp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(logp, k, dim=-1)
        ids.append(top.indices.cpu().numpy())
        logprobs.append(top.values.cpu().numpy())
        if chosen is not None:
            c = torch.from_numpy(np.asarray(chosen[start:start + CHUNK_ROWS], np.int64)).to(logp.device)
            picked = logp.gather(1, c[:, None])
            chosen_logprobs.append(picked[:, 0].cpu().numpy())
            chosen_ranks.append((logp > picked).sum(dim=1).cpu().numpy())
    result = {"top_ids": np.concatenate(ids).astype(np.int64), "top_logprobs": np.concatenate(logprobs)}
    if chosen is not None:
        result["chosen_logprobs"] = np.concatenate(chosen_logprobs)
        result["chosen_ranks"] = np.concatenate(chosen_ranks).astype(np.int64)
    return result
