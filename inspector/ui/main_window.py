"""The main window: docks (model tree, interventions, prompt), the views, menus and the status bar.

It draws what ``inspector.viewer.controller.Controller`` decides: user actions go to the controller,
the controller's news come back through the ``ControllerView`` methods below. Step events only grow
the shown run's data; a timer (``_tick``) repaints the views from it if anything changed, the upper
(heatmap) and lower (tokens) views on alternate ticks, each about 30 times a second: painting never
keeps pace with tokens one by one, and no turn of the event loop paints everything at once. Dialogs
are window-modal but non-blocking (``open()``): the event loop, and a running generation, never stop.
"""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QSignalBlocker, Qt, QTimer
from PySide6.QtGui import QColor, QKeySequence, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QComboBox, QDockWidget, QFileDialog, QHBoxLayout, QInputDialog, QLabel, QMainWindow,
                               QMessageBox, QPlainTextEdit, QProgressBar, QProgressDialog, QPushButton, QSplitter, QTabWidget,
                               QVBoxLayout, QWidget)

from inspector.capture.labels import default_hook
from inspector.capture.protocol import BOOT_STAGES, BootProgress, SessionFactory
from inspector.capture.sae import AttachedSae
from inspector.viewer.app_state import EMPTY_TEXT, GENERATE_TIPS, Action, AppState, describe_generation
from inspector.viewer.controller import Controller
from inspector.viewer.attention import AttentionPatterns, AttentionShown, attention_layers
from inspector.viewer.compare import Comparisons
from inspector.viewer.feature_labels import sae_key
from inspector.viewer.features import FeaturesShown, show_features
from inspector.viewer.jobs import GenerationResult, SessionInfo
from inspector.viewer.labels import display_token, short_hook_label
from inspector.viewer.lens import lens_hooks, lens_kinds
from inspector.viewer.routing import ExpertsShown, router_layers, show_experts
from inspector.viewer.run_view import RunSource

from .attention_view import AttentionView
from .compare_view import CompareView
from .connect_dialog import ConnectDialog
from .dashboard_view import DashboardView
from .features_view import FeaturesView
from .heatmap import HeatmapWidget
from .interventions_dock import InterventionsPanel
from .lens_view import LensView
from .model_tree import ModelTreeWidget
from .patching_view import PatchingView
from .prompt_panel import PromptPanel
from .routing_view import ExpertsView
from .settings import Settings
from .summary_view import SummaryView
from .tasks import TaskRunner
from .token_strip import TokenStrip

STAGE_TEXT = {"resolving": "Resolving model", "loading": "Loading weights", "compiling": "Compiling",
              "ready": "Ready"}
PAINT_INTERVAL_MS = 16  # alternately the upper and the lower views: each ~30 times a second
UPPER, LOWER = "upper", "lower"  # the heatmap or summary; the token strip or text
PROGRESS_INTERVAL_S = 0.1  # QProgressBar.setValue repaints synchronously (~1 ms): ten times a second is enough
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
        self._invalidate_views()
        self._half = UPPER
        self._text_shown: tuple = (None, 0)
        self._strip_key = None
        self._progress_shown = 0.0
        self.longest_tick_s = 0.0  # the slowest repaint so far (the bench reads it)

        self._build_views()
        self._build_docks()
        self._build_menus()
        self._build_status()
        self._wire()
        self._restore_settings()
        self.state_changed(AppState.NO_MODEL)

        self.paint_timer = QTimer(self, interval=PAINT_INTERVAL_MS)
        self.paint_timer.timeout.connect(self._tick)
        self.paint_timer.start()
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
        self.attention_patterns = AttentionPatterns()  # kept between repaints: only new rows are computed
        self.experts_view = ExpertsView()
        self.features_view = FeaturesView()
        self.dashboard_view = DashboardView()
        self.compare_view = CompareView()
        self.comparisons = Comparisons()  # kept between repaints: only new tokens and rows are computed
        self.tabs = QTabWidget()
        self.tabs.addTab(self.heatmap, "Tokens × features")
        self.tabs.addTab(self.summary, "Layers × tokens")
        self.tabs.addTab(self.lens_view, "Lens")
        self.tabs.addTab(self.attention_view, "Attention")
        self.tabs.addTab(self.experts_view, "Experts")
        self.tabs.addTab(self.features_view, "Features")
        self.tabs.addTab(self.dashboard_view, "Dashboard")
        self.patching_view = PatchingView(self.controller.experiments.sweep)
        self.tabs.addTab(self.patching_view, "Patching")
        self.tabs.addTab(self.compare_view, "Compare")
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
        self.prompt = PromptPanel()
        self.tree_dock = self._dock("Model", "model_dock", self.tree, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.interventions_dock = self._dock("Interventions", "interventions_dock", self.interventions,
                                             Qt.DockWidgetArea.RightDockWidgetArea)
        self.prompt_dock = self._dock("Prompt", "prompt_dock", self.prompt, Qt.DockWidgetArea.BottomDockWidgetArea)
        self.resizeDocks([self.tree_dock, self.interventions_dock], [360, 440], Qt.Orientation.Horizontal)
        self.resizeDocks([self.prompt_dock], [150], Qt.Orientation.Vertical)

    def _dock(self, title: str, name: str, widget: QWidget, area) -> QDockWidget:
        dock = QDockWidget(title, self, objectName=name)
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _build_menus(self) -> None:
        m = self.menuBar().addMenu("&File")
        self.act_open_model = m.addAction("Open &Model…", self.open_model_dialog, QKeySequence("Ctrl+M"))
        self.act_demo = m.addAction("Open &Demo Model", self._open_demo)
        self.act_connect = m.addAction("Co&nnect to Server…", self.connect_dialog)
        self.recent_models_menu = m.addMenu("Recent Models")
        self.recent_models_menu.triggered.connect(self._recent_model_triggered)
        m.addSeparator()
        m.addAction("Open &Capture…", self.open_capture_dialog, QKeySequence.StandardKey.Open)
        self.recent_captures_menu = m.addMenu("Recent Captures")
        self.recent_captures_menu.triggered.connect(self._recent_capture_triggered)
        m.addAction("Open S&can…", self.open_scan_dialog)
        m.addAction("&Watch an OpenAI Server…", self.watch_served_dialog)
        m.addAction("&Export…", self.export_dialog, QKeySequence("Ctrl+E"))
        m.addSeparator()
        self.act_new_run = m.addAction("&New Run", self.controller.runs.new_run)
        m.addSeparator()
        m.addAction("&Quit", self.close, QKeySequence.StandardKey.Quit)
        e = self.menuBar().addMenu("&Engine")
        self.act_restart = e.addAction("&Restart Engine", self.restart_engine)
        self.act_stop = e.addAction("&Stop Generation", self.controller.generating.stop)
        e.addAction("&Tensor Parallel Size…", self.choose_tensor_parallel_size)
        e.addAction("Room for &Feature Clamps…", self.choose_feature_clamps)
        e.addSeparator()
        self.act_attach_sae = e.addAction("Attach &SAE…", self.attach_sae_dialog)
        self.act_attach_demo_sae = e.addAction("Attach &Demo SAE", self.attach_demo_sae)
        self.act_attach_demo_sae.setToolTip("The SAE shipped for the demo model, its features labelled by a scan")
        v = self.menuBar().addMenu("&View")
        v.addAction("Show &Live Run", self.show_live)
        self.earlier_menu = v.addMenu("Earlier Runs")
        self.earlier_menu.triggered.connect(self._earlier_triggered)
        v.addSeparator()
        for dock in (self.tree_dock, self.interventions_dock, self.prompt_dock):
            v.addAction(dock.toggleViewAction())
        self.menuBar().addMenu("&Help").addAction("&About", self._about)
        self._rebuild_recent_menus()
        self._rebuild_run_menus()

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
        self.summary.settingsChanged.connect(self._invalidate_views)
        self.lens_view.settingsChanged.connect(self._invalidate_views)
        self.attention_view.settingsChanged.connect(self._invalidate_views)
        self.experts_view.settingsChanged.connect(self._invalidate_views)
        self.features_view.settingsChanged.connect(self._invalidate_views)
        self.features_view.detachRequested.connect(self.detach_sae)
        self.features_view.steerRequested.connect(self.steer_with_feature)
        self.features_view.featureSelected.connect(self._feature_selected)
        self.attention_view.captureRequested.connect(self._capture_hooks)
        self.patching_view.captureRequested.connect(self._capture_hooks)
        self.patching_view.runRequested.connect(self.controller.experiments.start_sweep)
        self.patching_view.stopRequested.connect(self.controller.experiments.stop_sweep)
        self.patching_view.cellActivated.connect(self._open_patched_cell)
        self.patching_view.saveRequested.connect(self.controller.experiments.save_sweep)
        self.patching_view.shown_prompts = self._shown_prompts
        self.compare_view.pairChosen.connect(self.select_request)
        self.tabs.currentChanged.connect(self._invalidate_views)
        self.lower_tabs.currentChanged.connect(self._invalidate_views)
        self.heatmap.colormapChanged.connect(self._colormap_changed)
        self.tree.applyRequested.connect(self.controller.engine.apply_hooks)
        self.tree.windowsChanged.connect(self.controller.engine.set_windows)
        self.tree.modeChangeRequested.connect(self.change_mode)
        self.tree.hookActivated.connect(self._tree_hook_activated)
        self.interventions.interventionsChanged.connect(self._interventions_edited)
        self.interventions.current_request = lambda: self.shown.selection.request
        self.interventions.current_hook = lambda: self.shown.selection.hook
        self.interventions.strip_selection = lambda: (self.shown.selection.request, self.strip.selected_positions())
        self.interventions.compute_steering = lambda hook, a, b: self.shown.steering_vector(hook, a, b)
        self.interventions.captured_hooks = lambda: self.shown.hooks_for(None)
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

    # Slots are bound methods returning None: never lambdas capturing self (PySide keeps them alive past
    # the window, and the interpreter's exit then deletes Qt objects in an order Qt cannot handle).
    def _open_demo(self, *_) -> None:
        self.open_model("demo")

    def _recent_model_triggered(self, action) -> None:
        self.open_model(action.data())

    def _recent_capture_triggered(self, action) -> None:
        self.open_capture(action.data())

    def _earlier_triggered(self, action) -> None:
        self.controller.runs.show(self.controller.runs.earlier[action.data()])

    # ================================================================== user actions
    def open_model(self, model: str, mode: str | None = None, hooks=None, **options) -> bool:
        options.setdefault("engine_args", self._parallel_engine_args())
        options.setdefault("feature_clamps", self.settings.feature_clamps)
        return self.controller.engine.open_model(model, mode or self.tree.mode(), hooks, **options)

    def _parallel_engine_args(self) -> dict:
        size = self.settings.tensor_parallel_size
        return {"tensor_parallel_size": size} if size > 1 else {}

    def choose_tensor_parallel_size(self) -> None:
        size, ok = QInputDialog.getInt(
            self, "Tensor Parallel Size", "Split the model over this many GPUs (vLLM's tensor parallelism; on a\n"
            "CPU, as many groups of cores). It applies when a model is opened or the engine restarts.",
            self.settings.tensor_parallel_size, 1, 64)
        if ok:
            self.set_tensor_parallel_size(size)

    def set_tensor_parallel_size(self, size: int) -> None:
        self.settings.tensor_parallel_size = size
        self.status(f"Tensor parallel size {size}: applies when a model is opened or the engine restarts", 8000)

    def choose_feature_clamps(self) -> None:
        count, ok = QInputDialog.getInt(
            self, "Room for Feature Clamps", "How many SAE features may be clamped to a value at once, per hook\n"
            "(Features tab ▸ Steer ▸ clamp to). The room costs every forward of a compiled engine\n"
            "(a few percent of a decode step); 0: none. It applies when a model is opened or the engine restarts.",
            self.settings.feature_clamps, 0, 64)
        if ok:
            self.settings.feature_clamps = count
            self.status(f"Room for {count} feature clamps per hook: applies when a model is opened or the engine "
                        "restarts", 8000)

    def open_model_dialog(self) -> None:
        start = self.settings.last_model or self.settings.last_dir
        path = QFileDialog.getExistingDirectory(self, "Open a Hugging Face model directory",
                                                str(Path(start).parent) if start else "")
        if path:
            self.open_model(path)

    def connect_dialog(self) -> None:
        dialog = ConnectDialog(self.settings.last_server, self)
        dialog.accepted.connect(self._connect_accepted)
        dialog.open()

    def _connect_accepted(self) -> None:
        dialog = self.sender()
        self.connect(dialog.url.text().strip(), dialog.keys)

    def connect(self, url: str, keys=None) -> bool:
        if not self.controller.engine.connect(url, keys):
            return False
        self.settings.last_server = url
        return True

    def attach_sae_dialog(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Attach a sparse autoencoder (a directory in SAELens's format)",
                                                self.settings.last_dir)
        if path:
            self.attach_sae(path)

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

    def open_capture_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a capture", self.settings.last_dir,
                                              "Captures (*.h5 *.hdf5);;All files (*)")
        if path:
            self.open_capture(path)

    def open_capture(self, path: str) -> bool:
        return self.controller.runs.open_capture(path)

    def watch_served_dialog(self) -> None:
        url, ok = QInputDialog.getText(self, "Watch an OpenAI Server",
                                       "The address of `inspector serve --openai` (its requests that ask for\n"
                                       "inspector_capture are shown as they arrive):",
                                       text=self.controller.runs.served.url if self.controller.runs.served else
                                       "http://127.0.0.1:8000")
        if ok and url.strip():
            self.watch_served(url)

    def watch_served(self, url: str) -> None:
        self.controller.runs.watch_served(url)

    def open_scan_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a corpus scan", self.settings.last_dir,
                                              "Scans (*.h5 *.hdf5);;All files (*)")
        if path:
            self.open_scan(path)

    def open_scan(self, path: str) -> bool:
        """Show the scan in ``path`` on the Dashboard tab (an error dialog says why not)."""
        return self.controller.runs.open_scan(path)

    def _feature_selected(self, feature: int) -> None:
        """A feature picked in the Features tab is selected on the Dashboard too, if its scan is of that SAE."""
        scan, path = self.controller.runs.scan, self.features_view.shown.path
        if scan is not None and scan.sae_path and path and sae_key(scan.sae_path) == sae_key(path):
            self.dashboard_view.select_unit(feature)

    def export_dialog(self) -> None:
        default = str(Path(self.settings.last_dir) / "capture.h5")
        path, _ = QFileDialog.getSaveFileName(self, "Export the run to HDF5", default, "Captures (*.h5)")
        if path:
            self.export(path if path.endswith((".h5", ".hdf5")) else path + ".h5")

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
        c = self.controller
        self._invalidate_views()
        self.prompt.generate_button.setEnabled(c.engine.enabled(Action.GENERATE))
        self.prompt.generate_button.setToolTip(GENERATE_TIPS[state])
        self.prompt.stop_button.setEnabled(c.engine.enabled(Action.STOP))
        self.act_stop.setEnabled(c.engine.enabled(Action.STOP))
        self.act_restart.setEnabled(c.engine.enabled(Action.RESTART))
        self.act_new_run.setEnabled(c.engine.enabled(Action.NEW_RUN))
        self.act_attach_sae.setEnabled(c.engine.enabled(Action.EDIT_SAES))
        self.act_attach_demo_sae.setEnabled(c.engine.can_attach_demo_sae())
        for action in (self.act_open_model, self.act_demo, self.act_connect):
            action.setEnabled(c.engine.enabled(Action.OPEN_MODEL))
        self.recent_models_menu.setEnabled(c.engine.enabled(Action.OPEN_MODEL) and bool(self.settings.recent_models))
        self.tree.set_busy(not c.engine.enabled(Action.EDIT_HOOKS))
        self.patching_view.set_engine(c.engine.enabled(Action.PATCH), c.engine.enabled(Action.STOP_PATCH))
        starting = state in (AppState.BOOTING, AppState.RESTARTING)
        self.boot_bar.setVisible(starting)
        self.prompt.progress.setVisible(state is AppState.GENERATING)
        if state is AppState.BOOTING:
            self.boot_bar.setValue(0)
            model = c.engine.options.model if c.engine.server else Path(c.engine.options.model).name
            self.stage_label.setText(f"{STAGE_TEXT['resolving']}: {model}…")
            if not self.tree.hook_names():
                self.tree.summary.setText(f"Starting {model}…")
        elif state is AppState.RESTARTING:
            self.boot_bar.setValue(BOOT_STAGES.index("compiling"))
            self.stage_label.setText("Restarting with the new hook points…")
        elif state is AppState.DEAD:
            self.stage_label.setText("Engine stopped")
        elif state is AppState.NO_MODEL:
            self.stage_label.setText("No model" if c.engine.options else "")
        self._update_title()

    def boot_progress(self, progress: BootProgress) -> None:
        if progress.stage in BOOT_STAGES:
            self.boot_bar.setValue(BOOT_STAGES.index(progress.stage) + (progress.stage == "ready"))
        self.stage_label.setText(f"{STAGE_TEXT.get(progress.stage, progress.stage)}… {progress.message}".strip())
        self._update_clock()

    def session_changed(self, info: SessionInfo | None, restarted: bool) -> None:
        if info is None:
            self.tree.set_catalogue([], ())
            self.interventions.set_hooks({})
            self.patching_view.set_hooks([], {})
            return
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
        server = f" · {self.controller.engine.server[0]}" if self.controller.engine.server else ""
        self.stage_label.setText(f"Ready · {len(info.installed)} hook points · {mode}{server}")
        family = info.metadata.get("block_family", "")
        refused = info.metadata.get("refused_kinds") or {}
        self.stage_label.setToolTip("\n".join([f"Blocks: {family}"] * bool(family) + list(refused.values())))
        if info.options.model != "demo" and not self.controller.engine.server:
            self.settings.add_recent_model(info.options.model)
            self._rebuild_recent_menus()
        self.settings.engine_mode = mode
        self._invalidate_views()

    def shown_changed(self) -> None:
        view = self.shown
        live = view is self.controller.runs.live
        self.source_label.setText("" if live else (f"File: {Path(view.label).name}"
                                                   if view.source is RunSource.FILE else view.label))
        self.source_label.setToolTip("" if live else view.label)
        self.live_button.setVisible(not live)
        self.interventions.set_requests(view.request_ids())
        self._rebuild_run_menus()
        self._update_title()
        self._invalidate_views()

    def generation_finished(self, result: GenerationResult | None) -> None:
        if result is not None:
            rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
            self.tokens_label.setText(f"{result.tokens} tokens · {rate:.0f} tok/s")
            self.status(describe_generation(result), 15000)
        else:
            tokens = self.controller.generating.progress.tokens if self.controller.generating.progress else 0
            self.status(f"Generation failed after {tokens} tokens; everything captured is kept.", 15000)
        self._invalidate_views()
        if self.tree.mode() == "eager" and self.tree.pending():
            self.tree.request_apply()

    def hooks_refused(self, info: SessionInfo) -> None:
        self.tree.set_checked(info.installed)

    def saes_changed(self, attached: AttachedSae | None) -> None:
        if attached is not None:
            self.features_view.choose(attached.name)
        self.act_attach_demo_sae.setEnabled(self.controller.engine.can_attach_demo_sae())
        self._invalidate_views()

    def interventions_dropped(self, message: str) -> None:
        self.interventions.set_hooks(self.controller.engine.info.installed if self.controller.engine.info else {})
        self.interventions.show_message(message)

    def capture_opened(self, path: str) -> None:
        self.settings.add_recent_capture(path)
        self.settings.last_dir = str(Path(path).parent)
        self._rebuild_recent_menus()
        if self.controller.engine.info is None:  # no engine: the tree lists the capture's hook points
            run = self.shown.run
            self.tree.set_catalogue(list(self.shown.catalogue.values()), run.hooks)
            self.tree.summary.setText(f"{len(run.hooks)} hook points in {Path(path).name} (no model loaded)")

    def scan_opened(self, path: str) -> None:
        self.settings.last_dir = str(Path(path).parent)
        self.dashboard_view.show_dashboard(self.controller.runs.scan)
        self.tabs.setCurrentWidget(self.dashboard_view)
        self._invalidate_views()  # the Features tab's labels may come from it

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
        self._show_box(box)

    def ask(self, title: str, text: str, on_yes, details: str = "") -> None:
        box = QMessageBox(QMessageBox.Icon.Question, title, text,
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        box.setDefaultButton(QMessageBox.StandardButton.Yes)
        if details:
            box.setDetailedText(details)
        self._answers[box] = on_yes
        box.finished.connect(self._ask_finished)
        self._show_box(box)

    def _show_box(self, box: QMessageBox) -> None:
        box.setWindowModality(Qt.WindowModality.WindowModal)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.last_dialog = box
        box.open()

    def _ask_finished(self, _code: int) -> None:
        box = self.sender()
        on_yes = self._answers.pop(box, None)
        if on_yes is not None and box.clickedButton() is box.button(QMessageBox.StandardButton.Yes):
            on_yes()

    def _about(self) -> None:
        QMessageBox.about(self, "About Activation Inspector",
                          "<b>Activation Inspector</b><br>Look inside an LLM while vLLM serves it.")

    # ================================================================== window furniture
    def _update_title(self) -> None:
        """The app's name is appended by Qt (the application's display name)."""
        view, options = self.shown, self.controller.engine.options
        if view.source is RunSource.SERVED:
            self.setWindowTitle(view.label)
        elif view.source is not RunSource.LIVE:
            self.setWindowTitle(Path(view.label).name)
        elif options is not None:
            where = f" on {self.controller.engine.server[0]}" if self.controller.engine.server else ""
            self.setWindowTitle(f"{Path(options.model).name} ({options.mode}){where}")
        else:
            self.setWindowTitle("")

    def _update_clock(self) -> None:
        c = self.controller
        c.engine.check_engine()
        if self.state in (AppState.BOOTING, AppState.RESTARTING) and c.engine.boot_stage:
            step = BOOT_STAGES.index(c.engine.boot_stage) + 1 if c.engine.boot_stage in BOOT_STAGES else "?"
            self.status(f"{STAGE_TEXT.get(c.engine.boot_stage, c.engine.boot_stage)} (step {step} of {len(BOOT_STAGES)}) · "
                        f"{time.perf_counter() - c.engine.boot_started:.0f} s")

    def _rebuild_recent_menus(self) -> None:
        for menu, paths in ((self.recent_models_menu, self.settings.recent_models),
                            (self.recent_captures_menu, self.settings.recent_captures)):
            menu.clear()
            for path in paths:
                menu.addAction(path).setData(path)
            menu.setEnabled(bool(paths))

    def _rebuild_run_menus(self) -> None:
        self.earlier_menu.clear()
        for i, view in enumerate(self.controller.runs.earlier):
            self.earlier_menu.addAction(f"{view.label}: {len(view.request_ids())} request(s)").setData(i)
        self.earlier_menu.setEnabled(bool(self.controller.runs.earlier))

    # ================================================================== painting
    def _invalidate_views(self, *_) -> None:
        self._painted = {UPPER: None, LOWER: None}

    def _tick(self) -> None:
        """Repaint from accumulated data, the upper and the lower views on alternate ticks: each view
        ~30 times a second whatever the token rate, and no event-loop turn paints both."""
        t0 = time.perf_counter()
        self._half = LOWER if self._half == UPPER else UPPER
        try:
            self._repaint_views((self._half,))
        finally:
            self.longest_tick_s = max(self.longest_tick_s, time.perf_counter() - t0)

    def refresh(self) -> None:
        """Bring every view up to date now (a selection changed; tests and tools)."""
        self._repaint_views((UPPER, LOWER))

    def _repaint_views(self, halves) -> None:
        c, view = self.controller, self.shown
        generating = c.engine.state is AppState.GENERATING
        live = generating and view is c.runs.live
        if live != self.heatmap.live:
            self.heatmap.live = live
            self._invalidate_views()
        if LOWER in halves:
            now = time.perf_counter()
            if generating and c.generating.progress is not None and now - self._progress_shown >= PROGRESS_INTERVAL_S:
                self._progress_shown = now
                self.prompt.progress.setValue(min(c.generating.progress.tokens, c.generating.progress.total))
                self.tokens_label.setText(f"{c.generating.progress.tokens} tokens · {c.generating.progress.rate:.0f} tok/s")
        keys = {UPPER: (id(view), view.revision, view.lens.revision, c.experiments.lens_problem, self.tabs.currentIndex(),
                        view.selection.position),
                LOWER: (id(view), view.revision, self.lower_tabs.currentIndex())}
        halves = [h for h in halves if keys[h] != self._painted[h]]
        if not halves:
            return
        self._painted.update({h: keys[h] for h in halves})
        self._refresh_selectors()
        sel = view.selection
        rid, hook = sel.request, sel.hook
        texts = view.token_texts(rid)
        marks = view.intervention_marks(rid, hook, len(texts))
        req = view.request(rid)
        if UPPER in halves:
            self._refresh_upper(view, req, texts, marks)
        if LOWER in halves:
            self._refresh_lower(view, req, texts, marks)

    def _refresh_upper(self, view, req, texts: list[str], marks) -> None:
        c, sel = self.controller, view.selection
        empty = EMPTY_TEXT[c.engine.state] if view is c.runs.live and not view.request_ids() else None
        # while the live run generates, the plots' message stays until rows come (one that changed with
        # the requests' start was laid out again in the first frame of rows)
        awaiting = EMPTY_TEXT[c.engine.state] if view is c.runs.live and c.engine.state is AppState.GENERATING else None
        self.heatmap.set_placeholder(empty or awaiting or "No rows captured at this hook point for this request")
        self.summary.empty_text.want(empty or awaiting or "No residual-stream hook points captured")
        if self.tabs.currentWidget() is self.heatmap:
            rows = view.rows(sel.request, sel.hook)
            info = view.hook_info(sel.hook)
            label = short_hook_label(info) if info else ""
            if rows is None:
                self.heatmap.clear(label, info.width if info else 0)
            else:
                source_id = (id(view), sel.request, sel.hook, id(req.hooks.get(sel.hook)))
                self.heatmap.set_data(rows[0], rows[1], texts, source_id, marks, label)
        elif self.tabs.currentWidget() is self.summary:
            measure, feature = self.summary.measure()
            self.summary.set_rows(view.summary_rows(sel.request, self.summary.kinds(), measure, feature), texts)
        elif self.tabs.currentWidget() is self.lens_view:
            self._refresh_lens(view, sel.request, empty)
        elif self.tabs.currentWidget() is self.compare_view:
            self.compare_view.show_comparison(self.comparisons.show(view, sel.hook), self.heatmap.live)
        elif self.tabs.currentWidget() is self.attention_view:
            self._refresh_attention(view, sel.request, empty)
        elif self.tabs.currentWidget() is self.experts_view:
            self._refresh_experts(view, sel.request, empty)
        elif self.tabs.currentWidget() is self.features_view:
            self._refresh_features(view, sel.request, empty)
        self.heatmap.select_position(sel.position)  # None: no column highlighted

    def _refresh_lens(self, view, rid: str | None, empty: str | None) -> None:
        """Only while the Lens tab is on show: ask for the lens of the rows not lensed yet, draw what there is."""
        captured = view.hooks_for(rid)
        hooks = lens_hooks(captured, self.lens_view.set_kinds(lens_kinds(captured)))
        self.controller.experiments.follow_lens(view, rid, hooks)
        message = empty or self.controller.experiments.lens_message(view, rid, hooks)
        self.lens_view.set_grid(None if message else view.lens.grid(view.run, rid, hooks), message)

    def _refresh_attention(self, view, rid: str | None, empty: str | None) -> None:
        """Only while the Attention tab is on show: the chosen layer and head, and the selected token's
        weights (the newest token's while none is selected)."""
        c = self.controller
        layer = self.attention_view.set_layers(attention_layers(view.hooks_for(rid)))
        capturing = c.engine.info.installed if c.engine.info is not None and view is c.runs.live else ()
        shown = AttentionShown(empty) if empty else self.attention_patterns.show(
            view, rid, layer, self.attention_view.head(), view.selection.position, capturing)
        can_capture = view is c.runs.live and c.engine.enabled(Action.EDIT_HOOKS)
        self.attention_view.show_attention(shown, can_capture, self.heatmap.live)

    def _refresh_experts(self, view, rid: str | None, empty: str | None) -> None:
        """Only while the Experts tab is on show: the chosen layer's routing of the shown request."""
        layer = self.experts_view.set_layers(router_layers(view.hooks_for(rid)))
        self.experts_view.show_experts(ExpertsShown(empty) if empty else show_experts(view, rid, layer))

    def _refresh_features(self, view, rid: str | None, empty: str | None) -> None:
        """Only while the Features tab is on show: the chosen SAE's features of the shown request."""
        c = self.controller
        attached = c.engine.info.saes if c.engine.info is not None and view is c.runs.live else {}
        if empty and c.engine.state not in (AppState.READY, AppState.GENERATING, AppState.PATCHING):
            shown = FeaturesShown(empty)  # no engine to attach an SAE to: say how to get one
        else:
            shown = show_features(view, rid, self.features_view.sae(), attached, c.runs.labels)
        is_attached = shown.sae in attached
        self.features_view.show_features(shown, view.selection.position,
                                         is_attached and c.engine.enabled(Action.EDIT_SAES), is_attached)

    def _capture_hooks(self, hooks: list) -> None:
        """A tab's capture button (Attention, Patching): tick ``hooks`` in the model tree and apply them
        as Apply would (eager mode applies ticks on its own)."""
        self.tree.set_checked(set(self.tree.checked()) | set(hooks))
        if self.tree.mode() == "compiled":
            self.tree.request_apply()

    def _refresh_lower(self, view, req, texts: list[str], marks) -> None:
        """Only the lower tab on show is kept current (a hidden one catches up when it is chosen)."""
        if self.lower_tabs.currentWidget() is not self.strip:
            self._refresh_text(req)
            return
        strip_key = (id(view), view.selection.request)
        if req is None:
            self.strip.set_tokens([], [], 0, reset=True)
        else:
            self.strip.set_tokens(texts, req.token_ids, len(req.prompt_token_ids), req.logprobs,
                                  req.top_logprobs, marks, reset=strip_key != self._strip_key)
        self._strip_key = strip_key

    def _refresh_selectors(self) -> None:
        view = self.shown
        sel = view.selection
        ids = view.request_ids()
        current = [self.request_box.itemData(i) for i in range(self.request_box.count())]
        if ids and sel.request not in ids:
            sel.request = ids[0]
        if ids != current or (ids and self.request_box.currentData() != sel.request):
            with QSignalBlocker(self.request_box):
                self.request_box.clear()
                for rid in ids:
                    prompt = (view.request(rid).prompt or "").replace("\n", "↵")
                    self.request_box.addItem(f"{rid} · {prompt[:40]}{'…' if len(prompt) > 40 else ''}", rid)
                self.request_box.setCurrentIndex(max(self.request_box.findData(sel.request), 0))
            self.interventions.set_requests(ids)
        hooks = view.hooks_for(sel.request)
        names = [h.name for h in hooks]
        if names and sel.hook not in names:
            sel.hook = default_hook(hooks).name
        current = [self.hook_box.itemData(i) for i in range(self.hook_box.count())]
        if names != current or self.hook_box.currentData() != sel.hook:
            with QSignalBlocker(self.hook_box):
                self.hook_box.clear()
                for h in hooks:
                    self.hook_box.addItem(f"{h.alias}  ·  {h.kind} [{h.width}]", h.name)
                self.hook_box.setCurrentIndex(max(self.hook_box.findData(sel.hook), 0))

    def _refresh_text(self, req) -> None:
        if req is None:
            if self._text_shown[0] is not None:
                self.text_view.clear()
                self._text_shown = (None, 0)
            return
        n_prompt = len(req.prompt_token_ids)
        generated = "".join(req.token_texts[n_prompt:])
        key = (id(self.shown), req.request_id)
        shown_key, shown_len = self._text_shown
        cursor = QTextCursor(self.text_view.document())
        if shown_key != key or len(generated) < shown_len:
            self.text_view.clear()
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(120, 120, 120))
            cursor.insertText(req.prompt or "".join(req.token_texts[:n_prompt]), fmt)
            shown_len = 0
        if len(generated) > shown_len:
            cursor.movePosition(QTextCursor.MoveOperation.End)
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(10, 10, 10))
            cursor.insertText(generated[shown_len:], fmt)
            self.text_view.ensureCursorVisible()
        self._text_shown = (key, len(generated))

    def generated_text(self, rid: str | None = None) -> str:
        req = self.shown.request(rid or self.shown.selection.request)
        return "" if req is None else "".join(req.token_texts[len(req.prompt_token_ids):])

    # ================================================================== shutdown
    def closeEvent(self, event) -> None:
        self.settings.save_window(self.saveGeometry(), self.saveState())
        self.settings.colormap = self.heatmap.colormap_name()
        self.settings.sync()
        self.paint_timer.stop()
        self._clock.stop()  # a closed window polls nothing (its engine is going)
        self.controller.shutdown(self._wait_for_tasks)
        super().closeEvent(event)

    def _wait_for_tasks(self) -> bool:
        return self.file_tasks.shutdown(SHUTDOWN_TIMEOUT_MS) and self.engine_tasks.shutdown(SHUTDOWN_TIMEOUT_MS)
