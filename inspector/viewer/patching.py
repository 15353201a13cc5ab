"""The Patching tab without Qt: which hook points form a sweep's rows, the typed answer and foil checked
as single tokens, a running sweep's latest snapshot, and the layers × positions grid the tab draws.

A sweep (``inspector.experiments.patching.patch``) runs on the engine thread and fills its result in
place; what crosses to the GUI thread is a copy (``SweepNews``), so the tab never reads an array the
engine thread writes. The tab repaints from the newest copy on a timer, never per engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

import numpy as np

from inspector.core.hooks import HookPoint
from inspector.experiments.patching import PatchSpec, SweepResult, metric_from_text

from .labels import display_token, short_hook_label

PATCH_KINDS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")  # in the order a block computes
DIRECTIONS = {"denoise": "denoise: clean → corrupted", "noise": "noise: corrupted → clean"}
EFFECT, METRIC = "effect (0 = corrupted, 1 = clean)", "metric"
MODES = (EFFECT, METRIC)


def patch_kinds(catalogue: Iterable[HookPoint]) -> list[str]:
    """The kinds of ``PATCH_KINDS`` the model has in its blocks (and can patch: read-only points cannot)."""
    offered = {h.kind for h in catalogue if h.layer >= 0 and not h.withdrawn and not h.unsteerable}
    return [kind for kind in PATCH_KINDS if kind in offered]


def kind_rows(points: Iterable[HookPoint], kind: str) -> list[HookPoint]:
    """``points`` of ``kind``, ordered by layer: a sweep's rows, top to bottom."""
    return sorted((h for h in points if h.kind == kind and h.layer >= 0), key=lambda h: h.layer)


def uncaptured(catalogue: Iterable[HookPoint], installed: dict[str, HookPoint], kind: str) -> list[HookPoint]:
    """The hook points of ``kind`` the engine could capture but does not."""
    return [h for h in kind_rows(catalogue, kind) if h.name not in installed and not h.withdrawn]


def rows_note(rows: list[HookPoint], missing: list[HookPoint], kind: str) -> str:
    """What the tab says of the rows a sweep of ``kind`` would have."""
    if not rows:
        return f"No {kind} hook point is captured: capture them to patch there."
    if missing:
        return f"Rows: {kind} of {len(rows)} of {len(rows) + len(missing)} layers (the others are not captured)."
    return f"Rows: {kind} of all {len(rows)} layers."


@dataclass(frozen=True)
class SweepRequest:
    """A sweep as the user typed it. Turned into a ``PatchSpec`` on the engine thread: tokenizing is
    the session's work."""

    clean: str
    corrupted: str
    answer: str
    foil: str  # "": none, the metric is the answer's logprob
    hooks: tuple[str, ...]  # installed names, ordered by layer
    direction: str = "denoise"

    def problem(self) -> str | None:
        """What is missing before any token is looked at, or None."""
        if not self.clean.strip() or not self.corrupted.strip():
            return "Type both prompts: the clean one and the corrupted one."
        if not self.answer:
            return "Type the answer token: the clean prompt's expected next token (mind its spaces)."
        if not self.hooks:
            return "No hook point of this kind is captured: capture them first."
        return None

    def spec(self, tokenize: Callable[[str], list[int]], token_texts: Callable[[list[int]], list[str]]) -> PatchSpec:
        """The spec to run; ValueError saying which token is not a single one, and how it splits."""
        return PatchSpec(self.clean, self.corrupted, self.hooks,
                         metric_from_text(self.answer, self.foil, tokenize, token_texts), self.direction)


def target_of(spec: PatchSpec) -> str:
    """The prompt a sweep's cells run, by name: denoising patches the corrupted one, noising the clean one."""
    return "corrupted" if spec.direction == "denoise" else "clean"


@dataclass(frozen=True)
class SweepNews:
    """A sweep as the engine thread last saw it (a copy), and what ``patch`` said it was doing."""

    result: SweepResult
    message: str

    @classmethod
    def of(cls, result: SweepResult, message: str) -> "SweepNews":
        return cls(replace(result, raw=result.raw.copy()), message)


class PatchingSweep:
    """The tab's sweep: the newest copy of its result, what it is doing, and why it stopped or failed.
    Changed on the GUI thread only; ``revision`` tells the tab's timer when to repaint."""

    def __init__(self):
        self.result: SweepResult | None = None
        self.request: SweepRequest | None = None  # what the result on show was asked as
        self.labels: dict[str, str] = {}  # hook name -> row label
        self.metadata: dict = {}  # of the run the sweep ran on: saved with it
        self.message = ""  # the progress line
        self.problem = ""  # why the last sweep was refused or failed
        self.running = False
        self.revision = 0
        self._next: tuple = ()  # the request, labels and metadata of a started sweep without news yet

    def _changed(self) -> None:
        self.revision += 1

    def start(self, request: SweepRequest, points: dict[str, HookPoint], metadata: dict) -> None:
        """A sweep was started; the previous result stays on show until the first news of this one."""
        self._next = (request, {name: short_hook_label(h) for name, h in points.items()}, dict(metadata))
        self.running, self.problem = True, ""
        self.message = "Running the clean and corrupted prompts…"
        self._changed()

    def news(self, news: SweepNews) -> None:
        if self._next:
            (self.request, self.labels, self.metadata), self._next = self._next, ()
        self.result, self.message = news.result, news.message
        self._changed()

    def finish(self, result: SweepResult) -> None:
        self.news(SweepNews(result, ""))
        self.running = False
        self.message = self.outcome()
        self._changed()

    def fail(self, problem: str) -> None:
        """The sweep was refused or failed; a result from before (or the cells that ran) stays."""
        self.running, self.problem, self._next = False, problem, ()
        self.message = self.outcome() if self.result is not None else ""
        self._changed()

    def forget_problem(self) -> None:
        """The reason shown no longer applies: the input it was about was edited, or its session is gone."""
        if self.problem:
            self.problem = ""
            self._changed()

    @property
    def progress(self) -> tuple[int, int]:
        """(cells done, cells) of the running sweep; (0, 0) before its first news (or when none runs)."""
        if not self.running or self._next or self.result is None:
            return 0, 0
        return self.result.done, self.result.raw.size

    def outcome(self) -> str:
        r = self.result
        ends = f"clean {r.clean_metric:.3g}, corrupted {r.corrupted_metric:.3g}"
        if not np.isfinite(r.normalized).any() and r.done:
            return (f"The clean and corrupted prompts give the same metric ({ends}): the effect is undefined. "
                    "Choose prompts whose answers differ.")
        if r.complete:
            return f"Done: {r.done} cells in {r.engine_calls} engine call(s) · {ends}"
        how = "Stopped" if r.stopped else "Incomplete"
        return f"{how}: {r.done} of {r.raw.size} cells ran (the others are blank) · {ends}"

    def grid(self) -> "PatchGrid | None":
        r = self.result
        if r is None:
            return None
        return PatchGrid([self.labels.get(h, h) for h in r.hooks], r.token_texts[target_of(r.spec)],
                         np.asarray(r.positions), r.normalized, r.raw)

    def target_prompt(self) -> str:
        _, target = self.result.spec.source_and_target
        return target

    def details(self, cell: tuple[int, int] | None) -> list[str]:
        """The side panel's lines: what the result measures, its two ends, and the cell clicked."""
        r, q = self.result, self.request
        if r is None or q is None:
            return ["No sweep yet."]
        metric = f"logit difference {q.answer!r} − {q.foil!r}" if q.foil else f"logprob of {q.answer!r}"
        lines = [f"metric: {metric}", f"clean run: {r.clean_metric:.4g}", f"corrupted run: {r.corrupted_metric:.4g}",
                 f"{DIRECTIONS[r.spec.direction]} (patched into the {target_of(r.spec)} prompt)"]
        if cell is not None:
            lines += ["", self.grid().describe(*cell).replace(" · ", "\n")]
        return lines


@dataclass(frozen=True)
class PatchGrid:
    """What the Patching tab draws: a row per hook point (by layer), a column per patched position of
    the target prompt. Cell (r, c) is the metric of the run patched at that hook and position."""

    labels: list[str]
    tokens: list[str]  # the target prompt's token texts
    positions: np.ndarray  # [columns]
    normalized: np.ndarray  # [rows, columns]: 0 = the corrupted run, 1 = the clean run; NaN: not run
    raw: np.ndarray  # [rows, columns]: the metric itself

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape

    def colour_values(self, mode: str) -> np.ndarray:
        """The effect on a diverging scale: -1 → 0, 0 (corrupted) → the middle, 1 (clean) → 1."""
        with np.errstate(invalid="ignore"):
            return np.clip((self.normalized + 1) / 2, 0, 1)

    def cell_text(self, mode: str, r: int, c: int) -> str:
        value = (self.normalized if mode == EFFECT else self.raw)[r, c]
        return f"{value:.2f}" if np.isfinite(value) else ""

    def input(self, c: int) -> str:
        p = int(self.positions[c])
        return display_token(self.tokens[p]) if p < len(self.tokens) else ""

    def where(self, r: int, c: int) -> str:
        return f"{self.labels[r]} · position {int(self.positions[c])} {self.input(c)!r}"

    def describe(self, r: int, c: int) -> str:
        where = self.where(r, c)
        if not np.isfinite(self.raw[r, c]):
            return f"{where} · not run"
        effect = self.normalized[r, c]
        text = f"effect {effect:.3f}" if np.isfinite(effect) else "effect undefined"
        return f"{where} · {text} (0 = corrupted, 1 = clean) · metric {self.raw[r, c]:.4g}"
