"""Short, readable text for hook points and tokens, and the hook point shown first: the app and the notebook's
views label and choose alike."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from .hooks import HookPoint

_KIND_ORDER = {"embed": 0, "pos_embed": 1, "resid_pre": 2, "attn_out": 3, "resid_mid": 4, "router": 5, "mlp_post": 6,
               "mlp_out": 7, "resid_post": 8, "normalized": 9}


def hook_sort_key(info: HookPoint) -> tuple:
    """Model order: embeddings, then block by block in the order a block computes, then the final norm."""
    return (info.layer if info.layer >= 0 else (-1 if info.kind in ("embed", "pos_embed") else 10 ** 6),
            _KIND_ORDER.get(info.kind, 99), info.name)


def default_hook(hooks: Iterable[HookPoint]) -> HookPoint | None:
    """The hook point a view shows first: the first resid_post in model order, else the first (None: no hooks)."""
    ordered = sorted(hooks, key=hook_sort_key)
    return next((h for h in ordered if h.kind == "resid_post"), ordered[0] if ordered else None)


def short_hook_label(info: HookPoint) -> str:
    """``blocks.3.hook_resid_post`` -> ``L3 resid_post``; keeps other aliases as they are."""
    if info.layer >= 0:
        return f"L{info.layer} {info.kind}"
    return info.alias or info.name


def display_token(text: str) -> str:
    """A token's text made visible: newlines, tabs and bare spaces get glyphs."""
    if text == "":
        return "∅"
    out = text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥")
    if out.strip(" ") == "":
        out = "␣" * len(out)
    return out


def runs_text(values, step: int = 1) -> str:
    """``0-3, 7`` for 0, 1, 2, 3, 7: runs of values ``step`` apart, ascending ("" for none)."""
    values = np.asarray(values)
    if not len(values):
        return ""
    breaks = np.flatnonzero(np.diff(values) != step) + 1
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in np.split(values, breaks))
