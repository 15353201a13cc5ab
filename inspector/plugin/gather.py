"""Turning drained forwards into rows per request and hook, with a few large copies.

Each forward's host copy holds, per stack of same-width hooks, ``[hooks, rows, width]`` for the
whole batch, in the engine's dtype (bfloat16 as ``ml_dtypes``' numpy bfloat16: no conversion on the
step path). A drain of one forward hands that copy out as it is (its rows are in request order);
several forwards are joined per stack into one array of our own in request order, one strided copy per
forward when its rows land evenly spaced (always, for decode steps). Each request then gets a
``RequestRows``, whose hooks' rows are views made when read. The number of copies must not grow with
the batch: every copy costs a wake-up of the host's threads; nor the Python objects made on the engine's
step path (measurements: docs/performance-notes.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, MutableMapping
from typing import NamedTuple

import numpy as np
import torch

from inspector.capture.dtypes import BFLOAT16

Rows = dict[str, np.ndarray]  # positions, token_ids, values


class QueuedForward(NamedTuple):
    """A forward whose rows are on their way to the host, not yet drained: its batch layout and its
    host copies (read once the transfer has landed), the stacks, then the token ids if it had them."""

    req_ids: list[str]
    query_start_loc: np.ndarray
    positions: np.ndarray
    stack_names: list[list[str | None]]
    host: list[torch.Tensor]


class RequestRows(MutableMapping):
    """One request's rows of a drain: hook → rows (positions, token_ids, values), each made when it is
    read. A drain hands out one of these per request, not a mapping per request and hook: at batch 32
    with 32 hooks those were a thousand Python objects on the engine's step path every step. Rows set
    here (scores, another rank's) are kept as they are."""

    __slots__ = ("_index", "_span", "_where", "_ids", "_set")

    def __init__(self, index: dict[str, tuple[np.ndarray, int]], span: slice, where: np.ndarray, ids: np.ndarray):
        self._index = index  # hook → (its stack, its place in it); shared by the requests of a drain
        self._span, self._where, self._ids = span, where, ids
        self._set: dict[str, Rows] = {}

    def __getitem__(self, hook: str) -> Rows:
        if hook in self._set:
            return self._set[hook]
        stack, h = self._index[hook]
        return {"positions": self._where, "token_ids": self._ids, "values": stack[h, self._span]}

    def __contains__(self, hook) -> bool:
        return hook in self._set or hook in self._index

    def __iter__(self) -> Iterator[str]:
        yield from self._index
        yield from (hook for hook in self._set if hook not in self._index)

    def __len__(self) -> int:
        return len(self._index) + sum(hook not in self._index for hook in self._set)

    def items(self) -> list[tuple[str, Rows]]:  # every row read at once (the session's way): no lookup per hook
        where, ids, span, made = self._where, self._ids, self._span, self._set
        return [*((hook, made[hook] if hook in made else {"positions": where, "token_ids": ids, "values": stack[h, span]})
                  for hook, (stack, h) in self._index.items()),
                *((hook, rows) for hook, rows in made.items() if hook not in self._index)]

    def __setitem__(self, hook: str, rows: Rows) -> None:
        self._set[hook] = rows

    def __delitem__(self, hook: str) -> None:
        if hook in self._index:
            self._set = {name: self[name] for name in self if name != hook}
            self._index = {}
        else:
            del self._set[hook]


def rows_by_request(forwards: list[QueuedForward]) -> dict[str, MutableMapping[str, Rows]]:
    """request id → hook → rows, over ``forwards`` in order. Forwards with the same hooks are gathered
    together; a hook set changed between them (eager mode) splits them, and a hook then covers only
    the forwards it was installed for."""
    out: dict[str, MutableMapping[str, Rows]] = {}
    for _, group in itertools.groupby(forwards, key=lambda f: f.stack_names):
        for rid, hooks in _gather(list(group)).items():
            merged = out.get(rid)
            if merged is None:
                out[rid] = hooks
                continue
            for name, rows in hooks.items():
                merged[name] = rows if name not in merged else {
                    key: np.concatenate([merged[name][key], rows[key]]) for key in rows}
    return out


def _gather(forwards: list[QueuedForward]) -> dict[str, RequestRows]:
    stack_names = forwards[0].stack_names
    offsets = np.cumsum([0] + [len(f.positions) for f in forwards])
    spans: dict[str, list[np.ndarray]] = {}  # request → its rows in the forwards joined, in order
    for offset, f in zip(offsets, forwards):
        bounds = f.query_start_loc.tolist()
        for rid, a, b in zip(f.req_ids, bounds, bounds[1:]):
            if a != b:
                spans.setdefault(rid, []).append(np.arange(offset + a, offset + b))
    if not spans:
        return {}
    order = np.concatenate([rows for parts in spans.values() for rows in parts])  # request order
    dest = np.empty(offsets[-1], dtype=np.int64)  # where each joined row goes
    dest[order] = np.arange(len(order))
    dest_rows = [dest[a:b] for a, b in zip(offsets, offsets[1:])]
    positions = np.concatenate([f.positions for f in forwards])[order]
    tokens = np.concatenate([_token_ids(f) for f in forwards])[order].astype(np.int64, copy=False)
    values = [_ordered_values([f.host[k] for f in forwards], dest_rows) for k in range(len(stack_names))]
    index = {name: (stack, h) for names, stack in zip(stack_names, values) for h, name in enumerate(names)
             if name is not None}
    out, start = {}, 0
    for rid, parts in spans.items():
        end = start + sum(len(p) for p in parts)
        out[rid] = RequestRows(index, slice(start, end), positions[start:end], tokens[start:end])
        start = end
    return out


def _token_ids(f: QueuedForward) -> np.ndarray:
    if len(f.host) > len(f.stack_names):
        return f.host[-1].numpy()
    return np.full(len(f.positions), -1, dtype=np.int64)


def _ordered_values(pieces: list[torch.Tensor], dest_rows: list[np.ndarray]) -> np.ndarray:
    """``[hooks, rows, width]`` pieces in one array, piece i's rows at ``dest_rows[i]``. One piece already
    in order (a drain of one forward: most drains, and every large one) is handed out as it landed, with
    no host copy; its pinned block goes back to torch's host allocator once nothing refers to it."""
    first = pieces[0]
    if len(pieces) == 1 and (len(dest_rows[0]) < 2 or (np.diff(dest_rows[0]) == 1).all()):
        return _numpy(first)
    out = torch.empty((first.shape[0], sum(len(d) for d in dest_rows), first.shape[2]), dtype=first.dtype)
    for piece, dest in zip(pieces, dest_rows):
        step = int(dest[1] - dest[0]) if len(dest) > 1 else 1
        if len(dest) and step > 0 and (np.diff(dest) == step).all():
            out[:, dest[0]:dest[-1] + 1:step].copy_(piece)
        elif len(dest):
            out.index_copy_(1, torch.from_numpy(dest), piece)
    return _numpy(out)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A view; numpy's bfloat16 is ``ml_dtypes``', which torch does not know: the bits are viewed as it."""
    return t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()


def merge_ranks(per_rank: list[dict[str, dict[str, Rows]]], sharded: set[str]) -> dict[str, dict[str, Rows]]:
    """One drain of every tensor-parallel rank as one drain: a ``sharded`` hook's column slices side by
    side in rank order (each slice comes from one rank), every other hook as the one rank that sends it."""
    merged = per_rank[0]
    for rows_of_rank in per_rank[1:]:
        for rid, hooks in rows_of_rank.items():
            mine = merged.setdefault(rid, {})
            for hook, rows in hooks.items():
                if hook not in mine:
                    mine[hook] = rows
                    continue
                if hook not in sharded or not np.array_equal(mine[hook]["positions"], rows["positions"]):
                    raise RuntimeError(f"request {rid}, hook {hook}: the tensor-parallel ranks sent different rows")
                mine[hook] = {**mine[hook], "values": np.concatenate([mine[hook]["values"], rows["values"]], axis=1)}
    return merged
