"""What the logit lens returns, and what it accepts: the same checks for every kind of session."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .dtypes import is_float_rows

MAX_K = 100


class _TopTokens:
    """Arrays by field name, as the engine, the wire and files carry them (absent: None)."""

    @classmethod
    def from_arrays(cls, arrays: dict):
        return cls(**{f.name: arrays.get(f.name) for f in fields(cls)})

    def as_arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(frozen=True)
class Lens(_TopTokens):
    """Per row of residual stream: the ``k`` most likely next tokens under the model's own final norm
    and unembedding, best first; with ``chosen`` tokens, their logprob and rank (0 = the top)."""

    top_ids: np.ndarray  # [rows, k] int64
    top_logprobs: np.ndarray  # [rows, k] float32
    chosen_logprobs: np.ndarray | None = None  # [rows] float32
    chosen_ranks: np.ndarray | None = None  # [rows] int64



@dataclass(frozen=True)
class Attribution(_TopTokens):
    """Direct logit attribution, per row of a component's output (attn_out, mlp_out, embed): what it adds
    to each token's logit through the final norm, with the norm's scale frozen at the final residual
    stream of the same position, and the unembedding (without bias or soft cap, so that the parts of
    the residual stream add up to the logits less those constants). The ``k`` largest, best first;
    with ``chosen`` tokens, their logit and rank (0 = the top)."""

    top_ids: np.ndarray  # [rows, k] int64
    top_logits: np.ndarray  # [rows, k] float32
    chosen_logits: np.ndarray | None = None  # [rows] float32
    chosen_ranks: np.ndarray | None = None  # [rows] int64



def checked_attribution_request(values, final_residual, k: int, chosen, width: int, vocab: int):
    """(values, final_residual, chosen) checked as ``checked_lens_request`` checks a lens's; the final
    residual rows must pair one to one with the component rows."""
    values, chosen = checked_lens_request(values, k, chosen, width, vocab)
    final_residual, _ = checked_lens_request(final_residual, k, None, width, vocab)
    if final_residual.shape != values.shape:
        raise ValueError(f"the final residual rows {final_residual.shape} must pair with the component rows {values.shape}")
    return values, final_residual, chosen


def checked_lens_request(values, k: int, chosen, width: int, vocab: int) -> tuple[np.ndarray, np.ndarray | None]:
    """``values`` as float32 [rows, width] and ``chosen`` as int64 [rows] (or None); ValueError with
    the reason for anything else."""
    values = np.asarray(values)
    if values.ndim != 2 or values.shape[1] != width or not len(values):
        raise ValueError(f"the lens takes residual-stream rows [rows, {width}], got an array of shape {values.shape}")
    if not is_float_rows(values.dtype) or not np.isfinite(values).all():
        raise ValueError("the lens takes finite floating-point rows")
    if not (isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= min(MAX_K, vocab)):
        raise ValueError(f"k must be an integer from 1 to {min(MAX_K, vocab)}, got {k!r}")
    if chosen is not None:
        chosen = np.asarray(chosen)
        if chosen.shape != (len(values),) or not np.issubdtype(chosen.dtype, np.integer):
            raise ValueError(f"chosen must be one token id per row ({len(values)}), got shape {chosen.shape}")
        if len(chosen) and (chosen.min() < 0 or chosen.max() >= vocab):
            raise ValueError(f"chosen token ids must lie in 0..{vocab - 1}")
        chosen = chosen.astype(np.int64)
    return values.astype(np.float32, copy=False), chosen


def checked_token_ids(ids, vocab: int) -> np.ndarray:
    """``ids`` as int64 [n]; ValueError unless each is a token id of a vocabulary of ``vocab``."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or (len(ids) and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"token ids must be a list of integers, got an array of shape {ids.shape}")
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must lie in 0..{vocab - 1}")
    return ids.astype(np.int64)
