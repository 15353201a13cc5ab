"""``inspector patch``: an activation-patching sweep (``inspector.experiments.patching``) into a sweep file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inspector.core.positions import parse_positions

from .engine_options import add_engine_options, add_server_options, open_session
from .progress import TerminalProgress


def add_parser(sub) -> None:
    pat = sub.add_parser("patch", help="an activation-patching sweep (hook points x positions) into a sweep file",
                         description="Patch each (hook point, position) activation of one prompt into the other, "
                                     "every cell a request of one batch; the metric per cell, 0 = corrupted, 1 = "
                                     "clean (docs/sweep-format.md).")
    add_engine_options(pat)
    add_server_options(pat)
    pat.add_argument("--clean", required=True, help="the clean prompt")
    pat.add_argument("--corrupted", required=True, help="the corrupted prompt (as many tokens as the clean one)")
    pat.add_argument("--answer", required=True, help="the answer token, as text (one token, e.g. ' alpha')")
    pat.add_argument("--foil", help="a foil token: the metric is then the logit difference answer - foil")
    pat.add_argument("--kind", default="resid_pre", help="the hook kind whose every layer is a row (default resid_pre)")
    pat.add_argument("--direction", choices=["denoise", "noise"], default="denoise",
                     help="denoise: clean activations into the corrupted prompt; noise: the other way")
    pat.add_argument("--positions", help="the positions to patch, like 0-3;7 (default: all)")
    pat.add_argument("--out", required=True, help="the sweep file to write (.h5)")
    pat.add_argument("--json", action="store_true", help="print a JSON summary on stdout")


def run(args) -> int:
    """An activation-patching sweep (inspector.experiments.patching) written to a sweep file."""
    from inspector.experiments.patching import PatchSpec, metric_from_text, patch as sweep
    from inspector.io.sweep import write_sweep
    from inspector.io.atomic_file import check_target

    out = Path(args.out)
    check_target(out)
    positions = tuple(parse_positions(args.positions)) if args.positions else None
    if not args.hooks and not args.server:  # a server keeps its hooks unless asked (a compiled one restarts)
        args.hooks = [f"blocks.*.hook_{args.kind}"]
    progress = TerminalProgress()
    session = open_session(args, progress.stage, retain_rows=False)
    try:
        hooks = sorted((p for p in session.installed.values() if p.kind == args.kind), key=lambda p: p.layer)
        if not hooks:
            raise ValueError(f"no {args.kind} hook points are captured: add --hooks blocks.*.hook_{args.kind} (on a "
                             "compiled server that restarts its engine)")
        metric = metric_from_text(args.answer, args.foil, session.tokenize, session.token_texts)
        spec = PatchSpec(args.clean, args.corrupted, tuple(p.name for p in hooks), metric, args.direction, positions)
        result = sweep(session, spec, lambda r, message: progress.bar("patching", r.done, r.raw.size, "cells"))
        path = write_sweep(result, out, session.run.metadata)
    finally:
        session.close()
    best = np.dstack(np.unravel_index(np.argsort(-np.nan_to_num(result.normalized, nan=-np.inf), axis=None),
                                      result.raw.shape))[0][:5]
    target = result.token_texts["corrupted" if args.direction == "denoise" else "clean"]
    metric = f"logprob of {args.answer!r}" if not args.foil else f"logit difference {args.answer!r} − {args.foil!r}"
    summary = {"out": str(path.resolve()), "metric": metric, "direction": args.direction,
               "clean_metric": result.clean_metric, "corrupted_metric": result.corrupted_metric,
               "cells": int(result.raw.size), "engine_calls": result.engine_calls, "complete": result.complete,
               "top_cells": [{"hook": result.hooks[h], "position": int(result.positions[p]),
                              "token": target[int(result.positions[p])], "normalized": float(result.normalized[h, p])}
                             for h, p in best]}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['metric']}: clean {result.clean_metric:.4f}, corrupted {result.corrupted_metric:.4f}; "
              f"{summary['cells']} cells in {result.engine_calls} engine call(s)")
        for cell in summary["top_cells"]:
            print(f"  {cell['normalized']:+.3f}  {cell['hook']} at {cell['position']} ({cell['token']!r})")
        print(f"wrote {summary['out']}")
    return 0
