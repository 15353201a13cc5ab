"""Hook points as every layer sees them: the plugin's catalogue, the session, the app and the files."""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import asdict, dataclass

from .attention import AttentionGeometry
from .routing import Routing


def matches_pattern(name: str, alias: str, pattern: str) -> bool:
    """How a hook selection picks points, everywhere: a glob on the stable name or on the
    TransformerLens-style alias."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(alias, pattern)


def check_patterns(patterns, points) -> None:
    """ValueError for the first hook pattern that matches none of ``points`` (HookPoints)."""
    points = list(points)
    for pattern in patterns:
        if not any(p.matches(pattern) for p in points):
            raise ValueError(f"hook pattern {pattern!r} matches no hook point of this model")


RESIDUAL_KINDS = ("resid_pre", "resid_mid", "resid_post")  # the residual stream: what the logit lens reads
ATTENTION_KINDS = ("q", "k")  # what the attention kernel receives: patterns are recomputed from them
ROUTER_KIND = "router"  # a mixture-of-experts layer's router logits: the chosen experts are recomputed from them


@dataclass(frozen=True)
class HookPoint:
    """Where an activation can be read and replaced: ``name`` is stable (``<module path>.<kind>``),
    ``alias`` is TransformerLens's name for it, ``layer`` is -1 outside the blocks and ``dtype`` is the
    engine's dtype its rows are captured in; ``attention`` is the layer's geometry on the queries and keys
    (``q``/``k`` kinds), which attention patterns are recomputed from, and ``routing`` a mixture-of-experts
    layer's rule on its router logits (``router`` kind), which the chosen experts are recomputed from; a
    ``withdrawn`` point failed the boot probe's identities and cannot be installed, an ``unsteerable`` one
    reads right but the probe's steering round trip showed an edit there would not act on the stream."""

    name: str
    alias: str
    module_path: str
    kind: str
    width: int
    layer: int = -1
    dtype: str = "float32"
    attention: AttentionGeometry | None = None
    withdrawn: str = ""  # why the boot probe found this point not to mean what its kind says ("" = it does)
    routing: Routing | None = None
    shards: int = 1  # tensor parallel: its columns are split in this many slices over the ranks (1: replicated)
    unsteerable: str = ""  # why an intervention here would not act as its kind says ("" = it would): read only

    def matches(self, pattern: str) -> bool:
        return matches_pattern(self.name, self.alias, pattern)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HookPoint":
        attention, routing = d.get("attention"), d.get("routing")
        return cls(str(d["name"]), str(d["alias"]), str(d["module_path"]), str(d["kind"]), int(d["width"]),
                   int(d.get("layer", -1)), str(d.get("dtype", "float32")),
                   AttentionGeometry(**attention) if attention else None, str(d.get("withdrawn", "")),
                   Routing.from_dict(routing) if routing else None, int(d.get("shards", 1)),
                   str(d.get("unsteerable", "")))


def installed_name(name_or_alias: str, installed: dict[str, HookPoint]) -> str:
    """The installed hook a name or alias refers to (ValueError if none)."""
    if name_or_alias in installed:
        return name_or_alias
    for name, info in installed.items():
        if info.alias == name_or_alias:
            return name
    close = difflib.get_close_matches(name_or_alias, [*installed, *(info.alias for info in installed.values())], n=3)
    raise ValueError(f"{name_or_alias!r} is not an installed hook point"
                     + (f"; did you mean {', '.join(close)}?" if close else ""))
