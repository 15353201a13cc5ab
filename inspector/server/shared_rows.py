"""A client's rows through the shared memory it offered (a client on this machine: docs/protocol.md).

Through a socket, a step's rows are copied twice by the kernel and land in fresh pages, on one thread
a side: on an H200's host a client keeping its rows got 2 GB/s of them, where an 8B model's 32 residual
points at batch 256 make 6.8 GB/s. Here they are copied once into the client's ring (by several
threads) and out of it by the client (5 GB/s there), the ring's pages reused.
An event's large arrays go ahead of it in ``rows`` messages, each naming the regions its pieces lie in;
the client copies them out at once and gives each region back (``rows_read``), so a step larger than
the ring passes through it piece by piece. When the client does not give room back for
``ROOM_WAIT_S``, the rest travels through the socket as frames, where the transport's back-pressure
and its stall limit take over.

A step's rows of ``SENDER_BYTES`` or more are copied into the ring on a thread of the client's own,
not on the engine's: at batch 256 an 8B model's step has 64 MiB of rows, 4 ms of copying in a 19 ms
step. Smaller ones are copied on the engine's thread, where waking a thread each step cost more (on
two busy cores, 0.86 of vanilla against 0.92 through the socket). Every message to the client goes
through that thread, in order, once one waits there; the engine waits while more rows than the ring
holds wait to be copied (``behind``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from inspector.core.shared_ring import COPY_PIECE, Copiers, Regions, SharedRing, aligned
from inspector.net.wire import AHEAD, INLINE_BYTES, Message, dtype_name

logger = logging.getLogger(__name__)
ROOM_WAIT_S = 2.0
SENDER_BYTES = COPY_PIECE
PIECES = 8  # a rows message's region is at most this share of the ring


class SharedRows:
    def __init__(self, ring: SharedRing, send: Callable[[Message], None], copiers: Copiers):
        self._ring, self._send, self._copiers = ring, send, copiers
        self._regions = Regions(ring.size)
        self._in_use: deque[int] = deque()  # the rows message of each region in use, oldest first
        self._room = threading.Condition()
        self._messages = itertools.count(1)
        self._arrays = itertools.count(1)
        self._closed = False
        self._starved = False  # a wait for room ran out: no more waits until the client reads again
        self._broken = False  # the ring failed: the rest goes through the socket
        self.piece_bytes = ring.size // PIECES
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # (message, its rows' bytes), for the sender
        self._waiting = 0  # messages posted and not yet sent
        self._waiting_bytes = 0  # their rows
        self._counts = threading.Lock()
        self._sender: threading.Thread | None = None

    def post(self, message: Message) -> None:
        """Send ``message`` to the client after those posted before it (the engine's thread posts)."""
        rows = _rows_bytes(message.body) if message.type == "event" else 0
        with self._counts:
            direct = not self._waiting and rows < SENDER_BYTES
            if not direct:
                self._waiting += 1
                self._waiting_bytes += rows
        if direct:
            self._send(self._ahead(message, rows))
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._run, name="client-rows-sender", daemon=True)
            self._sender.start()
        self._outbox.put((message, rows))

    @property
    def behind(self) -> bool:
        """More rows wait to be copied than the ring holds: the engine should wait (any thread)."""
        return self._waiting_bytes > self._ring.size

    def _run(self) -> None:
        while (item := self._outbox.get()) is not None:
            message, rows = item
            self._send(self._ahead(message, rows))
            with self._counts:
                self._waiting -= 1
                self._waiting_bytes -= rows

    def _ahead(self, message: Message, rows: int) -> Message:
        if rows < INLINE_BYTES or self._broken:
            return message
        try:
            return Message(message.type, self.send_ahead(message.body), message.id)
        except (OSError, ValueError, BufferError):  # not the memory it offered: the socket from now on
            logger.exception("a client's shared memory failed; its rows go through the socket")
            self._broken = True
            return message

    def send_ahead(self, body: dict) -> dict:
        """An event's body, its blocks' rows sent ahead (unless they are small: the header holds them)."""
        if _rows_bytes(body) < INLINE_BYTES:
            return body
        blocks = body["blocks"]
        slices: list[tuple[int, int, int, np.ndarray]] = []  # (array, first row, end row, rows)
        declared: dict[int, list] = {}
        sent = []
        for block in blocks:
            values = {}
            for hook, array in block["values"].items():
                number = next(self._arrays)
                declared[number] = [dtype_name(array.dtype), list(array.shape)]
                step = max(1, self.piece_bytes // max(1, array[:1].nbytes))
                slices += [(number, a, min(a + step, len(array)), array[a:a + step])
                           for a in range(0, len(array), step)]
                values[hook] = {AHEAD: number}
            sent.append({**block, "values": values})
        piece: list = []
        for s in slices:
            if piece and sum(aligned(p[3].nbytes) for p in piece) + s[3].nbytes > self.piece_bytes:
                self._send_piece(piece, declared)
                piece = []
            piece.append(s)
        self._send_piece(piece, declared)
        return {**body, "blocks": sent}

    def read(self, message: int) -> None:
        """The client copied out the rows messages up to ``message``: their regions are free (any thread)."""
        with self._room:
            while self._in_use and self._in_use[0] <= message:
                self._in_use.popleft()
                self._regions.release_oldest()
            self._starved = False
            self._room.notify_all()

    def close(self) -> None:
        """What waits is sent, through the socket (the client is going), then the ring let go of."""
        with self._room:
            self._closed = True
            self._room.notify_all()
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join()
        self._ring.close()

    def _send_piece(self, piece: list, declared: dict[int, list]) -> None:
        new = {number: declared.pop(number) for number, *_ in piece if number in declared}
        size = sum(aligned(rows.nbytes) for *_, rows in piece)
        taken = self._take(size) if size <= self._ring.size else None  # (a row larger than a tiny ring)
        if taken is None:  # no room came: through the socket
            self._send(Message("rows", {"arrays": new, "slices": [[n, a, b, rows] for n, a, b, rows in piece]}))
            return
        start, message = taken
        at, slices, copies = start, [], []
        for number, a, b, rows in piece:
            copies.append((self._ring.view(at, rows.dtype, rows.shape), rows))
            slices.append([number, a, b, at])
            at += aligned(rows.nbytes)
        self._copiers.copy(copies)
        self._send(Message("rows", {"message": message, "arrays": new, "slices": slices}))

    def _take(self, size: int) -> tuple[int, int] | None:
        """A region and its rows message's number, once the client has given back enough room; None
        after ``ROOM_WAIT_S`` without it (and at once from then on, until it reads again), or once the
        client is gone."""
        deadline = time.monotonic() + ROOM_WAIT_S
        with self._room:
            while (start := self._regions.take(size)) is None:
                left = deadline - time.monotonic()
                if self._closed or self._starved or left <= 0:
                    self._starved = True
                    return None
                self._room.wait(left)
            message = next(self._messages)
            self._in_use.append(message)
            return start, message


def _rows_bytes(body: dict) -> int:
    """The bytes of an event body's rows in bulk (its blocks' values)."""
    return sum(v.nbytes for b in body.get("blocks") or () for v in b["values"].values())
