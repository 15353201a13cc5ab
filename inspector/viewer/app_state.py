"""The app's states and what each allows, what the controller needs from the window and its runners,
and the sentences its dialogs say. Shared by the controller's parts (``inspector.viewer.controller``).
"""

from __future__ import annotations

import enum
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from inspector.core.protocol import BootProgress, SessionError
from inspector.core.sae import AttachedSae

from .jobs import GenerationResult, SessionInfo, TaskState

if TYPE_CHECKING:
    from .controller import Controller


class AppState(enum.Enum):
    NO_MODEL = "no model"
    BOOTING = "booting"
    READY = "ready"
    GENERATING = "generating"
    RESTARTING = "restarting"
    PATCHING = "patching"  # a patching sweep runs on the engine
    DEAD = "dead"  # the engine failed; its captures are kept


class Action(enum.Enum):
    OPEN_MODEL = "open a model"
    RESTART = "restart the engine"
    GENERATE = "generate"
    STOP = "stop generating"
    NEW_RUN = "start a new run"
    EDIT_HOOKS = "change hook points"
    CHANGE_MODE = "switch the engine mode"
    PATCH = "run a patching sweep"
    STOP_PATCH = "stop the patching sweep"
    EDIT_SAES = "attach or detach a sparse autoencoder"


S = AppState
ENABLED: dict[Action, frozenset[AppState]] = {
    Action.OPEN_MODEL: frozenset({S.NO_MODEL, S.READY, S.GENERATING, S.PATCHING, S.DEAD}),
    Action.RESTART: frozenset({S.NO_MODEL, S.READY, S.DEAD}),  # once a model was opened
    Action.GENERATE: frozenset({S.READY}),
    Action.STOP: frozenset({S.GENERATING}),
    Action.NEW_RUN: frozenset({S.NO_MODEL, S.READY, S.DEAD}),
    Action.EDIT_HOOKS: frozenset({S.READY}),
    Action.CHANGE_MODE: frozenset({S.NO_MODEL, S.READY, S.DEAD}),
    Action.PATCH: frozenset({S.READY}),
    Action.STOP_PATCH: frozenset({S.PATCHING}),
    Action.EDIT_SAES: frozenset({S.READY}),
}
# What the Generate button says in each state, and what the plots say while the live run is empty.
GENERATE_TIPS = {S.NO_MODEL: "Open a model first (File ▸ Open Model…)", S.BOOTING: "The engine is starting…",
                 S.RESTARTING: "The engine is restarting…", S.DEAD: "The engine stopped: Engine ▸ Restart Engine",
                 S.GENERATING: "Generating…", S.READY: "Generate (Ctrl+Enter)",
                 S.PATCHING: "A patching sweep is running (Patching tab ▸ Stop)"}
EMPTY_TEXT = {S.BOOTING: "The model is starting…", S.RESTARTING: "The engine is restarting…",
              S.NO_MODEL: "No model: File ▸ Open Model…, or File ▸ Open Capture… to view a saved run",
              S.DEAD: "The engine stopped: Engine ▸ Restart Engine",
              S.READY: "Type a prompt below and press Generate", S.GENERATING: "Generating: rows appear as they arrive…",
              S.PATCHING: "Type a prompt below and press Generate once the patching sweep is over"}


class TaskRunner(Protocol):
    def start(self, job: Callable, *args, on_done: Callable | None = None, on_partial: Callable | None = None,
              on_progress: Callable | None = None, on_exception: Callable | None = None) -> TaskState:
        """Run ``job(*args, state)`` off the GUI thread; the callbacks are called on the GUI thread."""


class ControllerView(Protocol):
    """What the controller needs from the window."""

    def state_changed(self, state: AppState) -> None: ...

    def boot_progress(self, progress: BootProgress) -> None: ...

    def session_changed(self, info: SessionInfo, restarted: bool) -> None:
        """A session is ready (``restarted`` False), or its hooks changed."""

    def server_unreachable(self, url: str, reason: str) -> None:
        """The server's engine is gone: offer to connect to it again (``engine.reconnect``) or to another."""

    def shown_changed(self) -> None:
        """Another run is shown, or the list of runs changed."""

    def hooks_refused(self, info: SessionInfo) -> None:
        """A hook change failed: ``info`` has the hooks the engine still captures."""

    def generation_finished(self, result: GenerationResult | None) -> None:
        """None: it failed."""

    def interventions_dropped(self, message: str) -> None: ...

    def saes_changed(self, attached: AttachedSae | None) -> None:
        """An SAE was attached (``attached``) or detached: ``info.saes`` lists the ones attached now."""

    def capture_opened(self, path: str) -> None: ...

    def scan_opened(self, path: str) -> None:
        """``controller.runs.scan`` is the scan in ``path`` now."""

    def export_progress(self, fraction: float | None) -> None:
        """0..1 while an export runs; None once it is over."""

    def status(self, text: str, ms: int = 0) -> None: ...

    def error(self, text: str, details: str = "", title: str = "Error") -> None: ...

    def ask(self, title: str, text: str, on_yes: Callable[[], None], details: str = "") -> None: ...


@dataclass
class GenerationProgress:
    started: float
    tokens: int
    total: int

    @property
    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-6)


def stage_text(state: AppState, info: SessionInfo | None, server: str = "",
               progress: GenerationProgress | None = None) -> str:
    """The status bar's word on an engine that is up: "Ready" only while it is idle; while it generates,
    how far it got."""
    if state is S.GENERATING:
        return f"Generating · {progress.tokens} of {progress.total} tokens" if progress else "Generating…"
    if state is S.PATCHING:
        return "Patching sweep running…"
    if info is None:
        return ""
    return f"Ready · {len(info.installed)} hook points · {info.options.mode}" + (f" · {server}" if server else "")


def describe_exception(exc: BaseException, doing: str) -> str:
    """One clear sentence for a dialog."""
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, MemoryError) or "out of memory" in text.lower():
        return (f"Out of memory while {doing}: {text}. Try fewer hook points, fewer tokens, "
                "a smaller max_model_len or the float16 dtype.")
    if isinstance(exc, SessionError):
        return text
    return f"{type(exc).__name__} while {doing}: {text}"


def details_of(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


class ControllerPart:
    """One job of the controller: it reaches the others through the controller that composes them."""

    def __init__(self, app: "Controller"):
        self.app, self.view = app, app.view

    @property
    def engine(self):
        return self.app.engine

    @property
    def runs(self):
        return self.app.runs

    @property
    def generating(self):
        return self.app.generating

    @property
    def experiments(self):
        return self.app.experiments


def describe_generation(result: GenerationResult) -> str:
    rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
    if result.stopped:
        return f"Stopped after {result.tokens} tokens ({result.seconds:.1f} s)."
    return f"Generated {result.tokens} tokens in {result.seconds:.1f} s ({rate:.0f} tokens/s)."

