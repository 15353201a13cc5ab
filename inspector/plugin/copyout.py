"""Moving each forward's captured rows to host memory without stalling the GPU.

A forward's rows sit in static capture buffers that the next forward overwrites, so they must leave
before it runs. On a GPU a decode step's rows are first copied on the device (microseconds) and then
sent to pinned host memory on a side stream, in parallel with the next forward; a large step
(prefill) is copied straight from the buffers on the compute stream, which needs no staging memory
of the buffers' size. Nothing here waits for the GPU: ``Transfer.ready`` says whether the copies
have landed, ``Transfer.wait`` waits for them. The driver's drain converts the landed copies, in
``gather`` (why not a background thread: docs/performance-notes.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def queue(self, tensors: list[torch.Tensor], stage: bool) -> Transfer:
        """``stage``: copy on the device first and send from there on the side stream."""
        if self.stream is None:
            return Transfer([t.clone() for t in tensors])
        compute = torch.cuda.current_stream(self.device)
        if not stage:
            return self._copy_on(compute, tensors)
        staged = [t.clone(memory_format=torch.contiguous_format) for t in tensors]
        self.stream.wait_stream(compute)
        transfer = self._copy_on(self.stream, staged)
        for t in staged:  # the allocator must not hand this memory out again before the copy has read it
            t.record_stream(self.stream)
        return transfer

    @staticmethod
    def _copy_on(stream: torch.cuda.Stream, tensors: list[torch.Tensor]) -> Transfer:
        with torch.cuda.stream(stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for dst, src in zip(host, tensors):
                # A strided source (a stack's first n rows of each hook) would be made contiguous in
                # a temporary as large as itself; its per-hook slices are contiguous: send them one by one.
                for d, s in ((dst, src),) if src.is_contiguous() else zip(dst, src):
                    d.copy_(s, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return Transfer(host, event)
