"""Write-through runs: rows go to a capture file as they arrive and are read back on demand.

A long run does not fit in memory (100,000 tokens × 32 hooks × 4,096 bf16 is 26 GB). A spooled run's
hook rows keep only their positions and token ids in memory (16 bytes a row); their values go straight
to a ``CaptureWriter`` and every read (a heatmap's visible window, a chunk of norms, an export) comes
back from the file, or from the writer's last, unwritten chunk. The file is scratch space: it is
removed when the spool closes (exporting writes a capture file of its own).
"""

from __future__ import annotations

import datetime as _dt
import os
import secrets
import threading
from pathlib import Path

import numpy as np

from inspector.core.arrays import GrowableArray
from inspector.core.hooks import HookPoint
from inspector.core.run import HookRows, RequestCapture

from .writer import CaptureWriter


class RowSpool:
    """One write-through run's file. Safe to read from one thread while another appends."""

    def __init__(self, directory: str | os.PathLike, metadata: dict):
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.path = directory / f"spool-{stamp}-{secrets.token_hex(3)}.h5"
        self._writer = CaptureWriter(self.path, metadata, {}, fsync=False)
        self._lock = threading.Lock()
        self._hooks: set[str] = set()
        self._requests: set[str] = set()

    def rows(self, req: RequestCapture, hook: HookPoint, dtype) -> "SpooledHookRows":
        """Empty rows of ``hook`` for ``req`` whose values go to this spool (``fold_event``'s ``new_rows``)."""
        with self._lock:
            if hook.name not in self._hooks:
                self._writer.add_hook(hook.name, hook)
                self._hooks.add(hook.name)
            if req.request_id not in self._requests:
                self._writer.add_request(req)
                self._requests.add(req.request_id)
        return SpooledHookRows(self, req.request_id, hook.name, hook.width, np.dtype(dtype))

    def append(self, request_id: str, hook: str, positions, token_ids, values) -> None:
        with self._lock:
            self._writer.append_rows(request_id, hook, positions, token_ids, values)

    def read(self, request_id: str, hook: str, rows: slice, columns: slice) -> np.ndarray:
        with self._lock:
            return self._writer.read_values(request_id, hook, rows, columns)

    def close(self) -> None:
        """Remove the file (rows read from it afterwards raise CaptureFileError)."""
        with self._lock:
            self._writer.abort()


class SpooledValues:
    """The values of spooled rows, ``[rows, width]`` as of when they were asked for: slicing reads them."""

    def __init__(self, spool: RowSpool, request_id: str, hook: str, rows: int, width: int, dtype: np.dtype):
        self._spool, self._request_id, self._hook = spool, request_id, hook
        self.shape, self.dtype = (rows, width), dtype

    ndim = 2
    size = property(lambda self: self.shape[0] * self.shape[1])
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        rows, columns = key if isinstance(key, tuple) else (key, slice(None))
        if isinstance(rows, (int, np.integer)):
            row = range(self.shape[0])[rows]
            return self[row:row + 1, columns][0]
        if isinstance(columns, (int, np.integer)):  # one column: read only its chunks
            column = range(self.shape[1])[columns]
            return self[rows, column:column + 1][:, 0]
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            return self.read()[rows, columns]  # fancy indexing: whole reads are for small runs
        start, stop, _ = rows.indices(self.shape[0])
        if stop <= start:
            return np.empty((0, self.shape[1]), self.dtype)[:, columns]
        return self._spool.read(self._request_id, self._hook, slice(start, stop), columns)

    def read(self) -> np.ndarray:
        return self[:, :]

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype, copy=False)


class SpooledHookRows(HookRows):
    """Rows of one hook for one request whose values live in a ``RowSpool``."""

    def __init__(self, spool: RowSpool, request_id: str, hook: str, width: int, dtype: np.dtype):
        self.width, self._dtype = width, dtype
        self._spool, self._request_id, self._hook = spool, request_id, hook
        self._positions, self._token_ids = GrowableArray(np.int64), GrowableArray(np.int64)
        self._kept, self._rows = [], 0  # nothing is held back: every row goes to the file at once

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def append(self, positions, token_ids, values) -> None:
        values = self._checked(positions, token_ids, values)
        self._spool.append(self._request_id, self._hook, positions, token_ids, values.astype(self._dtype, copy=False))
        self._positions.append(positions)
        self._token_ids.append(token_ids)
        self._rows += len(values)

    keep = append

    def snapshot(self) -> "SpooledHookRows":
        copy = SpooledHookRows(self._spool, self._request_id, self._hook, self.width, self._dtype)
        copy._positions, copy._token_ids = self._positions.snapshot(), self._token_ids.snapshot()
        copy._rows = len(copy._positions)
        return copy

    @property
    def values(self) -> SpooledValues:
        return SpooledValues(self._spool, self._request_id, self._hook, len(self), self.width, self._dtype)
