"""The Patching tab: an activation-patching sweep over layers × positions, filling in as it runs.

The user types (or takes from the run's requests) a clean and a corrupted prompt, the answer token
and an optional foil, the hook kind whose every layer forms the rows, and the direction. The
sweep runs on the engine thread (``Experiments.start_sweep``); its newest copy lives in a Qt-free
``PatchingSweep``, which a timer here repaints from when it changed, never per engine step. A click
on a cell opens that cell's patched run in the main views.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFontDatabase, QPalette
from PySide6.QtWidgets import (QComboBox, QGridLayout, QHBoxLayout, QLabel, QLineEdit, QMenu,
                               QPlainTextEdit, QProgressBar, QPushButton, QToolButton, QVBoxLayout)

from inspector.core.hooks import HookPoint
from inspector.viewer.patching import (DIRECTIONS, MODES, PatchingSweep, SweepRequest, kind_rows, patch_kinds,
                                       rows_note, uncaptured)

from .cell_grid import CellGrid, CellGridTab, elided_label
from .combo import offer
from .file_dialogs import save_file
from .view_kit import colormap

PAINT_INTERVAL_MS = 50  # the grid and the progress catch up with the sweep this often at most
DIVERGING = "CET-CBD1"  # colour-blind safe; reversed: blue towards clean, yellow beyond corrupted
PROMPT_LINES = 2.4
CLICK_HINT = ("Click a cell to open its patched run: the target prompt generated with that one cell patched "
              "(the Prompt dock's settings), in the main views like any run. Your own interventions are not "
              "applied to it.")


class PatchingView(CellGridTab):
    runRequested = Signal(object)  # a SweepRequest
    stopRequested = Signal()
    cellActivated = Signal(int, int)  # open the patched run of (row, column)
    saveRequested = Signal(str)  # write the sweep to this path
    captureRequested = Signal(list)  # hook names to tick (the button under a "not captured" note)

    def __init__(self, sweep: PatchingSweep, parent=None):
        super().__init__(CellGrid("patched ↓ at →", "Run a sweep to fill the grid.", row_heights=(24, 64)),
                         parent=parent)
        self.sweep = sweep
        self.shown_prompts = lambda: []  # (request id, prompt) of the run on show; the window sets it
        self._catalogue: list[HookPoint] = []
        self._installed: dict[str, HookPoint] = {}
        self._painted = None
        self._can_run = False

        # a pair where the demo model copies the argument's name (its tokens end in their spaces: "return ")
        self.clean_edit, self.clean_from = self._prompt_box("def f(name, other):\n    return ")
        self.corrupted_edit, self.corrupted_from = self._prompt_box("def f(context, other):\n    return ")
        self.answer_edit = QLineEdit("name", toolTip="The clean prompt's expected next token, one token "
                                                     "(mind the spaces: tokenizers differ in where they put them)")
        self.foil_edit = QLineEdit("context", placeholderText="none: logprob of the answer",
                                   toolTip="Optional: the corrupted prompt's token. With a foil the metric is the "
                                           "logit difference answer − foil")
        self.kind_box = QComboBox(toolTip="The hook kind swept: one row per layer")
        self.direction_box = QComboBox(toolTip="denoise: clean activations patched into the corrupted prompt; "
                                               "noise: corrupted ones into the clean prompt")
        for direction, text in DIRECTIONS.items():
            self.direction_box.addItem(text, direction)
        self.rows_label = QLabel()
        self.capture_button = QPushButton(visible=False)
        self.run_button = QPushButton("Run", enabled=False)
        self.stop_button = QPushButton("Stop", enabled=False)
        self.save_button = QPushButton("Save sweep…", enabled=False)
        self.problem = QLabel(wordWrap=True, visible=False)
        palette = self.problem.palette()
        palette.setColor(QPalette.ColorRole.WindowText, QColor(180, 30, 30))
        self.problem.setPalette(palette)
        self.problem.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.progress = QProgressBar(visible=False, maximumWidth=220)
        self.progress.setFormat("%v / %m cells")
        self.message = elided_label()
        self.mode_box = QComboBox(toolTip="What each cell shows (the colour is always the effect)")
        self.mode_box.addItems(list(MODES))
        self.cells.set_lookup(colormap(DIVERGING).getLookupTable(nPts=256, alpha=False).astype("uint8")[::-1].copy())
        self.show_scale()
        self.set_scale_numbers("−1", "0", "1", "colour: the effect, −1 (left), 0 = as corrupted (middle), "
                                               "1 = as clean (right)")
        self.details = QLabel(CLICK_HINT, wordWrap=True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setFixedWidth(240)
        self.readout.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self._layout()

        self.kind_box.currentTextChanged.connect(self._kind_changed)
        for edit in (self.clean_edit, self.corrupted_edit, self.answer_edit, self.foil_edit):
            edit.textChanged.connect(self._input_changed)
        for box in (self.kind_box, self.direction_box):
            box.currentIndexChanged.connect(self._input_changed)
        self.capture_button.clicked.connect(self._capture_clicked)
        self.run_button.clicked.connect(self._run_clicked)
        self.stop_button.clicked.connect(self.stopRequested)
        self.save_button.clicked.connect(self.save_dialog)
        self.mode_box.currentTextChanged.connect(self._mode_changed)
        self.timer = QTimer(self, interval=PAINT_INTERVAL_MS)
        self.timer.timeout.connect(self.repaint_sweep)
        self.timer.start()

    def _prompt_box(self, text: str) -> tuple[QPlainTextEdit, QToolButton]:
        edit = QPlainTextEdit(text, tabChangesFocus=True)
        edit.setFixedHeight(int(edit.fontMetrics().lineSpacing() * PROMPT_LINES) + 10)
        button = QToolButton(text="From run", toolTip="Take the prompt of a request of the run on show",
                             popupMode=QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(button)
        menu.aboutToShow.connect(self._fill_request_menus)
        menu.triggered.connect(self._request_chosen)
        button.setMenu(menu)
        return edit, button

    def _layout(self) -> None:
        form = QGridLayout()
        form.setContentsMargins(0, 0, 0, 0)
        form.setHorizontalSpacing(6)
        for row, (name, edit, button) in enumerate((("Clean", self.clean_edit, self.clean_from),
                                                    ("Corrupted", self.corrupted_edit, self.corrupted_from))):
            form.addWidget(QLabel(name), row, 0)
            form.addWidget(edit, row, 1)
            form.addWidget(button, row, 2)
        for row, (name, widget) in enumerate((("Answer", self.answer_edit), ("Foil", self.foil_edit))):
            form.addWidget(QLabel(name), row, 3)
            form.addWidget(widget, row, 4)
        for row, (name, widget) in enumerate((("Rows", self.kind_box), ("Direction", self.direction_box))):
            form.addWidget(QLabel(name), row, 5)
            form.addWidget(widget, row, 6)
        form.setColumnStretch(1, 1)
        for widget in (self.answer_edit, self.foil_edit):
            widget.setMaximumWidth(130)
        actions = QHBoxLayout()
        actions.setContentsMargins(0, 0, 0, 0)
        for widget in (self.run_button, self.stop_button, self.save_button, self.progress):
            actions.addWidget(widget)
        actions.addWidget(self.message, 1)
        actions.addWidget(QLabel("Show"))
        actions.addWidget(self.mode_box)
        actions.addWidget(self.scale)
        rows = QHBoxLayout()
        rows.setContentsMargins(0, 0, 0, 0)
        rows.addWidget(self.rows_label)
        rows.addWidget(self.capture_button)
        rows.addStretch(1)
        body = QHBoxLayout()
        body.setContentsMargins(0, 0, 0, 0)
        body.addWidget(self.cells, 1)
        body.addWidget(self.details)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(3)
        layout.addLayout(form)
        layout.addLayout(rows)
        layout.addWidget(self.problem)
        layout.addLayout(actions)
        layout.addLayout(body, 1)
        layout.addWidget(self.readout)

    # ------------------------------------------------------------------ what the window tells
    def set_hooks(self, catalogue: list[HookPoint], installed: dict[str, HookPoint]) -> None:
        """The engine's hook points changed: offer the kinds the model has, keeping the chosen one."""
        self._catalogue, self._installed = list(catalogue), dict(installed)
        offer(self.kind_box, patch_kinds(catalogue))
        self._kind_changed()

    def set_engine(self, can_run: bool, running: bool) -> None:
        """``can_run``: the engine is idle; ``running``: a sweep runs now."""
        self._can_run = can_run
        self.stop_button.setEnabled(running)
        self._kind_changed()

    # ------------------------------------------------------------------ the request
    def rows(self) -> list[HookPoint]:
        return kind_rows(self._installed.values(), self.kind_box.currentText())

    def request(self) -> SweepRequest:
        return SweepRequest(self.clean_edit.toPlainText(), self.corrupted_edit.toPlainText(), self.answer_edit.text(),
                            self.foil_edit.text(), tuple(h.name for h in self.rows()), self.direction_box.currentData())

    def _kind_changed(self, *_) -> None:
        kind = self.kind_box.currentText()
        rows, missing = self.rows(), uncaptured(self._catalogue, self._installed, kind)
        self.rows_label.setText(rows_note(rows, missing, kind) if kind else "No model: open one to patch")
        self.capture_button.setText(f"Capture every layer's {kind}")
        self.capture_button.setVisible(bool(missing))
        self.capture_button.setEnabled(self._can_run)
        self.run_button.setEnabled(self._can_run and bool(rows))

    def _input_changed(self, *_) -> None:
        self.sweep.forget_problem()

    def _capture_clicked(self) -> None:
        self.captureRequested.emit([h.name for h in uncaptured(self._catalogue, self._installed,
                                                               self.kind_box.currentText())])

    def _run_clicked(self) -> None:
        self.runRequested.emit(self.request())

    def _fill_request_menus(self) -> None:
        for button in (self.clean_from, self.corrupted_from):
            menu = button.menu()
            menu.clear()
            for rid, prompt in self.shown_prompts():
                shown = prompt.replace("\n", "↵")
                menu.addAction(f"{rid} · {shown[:50]}{'…' if len(shown) > 50 else ''}").setData(prompt)
            if menu.isEmpty():
                menu.addAction("No requests in the run on show").setEnabled(False)

    def _request_chosen(self, action) -> None:
        edit = self.clean_edit if self.sender() is self.clean_from.menu() else self.corrupted_edit
        edit.setPlainText(action.data())

    def save_dialog(self) -> None:
        path = save_file(self, "Save Sweep", "sweep.h5", "Sweeps (*.h5)")
        if path:
            self.saveRequested.emit(path if path.endswith((".h5", ".hdf5")) else path + ".h5")

    # ------------------------------------------------------------------ painting
    def repaint_sweep(self) -> None:
        """Bring the progress and the grid up to the sweep's newest copy (the timer calls it)."""
        sweep = self.sweep
        if self._painted == sweep.revision:
            return
        self._painted = sweep.revision
        self.problem.setText(sweep.problem)
        self.problem.setVisible(bool(sweep.problem))
        self.message.setText(sweep.message)
        self.message.setToolTip(sweep.message)
        done, cells = sweep.progress
        self.progress.setVisible(sweep.running)
        self.progress.setRange(0, cells)  # 0, 0: busy, no cells yet
        self.progress.setValue(done)
        self.save_button.setEnabled(sweep.result is not None)
        self.cells.set_grid(sweep.grid(), self.mode_box.currentText())
        self._show_details()

    def _mode_changed(self, mode: str) -> None:
        self.cells.set_grid(self.cells.grid, mode)

    def _cell_clicked(self, r: int, c: int) -> None:
        self._show_details()
        self.cellActivated.emit(r, c)

    def _show_details(self) -> None:
        cell = self.cells.selected
        grid = self.cells.grid
        if grid is None or cell is None or cell[0] >= grid.shape[0] or cell[1] >= grid.shape[1]:
            cell = None
        self.details.setText("\n".join(self.sweep.details(cell) + ["", CLICK_HINT]))
