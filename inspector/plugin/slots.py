"""The slot planner: which composed affine each captured row of a forward gets.

Each row of a forward belongs to a set of interventions; each distinct set gets a *slot*, a row in
every hook's ``scale``/``bias`` table that holds the composed affine. The
graph gathers the row's slot, so one mechanism covers every scope and a batch can mix clean and
steered requests. Only plain numpy here: this runs between forwards, outside the graph.
"""

from __future__ import annotations

import numpy as np

from inspector.capture.interventions import Intervention

MAX_ACTIVE = 62  # rows are keyed by a bit mask in an int64


class SlotPlanner:
    """Assigns slots to rows and says which table rows must be (re)written."""

    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self.interventions: list[Intervention] = []
        self._slot_of_mask: dict[int, int] = {0: 0}
        self._position_sets: list[np.ndarray | None] = []

    def set(self, interventions: list[Intervention]) -> None:
        if len(interventions) > MAX_ACTIVE:
            raise ValueError(f"at most {MAX_ACTIVE} interventions can be active at once, got {len(interventions)}")
        self.interventions = list(interventions)
        self._position_sets = [None if iv.positions is None else np.asarray(sorted(set(iv.positions)))
                               for iv in interventions]
        self._slot_of_mask = {0: 0}

    def row_masks(self, req_ids: list[str], query_start_loc: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Per row, the bit set of interventions that apply to it."""
        n = int(query_start_loc[-1])
        masks = np.zeros(n, dtype=np.int64)
        for bit, (iv, pos_set) in enumerate(zip(self.interventions, self._position_sets)):
            applies = np.ones(n, dtype=bool)
            if iv.request_id is not None:
                applies[:] = False
                for i, rid in enumerate(req_ids):
                    if rid == iv.request_id:
                        applies[query_start_loc[i]:query_start_loc[i + 1]] = True
            if pos_set is not None:
                applies &= np.isin(positions[:n], pos_set)
            masks[applies] |= np.int64(1) << bit
        return masks

    def assign(self, masks: np.ndarray) -> tuple[np.ndarray, list[tuple[int, list[Intervention]]]]:
        """Slots per row, plus (slot, interventions) for every slot that is new and must be written."""
        unique, inverse = np.unique(masks, return_inverse=True)
        new = []
        for mask in unique.tolist():
            if mask not in self._slot_of_mask:
                if len(self._slot_of_mask) >= self.max_slots:
                    raise RuntimeError(f"more than {self.max_slots} distinct intervention combinations in use; "
                                       "boot with a larger max_slots or clear interventions")
                slot = len(self._slot_of_mask)
                self._slot_of_mask[mask] = slot
                new.append((slot, [iv for b, iv in enumerate(self.interventions) if mask >> b & 1]))
        slot_of_unique = np.array([self._slot_of_mask[m] for m in unique.tolist()], dtype=np.int64)
        return slot_of_unique[inverse.reshape(-1)], new


def compose(interventions: list[Intervention], hook: str, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The single affine equal to applying, in order, every intervention on ``hook``; None if none."""
    scale, bias, any_ = np.ones(width), np.zeros(width), False
    for iv in interventions:
        if iv.hook == hook:
            s, b = iv.vector("scale", width), iv.vector("bias", width)
            scale, bias, any_ = scale * s, bias * s + b, True
    return (scale, bias) if any_ else None

