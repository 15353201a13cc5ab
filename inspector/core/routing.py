"""Mixture-of-experts routing recomputed from captured router logits (``mlp.hook_router``).

The router point captures the logits the model's own gate produced (what its experts were chosen
from); which experts each token went to, and with what weights, follows from them by the layer's
routing rule, read from the model's router at boot and checked there against the router itself on
the probe's tokens (``unsupported`` says why a rule cannot be recomputed). numpy only: the app's
process imports neither torch nor vLLM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Routing:
    """How one MoE layer picks ``top_k`` of its ``experts`` from the router logits: ``scoring`` turns
    logits into scores (softmax or sigmoid); grouped routing keeps the best ``groups_kept`` of
    ``groups`` expert groups first; ``correction_bias`` (DeepSeek-V3) shifts scores for choosing only;
    the chosen scores are renormalised to sum to one if ``renormalize``, then multiplied by
    ``scaling``."""

    experts: int
    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    groups: int = 0  # 0 = no grouped routing
    groups_kept: int = 0
    scaling: float = 1.0
    correction_bias: tuple[float, ...] = ()
    unsupported: str = ""  # why the choice cannot be recomputed ("" when it can)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Routing":
        return cls(**{**d, "correction_bias": tuple(d.get("correction_bias", ()))})


def route(logits, routing: Routing) -> tuple[np.ndarray, np.ndarray]:
    """Per row of router ``logits`` [tokens, experts]: the chosen expert ids [tokens, top_k] (int32)
    and their weights (float32), strongest first. ValueError when the rule is not one this recomputes."""
    if routing.unsupported:
        raise ValueError(f"this layer's expert choice cannot be recomputed: {routing.unsupported}")
    logits = np.asarray(logits, np.float32)
    if logits.ndim != 2 or logits.shape[1] != routing.experts:
        raise ValueError(f"router logits [tokens, {routing.experts}] expected, got {list(logits.shape)}")
    scores = _scores(logits, routing.scoring)
    choosing = scores + np.asarray(routing.correction_bias, np.float32) if routing.correction_bias else scores
    if routing.groups:
        choosing = _best_groups_only(choosing, routing)
    ids = np.argsort(-choosing, axis=1, kind="stable")[:, :routing.top_k]
    weights = np.take_along_axis(scores, ids, axis=1)
    if routing.renormalize:
        weights = weights / weights.sum(axis=1, keepdims=True)
    weights = weights * np.float32(routing.scaling)
    order = np.argsort(-weights, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1).astype(np.int32), np.take_along_axis(weights, order, axis=1)


def dense_weights(ids: np.ndarray, weights: np.ndarray, experts: int) -> np.ndarray:
    """[tokens, experts] with each token's routing weight at its chosen experts and zero elsewhere."""
    out = np.zeros((len(ids), experts), np.float32)
    np.put_along_axis(out, np.asarray(ids, np.int64), np.asarray(weights, np.float32), axis=1)
    return out


def _scores(logits: np.ndarray, scoring: str) -> np.ndarray:
    if scoring == "softmax":
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if scoring == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    raise ValueError(f"unknown router scoring {scoring!r}")


def _best_groups_only(scores: np.ndarray, routing: Routing) -> np.ndarray:
    """Scores with every expert outside each token's best ``groups_kept`` groups at -inf; a group's
    strength is its best score, or its best two summed when a correction bias is used (as vLLM does)."""
    grouped = scores.reshape(len(scores), routing.groups, -1)
    best = np.sort(grouped, axis=2)[:, :, ::-1]
    strength = best[:, :, :2].sum(axis=2) if routing.correction_bias else best[:, :, 0]
    kept = np.argsort(-strength, axis=1, kind="stable")[:, :routing.groups_kept]
    mask = np.zeros(strength.shape, bool)
    np.put_along_axis(mask, kept, True, axis=1)
    return np.where(np.repeat(mask, grouped.shape[2], axis=1), scores, -np.inf)
