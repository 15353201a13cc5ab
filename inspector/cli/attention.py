"""``inspector attention``: attention patterns recomputed from the queries and keys a capture file holds
(no engine)."""

from __future__ import annotations

import json

import numpy as np


def add_parser(sub) -> None:
    att = sub.add_parser("attention", help="attention patterns from the queries and keys in a capture file",
                         description="Recompute attention patterns from the attn.hook_q / attn.hook_k rows of a "
                                     "capture file (capture them with --hooks 'blocks.*.attn.hook_*'), with the "
                                     "layer's geometry stored in the file; no engine needed. Prints what one "
                                     "position attends to, per head; --out saves the whole [heads, T, T] pattern.")
    att.add_argument("file", help="a capture file (.h5)")
    att.add_argument("--request", type=int, default=0, help="the request's index in the file (default 0)")
    att.add_argument("--layer", type=int, default=None, help="default: the last layer with queries and keys")
    att.add_argument("--head", type=int, default=None, help="default: every head")
    att.add_argument("--position", type=int, default=None, help="the query position shown (default: the last)")
    att.add_argument("--top", type=int, default=3, help="how many attended tokens to show per head")
    att.add_argument("--out", help="save the weights [heads, queries, keys] as .npy")
    att.add_argument("--json", action="store_true")


def run(args) -> int:
    """Attention patterns recomputed from the queries and keys a capture file holds."""
    from inspector.core.attention import attention_weights
    from inspector.io import read_run

    run = read_run(args.file)
    requests = list(run.requests.values())
    if not 0 <= args.request < len(requests):
        raise ValueError(f"--request {args.request}: the file holds requests 0-{len(requests) - 1}")
    req = requests[args.request]
    points = {(p.layer, p.kind): name for name, p in run.hooks.items() if p.kind in ("q", "k") and name in req.hooks}
    layers = sorted(layer for layer, kind in points if kind == "q" and (layer, "k") in points)
    if not layers:
        raise ValueError("this request has no queries and keys: capture with --hooks 'blocks.*.attn.hook_*'")
    layer = layers[-1] if args.layer is None else args.layer
    if layer not in layers:
        raise ValueError(f"--layer {layer}: queries and keys are captured for layers {layers}")
    q, k = req.hooks[points[layer, "q"]], req.hooks[points[layer, "k"]]
    geometry = run.hooks[points[layer, "q"]].attention
    heads = list(range(geometry.heads)) if args.head is None else [args.head]
    if not all(0 <= h < geometry.heads for h in heads):
        raise ValueError(f"--head {args.head}: layer {layer} has heads 0-{geometry.heads - 1}")
    weights = attention_weights(q.values, q.positions, k.values, k.positions, geometry, heads)
    if args.out:
        np.save(args.out, weights)
    positions = q.positions.tolist()
    position = positions[-1] if args.position is None else args.position
    if position not in positions:
        raise ValueError(f"--position {position}: the captured positions are {positions[0]}-{positions[-1]}")
    at, texts, keys = positions.index(position), req.token_texts, k.positions.tolist()
    top = {head: [(keys[j], texts[keys[j]], float(w[at, j])) for j in np.argsort(-w[at], kind="stable")[:args.top]]
           for head, w in zip(heads, weights)}
    if args.json:
        print(json.dumps({"request": req.request_id, "layer": layer, "position": position, "out": args.out,
                          "top": {str(h): [{"position": p, "token": t, "weight": w} for p, t, w in ranked]
                                  for h, ranked in top.items()}}, indent=2))
        return 0
    print(f"{req.request_id}, layer {layer}: what position {position} ({texts[position]!r}) attends to")
    for head, ranked in top.items():
        print(f"  head {head:2d}: " + ", ".join(f"{p}:{t!r} {w:.2f}" for p, t, w in ranked))
    if args.out:
        print(f"wrote {args.out} ([heads, queries, keys] = {list(weights.shape)})")
    return 0
