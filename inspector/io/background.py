"""A capture file written by a process of its own, so that the engine's thread only hands rows over.

A writer thread in the engine's process shares its GIL: every numpy copy and HDF5 call lets the GIL
go and must wait to get it back from the engine's busy Python. On the H200 a capture file then took
a sixth of the disk's speed, and beside a thread spinning in Python the writer here all but stopped
(docs/performance-notes.md). So the file is written in a child process. A step's rows travel
through shared memory (a ring, ``backlog_bytes``): the engine's thread has a step's rows copied into
it (by several threads where they are large: a copy lets the GIL go) and sends where they lie; the
child writes them from there and says the room is free again. The other calls travel pickled, in
order. When the ring is full the caller waits for the disk: back-pressure, not unbounded memory.

Starting that process (an interpreter, numpy, h5py) and touching its ring's memory take a few tenths
of a second, a tenth of a short capture's time: ``prepare()`` does it ahead, in a thread, for the
next file (``inspector capture`` while its engine boots).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import threading
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import NamedTuple

import numpy as np

from inspector.core import writeback
from inspector.core.blocks import RowBlocks, consecutive
from inspector.core.shared_ring import Copiers, Regions, SharedRing, aligned, ring_bytes

from .atomic_file import FinishedOrDropped
from .writer import CaptureWriter

# The ring's size: a sixteenth of the memory, from 512 MiB to 2 GiB. A batch-32 prefill of an 8B model's
# 32 residual points is 1 GiB; while the ring is full, the engine waits for the disk before it decodes.
BACKLOG_BYTES = ring_bytes(16)


class BackgroundWriter(FinishedOrDropped):
    """A ``CaptureWriter(path, metadata, hooks, **options)`` in a process of its own:
    ``call("append_blocks", blocks)`` and the writer's other methods by name, in order. A failure there
    (a full disk, an unknown request) is raised by the caller's next call or by ``close``, and the file
    is not left behind; ``abort`` drops everything."""

    def __init__(self, path, metadata: dict, hooks: dict, backlog_bytes: int = BACKLOG_BYTES, **options):
        self._ring, self._conn, self._process = _prepared(backlog_bytes) or _start(backlog_bytes)
        self._conn.send(("open", os.fspath(path), metadata, hooks, options))
        self._copiers = Copiers("capture-rows-copy")
        self._regions = Regions(self._ring.size)
        self._error: BaseException | None = None
        self._closed = False  # the child starts meanwhile: a file it cannot open is raised by a later call

    def call(self, method: str, *args) -> None:
        """``writer.method(*args)`` in the writer's process."""
        getattr(CaptureWriter, method)  # a misspelt method fails here, not later in the child
        self._take_news()
        self._raise_failure()
        if method == "append_blocks":
            for piece in args[0].pieces(max(1, (self._ring.size // _PIECES) // max(1, _row_bytes(args[0])))):
                self._send_blocks(piece)
        elif method in ("add_request", "update_request"):  # what a request says, not its rows
            self._conn.send(("call", method, (replace(args[0], hooks={}, lens={}, features={}, scores={}),)))
        else:
            self._conn.send(("call", method, args))

    def close(self) -> Path:
        """Wait for every call, then finish the file (renamed onto its path, synced)."""
        path = self._finish("close")
        self._raise_failure()
        return path

    def abort(self) -> None:
        self._finish("abort")

    # --- the parent's side of the ring and the pipe

    def _send_blocks(self, blocks: RowBlocks) -> None:
        """Into the ring: the hooks' rows (in one copy where they lie side by side in the landed copy:
        each copy lets the GIL go and waits to get it back), then positions and token ids. A region
        takes whole pages, so the rows start on one: whole chunks go from the ring to the file past the
        page cache."""
        values = list(blocks.values.values())
        if len(values) > 1 and consecutive(values) and all(v.shape == values[0].shape for v in values):
            arrays = {_STACKED: np.lib.stride_tricks.as_strided(values[0], shape=(len(values), *values[0].shape))}
        else:
            arrays = dict(blocks.values)
        arrays.update(positions=np.ascontiguousarray(blocks.positions, np.int64),
                      token_ids=np.ascontiguousarray(blocks.token_ids, np.int64))
        sizes = {key: aligned(a.nbytes) for key, a in arrays.items()}
        size = -(-sum(sizes.values()) // writeback.ALIGN) * writeback.ALIGN
        start = self._reserve(size)
        where, at, copies = {}, start, []
        for key, a in arrays.items():
            copies.append((self._ring.view(at, a.dtype, a.shape), a))
            where[key] = (at, a.dtype, a.shape)
            at += sizes[key]
        self._copiers.copy(copies)
        self._conn.send(("blocks", blocks.request_ids, blocks.bounds, where, list(blocks.values)))

    def _reserve(self, size: int) -> int:
        """A region of ``size`` bytes of the ring, once the child has let go of enough (regions are
        taken and let go of in order)."""
        while (start := self._regions.take(size)) is None:
            self._answer("freed")
            self._raise_failure()
        return start

    def _take_news(self) -> None:
        while self._conn.poll():
            self._news(self._conn.recv())

    def _answer(self, wanted: str):
        """Wait for the child's next message of kind ``wanted`` (or a failure), taking in the others."""
        while True:
            try:
                message = self._conn.recv()
            except EOFError:
                self._error = self._error or RuntimeError(
                    f"the capture writer's process ended (exit code {self._process.exitcode})")
                return None
            self._news(message)
            if message[0] in (wanted, "error"):
                return message

    def _news(self, message) -> None:  # "ready" (the child has started) says nothing here
        if message[0] == "freed":
            self._regions.release_oldest()
        elif message[0] == "error" and self._error is None:
            self._error = message[1]

    def _finish(self, how: str) -> Path | None:
        if self._closed:
            return None
        self._closed = True
        message = None
        try:
            self._conn.send((how,))
        except OSError:  # the child is gone; its error, if it sent one, is kept
            message = ("done", None)
        while message is None or message[0] == "error":
            message = self._answer("done")
            if message is None:  # the child is gone
                break
        self._process.join(timeout=60)
        self._copiers.shutdown()
        self._conn.close()
        # its pages are given back on a thread: 2 GiB took 0.2 s, a tenth of a batch-32 capture's time
        threading.Thread(target=self._ring.close, name="capture-ring-close", daemon=True).start()
        return None if message is None else message[1]

    def _raise_failure(self) -> None:
        if self._error is not None:
            if not self._closed:
                self.abort()
            raise self._error


_STACKED = "@hooks"  # in the ring: every hook's rows as one [hooks, rows, width] array
# A step travels in pieces of at most an eighth of the ring, and the child writes each as it comes
# (a decode step's rows land in the chunk buffers with a scatter a hook, so holding steps saves
# nothing): its room is free again once the file's writes from it are done, and a file's last rows
# wait for nothing held back.
_PIECES = 8


def _row_bytes(blocks: RowBlocks) -> int:
    return 16 + sum(v.nbytes // max(1, len(v)) for v in blocks.values.values())


_spare: list = []  # at most one (ring size, the thread starting a worker, where it puts it) started ahead
_spare_lock = threading.Lock()


class _Worker(NamedTuple):
    ring: SharedRing
    conn: Connection  # the parent's end of the pipe
    process: BaseProcess


def prepare(backlog_bytes: int = BACKLOG_BYTES, wait: bool = False) -> None:
    """Start the writer's process of the next ``BackgroundWriter`` now, in a thread, unless one is.
    ``wait``: until it has started (its modules loaded, its ring mapped)."""
    with _spare_lock:
        if not _spare:
            made: dict = {}
            thread = threading.Thread(target=lambda: made.update(worker=_start(backlog_bytes, populate=True)),
                                      daemon=True, name="capture-writer-start")
            _spare.append((backlog_bytes, thread, made))
            thread.start()
        _, thread, made = _spare[0]
    if wait:
        thread.join()
        worker = made.get("worker")
        with contextlib.suppress(EOFError, OSError):
            while worker is not None and not made.get("ready"):
                made["ready"] = worker.conn.recv()[0] == "ready"


def _prepared(backlog_bytes: int) -> _Worker | None:
    """The worker ``prepare`` started, if it has this ring size and is alive (else it is stopped)."""
    with _spare_lock:
        if not _spare:
            return None
        size, thread, made = _spare.pop()
    thread.join()
    worker = made.get("worker")  # none if its start failed: a start now says why
    if worker is not None and (size != backlog_bytes or not worker.process.is_alive()):
        worker.conn.close()  # the child ends on the pipe's end
        worker.ring.close()
        return None
    return worker


def _start(backlog_bytes: int, populate: bool = False) -> _Worker:
    ctx = mp.get_context("spawn")
    ring = SharedRing(backlog_bytes, populate=populate)
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_serve, args=(child, ring), name="capture-writer", daemon=True)
    process.start()
    child.close()
    return _Worker(ring, conn, process)


def _serve(conn, ring: SharedRing) -> None:
    """The child: told its file (or to end: the pipe closed), a CaptureWriter fed from the pipe. Rows
    are handed to it where they lie in the ring (no copy out) and written at once; a thread says each
    region is free once the file's writes from it are done (see ``_PIECES``), so that this one never
    waits for the disk while the ring has rows."""
    try:
        conn.send(("ready",))
        _, path, metadata, hooks, options = conn.recv()
    except (EOFError, BrokenPipeError):  # a prepared process no file took
        return
    sending = threading.Lock()
    try:
        writer = CaptureWriter(path, metadata, hooks, **options)
    except BaseException as e:  # noqa: BLE001 - told to the parent
        _tell(conn, sending, ("error", e))
        writer, failed = None, True
    else:
        failed = False
    regions: queue.SimpleQueue = queue.SimpleQueue()  # the ticket each region read is written at, in order
    freer = threading.Thread(target=_free_when_written, args=(conn, sending, regions, writer), daemon=True,
                             name="capture-ring-freer")
    freer.start()
    while True:
        message = conn.recv()
        kind = message[0]
        if kind not in ("blocks", "call"):  # close or abort, once every region is free
            regions.put(None)
            freer.join()
            path = None
            try:
                if kind == "close" and not failed:
                    path = writer.close()
                elif writer is not None:
                    writer.abort()
            except BaseException as e:  # noqa: BLE001 - told to the parent; the file is gone
                _tell(conn, sending, ("error", e))
            _tell(conn, sending, ("done", path))
            return
        ticket = 0
        try:
            if kind == "blocks":
                _, request_ids, bounds, where, hooks = message
                if not failed:
                    arrays = {key: ring.view(at, dtype, shape) for key, (at, dtype, shape) in where.items()}
                    positions, token_ids = arrays.pop("positions"), arrays.pop("token_ids")
                    if _STACKED in arrays:
                        arrays = dict(zip(hooks, arrays[_STACKED]))
                    ticket = writer.append_blocks(RowBlocks(request_ids, bounds, positions, token_ids, arrays),
                                                  at_once=True)
            elif not failed:
                getattr(writer, message[1])(*message[2])
        except BaseException as e:  # noqa: BLE001 - told to the parent; what follows is dropped
            failed, ticket = True, 0
            _tell(conn, sending, ("error", e))
        if kind == "blocks":  # free once written, or at once if dropped
            regions.put(ticket)


def _free_when_written(conn, sending: threading.Lock, regions: queue.SimpleQueue, writer: CaptureWriter | None):
    """Say that regions of the ring are free, in order, as the file's writes from them are done."""
    while (ticket := regions.get()) is not None:
        if writer is not None:
            writer.wait_written(ticket)
        _tell(conn, sending, ("freed",))


def _tell(conn, sending: threading.Lock, message) -> None:
    with sending:
        try:
            conn.send(message)
        except Exception:  # noqa: BLE001 - an error that does not pickle goes as its text
            conn.send((message[0], RuntimeError(f"{type(message[1]).__name__}: {message[1]}")))
