"""The tokens x features heatmap: one column per captured token, features down the side.

Data arrive as views of growing buffers (``set_data``, called by the window's ~30 Hz timer, never
per token). The image shown is pooled to about one bin per pixel by ``PooledImage`` and updated
incrementally, so 2,000 tokens x 4,096 features repaint in a few milliseconds. Above the image a
thin track marks the positions where interventions were active (orange: on this hook; grey: on
another hook). Hovering reads out the raw (unpooled) value under the cursor.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QHBoxLayout, QLabel, QSpinBox, QToolButton,
                               QWidget)

from inspector.viewer.image_pool import PooledImage, choose_key, follow_extent, robust_levels
from inspector.viewer.labels import display_token
from inspector.viewer.tabs import HeatmapDrawing

from .color_image import ColorImageItem, colour
from .tasks import TaskRunner
from .view_kit import (COLORMAP_HINTS, COLORMAPS, MARK_OTHER, MARK_THIS, Placeholder, PositionAxis, colormap,
                       quiet_axes, stack_view)

LEVEL_MODES = ("auto", "auto ±", "fixed")


class HeatmapWidget(QWidget):
    positionClicked = Signal(int)  # a token position was clicked in the image
    colormapChanged = Signal(str)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._positions = np.zeros(0, dtype=np.int64)
        self._values = np.zeros((0, 0), dtype=np.float32)
        self._texts: list[str] = []
        self._marks = np.zeros(0, dtype=np.int8)
        self._source_id = None
        self._p0 = 0
        self._pool = PooledImage()
        self._pooler: TaskRunner | None = None  # pools rows read from disk, off the GUI thread
        self._pooling = False  # a pooling job is out
        self._wanted: tuple | None = None  # what to pool when it is back: (values, key, source)
        self._frame = None
        self._levels = (0.0, 1.0)
        self._follow = True
        self._updating_range = False
        self._selected: int | None = None
        self._hook_label = ""
        self.last_readout = ""
        self._levels_time = 0.0
        self._levels_stale = True  # new data: estimate the levels now
        self._shown_empty = None
        self._expected_width = 0  # the width of the rows awaited (a live run's hook): its axes drawn already
        self.live = False  # rows are arriving: the followed range grows in steps, not per token
        self.paint_count = 0
        self.track_marks = np.zeros(0, dtype=np.uint8)  # per shown row: 0 none, 1 other hook, 2 this hook

        # ---- controls ----
        self.features_from = QSpinBox(minimum=0, maximum=0, toolTip="First feature shown")
        self.features_to = QSpinBox(minimum=1, maximum=1, toolTip="Last feature shown (exclusive)")
        self.features_all = QToolButton(text="All", toolTip="Show every feature")
        self.follow_box = QCheckBox("Follow", checked=True, toolTip="Keep the newest tokens in view")
        self.cmap_box = QComboBox(toolTip="Colour map (cividis, viridis and the CET-CB maps are colour-blind safe)")
        for i, name in enumerate(COLORMAPS):
            self.cmap_box.addItem(name, name)
            hint = COLORMAP_HINTS.get(name)
            if hint:
                self.cmap_box.setItemData(i, hint, Qt.ItemDataRole.ToolTipRole)
        self.cmap_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.cmap_box.setMinimumContentsLength(8)
        self.levels_box = QComboBox(toolTip="Colour levels. auto: robust 0.5–99.5 percentiles; auto ±: symmetric "
                                           "about 0; fixed: the values on the right (or drag the colour bar)")
        self.levels_box.addItems(LEVEL_MODES)
        self.level_lo = QDoubleSpinBox(decimals=4, minimum=-1e9, maximum=1e9, value=-1.0, enabled=False)
        self.level_hi = QDoubleSpinBox(decimals=4, minimum=-1e9, maximum=1e9, value=1.0, enabled=False)
        for w in (self.level_lo, self.level_hi):
            w.setKeyboardTracking(False)
            w.setMinimumWidth(56)
            w.setMaximumWidth(84)
            w.setButtonSymbols(QDoubleSpinBox.ButtonSymbols.NoButtons)
        for w in (self.features_from, self.features_to):
            w.setButtonSymbols(QSpinBox.ButtonSymbols.NoButtons)
            w.setMinimumWidth(48)
        self.reset_view = QToolButton(text="Fit", toolTip="Show all tokens and the chosen feature range")

        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.setSpacing(4)
        bar.addWidget(QLabel("Features"))
        bar.addWidget(self.features_from)
        bar.addWidget(QLabel("–"))
        bar.addWidget(self.features_to)
        bar.addWidget(self.features_all)
        bar.addSpacing(6)
        bar.addWidget(self.follow_box)
        bar.addWidget(self.reset_view)
        bar.addStretch(1)
        bar.addWidget(self.cmap_box)
        bar.addWidget(self.levels_box)
        bar.addWidget(self.level_lo)
        bar.addWidget(self.level_hi)

        # ---- plots ----
        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.track = self.glw.addPlot(row=0, col=0)
        self.track.setMouseEnabled(x=False, y=False)
        self.track.hideButtons()
        self.track.hideAxis("bottom")
        self.track.setMenuEnabled(False)
        self.track.getViewBox().setBackgroundColor((246, 246, 246))
        self.track.getAxis("left").setTicks([[(0.5, "interv.")]])
        self.track.getAxis("left").setToolTip("Where interventions were active: orange on this hook, grey elsewhere")
        self.track.getAxis("left").setWidth(58)
        self.track.setYRange(0, 1, padding=0)
        self.track_img = pg.ImageItem(axisOrder="col-major")
        self._mark_colors = np.array([[0, 0, 0, 0], [*MARK_OTHER.getRgb()[:3], 255], [*MARK_THIS.getRgb()[:3], 255]],
                                     dtype=np.uint8)
        self.track.addItem(self.track_img)

        self.position_axis = PositionAxis("bottom")
        self.plot = self.glw.addPlot(row=1, col=0, axisItems={"bottom": self.position_axis})
        self.plot.setLabel("bottom", "token position")
        self.plot.setLabel("left", "feature")
        self.plot.getAxis("left").setWidth(58)
        self.plot.invertY(True)
        self.plot.hideButtons()
        self.plot.setMenuEnabled(False)
        self.vb = self.plot.getViewBox()
        self.vb.setDefaultPadding(0.0)
        self.track.setXLink(self.plot)
        self.img = ColorImageItem()
        self.plot.addItem(self.img)
        self.selection = pg.LinearRegionItem((0, 1), movable=False, brush=pg.mkBrush(255, 64, 64, 40),
                                             pen=pg.mkPen(220, 40, 40, 200, width=1.5))
        self.selection.setZValue(10)
        self.selection.hide()
        self.plot.addItem(self.selection)
        self.cbar = pg.ColorBarItem(values=(0, 1), colorMap=colormap("cividis"), interactive=True, width=14,
                                    rounding=1e-4, colorMapMenu=False)
        self.cbar.setImageItem(self.img)
        self.glw.addItem(self.cbar, row=1, col=1)
        self.glw.ci.layout.setRowStretchFactor(1, 10)
        self.glw.ci.layout.setRowFixedHeight(0, 18)
        self.glw.ci.layout.setRowSpacing(0, 2)
        self.empty_text = Placeholder("No captured rows yet")
        self.plot.addItem(self.empty_text)

        quiet_axes(self.glw)

        self.readout = QLabel(" ")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.readout.setMinimumHeight(self.readout.fontMetrics().height() + 4)

        stack_view(self, bar, self.glw, self.readout)

        # ---- wiring ----
        self._range_timer = QTimer(self, singleShot=True, interval=60)
        self._range_timer.timeout.connect(self._repool)
        self.vb.sigRangeChangedManually.connect(self._user_moved_view)
        self.vb.sigRangeChanged.connect(self._range_changed)
        self.vb.sigResized.connect(self._restart_range_timer)
        self.features_from.valueChanged.connect(self._feature_range_edited)
        self.features_to.valueChanged.connect(self._feature_range_edited)
        self.features_all.clicked.connect(self.show_all_features)
        self.follow_box.toggled.connect(self._follow_toggled)
        self.reset_view.clicked.connect(self.fit)
        self.cmap_box.currentIndexChanged.connect(self._cmap_chosen)
        self.levels_box.currentTextChanged.connect(self._levels_mode_changed)
        self.level_lo.valueChanged.connect(self._fixed_levels_edited)
        self.level_hi.valueChanged.connect(self._fixed_levels_edited)
        self.cbar.sigLevelsChangeFinished.connect(self._colorbar_dragged)
        self._hover_proxy = pg.SignalProxy(self.plot.scene().sigMouseMoved, rateLimit=60, slot=self._mouse_moved)
        self.plot.scene().sigMouseClicked.connect(self._mouse_clicked)

    # ------------------------------------------------------------------ data
    def draw(self, drawing: HeatmapDrawing) -> None:
        if drawing.rows is None:
            self.clear(drawing.label, drawing.width)
        else:
            self.set_data(*drawing.rows, drawing.texts, drawing.source_id, drawing.marks, drawing.label)

    def clear(self, hook_label: str = "", width: int = 0) -> None:
        """No rows (yet). ``hook_label`` and ``width``: those of the hook they will come from. While rows
        stream in (``live``), the plot is labelled and its axes are drawn for them now, so that the
        first frame of rows does not lay the plot out again and redraw every axis (on a busy machine
        that frame was the GUI's longest stall)."""
        self._expected_width = width
        self.set_data(np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32), [], None,
                      hook_label=hook_label)

    def set_data(self, positions: np.ndarray, values: np.ndarray, texts: list[str], source_id,
                 marks: np.ndarray | None = None, hook_label: str = "") -> None:
        """Show ``values`` ([rows, width], row k at ``positions[k]``). Cheap to call with growing views."""
        new_source = source_id != self._source_id
        width = values.shape[1] if values.ndim == 2 else 0
        old_width = self._values.shape[1] if self._values.ndim == 2 else 0
        self._positions, self._values, self._texts = positions, values, texts
        self._marks = marks if marks is not None else np.zeros(0, dtype=np.int8)
        if hook_label != self._hook_label:
            self.plot.setLabel("left", f"feature · {hook_label}" if hook_label else "feature")
        self._hook_label = hook_label
        self._p0 = int(positions[0]) if len(positions) else 0
        # a capture window keeps rows at some positions only: then the rows stand side by side, each
        # labelled with its position
        sparse = len(positions) > 1 and int(positions[-1]) - self._p0 != len(positions) - 1
        self.position_axis.show_rows(positions if sparse else None, self._p0, new_source)
        if new_source:
            self._source_id = source_id
            self._pool = PooledImage()  # a new one, not the old one emptied: a pooling job may still hold it
            self._levels_stale = True
            self._selected_row_changed()
        if width != old_width or new_source:
            with QSignalBlocker(self.features_from), QSignalBlocker(self.features_to):
                self.features_from.setMaximum(max(width - 1, 0))
                self.features_to.setMaximum(max(width, 1))
                to = self.features_to.value()
                if (new_source and width != old_width) or to > width or to == 0:
                    self.features_from.setValue(0)
                    self.features_to.setValue(max(width, 1))
            if new_source:
                self.fit()
        self.render()

    def set_placeholder(self, text: str) -> None:
        """The message shown while there is nothing to draw."""
        self.empty_text.want(text)

    def displayed_data(self) -> np.ndarray:
        """The full-resolution rows the image shows (tests compare this and the image with captures)."""
        return self._values

    def column_count(self) -> int:
        return len(self._values)

    def image_array(self) -> np.ndarray | None:
        return None if self._frame is None else self._frame.image

    def levels(self) -> tuple[float, float]:
        return self._levels

    # ------------------------------------------------------------------ painting
    def _pixel_size(self) -> tuple[int, int]:
        ratio = self.devicePixelRatioF() or 1.0
        return max(int(self.vb.width() * ratio), 64), max(int(self.vb.height() * ratio), 64)

    def render(self) -> None:
        """Update the image from the data (incremental); called at most at the repaint rate."""
        n = len(self._values)
        width = self._values.shape[1] if self._values.ndim == 2 else 0
        empty = n == 0 or width == 0
        awaited = self._expected_width if empty and self.live else 0
        self.empty_text.show_if(empty)
        blank = empty and not awaited
        if blank != self._shown_empty:  # setStyle makes an axis regenerate: only on a change
            self._shown_empty = blank
            for axis in ("left", "bottom"):
                self.plot.getAxis(axis).setStyle(showValues=not blank)
        if empty:
            self.img.clear()
            self.track_img.clear()
            self.track_marks = np.zeros(0, dtype=np.uint8)
            self._frame = None
            x1, y1 = (follow_extent(0), awaited) if awaited else (1, 1)
            self._updating_range = True
            try:
                self.vb.setRange(xRange=(0, x1), yRange=(0, y1), padding=0)
            finally:
                self._updating_range = False
            self.empty_text.setPos(x1 / 2, y1 / 2)
            return
        if self._follow:
            self._apply_follow_range(n)
        (x0, x1), (y0, y1) = self.vb.viewRange()
        pw, ph = self._pixel_size()
        key = choose_key(n, width, (x0 - self._p0, x1 - self._p0), (y0, y1), pw, ph)
        if isinstance(self._values, np.ndarray):
            self._show_frame(self._pool.update(self._values, key, self._source_id), self._pool.last_reset, n)
            return
        # Rows read back from a file (a write-through run, a reopened capture): pooled off the GUI thread,
        # so that reading them never stalls a frame; the image shown so far stays until they are pooled.
        self._wanted = (self._values, key, self._source_id)
        if not self._pooling:
            self._pool_next()

    def _pool_next(self) -> None:
        wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        if self._pooler is None:
            self._pooler = TaskRunner("heatmap pooling", self)
        self._pooling = True
        self._pooler.start(_pool_rows, self._pool, *wanted, self._levels, self.img.lut, on_done=self._pooled,
                           on_exception=self._pool_failed)

    def _pooled(self, result) -> None:
        self._pooling = False
        frame, rgb, levels, source_id, n = result
        if frame is not None and source_id == self._source_id:  # shown even if a newer request waits: better than none
            self._frame = frame
            self._adopt_levels(frame.image)
            if self._levels != levels and self._wanted is None:  # coloured at the old levels: again, off this thread
                self._wanted = (self._values, self._pool.key, self._source_id)
            self.img.set_coloured(frame.image, rgb, QRectF(self._p0 + frame.x0, frame.y0, frame.width, frame.height),
                                  levels)
            self._finish_frame(n)
        self._pool_next()

    def _pool_failed(self, exc: BaseException) -> None:
        self._pooling = False
        self.empty_text.want(f"Cannot read the rows: {exc}")
        self.empty_text.show_if(True)

    def _show_frame(self, frame, reset: bool, n: int) -> None:
        if frame is None:
            return
        self._frame = frame
        self._adopt_levels(frame.image)
        self.img.set_frame(frame.image, QRectF(self._p0 + frame.x0, frame.y0, frame.width, frame.height), reset,
                           self._levels)
        self._finish_frame(n)

    def _adopt_levels(self, image: np.ndarray) -> None:
        """New bins of the same data (a zoom, a longer run) keep the levels' pace, unless they are fixed."""
        mode = self.levels_box.currentText()
        if mode != "fixed":
            self._auto_levels(image, mode == "auto ±", force=self._levels_stale)
            self._levels_stale = False

    def _finish_frame(self, n: int) -> None:
        if tuple(self.cbar.levels()) != self._levels:
            self.cbar.setLevels(self._levels, update_items=False)
        self._render_marks(n)
        self.paint_count += 1

    def closeEvent(self, event) -> None:
        if self._pooler is not None:
            self._pooler.shutdown(2000)
        super().closeEvent(event)

    def _auto_levels(self, image: np.ndarray, symmetric: bool, force: bool) -> None:
        """Robust levels, re-estimated at most 4 times a second and adopted only when they move by more
        than 2% of the span (10% while rows stream in): every change recolours the whole image and
        redraws the colour bar's axis."""
        now = time.perf_counter()
        if not force and now - self._levels_time < 0.25:
            return
        self._levels_time = now
        lo, hi = robust_levels(image, symmetric=symmetric)
        span = max(self._levels[1] - self._levels[0], 1e-12) * (0.1 if self.live else 0.02)
        if force or abs(lo - self._levels[0]) > span or abs(hi - self._levels[1]) > span:
            self._levels = (lo, hi)
            self._show_levels()

    def _render_marks(self, n: int) -> None:
        marks = self._marks
        if marks is None or not len(marks) or not marks.any():
            if self.track_img.image is not None:  # clearing again still repaints both plots
                self.track_img.clear()
            self.track_marks = np.zeros(0, dtype=np.uint8)
            return
        if self.position_axis.positions is None:
            m = marks[self._p0:self._p0 + n].astype(np.uint8)
        else:  # each shown row's position
            at = self._positions[:n]
            m = np.where(at < len(marks), marks[np.minimum(at, len(marks) - 1)], 0).astype(np.uint8)
        self.track_marks = m
        rgba = self._mark_colors[np.minimum(m, 2)].reshape(len(m), 1, 4)
        self.track_img.setImage(rgba, autoLevels=False, levels=(0, 255))
        self.track_img.setRect(QRectF(self._p0, 0, len(m), 1))

    def _apply_follow_range(self, n: int) -> None:
        self._updating_range = True
        try:
            x0, x1 = self.vb.viewRange()[0]
            want = (self._p0, self._p0 + (follow_extent(n) if self.live else n))
            if (x0, x1) != want:  # an unchanged range must not make the axes regenerate
                self.vb.setXRange(*want, padding=0)
        finally:
            self._updating_range = False

    # slots are bound methods, never lambdas that capture self: PySide keeps such lambdas alive past
    # the widget, and the interpreter's exit then deletes Qt objects in an order Qt cannot handle
    def _restart_range_timer(self, *_) -> None:
        self._range_timer.start()

    def _cmap_chosen(self, _index: int) -> None:
        self.set_colormap(self.cmap_box.currentData())

    def _range_changed(self, *_) -> None:
        if not self._updating_range:
            self._range_timer.start()

    def _repool(self) -> None:
        if len(self._values):
            self.render()

    # ------------------------------------------------------------------ view controls
    def fit(self) -> None:
        n = len(self._values)
        self._updating_range = True
        try:
            extent = follow_extent(n) if self.live and self._follow else max(n, 1)
            self.vb.setXRange(self._p0, self._p0 + extent, padding=0)
            self.vb.setYRange(self.features_from.value(), max(self.features_to.value(), self.features_from.value() + 1),
                              padding=0)
        finally:
            self._updating_range = False
        self._range_timer.start()

    def show_all_features(self) -> None:
        width = self._values.shape[1] if self._values.ndim == 2 else 1
        with QSignalBlocker(self.features_from), QSignalBlocker(self.features_to):
            self.features_from.setValue(0)
            self.features_to.setValue(max(width, 1))
        self._feature_range_edited()

    def set_feature_range(self, f0: int, f1: int) -> None:
        with QSignalBlocker(self.features_from), QSignalBlocker(self.features_to):
            self.features_from.setValue(int(f0))
            self.features_to.setValue(int(f1))
        self._feature_range_edited()

    def _feature_range_edited(self, *_):
        f0, f1 = self.features_from.value(), self.features_to.value()
        if f1 <= f0:
            f1 = f0 + 1
        self._updating_range = True
        try:
            self.vb.setYRange(f0, f1, padding=0)
        finally:
            self._updating_range = False
        self.render()

    def _user_moved_view(self, *_):
        if self.follow_box.isChecked():
            self.follow_box.setChecked(False)
        (y0, y1) = self.vb.viewRange()[1]
        width = self._values.shape[1] if self._values.ndim == 2 else 1
        with QSignalBlocker(self.features_from), QSignalBlocker(self.features_to):
            self.features_from.setValue(int(np.clip(np.floor(y0), 0, max(width - 1, 0))))
            self.features_to.setValue(int(np.clip(np.ceil(y1), 1, width)))
        self._range_timer.start()

    def _follow_toggled(self, on: bool) -> None:
        self._follow = on
        if on:
            self.render()

    def set_colormap(self, name: str) -> None:
        i = self.cmap_box.findData(name)
        if i >= 0 and i != self.cmap_box.currentIndex():
            with QSignalBlocker(self.cmap_box):
                self.cmap_box.setCurrentIndex(i)
        self.cbar.setColorMap(colormap(name))
        self.colormapChanged.emit(name)

    def colormap_name(self) -> str:
        return self.cmap_box.currentData()

    def set_levels_mode(self, mode: str, lo: float | None = None, hi: float | None = None) -> None:
        if lo is not None and hi is not None:
            with QSignalBlocker(self.level_lo), QSignalBlocker(self.level_hi):
                self.level_lo.setValue(lo)
                self.level_hi.setValue(hi)
            self._levels = (float(lo), float(hi))
        self.levels_box.setCurrentText(mode)
        self._levels_mode_changed(mode)

    def _levels_mode_changed(self, mode: str) -> None:
        fixed = mode == "fixed"
        self.level_lo.setEnabled(fixed)
        self.level_hi.setEnabled(fixed)
        if fixed:
            self._fixed_levels_edited()
        elif self._frame is not None:
            self._auto_levels(self._frame.image, mode == "auto ±", force=True)
            self.img.setLevels(self._levels)
            self.cbar.setLevels(self._levels, update_items=False)

    def _fixed_levels_edited(self, *_):
        if self.levels_box.currentText() != "fixed":
            return
        lo, hi = self.level_lo.value(), self.level_hi.value()
        if hi <= lo:
            hi = lo + 1e-6
        self._levels = (lo, hi)
        self.img.setLevels(self._levels)
        self.cbar.setLevels(self._levels, update_items=False)

    def _colorbar_dragged(self, bar) -> None:
        lo, hi = bar.levels()
        with QSignalBlocker(self.levels_box):
            self.levels_box.setCurrentText("fixed")
        self.level_lo.setEnabled(True)
        self.level_hi.setEnabled(True)
        with QSignalBlocker(self.level_lo), QSignalBlocker(self.level_hi):
            self.level_lo.setValue(lo)
            self.level_hi.setValue(hi)
        self._levels = (float(lo), float(hi))

    def _show_levels(self) -> None:
        with QSignalBlocker(self.level_lo), QSignalBlocker(self.level_hi):
            self.level_lo.setValue(self._levels[0])
            self.level_hi.setValue(self._levels[1])

    # ------------------------------------------------------------------ selection
    def select_position(self, position: int | None) -> None:
        self._selected = position
        self._selected_row_changed()

    def _selected_row_changed(self) -> None:
        x = None if self._selected is None else self.position_axis.x_of(self._selected)
        if x is None:
            self.selection.hide()
            return
        self.selection.setRegion((x, x + 1))
        self.selection.show()

    # ------------------------------------------------------------------ hover and click
    def readout_at(self, x: float, y: float) -> str:
        """The read-out for data coordinates (x: position, y: feature); '' outside the data."""
        n = len(self._values)
        width = self._values.shape[1] if self._values.ndim == 2 else 0
        row, feature = int(np.floor(x)) - self._p0, int(np.floor(y))
        if not (0 <= row < n and 0 <= feature < width):
            return ""
        position = int(self._positions[row]) if row < len(self._positions) else row + self._p0
        text = self._texts[position] if 0 <= position < len(self._texts) else "?"
        value = float(self._values[row, feature])
        parts = [f"token {display_token(text)!r}", f"position {position}", f"feature {feature}",
                 f"value {value:.6g}"]
        if self._frame is not None and (self._frame.tbin > 1 or self._frame.fbin > 1):
            parts.append(f"(image pooled {self._frame.tbin}×{self._frame.fbin}, max-abs)")
        if 0 <= position < len(self._marks) and self._marks[position]:
            parts.append("intervention active" + (" on this hook" if self._marks[position] == 2 else " elsewhere"))
        return "   ".join(parts)

    def _mouse_moved(self, args) -> None:
        pos = args[0]
        if not self.plot.sceneBoundingRect().contains(pos):
            return
        p = self.vb.mapSceneToView(pos)
        text = self.readout_at(p.x(), p.y())
        self.last_readout = text
        self.readout.setText(text or " ")

    def hover_view_point(self, x: float, y: float) -> str:
        """Simulate hovering at data coordinates (tests); returns the read-out shown."""
        scene = self.vb.mapViewToScene(QPointF(x, y))
        self._mouse_moved((scene,))
        return self.readout.text().strip()

    def _mouse_clicked(self, ev) -> None:
        if ev.button() != Qt.MouseButton.LeftButton or not self.vb.sceneBoundingRect().contains(ev.scenePos()):
            return
        p = self.vb.mapSceneToView(ev.scenePos())
        row = int(np.floor(p.x())) - self._p0
        if 0 <= row < len(self._values):
            position = int(self._positions[row]) if row < len(self._positions) else row + self._p0
            self.select_position(position)
            self.positionClicked.emit(position)


def _pool_rows(pool: PooledImage, values, key, source_id, levels, lut, _state) -> tuple:
    """A pooling job (on the heatmap's pooling thread): the frame (its image copied: the next job writes
    the pool's), coloured at ``levels``, for what."""
    frame = pool.update(values, key, source_id)
    if frame is None:
        return None, None, levels, source_id, len(values)
    frame = dataclasses.replace(frame, image=frame.image.copy())
    return frame, colour(frame.image, *levels, lut), levels, source_id, len(values)
