"""The main window: docks (model tree, interventions, prompt), the views, menus and the status bar.

It draws what ``inspector.viewer.controller.Controller`` decides: user actions go to the controller,
the controller's news come back through the ``ControllerView`` methods below. Step events only grow
the shown run's data; the ``Painter`` (``painting.py``) repaints the views from it on a timer. Dialogs
are window-modal but non-blocking (``open()``): the event loop, and a running generation, never stop.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QComboBox, QDockWidget, QHBoxLayout, QLabel, QMainWindow, QMessageBox, QPlainTextEdit,
                               QProgressBar, QProgressDialog, QPushButton, QSplitter, QTabWidget, QVBoxLayout, QWidget)

from inspector.core.protocol import BOOT_STAGES, BootProgress, SessionFactory
from inspector.core.sae import AttachedSae
from inspector.viewer.app_state import GENERATE_TIPS, Action, AppState, describe_generation, stage_text
from inspector.viewer.controller import Controller
from inspector.viewer.feature_labels import sae_key
from inspector.viewer.jobs import GenerationResult, SessionInfo
from inspector.viewer.labels import display_token
from inspector.viewer.run_view import RunSource

from .attention_view import AttentionView
from .compare_view import CompareView
from .dashboard_view import DashboardView
from .features_view import FeaturesView
from .heatmap import HeatmapWidget
from .interventions_dock import InterventionsPanel
from .lens_view import LensView
from .menus import Menus
from .model_tree import ModelTreeWidget
from .painting import Painter
from .patching_view import PatchingView
from .prompt_panel import PromptPanel
from .routing_view import ExpertsView
from .settings import Settings
from .summary_view import SummaryView
from .tasks import TaskRunner
from .token_strip import TokenStrip
from .upper_tabs import upper_tabs
from .window_context import ShownRunContext

STAGE_TEXT = {"starting": "Starting the engine process", "resolving": "Resolving model", "loading": "Starting vLLM",
              "probing": "Finding hook points", "compiling": "Compiling", "ready": "Ready"}
SHUTDOWN_TIMEOUT_MS = 180_000


class MainWindow(QMainWindow):
    def __init__(self, session_factory: SessionFactory, settings: Settings | None = None):
        super().__init__()
        self.settings = settings or Settings()
        self.engine_tasks, self.file_tasks = TaskRunner("engine", self), TaskRunner("files", self)
        self.controller = Controller(session_factory, self.engine_tasks, self.file_tasks, self)
        self.last_dialog: QMessageBox | None = None
        self._answers: dict = {}  # open question boxes -> what "Yes" does
        self._export_dialog: QProgressDialog | None = None

        self._build_views()
        self.painter = Painter(self)
        self._build_docks()
        self.menus = Menus(self)
        self._build_status()
        self._wire()
        self._restore_settings()
        self.state_changed(AppState.NO_MODEL)

        self._clock = QTimer(self, interval=500)
        self._clock.timeout.connect(self._update_clock)
        self._clock.start()

    @property
    def state(self) -> AppState:
        return self.controller.engine.state

    @property
    def shown(self):
        return self.controller.runs.shown

    # ================================================================== construction
    def _build_views(self) -> None:
        self.request_box = QComboBox(toolTip="Request (prompt) shown")
        self.hook_box = QComboBox(toolTip="Hook point shown in the heatmap")
        for box in (self.request_box, self.hook_box):
            box.setMinimumContentsLength(14)
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.source_label = QLabel("")
        self.live_button = QPushButton("Back to live run", visible=False)
        bar = QHBoxLayout()
        bar.setContentsMargins(4, 2, 4, 0)
        bar.addWidget(QLabel("Request"))
        bar.addWidget(self.request_box, 1)
        bar.addWidget(QLabel("Hook"))
        bar.addWidget(self.hook_box, 1)
        bar.addWidget(self.source_label)
        bar.addWidget(self.live_button)

        self.heatmap = HeatmapWidget()
        self.summary = SummaryView()
        self.lens_view = LensView()
        self.attention_view = AttentionView()
        self.experts_view = ExpertsView()
        self.features_view = FeaturesView()
        self.dashboard_view = DashboardView()
        self.compare_view = CompareView()
        self.patching_view = PatchingView(self.controller.experiments.sweep)
        self.tabs = upper_tabs(self)
        self.strip = TokenStrip()
        self.text_view = QPlainTextEdit(readOnly=True)
        self.text_view.setPlaceholderText("Generated text streams in here.")
        self.lower_tabs = QTabWidget()
        self.lower_tabs.addTab(self.strip, "Tokens")
        self.lower_tabs.addTab(self.text_view, "Text")
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.tabs)
        split.addWidget(self.lower_tabs)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        split.setSizes([520, 160])
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(bar)
        layout.addWidget(split, 1)
        self.setCentralWidget(central)

    def _build_docks(self) -> None:
        self.tree = ModelTreeWidget()
        self.interventions = InterventionsPanel()
        self.prompt = PromptPanel(self.settings)
        self.tree_dock = self._dock("Model", "model_dock", self.tree, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.interventions_dock = self._dock("Interventions", "interventions_dock", self.interventions,
                                             Qt.DockWidgetArea.RightDockWidgetArea)
        self.prompt_dock = self._dock("Prompt", "prompt_dock", self.prompt, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.resizeDocks([self.tree_dock, self.interventions_dock], [275, 415], Qt.Orientation.Horizontal)
        self.resizeDocks([self.prompt_dock], [150], Qt.Orientation.Vertical)

    def _dock(self, title: str, name: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self, objectName=name)
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _build_status(self) -> None:
        self.stage_label = QLabel("")
        self.boot_bar = QProgressBar(maximum=len(BOOT_STAGES), visible=False)
        self.boot_bar.setMaximumWidth(160)
        self.boot_bar.setFormat("%v/%m")
        self.tokens_label = QLabel("")
        for widget in (self.tokens_label, self.stage_label, self.boot_bar):
            self.statusBar().addPermanentWidget(widget)

    def _wire(self) -> None:
        self.prompt.generateRequested.connect(self.generate)
        self.prompt.stopRequested.connect(self.controller.generating.stop)
        self.request_box.currentIndexChanged.connect(self._request_chosen)
        self.hook_box.currentIndexChanged.connect(self._hook_chosen)
        for view in (self.strip, self.heatmap, self.summary, self.lens_view, self.attention_view, self.experts_view,
                     self.features_view, self.compare_view):
            view.positionClicked.connect(self.select_position)
        self.summary.settingsChanged.connect(self.painter.invalidate)
        self.lens_view.settingsChanged.connect(self.painter.invalidate)
        self.attention_view.settingsChanged.connect(self.painter.invalidate)
        self.experts_view.settingsChanged.connect(self.painter.invalidate)
        self.features_view.settingsChanged.connect(self.painter.invalidate)
        self.features_view.detachRequested.connect(self.detach_sae)
        self.features_view.steerRequested.connect(self.steer_with_feature)
        self.features_view.featureSelected.connect(self._feature_selected)
        self.attention_view.captureRequested.connect(self._capture_hooks)
        self.attention_view.requestChosen.connect(self.select_request)
        self.patching_view.captureRequested.connect(self._capture_hooks)
        self.patching_view.runRequested.connect(self.controller.experiments.start_sweep)
        self.patching_view.stopRequested.connect(self.controller.experiments.stop_sweep)
        self.patching_view.cellActivated.connect(self._open_patched_cell)
        self.patching_view.saveRequested.connect(self.controller.experiments.save_sweep)
        self.patching_view.shown_prompts = self._shown_prompts
        self.compare_view.pairChosen.connect(self.select_request)
        self.tabs.currentChanged.connect(self.painter.invalidate)
        self.lower_tabs.currentChanged.connect(self.painter.invalidate)
        self.heatmap.colormapChanged.connect(self._colormap_changed)
        self.tree.applyRequested.connect(self.controller.engine.apply_hooks)
        self.tree.windowsChanged.connect(self.controller.engine.set_windows)
        self.tree.modeChangeRequested.connect(self.change_mode)
        self.tree.hookActivated.connect(self._tree_hook_activated)
        self.interventions.interventionsChanged.connect(self._interventions_edited)
        self.interventions.context = ShownRunContext(self)
        self.live_button.clicked.connect(self.show_live)

    def _restore_settings(self) -> None:
        geometry, state = self.settings.window_geometry(), self.settings.window_state()
        if geometry is not None:
            self.restoreGeometry(geometry)
        else:
            self.resize(1440, 900)
        if state is not None:
            self.restoreState(state)
        self.heatmap.set_colormap(self.settings.colormap)  # and, through colormapChanged, the summary's
        self.tree.set_mode(self.settings.engine_mode)

    # ================================================================== user actions
    # Slots are bound methods returning None: never lambdas capturing self (PySide keeps them alive past
    # the window, and the interpreter's exit then deletes Qt objects in an order Qt cannot handle).
    def open_model(self, model: str, mode: str | None = None, hooks=None, **options) -> bool:
        options.setdefault("engine_args", self._parallel_engine_args())
        options.setdefault("feature_clamps", self.settings.feature_clamps)
        return self.controller.engine.open_model(model, mode or self.tree.mode(), hooks, **options)

    def _parallel_engine_args(self) -> dict:
        size = self.settings.tensor_parallel_size
        return {"tensor_parallel_size": size} if size > 1 else {}

    def set_tensor_parallel_size(self, size: int) -> None:
        self.settings.tensor_parallel_size = size
        self.status(f"Tensor parallel size {size}: applies when a model is opened or the engine restarts", 8000)

    def connect(self, url: str, keys=None) -> bool:
        if not self.controller.engine.connect(url, keys):
            return False
        self.settings.last_server = url
        return True

    def attach_sae(self, path: str) -> bool:
        """Attach the SAE in directory ``path`` to the hook its config names (on the engine's thread)."""
        return self.controller.engine.attach_sae(path)

    def attach_demo_sae(self) -> bool:
        return self.controller.engine.attach_demo_sae()

    def detach_sae(self, name: str) -> bool:
        return self.controller.engine.detach_sae(name)

    def steer_with_feature(self, sae: str, feature: int, how: str, value: float) -> int:
        """A row in the interventions table that steers with feature ``feature`` of the attached SAE
        ``sae`` (``how``: a key of features_view.STEER_HOW); the row's index, or -1 and the reason shown."""
        attached = self.controller.engine.info.saes.get(sae) if self.controller.engine.info is not None else None
        if attached is None:
            self.interventions.show_message(f"{sae} is not attached to the engine now; attach it first.")
            return -1
        try:
            if how == "clamp":
                clamp = attached.clamping(feature, value).clamp
                return self.interventions.add_steering(attached.hook, f"clamp {clamp.label} to {value:g}", clamp=clamp)
            return self.interventions.add_steering(attached.hook, f"{value:g} × feature {sae}/{feature}",
                                                   bias=attached.steering(feature, value).bias)
        except ValueError as e:
            self.interventions.show_message(str(e))
            return -1

    def restart_engine(self) -> None:
        engine = self.controller.engine
        if engine.enabled(Action.RESTART):
            engine_args = {k: v for k, v in (engine.options.engine_args if engine.options else {}).items()
                           if k != "tensor_parallel_size"}
            engine.reopen(hooks=self.tree.checked() or None, engine_args={**engine_args, **self._parallel_engine_args()},
                          feature_clamps=self.settings.feature_clamps)

    def change_mode(self, mode: str) -> None:
        if self.controller.engine.options is None or self.state in (AppState.NO_MODEL, AppState.DEAD):
            self.tree.set_mode(mode)
            self.settings.engine_mode = mode
            return
        self.controller.engine.change_mode(mode, self.tree.checked() or self.controller.engine.options.hooks)

    def generate(self) -> bool:
        sampling = self.prompt.sampling()
        if not self.controller.generating.generate(self.prompt.prompt_list(), sampling, self.prompt.compare.isChecked()):
            return False
        self._generation_started()
        return True

    def _open_patched_cell(self, row: int, column: int) -> None:
        if self.controller.experiments.open_patched_cell(row, column, self.prompt.sampling()):
            self._generation_started()

    def _generation_started(self) -> None:
        self.prompt.progress.setRange(0, self.controller.generating.progress.total)
        self.prompt.progress.setValue(0)
        self.heatmap.follow_box.setChecked(True)

    def _shown_prompts(self) -> list[tuple[str, str]]:
        """(request id, prompt) of the run on show: the Patching tab takes its prompts from them."""
        return [(rid, self.shown.request(rid).prompt or "") for rid in self.shown.request_ids()]

    def _interventions_edited(self, interventions: list) -> None:
        try:
            self.controller.generating.set_interventions(interventions)
        except ValueError as exc:
            self.interventions.engine_refused(str(exc))
            return
        self.interventions.engine_accepted()

    def open_capture(self, path: str) -> bool:
        return self.controller.runs.open_capture(path)

    def watch_served(self, url: str) -> None:
        self.controller.runs.watch_served(url)

    def open_scan(self, path: str) -> bool:
        """Show the scan in ``path`` on the Dashboard tab (an error dialog says why not)."""
        return self.controller.runs.open_scan(path)

    def _feature_selected(self, feature: int) -> None:
        """A feature picked in the Features tab is selected on the Dashboard too, if its scan is of that SAE."""
        scan, path = self.controller.runs.scan, self.features_view.shown.path
        if scan is not None and scan.sae_path and path and sae_key(scan.sae_path) == sae_key(path):
            self.dashboard_view.select_unit(feature)

    def export(self, path: str) -> bool:
        if not self.controller.runs.export(path):
            return False
        self.settings.last_dir = str(Path(path).parent)
        return True

    def show_live(self) -> None:
        self.controller.runs.show(self.controller.runs.live)

    def select_request(self, rid: str) -> None:
        self.shown.select(request=rid)
        self.refresh()

    def select_hook(self, hook: str) -> None:
        self.shown.select(hook=hook)
        self.refresh()

    def select_position(self, position: int) -> None:
        """A token was clicked (strip, heatmap or summary): select it everywhere."""
        view = self.shown
        view.selection.position = position
        self.heatmap.select_position(position)
        self.strip.select_position(position)
        texts = view.token_texts(view.selection.request)
        if 0 <= position < len(texts):
            row = view.row_of_position(view.selection.request, view.selection.hook, position)
            req = view.request(view.selection.request)
            window = req.windows.get(view.selection.hook) if req is not None else None
            where = (f"row {row}" if row is not None else f"no row (outside this hook's capture window {window})"
                     if window else "no row (last token is never fed back)")
            self.status(f"Token {position}: {display_token(texts[position])!r} · {where}", 6000)

    def _request_chosen(self, index: int) -> None:
        rid = self.request_box.itemData(index)
        if rid is not None and rid != self.shown.selection.request:
            self.shown.select(request=rid)

    def _hook_chosen(self, index: int) -> None:
        hook = self.hook_box.itemData(index)
        if hook is not None and hook != self.shown.selection.hook:
            self.shown.select(hook=hook)

    def _tree_hook_activated(self, hook: str) -> None:
        if any(h.name == hook for h in self.shown.hooks_for(self.shown.selection.request)):
            self.select_hook(hook)

    def _colormap_changed(self, name: str) -> None:
        self.summary.set_colormap(name)
        self.lens_view.set_colormap(name)
        self.attention_view.set_colormap(name)
        self.experts_view.set_colormap(name)
        self.features_view.set_colormap(name)
        self.settings.colormap = name

    # ================================================================== ControllerView
    def state_changed(self, state: AppState) -> None:
        c, engine, menus = self.controller, self.controller.engine, self.menus
        self.painter.invalidate()
        self.prompt.generate_button.setEnabled(engine.enabled(Action.GENERATE))
        self.prompt.generate_button.setToolTip(GENERATE_TIPS[state])
        self.prompt.stop_button.setEnabled(engine.enabled(Action.STOP))
        menus.act_stop.setEnabled(engine.enabled(Action.STOP))
        menus.act_restart.setEnabled(engine.enabled(Action.RESTART))
        menus.act_new_run.setEnabled(engine.enabled(Action.NEW_RUN))
        menus.act_attach_sae.setEnabled(engine.enabled(Action.EDIT_SAES))
        menus.act_attach_demo_sae.setEnabled(engine.can_attach_demo_sae())
        for action in (menus.act_open_model, menus.act_demo, menus.act_connect):
            action.setEnabled(engine.enabled(Action.OPEN_MODEL))
        menus.recent_models_menu.setEnabled(engine.enabled(Action.OPEN_MODEL) and bool(self.settings.recent_models))
        self.tree.set_busy(not engine.enabled(Action.EDIT_HOOKS))
        self.patching_view.set_engine(engine.enabled(Action.PATCH), engine.enabled(Action.STOP_PATCH))
        starting = state in (AppState.BOOTING, AppState.RESTARTING)
        self.boot_bar.setVisible(starting)
        self.prompt.progress.setVisible(state is AppState.GENERATING)
        if state is AppState.BOOTING:
            self.boot_bar.setValue(0)
            doing = (f"Connecting to {c.engine.server[0]}" if c.engine.server else
                     f"Starting {Path(c.engine.options.model).name}")
            self.stage_label.setText(f"{doing}…")
            if not self.tree.hook_names():
                self.tree.summary.setText(f"{doing}…")
        elif state is AppState.RESTARTING:
            self.boot_bar.setValue(BOOT_STAGES.index("compiling"))
            self.stage_label.setText("Restarting with the new hook points…")
        elif state is AppState.DEAD:
            self.stage_label.setText("Engine stopped")
        elif state is AppState.NO_MODEL:
            self.stage_label.setText("No model" if c.engine.options else "")
        elif engine.info is not None:  # ready, generating or patching
            self.stage_label.setText(stage_text(state, engine.info, self._server_name(), c.generating.progress))
        self._update_title()

    def boot_progress(self, progress: BootProgress) -> None:
        if progress.stage in BOOT_STAGES:
            self.boot_bar.setValue(BOOT_STAGES.index(progress.stage) + (progress.stage == "ready"))
        self.stage_label.setText(f"{STAGE_TEXT.get(progress.stage, progress.stage)}… {progress.message}".strip())
        self._update_clock()

    def session_changed(self, info: SessionInfo, restarted: bool) -> None:
        self.painter.forget_stale()  # now: a message about the new session may follow at once
        mode = info.options.mode
        self._update_title()
        self.tree.set_mode(mode)
        if [h.name for h in info.catalogue] == self.tree.hook_names():
            self.tree.set_installed(info.installed)  # the same model: the tree stays as the user left it
        else:
            self.tree.set_catalogue(list(info.catalogue), info.installed)
        self.interventions.set_hooks(info.installed)
        self.patching_view.set_hooks(list(info.catalogue), info.installed)
        self.boot_bar.setValue(len(BOOT_STAGES))
        self.stage_label.setText(stage_text(self.state, info, self._server_name(), self.controller.generating.progress))
        family = info.metadata.get("block_family", "")
        refused = info.metadata.get("refused_kinds") or {}
        self.stage_label.setToolTip("\n".join([f"Blocks: {family}"] * bool(family) + list(refused.values())))
        if info.options.model != "demo" and not self.controller.engine.server:
            self.settings.add_recent_model(info.options.model)
            self.menus.rebuild_recent()
        self.settings.engine_mode = mode
        self.painter.invalidate()

    def shown_changed(self) -> None:
        view = self.shown
        live = view is self.controller.runs.live
        self.source_label.setText("" if live else (f"File: {Path(view.label).name}"
                                                   if view.source is RunSource.FILE else view.label))
        self.source_label.setToolTip("" if live else view.label)
        self.live_button.setVisible(not live)
        self.interventions.set_requests(view.request_ids())
        self.menus.rebuild_runs()
        self._update_title()
        self.painter.invalidate()

    def generation_finished(self, result: GenerationResult | None) -> None:
        if result is not None:
            rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
            self.tokens_label.setText(f"{result.tokens} tokens · {rate:.0f} tok/s")
            self.status(describe_generation(result), 15000)
        else:
            tokens = self.controller.generating.progress.tokens if self.controller.generating.progress else 0
            self.status(f"Generation failed after {tokens} tokens; everything captured is kept.", 15000)
        self.painter.invalidate()
        if self.tree.mode() == "eager" and self.tree.pending():
            self.tree.request_apply()

    def hooks_refused(self, info: SessionInfo) -> None:
        self.tree.set_checked(info.installed)

    def saes_changed(self, attached: AttachedSae | None) -> None:
        if attached is not None:
            self.features_view.choose(attached.name)
        self.menus.act_attach_demo_sae.setEnabled(self.controller.engine.can_attach_demo_sae())
        self.painter.invalidate()

    def interventions_dropped(self, message: str) -> None:
        self.interventions.set_hooks(self.controller.engine.info.installed if self.controller.engine.info else {})
        self.interventions.show_message(message)

    def capture_opened(self, path: str) -> None:
        self.settings.add_recent_capture(path)
        self.settings.last_dir = str(Path(path).parent)
        self.menus.rebuild_recent()
        if self.controller.engine.info is None:  # no engine: the tree lists the capture's hook points
            run = self.shown.run
            self.tree.set_catalogue(list(self.shown.catalogue.values()), run.hooks)
            self.tree.summary.setText(f"{len(run.hooks)} hook points in {Path(path).name} (no model loaded)")

    def scan_opened(self, path: str) -> None:
        self.settings.last_dir = str(Path(path).parent)
        self.dashboard_view.show_dashboard(self.controller.runs.scan)
        self.tabs.setCurrentWidget(self.dashboard_view)
        self.painter.invalidate()  # the Features tab's labels may come from it

    def export_progress(self, fraction: float | None) -> None:
        if fraction is None:
            if self._export_dialog is not None:
                self._export_dialog.reset()
                self._export_dialog.hide()
                self._export_dialog.deleteLater()
                self._export_dialog = None
            return
        if self._export_dialog is None:
            dialog = QProgressDialog("Writing the capture file…", "Cancel", 0, 1000, self)
            dialog.setWindowTitle("Export")
            dialog.setWindowModality(Qt.WindowModality.WindowModal)
            dialog.setMinimumDuration(300)
            dialog.setAutoClose(False)
            dialog.setAutoReset(False)
            dialog.canceled.connect(self.controller.runs.cancel_export)
            self._export_dialog = dialog
        self._export_dialog.setValue(int(fraction * 1000))

    def status(self, text: str, ms: int = 0) -> None:
        self.statusBar().showMessage(text, ms)

    def error(self, text: str, details: str = "", title: str = "Error") -> None:
        box = QMessageBox(QMessageBox.Icon.Critical, title, text, QMessageBox.StandardButton.Ok, self)
        if details:
            box.setDetailedText(details)
        self.show_box(box)

    def server_unreachable(self, url: str, reason: str) -> None:
        self.menus.server_unreachable(url, reason)

    def ask(self, title: str, text: str, on_yes, details: str = "") -> None:
        box = QMessageBox(QMessageBox.Icon.Question, title, text,
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        box.setDefaultButton(QMessageBox.StandardButton.Yes)
        if details:
            box.setDetailedText(details)
        self._answers[box] = on_yes
        box.finished.connect(self._ask_finished)
        self.show_box(box)

    def show_box(self, box: QMessageBox) -> None:
        box.setWindowModality(Qt.WindowModality.WindowModal)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.last_dialog = box
        box.open()

    def _ask_finished(self, _code: int) -> None:
        box = self.sender()
        on_yes = self._answers.pop(box, None)
        if on_yes is not None and box.clickedButton() is box.button(QMessageBox.StandardButton.Yes):
            on_yes()

    # ================================================================== window furniture
    def _update_title(self) -> None:
        """The app's name is appended by Qt (the application's display name)."""
        view = self.shown
        if view.source is RunSource.SERVED:
            self.setWindowTitle(view.label)
        elif view.source is not RunSource.LIVE:
            self.setWindowTitle(Path(view.label).name)
        else:
            self.setWindowTitle(self.controller.engine.title)

    def _server_name(self) -> str:
        return self.controller.engine.server[0] if self.controller.engine.server else ""

    def _update_clock(self) -> None:
        c = self.controller
        c.engine.check_engine()
        if self.state in (AppState.BOOTING, AppState.RESTARTING) and c.engine.boot_stage:
            stage = c.engine.boot_stage
            step = f" (step {BOOT_STAGES.index(stage) + 1} of {len(BOOT_STAGES)})" if stage in BOOT_STAGES else ""
            self.status(f"{STAGE_TEXT.get(stage, stage)}{step} · {time.perf_counter() - c.engine.boot_started:.0f} s")

    def _capture_hooks(self, hooks: list) -> None:
        """A tab's capture button (Attention, Patching): tick ``hooks`` in the model tree and apply them
        as Apply would (eager mode applies ticks on its own)."""
        self.tree.set_checked(set(self.tree.checked()) | set(hooks))
        if self.tree.mode() == "compiled":
            self.tree.request_apply()

    def refresh(self) -> None:
        """Bring every view up to date now (a selection changed; tests and tools)."""
        self.painter.refresh()

    def generated_text(self, rid: str | None = None) -> str:
        req = self.shown.request(rid or self.shown.selection.request)
        return "" if req is None else "".join(req.token_texts[len(req.prompt_token_ids):])

    # ================================================================== shutdown
    def closeEvent(self, event) -> None:
        self.settings.save_window(self.saveGeometry(), self.saveState())
        self.settings.colormap = self.heatmap.colormap_name()
        self.settings.sync()
        self.painter.timer.stop()
        self._clock.stop()  # a closed window polls nothing (its engine is going)
        self.controller.shutdown(self._wait_for_tasks)
        super().closeEvent(event)

    def _wait_for_tasks(self) -> bool:
        return self.file_tasks.shutdown(SHUTDOWN_TIMEOUT_MS) and self.engine_tasks.shutdown(SHUTDOWN_TIMEOUT_MS)
