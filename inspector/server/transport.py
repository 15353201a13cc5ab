"""The server's socket: who is connected, who is still alive, and what goes where.

It runs on its own thread (``Endpoint``), so it answers pings and reports boot progress while the
engine's thread is busy. Messages that are not well formed are answered here with an error and never
reach the engine; the rest go to the engine's inbox in the order they came.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import zmq

from inspector.net.endpoint import STALL_S, Endpoint
from inspector.net.wire import Message, WireError, decode, encode

# A client whose connection closes is gone at once (the socket monitor names the connection's file
# descriptor, each message the descriptor it came by); one that sent nothing, not even a ping, for this
# long is gone too (a hung host or network; a busy client process may be silent for seconds).
CLIENT_TIMEOUT_S = 15.0
GONE = "gone"  # the inbox's word for a client that went away


class ServerTransport:
    def __init__(self, socket: zmq.Socket, inbox: queue.Queue, backlog_limit: int = 256 << 20,
                 log: Callable[[str], None] = lambda text: None):
        self.inbox, self._log = inbox, log
        self.on_rows_read: Callable[[bytes, Message], None] = lambda key, message: None  # the hub's, once it is up
        self._seen: dict[bytes, float] = {}  # client -> when it last sent anything
        self._fd: dict[bytes, int] = {}  # client -> its connection's file descriptor
        self._greeted: set[bytes] = set()  # clients that said hello: they hear boot progress
        self._progress: list[Message] = []  # the boot so far, for clients that come later
        self._lock = threading.Lock()  # the greeted and the progress change together
        self.endpoint = Endpoint(socket, self._received, self._tick, routed=True, backlog_limit=backlog_limit,
                                 on_stalled=self._stalled, name="server-socket", on_disconnected=self._closed)

    def start(self) -> "ServerTransport":
        self.endpoint.start()
        return self

    def stop(self) -> None:
        self.endpoint.stop()

    def send(self, key: bytes, message: Message) -> None:
        """Thread-safe."""
        self.endpoint.send(encode(message), key)

    def broadcast(self, message: Message) -> None:
        """To every client that said hello (boot progress, goodbyes); thread-safe."""
        with self._lock:
            if message.type == "progress":
                self._progress.append(message)
            for key in self._greeted:
                self.send(key, message)

    @property
    def behind(self) -> bool:
        """A client's backlog is past the limit: the engine should wait for it (thread-safe)."""
        return self.endpoint.behind

    @property
    def clients(self) -> int:
        return len(self._seen)

    # ------------------------------------------------------------------ the socket's thread
    def _received(self, frames: list) -> None:
        key, fd, frames = frames[0].bytes, frames[0].get(zmq.SRCFD), frames[1:]
        if self._fd.get(key) != fd:  # a new connection, maybe on the fd of one that closed: hear that close first
            self.endpoint.take_closes()
            self._fd[key] = fd
        self._seen[key] = time.monotonic()
        try:
            message = decode(frames)
        except WireError as e:
            self.send(key, Message("error", {"kind": e.kind, "message": str(e)}))
            return
        if message.type == "ping":
            self.send(key, Message("pong", {}, message.id))
            return
        if message.type == "rows_read":  # here: the engine's thread may be waiting for that room
            self.on_rows_read(key, message)
            return
        if message.type == "hello":
            with self._lock:
                if key not in self._greeted:
                    self._greeted.add(key)
                    for progress in self._progress:
                        self.send(key, progress)
        self.inbox.put((key, message))

    def _tick(self) -> None:
        now = time.monotonic()
        for key, seen in list(self._seen.items()):
            if now - seen > CLIENT_TIMEOUT_S:
                self._gone(key)

    def _closed(self, fd: int) -> None:
        for key in [k for k, f in self._fd.items() if f == fd]:
            self._log("[serve] a client's connection closed: its requests are cancelled")
            self._gone(key)

    def _stalled(self, key: bytes) -> None:
        """It stopped reading: what waits for it is dropped, and so is it (it hears why if it reads again)."""
        self._log(f"[serve] a client stopped reading ({self.endpoint.limit >> 20} MiB waited for it, and it took "
                  f"nothing for {STALL_S:.0f} s): disconnected")
        self._gone(key)
        self.send(key, Message("goodbye", {"reason": "disconnected: this client stopped reading while the server "
                                           "had more than the allowed backlog for it; its requests were cancelled"}))

    def _gone(self, key: bytes) -> None:
        self._seen.pop(key, None)
        self._fd.pop(key, None)
        with self._lock:
            self._greeted.discard(key)
        self.endpoint.forget(key)
        self.inbox.put((key, GONE))
