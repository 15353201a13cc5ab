"""Turning drained forwards into rows per request and hook, without copying them.

Each forward's host copy holds, per stack of same-width hooks, ``[hooks, rows, width]`` for the
whole batch, in the engine's dtype (bfloat16 as ``ml_dtypes``' numpy bfloat16: no conversion on the
step path), each request's rows one contiguous span of it. A drain hands each request a
``RequestRows``: its spans in the forwards drained, whose hooks' rows are made when read (views of
the landed copy; a request spanning several forwards gets its rows joined then). So a drain makes
no host copy and a few Python objects per request, whatever the number of hooks: a drain runs on the
engine's step path, and rows joined there were a host copy of every backlogged forward
(measurements: docs/performance-notes.md). Where the requests' rows lie one after another,
``bulk_of`` hands the drain out as one block per hook (``RowBlocks``). A landed copy's pinned block
goes back to torch's host allocator once nothing refers to it: rows kept are kept as they are, and the
allocator's cache reuses their blocks once they are let go (a new run reuses the last one's). An
attached SAE's features travel in a forward's copy as a stack of their own (``SaeStack``) and leave
the drain beside the rows, in a ``DrainedRequest``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, MutableMapping
from typing import NamedTuple

import numpy as np
import torch

from inspector.core.blocks import RowBlocks
from inspector.core.drained import DrainedRequest, Features, Scores
from inspector.core.dtypes import BFLOAT16

Rows = dict[str, np.ndarray]  # positions, token_ids, values


class SaeStack(NamedTuple):
    """In a forward's ``stack_names``, in place of a stack's hook names: an attached SAE's strongest
    features of its hook's rows, [2, rows, k] (activations, then ids as floats)."""

    sae: str


class QueuedForward(NamedTuple):
    """A forward whose rows are on their way to the host, not yet drained: its batch layout and its
    host copies (read once the transfer has landed), the stacks, then the token ids if it had them."""

    req_ids: list[str]
    query_start_loc: np.ndarray
    positions: np.ndarray
    stack_names: list[list[str | None] | SaeStack]
    host: list[torch.Tensor]


class Span(NamedTuple):
    """A request's rows in one drained forward: its hooks (hook → their stack, place in it), where."""

    index: dict[str, tuple[np.ndarray, int]]  # shared by the forward's requests
    rows: slice
    positions: np.ndarray
    token_ids: np.ndarray


class RequestRows(MutableMapping):
    """One request's rows of a drain: hook → rows (positions, token_ids, values), each made when it is
    read. Rows set here (another rank's) are kept as they are."""

    __slots__ = ("_spans", "_set", "_join", "__weakref__")

    def __init__(self, spans: list[Span]):
        self._spans = spans  # in forward order
        self._set: dict[str, Rows] = {}
        self._join: DrainJoin | None = None  # set where the drain's forwards can be joined when read

    def _joined(self) -> None:
        if self._join is not None and len(self._spans) > 1:
            self._join()

    def __getstate__(self):
        self._joined()
        return self._spans, self._set

    def __setstate__(self, state) -> None:
        self._spans, self._set = state
        self._join = None  # unpickled: arrays of their own

    def __getitem__(self, hook: str) -> Rows:
        if hook in self._set:
            return self._set[hook]
        self._joined()
        spans = [span for span in self._spans if hook in span.index]
        if not spans:
            raise KeyError(hook)
        if len(spans) == 1:
            return _rows(spans[0], hook)
        parts = [_rows(span, hook) for span in spans]  # a hook added since (eager) covers its own forwards only
        return {key: np.concatenate([part[key] for part in parts]) for key in ("positions", "token_ids", "values")}

    def __contains__(self, hook) -> bool:
        return hook in self._set or any(hook in span.index for span in self._spans)

    def _hooks(self):
        if len(self._spans) == 1:
            return self._spans[0].index.keys()
        return dict.fromkeys(hook for span in self._spans for hook in span.index).keys()

    def __iter__(self) -> Iterator[str]:
        hooks = self._hooks()
        yield from hooks
        yield from (hook for hook in self._set if hook not in hooks)

    def __len__(self) -> int:
        hooks = self._hooks()
        return len(hooks) + sum(hook not in hooks for hook in self._set)

    def items(self) -> list[tuple[str, Rows]]:
        """Every hook's rows at once, the session's way: no lookup per hook, and ``_rows`` inlined (a
        call per hook cost a batch-32 step of 32 hooks 0.08 ms more here)."""
        self._joined()
        if len(self._spans) != 1:
            return [(hook, self[hook]) for hook in self]
        (index, rows, where, ids), made = self._spans[0], self._set
        return [*((hook, made[hook] if hook in made else {"positions": where, "token_ids": ids, "values": stack[h, rows]})
                  for hook, (stack, h) in index.items()),
                *((hook, r) for hook, r in made.items() if hook not in index)]

    def __setitem__(self, hook: str, rows: Rows) -> None:
        self._set[hook] = rows

    def __delitem__(self, hook: str) -> None:
        if hook not in self:
            raise KeyError(hook)
        self._set = {name: self[name] for name in self if name != hook}
        self._spans = []


def bulk_of(drained: dict[str, DrainedRequest]) -> tuple[RowBlocks, ...] | None:
    """A drain's rows in bulk, one ``RowBlocks`` a forward drained (views of its landed copy, no
    copy), where each forward's requests lie one after another; None where they do not (a capture
    window's rows, a request that wants none between others, ranks merged by hook)."""
    rows, request_ids = [], []
    for rid, request in drained.items():
        r = request.rows
        if type(r) is RequestRows and r._spans:
            if r._set:  # another rank's rows, set by hook
                return None
            rows.append(r)
            request_ids.append(rid)
        elif r:
            return None
    if not rows:
        return None
    order = [span.index for span in max((r._spans for r in rows), key=len)]  # the forwards, as they ran
    place = {id(index): k for k, index in enumerate(order)}
    members: list[list[tuple[Span, str]]] = [[] for _ in order]
    for rid, r in zip(request_ids, rows):
        last = -1
        for span in r._spans:
            k = place.get(id(span.index), -1)
            if k <= last:  # a forward the longest request was not in, or out of order
                return None
            members[k].append((span, rid))
            last = k
    blocks = []
    for index, spans in zip(order, members):
        spans.sort(key=lambda member: member[0].rows.start)
        if any(a.rows.stop != b.rows.start for (a, _), (b, _) in zip(spans, spans[1:])):
            return None
        where = slice(spans[0][0].rows.start, spans[-1][0].rows.stop)
        bounds = np.concatenate([[0], np.cumsum([s.rows.stop - s.rows.start for s, _ in spans])])
        blocks.append(RowBlocks([rid for _, rid in spans], bounds, np.concatenate([s.positions for s, _ in spans]),
                                np.concatenate([s.token_ids for s, _ in spans]),
                                {hook: stack[h, where] for hook, (stack, h) in index.items()}))
    return tuple(blocks)


def _rows(span: Span, hook: str) -> Rows:
    stack, h = span.index[hook]
    return {"positions": span.positions, "token_ids": span.token_ids, "values": stack[h, span.rows]}


def drained_requests(forwards: list[QueuedForward], scores: dict[str, Scores], no_rows: set[str]
                     ) -> dict[str, DrainedRequest]:
    """request id → its rows, features and scores, over ``forwards`` in order; requests in ``no_rows``
    keep their features and scores, not their rows."""
    forwards, features = split_features(forwards)
    rows = rows_by_request(forwards)
    drained = {}
    for rid in dict.fromkeys([*rows, *scores]):  # a request with features has spans in the forwards: it is in rows
        found = features.get(rid, {})
        if rid not in no_rows:
            drained[rid] = DrainedRequest(rows.get(rid, {}), found, scores.get(rid))
        elif found or rid in scores:
            drained[rid] = DrainedRequest({}, found, scores.get(rid))
    return drained


def split_features(forwards: list[QueuedForward]) -> tuple[list[QueuedForward], dict[str, dict[str, Features]]]:
    """The forwards without their SAE stacks, and each request's features from them: SAE name →
    positions, ids (int32), activations, over the forwards in order."""
    parts: dict[str, dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]]] = {}
    stripped = []
    for f in forwards:
        saes = [k for k, names in enumerate(f.stack_names) if isinstance(names, SaeStack)]
        if not saes:
            stripped.append(f)
            continue
        bounds = f.query_start_loc.tolist()
        for k in saes:
            stack = _numpy(f.host[k])
            for rid, a, b in zip(f.req_ids, bounds, bounds[1:]):
                if a != b:
                    parts.setdefault(rid, {}).setdefault(f.stack_names[k].sae, []).append(
                        (f.positions[a:b], stack[1, a:b].astype(np.int32), stack[0, a:b]))
        keep = [k for k in range(len(f.host)) if k not in saes]
        stripped.append(f._replace(stack_names=[f.stack_names[k] for k in keep if k < len(f.stack_names)],
                                   host=[f.host[k] for k in keep]))
    features = {rid: {sae: pieces[0] if len(pieces) == 1 else tuple(np.concatenate(p) for p in zip(*pieces))
                      for sae, pieces in of_request.items()} for rid, of_request in parts.items()}
    return stripped, features


def rows_by_request(forwards: list[QueuedForward]) -> dict[str, RequestRows]:
    """request id → hook → rows, over ``forwards`` in order. A hook set changed between them (eager
    mode) covers only the forwards it was installed for."""
    drained = {rid: RequestRows(parts) for rid, parts in _spans(forwards).items()}
    if len(forwards) > 1 and _same_layout(forwards):
        join = DrainJoin(forwards, drained)
        for rows in drained.values():
            rows._join = join
    return drained


def _spans(forwards: list[QueuedForward]) -> dict[str, list[Span]]:
    spans: dict[str, list[Span]] = {}
    for f in forwards:
        index = {name: (stack, h) for names, stack in zip(f.stack_names, map(_numpy, f.host))
                 for h, name in enumerate(names) if name is not None}
        ids = _token_ids(f)
        bounds = f.query_start_loc.tolist()
        for rid, a, b in zip(f.req_ids, bounds, bounds[1:]):
            if a != b:
                spans.setdefault(rid, []).append(Span(index, slice(a, b), f.positions[a:b], ids[a:b]))
    return spans


class DrainJoin:
    """Forwards of one layout drained together (the engine ran ahead of the drains), laid out request
    after request when the first request's rows are read, for every request of the drain at once:
    then each request's rows of a hook are one slice, as after a single forward. That is one copy of
    each stack, where joining each request's rows per hook made a thousand small ones at batch 32
    with 32 hooks (and a server then copied them again, to send them as a few large frames). A drain
    nobody reads costs nothing. It refers to the requests' rows weakly: a cycle would hold the
    forwards' pinned copies until the garbage collector ran."""

    __slots__ = ("_forwards", "_drained")

    def __init__(self, forwards: list[QueuedForward], drained: dict[str, "RequestRows"]):
        self._forwards = forwards
        self._drained = {rid: weakref.ref(rows) for rid, rows in drained.items()}

    def __call__(self) -> None:
        if self._forwards is None:
            return
        joined = _spans([_request_major(self._forwards)])
        self._forwards = None
        for rid, ref in self._drained.items():
            rows = ref()
            if rows is None:
                continue
            if rows._spans:  # not emptied by a deletion meanwhile
                rows._spans = joined[rid]
            rows._join = None


def _same_layout(forwards: list[QueuedForward]) -> bool:
    first = forwards[0]
    return all(f.stack_names == first.stack_names and len(f.host) == len(first.host)
               and all(t.dtype == u.dtype and t.shape[2:] == u.shape[2:] for t, u in zip(f.host, first.host))
               for f in forwards[1:])


def _request_major(forwards: list[QueuedForward]) -> QueuedForward:
    """Forwards of one layout drained together (the engine ran ahead of the drains) as one forward
    whose requests' rows lie one request after another: then every request's rows of a hook are one
    slice, as after a single forward. One copy of each stack, where joining a request's rows per hook
    made a thousand small ones at batch 32 with 32 hooks, and a server then copied them again to send
    them as a few large frames."""
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for k, f in enumerate(forwards):
        bounds = f.query_start_loc.tolist()
        for rid, a, b in zip(f.req_ids, bounds, bounds[1:]):
            if a != b:
                pieces.setdefault(rid, []).append((k, a, b))
    order = [(k, a, b) for parts in pieces.values() for k, a, b in parts]
    stacks = len(forwards[0].stack_names)
    host = [torch.cat([forwards[k].host[s][:, a:b] for k, a, b in order], dim=1) for s in range(stacks)]
    host += [torch.cat([forwards[k].host[s][a:b] for k, a, b in order]) for s in range(stacks, len(forwards[0].host))]
    counts = [sum(b - a for _, a, b in parts) for parts in pieces.values()]
    return QueuedForward(list(pieces), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                         np.concatenate([forwards[k].positions[a:b] for k, a, b in order]),
                         forwards[0].stack_names, host)


def _token_ids(f: QueuedForward) -> np.ndarray:
    if len(f.host) > len(f.stack_names):
        return f.host[-1].numpy().astype(np.int64, copy=False)
    return np.full(len(f.positions), -1, dtype=np.int64)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A view; numpy's bfloat16 is ``ml_dtypes``', which torch does not know: the bits are viewed as it."""
    return t.view(torch.int16).numpy().view(BFLOAT16) if t.dtype == torch.bfloat16 else t.numpy()
