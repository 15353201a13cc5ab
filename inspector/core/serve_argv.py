"""``SessionOptions`` as the command line of ``inspector serve``: the app's own server is that command,
so every option the app was given reaches its engine through this one function. The CLI's ``serve``
reads the line back (``inspector.cli.serve.served_options``); the tests hold the two to each other."""

from __future__ import annotations

import json

from .protocol import SessionOptions


def serve_argv(options: SessionOptions) -> list[str]:
    """``options`` as ``inspector serve``'s options. ``retain_rows`` is the client's alone: a server's
    session keeps no rows. No hooks: the server's default."""
    return ["--model", options.model, "--mode", options.mode, *(["--hooks", *options.hooks] if options.hooks else []),
            "--dtype", options.dtype, "--max-model-len", str(options.max_model_len),
            "--max-num-batched-tokens", str(options.max_num_batched_tokens),
            *([] if options.enable_position_interventions else ["--no-position-interventions"]),
            "--max-slots", str(options.max_slots), "--feature-clamps", str(options.feature_clamps),
            *(arg for pattern, window in options.windows for arg in ("--window", f"{pattern}={window}")),
            "--kept-layers", str(options.kept_layers), "--engine-args", json.dumps(options.engine_args)]
