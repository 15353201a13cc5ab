"""An array that grows along its first axis: appends are amortised O(rows) and views are free.

Rows arrive a decode step at a time (one row per request and hook); concatenating on every append
would copy the whole history each step. A view taken earlier (``view()[:n]``) stays valid and
unchanged: later appends write past ``n``, and growing copies into a new block.
"""

from __future__ import annotations

import numpy as np


class GrowableArray:
    def __init__(self, dtype, row_shape: tuple[int, ...] = (), capacity: int = 16,
                 max_capacity: int | None = None):
        """``max_capacity``: never allocate more rows than this at once (a buffer flushed at a fixed
        size has no use for more)."""
        self._n = 0
        self._max = max_capacity
        self._a = np.empty((self._capped(capacity), *row_shape), dtype=dtype)

    def _capped(self, rows: int) -> int:
        return rows if self._max is None else min(rows, self._max)

    def append(self, rows) -> None:
        rows = np.asarray(rows)
        need = self._n + len(rows)
        self._make_room(need)
        self._a[self._n: need] = rows
        self._n = need

    def extend(self, parts: list) -> None:
        """Append several blocks of rows, growing at most once."""
        start = self._n
        self._make_room(start + sum(len(part) for part in parts))
        for part in parts:
            self._a[start: start + len(part)] = part
            start += len(part)
        self._n = start

    def _make_room(self, need: int) -> None:
        if need > len(self._a):
            # x1.5: at most half again as much memory as the rows need
            grown = np.empty((max(need, self._capped(len(self._a) + len(self._a) // 2 + 1)),
                              *self._a.shape[1:]), dtype=self._a.dtype)
            grown[: self._n] = self._a[: self._n]
            self._a = grown

    @property
    def dtype(self) -> np.dtype:
        return self._a.dtype

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self._a.shape[1:]

    def view(self) -> np.ndarray:
        return self._a[: self._n]

    def snapshot(self) -> "GrowableArray":
        """An array holding the rows so far, shared (no copy), that later appends never change."""
        copy = GrowableArray.__new__(GrowableArray)
        copy._n, copy._max, copy._a = self._n, self._max, self.view()  # full: its next append reallocates
        return copy

    def clear(self) -> None:
        """Forget the rows, keep the memory (a buffer that is written out and refilled)."""
        self._n = 0

    def __len__(self) -> int:
        return self._n
