"""Moving each forward's captured rows to host memory while the next forward runs.

A forward's rows sit in static capture buffers that the next forward overwrites, so on a GPU they are
first copied on the device into a staging arena of the buffers' size (a gigabyte in well under a
millisecond), and sent from there to pinned host memory on a side stream, in parallel with the next
forward: prefill steps as much as decode steps. The arena is reused by the next forward's staging
only once the side stream has read it. Tensors made for this copy alone (a window's gathered rows,
an SAE's features) are sent as they are. Nothing here waits for the GPU: ``Transfer.ready`` says
whether the copies have landed, ``Transfer.wait`` waits for them. ``HostQueue`` keeps the forwards in
flight in step order; the driver's drain takes the landed ones and hands their copies out as they are,
in ``gather`` (why not a background thread: docs/performance-notes.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import torch

from .gather import QueuedForward


@dataclass
class Transfer:
    """Host copies of one forward's tensors, valid once ``ready()``."""

    host: list[torch.Tensor]
    event: torch.cuda.Event | None = None  # None: already complete (CPU device)

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class CopyOut:
    """Queues device-to-host copies of a forward's tensors, right after the forward is queued."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._arena_read: dict[int, torch.cuda.Event] = {}  # arena's address -> the side stream's last read of it

    def arena(self, like: torch.Tensor) -> torch.Tensor | None:
        """Staging memory for a static buffer's rows (None on a CPU, where copies are made at once)."""
        return None if self.stream is None else torch.empty(like.numel(), dtype=like.dtype, device=like.device)

    def queue(self, tensors: list[torch.Tensor], arenas: list[torch.Tensor | None]) -> Transfer:
        """Send ``tensors`` to the host. ``arenas[i]``: where to stage a view of a static buffer (from
        ``arena``), or None for a tensor that nothing writes again (it is sent as it is)."""
        if self.stream is None:
            return Transfer([t.clone() for t in tensors])
        compute = torch.cuda.current_stream(self.device)
        sources = []
        for tensor, arena in zip(tensors, arenas):
            if arena is None:
                sources.append(tensor)
                continue
            read = self._arena_read.get(arena.data_ptr())
            if read is not None:
                compute.wait_event(read)  # the previous forward's rows have left this arena
            sources.append(arena[:tensor.numel()].view(tensor.shape).copy_(tensor))  # contiguous: one copy out
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in sources]
            for dst, src in zip(host, sources):
                dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        for src, arena in zip(sources, arenas):
            if arena is None:  # the allocator must not hand this memory out again before the copy has read it
                src.record_stream(self.stream)
        self._arena_read.update((a.data_ptr(), event) for a in arenas if a is not None)
        return Transfer(host, event)


class HostQueue:
    """The forwards whose rows are on their way to the host, oldest first, each with its transfer."""

    def __init__(self, device: torch.device):
        self.copy_out = CopyOut(device)
        self._pending: list[tuple[QueuedForward, Transfer]] = []

    def send(self, forward: QueuedForward, tensors: list[torch.Tensor], arenas: list[torch.Tensor | None],
             input_ids: torch.Tensor | None, rows: slice | torch.Tensor) -> None:
        """Send a forward's tensors and, when known, its token ids (``rows``: the rows of them it keeps, a
        range or a device index). The engine reuses its input ids' buffer, so they leave as a copy."""
        if input_ids is not None:
            ids = input_ids[rows].clone() if isinstance(rows, slice) else input_ids.index_select(0, rows)
            tensors, arenas = [*tensors, ids], [*arenas, None]
        transfer = self.copy_out.queue(tensors, arenas)
        self._pending.append((forward._replace(host=transfer.host), transfer))

    def take(self, wait: bool | Collection[str] = True) -> list[QueuedForward]:
        """The forwards whose copies have landed, in step order. ``wait``: True waits for all of them,
        False for none (the first still in flight and those after it stay), request ids for the forwards
        holding those requests' rows and those before them. A finishing request's rows are in a forward
        already computed, while the engine (scheduling ahead) has the next one on the GPU: waiting for
        that one too left the GPU idle until the next step was scheduled."""
        if isinstance(wait, bool):
            due = len(self._pending) if wait else 0
        else:
            wanted = set(wait)
            due = max((i + 1 for i, (forward, _) in enumerate(self._pending) if not wanted.isdisjoint(forward.req_ids)),
                      default=0)
        ready = 0
        for i, (_, transfer) in enumerate(self._pending):
            if i < due:
                transfer.wait()
            elif not transfer.ready():
                break
            ready += 1
        taken, self._pending = self._pending[:ready], self._pending[ready:]
        return [forward for forward, _ in taken]

    def positions_after(self, wanted: set[str]) -> dict[str, int]:
        """Per request of ``wanted``, the position after its last row in a forward not taken yet."""
        after: dict[str, int] = {}
        for forward, _ in self._pending:
            bounds = forward.query_start_loc
            for i, rid in enumerate(forward.req_ids):
                if rid in wanted and bounds[i + 1] > bounds[i]:
                    after[rid] = max(after.get(rid, 0), int(forward.positions[bounds[i + 1] - 1]) + 1)
        return after
