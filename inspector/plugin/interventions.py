"""Interventions as data, and the slot planner that maps each captured row to an affine.

An intervention is ``value * scale + bias`` at one hook point, scoped to all requests, one request,
and/or given positions. Each row of a forward belongs to a set of interventions; each distinct set
gets a *slot*, a row in every hook's ``scale``/``bias`` table that holds the composed affine. The
graph gathers the row's slot, so one mechanism covers every scope and a batch can mix clean and
steered requests. Only plain numpy here: this runs between forwards, outside the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_ACTIVE = 62  # rows are keyed by a bit mask in an int64


@dataclass(frozen=True)
class Intervention:
    hook: str
    scale: float | tuple[float, ...] = 1.0
    bias: float | tuple[float, ...] = 0.0
    request_id: str | None = None  # None: every request
    positions: tuple[int, ...] | None = None  # None: every position

    @classmethod
    def from_dict(cls, d: dict) -> "Intervention":
        unknown = set(d) - {"hook", "scale", "bias", "request_id", "positions"}
        if unknown:
            raise ValueError(f"unknown intervention fields {sorted(unknown)}")
        if "hook" not in d:
            raise ValueError("an intervention needs a 'hook'")

        def value(v):
            arr = np.asarray(v, dtype=np.float64)
            if arr.ndim > 1:
                raise ValueError(f"scale and bias must be scalars or 1-D vectors, got shape {arr.shape}")
            return float(arr) if arr.ndim == 0 else tuple(arr.tolist())

        positions = d.get("positions")
        if positions is not None:
            positions = tuple(int(p) for p in np.asarray(positions).reshape(-1))
        request_id = d.get("request_id")
        return cls(str(d["hook"]), value(d.get("scale", 1.0)), value(d.get("bias", 0.0)),
                   None if request_id is None else str(request_id), positions)

    def vector(self, which: str, width: int) -> np.ndarray:
        v = np.asarray(getattr(self, which), dtype=np.float64)
        return np.full(width, float(v)) if v.ndim == 0 else v


def validate(iv: Intervention, widths: dict[str, int], max_position: int, allow_positions: bool) -> None:
    """Raise ValueError with the reason; nothing is changed in the engine when this fails."""
    if iv.hook not in widths:
        known = ", ".join(sorted(widths)[:8])
        raise ValueError(f"intervention on {iv.hook!r}, which is not an installed hook point (installed: {known}…)")
    width = widths[iv.hook]
    for which in ("scale", "bias"):
        v = np.asarray(getattr(iv, which), dtype=np.float64)
        if v.ndim == 1 and v.shape[0] != width:
            raise ValueError(f"{which} of the intervention on {iv.hook!r} has {v.shape[0]} values; "
                             f"the hook point is {width} wide")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{which} of the intervention on {iv.hook!r} holds NaN or Inf")
    if iv.positions is not None:
        if not allow_positions:
            raise ValueError("position interventions need the engine booted with enable_position_interventions=True")
        if not iv.positions:
            raise ValueError(f"the intervention on {iv.hook!r} names an empty position list")
        bad = [p for p in iv.positions if not 0 <= p < max_position]
        if bad:
            raise ValueError(f"positions {bad[:5]} are out of range [0, {max_position})")


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

