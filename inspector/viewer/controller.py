"""The app's behaviour without Qt: which runs there are and which is shown, the engine's state and what
each state allows, and every user action from opening a model to exporting a run.

The window is a ``ControllerView``: it draws, asks and tells; the controller decides. Engine work runs
as jobs (``inspector.viewer.jobs``) on an ``engine`` runner that keeps one thread for the engine;
exports run on a ``files`` runner. Both runners deliver results on the GUI thread, so the controller
never needs a lock.
"""

from __future__ import annotations

import enum
import functools
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Protocol

from inspector import client
from inspector.capture import resources
from inspector.capture.dtypes import ROW_DTYPES
from inspector.capture.interventions import Intervention
from inspector.capture.models import DEMO, model_path_problem
from inspector.capture.protocol import (BootProgress, Sampling, SessionError, SessionFactory,
                                        SessionOptions, SessionProtocol, StepEvent)
from inspector.capture.sae import AttachedSae
from inspector.capture.windows import CaptureWindow
from inspector.experiments.compare import Twins, mark_twins, scoped_to_intervened, upcoming_twins
from inspector.experiments.patching import SweepResult

from inspector.net.keys import ClientKeys

from . import jobs, served
from .dashboard import ScanDashboard, open_dashboard
from .feature_labels import LabelBook, sae_key
from .jobs import Cancelled, GenerationResult, LensBox, SessionInfo, TaskState
from .labels import hook_sort_key
from .lens import LensResult
from .patching import PatchingSweep, SweepRequest
from .run_view import RunSource, RunView

DEFAULT_HOOKS = ("blocks.*.hook_resid_post",)
# A live run that could keep more rows than this in memory writes its new rows through to a scratch file
# (RunView.write_through), so that a long run fits: 100,000 tokens of 32 hooks of 4,096 bf16 are 26 GB.
WRITE_THROUGH_BYTES = 512 << 20


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

    def session_changed(self, info: SessionInfo | None, restarted: bool) -> None:
        """A session is ready (``restarted`` False), its hooks changed, or it is gone (None)."""

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
        """``controller.scan`` is the scan in ``path`` now."""

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


class Controller:
    def __init__(self, session_factory: SessionFactory, engine: TaskRunner, files: TaskRunner,
                 view: ControllerView):
        self.factory, self.engine, self.files, self.view = session_factory, engine, files, view
        self.server: tuple[str, ClientKeys | None] | None = None  # connected to a server: (url, keys)
        self.state = AppState.NO_MODEL
        self.session: SessionProtocol | None = None
        self.info: SessionInfo | None = None  # of the session, as last described on the engine thread
        self.options: SessionOptions | None = None  # of the model last opened (kept when it fails)
        self.live = RunView.live({}, {})
        self.shown = self.live
        self.earlier: list[RunView] = []  # live runs of models opened before this one
        self.run_file = None  # the open capture file behind a shown FILE run (inspector.io.RunFile)
        self.interventions: list[Intervention] = []
        self.windows: dict[str, CaptureWindow] = {}  # the user's capture windows, by hook (installed or not)
        self.compared: list[Twins] | None = None  # the twins of the comparison generating now
        self._compared_with: list[Intervention] = []  # the interventions its job was given
        self.boot_started, self.boot_stage = 0.0, ""
        self.generation: GenerationProgress | None = None
        self.last_result: GenerationResult | None = None
        self.last_export: str | None = None
        self._generate_task: TaskState | None = None
        self._export_task: TaskState | None = None
        self._select_new = False
        self._lens_box = LensBox()  # a lens batch for the generation to compute between steps
        self._lens_out = False  # a lens batch is being computed: the next waits, and takes all that is new
        self.lens_problem: str | None = None  # the lens failed with this session: why
        self.sweep = PatchingSweep()  # the Patching tab's sweep, as its job last reported it
        self._sweep_task: TaskState | None = None
        self.patched_cell: Intervention | None = None  # the intervention of the patched run generating now
        self.labels = LabelBook()  # the features' labels of every SAE shown
        self.scan: ScanDashboard | None = None  # the scan the Dashboard shows
        self.write_through_bytes = WRITE_THROUGH_BYTES
        self.served: served.ServedRun | None = None  # the OpenAI server whose captures are watched
        self._served_task: TaskState | None = None

    # ================================================================== state
    def enabled(self, action: Action) -> bool:
        if action is Action.RESTART and self.options is None:
            return False
        return self.state in ENABLED[action]

    def _set_state(self, state: AppState) -> None:
        self.state = state
        self.view.state_changed(state)

    @property
    def mode(self) -> str | None:
        return self.options.mode if self.options else None

    # ================================================================== opening a model
    def open_model(self, model: str, mode: str, hooks=None, **options) -> bool:
        """Boot ``model`` (a directory, a cached hub id or "demo"); ``options`` are SessionOptions fields.
        A path that is plainly not a model directory is refused at once, keeping the current engine."""
        if not self._may_start():
            return False
        if model != DEMO:
            problem = model_path_problem(model)
            if problem:
                self.view.error(f"Cannot open the model: {problem}.", title="Open Model")
                return False
            path = Path(model).expanduser()
            model = str(path.resolve()) if path.exists() else model
        # rows reach the app in step events and live in its own run: the session need not keep a copy
        options = {"retain_rows": False, **options}
        self.server = None
        self._start(self.factory, SessionOptions(model=model, mode=mode, hooks=tuple(hooks or DEFAULT_HOOKS),
                                                 **options), f"Opening {model} ({mode} mode)…")
        return True

    def connect(self, url: str, keys: ClientKeys | None = None) -> bool:
        """Use the engine of the server at ``url`` (shared with its other clients)."""
        if not self._may_start():
            return False
        self.server = (url, keys)

        def remote(options: SessionOptions, progress) -> SessionProtocol:
            return client.connect(url, progress, keys, retain_rows=False)

        self._start(remote, SessionOptions(model=url, hooks=()), f"Connecting to {url}…")
        return True

    def reopen(self, mode: str | None = None, hooks=None, **changes) -> None:
        """Open the current model again (Engine ▸ Restart, a mode switch), keeping its other options but
        ``changes`` (SessionOptions fields); connected to a server, connect again."""
        if self.server is not None:
            self.connect(*self.server)
            return
        o = self.options
        extra = {f.name: getattr(o, f.name) for f in fields(o) if f.name not in ("model", "mode", "hooks")}
        self.open_model(o.model, mode or o.mode, hooks or o.hooks, **{**extra, **changes})

    def _may_start(self) -> bool:
        if self.enabled(Action.OPEN_MODEL):
            return True
        self.view.error("The engine is starting: wait until it is ready.", title="Busy")
        return False

    def _start(self, factory: SessionFactory, options: SessionOptions, status: str) -> None:
        self.options = options
        self._stop_generation()
        self._stop_sweep()
        self._close_session()
        self.boot_started, self.boot_stage = time.perf_counter(), "resolving"
        self._set_state(AppState.BOOTING)
        self.view.status(status)
        self.engine.start(jobs.boot, factory, options, on_partial=self._boot_progress, on_done=self._booted,
                          on_exception=self._boot_failed)

    def check_engine(self) -> None:
        """Notice an engine that went away while idle (a server stopped, its process was killed)."""
        if self.state is AppState.READY and self.session is not None and not self.session.alive:
            self._set_state(AppState.DEAD)
            reason = getattr(self.session, "lost", None) or "it stopped answering"
            self.view.error(f"The engine is gone: {reason}.\n\nEverything captured so far is kept. "
                            "Engine ▸ Restart Engine starts it again.", title="Engine")

    def _boot_progress(self, progress: BootProgress) -> None:
        self.boot_stage = progress.stage
        self.view.boot_progress(progress)

    def _booted(self, result: tuple[SessionProtocol, SessionInfo]) -> None:
        self.session, self.info = result
        self.options = self.info.options
        old_model = self.live.run.metadata.get("model_path")
        if self.live.total_rows() and old_model != self.info.metadata.get("model_path"):
            self._keep_live_as_earlier()  # another model: its captures stay viewable and exportable
        self.live.learn_hooks(self.info.metadata, self.info.installed, list(self.info.catalogue))
        self.boot_stage = "ready"
        self.lens_problem = None
        self._set_state(AppState.READY)
        self.view.session_changed(self.info, restarted=False)
        refused = self.info.metadata.get("refused_kinds") or {}
        # kinds the model's blocks have no point of: the user should know before looking for them
        missing = f"; not offered: {', '.join(sorted(refused))} (the ready label's tooltip says why)" if refused else ""
        self.view.status(f"Model ready in {time.perf_counter() - self.boot_started:.0f} s: {self.options.model}"
                         f"{missing}", 20000 if missing else 8000)
        self._reapply_interventions("opening the model")
        self._send_windows()

    def _boot_failed(self, exc: BaseException) -> None:
        self.session = self.info = None
        self._set_state(AppState.NO_MODEL)
        self.view.session_changed(None, restarted=False)
        self.view.status("Opening the model failed; open another one (File ▸ Open Model…).")
        self.view.error(f"Could not open the model.\n\n{describe_exception(exc, 'opening the model')}",
                        details_of(exc), title="Open Model")

    def _keep_live_as_earlier(self) -> None:
        kept = self.live
        kept.source = RunSource.EARLIER
        kept.label = f"{Path(str(kept.run.metadata.get('model_path', 'model'))).name} (earlier run)"
        self.earlier.append(kept)
        self.live = RunView.live({}, {})
        if self.shown is kept:
            self.shown = self.live
        self.view.shown_changed()
        self.view.status(f"The run captured with {kept.label.removesuffix(' (earlier run)')} is kept under "
                         "View ▸ Earlier Runs (export it to keep it on disk).", 10000)

    def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.engine.start(jobs.close, session, on_exception=self._close_failed)

    def _close_failed(self, exc: BaseException) -> None:
        self.view.error(describe_exception(exc, "closing the engine"), details_of(exc), title="Engine")

    # ================================================================== generating
    def generate(self, prompts: list[str], sampling: Sampling, compare: bool = False,
                 cell: Intervention | None = None) -> bool:
        """``compare``: each prompt twice in the batch, clean and with the interventions (the twins);
        ``cell``: a patching cell's intervention alone, not the user's (``open_patched_cell``)."""
        if not self.enabled(Action.GENERATE):
            self.view.status("Not ready: " + GENERATE_TIPS[self.state], 5000)
            return False
        if not prompts:
            self.view.status("Type a prompt first (one per line).", 5000)
            return False
        if self.shown is not self.live:
            self.show(self.live)
        copies = 2 if compare else 1
        self._write_through_if_long(prompts, sampling.max_tokens, copies)
        self.generation = GenerationProgress(time.perf_counter(), 0, sampling.max_tokens * len(prompts) * copies)
        self._select_new = True
        self._set_state(AppState.GENERATING)
        if compare:
            self.compared, self._compared_with = upcoming_twins(self.session, len(prompts)), list(self.interventions)
            job, args = jobs.compare, (self.session, list(prompts), self._compared_with, sampling)
            if self.interventions:
                self.view.status(f"Comparing {sampling.max_tokens} tokens for {len(prompts)} prompt(s), each run "
                                 "clean and with the interventions…")
            else:
                self.view.status("Compare is on but no intervention is set: the twins will agree. Set one in the "
                                 "Interventions dock to see what it changes.", 15000)
        elif cell is not None:
            self.patched_cell = cell
            job, args = jobs.patched_run, (self.session, prompts[0], cell, sampling)
        else:
            job, args = jobs.generate, (self.session, list(prompts), sampling)
            self.view.status(f"Generating {sampling.max_tokens} tokens for {len(prompts)} prompt(s)…")
        self._generate_task = self.engine.start(
            job, *args, self._lens_box, on_partial=functools.partial(self._generation_news, self.live),
            on_done=self._generated, on_exception=self._generation_failed)
        return True

    def _write_through_if_long(self, prompts: list[str], max_tokens: int, copies: int) -> None:
        """Rows go to disk from this generation on if the run could outgrow ``write_through_bytes``
        (a prompt has at most about as many tokens as characters)."""
        if self.live.spool is not None or self.info is None:
            return
        width = sum(h.width for h in self.info.installed.values())
        itemsize = ROW_DTYPES.get(self.info.options.dtype, ROW_DTYPES["float32"]).itemsize
        coming = sum(len(p) + max_tokens for p in prompts) * copies * width * itemsize
        if self.live.bytes_kept() + coming > self.write_through_bytes:
            self.live.write_through(resources.cache_root() / "spool")
            self.view.status(f"A long run: its rows go to {self.live.spool.path} as they come (read back as "
                             "you look), so that memory stays free. Export saves them.", 10000)

    def stop(self) -> None:
        """Works at any moment: before the first step, mid-generation; a no-op when idle."""
        if self.enabled(Action.STOP):
            self._stop_generation()
            self.view.status("Stopping after the current step…")

    def _stop_generation(self) -> None:
        if self._generate_task is not None:
            self._generate_task.cancel()

    def _generation_news(self, live: RunView, news: StepEvent | LensResult) -> None:
        if isinstance(news, LensResult):
            self._lensed(news)
        else:
            self._event(live, news)

    def _event(self, live: RunView, event: StepEvent) -> None:
        live.apply(event)
        if live is self.live and self.generation is not None:
            self.generation.tokens += sum(len(step.new_token_ids) for step in event.requests)
            if self._select_new and event.started:
                self._select_new = False
                live.select(request=event.started[0].request_id)
        if event.started and self.compared:
            mark_twins(live.run, self.compared)
            if self.state is AppState.GENERATING and self.interventions != self._compared_with:
                # edited before its job set the ones it was given: the edit wins
                self._compared_with = list(self.interventions)
                self.session.set_interventions(self._as_sent(self.interventions))

    def _generation_over(self) -> bool:
        """Whether the generation that just ended is the app's current one (not one a new boot cut short)."""
        self._generate_task = None
        if self._lens_box.take() is not None:  # it ended before computing it: the next paint asks again
            self._lens_out = False
        compared, self.compared = self.compared, None
        if compared and self.state is AppState.GENERATING and self.session.alive:
            self._reapply_interventions("the comparison")  # for all requests again, not its twins alone
        patched, self.patched_cell = self.patched_cell, None
        if patched and self.state is AppState.GENERATING and self.session.alive:
            self._reapply_interventions("the patched run")  # the user's, set aside while it ran
        return self.state is AppState.GENERATING

    def _generated(self, result: GenerationResult) -> None:
        self.last_result = result
        if self._generation_over():
            self._set_state(AppState.READY)
            self.view.generation_finished(result)

    def _generation_failed(self, exc: BaseException) -> None:
        if not self._generation_over():
            return
        alive = self.session is not None and self.session.alive
        self._set_state(AppState.READY if alive else AppState.DEAD)
        self.view.generation_finished(None)
        extra = "" if alive else "\n\nThe engine stopped. Engine ▸ Restart Engine boots it again."
        self.view.error(f"Generation failed.\n\n{describe_exception(exc, 'generating')}\n\n"
                        f"Everything captured so far is kept.{extra}", details_of(exc), title="Generation")

    # ================================================================== hooks, mode, interventions
    def apply_hooks(self, hooks: list[str]) -> None:
        """Capture ``hooks``: live in eager mode; compiled mode asks first (the engine restarts)."""
        if not self.enabled(Action.EDIT_HOOKS):
            return
        if self.mode == "compiled":
            self.view.ask("Restart the engine?",
                          f"Compiled mode bakes the hook points into the engine: capturing {len(hooks)} hook "
                          "point(s) restarts it (about as long as opening the model). Everything captured so "
                          "far is kept.", functools.partial(self._set_hooks, list(hooks)), details="\n".join(hooks))
        else:
            self._set_hooks(list(hooks))

    def _set_hooks(self, hooks: list[str]) -> None:
        self.boot_started = time.perf_counter()
        if self.mode == "compiled":
            self.boot_stage = "compiling"
            self._set_state(AppState.RESTARTING)
        else:
            self.view.status(f"Applying {len(hooks)} hook points…", 3000)
        self.engine.start(jobs.set_hooks, self.session, hooks, on_done=self._hooks_set,
                          on_exception=self._hooks_failed)

    def _hooks_set(self, result: tuple[bool, SessionInfo]) -> None:
        restarted, self.info = result
        self.options = self.info.options
        self.live.learn_hooks(self.info.metadata, self.info.installed, list(self.info.catalogue))
        self._set_state(AppState.READY)
        self.view.session_changed(self.info, restarted)
        how = "engine restarted" if restarted else "applied live"
        self.view.status(f"{len(self.info.installed)} hook points captured ({how}).", 8000)
        if restarted:
            self._reapply_interventions("changing hook points")
        self._send_windows()

    def _hooks_failed(self, exc: BaseException) -> None:
        alive = self.session is not None and self.session.alive
        self._set_state(AppState.READY if alive else AppState.DEAD)
        self.view.hooks_refused(self.info)
        self.view.error(f"Changing hook points failed.\n\n{describe_exception(exc, 'changing hook points')}",
                        details_of(exc), title="Hook points")

    def change_mode(self, mode: str, hooks) -> None:
        """Reopen the model in ``mode`` with ``hooks`` (after asking)."""
        if not self.enabled(Action.CHANGE_MODE):
            self.view.status("Wait for the engine to be idle before switching modes.", 5000)
            return
        if self.server is not None:
            self.view.error("A server's engine mode is its own: start the server in eager mode for live hook "
                            "changes of your own, or open a model to use an engine of your own.", title="Engine mode")
            return
        self.view.ask("Switch engine mode?", f"Switching to {mode} mode restarts the engine with the checked "
                      "hook points. Everything captured so far is kept.",
                      functools.partial(self.reopen, mode, tuple(hooks)))

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """ValueError with the reason if the engine refuses them (then the previous set stays)."""
        if self.session is not None and self.state in (AppState.READY, AppState.GENERATING) and not self.patched_cell:
            self.session.set_interventions(self._as_sent(interventions))
        self.interventions = list(interventions)
        if interventions:
            where = "from the next token" if self.state is AppState.GENERATING else "on the next generation"
            where = f"to the intervened twins {where}" if self.compared else where
            where = "after the patched run" if self.patched_cell else where
            self.view.status(f"{len(interventions)} intervention(s) set; they apply {where}.", 6000)

    def set_windows(self, windows: dict[str, CaptureWindow]) -> None:
        """Capture windows by hook name; the installed hooks' go to the engine at once (from the next
        forward of a generation running now), the others once their hooks are captured."""
        self.windows = {name: w for name, w in windows.items() if not w.is_all}
        if self.state in (AppState.READY, AppState.GENERATING) and self._send_windows():
            where = "from the next token" if self.state is AppState.GENERATING else "on the next generation"
            self.view.status(f"Capture windows set; they apply {where}.", 6000)

    def _send_windows(self) -> bool:
        """The user's windows of the installed hooks to the engine; whether there was a session to send them to."""
        if self.session is None or not self.session.alive:
            return False
        self.session.set_windows({n: w for n, w in self.windows.items() if n in self.session.installed})
        return True

    def _as_sent(self, interventions: list[Intervention]) -> list[Intervention]:
        """What the engine gets: while a comparison generates, the set for its intervened twins only."""
        return scoped_to_intervened(interventions, self.compared) if self.compared else list(interventions)

    def _reapply_interventions(self, doing: str) -> None:
        """The user's interventions to the engine again (none: clear what work of its own left there)."""
        try:
            self.session.set_interventions(list(self.interventions))
        except ValueError as exc:
            self.interventions = []
            self.view.interventions_dropped(f"Interventions were dropped after {doing}: {exc}")

    # ================================================================== sparse autoencoders
    def attach_sae(self, path: str) -> bool:
        """Attach the SAE in directory ``path`` on the engine's thread (to the hook its config names);
        what the engine refuses is an error dialog with its reason."""
        if not self._may_edit_saes():
            return False
        self.view.status(f"Attaching the SAE in {path}…")
        self.engine.start(jobs.attach_sae, self.session, path,
                          on_done=functools.partial(self._sae_attached, self.session),
                          on_exception=functools.partial(self._sae_refused, self.session, "attach"))
        return True

    def detach_sae(self, name: str) -> bool:
        """Stop encoding with SAE ``name``; the features captured so far stay in the run."""
        if not self._may_edit_saes():
            return False
        self.engine.start(jobs.detach_sae, self.session, name,
                          on_done=functools.partial(self._sae_detached, self.session, name),
                          on_exception=functools.partial(self._sae_refused, self.session, "detach"))
        return True

    def can_attach_demo_sae(self) -> bool:
        """The demo model runs here (not on a server: the SAE's path is this machine's), and its SAE
        is not attached yet."""
        if (not self.enabled(Action.EDIT_SAES) or self.server is not None or self.options is None
                or self.options.model != DEMO):
            return False
        demo = sae_key(resources.demo_sae_path())
        return all(sae_key(s.config.path) != demo for s in self.info.saes.values())

    def attach_demo_sae(self) -> bool:
        """The SAE shipped for the demo model; the scan in its directory labels its features."""
        if not self.can_attach_demo_sae():
            self.view.status("Attach Demo SAE: the demo model must be running here and idle (File ▸ Open Demo Model), "
                             "its SAE not attached yet", 8000)
            return False
        return self.attach_sae(str(resources.demo_sae_path()))

    def _may_edit_saes(self) -> bool:
        if self.enabled(Action.EDIT_SAES):
            return True
        self.view.status("Not ready: " + GENERATE_TIPS[self.state], 5000)
        return False

    def _sae_attached(self, session: SessionProtocol, result: tuple[AttachedSae, SessionInfo]) -> None:
        if session is not self.session:  # a model opened meanwhile: that engine is gone
            return
        sae, self.info = result
        info = self.info.installed[sae.hook]
        self.live.note_sae(sae)
        self.view.saes_changed(sae)
        self.view.status(f"SAE {sae.name} attached to {info.alias} ({sae.config.architecture}, {sae.config.d_sae} "
                         f"features, the {sae.k} strongest of each token kept): generate to see them.", 10000)

    def _sae_detached(self, session: SessionProtocol, name: str, info: SessionInfo) -> None:
        if session is not self.session:
            return
        self.info = info
        self.view.saes_changed(None)
        self.view.status(f"SAE {name} detached; the features captured with it stay.", 8000)

    def _sae_refused(self, session: SessionProtocol, verb: str, exc: BaseException) -> None:
        """``verb``: "attach" or "detach"."""
        if session is not self.session:
            return
        self.view.status("")
        if isinstance(exc, ValueError):  # SaeError among them: the message is the reason
            self.view.error(f"Could not {verb} the SAE.\n\n{exc}", title="SAE")
            return
        if not session.alive and self.state is AppState.READY:
            self._set_state(AppState.DEAD)
        self.view.error(f"Could not {verb} the SAE.\n\n{describe_exception(exc, verb + 'ing the SAE')}",
                        details_of(exc), title="SAE")

    # ================================================================== the logit lens
    def can_lens(self, view: RunView) -> bool:
        """Whether the engine can lens ``view``'s rows: it runs the model they were captured with."""
        return (self.session is not None  # while a sweep runs, a lens job waits for it on the engine thread
                and self.state in (AppState.READY, AppState.GENERATING, AppState.PATCHING)
                and self.lens_problem is None
                and view.run.metadata.get("model_path") == self.info.metadata.get("model_path"))

    def follow_lens(self, view: RunView, rid: str | None, hooks: list) -> None:
        """The Lens tab shows ``hooks`` of request ``rid``: lens their rows not lensed yet, all in one
        engine call (between two steps while generating). None while another is out: when it is back,
        the next takes everything that came meanwhile."""
        if self._lens_out or not self.can_lens(view):
            return
        batch = view.lens.pending(view.run, rid, hooks)
        if batch is None:
            return
        self._lens_out = True
        if self.state is AppState.GENERATING:
            self._lens_box.put(batch)
        else:
            self.engine.start(jobs.lens, self.session, batch, on_done=self._lensed)

    def _lensed(self, result: LensResult) -> None:
        self._lens_out = False
        if result.error is None:
            result.batch.target.add(result)
            return
        self.lens_problem = describe_exception(result.error, "computing the logit lens")
        self.view.error(f"The logit lens failed; no more is computed until the engine restarts.\n\n"
                        f"{self.lens_problem}", details_of(result.error), title="Lens")

    def lens_message(self, view: RunView, rid: str | None, hooks: list) -> str | None:
        """Why the Lens tab shows no cells for ``hooks`` of ``rid`` and will not, or None."""
        if view.request(rid) is None:
            return "No request to show"
        if not hooks:
            return ("No residual-stream hook point captured: select a resid_post hook point (Model tree) "
                    "to see the lens")
        if self.lens_problem is not None and not view.lens.has_any(rid, hooks):
            return f"The logit lens failed: {self.lens_problem}"
        if self.can_lens(view) or view.lens.has_any(rid, hooks):
            return None
        if view.source is RunSource.FILE:
            return "No lens stored in this file: capture with --lens K, or open its model, to see it"
        return "The lens needs the model this run was captured with, running: open it again to see it"

    # ================================================================== patching sweeps
    def start_sweep(self, request: SweepRequest) -> bool:
        """Run ``request`` on the engine thread; ``self.sweep`` fills in as cells finish. A sweep and a
        generation never run at once; a request that cannot run says why in ``self.sweep.problem``."""
        if not self.enabled(Action.PATCH):
            self.view.status("Not ready: " + GENERATE_TIPS[self.state], 5000)
            return False
        problem = request.problem()
        if problem:
            self.sweep.fail(problem)
            return False
        self.sweep.start(request, {h: self.info.installed[h] for h in request.hooks}, self.info.metadata)
        self._set_state(AppState.PATCHING)
        self.view.status(f"Patching sweep over {len(request.hooks)} hook points…")
        self._sweep_task = self.engine.start(jobs.sweep, self.session, request, on_partial=self.sweep.news,
                                             on_done=self._swept, on_exception=self._sweep_failed)
        return True

    def stop_sweep(self) -> None:
        """The cells done so far stay, marked incomplete."""
        if self.enabled(Action.STOP_PATCH):
            self._stop_sweep()
            self.view.status("Stopping the sweep after the current engine step…")

    def _stop_sweep(self) -> None:
        if self._sweep_task is not None:
            self._sweep_task.cancel()

    def _sweep_over(self) -> bool:
        """Whether the sweep that just ended is the app's current work (not one a new boot cut short)."""
        self._sweep_task = None
        if self.state is not AppState.PATCHING:
            return False
        alive = self.session.alive
        self._set_state(AppState.READY if alive else AppState.DEAD)
        if alive:
            self._reapply_interventions("the sweep")  # edited while it ran: the engine has the ones from before
        return True

    def _swept(self, result: SweepResult) -> None:
        self.sweep.finish(result)
        if self._sweep_over():
            self.view.status(self.sweep.message, 10000)

    def _sweep_failed(self, exc: BaseException) -> None:
        refused = isinstance(exc, ValueError)  # the request does not fit the session: the session's reason
        self.sweep.fail(str(exc) if refused else describe_exception(exc, "patching"))
        if self._sweep_over() and not refused:
            self.view.error(f"The patching sweep failed.\n\n{self.sweep.problem}\n\nThe cells that ran are kept.",
                            details_of(exc), title="Patching")

    def open_patched_cell(self, row: int, column: int, sampling: Sampling) -> bool:
        """Generate the sweep's target prompt with cell (row, column) patched and nothing else: a run in
        the main views like any other."""
        result = self.sweep.result
        if result is None:
            return False
        hook = result.hooks[row]
        if self.info is not None and (hook not in self.info.installed or self.sweep.metadata.get("model_path")
                                      != self.info.metadata.get("model_path")):
            self.view.error(f"This sweep ran on hook points the engine no longer captures ({hook}): run the sweep "
                            "again to open its cells.", title="Patching")
            return False
        if not self.generate([self.sweep.target_prompt()], sampling, cell=result.cell_intervention(row, column)):
            return False
        where = self.sweep.grid().where(row, column)
        self.view.status(f"Patched run: {where}; your own interventions are not applied to it.", 15000)
        return True

    def save_sweep(self, path: str) -> bool:
        """Write the sweep on show (finished or not) with its run's metadata, off the GUI thread."""
        if self.sweep.result is None:
            self.view.error("No sweep to save yet: run one first.", title="Save sweep")
            return False
        self.files.start(jobs.save_sweep, self.sweep.result, path, self.sweep.metadata, on_done=self._sweep_saved,
                         on_exception=self._sweep_save_failed)
        return True

    def _sweep_saved(self, path: Path) -> None:
        self.view.status(f"Saved the sweep to {path}", 10000)

    def _sweep_save_failed(self, exc: BaseException) -> None:
        self.view.error(f"Saving the sweep failed; nothing was written.\n\n{exc}", title="Save sweep")

    # ================================================================== runs
    def show(self, view: RunView) -> None:
        self.shown = view
        self.view.shown_changed()

    def new_run(self) -> None:
        if not self.enabled(Action.NEW_RUN):
            return
        if self.live.total_rows():
            self.view.ask("Start a new run?", "The captures of the current run are dropped (export them first "
                          "to keep them).", self._new_run)
        else:
            self._new_run()

    def _new_run(self) -> None:
        if self.session is not None:
            self.engine.start(jobs.new_run, self.session)
        info, dropped = self.info, self.live
        self.live = RunView.live(info.metadata, info.installed, list(info.catalogue)) if info else RunView.live({}, {})
        self.show(self.live)
        dropped.close()

    def open_capture(self, path: str) -> bool:
        """Reopen an .h5 capture without any model or engine; values stay on disk until viewed."""
        from inspector.io import open_run

        try:
            run_file = open_run(path)
        except Exception as exc:  # noqa: BLE001 - CaptureFileError and anything unexpected: a dialog
            self.view.error(f"Cannot open the capture.\n\n{exc}", title="Open Capture")
            return False
        if self.run_file is not None:
            self.run_file.close()
        self.run_file = run_file
        self.shown = RunView(run_file.run, RunSource.FILE, str(path),
                             sorted(run_file.run.hooks.values(), key=hook_sort_key))
        self.view.capture_opened(str(path))
        self.view.shown_changed()
        self.view.status(f"Opened {path}: {len(run_file.run.requests)} request(s), "
                         f"{len(run_file.run.hooks)} hook point(s).", 8000)
        return True

    # ================================================================== an OpenAI server's captures
    def watch_served(self, url: str) -> None:
        """Show the captures of an OpenAI server (``inspector serve --openai``) as they arrive: its
        requests that asked for rows, read while they run and again once they end (a watch of another
        server stops)."""
        self.stop_watching()
        self.served = served.ServedRun(url.strip().rstrip("/"))
        self.show(RunView(self.served.run, RunSource.SERVED, f"OpenAI server {self.served.url}"))
        self.view.status(f"Watching {self.served.url} for captures (requests with inspector_capture)…")
        self._look_at_served()

    def stop_watching(self) -> None:
        if self._served_task is not None:
            self._served_task.cancel()
        self._served_task, self.served = None, None

    def _look_at_served(self) -> None:
        watched = self.served
        self._served_task = self.files.start(
            served.look, watched.url, watched.seen, on_done=functools.partial(self._served_news, watched),
            on_exception=functools.partial(self._served_failed, watched))

    def _served_news(self, watched: served.ServedRun, captures: list[served.ServedCapture]) -> None:
        if watched is not self.served:  # stopped, or another server watched since
            return
        new = [c for c in captures if not any(r.startswith(c.id + "/") for r in watched.run.requests)]
        for capture in captures:
            watched.add(capture)
        if captures:  # a new view of the run (its requests changed): the selection stays, or goes to the newest
            shown = self.shown.run is watched.run
            view = RunView(watched.run, RunSource.SERVED, f"OpenAI server {watched.url}")
            if shown:
                view.selection = self.shown.selection
            if new or view.selection.request not in watched.run.requests:
                view.selection.request = next(reversed(watched.run.requests), None)
                hooks = view.hooks_for(view.selection.request)
                view.selection.hook = view.selection.hook if view.selection.hook in {h.name for h in hooks} else (
                    hooks[0].name if hooks else None)
            if shown:
                self.show(view)
                self.view.status(f"{watched.url}: {len(watched.run.requests)} captured request(s), "
                                 f"{len(watched.running)} running")
        self._look_at_served()

    def _served_failed(self, watched: served.ServedRun, exc: BaseException) -> None:
        if watched is not self.served:
            return
        self.stop_watching()
        self.view.error(f"Stopped watching {watched.url}.\n\n{exc}", details_of(exc), title="Watch an OpenAI Server")

    def open_scan(self, path: str) -> bool:
        """Show the corpus scan in ``path`` on the Dashboard; its top tokens label its SAE's features
        everywhere (the SAE's labels.json, if any, over them)."""
        try:
            scan = open_dashboard(path)
        except (OSError, ValueError) as exc:  # CaptureFileError among them: the message is the reason
            self.view.error(f"Cannot open the scan.\n\n{exc}", title="Open Scan")
            return False
        if scan.sae_path:
            self.labels.add_scan(scan.sae_path, path, scan.names)
            scan.set_names(self.labels.for_sae(scan.sae_path).names)
        self.scan = scan
        self.view.scan_opened(str(path))
        self.view.status(f"Opened the scan {path}: {len(scan.units)} of {scan.state.units} units active.", 8000)
        return True

    # ================================================================== export
    def export(self, path: str) -> bool:
        """Write the shown run to ``path`` off the GUI thread, with progress."""
        if self._export_task is not None:
            self.view.error("An export is already running.", title="Export")
            return False
        if not self.shown.run.requests:
            self.view.error("Nothing to export yet: generate first (or open a capture).", title="Export")
            return False
        self._export_task = self.files.start(jobs.export, self.shown.snapshot(), path,
                                             on_progress=self.view.export_progress, on_done=self._exported,
                                             on_exception=self._export_failed)
        self.view.export_progress(0.0)
        return True

    @property
    def exporting(self) -> bool:
        return self._export_task is not None

    def cancel_export(self) -> None:
        if self._export_task is not None:
            self._export_task.cancel()

    def _exported(self, path: Path) -> None:
        self._export_task = None
        self.last_export = str(path)
        self.view.export_progress(None)
        self.view.status(f"Exported to {path}", 10000)

    def _export_failed(self, exc: BaseException) -> None:
        self._export_task = None
        self.view.export_progress(None)
        if isinstance(exc, Cancelled):
            self.view.status("Export cancelled; nothing was written.", 6000)
        else:
            self.view.error(f"Export failed; nothing was written.\n\n{exc}", title="Export")

    # ================================================================== closing
    def shutdown(self, wait: Callable[[], bool]) -> bool:
        """Stop what runs, close the session on its thread; ``wait()`` waits for the runners."""
        self.cancel_export()
        self._stop_generation()
        self._stop_sweep()
        self._close_session()
        done = wait()
        for view in (self.live, *self.earlier):
            view.close()
        if self.run_file is not None:
            self.run_file.close()
            self.run_file = None
        return done


def describe_generation(result: GenerationResult) -> str:
    rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
    if result.stopped:
        return f"Stopped after {result.tokens} tokens ({result.seconds:.1f} s)."
    return f"Generated {result.tokens} tokens in {result.seconds:.1f} s ({rate:.0f} tokens/s)."

