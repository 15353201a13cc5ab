"""Layers x tokens: one row per captured residual-stream hook, one column per token position.

Each cell is the L2 norm of that hook's activation at that token (or one chosen feature's value).
Norms are computed incrementally as rows arrive (``RunView.norms``), so the matrix here is
small (hooks x tokens) and simply rebuilt per frame.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtWidgets import QCheckBox, QComboBox, QHBoxLayout, QLabel, QSpinBox, QWidget

from inspector.viewer.image_pool import robust_levels
from inspector.viewer.labels import display_token
from inspector.viewer.tabs import SummaryDrawing

from .view_kit import Placeholder, colormap, quiet_axes, stack_view

MEASURES = ("L2 norm", "feature value")
FAMILIES = {"resid_post": ("resid_post",), "all residual": ("resid_pre", "resid_mid", "resid_post")}


class SummaryView(QWidget):
    positionClicked = Signal(int)
    settingsChanged = Signal()  # measure, feature or family changed: the window feeds new data

    def __init__(self, parent=None):
        super().__init__(parent)
        self._matrix = np.zeros((0, 0), dtype=np.float32)
        self._labels: list[str] = []
        self._texts: list[str] = []
        self._shown_empty: bool | None = None  # axis state last set, to touch the axes only on change
        self._ticks: list | None = None
        self.last_readout = ""

        self.measure_box = QComboBox()
        self.measure_box.addItems(MEASURES)
        self.feature_box = QSpinBox(minimum=0, maximum=1_000_000, enabled=False, toolTip="Feature index")
        self.family_box = QComboBox(toolTip="Which residual-stream hook points form the rows")
        self.family_box.addItems(list(FAMILIES))
        self.relative_box = QCheckBox("relative to layer median", toolTip=(
            "Divide each row by its median, so layers of different scale (the residual stream grows with "
            "depth) share one colour scale"))
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("Show"))
        bar.addWidget(self.measure_box)
        bar.addWidget(self.feature_box)
        bar.addWidget(QLabel("of"))
        bar.addWidget(self.family_box)
        bar.addWidget(QLabel("hooks"))
        bar.addWidget(self.relative_box)
        bar.addStretch(1)

        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.plot = self.glw.addPlot(row=0, col=0)
        self.plot.invertY(True)
        self.plot.hideButtons()
        self.plot.setMenuEnabled(False)
        self.plot.setLabel("bottom", "token position")
        self.plot.getAxis("left").setWidth(96)
        self.vb = self.plot.getViewBox()
        self.vb.setDefaultPadding(0.0)
        self.img = pg.ImageItem(axisOrder="col-major")
        self.plot.addItem(self.img)
        self.cbar = pg.ColorBarItem(values=(0, 1), colorMap=colormap("cividis"), interactive=False, width=14,
                                    colorMapMenu=False)
        self.cbar.setImageItem(self.img)
        self.glw.addItem(self.cbar, row=0, col=1)
        self.empty_text = Placeholder("No residual-stream hook points captured")
        self.plot.addItem(self.empty_text)
        self.readout = QLabel(" ")
        quiet_axes(self.glw)
        stack_view(self, bar, self.glw, self.readout)

        self.measure_box.currentTextChanged.connect(self._measure_changed)
        self.feature_box.valueChanged.connect(self._emit_settings)
        self.family_box.currentTextChanged.connect(self._emit_settings)
        self.relative_box.toggled.connect(self._emit_settings)
        self._hover = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=60, slot=self._mouse_moved)
        self.plot.scene().sigMouseClicked.connect(self._mouse_clicked)

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _measure_changed(self, text: str) -> None:
        self.feature_box.setEnabled(text == "feature value")
        self.settingsChanged.emit()

    def measure(self) -> tuple[str, int]:
        return self.measure_box.currentText(), self.feature_box.value()

    def kinds(self) -> tuple[str, ...]:
        return FAMILIES[self.family_box.currentText()]

    def set_colormap(self, name: str) -> None:
        self.cbar.setColorMap(colormap(name))

    def draw(self, drawing: SummaryDrawing) -> None:
        self.set_rows(drawing.rows, drawing.texts)

    def set_rows(self, rows: list[tuple[str, np.ndarray, np.ndarray]], texts: list[str]) -> None:
        """rows: (label, positions [n], per-position values [n]) per hook, top to bottom."""
        self._texts = texts
        self._labels = [r[0] for r in rows]
        n_pos = max([int(p[-1]) + 1 for _, p, _ in rows if len(p)] + [0])
        m = np.full((n_pos, len(rows)), np.nan, dtype=np.float32)
        for j, (_, pos, vals) in enumerate(rows):
            k = min(len(pos), len(vals))
            if k:
                m[pos[:k], j] = vals[:k]
        if self.relative_box.isChecked() and m.size:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows (hook not captured yet)
                med = np.nanmedian(np.abs(m), axis=0)
            med = np.where(np.isfinite(med) & (med > 0), med, 1.0)
            m = m / med[None, :]
        self._matrix = m
        empty = m.size == 0 or not np.isfinite(m).any()
        self.empty_text.show_if(empty)
        if empty != self._shown_empty:  # setStyle makes an axis regenerate
            self._shown_empty = empty
            for axis in ("left", "bottom"):
                self.plot.getAxis(axis).setStyle(showValues=not empty)
        if empty:
            self.img.clear()
            self.vb.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
            self.empty_text.setPos(0.5, 0.5)
            return
        levels = robust_levels(m, symmetric=self.measure_box.currentText() == "feature value")
        self.img.setImage(m, autoLevels=False, levels=levels)
        self.img.setLevels(levels)  # again: ImageItem applies levels deferred from before it had an image
        self.img.setRect(QRectF(0, 0, m.shape[0], m.shape[1]))
        self.cbar.setLevels(levels, update_items=False)
        step = max(1, len(self._labels) // 24)
        ticks = [[(j + 0.5, lab) for j, lab in enumerate(self._labels) if j % step == 0]]
        if ticks != self._ticks:  # setTicks makes the axis redraw: only when the layers change, not every frame
            self._ticks = ticks
            self.plot.getAxis("left").setTicks(ticks)
        want = [[0, max(m.shape[0], 1)], [0, max(m.shape[1], 1)]]
        if self.vb.viewRange() != want:
            self.vb.setRange(xRange=want[0], yRange=want[1], padding=0)

    def matrix(self) -> np.ndarray:
        return self._matrix

    def readout_at(self, x: float, y: float) -> str:
        col, row = int(np.floor(x)), int(np.floor(y))
        if not (0 <= col < self._matrix.shape[0] and 0 <= row < self._matrix.shape[1]):
            return ""
        value = self._matrix[col, row]
        text = self._texts[col] if col < len(self._texts) else "?"
        what = "‖x‖" if self.measure_box.currentText() == "L2 norm" else f"feature {self.feature_box.value()}"
        if self.relative_box.isChecked():
            what += " / layer median"
        shown = "not captured" if not np.isfinite(value) else f"{value:.6g}"
        return f"{self._labels[row]}   token {display_token(text)!r}   position {col}   {what} = {shown}"

    def _mouse_moved(self, args) -> None:
        pos = args[0]
        if not self.plot.sceneBoundingRect().contains(pos):
            return
        p = self.vb.mapSceneToView(pos)
        self.last_readout = self.readout_at(p.x(), p.y())
        self.readout.setText(self.last_readout or " ")

    def _mouse_clicked(self, ev) -> None:
        if ev.button() != Qt.MouseButton.LeftButton or not self.vb.sceneBoundingRect().contains(ev.scenePos()):
            return
        p = self.vb.mapSceneToView(ev.scenePos())
        if 0 <= int(np.floor(p.x())) < self._matrix.shape[0]:
            self.positionClicked.emit(int(np.floor(p.x())))
