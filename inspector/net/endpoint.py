"""A ZeroMQ socket owned by a thread of its own, as ZeroMQ wants; other threads send through it.

The thread polls the socket and a wake-up pipe: a message from another thread goes into a queue and
one byte into the pipe, so it leaves at once, not at the next poll. What the peer cannot take yet (its
queue is full) waits in a backlog per peer, counted in bytes. A backlog past the limit is back-pressure
(``behind``: the sender should pause until it shrinks) while the peer still takes messages; a peer
that took nothing for ``STALL_S`` with its backlog past the limit has stopped reading: it is reported
(``on_stalled``) and its backlog dropped. So a slow reader slows the sender, and one that stopped
cannot grow the sender's memory without bound. A connecting socket can also be told when its connection closes
(``on_disconnected``, with the connection's file descriptor): a peer process that ends is noticed at
once, without waiting for silence.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

POLL_S = 0.05
STALL_S = 5.0
RECEIVE_BATCH = 64


class Endpoint:
    def __init__(self, socket: zmq.Socket, on_message: Callable[[list], None], on_tick: Callable[[], None],
                 routed: bool, backlog_limit: int = 256 << 20, on_stalled: Callable[[bytes], None] = lambda peer: None,
                 name: str = "endpoint", on_disconnected: Callable[[int], None] | None = None):
        """``routed``: a ROUTER socket, whose messages start with the peer's identity frame."""
        self.socket = socket
        self._on_message, self._on_tick, self._on_stalled = on_message, on_tick, on_stalled
        self._on_disconnected = on_disconnected
        self._routed, self.limit = routed, backlog_limit
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._backlog: dict[bytes | None, collections.deque] = {}
        self._backlog_bytes: dict[bytes | None, int] = collections.Counter()
        self._took_at: dict[bytes | None, float] = {}  # peer -> when it last took a message
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> "Endpoint":
        self._thread.start()
        return self

    def send(self, frames: list, peer: bytes | None = None) -> None:
        """Thread-safe; ``peer`` for a routed socket."""
        self._outbox.put((peer, frames))
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    @property
    def behind(self) -> bool:
        """Thread-safe: some peer's backlog is past the limit (pause what feeds it)."""
        return any(n > self.limit for n in list(self._backlog_bytes.values()))

    def forget(self, peer: bytes) -> None:
        """Drop what still waits for ``peer`` (it is gone)."""
        self._outbox.put((peer, None))
        os.write(self._wake_w, b"x")

    def stop(self, linger_s: float = 1.0) -> None:
        """Send what is queued (for up to ``linger_s``), then close the socket."""
        self._running = False
        self._linger_until = time.monotonic() + linger_s
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self._monitor = None
        if self._on_disconnected is not None:  # made here: a socket belongs to the thread that uses it
            self._monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while self._running or (self._pending() and time.monotonic() < self._linger_until):
                ready = dict(poller.poll(0 if self.socket.get(zmq.EVENTS) & zmq.POLLIN else POLL_S * 1000))
                self.take_closes()
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._take_outbox()
                self._flush()
                for _ in range(RECEIVE_BATCH):  # then send again: a flood coming in must not starve what goes out
                    if not self.socket.get(zmq.EVENTS) & zmq.POLLIN:
                        break
                    self._on_message(self.socket.recv_multipart(copy=False))
                self._on_tick()
        finally:  # a callback that raised must not leave the socket open: the context could never end
            if self._monitor is not None:
                self.socket.disable_monitor()
                self._monitor.close(linger=0)
            self.socket.close(linger=self._linger_ms())

    def _linger_ms(self) -> int:
        """How long ZeroMQ may still send what it was handed (a failed boot's reason, goodbyes) once
        the socket closes: the rest of the linger for a router, which drops what is addressed to peers
        already gone; none for a dealer, which would hold a dead server's messages for all of it."""
        if self._running or not self._routed:
            return 0
        return max(0, int((self._linger_until - time.monotonic()) * 1000))

    def take_closes(self) -> None:
        """Report the connections closed so far (from ``on_message`` too: a connection's close is
        reported before its file descriptor can come back with a new connection's first message)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on_disconnected(event["value"])

    def _pending(self) -> bool:
        return not self._outbox.empty() or any(self._backlog.values())

    def _take_outbox(self) -> None:
        while True:
            try:
                peer, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            if frames is None:
                self._drop(peer)
                continue
            if peer not in self._backlog:
                self._took_at[peer] = time.monotonic()  # a new backlog: its stall clock starts now
            self._backlog.setdefault(peer, collections.deque()).append(frames)
            self._backlog_bytes[peer] += sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)

    def _flush(self) -> None:
        for peer, waiting in list(self._backlog.items()):
            while waiting:
                frames = waiting[0]
                try:
                    self.socket.send_multipart([peer, *frames] if self._routed else frames, flags=zmq.NOBLOCK,
                                               copy=False)
                except zmq.Again:  # the peer's queue is full: keep the rest for later
                    break
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        raise
                    waiting.clear()  # the peer is gone
                    break
                waiting.popleft()
                self._backlog_bytes[peer] -= sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)
                self._took_at[peer] = time.monotonic()
            if not waiting:
                self._drop(peer)
            elif self._backlog_bytes[peer] > self.limit and time.monotonic() - self._took_at[peer] > STALL_S:
                self._drop(peer)
                self._on_stalled(peer)

    def _drop(self, peer: bytes | None) -> None:
        self._backlog.pop(peer, None)
        self._backlog_bytes.pop(peer, None)
        self._took_at.pop(peer, None)
