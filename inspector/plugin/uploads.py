"""Host values into the engine's device tensors between forwards, without waiting for the forward in flight.

A copy from pageable host memory waits for the device's stream, which under vLLM's asynchronous
scheduling is still running the previous forward: each such copy would hold the host's next step
back until the device is idle. From pinned memory the copy is queued instead, and torch's pinned pool
keeps the block until the copy has run.
"""

from __future__ import annotations

import numpy as np
import torch


def staged(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` on the host, pinned where ``device`` is a GPU."""
    host = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
    return host.pin_memory() if device.type == "cuda" else host


def upload(target: torch.Tensor, values: np.ndarray | torch.Tensor) -> None:
    """``target.copy_(values)``, queued behind the device's work rather than waiting for it."""
    target.copy_(staged(values, target.device), non_blocking=True)


def to_device(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of ``values`` (an index, say), queued behind the device's work."""
    return staged(values, device).to(device, non_blocking=True)
