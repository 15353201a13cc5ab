"""Named steering vectors of a served engine: registered at start (``NAME=FILE@HOOK``, or an SAE's
feature as ``NAME=SAE_DIR#FEATURE``) or at run time over HTTP, and looked up by requests by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inspector.core.interventions import FeatureClamp
from inspector.core.sae import decoder_row, feature_clamp, read_sae
from inspector.core.vectors import check_vector, load_vector

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class NamedVector:
    name: str
    hook: str  # an installed hook's name (an alias given is resolved when registered)
    vector: np.ndarray  # float64, the hook's width
    source: str  # where it came from, for people: a file, an SAE feature, "http"
    clamp: FeatureClamp | None = None  # an SAE feature's: what clamping it needs (its value set per request)
    unclampable: str = "it is not an SAE feature (register one as NAME=SAE_DIR#FEATURE)"  # why clamp is None

    def summary(self) -> dict:
        return {"name": self.name, "hook": self.hook, "width": int(self.vector.shape[0]),
                "norm": float(np.linalg.norm(self.vector)), "source": self.source, "clampable": self.clamp is not None}


def split_vector_spec(spec: str) -> tuple[str, str, str, str]:
    """``NAME=FILE@HOOK`` → (name, file, "@", hook); ``NAME=SAE_DIR#FEATURE`` → (name, dir, "#", feature)."""
    name, sep, where = spec.partition("=")
    if not sep or not where:
        raise ValueError(f"--vectors {spec!r}: write NAME=FILE@HOOK or NAME=SAE_DIR#FEATURE")
    check_name(name)
    path, mark, rest = where.rpartition("#" if "#" in where else "@")
    if not mark or not path or not rest:
        raise ValueError(f"--vectors {spec!r}: write NAME=FILE@HOOK (the hook the vector is added at) or "
                         "NAME=SAE_DIR#FEATURE")
    if mark == "#" and not rest.isdigit():
        raise ValueError(f"--vectors {spec!r}: the feature after '#' must be a number")
    return name, path, mark, rest


def absolute_vector_spec(spec: str) -> str:
    """The spec with its file or directory made absolute (the server may run elsewhere)."""
    name, path, mark, rest = split_vector_spec(spec)
    return f"{name}={Path(path).expanduser().resolve()}{mark}{rest}"


@dataclass(frozen=True)
class VectorSpec:
    """What a ``--vectors`` spec names, read: the hook as given (a name or alias), and for an SAE's feature
    what clamping it needs (or why it cannot be clamped)."""

    name: str
    hook: str
    vector: np.ndarray
    source: str
    clamp: FeatureClamp | None = None
    unclampable: str = NamedVector.unclampable


def parse_vector_spec(spec: str) -> VectorSpec:
    """The vector a spec names; ValueError with the reason."""
    name, path, mark, rest = split_vector_spec(spec)
    if mark == "@":
        return VectorSpec(name, rest, load_vector(path, what=f"vector {name!r}"), path)
    config = read_sae(path)
    if not config.hook:
        raise ValueError(f"--vectors {spec!r}: the SAE in {path} does not say which hook it reads")
    try:
        clamp, unclampable = feature_clamp(config, int(rest), 0.0), ""
    except ValueError as e:
        clamp, unclampable = None, str(e)
    return VectorSpec(name, config.hook, decoder_row(config, int(rest)), f"{config.name}#{rest}", clamp, unclampable)


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise ValueError(f"vector name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")


class VectorRegistry:
    """Name → vector. A request resolves its names when it arrives, so replacing a vector changes what
    later requests get, never one that runs."""

    def __init__(self):
        self._vectors: dict[str, NamedVector] = {}

    def add(self, name: str, hook: str, values, source: str, widths: dict[str, int], clamp: FeatureClamp | None = None,
            unclampable: str = NamedVector.unclampable) -> NamedVector:
        """Register (or replace) ``name``; ``hook`` must be installed (``widths``: installed name → width)."""
        check_name(name)
        if hook not in widths:
            raise ValueError(f"vector {name!r}: {hook!r} is not a hook this server compiled "
                             f"(see GET /inspector/v1/hooks)")
        vector = check_vector(values, widths[hook], f"vector {name!r}")
        vector.setflags(write=False)
        found = self._vectors[name] = NamedVector(name, hook, vector, source, clamp, unclampable)
        return found

    def remove(self, name: str) -> None:
        if self._vectors.pop(name, None) is None:
            raise KeyError(name)

    def get(self, name: str) -> NamedVector:
        found = self._vectors.get(name)
        if found is None:
            known = ", ".join(sorted(self._vectors)) or "none"
            raise ValueError(f"no vector named {name!r} is registered (registered: {known})")
        return found

    def summaries(self) -> list[dict]:
        return [v.summary() for v in sorted(self._vectors.values(), key=lambda v: v.name)]
