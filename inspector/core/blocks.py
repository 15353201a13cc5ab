"""A step's rows in bulk: one array per hook for all its requests, the requests' rows one after another.

A batch-32 decode step of 32 hooks has a thousand (request, hook) pairs; handling each in Python on
the engine's step path held a session to about a third of the engine's speed on the H200
(docs/performance-notes.md). ``RowBlocks`` carries such a step as the engine laid it out, so that
keeping it (``Run``), writing it (``CaptureWriter``) and sending it (the wire) cost a few calls per
hook, and a request's rows are made only where someone reads them (``RequestRowsView``). A step
that drained several forwards (the engine ran ahead) has a ``RowBlocks`` for each, as they landed:
joining them would copy every row on the engine's thread.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator, Mapping

import numpy as np

from .dtypes import BFLOAT16

Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # positions [n], token ids [n], values [n, width]


class RowBlocks:
    """Rows of ``request_ids`` (in that order; request k's are ``bounds[k]:bounds[k + 1]``) for every
    hook of ``values`` (hook -> [n, width]); ``positions`` and ``token_ids`` [n] are shared by the hooks."""

    __slots__ = ("request_ids", "bounds", "positions", "token_ids", "values", "_index")

    def __init__(self, request_ids, bounds, positions, token_ids, values: dict[str, np.ndarray]):
        self.request_ids = tuple(request_ids)
        self.bounds = np.asarray(bounds, dtype=np.int64)
        self.positions, self.token_ids, self.values = positions, token_ids, values
        if len(self.bounds) != len(self.request_ids) + 1 or self.bounds[0] != 0 or np.any(np.diff(self.bounds) < 0):
            raise ValueError(f"{len(self.request_ids)} requests need {len(self.request_ids) + 1} ascending bounds "
                             f"from 0, got {self.bounds.tolist()}")
        n = int(self.bounds[-1])
        if len(positions) != n or len(token_ids) != n or any(len(v) != n or v.ndim != 2 for v in values.values()):
            raise ValueError(f"{n} rows need as many positions, token ids and rows of each hook")
        self._index: dict[str, int] | None = None

    @property
    def rows(self) -> int:
        return int(self.bounds[-1])

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.values.values()) + self.positions.nbytes + self.token_ids.nbytes

    def span(self, request_id: str) -> slice | None:
        """Where the request's rows lie, or None if it has none here."""
        k = self._indexed().get(request_id)
        return None if k is None else slice(int(self.bounds[k]), int(self.bounds[k + 1]))

    def holds(self, request_id: str) -> bool:
        return request_id in self._indexed()

    def positions_reached(self) -> dict[str, int]:
        """Each request with rows here: the position after its last row (one pass, not a lookup a request)."""
        ends = self.bounds[1:]
        has = ends > self.bounds[:-1]
        reached = (self.positions[ends[has] - 1] + 1).tolist()
        return dict(zip(itertools.compress(self.request_ids, has.tolist()), reached))

    def _indexed(self) -> dict[str, int]:
        if self._index is None:
            self._index = {rid: k for k, rid in enumerate(self.request_ids)}
        return self._index

    def rows_of(self, request_id: str, hook: str) -> Rows:
        where = self.span(request_id)
        return self.positions[where], self.token_ids[where], self.values[hook][where]

    def selected(self, request_ids: Mapping[str, str], hooks=None) -> "RowBlocks | None":
        """The rows of ``request_ids`` (own id -> the id to give them) and of ``hooks`` (None: all), in
        this order; views where those requests lie side by side, else one gather a column. None if none
        of them has rows here."""
        chosen = [(k, request_ids[rid]) for k, rid in enumerate(self.request_ids) if rid in request_ids]
        if not chosen:
            return None
        values = self.values if hooks is None else {h: v for h, v in self.values.items() if h in hooks}
        ks = [k for k, _ in chosen]
        lengths = np.diff(self.bounds)[ks]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        if ks == list(range(ks[0], ks[-1] + 1)):
            where = slice(int(self.bounds[ks[0]]), int(self.bounds[ks[-1] + 1]))
        else:
            where = np.concatenate([np.arange(self.bounds[k], self.bounds[k + 1]) for k in ks])
        return RowBlocks([new for _, new in chosen], bounds, self.positions[where], self.token_ids[where],
                         {h: v[where] for h, v in values.items()})

    def pieces(self, max_rows: int) -> "list[RowBlocks]":
        """This step as blocks of at most ``max_rows`` rows, in order (views), each ending where a request's
        rows do if one does within it: a request's rows continue in the next piece only where they
        cannot fit in one (a capture file writes a request's whole chunks from where they lie)."""
        if self.rows <= max_rows:
            return [self]
        out, a = [], 0
        ends = self.bounds[1:]
        while a < self.rows:
            b = min(a + max_rows, self.rows)
            within = ends[(ends > a) & (ends <= b)]
            b = int(within[-1]) if len(within) else b
            bounds = np.clip(self.bounds, a, b) - a
            keep = [k for k in range(len(self.request_ids)) if bounds[k + 1] > bounds[k]]
            out.append(RowBlocks([self.request_ids[k] for k in keep], np.concatenate([[0], bounds[[k + 1 for k in keep]]]),
                                 self.positions[a:b], self.token_ids[a:b], {h: v[a:b] for h, v in self.values.items()}))
            a = b
        return out

    def copied(self) -> "RowBlocks":
        """With arrays of its own (for keeping rows whose memory the engine writes again)."""
        return RowBlocks(self.request_ids, self.bounds, self.positions.copy(), self.token_ids.copy(),
                         {h: v.copy() for h, v in self.values.items()})


class RequestRowsView(Mapping):
    """One request's rows of a step's ``RowBlocks`` (one per forward the step drained): hook ->
    (positions, token_ids, values), views made on read, joined where the request is in several."""

    __slots__ = ("_step_blocks", "_held", "_request_id")

    def __init__(self, blocks: tuple[RowBlocks, ...], request_id: str):
        self._step_blocks, self._held, self._request_id = blocks, None, request_id

    @property
    def blocks(self) -> list[RowBlocks]:
        """Those it has rows in, found when first read: a batch-256 step makes a view a request, and
        its consumers mostly read the step's blocks instead."""
        if self._held is None:
            self._held = [b for b in self._step_blocks if b.holds(self._request_id)]
        return self._held

    def __getitem__(self, hook: str) -> Rows:
        parts = [b.rows_of(self._request_id, hook) for b in self.blocks if hook in b.values]
        if not parts:
            raise KeyError(hook)
        return parts[0] if len(parts) == 1 else tuple(np.concatenate(column) for column in zip(*parts))

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(hook for b in self.blocks for hook in b.values))

    def __len__(self) -> int:
        return len(dict.fromkeys(hook for b in self.blocks for hook in b.values))

    def items(self):
        if len(self.blocks) != 1:
            return [(hook, self[hook]) for hook in self]
        blocks = self.blocks[0]
        where = blocks.span(self._request_id)
        positions, token_ids = blocks.positions[where], blocks.token_ids[where]
        return [(hook, (positions, token_ids, v[where])) for hook, v in blocks.values.items()]


def consecutive(arrays: list[np.ndarray]) -> bool:
    """Slices of one block, each starting where the one before ends. Addresses come through ctypes:
    numpy's own ways (``ctypes.data``, ``__array_interface__``) cost 3-4 times more, and a step at
    batch 32 asks a thousand times."""
    first = arrays[0]
    base, dtype, row = first.base, first.dtype, first.shape[1:]
    if base is None or any(a.base is not base for a in arrays):
        return False
    end = None
    try:
        for a in arrays:
            if a.dtype != dtype or a.shape[1:] != row:
                return False
            start = ctypes.addressof(ctypes.c_char.from_buffer(a if dtype != BFLOAT16 else a.view(np.uint16)))
            if end is not None and start != end:
                return False
            end = start + a.nbytes
    except (TypeError, ValueError, BufferError):  # read-only, not C-contiguous, or empty: no address here
        return False
    return True
