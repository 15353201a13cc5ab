"""Files written out as they grow: the kernel asked to start writing a file's dirty pages at once.

Otherwise it starts only past a share of the memory (a tenth of 128 GiB on a GPU host), and the
closing ``fsync`` waits for all of it: 0.8 of the 2.7 s a 2 GB capture file took, the disk idle while
the file went into memory. ``sync_file_range`` (Linux) starts the writing and does not wait for it;
elsewhere nothing is asked and the ``fsync`` does it all."""

from __future__ import annotations

import ctypes
import errno
import os

EVERY = 32 << 20  # bytes written between asks
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


def write_pieces(fd: int, pieces: list[memoryview], pos: int) -> None:
    """``pieces`` written one after the other from ``pos``, in one ``pwritev`` where there is one (a
    short write is finished piece by piece)."""
    if not hasattr(os, "pwritev") or len(pieces) == 1:
        for piece in pieces:
            write_all(fd, piece, pos)
            pos += len(piece)
        return
    wrote = os.pwritev(fd, pieces, pos)
    for piece in pieces:
        if wrote < len(piece):
            write_all(fd, piece[wrote:], pos + wrote)
        wrote = max(0, wrote - len(piece))
        pos += len(piece)
