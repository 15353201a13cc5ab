"""Moving each forward's captured rows to host memory without stalling the GPU or the engine.

A forward's rows sit in static capture buffers that the next forward overwrites, so they must leave
before it runs. On a GPU a decode step's rows are first copied on the device (microseconds) and then
sent to pinned host memory on a side stream, in parallel with the next forward; a large step
(prefill) is copied straight from the buffers on the compute stream, which needs no staging memory
of the buffers' size. A converter thread then turns the pinned copies into numpy arrays (torch
releases the GIL while it converts), so the engine's thread only collects finished arrays.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch


class Transfer:
    """Host copies of one forward's tensors, as numpy arrays once ``ready()``."""

    def __init__(self, host: list[torch.Tensor], event: torch.cuda.Event | None = None):
        self._host = host
        self._event = event  # None: the copies are complete (CPU device)
        self._arrays: list[np.ndarray] | None = None
        self._error: BaseException | None = None
        self._converted = threading.Event()
        if event is None:
            self.convert()

    def convert(self) -> None:
        """Wait for the copies, then make arrays that own their memory (the pinned buffers go back to
        torch's host cache for later steps); bfloat16 becomes float32, since numpy has no bfloat16."""
        try:
            if self._event is not None:
                self._event.synchronize()
            self._arrays = [_owned_array(t) for t in self._host]
        except BaseException as e:  # handed to the thread that asks for the arrays
            self._error = e
        self._host = []
        self._converted.set()

    def ready(self) -> bool:
        return self._converted.is_set()

    def arrays(self) -> list[np.ndarray]:
        """The arrays, waiting for them if need be."""
        self._converted.wait()
        if self._error is not None:
            raise RuntimeError(f"copying captured rows to the host failed: {self._error}") from self._error
        return self._arrays


class Converter:
    """A daemon thread that converts transfers in the order they were queued."""

    def __init__(self):
        self._queue: queue.SimpleQueue[Transfer] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="inspector-copyout", daemon=True).start()

    def submit(self, transfer: Transfer) -> None:
        self._queue.put(transfer)

    def _run(self) -> None:
        while True:
            self._queue.get().convert()


class CopyOut:
    """Queues device-to-host copies of a forward's tensors, right after the forward is queued."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._converter = Converter() if self.stream is not None else None

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

    def _copy_on(self, stream: torch.cuda.Stream, tensors: list[torch.Tensor]) -> Transfer:
        with torch.cuda.stream(stream):
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for dst, src in zip(host, tensors):
                # A strided source (a stack's first n rows of each hook) would be made contiguous in
                # a temporary as large as itself; its per-hook slices are contiguous: send them one by one.
                for d, s in ((dst, src),) if src.is_contiguous() else zip(dst, src):
                    d.copy_(s, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the converter thread sleeps, not spins, on it
            event.record(stream)
        transfer = Transfer(host, event)
        self._converter.submit(transfer)
        return transfer


def _owned_array(t: torch.Tensor) -> np.ndarray:
    dtype = torch.float32 if t.dtype == torch.bfloat16 else t.dtype
    return t.to(dtype, copy=t.is_pinned()).numpy()
