"""``inspector serve``: one engine, served to clients over ZeroMQ until SIGINT or SIGTERM.

The engine runs on the main thread (the hub); the socket on a thread of its own (the transport). A
stop signal cancels what is in flight (each client gets its requests' last events), says goodbye,
flushes and exits 0.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import zmq
import zmq.auth.thread

from inspector.core.protocol import BootProgress, BootTimes, SessionError, SessionOptions
from inspector.net.keys import ServerKeys, server_keys
from inspector.net.wire import Message

from .hub import Hub
from .transport import GONE, ServerTransport

IDLE_POLL_S = 0.05
BEHIND_WAIT_S = 0.002
HARD_MESSAGE_LIMIT = 256 << 20  # beyond this, ZeroMQ drops the connection before the bytes reach us


def check_listen(url: str, keys: ServerKeys | None) -> None:
    """Only loopback and ipc:// without keys: anything else must authenticate and encrypt (ValueError)."""
    parts = urlsplit(url)
    if parts.scheme == "ipc":
        return
    if parts.scheme != "tcp" or not parts.hostname:
        raise ValueError(f"listen on tcp://HOST:PORT or ipc://PATH, not {url!r}")
    if keys is None and not _loopback(parts.hostname):
        raise ValueError(f"refusing to listen on {parts.hostname} without CurveZMQ keys: anyone who can reach it "
                         "could read the captures and drive the engine. Make keys (inspector serve --keygen DIR, "
                         "then --keygen DIR --client NAME) and pass --keys DIR, or listen on 127.0.0.1 and "
                         "reach it through an SSH tunnel (docs/serving.md: Use a GPU server).")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind(context: zmq.Context, url: str, keys: ServerKeys | None) -> tuple[zmq.Socket, object]:
    """A ROUTER socket bound to ``url``: ipc paths readable by their owner only; CURVE when ``keys``."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer is an error we see, not a silent drop
    socket.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_LIMIT)
    socket.setsockopt(zmq.SNDHWM, 64)  # messages per client in ZeroMQ's queue; beyond, our backlog counts bytes
    auth = None
    if keys is not None:
        auth = zmq.auth.thread.ThreadAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=str(keys.allow_list))
        socket.curve_secretkey, socket.curve_publickey, socket.curve_server = keys.secret, keys.public, True
    if url.startswith("ipc://"):
        path = Path(url[len("ipc://"):])
        path.parent.mkdir(parents=True, exist_ok=True)
        old = os.umask(0o077)
        try:
            socket.bind(url)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
    else:
        try:
            socket.bind(url)
        except zmq.ZMQError as e:
            socket.close(0)
            raise ValueError(f"cannot listen on {url}: {e}") from None
    return socket, auth


def serve(options: SessionOptions, listen: str, keys_dir: str | None = None, exit_when_idle_s: float | None = None,
          backlog_limit: int = 256 << 20, session_factory: Callable | None = None,
          log: Callable[[str], None] = print) -> int:
    """Boot the engine and serve it; the exit code."""
    keys = server_keys(keys_dir) if keys_dir else None
    check_listen(listen, keys)
    context = zmq.Context()
    socket, auth = bind(context, listen, keys)
    inbox: queue.Queue = queue.Queue()
    transport = ServerTransport(socket, inbox, backlog_limit, log).start()
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    log(f"[serve] listening on {listen}" + (" (CurveZMQ: clients in the allow-list only)" if keys else ""))

    times = BootTimes()

    def progress(p: BootProgress) -> None:
        took = times.lap(p.stage)
        log(f"[{p.stage}] {p.message}" + (f" ({took})" if took else ""))
        transport.broadcast(Message("progress", {"stage": p.stage, "message": p.message}))

    try:
        session = _boot(options, progress, session_factory, stopping)
    except SessionError as e:
        log(f"[serve] could not start the engine: {e}")
        transport.broadcast(Message("error", {"kind": "boot-failed", "message": str(e)}))
        return _close(transport, context, auth, 1)
    if session is None:  # stopped while booting
        return _close(transport, context, auth, 0)
    hub = Hub(session, transport.send)
    transport.on_rows_read = hub.rows_read
    code = _run(hub, transport, inbox, stopping, exit_when_idle_s, log)
    for key in list(hub.clients):
        hub.client_gone(key)  # their last events go out before the goodbye
        transport.send(key, Message("goodbye", {"reason": "the server is shutting down"}))
    session.close()
    log("[serve] stopped")
    return _close(transport, context, auth, code)


def _boot(options, progress, factory, stopping):
    if factory is None:
        from inspector.engine.environment import prepare_environment

        prepare_environment()
        from inspector.engine.session import Session

        factory = Session.open
    session = factory(options, progress)
    if stopping.is_set():
        session.close()
        return None
    return session


def _run(hub: Hub, transport: ServerTransport, inbox: queue.Queue, stopping: threading.Event,
         exit_when_idle_s: float | None, log) -> int:
    idle_since, served = time.monotonic(), False
    while not stopping.is_set():
        try:
            key, message = inbox.get(timeout=0 if hub.busy else IDLE_POLL_S)
            while True:
                if message == GONE:
                    hub.client_gone(key)
                else:
                    hub.handle(key, message)
                key, message = inbox.get_nowait()
        except queue.Empty:
            pass
        if hub.busy and (transport.behind or hub.behind):  # a client reads slower than the engine makes rows
            time.sleep(BEHIND_WAIT_S)
        elif hub.busy:
            try:
                hub.step()
            except SessionError as e:
                log(f"[serve] the engine failed: {e}")
                hub.fail_everyone(str(e))
                return 1
        if hub.clients:
            served, idle_since = True, time.monotonic()
        elif served and exit_when_idle_s is not None and time.monotonic() - idle_since > exit_when_idle_s:
            log("[serve] no client left: exiting")
            return 0
    return 0


def _close(transport: ServerTransport, context: zmq.Context, auth, code: int) -> int:
    transport.stop()
    if auth is not None:
        auth.stop()
    context.term()
    return code
