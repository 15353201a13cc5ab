"""How a command gets its engine: the options that choose one (a model booted in this process, or an
inspector server's with --server) and the session they open. Shared by every command that drives one."""

from __future__ import annotations

import argparse

from inspector.core.protocol import MODES, SessionOptions, SessionProtocol

DEFAULT_HOOKS = ("blocks.*.hook_resid_post",)


def engine_session(options: SessionOptions, progress) -> SessionProtocol:
    """The engine in this process (the headless commands; the app with --in-process)."""
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from inspector.engine.session import Session

    return Session.open(options, progress)


def client_keys(args):
    """CurveZMQ keys from --client-key/--server-key (both or neither)."""
    if bool(args.client_key) != bool(args.server_key):
        raise ValueError("give both --client-key (your NAME.key_secret) and --server-key (the server's server.key)")
    if not args.client_key:
        return None
    from inspector.net.keys import client_keys as load

    return load(args.client_key, args.server_key)


def open_session(args, progress, retain_rows: bool) -> SessionProtocol:
    """On the server at --server, or an engine in this process."""
    if args.server:
        from inspector.client import connect

        session = connect(args.server, progress, client_keys(args), retain_rows=retain_rows)
        if args.hooks and set(session.installed) != {h.name for h in session.catalogue
                                                     if any(h.matches(p) for p in args.hooks)}:
            session.set_hooks(list(args.hooks))
        return session
    options = SessionOptions(model=args.model, mode=args.mode, hooks=tuple(args.hooks or DEFAULT_HOOKS),
                             dtype=args.dtype, max_model_len=args.max_model_len, retain_rows=retain_rows,
                             engine_args=parallel_args(args), feature_clamps=getattr(args, "feature_clamps", 0))
    return engine_session(options, progress)


def add_engine_options(parser: argparse.ArgumentParser, hooks_required: bool = False) -> None:
    """``hooks_required``: no default hooks (a harvest writes every row of each hook it takes)."""
    parser.add_argument("--model", default="demo", help="'demo', a model directory, or a cached hub id")
    parser.add_argument("--mode", choices=MODES, default="compiled")
    parser.add_argument("--hooks", nargs="+", default=None, required=hooks_required,
                        help="hook names, aliases or glob patterns" + ("" if hooks_required else
                             f" (default: {' '.join(DEFAULT_HOOKS)}; with --server: what the server captures)"))
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    add_parallel_option(parser)


def add_window_option(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument("--window", action="append", metavar="[PATTERN=]WINDOW",
                        help=f"capture only some rows of the hooks matching PATTERN (a glob over hook names and "
                             f"aliases, as --hooks; without it: every captured hook), {whose}; the engine drops the "
                             "other rows on its device. WINDOW: 'all' (every row, the default), 'generated' (the rows "
                             "that predict the generated tokens: the prompt's last position and every generated "
                             "token's), 'last:N' (the prompt's last N positions and every one after), 'every:K' "
                             "(positions 0, K, 2K, ...). Repeatable; a later one overrides an earlier one for the "
                             "hooks both match. The file's positions datasets list the rows kept")


def add_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N GPUs (vLLM's tensor parallelism; on a CPU, N groups of cores)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="split the model's blocks into N stages, one after another (vLLM's pipeline "
                             "parallelism); each stage captures and steers the blocks it holds")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                        help="the share of each GPU's memory the engine may take (vLLM's default: 0.92); lower it "
                             "where another engine shares the GPU. No effect on a CPU")


def parallel_args(args) -> dict:
    """vLLM engine arguments for --tensor-parallel-size, --pipeline-parallel-size and
    --gpu-memory-utilization."""
    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    for key, size in sizes.items():
        if size < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {size}")
    chosen = {key: size for key, size in sizes.items() if size > 1}
    share = args.gpu_memory_utilization
    if share is not None:
        if not 0 < share <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {share}")
        chosen["gpu_memory_utilization"] = share
    return chosen


def add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="use the engine of an inspector server (tcp://HOST:PORT or ipc://PATH)")
    parser.add_argument("--client-key", help="with --server: your key pair (NAME.key_secret), for a server with keys")
    parser.add_argument("--server-key", help="with --server: the server's public key (server.key)")
