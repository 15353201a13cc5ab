"""The Experts tab without Qt: which experts each token of a request was routed to in a mixture-of-experts
layer, recomputed from the captured router logits with the layer's routing rule (``capture.routing``),
and in words why there is nothing to show when there is nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inspector.core.hooks import ROUTER_KIND, HookPoint
from inspector.core.routing import dense_weights, route

from .labels import display_token
from .lens import percent
from .run_view import RunSource, RunView

WEIGHT, LOGIT = "routing weight", "router logit"
MODES = (WEIGHT, LOGIT)


class ExpertGrid:
    """What the Experts tab draws: a row per expert, a column per token (``cell_grid.Cells``). Cell
    (e, c) is expert e's routing weight for the token at column c (empty where it was not chosen), or
    its router logit."""

    def __init__(self, hook: HookPoint, positions: np.ndarray, logits: np.ndarray, texts: list[str]):
        self.hook, self.positions = hook, np.asarray(positions, np.int64)
        self.logits = np.asarray(logits, np.float32).T  # [experts, tokens]
        self.texts = texts
        self.labels = [f"expert {e}" for e in range(hook.width)]
        routing = hook.routing
        self.why_no_choice = ("the capture says nothing of the layer's routing rule" if routing is None
                              else routing.unsupported)
        if self.why_no_choice:
            self.ids = np.zeros((len(self.positions), 0), np.int32)
            self.weights = np.zeros((len(self.positions), 0), np.float32)
        else:
            self.ids, self.weights = route(logits, routing)
        dense = dense_weights(self.ids, self.weights, hook.width).T
        self.chosen = np.zeros(dense.shape, bool)
        np.put_along_axis(self.chosen.T, self.ids.astype(np.int64), True, axis=1)
        self.dense = np.where(self.chosen, dense, np.nan).astype(np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.logits.shape

    def colour_ends(self, mode: str) -> tuple[float, float]:
        """The values at the colour scale's ends: 0 and the largest weight, or the smallest and largest logit."""
        if mode == WEIGHT:
            return 0.0, float(np.nanmax(self.dense)) if np.isfinite(self.dense).any() else 1.0
        return (float(self.logits.min()), float(self.logits.max())) if self.logits.size else (0.0, 1.0)

    def colour_values(self, mode: str) -> np.ndarray:
        """0..1 along the colour scale (NaN where an expert was not chosen, in weight mode)."""
        lo, hi = self.colour_ends(mode)
        return ((self.dense if mode == WEIGHT else self.logits) - lo) / max(hi - lo, 1e-12)

    def cell_text(self, mode: str, r: int, c: int) -> str:
        if mode == WEIGHT:
            return percent(float(self.dense[r, c])) if self.chosen[r, c] else ""
        return f"{self.logits[r, c]:.2f}"

    def input(self, c: int) -> str:
        p = int(self.positions[c])
        return display_token(self.texts[p]) if p < len(self.texts) else f"@{p}"

    def describe(self, r: int, c: int) -> str:
        head = f"{self.input(c)!r} (position {int(self.positions[c])}) → expert {r}: "
        if self.why_no_choice:
            choice = f"choice not recomputed ({self.why_no_choice})"
        elif self.chosen[r, c]:
            rank = int(np.flatnonzero(self.ids[c] == r)[0])
            choice = f"chosen, weight {self.dense[r, c]:.4f} (#{rank + 1} of {self.ids.shape[1]})"
        else:
            choice = "not chosen"
        return f"{head}{choice}; router logit {self.logits[r, c]:.4f}"


@dataclass(frozen=True)
class ExpertsShown:
    message: str  # why there is no grid ("" when there is)
    layers: tuple[int, ...] = ()  # the request's layers with router logits captured
    layer: int | None = None
    grid: ExpertGrid | None = None


def router_layers(hooks: list[HookPoint]) -> list[int]:
    return sorted({h.layer for h in hooks if h.kind == ROUTER_KIND})


def show_experts(view: RunView, rid: str | None, layer: int | None) -> ExpertsShown:
    """Layer ``layer``'s routing for request ``rid`` (the first layer captured when it has none)."""
    if view.request(rid) is None:
        return ExpertsShown("No request to show")
    captured = {h.layer: h for h in view.hooks_for(rid) if h.kind == ROUTER_KIND}
    if not captured:
        return ExpertsShown(_not_captured(view, rid))
    layer = layer if layer in captured else min(captured)
    positions, logits = view.rows(rid, captured[layer].name)
    grid = ExpertGrid(captured[layer], positions, logits, view.token_texts(rid))
    return ExpertsShown("", tuple(sorted(captured)), layer, grid)


def _not_captured(view: RunView, rid: str) -> str:
    if view.source is RunSource.FILE:
        return "This capture holds no router logits (blocks.N.mlp.hook_router): capture them to see expert routing"
    offered = [h for h in view.catalogue.values() if h.kind == ROUTER_KIND]
    if not offered:
        return "This model has no mixture-of-experts layers (no router hook points), so no expert routing to show"
    return (f"No router logits captured for request {rid}: tick blocks.N.mlp.hook_router in the model tree "
            f"(layers {', '.join(str(h.layer) for h in sorted(offered, key=lambda h: h.layer))})")
