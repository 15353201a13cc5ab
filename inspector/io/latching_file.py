"""The file object a capture is written through: write errors are latched, so HDF5 never sees one, and
writes are done behind HDF5's back on a thread of their own."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from pathlib import Path

import numpy as np

from inspector.core import writeback
from inspector.core.writeback import write_pieces


class LatchingFile:
    """The temp file as HDF5 sees it (h5py's "fileobj" driver): a write error is latched, never raised.

    HDF5 (2.0 via h5py 3.16) can crash the process when it closes a file whose writes failed: failed
    flushes happen again in object deallocators and it frees state twice. So the first OSError
    (ENOSPC, EFBIG, EIO, ...) is stored in ``.error`` and the file switches to *discard* mode, where
    writes land in a small in-memory overlay (reads see them) and always succeed. HDF5 never sees a
    failure; CaptureWriter checks ``.error`` after every operation and removes the file. Plain
    positioned reads/writes on one descriptor.

    Writes are copied and handed to a ``WriteBehind`` thread, in order, so that the kernel's work on
    them (most of a capture file's CPU: page-cache pages found, filled and marked dirty) overlaps
    HDF5's and ours; reads, truncation and the end wait for them. An error met there is latched at
    the next call. Raw chunks written from an array ``lending`` names are not copied (the copy was a
    third of a capture writer's time): the array's owner leaves it as it is until ``wait_written``.
    Those page-aligned on the file and in memory (HDF5's pages place every chunk of 64 KiB or more on
    a page) go past the page cache (``writeback.write_pieces``).
    """

    LEND_FROM = 64 << 10  # smaller writes are copied all the same

    OVERLAY_MAX_WRITE = 1 << 20   # in discard mode, bigger writes (raw chunks) are dropped, not kept
    OVERLAY_MAX_TOTAL = 64 << 20

    def __init__(self, path: Path):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        self.fd: int | None = os.open(path, flags, 0o666)
        self.error: OSError | None = None
        self._behind = WriteBehind(self.fd, writeback.open_direct(path))
        self._extent = 0      # the end of the furthest write, those still behind included
        self._discarding = False
        self._pos = 0
        self._size = 0        # logical size in discard mode
        self._overlay: list[tuple[int, bytes]] = []
        self._overlay_bytes = 0
        self._lent: tuple[int, np.ndarray] | None = None  # (address, its bytes) while ``lending``

    def _latch(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc
        self.discard()

    def discard(self) -> None:
        if not self._discarding and self.fd is not None:
            self._discarding = True
            try:
                self._size = max(os.fstat(self.fd).st_size, self._extent)
            except OSError:
                self._size = self._extent

    def _end(self) -> int:
        if self._discarding:
            return self._size
        return max(os.fstat(self.fd).st_size, self._extent)

    def _settle(self) -> None:
        """Wait for the writes behind; latch what failed there."""
        self._behind.settle()
        self._latch_behind()

    def _latch_behind(self) -> None:
        if self._behind.error is not None and not self._discarding:
            self._latch(self._behind.error)

    # -- the file-like interface h5py's fileobj driver uses

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._end() + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n, pos = len(mv), self._pos
        self._latch_behind()
        if not self._discarding:
            lent = self._lent_view(mv) if self._lent is not None and n >= self.LEND_FROM else None
            # else a copy: HDF5 may reuse its buffer
            self._behind.write(bytes(mv) if lent is None else lent, pos, lent=lent is not None)
            self._extent = max(self._extent, pos + n)
        if self._discarding:
            if n <= self.OVERLAY_MAX_WRITE and self._overlay_bytes + n <= self.OVERLAY_MAX_TOTAL:
                self._overlay.append((pos, bytes(mv)))
                self._overlay_bytes += n
            self._size = max(self._size, pos + n)
        self._pos = pos + n
        return n

    def readinto(self, buffer) -> int:
        self._settle()
        mv = memoryview(buffer).cast("B")
        n, pos = len(mv), self._pos
        got = 0
        try:
            got = os.preadv(self.fd, [mv], pos) if hasattr(os, "preadv") else self._pread_copy(mv, pos)
        except OSError as exc:
            self._latch(exc)
        if got < n:
            mv[got:] = bytes(n - got)
        for at, blob in self._overlay:  # later writes win
            lo, hi = max(at, pos), min(at + len(blob), pos + n)
            if lo < hi:
                mv[lo - pos: hi - pos] = blob[lo - at: hi - at]
        self._pos = pos + n
        return n

    def _pread_copy(self, mv: memoryview, pos: int) -> int:
        data = os.pread(self.fd, len(mv), pos)
        mv[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        size = max(0, self._end() - self._pos) if size is None or size < 0 else size
        buf = bytearray(size)
        self.readinto(buf)
        return bytes(buf)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        self._settle()
        if not self._discarding:
            try:
                os.ftruncate(self.fd, size)
                self._extent = size
            except OSError as exc:
                self._latch(exc)
        if self._discarding:
            self._size = size
        return size

    def flush(self) -> None:
        pass

    # -- ours

    @contextlib.contextmanager
    def lending(self, array: np.ndarray):
        """Within the block, writes of ``array``'s bytes are queued as views of it: the caller leaves it
        as it is until ``wait_written(ticket)`` (``ticket`` read after the block) returns. ``array`` is
        C-contiguous."""
        raw = array.reshape(-1).view(np.uint8)
        self._lent = (raw.__array_interface__["data"][0], raw)
        try:
            yield
        finally:
            self._lent = None

    def _lent_view(self, mv: memoryview):
        address, raw = self._lent
        at = np.frombuffer(mv, np.uint8).__array_interface__["data"][0] - address
        return raw[at: at + len(mv)] if 0 <= at and at + len(mv) <= len(raw) else None

    @property
    def ticket(self) -> int:
        """Writes asked for so far: ``wait_written`` of it returns once they are done."""
        return self._behind.submitted

    @property
    def written(self) -> int:
        """Writes done so far (in the order asked): a ticket up to this is done."""
        return self._behind.done

    def wait_written(self, ticket: int) -> None:
        self._behind.wait_done(ticket)

    def finish(self, fsync: bool) -> None:
        """After HDF5 closed the file: fsync (errors raise) and close the descriptor."""
        self._settle()
        if self.error is not None:
            raise self.error
        try:
            if fsync:
                os.fsync(self.fd)
        finally:
            self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if self.fd is not None:
            self._behind.stop()
            try:
                os.close(self.fd)
            except OSError as exc:
                if self.error is None and not self._discarding:
                    self.error = exc
            self.fd = None


class WriteBehind:
    """``pwrite`` on a thread of its own, in the order asked, while the caller goes on. At most
    ``MAX_QUEUED`` bytes of copies wait (their memory is the queue's); lent bytes are bounded by their
    owners, who wait for them before writing there again. The first error stops the writes after it
    and stays in ``error``."""

    MAX_QUEUED = 64 << 20
    MAX_RUN = 512  # pieces a pwritev takes at most (Linux takes 1,024)

    def __init__(self, fd: int, direct: int | None = None):
        """``direct``: a descriptor of the same file for the page-aligned writes (``writeback.open_direct``),
        closed with the writes' thread."""
        self.fd, self.direct = fd, direct
        self.error: Exception | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # bytes of copies waiting
        self.submitted = self.done = 0  # writes asked for, and done (in that order)
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="capture-file-writes", daemon=True)
        self._thread.start()

    def write(self, blob, pos: int, lent: bool = False) -> None:
        """Queue ``blob`` (bytes, or a lent array's bytes) for ``pos``."""
        if not lent:
            with self._changed:
                self._changed.wait_for(lambda: self._queued < self.MAX_QUEUED)
                self._queued += len(blob)
        self.submitted += 1
        self._jobs.put((blob, pos, lent))

    def wait_done(self, ticket: int) -> None:
        """Return once the first ``ticket`` writes are done."""
        if self.done < ticket:
            with self._changed:
                self._changed.wait_for(lambda: self.done >= ticket or not self._thread.is_alive())

    def settle(self) -> None:
        """Return once every write asked so far is done."""
        self.wait_done(self.submitted)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        if self.direct is not None:
            with contextlib.suppress(OSError):  # its writes are done; the file's own descriptor says the rest
                os.close(self.direct)
            self.direct = None

    def _run(self) -> None:
        try:
            self._write_jobs()
        finally:  # however it ended, a waiter sees the thread gone
            with self._changed:
                self._changed.notify_all()

    def _write_jobs(self) -> None:
        unsent = 0  # bytes written through the page cache since the kernel was last asked to write them out
        job = self._jobs.get()
        while job is not None:
            run, job = self._contiguous_run(job)
            pieces = [memoryview(blob) for blob, _, _ in run]
            if self.error is None:
                try:
                    unsent += write_pieces(self.fd, pieces, run[0][1], self.direct)
                except Exception as exc:  # noqa: BLE001 - latched: the file fails, its writer does not hang
                    self.error = exc
                if unsent >= writeback.EVERY:
                    writeback.start_writeback(self.fd)
                    unsent = 0
            copied, count = sum(len(blob) for blob, _, lent in run if not lent), len(run)
            del run, pieces  # a lent array's views go before its owner hears they are written
            with self._changed:
                self._queued -= copied
                self.done += count
                self._changed.notify_all()
            if job is _NONE_WAITING:
                job = self._jobs.get()

    def _contiguous_run(self, first: tuple) -> tuple[list[tuple], object]:
        """``first`` and the jobs queued after it that continue it on the file (HDF5 writes a file's chunks
        one after the other), up to ``MAX_RUN`` pieces or ``writeback.EVERY`` bytes: one ``pwritev``
        for them all, where a call and a wake-up for each held a batch-256 capture file's writer to
        1.25 GB/s on an H100's host (1.8 joined; docs/gpu-run-2026-12-07e-writes-joined.md). Also the job
        after the run (``_NONE_WAITING``: none is queued)."""
        run, end, size = [first], first[1] + len(first[0]), len(first[0])
        while len(run) < self.MAX_RUN and size < writeback.EVERY:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return run, _NONE_WAITING
            if job is None or job[1] != end:
                return run, job
            run.append(job)
            end, size = end + len(job[0]), size + len(job[0])
        return run, _NONE_WAITING


_NONE_WAITING = object()
