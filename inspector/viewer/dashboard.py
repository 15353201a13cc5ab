"""The Dashboard tab without Qt: a corpus scan (``inspector scan``, docs/scan-format.md) unit by unit.

The units (an SAE's features, or a hook's neurons) that were active somewhere, strongest first and
searchable by id or label; for one unit its strongest examples as text with the activating token
marked, and the histogram of all its activations; and a header saying what was scanned and whether
the scan is finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inspector.experiments.scan import AFTER, BEFORE, BINS, ScanState
from inspector.io.scan import read_scan

from .feature_labels import feature_label, scan_labels
from .labels import display_token

WINDOW = BEFORE + 1 + AFTER


@dataclass(frozen=True)
class Example:
    """One of a unit's strongest activations, with the text around it."""

    activation: float
    document: int  # the corpus index
    position: int  # the token's position in its document
    before: str  # the tokens before the activating one, as running text
    token: str  # the activating token, made visible
    after: str


@dataclass(frozen=True)
class Histogram:
    edges: np.ndarray  # [BINS + 1]
    counts: np.ndarray  # [BINS]
    below: int  # activations below the first edge
    above: int  # and above the last

    def overflow_text(self) -> str:
        """The counts the bars leave out, in words."""
        return (f"{self.below} below {self.edges[0]:.3g} and {self.above} above {self.edges[-1]:.3g} "
                f"(outside the bars); {int(self.counts.sum()) + self.below + self.above} activations in all")


class ScanDashboard:
    def __init__(self, path: str, state: ScanState, settings: dict, vocabulary: dict[int, str]):
        self.path, self.state, self.settings, self.vocabulary = path, state, settings, vocabulary
        self.sae: dict | None = settings.get("sae") or None
        self.prefix = "f" if self.sae else "n"  # a feature or a neuron
        ids = np.flatnonzero(state.top_documents[:, 0] >= 0)
        self.units = ids[np.lexsort((ids, -state.top_activations[ids, 0]))]  # strongest first; never active: out
        self.names = scan_labels(state, vocabulary)

    @property
    def sae_path(self) -> str | None:
        return self.sae.get("path") if self.sae else None

    def set_names(self, names: dict[int, str]) -> None:
        """Labels from elsewhere (the SAE's labels.json over the scan's top tokens)."""
        self.names = names

    def label(self, unit: int) -> str:
        return feature_label(unit, self.names, self.prefix)

    def peak(self, unit: int) -> float:
        return float(self.state.top_activations[unit, 0])

    def search(self, text: str) -> list[int]:
        """The units whose label contains ``text`` (any case), strongest first; a unit whose id is
        ``text`` (with or without its f/n) comes first."""
        query = text.strip().lower()
        if not query:
            return self.units.tolist()
        exact = query.removeprefix(self.prefix)
        first = [int(exact)] if exact.isdecimal() and int(exact) in set(self.units.tolist()) else []
        return first + [u for u in self.units.tolist() if query in self.label(u).lower() and u not in first]

    def examples(self, unit: int) -> list[Example]:
        s = self.state
        filled = np.flatnonzero(s.top_documents[unit] >= 0)
        return [Example(float(s.top_activations[unit, i]), int(s.top_documents[unit, i]), int(s.top_positions[unit, i]),
                        *self._window_text(s.top_windows[unit, i])) for i in filled.tolist()]

    def _window_text(self, window: np.ndarray) -> tuple[str, str, str]:
        text = [self.vocabulary.get(t, f"<{t}>") if t >= 0 else "" for t in window.tolist()]
        return running_text("".join(text[:BEFORE])), display_token(text[BEFORE]), running_text("".join(text[BEFORE + 1:]))

    def histogram(self, unit: int) -> Histogram | None:
        """None before the first batch fixed the edges."""
        if self.state.edges is None:
            return None
        counts = self.state.histogram[unit]
        return Histogram(np.asarray(self.state.edges, np.float64), counts[1:-1], int(counts[0]), int(counts[-1]))

    def describe_unit(self, unit: int) -> str:
        counts = int(self.state.histogram[unit].sum())
        if self.state.top_documents[unit, 0] < 0:
            return f"{self.label(unit)}: not active anywhere in the {self.state.documents_done} documents scanned"
        what = "among the token's strongest features at" if self.sae else "seen at"
        return f"{self.label(unit)}: strongest {self.peak(unit):.3f}; {what} {counts} tokens"

    def header(self) -> str:
        s, settings = self.state, self.settings
        parts = [f"Scan {Path(self.path).name}", f"model {settings.get('model', '?')}", f"hook {settings.get('hook', '?')}"]
        if self.sae:
            k = settings.get("sae_k")
            parts.append(f"SAE {Path(str(self.sae.get('path', '?'))).name} ({self.sae.get('d_sae', s.units)} features"
                         + (f", the {k} strongest per token" if k else "") + ")")
        else:
            parts.append(f"{s.units} neurons")
        total = settings.get("documents")
        parts.append(f"{s.documents_done} of {total} documents" if total else f"{s.documents_done} documents")
        parts.append(f"{s.tokens_done} tokens")
        parts.append(f"{len(self.units)} of {s.units} units active, top {s.top} kept each")
        return " · ".join(parts)

    def unfinished(self) -> str:
        """What a scan that stopped early says ("" once it went through its corpus)."""
        total = self.settings.get("documents")
        if total is None or self.state.documents_done >= total:
            return ""
        return (f"Unfinished: {self.state.documents_done} of {total} documents scanned so far (the same "
                "inspector scan command resumes it)")


def open_dashboard(path) -> ScanDashboard:
    """The scan in ``path``; CaptureFileError (an OSError) or ValueError with the reason if it is not one."""
    state, settings, vocabulary = read_scan(path)
    expected = {"top_activations": (state.units, state.top), "top_windows": (state.units, state.top, WINDOW),
                "histogram": (state.units, BINS + 2)}
    for name, shape in expected.items():
        if getattr(state, name).shape != shape:
            raise ValueError(f"{path}: {name} is {list(getattr(state, name).shape)}, not {list(shape)}")
    return ScanDashboard(str(path), state, settings, vocabulary)


def running_text(text: str) -> str:
    """Tokens' text on one line: line breaks and tabs as glyphs, spaces kept."""
    return text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥")
