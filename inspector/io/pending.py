"""Where a capture file's writer keeps each (request, hook)'s rows until they fill a chunk.

A batch-256 decode step of 32 hooks brings one row to each of 8,192 (request, hook)s: a call for
each to put its row away set the writer's pace. So a hook's chunk buffers are one array, a slot a
request (``ChunkSlab``), and a step's rows of every request land in it with one scatter a hook.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol

import numpy as np

from inspector.core.dtypes import as_bits
from inspector.core.reused_memory import mapped_empty


class Slots:
    """Slot numbers for the requests that have rows buffered: the lowest free first, so that the slabs'
    memory stays where it was touched."""

    def __init__(self):
        self._free: list[int] = []
        self.made = 0

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self.made += 1
        return self.made - 1

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


class Writes(Protocol):
    """Where a slab's full chunks are written from (``LatchingFile``): tickets of writes, done in order."""

    @property
    def written(self) -> int: ...

    def wait_written(self, ticket: int) -> None: ...


class ChunkSlab:
    """A hook's chunk buffers (``chunk_rows`` rows of ``width`` each), a chunk a slot and as many spare:
    a full chunk is written from where it lies (``lend``) while its slot fills a spare. ``fill``: rows
    a slot holds; ``room``: rows its (request, hook) takes before a chunk boundary (a whole chunk unless
    a partial chunk was written early); ``home``: the chunk a slot fills. Its memory is page-aligned:
    a whole chunk goes to the file past the page cache where its size is whole pages."""

    def __init__(self, width: int, dtype: np.dtype, chunk_rows: int, writes: Writes, slots: int = 0):
        """``slots``: room made at once (growing copies what the slots hold)."""
        self.chunk_rows, self.writes = chunk_rows, writes
        self.array = mapped_empty((0, width), dtype)
        self.fill = np.zeros(0, np.int64)
        self.room = np.zeros(0, np.int64)
        self.home = np.zeros(0, np.int64)
        self._spare: list[int] = []  # chunks no slot fills and no write reads
        self._lent: deque[tuple[int, int]] = deque()  # (ticket, chunk) of chunks being written, oldest first
        self.reach(slots)

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def reach(self, slots: int) -> None:
        """Room for slot numbers below ``slots``; grows by half again at least (the memory beyond the
        chunks in use is never touched; chunks being written keep the old array until they are)."""
        have = len(self.fill)
        if slots <= have:
            return
        slots = max(slots, have + have // 2, 16)
        grown = mapped_empty((2 * slots * self.chunk_rows, self.array.shape[1]), self.array.dtype)
        held = np.flatnonzero(self.fill)  # copied alone: the rest of the memory stays untouched
        shape = (self.chunk_rows, self.array.shape[1])
        as_bits(grown).reshape(2 * slots, *shape)[held] = as_bits(self.array).reshape(-1, *shape)[self.home[held]]
        self.array = grown
        self.fill, self.room = (np.concatenate([a, np.zeros(slots - have, np.int64)]) for a in (self.fill, self.room))
        self.home = np.arange(slots, dtype=np.int64)
        self._spare, self._lent = list(range(slots, 2 * slots)), deque()

    def scatter(self, slots: np.ndarray, counts: np.ndarray, starts: np.ndarray, values: np.ndarray) -> None:
        """Rows ``starts[i]:starts[i] + counts[i]`` of ``values`` after what slot ``slots[i]`` holds (the
        spans ascending and apart; no slot may pass its room)."""
        fill = self.fill[slots]
        first = self.home[slots] * self.chunk_rows + fill
        total = int(counts.sum())
        if total == len(counts):  # a row each (a decode step)
            dest, source = first, starts
        else:
            within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            dest, source = np.repeat(first, counts) + within, np.repeat(starts, counts) + within
        values = as_bits(values)
        as_bits(self.array)[dest] = values if total == len(values) else values[source]  # all its rows: in order
        self.fill[slots] = fill + counts

    def lend(self, slot: int, ticket: int) -> None:
        """The slot's chunk is being written (done at ``ticket``): the slot starts an empty spare."""
        self._lent.append((ticket, int(self.home[slot])))
        while self._lent and self._lent[0][0] <= self.writes.written:
            heapq.heappush(self._spare, self._lent.popleft()[1])
        if not self._spare:  # as many chunks as slots are being written: wait for the oldest
            ticket, chunk = self._lent.popleft()
            self.writes.wait_written(ticket)
            heapq.heappush(self._spare, chunk)
        self.home[slot] = heapq.heappop(self._spare)  # the lowest: the memory touched stays compact
        self.fill[slot] = 0


class SlotRows:
    """A (request, hook)'s chunk buffer in its hook's slab, with ``GrowableArray``'s calls."""

    __slots__ = ("slab", "slot")

    def __init__(self, slab: ChunkSlab, slot: int, room: int):
        slab.reach(slot + 1)
        self.slab, self.slot = slab, slot
        slab.fill[slot], slab.room[slot] = 0, room

    def __len__(self) -> int:
        return int(self.slab.fill[self.slot])

    @property
    def dtype(self) -> np.dtype:
        return self.slab.dtype

    def set_room(self, rows: int) -> None:
        self.slab.room[self.slot] = rows

    def view(self) -> np.ndarray:
        start = int(self.slab.home[self.slot]) * self.slab.chunk_rows
        return self.slab.array[start: start + len(self)]

    def extend(self, parts: list) -> None:
        start = int(self.slab.home[self.slot]) * self.slab.chunk_rows
        at = start + len(self)
        for part in parts:
            as_bits(self.slab.array)[at: at + len(part)] = as_bits(part)
            at += len(part)
        self.slab.fill[self.slot] = at - start

    def append(self, rows) -> None:
        self.extend([rows])

    def padded(self) -> np.ndarray:
        """Its whole chunk: the rows it holds, then zeros."""
        start = int(self.slab.home[self.slot]) * self.slab.chunk_rows
        chunk = self.slab.array[start: start + self.slab.chunk_rows]
        as_bits(chunk)[len(self):] = 0
        return chunk

    def clear(self) -> None:
        self.slab.fill[self.slot] = 0

    def lend(self, ticket: int) -> None:
        """What it holds is being written (done at ``ticket``): it starts again, empty, elsewhere."""
        self.slab.lend(self.slot, ticket)
