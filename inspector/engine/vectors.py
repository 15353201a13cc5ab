"""Per-feature vectors for interventions, from .npy files."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def load_vector(path: str | Path, width: int | None = None) -> tuple[float, ...]:
    """A 1-D finite float vector from ``path``; ValueError with the reason otherwise."""
    try:
        arr = np.load(Path(path), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a vector from {path}: {e}") from None
    arr = np.squeeze(arr)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"{path} holds an array of shape {arr.shape} ({arr.dtype}); a 1-D numeric vector is needed")
    if width is not None and arr.shape[0] != width:
        raise ValueError(f"{path} holds {arr.shape[0]} values; the hook point is {width} wide")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{path} holds NaN or Inf")
    return tuple(float(x) for x in arr)
