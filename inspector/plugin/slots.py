"""The slot planner: which composed affine each row of a forward gets at each hook.

Every hook has a ``scale``/``bias`` table of ``max_slots`` rows; slot 0 is the identity, and each other
slot holds the composed affine of one combination of interventions on that hook. Per forward, each
hook gathers its rows' slots from its own ``row_slot`` vector, so one mechanism covers every scope and
a batch can mix clean and steered requests. Slots are numbered per hook and reused once no row of the
current forward needs them: a patching sweep of 32 layers × 64 positions needs 64 slots per hook in a
forward, not 2,048 in all. A slot keeps its contents while its effects stay in the set: on a busy
server the set changes as requests come and go, nearly every step, and rewriting every vector then
cost more than the steering. Only plain numpy here: this runs between forwards, outside the graph.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from inspector.core.interventions import Intervention

Key = tuple[int, ...]  # the effects applied to a row at one hook, in order, by their numbers (never reused)


class SlotTable:
    """One hook's slots: which combination of effects each holds, least recently used first."""

    def __init__(self, hook: str, max_slots: int):
        self.hook = hook
        self.capacity = max_slots - 1  # slot 0 is the identity
        self._slot_of = OrderedDict()  # key -> slot
        self._free = list(range(max_slots - 1, 0, -1))

    def claim(self, keys: set[Key]) -> tuple[dict[Key, int], list[tuple[int, Key]]]:
        """Slots for every key this forward uses, plus (slot, key) for each slot that must be written.
        A slot whose key no row of this forward uses may be given to another key."""
        if len(keys) > self.capacity:
            raise RuntimeError(f"{len(keys)} distinct intervention combinations at {self.hook} in one forward, more "
                               f"than its {self.capacity} slots: boot with a larger max_slots or run fewer at once")
        for key in keys & self._slot_of.keys():
            self._slot_of.move_to_end(key)
        new = []
        for key in keys - self._slot_of.keys():
            if self._free:
                slot = self._free.pop()
            else:  # the least recently used: not one of this forward's, which were all moved to the end
                _, slot = self._slot_of.popitem(last=False)
            self._slot_of[key] = slot
            new.append((slot, key))
        return {key: self._slot_of[key] for key in keys}, new


class SlotPlanner:
    """Assigns slots to rows, per hook, and says which table rows must be (re)written.

    A key is the sequence of effects applied to a row (an effect is what an intervention does: hook,
    scale, bias), not which interventions those were: a thousand requests steered alike by
    per-request interventions share one slot."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self._numbers = itertools.count()
        self._effect_numbers: dict[tuple, int] = {}  # effect -> its number, for the effects of the set
        self._tables: dict[str, SlotTable] = {}
        self.set([])

    def set(self, interventions: list[Intervention]) -> None:
        """The interventions from now on. An effect keeps its number while it stays in the set, and a slot
        holding a combination of them keeps it; a number gone is never given again."""
        self.interventions = list(interventions)
        self._position_sets = [None if iv.positions is None else np.asarray(sorted(set(iv.positions)))
                               for iv in interventions]
        numbers = {}
        for iv in interventions:
            if iv.effect not in numbers:
                known = self._effect_numbers.get(iv.effect)
                numbers[iv.effect] = next(self._numbers) if known is None else known
        self._effect_numbers = numbers
        self._effect = [numbers[iv.effect] for iv in interventions]
        self._first = {}  # effect number -> the first intervention with that effect
        for k, e in enumerate(self._effect):
            self._first.setdefault(e, k)
        self._effects = np.asarray(self._effect, dtype=np.int64)
        self._hooks = sorted({iv.hook for iv in interventions})
        index = {hook: h for h, hook in enumerate(self._hooks)}
        self._hook_of = np.array([index[iv.hook] for iv in interventions], dtype=np.int64)
        self._global = [k for k, iv in enumerate(interventions) if iv.request_id is None]
        self._by_request: dict[str, list[int]] = {}
        for k, iv in enumerate(interventions):
            if iv.request_id is not None:
                self._by_request.setdefault(iv.request_id, []).append(k)

    def forget(self, hooks) -> None:
        """What ``hooks``' slots hold is gone (their tables were made anew, or cleared): fill them again."""
        for hook in hooks:
            self._tables.pop(hook, None)

    def plan(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray
             ) -> tuple[dict[str, np.ndarray], list[tuple[str, int, list[Intervention]]]]:
        """For each hook that some row of this forward intervenes on: every row's slot [rows]; and
        (hook, slot, its interventions in order) for each slot that must be (re)written."""
        n = int(query_start_loc[-1])
        rows, ks = self._applications(req_ids, query_start_loc, positions[:n])
        if not len(rows):
            return {}, []
        hook_of = self._hook_of[ks]
        slots, writes = {}, []
        for h in np.unique(hook_of).tolist():
            hook = self._hooks[h]
            mine = hook_of == h
            hook_rows, hook_ks = rows[mine], ks[mine]
            order = np.lexsort((hook_ks, hook_rows))  # by row, then in the interventions' order
            hook_rows, hook_ks = hook_rows[order], hook_ks[order]
            starts = np.flatnonzero(np.concatenate([[True], hook_rows[1:] != hook_rows[:-1]]))
            where = hook_rows[starts]
            effects = self._effects[hook_ks].tolist()
            if len(starts) == len(hook_rows):  # one intervention per row, the common case
                keys = [(e,) for e in effects]
            else:
                bounds = [*starts.tolist(), len(effects)]
                keys = [tuple(effects[x:y]) for x, y in zip(bounds, bounds[1:])]
            table = self._tables.setdefault(hook, SlotTable(hook, self.max_slots))
            slot_of, new = table.claim(set(keys))
            out = slots[hook] = np.zeros(n, dtype=np.int64)
            out[where] = [slot_of[key] for key in keys]
            writes += [(hook, slot, [self.interventions[self._first[e]] for e in key]) for slot, key in new]
        return slots, writes

    def _applications(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Every (row, intervention) pair of this forward where the intervention applies to the row. The
        requests' own interventions at every position (a decode step of 64 steered requests: 64 of them)
        become rows in a few array operations, not a few per request: this runs before every forward."""
        rows, ks = [], []

        def add(found: np.ndarray, k: int) -> None:
            if len(found):
                rows.append(found)
                ks.append(np.full(len(found), k, dtype=np.int64))

        whole_at, whole_k = [], []  # (request's index in the forward, intervention) applying at every position
        for i, rid in enumerate(req_ids):
            for k in self._by_request.get(rid, ()):
                if self._position_sets[k] is None:
                    whole_at.append(i)
                    whole_k.append(k)
                else:
                    add(self._at_positions(k, int(query_start_loc[i]), int(query_start_loc[i + 1]), positions), k)
        if whole_at:
            starts = query_start_loc[whole_at].astype(np.int64)
            counts = query_start_loc[np.asarray(whole_at) + 1].astype(np.int64) - starts
            rows.append(np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts),
                                                                                 counts))
            ks.append(np.repeat(np.asarray(whole_k, dtype=np.int64), counts))
        for k in self._global:
            wanted = self._position_sets[k]
            add(np.arange(len(positions)) if wanted is None else np.flatnonzero(np.isin(positions, wanted)), k)
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(rows), np.concatenate(ks)

    def _at_positions(self, k: int, a: int, b: int, positions: np.ndarray) -> np.ndarray:
        """Rows a..b (one request's) at the positions intervention ``k`` names."""
        if a == b:
            return np.zeros(0, np.int64)
        wanted, first = self._position_sets[k], int(positions[a])
        if int(positions[b - 1]) - first == b - 1 - a:  # a request's rows: consecutive positions
            return a + wanted[(wanted >= first) & (wanted < first + b - a)] - first
        return a + np.flatnonzero(np.isin(positions[a:b], wanted))


def compose(interventions: list[Intervention], hook: str, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The single affine equal to applying, in order, every intervention on ``hook``; None if none."""
    scale, bias, any_ = np.ones(width), np.zeros(width), False
    for iv in interventions:
        if iv.hook == hook:
            s, b = iv.vector("scale", width), iv.vector("bias", width)
            scale, bias, any_ = scale * s, bias * s + b, True
    return (scale, bias) if any_ else None
