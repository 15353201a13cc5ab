"""Files written out as they grow: the kernel asked to start writing a file's dirty pages at once.

Otherwise it starts only past a share of the memory (a tenth of 128 GiB on a GPU host), and the
closing ``fsync`` waits for all of it: 0.8 of the 2.7 s a 2 GB capture file took, the disk idle while
the file went into memory. ``sync_file_range`` (Linux) starts the writing and does not wait for it;
elsewhere nothing is asked and the ``fsync`` does it all.

Writes whose file offset, length and memory are page-aligned go past the page cache where the file
system allows it (``O_DIRECT``, through a second descriptor): the kernel's copy into the page cache
was the thread's bound. On the project's CPU 2 GiB in 32 MiB writes took 2.3-5.8 s of CPU through the
page cache and 0.13 s past it (921 and 1,505 MB/s)."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np

EVERY = 32 << 20  # bytes written between asks
ALIGN = 4096  # what a direct write asks of its offset, length and memory (a page: enough for any disk)
_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range():
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages out, without waiting for them."""
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, data: memoryview, pos: int) -> None:
    """``data`` written at ``pos`` whole (a short write is tried again from where it stopped)."""
    done = 0
    while done < len(data):
        wrote = os.pwrite(fd, data[done:], pos + done)
        if wrote <= 0:
            raise OSError(errno.ENOSPC, "no space left on device (short write)")
        done += wrote


def open_direct(path) -> int | None:
    """A second descriptor for writing ``path`` past the page cache, or None where the system or the
    file system offers none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag or not hasattr(os, "pwritev"):
        return None
    try:
        return os.open(path, os.O_WRONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None


def page_aligned(pieces: list[memoryview], pos: int) -> bool:
    """Whether a direct write can take ``pieces`` at ``pos``."""
    return pos % ALIGN == 0 and all(len(p) % ALIGN == 0 and _address(p) % ALIGN == 0 for p in pieces)


def _address(data: memoryview) -> int:
    return np.frombuffer(data, np.uint8).ctypes.data if len(data) else 0


def write_range(fd: int, data: memoryview, pos: int, direct: int | None = None) -> int:
    """``data`` written whole at ``pos``: where its memory and the file agree on where pages start, the
    whole pages past the page cache (through ``direct``), its ends through it. Returns the bytes written
    through the page cache."""
    head = (-pos) % ALIGN
    body = max(0, len(data) - head) // ALIGN * ALIGN
    if direct is None or not body or (_address(data) + head) % ALIGN:
        write_all(fd, data, pos)
        return len(data)
    write_all(fd, data[:head], pos)
    cached = write_pieces(fd, [data[head:head + body]], pos + head, direct)
    write_all(fd, data[head + body:], pos + head + body)
    return len(data) - body + cached


def write_pieces(fd: int, pieces: list[memoryview], pos: int, direct: int | None = None) -> int:
    """``pieces`` written one after the other from ``pos``, in one ``pwritev`` where there is one (a
    short write is finished piece by piece): through ``direct`` (``open_direct``'s) where they are
    page-aligned. Returns the bytes written through the page cache (``start_writeback`` asks them out)."""
    if direct is not None and page_aligned(pieces, pos):
        try:
            wrote = os.pwritev(direct, pieces, pos)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # a file system that takes no direct write here
                raise
        else:
            return _finish_short(fd, pieces, pos, wrote)
    if not hasattr(os, "pwritev") or len(pieces) == 1:
        for piece in pieces:
            write_all(fd, piece, pos)
            pos += len(piece)
    else:
        _finish_short(fd, pieces, pos, os.pwritev(fd, pieces, pos))
    return sum(len(piece) for piece in pieces)


def _finish_short(fd: int, pieces: list[memoryview], pos: int, wrote: int) -> int:
    """The bytes of ``pieces`` past the first ``wrote`` written through ``fd``; returns how many."""
    rest = 0
    for piece in pieces:
        if wrote < len(piece):
            write_all(fd, piece[wrote:], pos + wrote)
            rest += len(piece) - wrote
        wrote = max(0, wrote - len(piece))
        pos += len(piece)
    return rest
