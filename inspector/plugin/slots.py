"""The slot planner: which composed affine each captured row of a forward gets.

Each row of a forward belongs to a set of interventions; each distinct set of effects gets a *slot*, a
row in every hook's ``scale``/``bias`` table that holds the composed affine. The graph gathers the
row's slot, so one mechanism covers every scope and a batch can mix clean and steered requests. Only
plain numpy here: this runs between forwards, outside the graph.
"""

from __future__ import annotations

import numpy as np

from inspector.capture.interventions import Intervention

class SlotPlanner:
    """Assigns slots to rows and says which table rows must be (re)written.

    A slot is keyed by the effects applied to a row, in order (an effect is what an intervention does:
    hook, scale, bias), not by which interventions those were: a thousand requests steered alike by
    per-request interventions share one slot. Only distinct combinations of effects need slots."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.interventions: list[Intervention] = []
        self._position_sets: list[np.ndarray | None] = []
        self._effect: list[int] = []  # per intervention, the first one with the same effect
        self._slot_of_key: dict[tuple[int, ...], int] = {(): 0}

    def set(self, interventions: list[Intervention]) -> None:
        self.interventions = list(interventions)
        self._position_sets = [None if iv.positions is None else np.asarray(sorted(set(iv.positions)))
                               for iv in interventions]
        effects: dict[tuple, int] = {}
        self._effect = [effects.setdefault((iv.hook, iv.scale, iv.bias), i) for i, iv in enumerate(interventions)]
        self._slot_of_key = {(): 0}

    def applies(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """[rows, interventions]: which intervention applies to which row of this forward."""
        n = int(query_start_loc[-1])
        out = np.ones((n, len(self.interventions)), dtype=bool)
        for k, (iv, pos_set) in enumerate(zip(self.interventions, self._position_sets)):
            if iv.request_id is not None:
                out[:, k] = False
                for i, rid in enumerate(req_ids):
                    if rid == iv.request_id:
                        out[query_start_loc[i]:query_start_loc[i + 1], k] = True
            if pos_set is not None:
                out[:, k] &= np.isin(positions[:n], pos_set)
        return out

    def assign(self, applies: np.ndarray) -> tuple[np.ndarray, list[tuple[int, list[Intervention]]]]:
        """Slots per row, plus (slot, interventions) for every slot that is new and must be written."""
        unique, inverse = np.unique(applies, axis=0, return_inverse=True)
        new, slot_of_unique = [], np.empty(len(unique), dtype=np.int64)
        for u, row in enumerate(unique):
            applied = np.flatnonzero(row).tolist()
            key = tuple(self._effect[k] for k in applied)
            if key not in self._slot_of_key:
                if len(self._slot_of_key) >= self.max_slots:
                    raise RuntimeError(f"more than {self.max_slots} distinct intervention combinations in use; "
                                       "boot with a larger max_slots or clear interventions")
                self._slot_of_key[key] = len(self._slot_of_key)
                new.append((self._slot_of_key[key], [self.interventions[k] for k in applied]))
            slot_of_unique[u] = self._slot_of_key[key]
        return slot_of_unique[inverse.reshape(-1)], new


def compose(interventions: list[Intervention], hook: str, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The single affine equal to applying, in order, every intervention on ``hook``; None if none."""
    scale, bias, any_ = np.ones(width), np.zeros(width), False
    for iv in interventions:
        if iv.hook == hook:
            s, b = iv.vector("scale", width), iv.vector("bias", width)
            scale, bias, any_ = scale * s, bias * s + b, True
    return (scale, bias) if any_ else None

