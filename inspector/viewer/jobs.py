"""Work that runs off the GUI thread, written without Qt (Orange3's split).

A job is a plain function ``job(*args, state)``: it reports partial results and progress through
``state`` and checks ``state.cancelled`` between pieces of work. ``inspector.ui.tasks`` runs jobs on
a thread of their own and hands their results back on the GUI thread; tests can call them directly.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from inspector.core.hooks import HookPoint
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionFactory, SessionOptions, SessionProtocol, StepEvent
from inspector.core.run import Run
from inspector.core.sae import AttachedSae
from inspector.experiments.compare import compare as compare_twins
from inspector.experiments.patching import SweepResult, patch
from inspector.io import write_run
from inspector.io.sweep import write_sweep

from .lens import LENS_K, LensBatch, LensResult
from .patching import SweepNews, SweepRequest


class Cancelled(Exception):
    """A job stopped because it was asked to."""


class TaskState:
    """A running job's line to whoever started it; thread-safe."""

    def __init__(self, on_partial: Callable[[object], None] = lambda value: None,
                 on_progress: Callable[[float], None] = lambda fraction: None):
        self._on_partial, self._on_progress = on_partial, on_progress
        self._cancelled = threading.Event()

    def set_partial_result(self, value) -> None:
        self._on_partial(value)

    def set_progress(self, fraction: float) -> None:
        self._on_progress(fraction)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def raise_if_cancelled(self) -> None:
        if self.cancelled:
            raise Cancelled()


@dataclass(frozen=True)
class SessionInfo:
    """What the app shows of a session, read on the thread that owns it."""

    options: SessionOptions
    catalogue: tuple[HookPoint, ...]
    installed: dict[str, HookPoint]
    metadata: dict
    saes: dict[str, AttachedSae]  # by name: the SAEs encoding installed hooks' rows


@dataclass(frozen=True)
class GenerationResult:
    steps: int
    tokens: int
    stopped: bool
    seconds: float


def describe(session: SessionProtocol) -> SessionInfo:
    return SessionInfo(session.options, tuple(session.catalogue), dict(session.installed),
                       dict(session.run.metadata), dict(session.saes))


def boot(factory: SessionFactory, options: SessionOptions, state: TaskState) -> tuple[SessionProtocol, SessionInfo]:
    """Boot stages arrive as partial results. Cancelled meanwhile (the app is closing), the new session
    is closed again."""
    session = factory(options, state.set_partial_result)
    if state.cancelled:
        session.close()
        raise Cancelled()
    return session, describe(session)


class LensBox:
    """A lens batch handed from the GUI thread to a generation, which computes it between two steps:
    the engine thread is busy generating, and only it may call the engine meanwhile."""

    def __init__(self):
        self._lock = threading.Lock()
        self._batch: LensBatch | None = None

    def put(self, batch: LensBatch) -> None:
        with self._lock:
            self._batch = batch

    def take(self) -> LensBatch | None:
        with self._lock:
            batch, self._batch = self._batch, None
        return batch


def generate(session: SessionProtocol, prompts: list[str], sampling: Sampling, lens_box: LensBox,
             state: TaskState) -> GenerationResult:
    """Step events arrive as partial results, and so does the lens of a batch put in ``lens_box``
    (a ``LensResult``, after the next step); cancelling stops the generation after the current step
    (its final event still arrives)."""
    return _stream(session, lambda: session.generate(prompts, sampling), lens_box, state)


def compare(session: SessionProtocol, prompts: list[str], interventions: list[Intervention], sampling: Sampling,
            lens_box: LensBox, state: TaskState) -> GenerationResult:
    """``generate``, each prompt twice: a clean twin and one with ``interventions``, in one batch
    (``inspector.experiments.compare``)."""
    return _stream(session, lambda: compare_twins(session, prompts, interventions, sampling)[1], lens_box, state)


def patched_run(session: SessionProtocol, prompt: str, cell: Intervention, sampling: Sampling, lens_box: LensBox,
                state: TaskState) -> GenerationResult:
    """``generate`` of ``prompt`` with one patching cell's intervention alone, scoped to its request
    (the controller gives the engine the user's interventions again once it ends)."""
    def start() -> Iterator[StepEvent]:
        rid, = session.upcoming_request_ids(1)
        session.set_interventions([replace(cell, request_id=rid)])
        return session.generate([prompt], sampling)

    return _stream(session, start, lens_box, state)


def sweep(session: SessionProtocol, request: SweepRequest, state: TaskState) -> SweepResult:
    """A patching sweep of ``request`` (its tokens are checked here: tokenizing is the session's work).
    A copy of the result arrives as a partial result (``SweepNews``) with each engine step;
    cancelling stops the engine call under way, and the cells done so far are the result."""
    spec = request.spec(session.tokenize, session.token_texts)

    def progress(result: SweepResult, message: str) -> None:
        if state.cancelled:
            session.stop()
        state.set_partial_result(SweepNews.of(result, message))

    return patch(session, spec, progress, lambda: state.cancelled)


def _stream(session: SessionProtocol, start: Callable[[], Iterator[StepEvent]], lens_box: LensBox,
            state: TaskState) -> GenerationResult:
    t0, steps, tokens = time.perf_counter(), 0, 0
    if state.cancelled:  # stopped before it started
        return GenerationResult(0, 0, True, 0.0)
    for event in start():
        state.set_partial_result(event)
        steps += 1
        tokens += sum(len(step.new_token_ids) for step in event.requests)
        if state.cancelled:
            session.stop()
        batch = lens_box.take()
        if batch is not None:
            state.set_partial_result(lens(session, batch, state))
    return GenerationResult(steps, tokens, state.cancelled, time.perf_counter() - t0)


def lens(session: SessionProtocol, batch: LensBatch, state: TaskState) -> LensResult:
    """The top ``LENS_K`` tokens of each row and the rank of the token that came next (where known),
    with the texts of the tokens named that the run does not know yet (its ``texts`` change only on
    the GUI thread, and only once this result is back). A failure is part of the result: a
    generation that lenses between its steps goes on."""
    try:
        # a next token not known yet (-1) asks about token 0 instead: RunLens.add drops its rank
        result = session.lens(batch.values, LENS_K, chosen=np.maximum(batch.chosen, 0))
        new = [i for i in np.unique(result.top_ids).tolist() if i not in batch.target.texts]
        return LensResult(batch, result, dict(zip(new, session.token_texts(new))) if new else {})
    except Exception as exc:  # noqa: BLE001 - shown by the GUI thread
        return LensResult(batch, error=exc)


def set_hooks(session: SessionProtocol, patterns: list[str], state: TaskState) -> tuple[bool, SessionInfo]:
    """(whether the engine restarted, the session afterwards)."""
    restarted = session.set_hooks(patterns)
    return restarted, describe(session)


def attach_sae(session: SessionProtocol, path: str, state: TaskState) -> tuple[AttachedSae, SessionInfo]:
    """(the SAE attached, the session afterwards): the hook is the one its config names, k the default."""
    sae = session.attach_sae(path)
    return sae, describe(session)


def detach_sae(session: SessionProtocol, name: str, state: TaskState) -> SessionInfo:
    session.detach_sae(name)
    return describe(session)


def new_run(session: SessionProtocol, state: TaskState) -> None:
    session.new_run()


def close(session: SessionProtocol, state: TaskState) -> None:
    session.close()


def export(run: Run, path: str, state: TaskState) -> Path:
    """Write ``run`` to ``path`` with progress; cancelling leaves nothing at ``path``."""
    def progress(fraction: float) -> None:
        state.raise_if_cancelled()
        state.set_progress(fraction)

    return write_run(run, path, progress=progress)


def save_sweep(result: SweepResult, path: str, metadata: dict, state: TaskState) -> Path:
    """Write a patching sweep (finished or not) with the metadata of the run it ran on."""
    return write_sweep(result, path, metadata)
