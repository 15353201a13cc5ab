"""Captured rows as the notebook's [batch, pos, width] tensors, two ways. With the engine in this process,
``DeviceRows`` takes each forward's rows where the engine made them (``Session.set_row_sink``) and
scatters them into place on its device: no host copy, no per-request Python, so a cache of every
block of an 8B model keeps up with the engine. A server's rows arrive as drained host arrays instead
(``drained_prefill``, ``drained_generation``)."""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np
import torch

from .cache import as_torch


class DeviceRows:
    """A row sink: the ``wanted`` hooks' rows of the requests in ``request_index`` (engine id → the
    prompt's index), each at its prompt and position of one [batch, capacity, width] tensor per hook on
    the engine's device, in its dtype; ``written`` [batch, capacity] marks the positions filled. Per
    forward: one small asynchronous upload of where the rows go and one scatter per stack of same-width
    hooks, so the engine's next step is not kept waiting."""

    def __init__(self, wanted: Collection[str], request_index: dict[str, int], batch: int, capacity: int):
        self.wanted, self.request_index, self.batch, self.capacity = set(wanted), request_index, batch, capacity
        self.tensors: dict[str, torch.Tensor] = {}
        self.written: torch.Tensor | None = None
        self._true: torch.Tensor | None = None
        self._stacked: dict[int, torch.Tensor] = {}  # stack's place -> its wanted hooks' [hooks, batch, capacity, width]
        self._chosen: dict[int, tuple] = {}  # stack's place -> (its hooks, the wanted ones, their index or None)

    def __call__(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray, stacks: list) -> None:
        requests = np.repeat([self.request_index.get(rid, -1) for rid in req_ids], np.diff(query_start_loc))
        ours = requests >= 0
        if not ours.any() or not stacks:
            return
        device = stacks[0][1].device
        every = bool(ours.all())
        # where each row goes (prompt, position) and which rows are ours: one upload, not waited for
        where = torch.from_numpy(np.stack([requests[ours], positions[ours], np.flatnonzero(ours)]).astype(np.int64))
        where = where.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else where
        b, p, rows = where[0], where[1], where[2]
        if self.written is None:
            with torch.inference_mode(False):  # the cache's tensors are the user's, to edit as they like
                self.written = torch.zeros((self.batch, self.capacity), dtype=torch.bool, device=device)
            self._true = torch.ones(1, dtype=torch.bool, device=device)
        # a value already on the device: a host ``True`` would be copied there, waiting for the forward
        self.written.index_put_((b, p), self._true)  # written in inference mode, they stay ordinary tensors
        for place, (names, tensor) in enumerate(stacks):
            chosen, index = self._chosen_of(place, names, device)
            if not chosen:
                continue
            if index is not None:
                tensor = tensor.index_select(0, index)
            tensor = tensor if every else tensor.index_select(1, rows)
            self._stack(place, chosen, tensor)[:, b, p] = tensor

    def _chosen_of(self, place: int, names, device) -> tuple[list[str], torch.Tensor | None]:
        """The wanted hooks of a stack, and where only some are, their index in it (worked out once a
        stack's hooks, not each forward)."""
        known = self._chosen.get(place)
        if known is None or known[0] != tuple(names):
            chosen = [h for h, name in enumerate(names) if name in self.wanted]
            index = torch.tensor(chosen, device=device) if 0 < len(chosen) < len(names) else None
            self._chosen[place] = known = (tuple(names), [names[h] for h in chosen], index)
        return known[1], known[2]

    def _stack(self, place: int, names: list[str], tensor: torch.Tensor) -> torch.Tensor:
        """The wanted hooks of a stack: one [hooks, batch, capacity, width] tensor, each hook's a view."""
        if place not in self._stacked:
            with torch.inference_mode(False):  # views made in inference mode could not be edited outside it
                self._stacked[place] = stacked = tensor.new_zeros((len(names), self.batch, self.capacity, tensor.shape[2]))
                self.tensors.update(zip(names, stacked))
        return self._stacked[place]


def drained_prefill(session, contexts: list[list[int]], names: Collection[str],
                    request_ids: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Per hook in ``names``, ``session.prefill``'s drained rows of ``contexts`` as [batch, longest, width]
    on the host, zeros after each context's end."""
    longest = max(map(len, contexts))
    out: dict[str, torch.Tensor] = {}
    prefilled = session.prefill(contexts) if request_ids is None else session.prefill(contexts, request_ids)
    for done in prefilled:
        for name in names:
            parts = [part[name] for part in done.parts if name in part]
            positions = torch.from_numpy(np.concatenate([np.asarray(p["positions"]) for p in parts]).astype(np.int64))
            values = as_torch(np.concatenate([np.asarray(p["values"]) for p in parts]))
            if name not in out:
                out[name] = values.new_zeros((len(contexts), longest, values.shape[1]))
            out[name][done.index, positions] = values
    return out


def drained_generation(requests: list, names: Collection[str], longest: int
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per hook in ``names``, the rows a generation's ``requests`` (``Run`` requests) kept, as [batch,
    longest, width] on the host, and [batch, longest] marking the positions that hold rows."""
    out: dict[str, torch.Tensor] = {}
    written = torch.zeros((len(requests), longest), dtype=torch.bool)
    for i, request in enumerate(requests):
        for name, found in request.hooks.items():
            if name not in names:
                continue
            positions = torch.from_numpy(np.asarray(found.positions, dtype=np.int64))
            values = as_torch(found.values)
            if name not in out:
                out[name] = values.new_zeros((len(requests), longest, values.shape[1]))
            out[name][i, positions] = values
            written[i, positions] = True
    return out, written
