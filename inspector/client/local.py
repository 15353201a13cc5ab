"""A server of the app's own: ``inspector serve`` as a child process on a private ``ipc://`` socket.

This is the app's default session factory: the engine (torch, vLLM, its threads and its GIL) lives in
the child, the window in a process that imports neither. The child's output goes to ``engine.log`` in
its private directory; it exits when its last client is gone, so a killed app leaves no engine behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from inspector.core.protocol import BootProgress, SessionOptions
from inspector.core.serve_argv import serve_argv

from .remote import RemoteSession, connect

EXIT_WHEN_IDLE_S = 5.0
STOP_TIMEOUT_S = 30.0


def serve_command(options: SessionOptions, listen: str) -> list[str]:
    return [sys.executable, "-m", "inspector.cli", "serve", *serve_argv(options), "--listen", listen,
            "--exit-when-idle", str(EXIT_WHEN_IDLE_S)]


def start_local_server(options: SessionOptions, progress: Callable[[BootProgress], None] | None = None
                       ) -> RemoteSession:
    """Spawn a server for ``options`` and connect to it; SessionError (with the end of its log) if it
    cannot start. While the child lives it is starting (importing torch and vLLM on a busy machine may
    outlast any deadline), so it is waited for; once it exits, its exit code and log say why at once.
    Closing the session stops the child."""
    home = Path(tempfile.mkdtemp(prefix="inspector-engine-"))  # 0700: the socket is ours alone
    log_path = home / "engine.log"
    listen = f"ipc://{home / 'engine.sock'}"
    # The child keeps the app's session: in a session (a scheduler group) of its own, the GUI's gaps grew.
    with open(log_path, "wb") as log:
        process = subprocess.Popen(serve_command(options, listen), stdin=subprocess.DEVNULL, stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if progress is not None:  # before the server's own stages, which it reports once it listens
        progress(BootProgress("starting", f"process {process.pid}, its log in {log_path}"))

    def why_gone() -> str | None:
        if process.poll() is None:
            return None
        return f"the engine process exited with code {process.returncode} ({_tail(log_path)})"

    def stop(keep_log: bool = False) -> None:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if keep_log:
            (home / "engine.sock").unlink(missing_ok=True)
        else:
            shutil.rmtree(home, ignore_errors=True)

    try:
        session = connect(listen, progress, retain_rows=options.retain_rows, timeout_s=None, why_gone=why_gone,
                          on_close=stop)
    except BaseException as e:
        stop(keep_log=str(log_path) in str(e))  # where the error names the log, the user reads why there
        raise
    session.process = process
    return session


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return " | ".join(text[-lines:]) + f"; log: {path}"
