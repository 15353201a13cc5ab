"""A request's ``vllm_xargs`` steering fields → the interventions it carries, checked; or the one-line
reason it is refused (an HTTP 400 before vLLM admits it).

Fields (lists: comma-separated, or JSON lists):

- ``inspector_steer``: vectors added at their hooks, by registered name or inline (``HOOK:BASE64``,
  float32 little-endian); ``inspector_vector``: inline ones only; ``inspector_scale``: their multiplier
  (default 1);
- ``inspector_ablate``: vectors (named or inline) whose direction is projected out of the hook's rows;
- ``inspector_clamp``: registered SAE features clamped to a value, ``NAME=VALUE``;
- ``inspector_positions``: where all of these apply (the project's syntax ``3-7, 10``, or a list;
  default every position);
- ``inspector_capture``: hook patterns whose rows the server keeps for the request, and
  ``inspector_window``: which rows (``all``, ``generated``, ``last:N``, ``every:K``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from inspector.core.hooks import HookPoint
from inspector.core.interventions import FeatureClamp, Intervention, validate
from inspector.core.positions import parse_positions
from inspector.core.request_edits import CAPTURE_KEY, CLIENT_PREFIX as PREFIX, EDIT_KEY, decode_vector
from inspector.core.windows import CaptureWindow

from .vectors import VectorRegistry

STEER_FIELDS = ("inspector_steer", "inspector_vector", "inspector_scale", "inspector_ablate", "inspector_clamp",
                "inspector_positions")
ABLATION_FLOOR = -1e30  # an ablation is a clamp to 0 whose activation is never floored (finite in every dtype)
CAPTURE_FIELDS = ("inspector_capture", "inspector_window")
FIELDS = STEER_FIELDS + CAPTURE_FIELDS


class Refused(ValueError):
    """A request the server will not admit: ``status`` and the field it is about."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass(frozen=True)
class HookTable:
    """What the engine compiled, as its worker describes it (``inspector_describe``)."""

    points: dict[str, HookPoint]  # installed name -> point
    dtype: str
    max_slots: int
    max_model_len: int
    mode: str
    feature_clamps: int = 0  # per hook, directions that running edits may clamp (ablations included)

    @classmethod
    def from_description(cls, described: dict) -> "HookTable":
        catalogue = {p["name"]: HookPoint.from_dict(p) for p in described["hook_points"]}
        points = {name: catalogue[point] for name, point in described["installed"].items()}
        return cls(points, described["dtype"], int(described["max_slots"]), int(described["max_model_len"]),
                   described["mode"], int(described.get("feature_clamps", 0)))

    @property
    def widths(self) -> dict[str, int]:
        return {name: p.width for name, p in self.points.items()}

    def installed(self, hook: str) -> str:
        """The installed name of ``hook`` (a name or alias); ValueError naming what is installed."""
        if hook in self.points:
            return hook
        for name, p in self.points.items():
            if hook in (p.alias, p.name):
                return name
        raise ValueError(f"{hook!r} is not a hook this server compiled; it steers only those it compiled at start "
                         "(GET /inspector/v1/hooks)")

    def describe(self) -> dict:
        return {"mode": self.mode, "dtype": self.dtype, "max_slots": self.max_slots, "feature_clamps": self.feature_clamps,
                "hooks": [{"name": name, "alias": p.alias, "kind": p.kind, "layer": p.layer, "width": p.width,
                           "steerable": not p.unsteerable} for name, p in self.points.items()]}


def steering_fields(xargs: dict) -> dict:
    """The request's inspector fields; Refused for a field no version of ours reads, or one only the
    server may write."""
    ours = {key: value for key, value in xargs.items() if key.startswith(PREFIX)}
    for reserved in (EDIT_KEY, CAPTURE_KEY):
        if reserved in ours:
            raise Refused(f"{reserved} is written by the server, not by clients", reserved)
    unknown = sorted(ours.keys() - set(FIELDS))
    if unknown:
        raise Refused(f"unknown steering field {unknown[0]!r} (known: {', '.join(FIELDS)})", unknown[0])
    return ours


@dataclass(frozen=True)
class CaptureAsk:
    """Which rows of a request the server keeps: its hooks (installed names) and window."""

    hooks: tuple[str, ...]
    window: str


def capture_ask(fields: dict, hooks: HookTable) -> CaptureAsk | None:
    """What ``inspector_capture`` and ``inspector_window`` ask for (None: no capture)."""
    if "inspector_capture" not in fields:
        if "inspector_window" in fields:
            raise Refused("inspector_window without inspector_capture: name the hooks to keep", "inspector_window")
        return None
    asked = fields["inspector_capture"]
    patterns = [str(p).strip() for p in (asked if isinstance(asked, list) else str(asked).split(","))]
    if not patterns or not all(patterns):
        raise Refused(f"inspector_capture {asked!r} holds an empty pattern", "inspector_capture")
    chosen = []
    for pattern in patterns:
        found = [name for name, p in hooks.points.items() if p.matches(pattern)]
        if not found:
            raise Refused(f"inspector_capture {pattern!r} matches no hook this server compiled "
                          "(GET /inspector/v1/hooks)", "inspector_capture")
        chosen += [name for name in found if name not in chosen]
    split = [hooks.points[name].alias for name in chosen if hooks.points[name].shards > 1]
    if split:
        raise Refused(f"inspector_capture: {split[0]} is split over the tensor-parallel ranks, and the server keeps "
                      "the rows of one rank; capture a replicated point (the residual stream, an attention or MLP "
                      "output)", "inspector_capture")
    try:
        window = str(CaptureWindow.parse(str(fields.get("inspector_window", "all"))))
    except ValueError as e:
        raise Refused(f"inspector_window: {e}", "inspector_window") from None
    return CaptureAsk(tuple(chosen), window)


def resolve(fields: dict, vectors: VectorRegistry, hooks: HookTable) -> list[Intervention]:
    """The interventions a request's steering fields ask for (no request id: the worker adds it)."""
    fields = {key: value for key, value in fields.items() if key in STEER_FIELDS}
    if not fields:
        return []
    scale = _number(fields.get("inspector_scale", 1.0), "inspector_scale")
    positions = _positions(fields.get("inspector_positions"))
    interventions = [Intervention(hook, bias=vector * scale, positions=positions)
                     for field in ("inspector_steer", "inspector_vector")
                     for hook, vector in _vectors(fields, field, vectors, hooks)]
    for hook, vector in _vectors(fields, "inspector_ablate", vectors, hooks):
        norm = float(np.linalg.norm(vector))
        if not norm:
            raise Refused(f"inspector_ablate: a zero vector at {hook} has no direction", "inspector_ablate")
        unit = vector / norm
        interventions.append(Intervention(hook, positions=positions,
                                          clamp=FeatureClamp(unit, 0.0, ABLATION_FLOOR, unit, 0.0, "ablation")))
    interventions += [Intervention(named.hook, positions=positions, clamp=clamp)
                      for named, clamp in _clamps(fields.get("inspector_clamp"), vectors)]
    if not interventions:
        raise Refused("inspector_scale or inspector_positions without a vector: name one in inspector_steer (or "
                      "inspector_ablate, inspector_clamp) or give one in inspector_vector", "inspector_steer")
    if any(iv.clamp is not None for iv in interventions) and not hooks.feature_clamps:
        raise Refused("this server has no room for clamps or ablations: start it with --feature-clamps N",
                      "inspector_ablate" if "inspector_ablate" in fields else "inspector_clamp")
    for iv in interventions:
        point = hooks.points[iv.hook]
        if point.unsteerable:
            raise Refused(f"{point.alias} cannot be steered: {point.unsteerable}", "inspector_steer")
        try:
            validate(iv, hooks.widths, hooks.max_model_len, True, hooks.dtype)
        except ValueError as e:
            raise Refused(str(e), "inspector_positions" if "position" in str(e) else None) from None
    return interventions


def _vectors(fields: dict, field: str, vectors: VectorRegistry, hooks: HookTable) -> list[tuple[str, object]]:
    """(installed hook, vector) for each item of a vector field: a registered name, or ``HOOK:BASE64``
    (``inspector_vector`` takes only the latter)."""
    found = []
    for item in _names(fields.get(field), field):
        if ":" in item or field == "inspector_vector":
            found.append(_inline(item, hooks, field))
            continue
        try:
            named = vectors.get(item)
        except ValueError as e:
            raise Refused(str(e), field) from None
        found.append((named.hook, named.vector))
    return found


def _clamps(value, vectors: VectorRegistry) -> list[tuple]:
    """(named vector, its clamp at the value asked) for each ``NAME=VALUE``."""
    found = []
    for item in _names(value, "inspector_clamp"):
        name, equals, number = item.partition("=")
        if not equals:
            raise Refused(f"inspector_clamp {item!r}: write NAME=VALUE (a registered SAE feature)", "inspector_clamp")
        try:
            named = vectors.get(name.strip())
        except ValueError as e:
            raise Refused(str(e), "inspector_clamp") from None
        if named.clamp is None:
            raise Refused(f"inspector_clamp: {name.strip()!r} cannot be clamped: {named.unclampable}", "inspector_clamp")
        found.append((named, replace(named.clamp, value=_number(number, "inspector_clamp"))))
    return found


def _names(value, field: str) -> list[str]:
    """A field's items: a list, or comma-separated (base64 holds no comma)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    names = [str(item).strip() for item in items]
    if not all(names):
        raise Refused(f"{field} {value!r} holds an empty name", field)
    return names


def _number(value, field: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise Refused(f"{field} must be a number, got {value!r}", field) from None
    if not math.isfinite(number):
        raise Refused(f"{field} must be finite, got {value!r}", field)
    return number


def _positions(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        if isinstance(value, str):
            return parse_positions(value)
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in items):
            raise ValueError(f"{value!r} is not a list of positions (whole numbers from 0)")
        return tuple(sorted(set(items)))
    except ValueError as e:
        raise Refused(f"inspector_positions: {e}", "inspector_positions") from None


def _inline(item, hooks: HookTable, field: str) -> tuple[str, object]:
    if not isinstance(item, str) or ":" not in item:
        raise Refused(f"{field} takes HOOK:BASE64 (float32, little-endian), or a list of them", field)
    hook, _, text = item.rpartition(":")
    try:
        name = hooks.installed(hook)
    except ValueError as e:
        raise Refused(f"{field}: {e}", field) from None
    width = hooks.points[name].width
    if len(text) > 4 * ((4 * width + 2) // 3):  # longer than its width's base64: refused before decoding
        raise Refused(f"{field} for {hook!r} is longer than {width} float32 values", field)
    try:
        return name, decode_vector(text, f"{field} for {hook!r}")
    except ValueError as e:
        raise Refused(str(e), field) from None
