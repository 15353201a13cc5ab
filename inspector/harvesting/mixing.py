"""Shuffled training batches from a stream of activation chunks, as SAELens's ``mixing_buffer`` makes
them: rows gather until the buffer holds ``buffer_rows``; then it is shuffled, the part that
``mix_fraction`` says stays (to be mixed with later rows), and the rest leaves in batches. Every hook's
rows are shuffled by one permutation, so a batch's rows of two hooks are the same tokens'.

A buffer's permutation is drawn when it starts, so each chunk's rows go to their shuffled places as the
chunk comes, and the rows kept from the buffer before go a share with each chunk: the work is spread
over the buffer's filling, where shuffling it whole once full held the engine up (its queue of chunks
filled meanwhile). On the CPU a buffer is made in the memory of buffers let go of (their batches gone):
rows scattered into fresh pages moved a quarter of what they moved into pages made before."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Iterator

from inspector.core.reused_memory import ReusedMemory

if TYPE_CHECKING:  # torch is imported when batches are made: the app's process, which parses the
    import torch   # command line (inspector.cli imports this package), must not load it


def mixed_batches(chunks: Iterable[dict[str, torch.Tensor]], batch_size: int, buffer_rows: int,
                  mix_fraction: float = 0.5, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Batches (hook → [batch_size, width]) from chunks (hook → [rows, width]); when the chunks end,
    what is left is shuffled and leaves in full batches (fewer rows than a batch are dropped)."""
    import torch

    check_mixing(batch_size, buffer_rows, mix_fraction)
    generator = torch.Generator().manual_seed(seed)
    memory = ReusedMemory()
    leaving = (buffer_rows - int(buffer_rows * mix_fraction)) // batch_size * batch_size  # a full buffer's
    buffer, kept = None, None
    try:
        for chunk in chunks:
            at, rows = 0, len(next(iter(chunk.values())))
            while at < rows:
                if buffer is None:
                    buffer, kept = _Buffer(chunk, buffer_rows, kept, generator, memory), None
                at += buffer.add(chunk, at)
                if buffer.full:
                    yield from _batches(buffer.rows, leaving, batch_size)
                    kept = {hook: values[leaving:] for hook, values in buffer.rows.items()}
                    buffer = None
        if buffer is None and kept:  # the chunks ended as a buffer did: what it kept is left
            buffer = _Buffer(kept, buffer_rows, kept, generator, memory)
        if buffer is not None:
            left = buffer.left()
            yield from _batches(left, len(next(iter(left.values()))) // batch_size * batch_size, batch_size)
    finally:
        memory.close()  # batches still held keep their memory; nothing comes back here after


def check_mixing(batch_size: int, buffer_rows: int, mix_fraction: float) -> None:
    if batch_size < 1 or buffer_rows < batch_size:
        raise ValueError(f"the mixing buffer ({buffer_rows} rows) must hold at least one batch ({batch_size} rows)")
    if not 0 <= mix_fraction < 1:
        raise ValueError(f"mix fraction must be in [0, 1), got {mix_fraction}")
    if buffer_rows - int(buffer_rows * mix_fraction) < batch_size:
        raise ValueError(f"a mixing buffer of {buffer_rows} rows that keeps {mix_fraction:g} of them lets fewer "
                         f"than a batch ({batch_size} rows) go: make it larger or keep less")


def _batches(rows: dict[str, torch.Tensor], end: int, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    for start in range(0, end, batch_size):
        yield {hook: values[start:start + batch_size] for hook, values in rows.items()}


class _Buffer:
    """One buffer's rows in their shuffled places: those kept from the buffer before first (in the
    joined order), then the chunks'. Joined row i goes to row ``place[i]``."""

    def __init__(self, like: dict[str, torch.Tensor], size: int, kept: dict[str, torch.Tensor] | None,
                 generator: torch.Generator, memory: ReusedMemory):
        import torch

        order = torch.randperm(size, generator=generator)  # shuffled[j] is joined row order[j]
        place = torch.empty_like(order)
        place[order] = torch.arange(size)
        self.place = place.to(next(iter(like.values())).device)
        self.rows = {hook: _empty((size, *v.shape[1:]), v.dtype, v.device, memory) for hook, v in like.items()}
        self.kept, self.kept_placed = kept or {}, 0
        self.kept_rows = len(next(iter(kept.values()))) if kept else 0
        self.filled = self.kept_rows  # joined rows taken (the kept ones count from the start)

    @property
    def full(self) -> bool:
        return self.filled == len(self.place)

    def add(self, chunk: dict[str, torch.Tensor], at: int) -> int:
        """Rows of ``chunk`` from ``at`` put in their places, as many as fit, and the kept rows' share
        that goes with them (all that are left, once full); how many of the chunk's were taken."""
        n = min(len(next(iter(chunk.values()))) - at, len(self.place) - self.filled)
        self._put(chunk, at, self.filled, n)
        self.filled += n
        new_rows = len(self.place) - self.kept_rows
        due = self.kept_rows if self.full else math.ceil(self.kept_rows * (self.filled - self.kept_rows) / new_rows)
        self._place_kept(due)
        return n

    def left(self) -> dict[str, torch.Tensor]:
        """The rows taken so far, shuffled (the chunks ended before the buffer filled): those of the
        places taken, in the places' order."""
        import torch

        self._place_kept(self.kept_rows)
        taken = torch.sort(self.place[:self.filled]).values
        return {hook: values.index_select(0, taken) for hook, values in self.rows.items()}

    def _place_kept(self, due: int) -> None:
        if due > self.kept_placed:
            self._put(self.kept, self.kept_placed, self.kept_placed, due - self.kept_placed)
            self.kept_placed = due
        if self.kept_placed == self.kept_rows:
            self.kept = {}  # the buffer before can go once its batches are gone

    def _put(self, rows: dict[str, torch.Tensor], at: int, joined: int, n: int) -> None:
        for hook, values in rows.items():
            self.rows[hook].index_copy_(0, self.place[joined:joined + n], values[at:at + n])


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, memory: ReusedMemory) -> torch.Tensor:
    import torch

    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.from_numpy(memory.empty(math.prod(shape) * dtype.itemsize)).view(dtype).view(shape)
