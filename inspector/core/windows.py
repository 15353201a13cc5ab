"""Capture windows: which positions' rows of a hook a request keeps (numpy only).

Users rarely look at every row; a window keeps only the rows they will read, and the engine drops the
others on the device. ``CaptureWindow.keeps`` is the one definition of a window, used by the engine's
worker and by the tests alike.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import numpy as np

from .hooks import HookPoint, installed_name

KINDS = ("all", "generated", "last", "every")
MAX_NUMBER = 2**31 - 1  # beyond any sequence; keeps the engine's position arithmetic in its integers
SYNTAX = "all, generated, last:N or every:K (N, K from 1 to 2147483647)"


@dataclass(frozen=True)
class CaptureWindow:
    """``all``: every position. ``generated``: the rows that predict generated tokens, positions >=
    prompt_len - 1. ``last`` (``last:N``): the prompt's last N positions and every one after, positions
    >= prompt_len - N. ``every`` (``every:K``): positions p with p % K == 0."""

    kind: str = "all"
    n: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown capture window {self.kind!r}: use {SYNTAX}")
        if self.kind in ("last", "every") and not (isinstance(self.n, int) and 1 <= self.n <= MAX_NUMBER):
            raise ValueError(f"capture window {self.kind}:{self.n}: the number must be a whole number; use {SYNTAX}")
        if self.kind in ("all", "generated") and self.n != 0:
            raise ValueError(f"capture window {self.kind} takes no number; use {SYNTAX}")

    @classmethod
    def parse(cls, text: str) -> "CaptureWindow":
        """The window a text names; the same text gives the same (immutable) object, which keeps the
        engine's per-forward grouping of hooks by window cheap."""
        return _parsed(str(text).strip())

    def __str__(self) -> str:
        return f"{self.kind}:{self.n}" if self.kind in ("last", "every") else self.kind

    @property
    def is_all(self) -> bool:
        return self.kind == "all"

    def keeps_all_from(self, prompt_len: int) -> float:
        """The position from which every row is kept (infinity: never; every:K skips rows for good)."""
        if self.kind == "every":
            return 0 if self.n == 1 else np.inf
        return {"all": 0, "generated": prompt_len - 1, "last": prompt_len - self.n}[self.kind]

    def keeps(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """For each position (of a request whose prompt has ``prompt_len`` tokens), whether its row is kept."""
        positions = np.asarray(positions)
        if self.kind == "every":
            return positions % self.n == 0
        return positions >= self.keeps_all_from(prompt_len)


ALL = CaptureWindow()


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> CaptureWindow:
    kind, colon, number = text.lower().partition(":")
    if kind in ("last", "every"):
        if not colon or not number.strip().isdigit():
            raise ValueError(f"capture window {text!r}: {kind} needs a number; use {SYNTAX}")
        return CaptureWindow(kind, int(number))
    if kind not in KINDS:
        raise ValueError(f"unknown capture window {text!r}: use {SYNTAX}")
    if colon:
        raise ValueError(f"capture window {text!r}: {kind} takes no number; use {SYNTAX}")
    return ALL if kind == "all" else CaptureWindow(kind)


def checked_windows(windows: dict[str, CaptureWindow | str], installed: dict[str, HookPoint]
                    ) -> dict[str, CaptureWindow]:
    """``windows`` by installed hook name (given by name or alias), "all" left out; ValueError for an
    unknown hook or a bad window."""
    checked = {}
    for hook, window in windows.items():
        name = installed_name(hook, installed)
        window = window if isinstance(window, CaptureWindow) else CaptureWindow.parse(window)
        if name in checked and checked[name] != window:
            raise ValueError(f"hook {hook!r} is given two windows: {checked[name]} and {window}")
        checked[name] = window
    return {name: window for name, window in checked.items() if not window.is_all}


def parse_window_option(text: str) -> tuple[str, str]:
    """``[PATTERN=]WINDOW`` (the CLI's ``--window``) as (pattern, window text); ValueError if bad."""
    pattern, equals, window = text.rpartition("=")
    pattern = pattern.strip() if equals else "*"
    if not pattern:
        raise ValueError(f"--window {text!r}: the hook pattern before '=' is empty")
    try:
        return pattern, str(CaptureWindow.parse(window))
    except ValueError as e:
        raise ValueError(f"--window {text!r}: {e}") from None  # every window error names the syntax


def windows_from_patterns(pairs, installed: dict[str, HookPoint]) -> dict[str, CaptureWindow]:
    """(glob pattern over hook names and aliases, window text) pairs as windows by installed hook; a
    later pair overrides an earlier one. ValueError for a pattern that matches no installed hook."""
    windows = {}
    for pattern, text in pairs:
        window = CaptureWindow.parse(text)
        hits = [name for name, point in installed.items() if point.matches(pattern)]
        if not hits:
            raise ValueError(f"window pattern {pattern!r} matches no captured hook")
        windows.update(dict.fromkeys(hits, window))
    return {name: window for name, window in windows.items() if not window.is_all}


@contextlib.contextmanager
def every_row(session):
    """The session's capture windows set aside while an experiment reads every row of its hooks (a
    patching sweep's source run, a neuron scan): the user's windows are for what they look at."""
    kept = dict(session.windows)
    if kept:
        session.set_windows({})
    try:
        yield
    finally:
        if kept and session.alive:
            session.set_windows(kept)
