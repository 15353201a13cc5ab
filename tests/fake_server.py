"""``inspector serve`` on the fake engine (tests/fake_session.py) in a child process: a server that
starts in a second and can be killed, for the tests of what the app does with a server it did not
boot, or a child of its own that is slow to start."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).parent


def script(listen: str, model: str = "fake-model", delay_s: float = 0.0) -> str:
    """Python code that waits ``delay_s`` (a busy machine), then serves the fake engine on ``listen``."""
    return f"""
import sys, time
time.sleep({delay_s})
sys.path.insert(0, {str(TESTS)!r})
from fake_session import FakeSession
from inspector.core.protocol import SessionOptions
from inspector.server.serve import serve

class IdleSession(FakeSession):  # what the server asks of an engine that runs no request
    open_requests = {{}}

sys.exit(serve(SessionOptions(model={model!r}), {listen!r}, exit_when_idle_s=30, session_factory=IdleSession.open,
               log=lambda text: print(text, flush=True)))
"""


def free_tcp_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@contextlib.contextmanager
def fake_server(listen: str | None = None, model: str = "fake-model"):
    """Yields (url, process) once the server listens; stopped (or found killed) when the block ends."""
    url = listen or free_tcp_url()
    log_path = Path(tempfile.mkdtemp(prefix="inspector-fake-server-")) / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", script(url, model)], stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while "listening on" not in log_path.read_text(errors="replace"):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text(errors="replace")
            time.sleep(0.05)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)
        shutil.rmtree(log_path.parent, ignore_errors=True)
