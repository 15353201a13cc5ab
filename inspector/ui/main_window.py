"""The main window: docks (model tree, interventions, prompt), the views, menus and the engine.

Data flow: the engine worker (its own thread) emits ``StepUpdate``s; ``_on_step`` only folds them
into the live ``CaptureViewModel`` (cheap list/array appends). A 30 Hz timer (``_tick``) repaints
the views from that model if anything changed, so painting never keeps up with tokens one by one,
and a slow paint never slows generation. All dialogs are window-modal but non-blocking (``open()``),
so the event loop (and a running generation) never stops for them.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, QSignalBlocker, Qt, QThread, QTimer, Signal, Slot
from PySide6.QtGui import QKeySequence, QTextCharFormat, QColor, QTextCursor
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDockWidget, QDoubleSpinBox, QFileDialog, QGridLayout,
                               QHBoxLayout, QLabel,
                               QMainWindow, QMessageBox, QPlainTextEdit, QProgressBar, QProgressDialog,
                               QPushButton, QSpinBox, QSplitter, QTabWidget, QVBoxLayout, QWidget)

from .capture_view_model import (CaptureViewModel, SessionInfo, StepUpdate, display_token, hook_sort_key,
                                 short_hook_label)
from .engine_worker import EngineController, EngineFailure, GenerationResult
from .heatmap import HeatmapWidget
from .interventions_dock import InterventionsPanel
from .model_tree import ModelTreeWidget
from .settings import Settings
from .summary_view import SummaryView
from .token_strip import TokenStrip

APP_TITLE = "Activation Inspector"
DEFAULT_HOOKS = ("blocks.*.hook_resid_post",)
BOOT_STAGES = ("resolving", "loading", "compiling", "ready")
STAGE_TEXT = {"resolving": "Resolving model", "loading": "Loading weights", "compiling": "Compiling",
              "ready": "Ready"}
PAINT_INTERVAL_MS = 33


def model_path_problem(model: str) -> str | None:
    """Why ``model`` cannot be a model directory, or None (hub ids like org/name go to the engine)."""
    path = Path(model).expanduser()
    if not path.exists():
        if model.count("/") == 1 and not model.startswith((".", "/", "~")):
            return None  # maybe a hub id in the local cache: the engine says if not
        return f"{path} does not exist."
    if not path.is_dir():
        return f"{path} is a file: choose a Hugging Face model directory (one with config.json)."
    if not (path / "config.json").is_file():
        return f"{path} is not a Hugging Face model directory (it has no config.json)."
    return None


class ExportJob(QObject):
    """write_run on its own thread; progress as a fraction; cancellable between pieces."""

    progress = Signal(float)
    done = Signal(str)
    failed = Signal(str)

    def __init__(self, run, path: str):
        super().__init__()
        self.run, self.path = run, path
        self.cancelled = threading.Event()

    @Slot()
    def work(self) -> None:
        try:
            from inspector.io.hdf5 import write_run

            def progress(f: float) -> None:
                if self.cancelled.is_set():
                    raise InterruptedError("export cancelled")
                self.progress.emit(float(f))

            out = write_run(self.run, self.path, progress=progress)
        except InterruptedError:
            self.failed.emit("")
        except BaseException as exc:  # noqa: BLE001
            self.failed.emit(str(exc) or type(exc).__name__)
        else:
            self.done.emit(str(out))


class PromptPanel(QWidget):
    generateRequested = Signal()
    stopRequested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.prompts = QPlainTextEdit()
        self.prompts.setPlaceholderText("One prompt per line; several lines run as one batch. Ctrl+Enter generates.")
        self.prompts.setPlainText("def fibonacci(n):")
        self.prompts.setMaximumHeight(110)
        self.max_tokens = QSpinBox(minimum=1, maximum=100_000, value=32, toolTip="Tokens to generate per prompt")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=5.0, value=0.0, singleStep=0.1, decimals=2,
                                          toolTip="0 = greedy")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, value=1.0, singleStep=0.05, decimals=2)
        self.seed = QSpinBox(minimum=-1, maximum=2 ** 31 - 1, value=-1, toolTip="-1: random")
        self.seed.setSpecialValueText("random")
        self.ignore_eos = QCheckBox("Ignore EOS", toolTip="Always generate max tokens, past end-of-sequence")
        self.generate_button = QPushButton("Generate")
        self.generate_button.setShortcut(QKeySequence("Ctrl+Return"))
        self.stop_button = QPushButton("Stop", enabled=False)
        self.stop_button.setShortcut(QKeySequence("Escape"))
        self.progress = QProgressBar()
        self.progress.setFormat("%v / %m tokens")
        self.progress.setVisible(False)
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        for i, (label, w) in enumerate((("Max tokens", self.max_tokens), ("Temperature", self.temperature),
                                        ("Top-p", self.top_p), ("Seed", self.seed))):
            grid.addWidget(QLabel(label), i // 2, (i % 2) * 2)
            grid.addWidget(w, i // 2, (i % 2) * 2 + 1)
        buttons = QHBoxLayout()
        buttons.addWidget(self.generate_button, 1)
        buttons.addWidget(self.stop_button, 1)
        grid.addWidget(self.ignore_eos, 2, 0, 1, 2)
        grid.addLayout(buttons, 3, 0, 1, 4)
        grid.addWidget(self.progress, 4, 0, 1, 4)
        self.prompts.setMinimumWidth(120)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.prompts, 1)
        layout.addLayout(grid)
        self.generate_button.clicked.connect(self.generateRequested)
        self.stop_button.clicked.connect(self.stopRequested)

    def prompt_list(self) -> list[str]:
        return [line for line in self.prompts.toPlainText().splitlines() if line.strip()]

    def sampling(self) -> dict:
        seed = self.seed.value()
        return {"max_tokens": self.max_tokens.value(), "temperature": self.temperature.value(),
                "top_p": self.top_p.value(), "seed": None if seed < 0 else seed,
                "ignore_eos": self.ignore_eos.isChecked()}


class MainWindow(QMainWindow):
    def __init__(self, session_factory=None, types=None, settings: Settings | None = None):
        super().__init__()
        self.settings = settings or Settings()
        self.controller = EngineController(session_factory, types, parent=self)
        self.live = CaptureViewModel()
        self.vm = self.live  # the model shown: the live run, or a reopened capture
        self.previous_runs: list[CaptureViewModel] = []  # live runs of models opened before this one
        self._run_file = None  # an open inspector.io RunFile (lazy capture)
        self.state = "no-model"  # no-model | booting | ready | generating | restarting | dead
        self.session_info: SessionInfo | None = None
        self.options: dict | None = None
        self.step_threads: set[int] = set()  # threads StepUpdates were produced on (tests check)
        self.last_dialog: QMessageBox | None = None
        self._answers: dict = {}  # open question boxes -> what "Yes" does
        self.export_thread: QThread | None = None
        self._export_job: ExportJob | None = None
        self._export_dialog: QProgressDialog | None = None
        self._last_paint_key = None
        self._text_shown: tuple = (None, 0, 0)
        self._strip_key = None
        self._select_new = False
        self._gen_t0 = 0.0
        self._gen_tokens = 0
        self._gen_max = 0
        self._boot_t0 = 0.0
        self._stage = ""
        self._closing = False
        self.longest_tick_s = 0.0  # the slowest repaint so far (the bench reads it)

        self.setWindowTitle(APP_TITLE)
        self._build_views()
        self._build_docks()
        self._build_menus()
        self._build_status()
        self._wire()
        self._restore_settings()
        self._set_state("no-model")

        self.paint_timer = QTimer(self, interval=PAINT_INTERVAL_MS)
        self.paint_timer.timeout.connect(self._tick)
        self.paint_timer.start()
        self._clock = QTimer(self, interval=500)
        self._clock.timeout.connect(self._update_clock)
        self._clock.start()

    # ================================================================== construction
    def _build_views(self) -> None:
        self.request_box = QComboBox(toolTip="Request (prompt) shown")
        self.request_box.setMinimumContentsLength(14)
        self.request_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.hook_box = QComboBox(toolTip="Hook point shown in the heatmap")
        self.hook_box.setMinimumContentsLength(14)
        self.hook_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
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
        self.tabs = QTabWidget()
        self.tabs.addTab(self.heatmap, "Tokens × features")
        self.tabs.addTab(self.summary, "Layers × tokens")
        self.strip = TokenStrip()
        self.text_view = QPlainTextEdit(readOnly=True)
        self.text_view.setPlaceholderText("Generated text streams in here.")
        lower = QTabWidget()
        lower.addTab(self.strip, "Tokens")
        lower.addTab(self.text_view, "Text")
        self.lower_tabs = lower
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.tabs)
        split.addWidget(lower)
        split.setStretchFactor(0, 4)
        split.setStretchFactor(1, 1)
        split.setSizes([520, 160])
        self.splitter = split
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addLayout(bar)
        layout.addWidget(split, 1)
        self.setCentralWidget(central)

    def _build_docks(self) -> None:
        self.tree = ModelTreeWidget()
        self.tree_dock = QDockWidget("Model", self, objectName="model_dock")
        self.tree_dock.setWidget(self.tree)
        self.addDockWidget(Qt.DockWidgetArea.LeftDockWidgetArea, self.tree_dock)
        self.interventions = InterventionsPanel()
        self.interventions_dock = QDockWidget("Interventions", self, objectName="interventions_dock")
        self.interventions_dock.setWidget(self.interventions)
        self.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, self.interventions_dock)
        self.prompt = PromptPanel()
        self.prompt_dock = QDockWidget("Prompt", self, objectName="prompt_dock")
        self.prompt_dock.setWidget(self.prompt)
        self.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, self.prompt_dock)
        self.resizeDocks([self.tree_dock, self.interventions_dock], [360, 440], Qt.Orientation.Horizontal)
        self.resizeDocks([self.prompt_dock], [150], Qt.Orientation.Vertical)

    def _build_menus(self) -> None:
        m = self.menuBar().addMenu("&File")
        self.act_open_model = m.addAction("Open &Model…", self.open_model_dialog, QKeySequence("Ctrl+M"))
        self.act_demo = m.addAction("Open &Demo Model", self._open_demo)
        self.recent_models_menu = m.addMenu("Recent Models")
        self.recent_models_menu.triggered.connect(self._recent_model_triggered)
        m.addSeparator()
        self.act_open_capture = m.addAction("Open &Capture…", self.open_capture_dialog, QKeySequence.StandardKey.Open)
        self.recent_captures_menu = m.addMenu("Recent Captures")
        self.recent_captures_menu.triggered.connect(self._recent_capture_triggered)
        self.act_export = m.addAction("&Export…", self.export_dialog, QKeySequence("Ctrl+E"))
        m.addSeparator()
        self.act_new_run = m.addAction("&New Run", self.new_run)
        m.addSeparator()
        m.addAction("&Quit", self.close, QKeySequence.StandardKey.Quit)
        e = self.menuBar().addMenu("&Engine")
        self.act_restart = e.addAction("&Restart Engine", self.restart_engine)
        self.act_stop = e.addAction("&Stop Generation", self.stop)
        v = self.menuBar().addMenu("&View")
        self.act_live = v.addAction("Show &Live Run", self.show_live)
        self.previous_menu = v.addMenu("Earlier Runs")
        self.previous_menu.triggered.connect(self._previous_triggered)
        self.previous_menu.setEnabled(False)
        v.addSeparator()
        for dock in (self.tree_dock, self.interventions_dock, self.prompt_dock):
            v.addAction(dock.toggleViewAction())
        h = self.menuBar().addMenu("&Help")
        h.addAction("&About", self._about)
        self._rebuild_recent_menus()

    def _build_status(self) -> None:
        self.stage_label = QLabel("")
        self.boot_progress = QProgressBar(maximum=len(BOOT_STAGES), visible=False)
        self.boot_progress.setMaximumWidth(160)
        self.boot_progress.setFormat("%v/%m")
        self.tokens_label = QLabel("")
        sb = self.statusBar()
        sb.addPermanentWidget(self.tokens_label)
        sb.addPermanentWidget(self.stage_label)
        sb.addPermanentWidget(self.boot_progress)

    def _wire(self) -> None:
        w = self.controller.worker
        w.bootProgress.connect(self._on_boot_progress)
        w.ready.connect(self._on_ready)
        w.stepEvent.connect(self._on_step)
        w.finished.connect(self._on_finished)
        w.hooksChanged.connect(self._on_hooks_changed)
        w.failed.connect(self._on_failed)
        self.prompt.generateRequested.connect(self._generate_clicked)
        self.prompt.stopRequested.connect(self.stop)
        self.request_box.currentIndexChanged.connect(self._request_chosen)
        self.hook_box.currentIndexChanged.connect(self._hook_chosen)
        self.strip.positionClicked.connect(self.select_position)
        self.heatmap.positionClicked.connect(self.select_position)
        self.summary.positionClicked.connect(self.select_position)
        self.summary.settingsChanged.connect(self._invalidate_views)
        self.tabs.currentChanged.connect(self._invalidate_views)
        self.heatmap.colormapChanged.connect(self._colormap_changed)
        self.tree.applyRequested.connect(self.apply_hooks)
        self.tree.modeChangeRequested.connect(self.change_mode)
        self.tree.hookActivated.connect(self._tree_hook_activated)
        self.interventions.interventionsChanged.connect(self._interventions_changed)
        self.interventions.current_request = lambda: self.vm.selected_request
        self.interventions.current_hook = lambda: self.vm.selected_hook
        self.interventions.strip_selection = lambda: (self.vm.selected_request, self.strip.selected_positions())
        self.interventions.compute_steering = lambda hook, a, b: self.vm.steering_vector(hook, a, b)
        self.interventions.captured_hooks = lambda: self.vm.hooks_for(None)
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

    def _generate_clicked(self, *_) -> None:
        self.generate()

    def _recent_model_triggered(self, action) -> None:
        self.open_model(action.data())

    def _recent_capture_triggered(self, action) -> None:
        self.open_capture(action.data())

    def _previous_triggered(self, action) -> None:
        self.show_run(self.previous_runs[action.data()])

    # ================================================================== state
    def _set_state(self, state: str) -> None:
        self.state = state
        self._last_paint_key = None
        ready = state == "ready"
        generating = state == "generating"
        self.prompt.generate_button.setEnabled(ready)
        self.prompt.stop_button.setEnabled(generating)
        self.act_stop.setEnabled(generating)
        self.act_restart.setEnabled(state in ("ready", "dead", "no-model") and self.options is not None)
        self.act_new_run.setEnabled(state in ("ready", "no-model", "dead"))
        self.act_open_model.setEnabled(state not in ("booting", "restarting"))
        self.act_demo.setEnabled(state not in ("booting", "restarting"))
        self.recent_models_menu.setEnabled(state not in ("booting", "restarting"))
        self.tree.set_busy(state != "ready")
        self.boot_progress.setVisible(state in ("booting", "restarting"))
        self.prompt.progress.setVisible(generating)
        tips = {"no-model": "Open a model first (File ▸ Open Model…)", "booting": "The engine is starting…",
                "restarting": "The engine is restarting…", "dead": "The engine stopped: Engine ▸ Restart Engine",
                "generating": "Generating…", "ready": "Generate (Ctrl+Enter)"}
        self.prompt.generate_button.setToolTip(tips.get(state, ""))
        self._update_title()

    def _update_title(self) -> None:
        parts = [APP_TITLE]
        if self.vm is not self.live and self.vm.path:
            parts.append(Path(self.vm.path).name)
        elif self.options:
            parts.append(f"{Path(self.options['model']).name} ({self.options['mode']})")
        self.setWindowTitle(" — ".join(parts))

    # ================================================================== engine: boot
    def open_model(self, model: str, mode: str | None = None, hooks=None, **options) -> bool:
        """Boot ``model`` (a directory, a cached hub id or "demo"); extra ``options`` go to SessionOptions.

        A path that is plainly not a model directory is refused at once, keeping the current engine."""
        if self.state in ("booting", "restarting"):
            self._error("The engine is starting: wait until it is ready.", title="Busy")
            return False
        if model != "demo":
            problem = model_path_problem(model)
            if problem:
                self._error(f"Cannot open the model: {problem}", title="Open Model")
                return False
            path = Path(model).expanduser()
            model = str(path.resolve()) if path.exists() else model
        if self.state == "generating":
            self.stop()
        mode = mode or self.tree.mode()
        hooks = tuple(hooks) if hooks else DEFAULT_HOOKS
        # rows reach the GUI in step events and live in its own buffers: the session need not keep a copy
        self.options = {"model": model, "mode": mode, "hooks": hooks, "retain_rows": False, **options}
        self._boot_t0 = time.perf_counter()
        self._stage = "resolving"
        self.boot_progress.setValue(0)
        self._set_state("booting")
        self.stage_label.setText(f"{STAGE_TEXT['resolving']}: {Path(model).name}…")
        if not self.tree.hook_names():
            self.tree.summary.setText(f"Starting {Path(model).name}…")
        self.statusBar().showMessage(f"Opening {model} ({mode} mode)…")
        self.controller.open(dict(self.options))
        return True

    def open_model_dialog(self) -> None:
        start = self.settings.last_model or self.settings.last_dir
        path = QFileDialog.getExistingDirectory(self, "Open a Hugging Face model directory",
                                                str(Path(start).parent) if start else "")
        if path:
            self.open_model(path)

    def restart_engine(self) -> None:
        if self.options is not None:
            self._reopen(self.options["mode"], self.tree.checked() or self.options["hooks"])

    def _reopen(self, mode: str, hooks) -> None:
        """Open the current model again, in ``mode`` with ``hooks``, keeping its other options."""
        extra = {k: v for k, v in self.options.items() if k not in ("model", "mode", "hooks")}
        self.open_model(self.options["model"], mode, hooks, **extra)

    @Slot(object)
    def _on_boot_progress(self, p) -> None:
        stage = getattr(p, "stage", str(p))
        self._stage = stage
        if stage in BOOT_STAGES:
            self.boot_progress.setValue(BOOT_STAGES.index(stage) + (1 if stage == "ready" else 0))
        message = getattr(p, "message", "")
        self.stage_label.setText(f"{STAGE_TEXT.get(stage, stage)}… {message}".strip())
        self._update_clock()

    def _update_clock(self) -> None:
        if self.state in ("booting", "restarting") and self._stage:
            secs = time.perf_counter() - self._boot_t0
            step = BOOT_STAGES.index(self._stage) + 1 if self._stage in BOOT_STAGES else "?"
            self.statusBar().showMessage(f"{STAGE_TEXT.get(self._stage, self._stage)} (step {step} of "
                                         f"{len(BOOT_STAGES)}) · {secs:.0f} s")

    @Slot(object)
    def _on_ready(self, info: SessionInfo) -> None:
        self.session_info = info
        opts = info.options
        self.options = {**(self.options or {}), "model": str(getattr(opts, "model", "demo")),
                        "mode": getattr(opts, "mode", "compiled"),
                        "hooks": tuple(getattr(opts, "hooks", DEFAULT_HOOKS))}
        self.tree.set_mode(self.options["mode"])
        self.tree.set_catalogue(list(info.catalogue), info.installed)
        self.interventions.set_hooks(info.installed)
        old_model = (self.live.run.metadata.get("model_path") or self.live.run.metadata.get("model")) \
            if self.live.run is not None else None
        new_model = info.metadata.get("model_path") or info.metadata.get("model")
        if self.live.total_rows() and old_model != new_model:
            self._keep_previous_run(old_model)  # another model: its captures stay viewable and exportable
        self.live.ensure_live(info.metadata, info.installed, info.catalogue)
        self.boot_progress.setValue(len(BOOT_STAGES))
        secs = time.perf_counter() - self._boot_t0
        self.stage_label.setText(f"Ready · {len(info.installed)} hook points · {self.options['mode']}")
        self.statusBar().showMessage(f"Model ready in {secs:.0f} s: {self.options['model']}", 8000)
        if self.options["model"] != "demo":
            self.settings.add_recent_model(self.options["model"])
            self._rebuild_recent_menus()
        self.settings.engine_mode = self.options["mode"]
        self._set_state("ready")
        self._invalidate_views()

    # ================================================================== engine: generation
    def generate(self) -> bool:
        if self.state != "ready":
            self.statusBar().showMessage("Not ready: " + self.prompt.generate_button.toolTip(), 5000)
            return False
        prompts = self.prompt.prompt_list()
        if not prompts:
            self.statusBar().showMessage("Type a prompt first (one per line).", 5000)
            return False
        if self.vm is not self.live:
            self.show_live()
        sampling = self.prompt.sampling()
        self._gen_t0, self._gen_tokens = time.perf_counter(), 0
        self._gen_max = sampling["max_tokens"] * len(prompts)
        self.prompt.progress.setRange(0, self._gen_max)
        self.prompt.progress.setValue(0)
        self._select_new = True
        self.heatmap.follow_box.setChecked(True)
        self._set_state("generating")
        self.statusBar().showMessage(f"Generating {sampling['max_tokens']} tokens for {len(prompts)} prompt(s)…")
        self.controller.generate(prompts, sampling)
        return True

    def stop(self) -> None:
        """Works at any moment: before the first step, mid-generation; a no-op when idle."""
        if self.state == "generating":
            self.controller.stop()
            self.statusBar().showMessage("Stopping after the current step…")

    def _start_live(self) -> None:
        """A fresh live run for the open session's model and hooks."""
        info = self.session_info
        self.live.start_live(info.metadata if info else {}, info.installed if info else {},
                             info.catalogue if info else ())

    @Slot(object)
    def _on_step(self, update: StepUpdate) -> None:
        self.step_threads.add(update.thread_id)
        if self.live.run is None:
            self._start_live()
        self.live.apply_update(update)
        if self._select_new and update.new_requests:
            self._select_new = False
            if self.vm is self.live:
                self.live.selected_request = update.new_requests[0].request_id
                self.live.selected_position = None
        self._gen_tokens += sum(len(r.new_token_ids) for r in update.event.requests)

    @Slot(object)
    def _on_finished(self, result: GenerationResult) -> None:
        if self.state == "generating":
            self._set_state("ready" if self.controller.worker.session is not None else "dead")
        rate = result.tokens / result.seconds if result.seconds > 0 else 0.0
        self.tokens_label.setText(f"{result.tokens} tokens · {rate:.0f} tok/s")
        if result.error:
            msg = f"Generation failed after {result.tokens} tokens; everything captured is kept."
        elif result.stopped:
            msg = f"Stopped after {result.tokens} tokens ({result.seconds:.1f} s)."
        else:
            msg = f"Generated {result.tokens} tokens in {result.seconds:.1f} s ({rate:.0f} tokens/s)."
        self.statusBar().showMessage(msg, 15000)
        self._invalidate_views()
        if self.tree.mode() == "eager" and self.tree.pending():
            self.tree.request_apply()

    # ================================================================== engine: hooks, mode, interventions
    def apply_hooks(self, hooks: list) -> None:
        if self.state != "ready":
            return
        if self.tree.mode() == "compiled":
            box = self._ask(
                "Restart the engine?",
                f"Compiled mode bakes the hook points into the engine: capturing {len(hooks)} hook point(s) "
                "restarts it (about as long as opening the model). Everything captured so far is kept.",
                lambda: self._do_set_hooks(hooks))
            box.setDetailedText("\n".join(hooks))
        else:
            self._do_set_hooks(hooks)

    def _do_set_hooks(self, hooks: list) -> None:
        self._boot_t0 = time.perf_counter()
        if self.tree.mode() == "compiled":
            self._stage = "compiling"
            self.boot_progress.setValue(2)
            self.stage_label.setText(f"Restarting with {len(hooks)} hook points…")
            self._set_state("restarting")
        else:
            self.statusBar().showMessage(f"Applying {len(hooks)} hook points…", 3000)
        self.controller.set_hooks(hooks)

    @Slot(object, bool)
    def _on_hooks_changed(self, info: SessionInfo, restarted: bool) -> None:
        self.session_info = info
        self.tree.set_installed(info.installed.keys())
        self.interventions.set_hooks(info.installed)
        self.live.ensure_live(info.metadata, info.installed, info.catalogue)
        how = "engine restarted" if restarted else "applied live"
        self.statusBar().showMessage(f"{len(info.installed)} hook points captured ({how}).", 8000)
        self.stage_label.setText(f"Ready · {len(info.installed)} hook points · {self.tree.mode()}")
        if self.state in ("restarting", "ready"):
            self._set_state("ready")
        self._invalidate_views()

    def change_mode(self, mode: str) -> None:
        if self.options is None or self.state in ("no-model", "dead"):
            self.tree.set_mode(mode)
            self.settings.engine_mode = mode
            return
        if self.state != "ready":
            self.statusBar().showMessage("Wait for the engine to be idle before switching modes.", 5000)
            return
        hooks = self.tree.checked() or list(self.options["hooks"])

        def go():
            self.tree.set_mode(mode)
            self.settings.engine_mode = mode
            self._reopen(mode, hooks)

        self._ask("Switch engine mode?",
                  f"Switching to {mode} mode restarts the engine with the checked hook points. "
                  "Everything captured so far is kept.", go)

    def _interventions_changed(self, interventions: list) -> None:
        try:
            self.controller.set_interventions(interventions)
        except ValueError as exc:
            self.interventions.engine_refused(str(exc))
            return
        self.interventions.engine_accepted()
        if interventions:
            where = "from the next token" if self.state == "generating" else "on the next generation"
            self.statusBar().showMessage(f"{len(interventions)} intervention(s) set; they apply {where}.", 6000)

    # ================================================================== failures and dialogs
    @Slot(object)
    def _on_failed(self, failure: EngineFailure) -> None:
        if self._closing:
            return
        if failure.op == "open":
            self.session_info = None
            self.tree.set_catalogue([], ())
            self._set_state("no-model")
            self.stage_label.setText("No model")
            self.statusBar().showMessage("Opening the model failed; open another one (File ▸ Open Model…).")
            self._error(f"Could not open the model.\n\n{failure.message}", failure.details, title="Open Model")
        elif failure.op == "set_hooks":
            self._set_state("ready" if failure.alive else "dead")
            self.tree.set_checked(self.tree.installed())
            self._error(f"Changing hook points failed.\n\n{failure.message}", failure.details, title="Hook points")
        elif failure.op == "generate":
            if not failure.alive:
                self._set_state("dead")
                self.stage_label.setText("Engine stopped")
            extra = "" if failure.alive else ("\n\nThe engine stopped. Engine ▸ Restart Engine boots it again.")
            self._error(f"Generation failed.\n\n{failure.message}\n\nEverything captured so far is kept."
                        f"{extra}", failure.details, title="Generation")
        elif failure.op == "interventions":
            self.interventions.set_hooks(self.session_info.installed if self.session_info else {})
            self.interventions.show_message(failure.message)
        else:
            self._error(failure.message, failure.details, title="Engine")

    def _error(self, text: str, details: str = "", title: str = "Error") -> QMessageBox:
        box = QMessageBox(QMessageBox.Icon.Critical, title, text, QMessageBox.StandardButton.Ok, self)
        if details:
            box.setDetailedText(details)
        box.setWindowModality(Qt.WindowModality.WindowModal)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.last_dialog = box
        box.open()
        return box

    def _ask(self, title: str, text: str, on_yes) -> QMessageBox:
        box = QMessageBox(QMessageBox.Icon.Question, title, text,
                          QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel, self)
        box.setDefaultButton(QMessageBox.StandardButton.Yes)
        box.setWindowModality(Qt.WindowModality.WindowModal)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self._answers[box] = on_yes
        box.finished.connect(self._ask_finished)
        self.last_dialog = box
        box.open()
        return box

    def _ask_finished(self, _code: int) -> None:
        box = self.sender()
        on_yes = self._answers.pop(box, None)
        if on_yes is not None and box.clickedButton() is box.button(QMessageBox.StandardButton.Yes):
            on_yes()

    def _about(self) -> None:
        QMessageBox.about(self, APP_TITLE, "<b>Activation Inspector</b><br>Look inside an LLM while vLLM serves it.")

    # ================================================================== files
    def open_capture_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a capture", self.settings.last_dir,
                                              "Captures (*.h5 *.hdf5);;All files (*)")
        if path:
            self.open_capture(path)

    def open_capture(self, path: str) -> bool:
        """Reopen an .h5 capture without any model or engine; values stay on disk until viewed."""
        try:
            from inspector.io.hdf5 import open_run

            run_file = open_run(path)
        except ImportError as exc:
            self._error(f"HDF5 support is not available: {exc}", title="Open Capture")
            return False
        except Exception as exc:  # noqa: BLE001 - CaptureFileError and anything unexpected: a dialog
            self._error(f"Cannot open the capture.\n\n{exc}", title="Open Capture")
            return False
        old = self._run_file
        vm = CaptureViewModel()
        vm.load_run(run_file.run, path)
        self._run_file = run_file
        self.vm = vm
        if old is not None:
            old.close()
        self.settings.add_recent_capture(str(path))
        self.settings.last_dir = str(Path(path).parent)
        self._rebuild_recent_menus()
        self.source_label.setText(f"File: {Path(path).name}")
        self.source_label.setToolTip(str(path))
        if self.session_info is None:  # no engine: the tree lists the capture's hook points
            self.tree.set_catalogue(sorted(run_file.run.hooks.values(), key=hook_sort_key), run_file.run.hooks)
            self.tree.summary.setText(f"{len(run_file.run.hooks)} hook points in {Path(path).name} "
                                      "(no model loaded)")
        self.live_button.setVisible(True)
        self.interventions.set_requests(vm.request_ids())
        n_req, n_hooks = len(run_file.run.requests), len(run_file.run.hooks)
        self.statusBar().showMessage(f"Opened {path}: {n_req} request(s), {n_hooks} hook point(s).", 8000)
        self._update_title()
        self._invalidate_views()
        return True

    def _keep_previous_run(self, model) -> None:
        kept = self.live
        kept.source, kept.path = "memory", f"{Path(str(model)).name} (earlier run)"
        label = f"{kept.path}: {len(kept.request_ids())} request(s)"
        self.previous_runs.append(kept)
        self.previous_menu.addAction(label).setData(len(self.previous_runs) - 1)
        self.previous_menu.setEnabled(True)
        self.live = CaptureViewModel()
        if self.vm is kept:
            self.vm = self.live
        self.statusBar().showMessage(f"The run captured with {Path(str(model)).name} is kept under "
                                     "View ▸ Earlier Runs (export it to keep it on disk).", 10000)

    def show_run(self, vm: CaptureViewModel) -> None:
        """Show an in-memory earlier run (or any view model) instead of the live one."""
        self.vm = vm
        self.source_label.setText(vm.path or "")
        self.live_button.setVisible(vm is not self.live)
        self.interventions.set_requests(vm.request_ids())
        self._update_title()
        self._invalidate_views()

    def show_live(self) -> None:
        self.vm = self.live
        self.source_label.setText("")
        self.live_button.setVisible(False)
        self.interventions.set_requests(self.live.request_ids())
        self._update_title()
        self._invalidate_views()

    def export_dialog(self) -> None:
        if self.vm.run is None or not self.vm.run.requests:
            self._error("Nothing to export yet: generate first (or open a capture).", title="Export")
            return
        default = str(Path(self.settings.last_dir) / "capture.h5")
        path, _ = QFileDialog.getSaveFileName(self, "Export the run to HDF5", default, "Captures (*.h5)")
        if path:
            if not path.endswith((".h5", ".hdf5")):
                path += ".h5"
            self.export(path)

    def export(self, path: str) -> bool:
        """Write the shown run to ``path`` on a worker thread, with a progress dialog."""
        if self.export_thread is not None:
            self._error("An export is already running.", title="Export")
            return False
        if self.vm.run is None:
            return False
        run = self.vm.snapshot()
        job = ExportJob(run, path)
        thread = QThread(self)
        thread.setObjectName("export")
        job.moveToThread(thread)
        dialog = QProgressDialog(f"Writing {Path(path).name}…", "Cancel", 0, 1000, self)
        dialog.setWindowTitle("Export")
        dialog.setWindowModality(Qt.WindowModality.WindowModal)
        dialog.setMinimumDuration(300)
        dialog.setAutoClose(False)
        dialog.setAutoReset(False)
        dialog.canceled.connect(job.cancelled.set)
        job.progress.connect(self._export_progress)
        job.done.connect(self._export_done)
        job.failed.connect(self._export_failed)
        thread.started.connect(job.work)
        self.export_thread, self._export_job, self._export_dialog = thread, job, dialog
        thread.start()
        return True

    def _export_progress(self, fraction: float) -> None:
        if self._export_dialog is not None:
            self._export_dialog.setValue(int(fraction * 1000))

    def _export_finish(self) -> None:
        thread, dialog = self.export_thread, self._export_dialog
        self.export_thread = self._export_job = self._export_dialog = None
        if dialog is not None:
            dialog.reset()
            dialog.hide()
            dialog.deleteLater()
        if thread is not None:
            thread.quit()
            thread.wait()
            thread.deleteLater()

    def _export_done(self, path: str) -> None:
        self._export_finish()
        self.settings.last_dir = str(Path(path).parent)
        self.last_export = path
        self.statusBar().showMessage(f"Exported to {path}", 10000)

    def _export_failed(self, reason: str) -> None:
        self._export_finish()
        if reason:
            self._error(f"Export failed; nothing was written.\n\n{reason}", title="Export")
        else:
            self.statusBar().showMessage("Export cancelled; nothing was written.", 6000)

    def new_run(self) -> None:
        if self.state == "generating":
            return

        def go():
            self.controller.new_run()
            self._start_live()
            self.show_live()

        if self.live.total_rows():
            self._ask("Start a new run?", "The captures of the current run are dropped (export them first "
                      "to keep them).", go)
        else:
            go()

    def _rebuild_recent_menus(self) -> None:
        self.recent_models_menu.clear()
        for path in self.settings.recent_models:
            self.recent_models_menu.addAction(path).setData(path)
        self.recent_models_menu.setEnabled(bool(self.settings.recent_models))
        self.recent_captures_menu.clear()
        for path in self.settings.recent_captures:
            self.recent_captures_menu.addAction(path).setData(path)
        self.recent_captures_menu.setEnabled(bool(self.settings.recent_captures))

    # ================================================================== selection
    def _request_chosen(self, index: int) -> None:
        rid = self.request_box.itemData(index)
        if rid is not None and rid != self.vm.selected_request:
            self.vm.selected_request = rid
            self.vm.selected_position = None
            self._invalidate_views()

    def _hook_chosen(self, index: int) -> None:
        hook = self.hook_box.itemData(index)
        if hook is not None and hook != self.vm.selected_hook:
            self.vm.selected_hook = hook
            self._invalidate_views()

    def _tree_hook_activated(self, hook: str) -> None:
        if any(h.name == hook for h in self.vm.hooks_for(self.vm.selected_request)):
            self.select_hook(hook)

    def select_request(self, rid: str) -> None:
        self.vm.selected_request = rid
        self.vm.selected_position = None
        self._invalidate_views()
        self._tick()

    def select_hook(self, hook: str) -> None:
        self.vm.selected_hook = hook
        self._invalidate_views()
        self._tick()

    def select_position(self, position: int) -> None:
        """A token was clicked (strip, heatmap or summary): select it everywhere."""
        self.vm.selected_position = position
        self.heatmap.select_position(position)
        self.strip.select_position(position)
        texts = self.vm.token_texts(self.vm.selected_request)
        if 0 <= position < len(texts):
            row = self.vm.row_of_position(self.vm.selected_request, self.vm.selected_hook, position)
            where = f"row {row}" if row is not None else "no row (last token is never fed back)"
            self.statusBar().showMessage(f"Token {position}: {display_token(texts[position])!r} · {where}", 6000)

    def _colormap_changed(self, name: str) -> None:
        self.summary.set_colormap(name)
        self.settings.colormap = name

    # ================================================================== painting
    def _invalidate_views(self, *_) -> None:
        self._last_paint_key = None

    def _tick(self) -> None:
        """Repaint from accumulated data; at most ~30 times a second, whatever the token rate."""
        t0 = time.perf_counter()
        try:
            self._repaint_views()
        finally:
            self.longest_tick_s = max(self.longest_tick_s, time.perf_counter() - t0)

    def _repaint_views(self) -> None:
        if self.state == "generating":
            self.prompt.progress.setValue(min(self._gen_tokens, self._gen_max))
            secs = max(time.perf_counter() - self._gen_t0, 1e-6)
            self.tokens_label.setText(f"{self._gen_tokens} tokens · {self._gen_tokens / secs:.0f} tok/s")
        vm = self.vm
        live = self.state == "generating" and vm is self.live
        if live != self.heatmap.live:
            self.heatmap.live = live
            self._last_paint_key = None
        key = (id(vm), vm.revision, vm.selected_request, vm.selected_hook, self.tabs.currentIndex())
        if key == self._last_paint_key:
            return
        self._last_paint_key = key
        self._refresh_selectors()
        rid, hook = vm.selected_request, vm.selected_hook
        texts = vm.token_texts(rid)
        info = vm.hook_info(hook)
        marks = vm.intervention_marks(rid, hook, len(texts))
        state = self._state_placeholder()
        self.heatmap.set_placeholder(state or "No rows captured at this hook point for this request")
        self.summary.empty_text.setText(state or "No residual-stream hook points captured")
        if self.tabs.currentWidget() is self.heatmap:
            rows = vm.rows(rid, hook)
            if rows is None:
                self.heatmap.clear()
            else:
                req = vm.request(rid)
                source_id = (id(vm), rid, hook, id(req.hooks.get(hook)) if req else 0)
                self.heatmap.set_data(rows[0], rows[1], texts, source_id, marks,
                                      short_hook_label(info) if info else "")
        else:
            measure, feature = self.summary.measure()
            self.summary.set_rows(vm.summary_rows(rid, self.summary.kinds(), measure, feature), texts)
        req = vm.request(rid)
        strip_key = (id(vm), rid)
        if req is None:
            self.strip.set_tokens([], [], 0, reset=True)
        else:
            self.strip.set_tokens(texts, req.token_ids, len(req.prompt_token_ids), req.logprobs, req.top_logprobs,
                                  marks, reset=strip_key != self._strip_key)
        self._strip_key = strip_key
        self._refresh_text(req)
        self.heatmap.select_position(vm.selected_position)  # None: no column highlighted

    def _state_placeholder(self) -> str | None:
        """What the plots say while the live run has no request yet; None once there is data to show."""
        if self.vm is self.live and not self.live.request_ids():
            return {"booting": "The model is starting…", "restarting": "The engine is restarting…",
                    "no-model": "No model: File ▸ Open Model…, or File ▸ Open Capture… to view a saved run",
                    "dead": "The engine stopped: Engine ▸ Restart Engine",
                    }.get(self.state, "Type a prompt below and press Generate")
        return None

    def _refresh_selectors(self) -> None:
        vm = self.vm
        ids = vm.request_ids()
        current = [self.request_box.itemData(i) for i in range(self.request_box.count())]
        if ids != current or (ids and self.request_box.currentData() != vm.selected_request):
            with QSignalBlocker(self.request_box):
                self.request_box.clear()
                for rid in ids:
                    req = vm.request(rid)
                    prompt = (req.prompt or "").replace("\n", "↵")
                    label = f"{rid} · {prompt[:40]}{'…' if len(prompt) > 40 else ''}"
                    self.request_box.addItem(label, rid)
                self.request_box.setCurrentIndex(max(self.request_box.findData(vm.selected_request), 0))
            if ids and vm.selected_request not in ids:
                vm.selected_request = ids[0]
            self.interventions.set_requests(ids)
        hooks = vm.hooks_for(vm.selected_request)
        names = [h.name for h in hooks]
        current = [self.hook_box.itemData(i) for i in range(self.hook_box.count())]
        if names and vm.selected_hook not in names:
            vm.selected_hook = next((h.name for h in hooks if h.kind == "resid_post"), names[0])
        if names != current or self.hook_box.currentData() != vm.selected_hook:
            with QSignalBlocker(self.hook_box):
                self.hook_box.clear()
                for h in hooks:
                    self.hook_box.addItem(f"{h.alias}  ·  {h.kind} [{h.width}]", h.name)
                self.hook_box.setCurrentIndex(max(self.hook_box.findData(vm.selected_hook), 0))

    def _refresh_text(self, req) -> None:
        if req is None:
            if self._text_shown[0] is not None:
                self.text_view.clear()
                self._text_shown = (None, 0, 0)
            return
        n_prompt = len(req.prompt_token_ids)
        gen = "".join(req.token_texts[n_prompt:])
        key = (id(self.vm), req.request_id)
        shown_key, shown_len, _ = self._text_shown
        cursor = QTextCursor(self.text_view.document())
        if shown_key != key or len(gen) < shown_len:
            self.text_view.clear()
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(120, 120, 120))
            cursor.insertText(req.prompt or "".join(req.token_texts[:n_prompt]), fmt)
            shown_len = 0
        if len(gen) > shown_len:
            cursor.movePosition(QTextCursor.MoveOperation.End)
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(10, 10, 10))
            cursor.insertText(gen[shown_len:], fmt)
            self.text_view.ensureCursorVisible()
        self._text_shown = (key, len(gen), 0)

    def generated_text(self, rid: str | None = None) -> str:
        req = self.vm.request(rid or self.vm.selected_request)
        return "" if req is None else "".join(req.token_texts[len(req.prompt_token_ids):])

    # ================================================================== shutdown
    def closeEvent(self, event) -> None:
        self._closing = True
        self.settings.save_window(self.saveGeometry(), self.saveState())
        self.settings.colormap = self.heatmap.colormap_name()
        self.settings.sync()
        self.paint_timer.stop()
        if self._export_job is not None:
            self._export_job.cancelled.set()
        if self.export_thread is not None:
            self.export_thread.quit()
            self.export_thread.wait(30000)
        self.controller.shutdown()
        if self._run_file is not None:
            self._run_file.close()
            self._run_file = None
        super().closeEvent(event)
