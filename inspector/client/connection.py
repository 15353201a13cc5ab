"""A client's line to a server: calls that get a reply, calls that stream, and knowing the server is alive.

The socket (a DEALER) lives on a thread of its own (``Endpoint``); any thread may call. A server is
gone, and every call waiting on it ends with ``ServerGone``, once its connection closes (its process
ended: noticed at once) or once it has answered nothing, not even the pings sent four times a second,
for ``DEAD_AFTER_S`` (a hung host or network). That wait is long because a busy server may hold its
GIL for seconds (a first forward that compiles kernels), which delays its answers but is no failure.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Callable

import zmq

from inspector.net.endpoint import Endpoint
from inspector.net.keys import ClientKeys
from inspector.net.wire import Message, WireError, decode, encode

from .rows_ahead import RowsAhead

PING_EVERY_S = 0.25
DEAD_AFTER_S = 15.0


class ServerGone(ConnectionError):
    """The server stopped answering, said goodbye, or was never there."""


class Connection:
    def __init__(self, url: str, keys: ClientKeys | None = None, on_message: Callable[[Message], None] = None,
                 rows_ahead: RowsAhead | None = None):
        """``on_message``: messages that answer no call (boot progress); ``rows_ahead``: shared memory
        offered to the server for rows (its offer goes in the hello: ``inspector.client.remote``)."""
        self.url = url
        self.rows_ahead = rows_ahead
        self._context = zmq.Context()
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = (
                keys.secret, keys.public, keys.server_public)
        socket.connect(url)
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._on_message = on_message or (lambda message: None)
        self._last_heard: float | None = None  # nothing yet: the server may not exist
        self._last_ping = 0.0
        self.lost: str | None = None  # why the server is gone, once it is
        self._endpoint = Endpoint(socket, self._received, self._tick, routed=False, name="client-socket",
                                  on_disconnected=self._disconnected)
        self._endpoint.start()  # after the assignment: its first tick sends a ping through it

    # ------------------------------------------------------------------ calls
    def start(self, type_: str, body: dict | None = None) -> "Call":
        """Send a message that expects answers (they carry its id); ServerGone if the server is gone."""
        if self.lost is not None:
            raise ServerGone(self.lost)
        replies: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            call = Call(self, next(self._ids), replies)
            self._waiting[call.id] = replies
        self.send(Message(type_, body or {}, call.id))
        return call

    def call(self, type_: str, body: dict | None = None, timeout_s: float | None = None) -> Message:
        """Send and wait for the one reply; ServerGone, or TimeoutError after ``timeout_s``."""
        with self.start(type_, body) as call:
            return call.next(timeout_s)

    def send(self, message: Message) -> None:
        self._endpoint.send(encode(message))

    def close(self, say_bye: bool = True) -> None:
        if say_bye and self.lost is None:
            self.send(Message("bye"))
        self._lose("the connection was closed")
        self._endpoint.stop(linger_s=0.2)
        self._context.term()
        self.drop_rows_ahead()

    def drop_rows_ahead(self) -> None:
        """The server does not use the shared memory (or the connection is closed): let it go."""
        if self.rows_ahead is not None:
            self.rows_ahead.close()
            self.rows_ahead = None

    # ------------------------------------------------------------------ the socket's thread
    def _received(self, frames: list) -> None:
        self._last_heard = time.monotonic()
        ahead = self.rows_ahead
        try:
            message = decode(frames, limited=False, ahead=None if ahead is None else ahead.arrays)
            if message.type == "rows":
                if ahead is None:
                    raise WireError("bad-message", "rows sent ahead to a client that offered no shared memory")
                read = ahead.take(message.body)
                if read is not None:
                    self.send(Message("rows_read", {"message": read}))
                return
        except WireError as e:  # a lost message would leave a stream with a hole: stop here, and say why
            self._lose(f"the server at {self.url} sent a message this client cannot read ({e})")
            return
        if message.type == "pong":
            return
        if message.type == "goodbye":
            self._lose(f"the server said goodbye: {message.body.get('reason', '')}")
            return
        with self._lock:
            replies = self._waiting.get(message.id)
        if replies is not None:
            replies.put(message)
        else:
            self._on_message(message)

    def _tick(self) -> None:
        now = time.monotonic()
        if self.lost is not None:
            return
        if now - self._last_ping >= PING_EVERY_S:
            self._last_ping = now
            self.send(Message("ping"))
        if self._last_heard is not None and now - self._last_heard > DEAD_AFTER_S:
            self._lose(f"the server at {self.url} stopped answering")

    def _disconnected(self, fd: int) -> None:
        if self._last_heard is not None:  # before that, a refused handshake (wrong keys) is waited out
            self._lose(f"the server at {self.url} closed the connection")

    def _lose(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        with self._lock:
            waiting = list(self._waiting.values())
        for replies in waiting:
            replies.put(ServerGone(reason))

    @property
    def heard_from(self) -> bool:
        return self._last_heard is not None


class Call:
    """The answers to one message, in order."""

    def __init__(self, connection: Connection, call_id: int, replies: queue.SimpleQueue):
        self._connection, self.id, self._replies = connection, call_id, replies

    def next(self, timeout_s: float | None = None) -> Message:
        """The next answer; TimeoutError after ``timeout_s``, ServerGone if the server is gone."""
        try:
            message = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no answer from {self._connection.url} in {timeout_s:.1f} s") from None
        if isinstance(message, ServerGone):
            raise message
        return message

    def close(self) -> None:
        with self._connection._lock:
            self._connection._waiting.pop(self.id, None)

    def __enter__(self) -> "Call":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
