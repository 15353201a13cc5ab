"""Shared memory for rows on their way from one process to another: a ring whose regions are taken and
let go of in order, and the copies into it and out of it, split among threads.

The ring is a memfd, not a file in /dev/shm, which containers keep small. Its maker hands it to a child
it spawns (the descriptor goes with the child's arguments), or offers it to another process of the same
user on the same machine, which opens it as ``/proc/PID/fd/N`` (checked against the ring's inode, so a
process of another PID namespace cannot map something else). Its pages are made as they are first
written and reused from then on: a step's rows do not need fresh pages.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import reduction

import numpy as np

COPIERS = min(4, os.cpu_count() or 1)  # threads that copy rows in or out
COPY_PIECE = 4 << 20  # bytes a copier takes at least: one thread copied 6.6 GB/s on an H100's host, four 16 GB/s


MEMORY_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the machine's memory


def ring_bytes(share: int, most: int = 2 << 30) -> int:
    """A ``share``-th of the machine's memory, from 512 MiB to ``most``."""
    return min(most, max(512 << 20, MEMORY_BYTES // share))


def aligned(n: int) -> int:
    return -(-n // 64) * 64


def boot_id() -> str:
    """This machine's boot (two processes that see the same one share a kernel, and so its memfds)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class SharedRing:
    def __init__(self, size: int, fd: int | None = None, populate: bool = False, name: str = "inspector-rows"):
        """``populate``: its pages made now (a ring made ahead of its use), not as rows are first
        copied into them (0.3 s of 512 MiB on the project's CPU: a small capture's time)."""
        self.size, self.populate = size, populate
        self.fd = os.memfd_create(name) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, size)
        self.memory = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0))
        self.array = np.frombuffer(self.memory, dtype=np.uint8)

    def __reduce__(self):  # while spawning a child: the descriptor goes with it
        return SharedRing._attach, (self.size, reduction.DupFd(self.fd), self.populate)

    @staticmethod
    def _attach(size: int, fd, populate: bool) -> "SharedRing":
        return SharedRing(size, fd.detach(), populate)

    def offer(self) -> dict:
        """What another process of this user on this machine needs to map it (``opened``)."""
        return {"pid": os.getpid(), "fd": self.fd, "bytes": self.size, "inode": os.fstat(self.fd).st_ino,
                "boot": boot_id()}

    @classmethod
    def opened(cls, offer: dict) -> "SharedRing":
        """The ring another process offered; OSError or ValueError where it cannot be mapped here."""
        if not (isinstance(offer, dict) and all(isinstance(offer.get(k), int) and offer[k] > 0
                                                for k in ("pid", "fd", "bytes", "inode"))):
            raise ValueError(f"a ring's offer has a pid, fd, bytes and inode, got {offer!r:.200}")
        if not offer.get("boot") or offer.get("boot") != boot_id():
            raise ValueError("the ring is on another machine")
        fd = os.open(f"/proc/{offer['pid']}/fd/{offer['fd']}", os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_ino != offer["inode"] or st.st_size < offer["bytes"]:
                raise ValueError("the offered descriptor is not that ring")
            return cls(offer["bytes"], fd)
        except BaseException:
            os.close(fd)
            raise

    def view(self, offset: int, dtype, shape) -> np.ndarray:
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at {offset} do not lie in a ring of {self.size}")
        return self.array[offset:offset + n].view(dtype).reshape(shape)

    def close(self) -> None:
        self.array = None
        self.memory.close()
        os.close(self.fd)


class Regions:
    """Where the next region of a ring of ``size`` bytes goes; regions are let go of oldest first."""

    def __init__(self, size: int):
        self.size = size
        self._used: deque[tuple[int, int]] = deque()  # (start, size), oldest first
        self._next = 0  # where the next region starts

    def take(self, size: int) -> int | None:
        """A region's start, or None while the regions in use leave no room for it."""
        if not self._used:  # (a region larger than the ring is the caller's error: its view says so)
            start, fits = 0, True
        elif self._used[0][0] < self._next:  # in use: from the oldest region to the newest's end
            start = self._next if self._next + size <= self.size else 0
            fits = start == self._next or size <= self._used[0][0]
        else:  # wrapped: in use from the oldest to the ring's end, and from its start to the newest's end
            start = self._next
            fits = start + size <= self._used[0][0]
        if not fits:
            return None
        self._used.append((start, size))
        self._next = start + size
        return start

    def release_oldest(self) -> None:
        self._used.popleft()

    def __len__(self) -> int:
        return len(self._used)


class Copiers:
    """Copies run side by side, in pieces of ``COPY_PIECE`` bytes at least (a large copy lets the GIL go,
    and handing a smaller one over would cost more than the copy). Pairs that lie end to end on both
    sides are copied as one: each copy takes the GIL back when it ends, which beside a thread running
    Python waits up to the interpreter's switch interval (5 ms). On the project's CPU that took the
    wire beside a busy thread from 0.71 to 1.5 GB/s; an H100 host's server at batch 256 did not change
    (docs/performance-notes.md)."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(COPIERS, thread_name_prefix=name)

    def copy(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Each (destination, source) pair copied; returns once all are. Large copies are split, small
        ones grouped, into pieces of ``COPY_PIECE`` bytes or more; the first, and the last group if
        smaller, are copied here."""
        groups, group, size = [], [], 0
        for piece in (p for pair in joined(pairs) for p in split_copies(*pair)):
            group.append(piece)
            size += piece[1].nbytes
            if size >= COPY_PIECE:
                groups.append(group)
                group, size = [], 0
        running = [self._pool.submit(_copy_all, g) for g in groups[1:]]
        _copy_all(groups[0] + group if groups else group)  # a share here: one thread less to wait for
        for done in running:
            done.result()

    def shutdown(self) -> None:
        self._pool.shutdown()


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dest, source in pairs:
        np.copyto(dest, source)


def joined(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pairs, each run of them whose destinations lie end to end in memory, and whose sources do
    too, as one pair of byte views (a stack's hooks into a ring's region: one copy, not one a hook).
    Only exact neighbours are joined, so the bytes copied are exactly the pairs'."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    run: list[tuple[np.ndarray, np.ndarray]] = []
    for pair in pairs:
        if run and _follows(run[-1], pair):
            run.append(pair)
            continue
        if run:
            out.append(_one(run))
        run = [pair] if _plain(*pair) else []
        if not run:
            out.append(pair)
    if run:
        out.append(_one(run))
    return out


def _plain(dest: np.ndarray, source: np.ndarray) -> bool:
    """A copy of bytes as they are: same type and shape, both contiguous, not empty."""
    return (dest.dtype == source.dtype and dest.shape == source.shape and dest.nbytes > 0
            and dest.flags.c_contiguous and source.flags.c_contiguous)


def _follows(last: tuple[np.ndarray, np.ndarray], pair: tuple[np.ndarray, np.ndarray]) -> bool:
    return _plain(*pair) and all(_address(b) == _address(a) + a.nbytes for a, b in zip(last, pair))


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _one(run: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if len(run) == 1:
        return run[0]
    n = sum(dest.nbytes for dest, _ in run)
    # views from the first pair's arrays over the whole run: its neighbours, alive in ``run``'s caller's pairs
    return tuple(np.lib.stride_tricks.as_strided(a.reshape(-1).view(np.uint8), (n,), (1,)) for a in run[0])


def split_copies(dest: np.ndarray, source: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(destination, source) pieces of one copy along its first axis, a piece a copier at most."""
    k = max(1, min(COPIERS, len(source), source.nbytes // COPY_PIECE))
    return list(zip(np.array_split(dest, k), np.array_split(source, k)))
