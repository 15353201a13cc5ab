"""Attention patterns recomputed from captured queries and keys (``attn.hook_q`` / ``attn.hook_k``).

The rows are what the model's attention kernel itself received (after the rotary embedding, any q/k
norm and layout); the geometry (heads, scale, sliding window, soft-capping, ALiBi slopes, sinks) is
read from the model's attention module at boot, never assumed. numpy only: the app's process imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QUERY_BLOCK = 256  # queries scored together: their scores stay in cache, and a window bounds the keys scored


@dataclass(frozen=True)
class AttentionGeometry:
    """How one layer's attention turns q and k into weights. ``unsupported`` says why a pattern cannot
    be recomputed faithfully for this layer ("" when it can)."""

    heads: int
    kv_heads: int
    head_size: int
    scale: float
    sliding_window: int = 0  # a query sees the keys of this many positions, its own included; 0 = all
    soft_cap: float = 0.0  # scores become soft_cap * tanh(scores / soft_cap); 0 = none
    unsupported: str = ""
    alibi_slopes: tuple[float, ...] = ()  # per head: slope × (key position - query position) added to scores
    sinks: tuple[float, ...] = ()  # per head: a logit in the softmax's sum that no key takes (attention sinks)

    def __post_init__(self):  # tuples, whether built here or read back from JSON lists
        object.__setattr__(self, "alibi_slopes", tuple(float(x) for x in self.alibi_slopes))
        object.__setattr__(self, "sinks", tuple(float(x) for x in self.sinks))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_size

    @property
    def k_width(self) -> int:
        return self.kv_heads * self.head_size

    def columns(self, head: int) -> slice:
        """Where a head's vector lies in a row of queries (or of keys, for a key head)."""
        return slice(head * self.head_size, (head + 1) * self.head_size)

    def kv_head(self, head: int) -> int:
        """The key head a query head reads (grouped-query attention shares one among several)."""
        return head // (self.heads // self.kv_heads)


def missing_key_positions(q_positions, k_positions, geometry: AttentionGeometry) -> np.ndarray:
    """Key positions that the queries attend to but whose rows are absent (a prefix served from the
    cache, a capture window): with any, the pattern would be plausible but wrong."""
    q_positions, k_positions = np.asarray(q_positions), np.asarray(k_positions)
    if not len(q_positions):
        return np.zeros(0, np.int64)
    last = int(q_positions.max())
    first = 0 if not geometry.sliding_window else max(0, int(q_positions.min()) - geometry.sliding_window + 1)
    return np.setdiff1d(np.arange(first, last + 1), k_positions)


def attention_weights(q, q_positions, k, k_positions, geometry: AttentionGeometry,
                      heads=None) -> np.ndarray:
    """Softmax weights ``[heads, queries, keys]`` (float32) of the query rows ``q`` [Q, heads×head_size]
    over the key rows ``k`` [K, kv_heads×head_size], at the given token positions of one request: causal,
    windowed, soft-capped, ALiBi-biased and sunk as the model is. ValueError when the layer's attention is not one this
    recomputes, or when keys the queries attend to were not captured."""
    if geometry.unsupported:
        raise ValueError(f"this layer's attention pattern cannot be recomputed: {geometry.unsupported}")
    q, k = np.asarray(q, np.float32), np.asarray(k, np.float32)
    q_positions, k_positions = np.asarray(q_positions, np.int64), np.asarray(k_positions, np.int64)
    if q.shape != (len(q_positions), geometry.q_width) or k.shape != (len(k_positions), geometry.k_width):
        raise ValueError(f"queries [{len(q_positions)}, {geometry.q_width}] and keys [{len(k_positions)}, "
                         f"{geometry.k_width}] expected, got {q.shape} and {k.shape}")
    missing = missing_key_positions(q_positions, k_positions, geometry)
    if len(missing):
        from .labels import runs_text  # labels imports hooks, which imports this module

        raise ValueError(f"the keys of positions {runs_text(missing)} were not captured, so the pattern "
                         "would be wrong there")
    heads = range(geometry.heads) if heads is None else heads
    out = np.zeros((len(heads), len(q), len(k)), np.float32)
    keys_in_order = bool(np.all(np.diff(k_positions) > 0))
    for start in range(0, len(q), QUERY_BLOCK):
        block = slice(start, start + QUERY_BLOCK)
        first, last = _key_span(q_positions[block], k_positions, geometry, keys_in_order)
        keys = k_positions[first:last]
        hidden = keys[None, :] > q_positions[block, None]
        if geometry.sliding_window:
            hidden |= q_positions[block, None] - keys[None, :] >= geometry.sliding_window
        for i, head in enumerate(heads):
            scores = _scores(q[block, geometry.columns(head)], k[first:last, geometry.columns(geometry.kv_head(head))],
                             geometry)
            if geometry.alibi_slopes:
                scores += np.float32(geometry.alibi_slopes[head]) * (keys[None, :] - q_positions[block, None])
            out[i, block, first:last] = _softmax(scores, hidden, geometry.sinks[head] if geometry.sinks else None)
    return out


def _key_span(q_positions, k_positions, geometry: AttentionGeometry, keys_in_order: bool) -> tuple[int, int]:
    """The slice of keys that a block of queries can see (all keys when they are not in position order)."""
    if not keys_in_order:
        return 0, len(k_positions)
    lowest = int(q_positions.min()) - geometry.sliding_window + 1 if geometry.sliding_window else None
    first = 0 if lowest is None else int(np.searchsorted(k_positions, lowest))
    return first, int(np.searchsorted(k_positions, int(q_positions.max()), side="right"))


def _scores(q, k, geometry: AttentionGeometry) -> np.ndarray:
    scores = q @ k.T
    scores *= np.float32(geometry.scale)
    if geometry.soft_cap:
        scores /= np.float32(geometry.soft_cap)
        np.tanh(scores, out=scores)
        scores *= np.float32(geometry.soft_cap)
    return scores


def _softmax(scores, hidden, sink: float | None) -> np.ndarray:
    """Softmax over the visible keys; a sink's logit joins the sum (its weight goes to no key)."""
    np.putmask(scores, hidden, -np.inf)
    top = scores.max(axis=1, keepdims=True)
    if sink is not None:
        top = np.maximum(top, np.float32(sink))
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=1, keepdims=True)
    if sink is not None:
        total += np.exp(np.float32(sink) - top)
    scores /= total
    return scores
