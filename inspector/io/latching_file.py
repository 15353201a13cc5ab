"""The file object a capture is written through: write errors are latched, so HDF5 never sees one."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class LatchingFile:
    """The temp file as HDF5 sees it (h5py's "fileobj" driver): a write error is latched, never raised.

    HDF5 (2.0 via h5py 3.16) can crash the process when it closes a file whose writes failed: failed
    flushes happen again in object deallocators and it frees state twice. So the first OSError
    (ENOSPC, EFBIG, EIO, ...) is stored in ``.error`` and the file switches to *discard* mode, where
    writes land in a small in-memory overlay (reads see them) and always succeed. HDF5 never sees a
    failure; CaptureWriter checks ``.error`` after every operation and removes the file. Plain
    positioned reads/writes on one descriptor: as fast as HDF5's own POSIX driver (measured).
    """

    OVERLAY_MAX_WRITE = 1 << 20   # in discard mode, bigger writes (raw chunks) are dropped, not kept
    OVERLAY_MAX_TOTAL = 64 << 20

    def __init__(self, path: Path):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        self.fd: int | None = os.open(path, flags, 0o666)
        self.error: OSError | None = None
        self._discarding = False
        self._pos = 0
        self._size = 0        # logical size in discard mode
        self._overlay: list[tuple[int, bytes]] = []
        self._overlay_bytes = 0

    def _latch(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc
        self.discard()

    def discard(self) -> None:
        if not self._discarding and self.fd is not None:
            self._discarding = True
            try:
                self._size = os.fstat(self.fd).st_size
            except OSError:
                self._size = 0

    def _end(self) -> int:
        if self._discarding:
            return self._size
        return os.fstat(self.fd).st_size

    # -- the file-like interface h5py's fileobj driver uses

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._end() + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n, pos = len(mv), self._pos
        if not self._discarding:
            try:
                done = 0
                while done < n:
                    wrote = os.pwrite(self.fd, mv[done:], pos + done)
                    if wrote <= 0:
                        raise OSError(errno.ENOSPC, "no space left on device (short write)")
                    done += wrote
            except OSError as exc:
                self._latch(exc)
        if self._discarding:
            if n <= self.OVERLAY_MAX_WRITE and self._overlay_bytes + n <= self.OVERLAY_MAX_TOTAL:
                self._overlay.append((pos, bytes(mv)))
                self._overlay_bytes += n
            self._size = max(self._size, pos + n)
        self._pos = pos + n
        return n

    def readinto(self, buffer) -> int:
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
        if not self._discarding:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self._latch(exc)
        if self._discarding:
            self._size = size
        return size

    def flush(self) -> None:
        pass

    # -- ours

    def finish(self, fsync: bool) -> None:
        """After HDF5 closed the file: fsync (errors raise) and close the descriptor."""
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
            try:
                os.close(self.fd)
            except OSError as exc:
                if self.error is None and not self._discarding:
                    self.error = exc
            self.fd = None
