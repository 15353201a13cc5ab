"""Pinned host memory for the rows' copies, pinned ahead of need on a thread of its own.

A copy from the device runs alongside the next forward only into pinned host memory. torch's pinned
allocator pins each new block on the engine's thread, as the copy is queued: a session's first run of
a size spent most of its time there (on an H100, 2.0 of 4.4 s at batch 256; later runs reuse the
blocks, docs/performance-notes.md). Here pinned memory comes in slabs that a helper thread maps and
registers ahead of need (``cudaHostRegister`` lets the GIL go), and each forward's copy is carved from
one. A slab is carved again once nothing refers to any block of it: every block, and every array or
tensor made from one, holds a reference to its slab's array, so the array's reference count says when
the last of them is gone. Slabs are kept for reuse, as torch's allocator keeps its blocks.
"""

from __future__ import annotations

import logging
import mmap
import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

SLAB_BYTES = 256 << 20
_ALIGN = 4096


def cuda_register(address: int, nbytes: int) -> bool:
    """Pin host memory for the GPU's copies (the GIL is let go meanwhile); False if the driver refuses."""
    cudart = torch.cuda.cudart()
    return cudart.cudaHostRegister(address, nbytes, 0) == cudart.cudaError.success


class HostSlabs:
    """Blocks of pinned host memory, carved from slabs that a helper thread pins ahead, so that ``ahead``
    free slabs stand ready, each at least as large as the largest block asked for so far."""

    def __init__(self, register: Callable[[int, int], bool] = cuda_register, slab_bytes: int = SLAB_BYTES,
                 ahead: int = 1):
        self._register = register
        self._slab_bytes = slab_bytes
        self._ahead = ahead
        self._slabs: list[np.ndarray] = []  # every slab pinned and handed out, in use or not
        self._current: np.ndarray | None = None  # the slab blocks are carved from, and how far
        self._used = 0
        self._ready: list[np.ndarray] = []  # pinned by the helper, not handed out yet
        self._wanted = ahead  # slabs the helper is to pin
        self._wake = threading.Condition()
        self._failed = False
        self._closed = False
        self._helper = threading.Thread(target=self._pin_ahead, name="inspector-host-slabs", daemon=True)
        self._helper.start()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory for a tensor of ``shape`` and ``dtype`` (torch's own pinned memory where
        the driver refused to pin a slab)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = self._take(nbytes)
        if block is None:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return torch.from_numpy(block[:nbytes]).view(dtype).view(shape)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _take(self, nbytes: int) -> np.ndarray | None:
        size = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        if self._current is None or self._used + size > len(self._current):
            self._current, self._used = None, 0  # its own reference would count as a use
            self._current = self._slab_for(size)
            if self._current is None:
                return None
        block = self._current[self._used:self._used + size]
        self._used += size
        return block

    def _slab_for(self, size: int) -> np.ndarray | None:
        """A slab of at least ``size`` bytes that nothing refers to (one let go of, or pinned ahead), else
        one pinned now; and the helper told how many to pin so that ``ahead`` stand ready."""
        with self._wake:
            self._slabs += self._ready
            self._ready = []
        self._slab_bytes = max(self._slab_bytes, size)
        free = [slab for slab in self._slabs if sys.getrefcount(slab) <= 3]  # the list's, this loop's, the call's
        chosen = next((slab for slab in free if len(slab) >= size), None)
        spare = sum(len(slab) >= self._slab_bytes for slab in free) - (chosen is not None)
        del free
        if chosen is None and not self._failed:
            chosen = self._pinned(self._slab_bytes)
            if chosen is not None:
                self._slabs.append(chosen)
        with self._wake:
            self._wanted = max(0, self._ahead - spare)
            self._wake.notify()
        return chosen

    def _pinned(self, nbytes: int) -> np.ndarray | None:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        slab = np.frombuffer(memory, dtype=np.uint8)
        if not self._register(slab.ctypes.data, nbytes):
            logger.warning("the driver did not pin %d MiB of host memory; rows' copies use torch's pinned memory",
                           nbytes >> 20)
            self._failed = True
            return None
        return slab

    def _pin_ahead(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (self._failed or self._wanted <= 0):
                    self._wake.wait()
                if self._closed:
                    return
                self._wanted -= 1
                nbytes = self._slab_bytes
            slab = self._pinned(nbytes)
            with self._wake:
                if slab is not None:
                    self._ready.append(slab)
                del slab  # a reference held here would count as a use
