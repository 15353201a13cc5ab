"""Names for an SAE's features, so a row reads "f123 def · class" rather than a bare id.

Per feature, in order: a ``labels.json`` in the SAE's directory, written by hand or by a labelling
tool; else the feature's top tokens in a corpus scan of that SAE: a scan file the user opened (its
``settings["sae"]["path"]`` is the SAE's directory), else a ``scan.h5`` in the SAE's directory (the
demo SAE ships one). A feature's top tokens are the distinct tokens it fired on in its strongest
examples, most frequent first (ties: the stronger example first), up to three, each made visible and
without its leading space ("def", not " def").

``labels.json`` is one JSON object, feature id (a decimal string) -> label::

    {"0": "Python keywords", "17": "closing brackets", "123": "def · class"}

Ids outside the SAE are harmless (no row ever asks for them); features it leaves out fall back to the
scan's top tokens. A file that is not such an object is a ValueError naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inspector.experiments.scan import BEFORE, ScanState
from inspector.io.scan import read_scan

from .labels import display_token

LABELS_FILE, SCAN_FILE = "labels.json", "scan.h5"
TOP_TOKENS = 3
SEPARATOR = " · "


def feature_label(feature: int, names: dict[int, str] | None = None, prefix: str = "f") -> str:
    """``f123``, or ``f123 def · class`` where ``names`` has a label for it."""
    name = (names or {}).get(feature)
    return f"{prefix}{feature} {name}" if name else f"{prefix}{feature}"


@dataclass(frozen=True)
class FeatureLabels:
    names: dict[int, str]  # feature -> label, only the labelled ones
    sources: tuple[str, ...] = ()  # the files they come from
    problem: str = ""  # a labels file that is there but could not be used, and why

    def label(self, feature: int) -> str:
        return feature_label(feature, self.names)

    def describe(self) -> str:
        """Where the labels come from (and what went wrong), for the Features tab's side note."""
        found = f"labels: {', '.join(Path(s).name for s in self.sources)}" if self.sources else ""
        return "; ".join(part for part in (found, self.problem) if part)


NO_LABELS = FeatureLabels({})


def read_labels_file(path) -> dict[int, str]:
    """The labels of a ``labels.json`` (format in the module's docstring); ValueError naming the file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a JSON object of feature id -> label expected, not {type(data).__name__}")
    names = {}
    for key, label in data.items():
        if not key.isdecimal() or not isinstance(label, str):
            raise ValueError(f"{path}: entry {key!r}: {label!r}: keys must be feature ids (\"123\") and labels "
                             "strings")
        if label.strip():
            names[int(key)] = label.strip()
    return names


def top_tokens(state: ScanState) -> np.ndarray:
    """[units, top] token ids: each unit's distinct activating tokens (window column ``BEFORE``) among
    its top examples, most frequent first, ties in the examples' order (strongest first); -1 pads."""
    tokens = np.where(state.top_documents >= 0, state.top_windows[:, :, BEFORE], -1)  # [U, N]
    same = tokens[:, :, None] == tokens[:, None, :]  # [U, N, N]
    counts = same.sum(axis=2)
    earlier = np.tril(same, k=-1).any(axis=2)  # the token already occurred in a stronger example
    first = (tokens >= 0) & ~earlier
    slots = np.arange(tokens.shape[1])
    order = np.lexsort((np.broadcast_to(slots, tokens.shape), -np.where(first, counts, -1)), axis=1)
    chosen = np.take_along_axis(tokens, order, axis=1)
    return np.where(np.take_along_axis(first, order, axis=1), chosen, -1)


def scan_labels(state: ScanState, vocabulary: dict[int, str]) -> dict[int, str]:
    """unit -> its top tokens joined with " · ", for the units with any examples."""
    tops = top_tokens(state)
    names = {}
    for unit in np.flatnonzero(tops[:, 0] >= 0).tolist():
        pieces = dict.fromkeys(_piece(vocabulary.get(t, f"<{t}>")) for t in tops[unit].tolist()
                               if t >= 0)  # " def" and "def" read the same: one piece
        names[unit] = SEPARATOR.join(list(pieces)[:TOP_TOKENS])
    return names


def _piece(text: str) -> str:
    shown = display_token(text)
    return shown.strip() or shown


def sae_key(path) -> str:
    """One spelling of an SAE directory (scan settings and attached SAEs name it resolved, but a file
    written elsewhere may not)."""
    return str(Path(path).expanduser().resolve())


class LabelBook:
    """The labels of every SAE the app shows, found when first asked for and kept until the files
    behind them change (an edited labels.json shows the next time the Features tab is drawn)."""

    def __init__(self):
        self._found: dict[str, tuple[tuple, FeatureLabels]] = {}  # SAE directory -> (files' stamps, labels)
        self._opened: dict[str, tuple[str, dict[int, str]]] = {}  # SAE directory -> (scan file, its labels)

    def add_scan(self, sae_path, scan_path, names: dict[int, str]) -> None:
        """A scan of the SAE in ``sae_path`` that the user opened: its top tokens label the features
        from now on (before its directory's own scan.h5)."""
        key = sae_key(sae_path)
        self._opened[key] = (str(scan_path), names)
        self._found.pop(key, None)

    def for_sae(self, sae_path) -> FeatureLabels:
        key = sae_key(sae_path)
        directory = Path(key)
        stamps = tuple(_stamp(directory / name) for name in (LABELS_FILE, SCAN_FILE))
        known = self._found.get(key)
        if known is None or known[0] != stamps:
            known = self._found[key] = (stamps, self._read(key, directory))
        return known[1]

    def _read(self, key: str, directory: Path) -> FeatureLabels:
        names, sources, problems = {}, [], []
        scan = self._opened.get(key)
        if scan is None and (directory / SCAN_FILE).is_file():
            try:
                scan = (str(directory / SCAN_FILE), scan_labels_of_file(directory / SCAN_FILE))
            except (OSError, ValueError) as e:
                problems.append(str(e))
        if scan is not None:
            names.update(scan[1])
            sources.append(scan[0])
        if (directory / LABELS_FILE).is_file():
            try:
                names.update(read_labels_file(directory / LABELS_FILE))
                sources.insert(0, str(directory / LABELS_FILE))
            except ValueError as e:
                problems.append(str(e))
        return FeatureLabels(names, tuple(sources), "; ".join(problems))


def scan_labels_of_file(path) -> dict[int, str]:
    """The top-token labels of the SAE scan in ``path``; ValueError (or the reader's error) if it is
    not a scan of an SAE's features."""
    state, settings, vocabulary = read_scan(path)
    if not settings.get("sae"):
        raise ValueError(f"{path} is a scan of a hook's neurons, not of an SAE's features")
    return scan_labels(state, vocabulary)


def _stamp(path: Path) -> tuple:
    try:
        stat = path.stat()
    except OSError:
        return ()
    return stat.st_mtime_ns, stat.st_size
