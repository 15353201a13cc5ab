"""The Features tab: what an attached sparse autoencoder reads in each token of the shown request.

A row per feature (the request's strongest, by their largest activation), a column per token
(``CellGrid`` over ``viewer.features.FeatureGrid``), each cell the feature's activation where it is
among the token's strongest. Hover reads a cell out and lists that token's strongest features on the
side; clicking a row's label, a cell or a listed feature selects the feature, outlines its row and
plots its activation across the tokens below; a click on a cell also selects its token everywhere.
Below the plot the selected feature can steer the model (its decoder direction added with a strength,
or the feature clamped to a value): a row in the interventions table, live from the next forward.
Features are named by their labels where the SAE has any (its labels.json, or the top tokens of a scan
of it).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QHBoxLayout, QLabel, QListWidget, QListWidgetItem,
                               QPushButton, QSizePolicy, QVBoxLayout, QWidget)

from inspector.viewer.features import ACTIVATION, NO_SAE, FeaturesShown
from inspector.viewer.tabs import FeaturesDrawing

from .cell_grid import CELL_W, LABEL_W, SELECTED, CellGrid, CellGridTab, elided_label
from .combo import offer
from .view_kit import quiet_axes, stack_view

LEGEND = "activation (blank: not among the token's strongest)"
PICK_A_FEATURE = "Click a feature (a row, a cell or one in the list) to plot it across the tokens"
SIDE_W, TRACE_H = 230, 120
STEER_HOW = {"add": "add × its direction", "clamp": "clamp to"}  # the ways a feature steers: their labels
GRID_MIN_TOKENS = 6  # token columns always in view beside the feature labels


class FeaturesView(CellGridTab):
    positionClicked = Signal(int)  # a cell was clicked: select its token everywhere
    settingsChanged = Signal()  # another SAE was chosen: the window feeds its features
    detachRequested = Signal(str)  # the SAE shown, by name
    featureSelected = Signal(int)  # the user picked a feature of the SAE shown (the Dashboard may follow)
    steerRequested = Signal(str, int, str, float)  # SAE, feature, a key of STEER_HOW, strength or value

    def __init__(self, parent=None):
        super().__init__(CellGrid("feature ↓ token →", NO_SAE, row_heights=(20, 32)), parent=parent)
        self.shown = FeaturesShown(NO_SAE)
        self.selected_feature: int | None = None  # of the SAE shown
        self._focus: int | None = None  # the position whose features the side list shows
        self._position_seen: int | None = None  # the window's selected position, last given
        self._listed: tuple = ()
        self.sae_box = QComboBox(toolTip="Sparse autoencoder whose features are shown")
        self.sae_box.setMinimumContentsLength(16)
        self.sae_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.detach_button = QPushButton("Detach", enabled=False,
                                         toolTip="Stop encoding with this SAE (the features captured so far stay)")
        self.about = QLabel(wordWrap=True)
        self.about.setStyleSheet("color: #555")
        self.legend = elided_label(LEGEND, toolTip=LEGEND)
        self.cells.setMinimumWidth(LABEL_W + GRID_MIN_TOKENS * CELL_W)  # the docks give way, not the tokens
        self.trace_title = QLabel(PICK_A_FEATURE)
        self.trace_plot = pg.PlotWidget(background="w")
        self.trace_plot.setFixedHeight(TRACE_H)
        self.trace_plot.setMouseEnabled(x=False, y=False)
        self.trace_plot.hideButtons()
        self.trace_plot.setMenuEnabled(False)
        self.trace_plot.getAxis("left").setWidth(48)
        self.trace_curve = self.trace_plot.plot(pen=pg.mkPen(SELECTED, width=1.5), symbol="o", symbolSize=4,
                                                symbolPen=None, symbolBrush=SELECTED)
        quiet_axes(self.trace_plot)
        self.token_title = QLabel(wordWrap=True)
        self.token_list = QListWidget(toolTip="Click a feature to plot it across the tokens")
        self.token_list.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.steer_how = QComboBox(toolTip="Add the feature's decoder direction times the number, or set the "
                                           "feature's activation to the number (0 ablates it) keeping the rest")
        for key, label in STEER_HOW.items():
            self.steer_how.addItem(label, key)
        self.steer_value = QDoubleSpinBox(decimals=2, minimum=-1000.0, maximum=1000.0, value=4.0, singleStep=0.5)
        self.steer_button = QPushButton("Steer", enabled=False,
                                        toolTip="A row in the interventions table, for all requests from the next "
                                                "forward on (edit its scope there)")
        self._can_steer = False
        self.clamp_note = QLabel(visible=False)  # why "clamp to" is not offered, beside the button
        self.clamp_note.setStyleSheet("color: #8a4b00")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        for line in (self.trace_title, self.readout):  # a long feature label never widens the window
            line.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)

        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("SAE"))
        bar.addWidget(self.sae_box)
        bar.addWidget(self.detach_button)
        bar.addWidget(self.scale)
        bar.addWidget(self.legend, 1)
        grid_column = QVBoxLayout()
        grid_column.setContentsMargins(0, 0, 0, 0)
        grid_column.addWidget(self.cells, 1)
        grid_column.addWidget(self.trace_title)
        grid_column.addWidget(self.trace_plot)
        steer = QHBoxLayout()
        steer.addWidget(QLabel("Steer with the selected feature:"))
        for widget in (self.steer_how, self.steer_value, self.steer_button, self.clamp_note):
            steer.addWidget(widget)
        steer.addStretch(1)
        grid_column.addLayout(steer)
        side = QWidget()
        side.setFixedWidth(SIDE_W)
        side_column = QVBoxLayout(side)
        side_column.setContentsMargins(0, 0, 0, 0)
        side_column.addWidget(self.about)
        side_column.addWidget(self.token_title)
        side_column.addWidget(self.token_list, 1)
        body = QWidget()
        row = QHBoxLayout(body)
        row.setContentsMargins(0, 0, 0, 0)
        row.addLayout(grid_column, 1)
        row.addWidget(side)
        stack_view(self, bar, body, self.readout)

        self.sae_box.currentTextChanged.connect(self._emit_settings)
        self.detach_button.clicked.connect(self._detach_clicked)
        self.steer_button.clicked.connect(self._steer_clicked)
        self.cells.labelClicked.connect(self._label_clicked)
        self.token_list.itemClicked.connect(self._item_clicked)

    # ------------------------------------------------------------------ choices
    def sae(self) -> str | None:
        return self.sae_box.currentText() or None

    def choose(self, sae: str) -> None:
        """Show ``sae`` from the next refresh on (a newly attached one)."""
        offer(self.sae_box, list(dict.fromkeys([*self.shown.saes, sae])))
        self.sae_box.setCurrentText(sae)

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _detach_clicked(self) -> None:
        if self.shown.sae is not None:
            self.detachRequested.emit(self.shown.sae)

    def _steer_clicked(self) -> None:
        if self.shown.sae is not None and self.selected_feature is not None:
            self.steerRequested.emit(self.shown.sae, self.selected_feature, self.steer_how.currentData(),
                                     self.steer_value.value())

    # ------------------------------------------------------------------ data
    def draw(self, drawing: FeaturesDrawing) -> None:
        self.show_features(drawing.shown, drawing.position, drawing.can_detach, drawing.can_steer,
                           drawing.clamp_refusal)

    def show_features(self, shown: FeaturesShown, position: int | None, can_detach: bool, can_steer: bool,
                      clamp_refusal: str = "") -> None:
        """Draw ``shown``: its grid, or its message where it has none. ``position``: the token selected
        in the window (the side list follows it when it changes); ``can_detach``: the SAE shown is
        attached to the engine now, and the engine is idle; ``can_steer``: it is attached now;
        ``clamp_refusal``: why its features cannot be clamped ("" when they can)."""
        self._can_steer = can_steer
        self._offer_clamp(clamp_refusal)
        if shown.sae != self.shown.sae:
            self.selected_feature = None  # a feature id means another feature in another SAE
        self.shown = shown
        offer(self.sae_box, list(shown.saes))
        if shown.sae is not None and shown.sae != self.sae_box.currentText():
            with QSignalBlocker(self.sae_box):
                self.sae_box.setCurrentText(shown.sae)
        self.detach_button.setEnabled(can_detach)
        self.about.setText(shown.about)
        self.about.setVisible(bool(shown.about))
        if position != self._position_seen:
            self._position_seen = self._focus = position
        grid = shown.grid
        self.cells.set_grid(grid, ACTIVATION, shown.message)
        self.trace_plot.setVisible(grid is not None)
        self.set_scale_numbers(*(("0", f"{grid.peak / 2:.2f}", f"{grid.peak:.2f}") if grid is not None else ("",) * 3),
                               "colour: the feature's activation, 0 (left) to the largest in the grid (right)")
        self._show_selection()

    def _offer_clamp(self, refusal: str) -> None:
        """The "clamp to" choice is greyed out where the engine would refuse it, the reason beside the button."""
        item = self.steer_how.model().item(self.steer_how.findData("clamp"))
        item.setEnabled(not refusal)
        item.setToolTip(f"Not offered: {refusal}" if refusal else "")
        if refusal and self.steer_how.currentData() == "clamp":
            self.steer_how.setCurrentIndex(self.steer_how.findData("add"))
        self.clamp_note.setText("No clamping: hover for why" if refusal else "")
        self.clamp_note.setToolTip(refusal[:1].upper() + refusal[1:])
        self.clamp_note.setVisible(bool(refusal))

    def select_feature(self, feature: int) -> None:
        self.selected_feature = feature
        self._show_selection()

    def _show_selection(self) -> None:
        grid = self.shown.grid
        self.steer_button.setEnabled(self._can_steer and self.selected_feature is not None)
        self.cells.highlighted_row = grid.row_of(self.selected_feature) if grid is not None else None
        self.cells.viewport().update()
        self._show_token_list()
        self._show_trace()

    def _show_token_list(self) -> None:
        """The strongest features of the token in focus (the last one when none is)."""
        grid = self.shown.grid
        c = grid.column_of(self._focus) if grid is not None else None
        if c is None and grid is not None:
            c = grid.shape[1] - 1
        listed = () if c is None else (grid.input(c), int(grid.positions[c]), tuple(grid.token_features(c)))
        if listed != self._listed:
            self._listed = listed
            self.token_list.clear()
            if listed:
                text, position, features = listed
                self.token_title.setText(f"{text!r} (position {position}): its {len(features)} strongest features")
                for feature, activation in features:
                    label = grid.label_of(feature)
                    item = QListWidgetItem(f"{activation:7.3f}  {label}")
                    item.setToolTip(label)
                    item.setData(Qt.ItemDataRole.UserRole, feature)
                    self.token_list.addItem(item)
            else:
                self.token_title.setText("")
        features = [f for f, _ in listed[2]] if listed else []
        with QSignalBlocker(self.token_list):
            self.token_list.setCurrentRow(features.index(self.selected_feature)
                                          if self.selected_feature in features else -1)

    def _show_trace(self) -> None:
        grid, feature = self.shown.grid, self.selected_feature
        if grid is None or feature is None:
            self.trace_curve.setData([], [])
            self.trace_title.setText(PICK_A_FEATURE if grid is not None else "")
            return
        trace = grid.trace(feature)
        self.trace_curve.setData(grid.positions.astype(np.float64), trace.astype(np.float64))
        top = int(np.argmax(trace))
        active = int((trace > 0).sum())
        self.trace_title.setText(
            f"{grid.label_of(feature)} across the tokens: largest {trace[top]:.3f} at {grid.input(top)!r} "
            f"(position {int(grid.positions[top])}); among the strongest at {active} of {len(trace)} tokens"
            if active else f"{grid.label_of(feature)} is not among any token's strongest in this request")

    def trace_data(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, activations) the plot below the grid shows."""
        x, y = self.trace_curve.getData()
        return (np.zeros(0), np.zeros(0)) if x is None else (x, y)

    def listed_features(self) -> list[int]:
        return [self.token_list.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.token_list.count())]

    # ------------------------------------------------------------------ hover and click
    def _cell_clicked(self, r: int, c: int) -> None:
        grid = self.shown.grid
        self._focus = int(grid.positions[c])
        self._picked(int(grid.features[r]))
        self.positionClicked.emit(self._focus)

    def _label_clicked(self, r: int) -> None:
        self._picked(int(self.shown.grid.features[r]))

    def _item_clicked(self, item: QListWidgetItem) -> None:
        self._picked(int(item.data(Qt.ItemDataRole.UserRole)))

    def _picked(self, feature: int) -> None:
        self.select_feature(feature)
        self.featureSelected.emit(feature)

    def _cell_hovered(self, r: int, c: int) -> None:
        super()._cell_hovered(r, c)
        self._focus = int(self.shown.grid.positions[c])
        self._show_token_list()
