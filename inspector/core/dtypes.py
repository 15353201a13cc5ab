"""The dtypes captured rows are kept in: the engine's own, from the device to the file.

numpy has no bfloat16; ``ml_dtypes`` gives it one, so a bf16 engine's rows stay 2 bytes each on the host
(half the memory of float32, and no conversion on the engine's step path). Code that computes with
rows converts them with ``as_float32``; files and the wire name the dtype explicitly, since neither HDF5
nor numpy's own dtype strings know bfloat16 (its ``dtype.str`` is an anonymous ``<V2``).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
ROW_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BFLOAT16}


def is_float_rows(dtype: np.dtype) -> bool:
    """Floating point, bfloat16 included (numpy does not count it among its floating types)."""
    return np.issubdtype(dtype, np.floating) or dtype == BFLOAT16


def as_bits(array: np.ndarray) -> np.ndarray:
    """The same memory as unsigned integers of its item size, for copies that move rows unchanged:
    numpy moves bfloat16 item by item in ``ml_dtypes``' loops, keeping the GIL (a scatter of 256 rows
    of 4,096 ran at 10 GB/s against 36 as integers, a fill with zeros at 7 against 45)."""
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def as_float32(values) -> np.ndarray:
    """Rows as float32 for arithmetic (a view when they already are)."""
    return np.asarray(values, dtype=np.float32)
