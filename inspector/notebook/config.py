"""``Inspector.cfg``: the fields of TransformerLens's ``HookedTransformerConfig`` that notebooks read most,
from what the engine says of its model (its hook points' widths, attention geometries and config), so
that ``model.cfg.n_layers`` and ``model.cfg.d_head`` work as they do there."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    model_name: str
    n_layers: int
    d_model: int
    n_ctx: int  # the engine's context, at most the model's
    dtype: str
    n_heads: int | None = None  # None: the model has no attention the engine reads q from
    n_key_value_heads: int | None = None
    d_head: int | None = None
    d_mlp: int | None = None  # the first block's MLP (None: no MLP hook point)
    d_vocab: int | None = None  # None: the model's config names no vocabulary size


def model_config_of(session) -> ModelConfig:
    """The configuration of the model ``session`` runs (an engine in this process or a server's)."""
    points = session.catalogue
    widths = {p.kind: p.width for p in sorted(points, key=lambda p: -p.layer) if p.layer >= 0}  # the first block's
    geometry = next((p.attention for p in points if p.kind == "q" and p.attention), None)
    config = session.run.metadata.get("model_config") or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return ModelConfig(
        model_name=session.options.model, n_layers=1 + max((p.layer for p in points), default=-1),
        d_model=widths.get("resid_post") or widths.get("resid_pre") or 0, n_ctx=session.options.max_model_len,
        dtype=session.options.dtype, n_heads=geometry and geometry.heads,
        n_key_value_heads=geometry and geometry.kv_heads, d_head=geometry and geometry.head_size,
        d_mlp=widths.get("mlp_post"),
        d_vocab=text.get("vocab_size") if isinstance(text.get("vocab_size"), int) else None)
