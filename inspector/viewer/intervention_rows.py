"""Rows of the interventions table as plain data, with the validation the editor applies (no Qt).

A row is what the user edits; ``to_intervention`` turns an enabled, valid row into the engine's
``Intervention``. Validation happens on every edit, so an invalid value (NaN, a vector of the wrong
length, positions that do not parse) is refused with a message and the previous value stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from inspector.core.interventions import FeatureClamp, Intervention
from inspector.core.positions import format_positions, parse_positions
from inspector.core.vectors import check_vector

SCOPES = ("all", "request", "positions", "request+positions")
SCOPE_LABELS = {"all": "all requests", "request": "this request", "positions": "positions",
                "request+positions": "this request, positions"}


def parse_scalar(text, what: str = "value") -> float:
    """A finite float from user text; ValueError with a clear message otherwise."""
    if isinstance(text, (int, float, np.floating, np.integer)):
        value = float(text)
    else:
        s = str(text).strip()
        if not s:
            raise ValueError(f"{what} is empty: enter a number such as 1.0")
        try:
            value = float(s)
        except ValueError:
            raise ValueError(f"{what} {s!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value}")
    return value


@dataclass
class InterventionRow:
    hook: str
    enabled: bool = True
    scope: str = "all"
    request_id: str | None = None
    positions: tuple[int, ...] | None = None
    scale: float | np.ndarray = 1.0
    bias: float | np.ndarray = 0.0
    source: str = ""  # where a vector came from (file name, steering recipe)
    clamp: FeatureClamp | None = None  # a row that clamps an SAE feature: its Bias column is the value
    problem: str = ""  # set when the row no longer fits the engine (e.g. hook gone after a restart)

    # ---- display ----
    def value_text(self, which: str) -> str:
        if self.clamp is not None and which == "bias":
            return f"clamp {self.clamp.value:g}"
        v = getattr(self, which)
        if isinstance(v, np.ndarray):
            return f"vector[{v.shape[0]}] ‖{np.linalg.norm(v):.3g}‖"
        return f"{v:g}"

    def is_identity(self) -> bool:
        """Scale 1 and bias 0, no clamp: the row changes nothing (a new row, until it is edited)."""
        return self.clamp is None and bool(np.all(np.asarray(self.scale) == 1.0)) and \
            bool(np.all(np.asarray(self.bias) == 0.0))

    def is_active(self) -> bool:
        """Enabled, fitting the engine, and changing something: what the engine is sent and the dock counts."""
        return self.enabled and not self.problem and not self.is_identity()

    def positions_text(self) -> str:
        return format_positions(self.positions) if self.positions else ""

    # ---- edits (each returns a new row or raises ValueError; the row itself is never half-changed) ----
    def with_field(self, name: str, value, width: int | None) -> "InterventionRow":
        if name == "enabled":
            return replace(self, enabled=bool(value))
        if name == "clamp":
            return replace(self, clamp=value)
        if name == "hook":
            if self.clamp is not None and str(value) != self.hook:
                raise ValueError(f"this row clamps feature {self.clamp.label}, which reads {self.hook} only")
            return replace(self, hook=str(value), problem="")
        if name == "scope":
            if value not in SCOPES:
                raise ValueError(f"scope must be one of {', '.join(SCOPES)}")
            return replace(self, scope=value)
        if name == "request_id":
            return replace(self, request_id=(str(value) if value not in (None, "") else None))
        if name == "positions":
            if value in (None, "") or (isinstance(value, str) and not value.strip()):
                return replace(self, positions=None)
            ps = value if isinstance(value, tuple) else parse_positions(str(value))
            return replace(self, positions=tuple(int(p) for p in ps))
        if name in ("scale", "bias") and self.clamp is not None:
            if name == "scale":
                raise ValueError("a clamp row has no scale: scale this hook in a row of its own")
            text = str(value).removeprefix("clamp ") if isinstance(value, str) else value
            return replace(self, clamp=replace(self.clamp, value=parse_scalar(text, "the clamp's value")))
        if name in ("scale", "bias"):
            if isinstance(value, np.ndarray) or isinstance(value, (list, tuple)):
                return replace(self, **{name: check_vector(value, width, name).astype(np.float32)})
            return replace(self, **{name: parse_scalar(value, name)})
        raise KeyError(name)

    def validate(self, widths: dict[str, int]) -> None:
        """Raise ValueError if the row cannot become an Intervention for the installed hooks."""
        if not self.hook:
            raise ValueError("choose a hook point for this intervention")
        if widths and self.hook not in widths:
            raise ValueError(f"{self.hook!r} is not an installed hook point")
        width = widths.get(self.hook)
        for which in ("scale", "bias"):
            v = getattr(self, which)
            if isinstance(v, np.ndarray):
                check_vector(v, width, which)
            else:
                parse_scalar(v, which)
        if self.clamp is not None:
            for which in ("encoder", "decoder"):
                check_vector(getattr(self.clamp, which), width, f"the clamp's {which}")
        if self.scope in ("request", "request+positions") and not self.request_id:
            raise ValueError("scope 'this request' needs a request: select one in the view first")
        if self.scope in ("positions", "request+positions") and not self.positions:
            raise ValueError("scope 'positions' needs positions, e.g. 3-7, 10")

    def to_intervention(self) -> Intervention:
        def val(v):
            return v if isinstance(v, np.ndarray) else float(v)

        rid = self.request_id if self.scope in ("request", "request+positions") else None
        pos = self.positions if self.scope in ("positions", "request+positions") else None
        return Intervention(hook=self.hook, scale=val(self.scale), bias=val(self.bias), request_id=rid,
                            positions=tuple(pos) if pos else None, clamp=self.clamp)


def active_interventions(rows: list[InterventionRow], widths: dict[str, int]) -> list[Intervention]:
    """Interventions of the active rows; invalid rows raise (the editor keeps them from existing)."""
    out = []
    for row in rows:
        if row.is_active():
            row.validate(widths)
            out.append(row.to_intervention())
    return out
