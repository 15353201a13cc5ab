"""Interventions as data: ``value * scale + bias`` at one hook point, scoped to all requests or one,
and to every position or some. Validated the same way in the app, the session and the worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .vectors import check_vector

FIELDS = ("hook", "scale", "bias", "request_id", "positions")


@dataclass(frozen=True)
class Intervention:
    hook: str
    scale: float | tuple[float, ...] = 1.0
    bias: float | tuple[float, ...] = 0.0
    request_id: str | None = None  # None: every request
    positions: tuple[int, ...] | None = None  # None: every position

    @classmethod
    def from_dict(cls, d: dict) -> "Intervention":
        unknown = set(d) - set(FIELDS)
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

    def as_dict(self) -> dict:
        """Plain JSON-able values (intervention logs, files, RPC arguments)."""
        return {"hook": self.hook, "scale": self.scale, "bias": self.bias, "request_id": self.request_id,
                "positions": None if self.positions is None else list(self.positions)}

    def vector(self, which: str, width: int) -> np.ndarray:
        v = np.asarray(getattr(self, which), dtype=np.float64)
        return np.full(width, float(v)) if v.ndim == 0 else v

    def applies_to(self, request_id: str) -> bool:
        return self.request_id in (None, request_id)


def validate(iv: Intervention, widths: dict[str, int], max_position: int, allow_positions: bool) -> None:
    """Raise ValueError with the reason; nothing is changed in the engine when this fails."""
    if iv.hook not in widths:
        known = ", ".join(sorted(widths)[:8])
        raise ValueError(f"intervention on {iv.hook!r}, which is not an installed hook point (installed: {known}…)")
    width = widths[iv.hook]
    for which in ("scale", "bias"):
        check_vector(iv.vector(which, width), width, f"{which} of the intervention on {iv.hook!r}")
    if iv.positions is not None:
        if not allow_positions:
            raise ValueError("position interventions need the engine booted with enable_position_interventions=True")
        if not iv.positions:
            raise ValueError(f"the intervention on {iv.hook!r} names an empty position list")
        bad = [p for p in iv.positions if not 0 <= p < max_position]
        if bad:
            raise ValueError(f"positions {bad[:5]} are out of range [0, {max_position})")
