"""``inspector serve`` in a child process, for the tests of the server and of its clients."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engines import ENGINE_ARGS

HOOKS = ("blocks.*.hook_resid_post", "hook_embed")
FEATURE_CLAMPS = 2  # room to clamp SAE features (tests/test_sae.py)


@contextlib.contextmanager
def running_server(model_dir, mode: str = "compiled", hooks=HOOKS, listen: str | None = None, extra=()):
    """Yields (url, process); the server's output is in ``process.log_path``. Stopped with SIGTERM, and
    its exit code checked: a server that crashed fails the test that used it."""
    home = Path(tempfile.mkdtemp(prefix="inspector-test-server-"))
    url = listen or f"ipc://{home / 'engine.sock'}"
    log_path = home / "server.log"
    command = [sys.executable, "-m", "inspector.cli", "serve", "--model", str(model_dir), "--mode", mode,
               "--hooks", *hooks, "--max-model-len", "256", "--max-num-batched-tokens", "64", "--listen", url,
               "--engine-args", json.dumps(ENGINE_ARGS), "--feature-clamps", str(FEATURE_CLAMPS), *extra]
    with child(command, log_path) as process:
        deadline = time.monotonic() + 120
        while "listening on" not in log_path.read_text(errors="replace"):  # bound, signals handled
            assert process.poll() is None and time.monotonic() < deadline, tail(log_path)
            time.sleep(0.1)
        yield url, process
    assert process.returncode in (0, -9), f"the server exited with {process.returncode}: {tail(log_path)}"


@contextlib.contextmanager
def child(command: list[str], log_path: Path, env=None):
    """``command`` in a child process, its output in ``log_path`` (``process.log_path``); stopped with
    SIGTERM when the block ends."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    process.log_path = log_path
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(120)


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_openai_server(model_dir, extra=(), env=None, engine_args=None):
    """``inspector serve --openai`` (vLLM's OpenAI server with our plugins) in a child process: yields
    (base url, process) once it answers /health; stopped with SIGTERM. ``engine_args``: more of vLLM's
    arguments (``--engine-args``)."""
    import socket
    import urllib.request

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    home = Path(tempfile.mkdtemp(prefix="inspector-test-openai-"))
    log_path = home / "server.log"
    command = [sys.executable, "-m", "inspector.cli", "serve", "--openai", "--model", str(model_dir),
               "--port", str(port), "--max-num-batched-tokens", "64",
               "--engine-args", json.dumps({**ENGINE_ARGS, **(engine_args or {})}), *extra]
    url = f"http://127.0.0.1:{port}"
    with child(command, log_path, env) as process:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None and time.monotonic() < deadline, tail(log_path)
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        yield url, process
