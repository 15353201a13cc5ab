"""Turning drained forwards into rows per request and hook, in one pass over the data.

Each forward's host copy holds, per stack of same-width hooks, ``[hooks, rows, width]`` for the
whole batch. A request's rows are gathered from every drained forward straight into one array per
stack (converting bfloat16 to float32 on the way, since numpy has no bfloat16); each hook then gets
a view of it. The Python work is per request and stack, not per hook and forward.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

Rows = dict[str, np.ndarray]  # positions, token_ids, values


class Drained(NamedTuple):
    """One forward's rows and their host copies (read once its transfer has landed): the stacks,
    then the token ids if the forward had them."""

    req_ids: list[str]
    query_start_loc: np.ndarray
    positions: np.ndarray
    stack_names: list[list[str | None]]
    host: list[torch.Tensor]


def rows_by_request(forwards: list[Drained]) -> dict[str, dict[str, Rows]]:
    """request id → hook → rows, over ``forwards`` in order. Forwards with the same hooks are gathered
    together; a hook set changed between them (eager mode) splits them, and a hook then covers only
    the forwards it was installed for."""
    out: dict[str, dict[str, Rows]] = {}
    for _, group in itertools.groupby(forwards, key=lambda f: f.stack_names):
        for rid, hooks in _gather(list(group)).items():
            merged = out.setdefault(rid, {})
            for name, rows in hooks.items():
                merged[name] = rows if name not in merged else {
                    key: np.concatenate([merged[name][key], rows[key]]) for key in rows}
    return out


def _gather(forwards: list[Drained]) -> dict[str, dict[str, Rows]]:
    stack_names = forwards[0].stack_names
    token_ids = [_token_ids(f) for f in forwards]
    spans: dict[str, list[tuple[int, int, int]]] = {}  # request → (forward, first row, end row)
    for index, f in enumerate(forwards):
        bounds = f.query_start_loc.tolist()
        for rid, a, b in zip(f.req_ids, bounds, bounds[1:]):
            if a != b:
                spans.setdefault(rid, []).append((index, a, b))
    out = {}
    for rid, parts in spans.items():
        positions = _join([forwards[i].positions[a:b] for i, a, b in parts])
        tokens = _join([token_ids[i][a:b] for i, a, b in parts])
        hooks = {}
        for k, names in enumerate(stack_names):
            values = _joined_values([forwards[i].host[k][:, a:b] for i, a, b in parts])
            hooks.update({name: {"positions": positions, "token_ids": tokens, "values": v}
                          for name, v in zip(names, values) if name is not None})
        out[rid] = hooks
    return out


def _token_ids(f: Drained) -> np.ndarray:
    if len(f.host) > len(f.stack_names):
        return f.host[-1].numpy().astype(np.int64)  # astype copies: the pinned block can be reused
    return np.full(int(f.query_start_loc[-1]), -1, dtype=np.int64)


def _joined_values(pieces: list[torch.Tensor]) -> np.ndarray:
    """[hooks, rows, width] pieces joined along rows into memory of our own, as float32 for bfloat16."""
    dtype = torch.float32 if pieces[0].dtype == torch.bfloat16 else pieces[0].dtype
    if len(pieces) == 1 and pieces[0].dtype == dtype and not pieces[0].is_pinned():
        return pieces[0].numpy()  # a private copy already (CPU device): a view will do
    hooks, width = pieces[0].shape[0], pieces[0].shape[2]
    out = torch.empty((hooks, sum(p.shape[1] for p in pieces), width), dtype=dtype)
    row = 0
    for p in pieces:
        out[:, row:row + p.shape[1]].copy_(p)
        row += p.shape[1]
    return out.numpy()


def _join(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
