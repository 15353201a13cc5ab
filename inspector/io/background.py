"""A capture file written on a thread of its own, so that the engine's thread only hands rows over.

HDF5 lets go of the GIL while it writes, and numpy while it copies: the file's work then overlaps the
engine's next forwards instead of following each step (``inspector capture`` at batch 32 on the
H200: docs/performance-notes.md). Calls run in the order given. Rows waiting are bounded: past
``backlog_bytes`` the caller waits for the disk (back-pressure, not unbounded memory).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from .writer import CaptureWriter


class BackgroundWriter:
    """Runs ``writer``'s calls on a thread: ``call("append_blocks", blocks, nbytes=...)`` queues
    ``writer.append_blocks(blocks)`` (``nbytes``: the rows it holds, for the backlog's bound).
    A failure there is raised by the caller's next call, or by ``close``; ``abort`` drops everything."""

    def __init__(self, writer: CaptureWriter, backlog_bytes: int = 512 << 20):
        self.writer = writer
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Condition()
        self._waiting_bytes, self._backlog = 0, int(backlog_bytes)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="capture-writer", daemon=True)
        self._thread.start()

    def call(self, method: str, *args, nbytes: int = 0) -> None:
        fn = getattr(self.writer, method)
        self._raise_failure()
        with self._room:
            while self._waiting_bytes and self._waiting_bytes + nbytes > self._backlog and self._error is None:
                self._room.wait()
            self._waiting_bytes += nbytes
        self._raise_failure()
        self._queue.put((fn, args, nbytes))

    def close(self) -> Path:
        """Wait for every call, then finish the file."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            self.writer.abort()
            raise self._error
        return self.writer.close()

    def abort(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self.writer.abort()

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args, nbytes = item
            try:
                if self._error is None:  # after a failure the rest is dropped, not written
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                self._error = e
            finally:
                with self._room:
                    self._waiting_bytes -= nbytes
                    self._room.notify_all()
