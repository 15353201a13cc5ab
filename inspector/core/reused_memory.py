"""Host memory for rows a process keeps, reused once their arrays are gone.

Rows copied into fresh memory cost its pages as well: on the project's CPU a copy into fresh pages ran
at 6.2 GB/s, into pages made before at 13.7 (1.15 GB/s where pages are 4 KiB, not huge). A run a
client drops gives its memory back here, and the next run's rows land in it. The memory waiting here
is marked free for the kernel (``MADV_FREE``): it takes those pages back when it needs them, and until
then reusing them costs nothing.

A block is handed out as a numpy array whose base is a buffer, not another array, so every view of it
keeps that array alive (numpy collapses a view's base only through arrays) and its death says that
nothing uses the memory any more.
"""

from __future__ import annotations

import math
import mmap
import threading
import weakref
from collections import OrderedDict

import numpy as np

from inspector.core.shared_ring import MEMORY_BYTES

SMALLEST = 2 << 20  # blocks under a huge page come from numpy's allocator as before
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 2 MiB and of an eighth of its power of two (at most 1/8
    more), so blocks of slightly different sizes are reused for one another."""
    grain = max(SMALLEST, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // grain) * grain


def mapped_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An array in a mapping of its own: page-aligned, as a direct write takes it (``core.writeback``),
    where numpy's allocator starts large arrays 16 bytes into a page."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    memory = mmap.mmap(-1, max(1, nbytes), flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, max(1, nbytes))
    _advise(memory, "MADV_HUGEPAGE")
    return np.frombuffer(memory, np.uint8, count=nbytes).view(dtype).reshape(shape)


class ReusedMemory:
    def __init__(self, keep_bytes: int | None = None):
        """``keep_bytes``: the most memory kept for reuse (a quarter of the machine's by default)."""
        self.keep_bytes = keep_bytes if keep_bytes is not None else MEMORY_BYTES // 4
        self._free: OrderedDict[int, list[mmap.mmap]] = OrderedDict()  # by size class, least recent first
        self._free_bytes = 0
        self._lock = threading.RLock()  # a block let go of by a collection inside the lock comes back here
        self.reused = 0  # blocks handed out again
        self.made = 0  # and made

    def empty(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes``, its memory reused where a block of its size class waits."""
        if nbytes < SMALLEST:
            return np.empty(nbytes, np.uint8)
        size = size_class(nbytes)
        with self._lock:
            waiting = self._free.get(size)
            memory = waiting.pop() if waiting else None
            if memory is not None:
                self._free_bytes -= size
                self.reused += 1
            else:
                self.made += 1
        if memory is None:
            memory = mmap.mmap(-1, size, flags=_PRIVATE) if _PRIVATE else mmap.mmap(-1, size)
            _advise(memory, "MADV_HUGEPAGE")
        block = np.frombuffer(memory, np.uint8, count=nbytes)
        weakref.finalize(block, self._give_back, memory, size).atexit = False
        return block

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def close(self) -> None:
        """What waits is let go of, and so is every block given back from now on."""
        with self._lock:
            self.keep_bytes = 0
            self._free.clear()
            self._free_bytes = 0

    def _give_back(self, memory: mmap.mmap, size: int) -> None:
        """A block's last view is gone (on whichever thread let it go): its memory waits here, the
        least recently used let go of beyond ``keep_bytes`` (unmapped once nothing refers to it)."""
        _advise(memory, "MADV_FREE")
        with self._lock:
            self._free.setdefault(size, []).append(memory)
            self._free.move_to_end(size)
            self._free_bytes += size
            while self._free_bytes > self.keep_bytes:
                oldest, blocks = next(iter(self._free.items()))
                blocks.pop(0)
                self._free_bytes -= oldest
                if not blocks:
                    del self._free[oldest]


def _advise(memory: mmap.mmap, what: str) -> None:
    advice = getattr(mmap, what, None)
    if advice is not None and _PRIVATE:
        try:
            memory.madvise(advice)
        except OSError:  # a kernel without it: the memory works the same, faults cost more
            pass
