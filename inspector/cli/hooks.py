"""``inspector hooks``: the block family and hook points of a model (or of a server's engine)."""

from __future__ import annotations

import argparse
import json

from inspector.core.protocol import SessionOptions

from .engine_options import add_parallel_option, add_server_options, engine_session, open_session, parallel_args
from .progress import TerminalProgress


def add_parser(sub) -> None:
    hk = sub.add_parser("hooks", help="list the hook points of a model")
    hk.add_argument("--model", default="demo")
    add_parallel_option(hk)
    add_server_options(hk)
    hk.add_argument("--hooks", nargs="+", default=None, help=argparse.SUPPRESS)
    hk.add_argument("--json", action="store_true")


def run(args) -> int:
    if args.server:
        session = open_session(args, TerminalProgress().stage, retain_rows=False)
    else:  # eager, no hooks installed: nothing to compile, so the catalogue comes fast
        session = engine_session(SessionOptions(model=args.model, mode="eager", hooks=(), engine_args=parallel_args(args)),
                                 TerminalProgress().stage)
    try:
        catalogue, family = session.catalogue, session.run.metadata.get("block_family", "unknown")
        refused = session.run.metadata.get("refused_kinds") or {}
    finally:
        session.close()
    if args.json:
        print(json.dumps([h.as_dict() for h in catalogue], indent=2))
        return 0
    print(f"block family: {family}")
    print(f"{'name':48s} {'alias':28s} {'kind':11s} {'width':>6s}")
    for h in catalogue:
        print(f"{h.name:48s} {h.alias:28s} {h.kind:11s} {h.width:6d}" + ("  WITHDRAWN" if h.withdrawn else "")
              + ("  READ ONLY" if h.unsteerable else "") + (f"  sharded over {h.shards} ranks" if h.shards > 1 else ""))
    for h in catalogue:
        if h.withdrawn:
            print(f"withdrawn {h.alias}: {h.withdrawn}")
        elif h.unsteerable:
            print(f"read only {h.alias}: {h.unsteerable}")
    for why in refused.values():
        print(why)
    return 0
