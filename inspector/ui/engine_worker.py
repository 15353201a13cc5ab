"""The engine on its own thread: a QObject wrapping ``Session``, moved to a QThread.

Every call that runs engine code (open, generate, set_hooks, new_run, close) is a slot invoked
through a queued signal, so it runs on the worker thread; results come back as signals carrying
frozen dataclasses and numpy arrays. ``stop`` and ``set_interventions`` are the two exceptions:
the Session documents them as thread-safe, and they must take effect *while* ``generate`` is
running (the worker thread is busy in it then), so the GUI calls them directly.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from .capture_view_model import RequestInfo, SessionInfo, StepUpdate


@dataclass(frozen=True)
class EngineFailure:
    op: str  # "open" | "generate" | "set_hooks" | "interventions" | "close" | "new_run"
    message: str  # one clear sentence for the dialog
    details: str = ""  # traceback for "Show Details…"
    alive: bool = False  # the session is still usable after this failure


@dataclass(frozen=True)
class GenerationResult:
    steps: int
    tokens: int
    stopped: bool
    seconds: float
    error: str | None = None


def default_session_factory(options, progress):
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from inspector.engine.session import Session

    return Session.open(options, progress=progress)


def default_types():
    """SessionOptions and Sampling, imported on the worker thread (the engine import is heavy)."""
    from inspector.engine.session import Sampling, SessionOptions

    return SessionOptions, Sampling


def describe_exception(exc: BaseException, op: str) -> str:
    text = str(exc).strip() or type(exc).__name__
    low = text.lower()
    if isinstance(exc, MemoryError) or "out of memory" in low or "outofmemory" in low.replace(" ", ""):
        return (f"Out of memory while {op_verb(op)}: {text}. Try fewer hook points, fewer tokens, "
                "a smaller max_model_len or the float16 dtype.")
    if type(exc).__name__ == "SessionError":
        return text
    return f"{type(exc).__name__} while {op_verb(op)}: {text}"


def op_verb(op: str) -> str:
    return {"open": "opening the model", "generate": "generating", "set_hooks": "changing hook points",
            "close": "closing the engine", "new_run": "starting a new run",
            "interventions": "setting interventions"}.get(op, op)


class EngineWorker(QObject):
    bootProgress = Signal(object)  # BootProgress
    ready = Signal(object)  # SessionInfo
    stepEvent = Signal(object)  # StepUpdate
    finished = Signal(object)  # GenerationResult
    hooksChanged = Signal(object, bool)  # SessionInfo, restarted
    failed = Signal(object)  # EngineFailure
    closed = Signal()

    def __init__(self, session_factory: Callable | None = None, types: Callable | None = None):
        super().__init__()
        self._factory = session_factory or default_session_factory
        self._types = types or default_types
        self._session = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._interventions: list = []
        self._known: dict[str, dict] = {}  # request id -> log entries already sent, prompt known
        self.engine_threads: set[int] = set()  # threads engine code ran on (tests assert on this)

    # ---- helpers ----
    def _mark(self) -> None:
        self.engine_threads.add(threading.get_ident())

    @property
    def session(self):
        return self._session

    def _info(self) -> SessionInfo:
        s = self._session
        return SessionInfo(options=s.options, catalogue=tuple(s.catalogue), installed=dict(s.installed),
                           metadata=copy.deepcopy(getattr(s.run, "metadata", {}) or {}),
                           thread_id=threading.get_ident())

    def _fail(self, op: str, exc: BaseException) -> None:
        alive = bool(self._session is not None and getattr(self._session, "alive", False))
        self.failed.emit(EngineFailure(op, describe_exception(exc, op), traceback.format_exc(), alive))

    # ---- slots (run on the worker thread) ----
    @Slot(object)
    def open(self, options) -> None:
        """``options``: a dict of SessionOptions fields (the GUI thread never imports the engine)."""
        self._mark()
        self._close_session()
        try:
            if isinstance(options, dict):
                options = self._types()[0](**options)
            session = self._factory(options, self.bootProgress.emit)
        except BaseException as exc:  # noqa: BLE001 - anything the engine throws becomes a dialog
            self._fail("open", exc)
            return
        with self._lock:
            self._session = session
            self._known = {}
        self._reapply_interventions("open")
        self.ready.emit(self._info())

    @Slot(object, object)
    def generate(self, prompts, sampling) -> None:
        self._mark()
        session = self._session
        t0, steps, tokens = time.perf_counter(), 0, 0
        if session is None:
            self.failed.emit(EngineFailure("generate", "No model is loaded: open a model first.", alive=False))
            self.finished.emit(GenerationResult(0, 0, False, 0.0, "no model"))
            return
        if self._stop.is_set():  # Stop pressed before the generation even started
            self.finished.emit(GenerationResult(0, 0, True, 0.0))
            return
        error = None
        try:
            if isinstance(sampling, dict):
                sampling = self._types()[1](**sampling)
            for event in session.generate(list(prompts), sampling):
                self._mark()
                steps += 1
                tokens += sum(len(r.new_token_ids) for r in event.requests)
                self.stepEvent.emit(self._envelope(session, event))
                if self._stop.is_set():
                    session.stop()
        except BaseException as exc:  # noqa: BLE001
            error = describe_exception(exc, "generate")
            self._fail("generate", exc)
        self.finished.emit(GenerationResult(steps, tokens, self._stop.is_set(), time.perf_counter() - t0, error))

    def _envelope(self, session, event) -> StepUpdate:
        new, logs = [], {}
        requests = getattr(session.run, "requests", {})
        for rs in event.requests:
            rid = rs.request_id
            req = requests.get(rid)
            known = self._known.get(rid)
            fresh = known is None
            if fresh:
                known = self._known[rid] = {"log": 0, "prompt": False}
            if not known["prompt"]:
                # the prompt's token ids are known from the request's first output (after any
                # chunked-prefill steps): send the request again once they are there
                info = self._request_info(rid, req)
                if info.prompt_token_ids or fresh:
                    new.append(info)
                known["prompt"] = bool(info.prompt_token_ids)
            if req is not None:
                log = req.intervention_log
                if len(log) > known["log"]:
                    logs[rid] = tuple((int(p), tuple(copy.deepcopy(list(ivs)))) for p, ivs in log[known["log"]:])
                    known["log"] = len(log)
        return StepUpdate(event, tuple(new), logs, threading.get_ident())

    @staticmethod
    def _request_info(rid: str, req) -> RequestInfo:
        if req is None:
            return RequestInfo(rid, "", (), ())
        n_prompt = len(req.prompt_token_ids)
        texts = list(req.token_texts[:n_prompt])
        texts += [f"⟨{t}⟩" for t in req.prompt_token_ids[len(texts):]]
        return RequestInfo(rid, req.prompt, tuple(req.prompt_token_ids), tuple(texts), dict(req.sampling or {}))

    @Slot(object)
    def set_hooks(self, hooks) -> None:
        self._mark()
        session = self._session
        if session is None:
            self.failed.emit(EngineFailure("set_hooks", "No model is loaded.", alive=False))
            return
        try:
            restarted = bool(session.set_hooks(list(hooks)))
        except BaseException as exc:  # noqa: BLE001
            self._fail("set_hooks", exc)
            return
        if restarted:
            self._reapply_interventions("set_hooks")
        self.hooksChanged.emit(self._info(), restarted)

    @Slot()
    def new_run(self) -> None:
        self._mark()
        if self._session is None:
            return
        try:
            self._session.new_run()
            self._known = {}
        except BaseException as exc:  # noqa: BLE001
            self._fail("new_run", exc)

    @Slot()
    def close(self) -> None:
        self._mark()
        self._close_session()
        self.closed.emit()

    def _close_session(self) -> None:
        with self._lock:
            session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except BaseException as exc:  # noqa: BLE001
                self.failed.emit(EngineFailure("close", describe_exception(exc, "close"), traceback.format_exc()))

    def _reapply_interventions(self, op: str) -> None:
        if not self._interventions:
            return
        try:
            self._session.set_interventions(list(self._interventions))
        except ValueError as exc:
            self._interventions = []
            self.failed.emit(EngineFailure("interventions", f"Interventions were dropped after {op_verb(op)}: {exc}",
                                           alive=True))

    # ---- thread-safe direct calls (GUI thread) ----
    def request_stop(self) -> None:
        self._stop.set()
        with self._lock:
            session = self._session
        if session is not None:
            session.stop()

    def clear_stop(self) -> None:
        self._stop.clear()

    def set_interventions(self, interventions: list) -> None:
        """Validated at once by the session (ValueError with the reason); applied before the next forward."""
        with self._lock:
            session = self._session
            if session is not None:
                session.set_interventions(list(interventions))
            self._interventions = list(interventions)


class EngineController(QObject):
    """GUI-thread handle: owns the thread and the worker, queues calls onto it."""

    _open = Signal(object)
    _generate = Signal(object, object)
    _set_hooks = Signal(object)
    _new_run = Signal()
    _close = Signal()

    def __init__(self, session_factory: Callable | None = None, types: Callable | None = None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker(session_factory, types)
        self.worker.moveToThread(self.thread)
        self._open.connect(self.worker.open)
        self._generate.connect(self.worker.generate)
        self._set_hooks.connect(self.worker.set_hooks)
        self._new_run.connect(self.worker.new_run)
        self._close.connect(self.worker.close)
        self.thread.start()

    def __del__(self):
        # A window dropped without closeEvent (garbage-collected, killed) must not take a running
        # QThread down with it: Qt aborts the process when a running QThread is destroyed.
        # No queued close here (nothing may be emitted while objects are being collected): stop any
        # generation and end the thread's event loop once its current slot returns.
        try:
            if self.thread.isRunning():
                self.worker.request_stop()
                self.thread.quit()
                self.thread.wait()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing more can be done
            pass

    # signals, re-exported for convenience
    @property
    def signals(self) -> EngineWorker:
        return self.worker

    def open(self, options) -> None:
        self._open.emit(options)

    def generate(self, prompts: list[str], sampling) -> None:
        self.worker.clear_stop()
        self._generate.emit(list(prompts), sampling)

    def stop(self) -> None:
        self.worker.request_stop()

    def set_interventions(self, interventions: list) -> None:
        self.worker.set_interventions(interventions)

    def set_hooks(self, hooks: list[str]) -> None:
        self._set_hooks.emit(list(hooks))

    def new_run(self) -> None:
        self._new_run.emit()

    def shutdown(self, timeout_ms: int = 180000) -> bool:
        """Stop any generation, close the session on its thread, and end the thread."""
        try:
            if not self.thread.isRunning():
                return True
        except RuntimeError:  # the C++ thread object is already gone
            return True
        self.worker.request_stop()
        self._close.emit()
        self.thread.quit()
        return self.thread.wait(timeout_ms)
