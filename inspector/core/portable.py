"""Arrays as plain values (dtype, shape, bytes), for results of vLLM's own RPC (``collective_rpc`` from
the OpenAI server): without insecure serialization it returns results without their types, and a large
numpy array would arrive as an index into buffers the caller never sees."""

from __future__ import annotations

import numpy as np


def to_portable(values: np.ndarray) -> list:
    """bfloat16 goes as float32 (exactly): its numpy dtype has no portable name."""
    values = values.astype(np.float32) if values.dtype.kind == "V" else np.ascontiguousarray(values)
    return [values.dtype.str, list(values.shape), values.tobytes()]


def from_portable(value: list) -> np.ndarray:
    dtype, shape, data = value
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
