"""Shuffled training batches from a stream of activation chunks, as SAELens's ``mixing_buffer`` makes
them: rows gather until the buffer holds ``buffer_rows``; then it is shuffled, the part that
``mix_fraction`` says stays (to be mixed with later rows), and the rest leaves in batches. Every hook's
rows are shuffled by one permutation, so a batch's rows of two hooks are the same tokens'. On the CPU a
buffer is made in the memory of buffers let go of (their batches gone): rows scattered into fresh pages
moved a quarter of what they moved into pages made before."""

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
    held: list[dict[str, torch.Tensor]] = []
    rows = 0
    try:
        for chunk in chunks:
            held.append(chunk)
            rows += len(next(iter(chunk.values())))
            if rows >= buffer_rows:
                buffer = _shuffled(held, generator, memory)
                keep = int(buffer_rows * mix_fraction)
                leaving = (rows - keep) // batch_size * batch_size
                for start in range(0, leaving, batch_size):
                    yield {hook: values[start:start + batch_size] for hook, values in buffer.items()}
                held, rows = [{hook: values[leaving:] for hook, values in buffer.items()}], rows - leaving
        if held and rows >= batch_size:
            buffer = _shuffled(held, generator, memory)
            for start in range(0, rows // batch_size * batch_size, batch_size):
                yield {hook: values[start:start + batch_size] for hook, values in buffer.items()}
    finally:
        memory.close()  # batches still held keep their memory; nothing comes back here after


def check_mixing(batch_size: int, buffer_rows: int, mix_fraction: float) -> None:
    if batch_size < 1 or buffer_rows < batch_size:
        raise ValueError(f"the mixing buffer ({buffer_rows} rows) must hold at least one batch ({batch_size} rows)")
    if not 0 <= mix_fraction < 1:
        raise ValueError(f"mix fraction must be in [0, 1), got {mix_fraction}")


def _shuffled(chunks: list[dict[str, torch.Tensor]], generator: torch.Generator,
              memory: ReusedMemory) -> dict[str, torch.Tensor]:
    """The chunks' rows in one random order, every hook alike. Each chunk's rows go straight to their
    places in the shuffled buffer: one copy a row, where joining the chunks and then gathering took two
    (docs/performance-notes.md)."""
    import torch

    rows = [len(next(iter(chunk.values()))) for chunk in chunks]
    order = torch.randperm(sum(rows), generator=generator)  # shuffled[j] is joined row order[j]
    place = torch.empty_like(order)
    place[order] = torch.arange(len(order))  # so joined row i goes to shuffled row place[i]
    first = chunks[0]
    place = place.to(next(iter(first.values())).device)
    shuffled = {hook: _empty((len(order), *v.shape[1:]), v.dtype, v.device, memory) for hook, v in first.items()}
    at = 0
    for chunk, n in zip(chunks, rows):
        for hook, values in chunk.items():
            shuffled[hook].index_copy_(0, place[at:at + n], values)
        at += n
    return shuffled


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, memory: ReusedMemory) -> torch.Tensor:
    import torch

    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.from_numpy(memory.empty(math.prod(shape) * dtype.itemsize)).view(dtype).view(shape)
