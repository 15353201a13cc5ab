"""``inspector serve``: one engine served to clients over ZeroMQ (or, with --openai, as vLLM's
OpenAI-compatible server with the inspector's routes), and the making of key pairs for it."""

from __future__ import annotations

import json

from inspector.core.protocol import SessionOptions
from inspector.core.windows import parse_window_option
from inspector.openai import cli as openai_cli

from .engine_options import DEFAULT_HOOKS, add_engine_options, add_window_option, parallel_args


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="serve an engine: vLLM's OpenAI API with steering and capture (--openai), "
                                             "or to the app, capture and scripts over ZeroMQ",
                         description="Boot one engine and serve it until SIGINT/SIGTERM. Requests of all clients "
                                     "run in one continuous batch; each client's interventions apply to its own "
                                     "requests. With --openai: vLLM's OpenAI-compatible server, steered and "
                                     "captured per request through vllm_xargs. See docs/serving.md and "
                                     "docs/protocol.md.")
    add_engine_options(srv)
    srv.add_argument("--listen", default="tcp://127.0.0.1:5557",
                     help="tcp://HOST:PORT or ipc://PATH (default: loopback; any other address needs --keys)")
    srv.add_argument("--keys", help="a key directory (made with --keygen): CurveZMQ, allow-listed clients only")
    srv.add_argument("--keygen", metavar="DIR", help="write a server key pair (or, with --client, a client's) and exit")
    srv.add_argument("--client", metavar="NAME", help="with --keygen: make a key pair for client NAME and allow it")
    srv.add_argument("--max-num-batched-tokens", type=int, default=512)
    add_window_option(srv, "the default of every client (a client may give its own)")
    srv.add_argument("--engine-args", default="{}", help="more vLLM engine arguments, as JSON")
    srv.add_argument("--no-position-interventions", action="store_true")
    srv.add_argument("--feature-clamps", type=int, default=0, metavar="N",
                     help="room, per hook, for N SAE features clamped to a value at once (default 0: none; the room "
                          "costs every compiled forward, a few percent of a decode step)")
    srv.add_argument("--kept-layers", type=int, default=0, metavar="N",
                     help="boot only the model's first N decoder blocks (default 0: every block)")
    srv.add_argument("--max-backlog-mib", type=float, default=256,
                     help="the engine waits for a client this far behind; one that stops reading for 5 s with this "
                          "much waiting is disconnected (default 256)")
    srv.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                     help="exit once the last client has been gone this long (the app's own server does)")
    openai_cli.add_options(srv)


def run(args) -> int:
    from inspector.net.keys import keygen
    from inspector.server.serve import serve as run

    if args.keygen:
        for path in keygen(args.keygen, args.client):
            print(f"wrote {path}")
        return 0
    if args.openai:
        from inspector.engine.environment import prepare_environment

        prepare_environment()
        args.hooks = args.hooks or list(DEFAULT_HOOKS)
        return openai_cli.serve(args, _engine_args(args))
    return run(served_options(args), args.listen, args.keys, args.exit_when_idle, int(args.max_backlog_mib * 2**20),
               log=lambda text: print(text, flush=True))


def served_options(args) -> SessionOptions:
    """The session options of a parsed ``inspector serve`` command line (what ``capture.serve_argv``
    writes); a server's session keeps no rows (its clients do)."""
    return SessionOptions(model=args.model, mode=args.mode, hooks=tuple(args.hooks or DEFAULT_HOOKS), dtype=args.dtype,
                          max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_position_interventions=not args.no_position_interventions, retain_rows=False,
                          max_slots=args.max_slots, feature_clamps=args.feature_clamps,
                          windows=tuple(parse_window_option(text) for text in args.window or []),
                          kept_layers=args.kept_layers, engine_args=_engine_args(args))


def _engine_args(args) -> dict:
    """--engine-args with --tensor-parallel-size and --pipeline-parallel-size."""
    try:
        engine_args = json.loads(args.engine_args)
    except ValueError as e:
        raise ValueError(f"--engine-args is not JSON: {e}") from None
    return {**engine_args, **parallel_args(args)}
