"""Interventions as data: ``value * scale + bias`` at one hook point, or a feature clamped to a value,
scoped to all requests or one, and to every position or some. Validated the same way in the app, the
session and the worker."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .vectors import check_vector

FIELDS = ("hook", "scale", "bias", "request_id", "positions", "clamp")
# Per hook, the intervention combinations one forward can hold (slot 0, the identity, included): a
# patching sweep runs MAX_SLOTS - 1 cells per hook point in one engine call, so 32 layers x 127
# positions at once. Each slot costs two rows of the hook's width on the device.
DEFAULT_MAX_SLOTS = 128


Vector = float | np.ndarray  # a number for every feature, or one per feature (read-only float64)


@dataclass(frozen=True, eq=False)
class FeatureClamp:
    """Clamp one feature of a sparse autoencoder to ``value``: each row ``x`` becomes
    ``x + (value - a(x)) * decoder``, where ``a(x) = p * (p > floor)`` with ``p = x . encoder + offset`` is
    the feature's activation (ReLU: floor 0; JumpReLU: its threshold). That is the SAE's reconstruction
    with the feature set to ``value`` plus the SAE's error, so the rest of the row is left as it was.
    ``capture.sae.feature_clamp`` builds one from an SAE's directory."""

    encoder: np.ndarray  # [width]
    offset: float
    floor: float
    decoder: np.ndarray  # [width]
    value: float
    label: str = ""  # what it clamps, for people: "sae/feature"

    def __post_init__(self):
        for which in ("encoder", "decoder"):
            v = _as_vector(getattr(self, which), f"the {which} of a feature clamp")
            if isinstance(v, float):
                raise ValueError(f"the {which} of a feature clamp must be a vector")
            object.__setattr__(self, which, v)
        for which in ("offset", "floor", "value"):
            number = float(getattr(self, which))
            if not np.isfinite(number):
                raise ValueError(f"the {which} of a feature clamp must be finite, got {number}")
            object.__setattr__(self, which, number)

    @property
    def direction(self) -> tuple:
        """Which feature it reads and writes (hashable), whatever the value."""
        return self.encoder.tobytes(), self.offset, self.floor, self.decoder.tobytes()

    def as_dict(self, arrays: bool = False) -> dict:
        def plain(v):
            return v if arrays else v.tolist()

        return {"encoder": plain(self.encoder), "offset": self.offset, "floor": self.floor,
                "decoder": plain(self.decoder), "value": self.value, "label": self.label}

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureClamp":
        unknown = set(d) - {"encoder", "offset", "floor", "decoder", "value", "label"}
        missing = {"encoder", "offset", "floor", "decoder", "value"} - set(d)
        if unknown or missing:
            raise ValueError(f"a feature clamp: unknown fields {sorted(unknown)}, missing {sorted(missing)}")
        return cls(d["encoder"], d["offset"], d["floor"], d["decoder"], d["value"], str(d.get("label", "")))


@dataclass(frozen=True, eq=False)
class Intervention:
    """Vectors are kept as read-only float64 arrays (a tuple or list given becomes one): a patching
    sweep passes a thousand hidden-size vectors through validation, the wire and the slot tables, and
    converting Python floats at each stage cost more than the forward."""

    hook: str
    scale: Vector = 1.0
    bias: Vector = 0.0
    request_id: str | None = None  # None: every request
    positions: tuple[int, ...] | None = None  # None: every position
    clamp: FeatureClamp | None = None  # applied after the hook's scales and biases; this one's are identities

    def __post_init__(self):
        for which in ("scale", "bias"):
            object.__setattr__(self, which, _as_vector(getattr(self, which)))
        if self.positions is not None:
            object.__setattr__(self, "positions", tuple(int(p) for p in self.positions))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Intervention):
            return NotImplemented
        return ((self.hook, self.request_id, self.positions) == (other.hook, other.request_id, other.positions)
                and self.effect == other.effect)

    def __hash__(self) -> int:
        return hash((self.hook, self.request_id, self.positions, *self.effect[1:]))

    @property
    def effect(self) -> tuple:
        """What it does, hashable: (hook, scale, bias, clamp), vectors by their bytes (computed once)."""
        effect = self.__dict__.get("_effect")
        if effect is None:
            clamp = None if self.clamp is None else (*self.clamp.direction, self.clamp.value)
            effect = (self.hook, *(v if isinstance(v, float) else v.tobytes() for v in (self.scale, self.bias)), clamp)
            object.__setattr__(self, "_effect", effect)
        return effect

    @classmethod
    def from_dict(cls, d: dict) -> "Intervention":
        unknown = set(d) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown intervention fields {sorted(unknown)}")
        if "hook" not in d:
            raise ValueError("an intervention needs a 'hook'")
        positions = d.get("positions")
        if positions is not None:
            positions = tuple(int(p) for p in np.asarray(positions).reshape(-1))
        request_id, clamp = d.get("request_id"), d.get("clamp")
        if clamp is not None and not isinstance(clamp, dict):
            raise ValueError("an intervention's 'clamp' must be a mapping")
        return cls(str(d["hook"]), d.get("scale", 1.0), d.get("bias", 0.0),
                   None if request_id is None else str(request_id), positions,
                   None if clamp is None else FeatureClamp.from_dict(clamp))

    def as_dict(self, arrays: bool = False) -> dict:
        """Plain JSON-able values (intervention logs, files, the wire); ``arrays``: vectors stay numpy
        arrays (an RPC to the engine's worker, which takes them as they are)."""
        def plain(v):
            return v if isinstance(v, float) or arrays else v.tolist()

        d = {"hook": self.hook, "scale": plain(self.scale), "bias": plain(self.bias), "request_id": self.request_id,
             "positions": None if self.positions is None else list(self.positions)}
        if self.clamp is not None:
            d["clamp"] = self.clamp.as_dict(arrays)
        return d

    def vector(self, which: str, width: int) -> np.ndarray:
        v = getattr(self, which)
        return np.full(width, v) if isinstance(v, float) else v

    def applies_to(self, request_id: str) -> bool:
        return self.request_id in (None, request_id)


def _as_vector(v, what: str = "scale and bias") -> Vector:
    if isinstance(v, np.ndarray) and v.dtype == np.float64 and v.ndim == 1 and not v.flags.writeable:
        return v  # already one of ours: shared, never copied
    arr = np.array(v, dtype=np.float64)
    if arr.ndim == 0:
        return float(arr)
    if arr.ndim > 1:
        raise ValueError(f"{what} must be scalars or 1-D vectors, got shape {arr.shape}")
    arr.setflags(write=False)
    return arr


def _same(a: Vector, b: Vector) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a == b if isinstance(a, float) and isinstance(b, float) else False
    return a.shape == b.shape and bool(np.array_equal(a, b))


LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}  # else float32's (check_vector)


def validate(iv: Intervention, widths: dict[str, int], max_position: int, allow_positions: bool,
             dtype: str = "float32") -> None:
    """Raise ValueError with the reason; nothing is changed in the engine when this fails. ``dtype``:
    the engine's, in which its scale and bias tables hold the values."""
    if iv.hook not in widths:
        known = ", ".join(sorted(widths)[:8])
        raise ValueError(f"intervention on {iv.hook!r}, which is not an installed hook point (installed: {known}…)")
    width = widths[iv.hook]
    for which in ("scale", "bias"):
        values = check_vector(iv.vector(which, width), width, f"{which} of the intervention on {iv.hook!r}")
        if np.abs(values).max(initial=0.0) > LARGEST.get(dtype, np.inf):
            raise ValueError(f"{which} of the intervention on {iv.hook!r} holds values beyond ±{LARGEST[dtype]:.5g}, "
                             f"which a {dtype} engine would hold as Inf")
    if iv.clamp is not None:
        if not (_same(iv.scale, 1.0) and _same(iv.bias, 0.0)):
            raise ValueError(f"a feature clamp on {iv.hook!r} stands alone: give its scale and bias as separate "
                             "interventions")
        for which in ("encoder", "decoder"):
            check_vector(getattr(iv.clamp, which), width, f"{which} of the feature clamp on {iv.hook!r}")
    if iv.positions is not None:
        if not allow_positions:
            raise ValueError("position interventions need the engine booted with enable_position_interventions=True")
        if not iv.positions:
            raise ValueError(f"the intervention on {iv.hook!r} names an empty position list")
        bad = [p for p in iv.positions if not 0 <= p < max_position]
        if bad:
            raise ValueError(f"positions {bad[:5]} are out of range [0, {max_position})")


def check_clamp_capacity(interventions: list[Intervention], capacity: int) -> None:
    """An intervention set clamps at most ``capacity`` distinct features per hook (the engine's tables
    hold that many); ValueError with the reason otherwise."""
    directions: dict[str, set] = {}
    for iv in interventions:
        if iv.clamp is not None:
            directions.setdefault(iv.hook, set()).add(iv.clamp.direction)
    for hook, found in directions.items():
        if len(found) > capacity:
            how = ("SessionOptions.feature_clamps, inspector serve --feature-clamps N, or the app's Engine ▸ Room for "
                   "Feature Clamps…, then restart")
            raise ValueError(f"{len(found)} features clamped at {hook!r}, more than the engine's {capacity}: boot it "
                             f"with room for more ({how})" if capacity else
                             f"a feature clamp on {hook!r}, but this engine was booted without room for feature "
                             f"clamps ({how})")
