"""Per-feature vectors for interventions: checked once, the same way for files, the app and the engine."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def check_vector(values, width: int | None, what: str = "vector") -> np.ndarray:
    """A finite 1-D float64 vector (a [1, n] or [n, 1] array counts as one), ``width`` long if given;
    ValueError with the reason otherwise."""
    arr = np.asarray(values)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"{what} must hold numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    if arr.ndim == 2 and 1 in arr.shape:
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D vector, got shape {arr.shape}")
    if width is not None and arr.shape[0] != width:
        raise ValueError(f"{what} has {arr.shape[0]} values but the hook point is {width} wide")
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(f"{what} holds {int(bad.sum())} NaN/Inf value(s) (first at index {int(np.argmax(bad))})")
    huge = np.abs(arr) > FLOAT32_MAX
    if huge.any():  # an engine's tables would hold them as Inf
        raise ValueError(f"{what} holds {int(huge.sum())} value(s) beyond float32's range ±{FLOAT32_MAX:.4g} "
                         f"(first at index {int(np.argmax(huge))})")
    return arr


FLOAT32_MAX = float(np.finfo(np.float32).max)


def load_vector(path: str | Path, width: int | None = None, what: str = "vector") -> np.ndarray:
    """A vector from a .npy file (or an .npz holding one array); ValueError naming the file otherwise."""
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise ValueError(f"cannot read a vector from {path}: {e}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            keys = list(data.keys())
            if len(keys) != 1:
                raise ValueError(f"{path.name} holds {len(keys)} arrays; expected exactly one")
            data = data[keys[0]]
    return check_vector(data, width, f"{what} in {path.name}")
