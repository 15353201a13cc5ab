"""Activation patching sweeps: every (hook point × position) cell a request of one batch.

A cell runs the target prompt with one hook point's activation at one position replaced (scale 0,
bias = the source prompt's activation there), scoped to that cell's request by our per-request,
per-position intervention slots, so a whole grid is one batched prefill of the compiled engine
instead of a loop of forward passes. Denoising patches clean activations into the corrupted prompt;
noising patches corrupted ones into the clean prompt. Either way the metric is normalised so that
0 is the corrupted run and 1 the clean run.

Works on any ``SessionProtocol`` (in-process, remote, fake) through its public calls only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from inspector.core.hooks import installed_name
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionProtocol, StepEvent
from inspector.core.windows import every_row

DIRECTIONS = ("denoise", "noise")  # clean → corrupted, corrupted → clean


@dataclass(frozen=True)
class Metric:
    """At the last position: the logprob of ``answer``, or with a ``foil`` the logit difference
    answer − foil (equal to their logprob difference: the normaliser cancels)."""

    answer: int
    foil: int | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        return (self.answer,) if self.foil is None else (self.answer, self.foil)

    def of(self, logprobs: np.ndarray) -> float:
        """The metric from the logprobs of ``token_ids``."""
        return float(logprobs[0] if self.foil is None else logprobs[0] - logprobs[1])

    def describe(self) -> str:
        return f"logprob of {self.answer}" if self.foil is None else f"logit difference {self.answer} − {self.foil}"


def metric_from_text(answer: str, foil: str | None, tokenize: Callable[[str], list[int]],
                     token_texts: Callable[[list[int]], list[str]]) -> Metric:
    """The metric of typed answer and foil tokens (a session's ``tokenize`` and ``token_texts``);
    ValueError saying which text is not one token and how it splits, or that the two are the same."""
    token = single_token("answer", answer, tokenize, token_texts)
    other = single_token("foil", foil, tokenize, token_texts) if foil else None
    if other == token:
        raise ValueError(f"The answer and the foil are the same token ({answer!r}): pick another foil.")
    return Metric(token, other)


def single_token(role: str, text: str, tokenize: Callable[[str], list[int]],
                 token_texts: Callable[[list[int]], list[str]]) -> int:
    """The one token id of ``text``; ValueError naming the pieces it splits into."""
    ids = list(tokenize(text))
    if len(ids) == 1:
        return int(ids[0])
    if not ids:
        raise ValueError(f"The {role} {text!r} is no token at all: type the token's text.")
    pieces = " + ".join(repr(t) for t in token_texts(ids))
    raise ValueError(f"The {role} {text!r} is {len(ids)} tokens, not one: {pieces}. The metric scores a single "
                     "next token: type one token (often a leading space and a short word).")


@dataclass(frozen=True)
class PatchSpec:
    clean: str
    corrupted: str  # must be as many tokens long as ``clean``
    hooks: tuple[str, ...]  # the grid's rows: installed hook names or aliases (e.g. every layer's resid_pre)
    metric: Metric
    direction: str = "denoise"
    positions: tuple[int, ...] | None = None  # the grid's columns; None: every position

    @property
    def source_and_target(self) -> tuple[str, str]:
        """Where patched activations come from, and the prompt they are patched into."""
        return (self.clean, self.corrupted) if self.direction == "denoise" else (self.corrupted, self.clean)


@dataclass
class SweepResult:
    """A sweep's outcome, filled as cells finish: ``raw`` is NaN where a cell has not run (yet)."""

    spec: PatchSpec
    hooks: list[str]  # installed names, the grid's rows
    positions: np.ndarray  # the grid's columns
    token_ids: dict[str, list[int]]  # "clean", "corrupted": the prompts' tokens
    token_texts: dict[str, list[str]]
    source: np.ndarray  # [hooks, positions, width]: the activations each cell patches in
    clean_metric: float
    corrupted_metric: float
    raw: np.ndarray  # [hooks, positions]: the metric of each patched run
    engine_calls: int = 0
    cells_per_call: int = 0  # at most, as the engine's slots allow
    stopped: bool = False
    settings: dict = field(default_factory=dict)

    @property
    def normalized(self) -> np.ndarray:
        """0 = the corrupted run, 1 = the clean run (NaN if the two runs do not differ)."""
        span = self.clean_metric - self.corrupted_metric
        if not np.isfinite(span) or abs(span) < 1e-6:
            return np.full_like(self.raw, np.nan)
        return (self.raw - self.corrupted_metric) / span

    @property
    def done(self) -> int:
        return int(np.isfinite(self.raw).sum())

    @property
    def complete(self) -> bool:
        return self.done == self.raw.size

    def cell_intervention(self, row: int, column: int) -> Intervention:
        """The patch of one cell, for every request (scope it before use)."""
        return Intervention(self.hooks[row], 0.0, self.source[row, column], None, (int(self.positions[column]),))


SweepProgress = Callable[[SweepResult, str], None]  # the result so far, and what is happening


def patch(session: SessionProtocol, spec: PatchSpec, progress: SweepProgress | None = None,
          cancelled: Callable[[], bool] = lambda: False) -> SweepResult:
    """Run a sweep on ``session``. To end it early with the cells done so far, make ``cancelled()``
    true and call ``session.stop()`` (from any thread). The session's interventions and run are as before afterwards; the sweep runs the
    model without them. ValueError for a spec that does not fit the session."""
    report = progress or (lambda result, message: None)
    hooks, metric_ids = _checked(session, spec)
    user_interventions, runs_before = session.interventions, set(session.run.requests)
    try:
        session.set_interventions([])
        result = _baselines(session, spec, hooks, metric_ids)
        report(result, f"baselines: clean {result.clean_metric:.4g}, corrupted {result.corrupted_metric:.4g}")
        if not result.stopped:
            _cells(session, spec, result, report, cancelled)
        return result
    finally:
        session.set_interventions(user_interventions)
        for rid in set(session.run.requests) - runs_before:
            del session.run.requests[rid]


def _checked(session: SessionProtocol, spec: PatchSpec) -> tuple[list[str], tuple[int, ...]]:
    if spec.direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {spec.direction!r}")
    if not spec.hooks:
        raise ValueError("a sweep needs at least one hook point")
    hooks = []
    for hook in spec.hooks:
        try:
            hooks.append(installed_name(hook, session.installed))
        except ValueError:
            raise ValueError(f"{hook!r} is not captured now: install it first (set_hooks)") from None
    if len(set(hooks)) != len(hooks):
        raise ValueError("a hook point appears twice in the sweep")
    clean, corrupted = session.tokenize(spec.clean), session.tokenize(spec.corrupted)
    if len(clean) != len(corrupted):
        raise ValueError(f"the clean and corrupted prompts must be as many tokens long: {len(clean)} vs "
                         f"{len(corrupted)} (clean {session.token_texts(clean)}, corrupted "
                         f"{session.token_texts(corrupted)})")
    try:
        session.token_texts(list(spec.metric.token_ids))
    except ValueError as e:
        raise ValueError(f"the metric's tokens {list(spec.metric.token_ids)} are not all in the vocabulary: {e}") from None
    return hooks, spec.metric.token_ids


def _sampling(metric_ids: tuple[int, ...], capture: bool) -> Sampling:
    return Sampling(max_tokens=1, temperature=0.0, logprobs=0, capture=capture, score_token_ids=metric_ids)


def _baselines(session: SessionProtocol, spec: PatchSpec, hooks: list[str], metric_ids) -> SweepResult:
    """Both prompts once, captured: the activations to patch in, and the metric's two ends."""
    rids = session.upcoming_request_ids(2)
    names = dict(zip(rids, ("clean", "corrupted")))
    starts, rows, scores, stopped = {}, {}, {}, False
    with every_row(session):
        for event in session.generate([spec.clean, spec.corrupted], _sampling(metric_ids, capture=True)):
            stopped |= _collect(event, names, starts, scores)
            for step in event.requests:
                for hook, (positions, _, values) in step.rows.items():
                    if hook in hooks:
                        rows.setdefault((names[step.request_id], hook), []).append((positions, values))
    n = len(starts["clean"].prompt_token_ids)
    if len(starts["corrupted"].prompt_token_ids) != n:
        raise ValueError("the clean and corrupted prompts must be as many tokens long")
    positions = np.arange(n) if spec.positions is None else np.asarray(spec.positions, dtype=np.int64)
    if len(positions) == 0 or positions.min() < 0 or positions.max() >= n:
        raise ValueError(f"positions must lie in [0, {n}), the prompts' tokens")
    source_name = "clean" if spec.direction == "denoise" else "corrupted"
    source = np.stack([_at(rows.get((source_name, hook), []), positions, hook) for hook in hooks])
    last = n - 1
    metric = {name: spec.metric.of(scores[name][last]) if last in scores.get(name, {}) else float("nan")
              for name in ("clean", "corrupted")}
    return SweepResult(
        spec, hooks, positions,
        {name: list(s.prompt_token_ids) for name, s in starts.items()},
        {name: list(s.prompt_texts) for name, s in starts.items()},
        source, metric["clean"], metric["corrupted"], np.full((len(hooks), len(positions)), np.nan),
        stopped=stopped, settings={"max_slots": session.options.max_slots, "metric": spec.metric.describe()})


def _cells(session: SessionProtocol, spec: PatchSpec, result: SweepResult, report: SweepProgress,
           cancelled: Callable[[], bool]) -> None:
    """Every cell, in as few engine calls as the slots allow: each call holds at most ``max_slots - 1``
    cells per hook point, so no forward can run out of slots whatever the scheduler batches."""
    per_hook = session.options.max_slots - 1
    columns = len(result.positions)
    calls = [range(start, min(start + per_hook, columns)) for start in range(0, columns, per_hook)]
    result.cells_per_call = len(result.hooks) * min(per_hook, columns)
    _, target = spec.source_and_target
    last = len(result.token_ids["clean"]) - 1
    for number, span in enumerate(calls):
        if cancelled():
            result.stopped = True
            return
        cells = [(row, column) for column in span for row in range(len(result.hooks))]  # spread over hooks
        rids = session.upcoming_request_ids(len(cells))
        session.set_interventions([replace(result.cell_intervention(row, column), request_id=rid)
                                   for rid, (row, column) in zip(rids, cells)])
        where = dict(zip(rids, cells))
        report(result, f"engine call {number + 1} of {len(calls)}: {len(cells)} patched runs")
        for event in session.generate([target] * len(cells), _sampling(result.spec.metric.token_ids, False)):
            for step in event.requests:
                result.stopped |= step.finish_reason == "stopped"
                if step.scores is not None and last in step.scores[0].tolist():
                    row, column = where[step.request_id]
                    k = step.scores[0].tolist().index(last)
                    result.raw[row, column] = spec.metric.of(step.scores[1][k])
            report(result, f"engine call {number + 1} of {len(calls)}: {result.done} of {result.raw.size} cells")
        result.engine_calls += 1
        if result.stopped:
            return


def _collect(event: StepEvent, names: dict[str, str], starts: dict, scores: dict) -> bool:
    """Note the starts and scores of ``event``'s requests (by role); True if one was stopped."""
    for start in event.started:
        if start.request_id in names:
            starts[names[start.request_id]] = start
    stopped = False
    for step in event.requests:
        if step.request_id not in names:
            continue
        stopped |= step.finish_reason == "stopped"
        if step.scores is not None:
            scores.setdefault(names[step.request_id], {}).update(zip(step.scores[0].tolist(), step.scores[1]))
    return stopped


def _at(pieces: list[tuple[np.ndarray, np.ndarray]], positions: np.ndarray, hook: str) -> np.ndarray:
    """A hook's rows at ``positions`` from a request's captured pieces."""
    if not pieces:
        raise ValueError(f"no rows of {hook} came back for the source prompt")
    where = np.concatenate([p for p, _ in pieces])
    values = np.concatenate([v for _, v in pieces])
    found = {int(p): k for k, p in enumerate(where)}
    missing = [int(p) for p in positions if int(p) not in found]
    if missing:
        raise ValueError(f"{hook} has no rows at positions {missing[:5]} of the source prompt")
    return values[[found[int(p)] for p in positions]]
