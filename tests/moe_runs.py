"""Synthetic runs of a mixture-of-experts model (imported by the Experts tab's tests): router logits
at some layers, a residual stream at layer 0, random but seeded."""

from __future__ import annotations

import numpy as np

from inspector.core.hooks import HookPoint
from inspector.core.routing import Routing
from inspector.core.run import HookRows, RequestCapture, Run


def router_point(layer: int, routing: Routing | None) -> HookPoint:
    path = f"model.layers.{layer}.mlp.gate"
    return HookPoint(f"{path}.router", f"blocks.{layer}.mlp.hook_router", path, "router",
                     routing.experts if routing else 4, layer, routing=routing)


def moe_run(routings: dict[int, Routing | None], n_tokens: int = 9, seed: int = 0) -> Run:
    """One finished request, req0, of ``n_tokens`` tokens (a row per token but the last) with router
    logits at each layer of ``routings``, and resid_post rows at layer 0."""
    resid = HookPoint("model.layers.0.resid_post", "blocks.0.hook_resid_post", "model.layers.0", "resid_post", 8, 0)
    hooks = {h.name: h for h in [resid] + [router_point(layer, r) for layer, r in routings.items()]}
    run = Run(metadata={"model": "synthetic-moe", "engine_mode": "compiled", "dtype": "float32"}, hooks=hooks)
    texts = [" the", " cat", " sat", " on", " the", " mat", " and", " then", " slept", " well"] * (n_tokens // 10 + 1)
    prompt = list(range(4))
    req = RequestCapture("req0", "the cat sat on", prompt, {"max_tokens": n_tokens - 4},
                         generated_token_ids=list(range(100, 100 + n_tokens - 4)), token_texts=texts[:n_tokens],
                         finish_reason="length")
    rng = np.random.default_rng(seed)
    positions = np.arange(n_tokens - 1)
    for name, h in hooks.items():
        rows = req.hooks[name] = HookRows(h.width)
        rows.append(positions, positions + 1000, rng.normal(0, 1.5, (len(positions), h.width)).astype(np.float32))
    run.requests["req0"] = req
    return run


def router_logits(run: Run, layer: int) -> tuple[np.ndarray, np.ndarray, HookPoint]:
    """(positions, logits [tokens, experts], hook) of req0's router at ``layer``."""
    hook = next(h for h in run.hooks.values() if h.kind == "router" and h.layer == layer)
    rows = run.requests["req0"].hooks[hook.name]
    return np.asarray(rows.positions), np.asarray(rows.values), hook
