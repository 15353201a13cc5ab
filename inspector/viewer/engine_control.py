"""The engine's lifecycle and what each of its states allows: opening a model or connecting to a server,
booting, restarting, noticing an engine that went away, the hook points captured and the engine mode,
capture windows, and the sparse autoencoders attached.
"""

from __future__ import annotations

import functools
import time
from dataclasses import fields
from pathlib import Path

from inspector import client
from inspector.core import resources
from inspector.core.models import DEMO, model_path_problem
from inspector.core.protocol import BootProgress, BootTimes, SessionFactory, SessionOptions, SessionProtocol
from inspector.core.sae import AttachedSae
from inspector.core.windows import CaptureWindow
from inspector.net.keys import ClientKeys

from . import jobs
from .app_state import ENABLED, GENERATE_TIPS, Action, AppState, ControllerPart, describe_exception, details_of
from .feature_labels import sae_key
from .jobs import SessionInfo

DEFAULT_HOOKS = ("blocks.*.hook_resid_post",)


class EngineControl(ControllerPart):
    def __init__(self, app, session_factory: SessionFactory):
        super().__init__(app)
        self.factory, self.tasks = session_factory, app.engine_tasks
        self.server: tuple[str, ClientKeys | None] | None = None  # connected to a server: (url, keys)
        self.lost_reason = ""  # why the engine last went away, or could not be reached
        self.state = AppState.NO_MODEL
        self.session: SessionProtocol | None = None
        self.info: SessionInfo | None = None  # of the session, as last described on the engine thread
        self.options: SessionOptions | None = None  # of the model last opened (kept when it fails)
        self.windows: dict[str, CaptureWindow] = {}  # the user's capture windows, by hook (installed or not)
        self.boot_started, self.boot_stage = 0.0, ""
        self.boot_times = BootTimes()  # of the last boot: the stages' seconds, said when it is ready

    def enabled(self, action: Action) -> bool:
        if action is Action.RESTART and self.options is None:
            return False
        return self.state in ENABLED[action]

    def set_state(self, state: AppState) -> None:
        self.state = state
        self.view.state_changed(state)

    @property
    def mode(self) -> str | None:
        return self.options.mode if self.options else None

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
        # the same server again: its model, as last described, names the window until it answers
        known = self.options if self.server is not None and self.server[0] == url else None
        self.server = (url, keys)

        def remote(options: SessionOptions, progress) -> SessionProtocol:
            return client.connect(url, progress, keys, retain_rows=False)

        self._start(remote, known or SessionOptions(model=url, hooks=()), f"Connecting to {url}…")
        return True

    def reconnect(self) -> bool:
        """Connect again to the server last used."""
        return self.server is not None and self.connect(*self.server)

    def reopen(self, mode: str | None = None, hooks=None, **changes) -> None:
        """Open the current model again (Engine ▸ Restart, a mode switch), keeping its other options but
        ``changes`` (SessionOptions fields). Connected to a server: connect again while it answers; once it
        is gone the user chooses (a dead address would only be dialled until the connect deadline)."""
        if self.server is not None:
            if self.session is not None and self.session.alive:
                self.connect(*self.server)
            else:
                self.view.server_unreachable(self.server[0], self.lost_reason or "it stopped answering")
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
        self.generating.cancel()
        self.experiments.cancel_sweep()
        self.close_session()
        self.boot_started, self.boot_stage, self.boot_times = time.perf_counter(), "resolving", BootTimes()
        self.set_state(AppState.BOOTING)
        self.view.status(status)
        self.tasks.start(jobs.boot, factory, options, on_partial=self._boot_progress, on_done=self._booted,
                          on_exception=self._boot_failed)

    def check_engine(self) -> None:
        """Notice an engine that went away while idle (a server stopped, its process was killed)."""
        if self.state is AppState.READY and self.session is not None and not self.session.alive:
            self.set_state(AppState.DEAD)
            reason = self.lost_reason = getattr(self.session, "lost", None) or "it stopped answering"
            self.view.error(f"The engine is gone: {reason}.\n\nEverything captured so far is kept. "
                            "Engine ▸ Restart Engine starts it again.", title="Engine")

    def _boot_progress(self, progress: BootProgress) -> None:
        self.boot_stage = progress.stage
        self.boot_times.lap(progress.stage)
        self.view.boot_progress(progress)

    def _booted(self, result: tuple[SessionProtocol, SessionInfo]) -> None:
        self.session, self.info = result
        self.options = self.info.options
        old_model = self.runs.live.run.metadata.get("model_path")
        if self.runs.live.total_rows() and old_model != self.info.metadata.get("model_path"):
            self.runs.keep_live_as_earlier()  # another model: its captures stay viewable and exportable
        self.runs.live.learn_hooks(self.info.metadata, self.info.installed, list(self.info.catalogue))
        self.boot_stage = "ready"
        self.experiments.lens_problem = None
        self.set_state(AppState.READY)
        self.view.session_changed(self.info, restarted=False)
        refused = self.info.metadata.get("refused_kinds") or {}
        # kinds the model's blocks have no point of: the user should know before looking for them
        missing = f"; not offered: {', '.join(sorted(refused))} (the ready label's tooltip says why)" if refused else ""
        stages = self.boot_times.summary()
        self.view.status(f"Model ready in {time.perf_counter() - self.boot_started:.0f} s"
                         f"{f' ({stages})' if stages else ''}: {self.options.model}{missing}", 20000 if missing else 8000)
        self.generating.reapply_interventions("opening the model")
        self.send_windows()

    def _boot_failed(self, exc: BaseException) -> None:
        """The views keep the last engine's hook points (the tree, the interventions' names) until
        another engine replaces them."""
        self.session = self.info = None
        self.lost_reason = describe_exception(exc, "connecting" if self.server else "opening the model")
        self.set_state(AppState.NO_MODEL)
        if self.server is not None:
            self.view.status("Connecting failed; Engine ▸ Restart Engine tries again (File ▸ Connect to Server…: "
                             "another one).")
            self.view.error(f"Could not connect to the server at {self.server[0]}.\n\n{self.lost_reason}",
                            details_of(exc), title="Connect to Server")
            return
        self.view.status("Opening the model failed; open another one (File ▸ Open Model…).")
        self.view.error(f"Could not open the model.\n\n{self.lost_reason}", details_of(exc), title="Open Model")

    @property
    def title(self) -> str:
        """What the window's title says of the engine: its model and mode, and the server's address once."""
        if self.options is None:
            return ""
        url = self.server[0] if self.server is not None else None
        if self.options.model == url:  # connecting: the server has not said which model it runs
            return url
        return f"{Path(self.options.model).name} ({self.options.mode})" + (f" on {url}" if url else "")

    def close_session(self) -> None:
        session, self.session = self.session, None
        if session is not None:
            self.tasks.start(jobs.close, session, on_exception=self._close_failed)

    def _close_failed(self, exc: BaseException) -> None:
        self.view.error(describe_exception(exc, "closing the engine"), details_of(exc), title="Engine")

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
            self.set_state(AppState.RESTARTING)
        else:
            self.view.status(f"Applying {len(hooks)} hook points…", 3000)
        self.tasks.start(jobs.set_hooks, self.session, hooks, on_done=self._hooks_set,
                          on_exception=self._hooks_failed)

    def _hooks_set(self, result: tuple[bool, SessionInfo]) -> None:
        restarted, self.info = result
        self.options = self.info.options
        self.runs.live.learn_hooks(self.info.metadata, self.info.installed, list(self.info.catalogue))
        self.set_state(AppState.READY)
        self.view.session_changed(self.info, restarted)
        how = "engine restarted" if restarted else "applied live"
        self.view.status(f"{len(self.info.installed)} hook points captured ({how}).", 8000)
        if restarted:
            self.generating.reapply_interventions("changing hook points")
        self.send_windows()

    def _hooks_failed(self, exc: BaseException) -> None:
        alive = self.session is not None and self.session.alive
        self.set_state(AppState.READY if alive else AppState.DEAD)
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

    def set_windows(self, windows: dict[str, CaptureWindow]) -> None:
        """Capture windows by hook name; the installed hooks' go to the engine at once (from the next
        forward of a generation running now), the others once their hooks are captured."""
        self.windows = {name: w for name, w in windows.items() if not w.is_all}
        if self.state in (AppState.READY, AppState.GENERATING) and self.send_windows():
            where = "from the next token" if self.state is AppState.GENERATING else "on the next generation"
            self.view.status(f"Capture windows set; they apply {where}.", 6000)

    def send_windows(self) -> bool:
        """The user's windows of the installed hooks to the engine; whether there was a session to send them to."""
        if self.session is None or not self.session.alive:
            return False
        self.session.set_windows({n: w for n, w in self.windows.items() if n in self.session.installed})
        return True

    def attach_sae(self, path: str) -> bool:
        """Attach the SAE in directory ``path`` on the engine's thread (to the hook its config names);
        what the engine refuses is an error dialog with its reason."""
        if not self._may_edit_saes():
            return False
        self.view.status(f"Attaching the SAE in {path}…")
        self.tasks.start(jobs.attach_sae, self.session, path,
                          on_done=functools.partial(self._sae_attached, self.session),
                          on_exception=functools.partial(self._sae_refused, self.session, "attach"))
        return True

    def detach_sae(self, name: str) -> bool:
        """Stop encoding with SAE ``name``; the features captured so far stay in the run."""
        if not self._may_edit_saes():
            return False
        self.tasks.start(jobs.detach_sae, self.session, name,
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
        self.runs.live.note_sae(sae)
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
            self.set_state(AppState.DEAD)
        self.view.error(f"Could not {verb} the SAE.\n\n{describe_exception(exc, verb + 'ing the SAE')}",
                        details_of(exc), title="SAE")
