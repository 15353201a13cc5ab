"""The Attention tab: what each head of one layer attends to, recomputed from the captured q and k.

Above, one row per head: the selected token's weights over the tokens up to it. Below, the chosen
head's pattern, a row per token (the query) and a column per token it may attend to (the key); later
tokens, which causal attention never sees, are left blank. Both share the key axis. Images are
max-pooled to about a pixel per bin over the part in view, so a few strong weights in a long context
stay visible. Hover reads out the token pair and its weight; a click on a row selects that token, a
click on a head's row selects the head. When there is no pattern the tab says why, and, where the
engine can capture what is missing, offers to; where other requests of the run hold it, it offers to
show one.
"""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QPushButton, QSizePolicy, QStackedWidget,
                               QToolButton, QVBoxLayout, QWidget)

from inspector.viewer.attention import AttentionShown
from inspector.viewer.image_pool import follow_extent, pow2_at_least
from inspector.viewer.labels import display_token
from inspector.viewer.tabs import AttentionDrawing

from .view_kit import colormap, quiet_axes, stack_view

AXIS_WIDTH = 110  # both plots' left axes: the same width keeps their key axes aligned
HEAD_ROWS_PX = 200  # the upper plot's height for all heads together …
HEAD_ROW_PX = (4, 22)  # … within these bounds per head
TICK_STEPS = [m * 10 ** e for e in range(7) for m in (1, 2, 5)]
LABEL_CHARS = 12  # a token's text on an axis is cut to this many characters
ROW_LABEL_PX, COLUMN_LABEL_PX = 13, 44  # room a token's text needs: a line down the side, a short word across
SELECTED_PEN = pg.mkPen(220, 40, 40, 220, width=1.5)


class TokenAxis(pg.AxisItem):
    """Token positions, labelled with the tokens' texts where each has room, else with their numbers."""

    def __init__(self, orientation: str, room: int):
        super().__init__(orientation)
        self.texts: list[str] = []
        self.room = room  # pixels a label needs along the axis

    def tickValues(self, minVal, maxVal, size):
        minVal, maxVal = sorted((minVal, maxVal))  # an inverted axis gives them the other way round
        per_token = size / max(maxVal - minVal, 1e-9)
        step = next((s for s in TICK_STEPS if s * per_token >= self.room), TICK_STEPS[-1])
        first = math.ceil(minVal / step) * step
        return [(step, list(range(first, math.floor(maxVal) + 1, step)))]

    def tickStrings(self, values, scale, spacing):
        if spacing != 1:
            return [str(int(v)) for v in values]
        return [display_token(self.texts[int(v)])[:LABEL_CHARS] if 0 <= int(v) < len(self.texts) else ""
                for v in values]


def pool_max(image: np.ndarray, row_bin: int, col_bin: int) -> np.ndarray:
    """The maximum of each row_bin x col_bin bin (the last ones partial), as a new array. Rows first:
    a maximum across whole rows runs at the speed of memory, one over short runs of columns at a tenth
    of it (pooling one head's pattern of 2,048 tokens costs about one pass over it)."""
    rows, cols = image.shape
    full_rows, full_cols = rows // row_bin * row_bin, cols // col_bin * col_bin
    by_rows = np.empty((-(-rows // row_bin), cols), np.float32)
    np.max(image[:full_rows].reshape(-1, row_bin, cols), axis=1, out=by_rows[:rows // row_bin])
    if full_rows < rows:
        by_rows[-1] = image[full_rows:].max(axis=0)
    out = np.empty((len(by_rows), -(-cols // col_bin)), np.float32)
    np.max(by_rows[:, :full_cols].reshape(len(by_rows), -1, col_bin), axis=2, out=out[:, :cols // col_bin])
    if full_cols < cols:
        out[:, -1] = by_rows[:, full_cols:].max(axis=1)
    return out


def pooled_window(image: np.ndarray, row_range, col_range, pixels: tuple[int, int]):
    """The part of ``image`` [rows, columns] in view (cell (r, c) drawn centred on x = c, y = r),
    max-pooled to about a pixel per bin, so a few strong weights in a long context stay visible: (pooled, first row,
    first column, row bin, column bin)."""
    def window(n, lo, hi, px):
        a = int(np.clip(np.floor(lo + 0.5), 0, max(n - 1, 0)))
        b = int(np.clip(np.ceil(hi + 0.5), a + 1, max(n, 1)))
        step = pow2_at_least((b - a) / max(px, 16))
        return a // step * step, b, step

    r0, r1, row_bin = window(image.shape[0], *row_range, pixels[0])
    c0, c1, col_bin = window(image.shape[1], *col_range, pixels[1])
    return pool_max(image[r0:r1, c0:c1], row_bin, col_bin), r0, c0, row_bin, col_bin


class AttentionView(QWidget):
    positionClicked = Signal(int)  # a token's row was clicked: select that token everywhere
    settingsChanged = Signal()  # the layer or head changed: the window feeds new data
    captureRequested = Signal(list)  # hook names to tick (the button under a "not captured" message)
    requestChosen = Signal(str)  # show this request (the button under a "held by other requests" message)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.shown = AttentionShown("No attention patterns yet")
        self.last_readout = ""
        self._user_range = False  # the user zoomed or panned: new rows keep the view where it is

        self.layer_box = QComboBox(toolTip="Layers whose queries and keys are captured")
        self.head_box = QComboBox(toolTip="The head whose pattern is drawn below (or click its row above)")
        self.query_label = QLabel()
        self.query_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.fit_button = QToolButton(text="Fit", toolTip="Show every token")
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("Layer"))
        bar.addWidget(self.layer_box)
        bar.addWidget(QLabel("Head"))
        bar.addWidget(self.head_box)
        bar.addWidget(self.query_label, 1)
        bar.addWidget(self.fit_button)

        self.message = QLabel(wordWrap=True, alignment=Qt.AlignmentFlag.AlignCenter)
        self.message.setStyleSheet("color: rgb(110, 110, 110)")
        self.capture_button = QPushButton()
        self.request_button = QPushButton(toolTip="Show this request, which holds queries and keys, in every view")
        message_page = QWidget()
        column = QVBoxLayout(message_page)
        column.addStretch(1)
        column.addWidget(self.message)
        column.addWidget(self.capture_button, 0, Qt.AlignmentFlag.AlignHCenter)
        column.addWidget(self.request_button, 0, Qt.AlignmentFlag.AlignHCenter)
        column.addStretch(1)

        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.heads_plot = self.glw.addPlot(row=0, col=0)
        self.pattern_plot = self.glw.addPlot(row=1, col=0, axisItems={"left": TokenAxis("left", ROW_LABEL_PX),
                                                                     "bottom": TokenAxis("bottom", COLUMN_LABEL_PX)})
        for plot in (self.heads_plot, self.pattern_plot):
            plot.invertY(True)
            plot.hideButtons()
            plot.setMenuEnabled(False)
            plot.getViewBox().setDefaultPadding(0.0)
            plot.getAxis("left").setWidth(AXIS_WIDTH)
        self.heads_plot.hideAxis("bottom")
        self.heads_plot.setMouseEnabled(x=True, y=False)
        self.heads_plot.setXLink(self.pattern_plot)
        self.heads_plot.setLabel("left", "head")
        self.pattern_plot.setLabel("left", "token (query)")
        self.pattern_plot.setLabel("bottom", "earlier token it attends to (key)")
        self.heads_img = pg.ImageItem(axisOrder="row-major")  # [rows, columns]: [heads or tokens, keys]
        self.pattern_img = pg.ImageItem(axisOrder="row-major")
        self.heads_plot.addItem(self.heads_img)
        self.pattern_plot.addItem(self.pattern_img)
        self.head_band = pg.LinearRegionItem((0, 1), orientation="horizontal", movable=False,
                                             brush=pg.mkBrush(0, 0, 0, 0), pen=SELECTED_PEN)
        self.query_band = pg.LinearRegionItem((0, 1), orientation="horizontal", movable=False,
                                              brush=pg.mkBrush(255, 64, 64, 30), pen=SELECTED_PEN)
        self.heads_plot.addItem(self.head_band)
        self.pattern_plot.addItem(self.query_band)
        self.note = pg.TextItem("", color=(110, 110, 110), anchor=(0, 0.5))
        self.heads_plot.addItem(self.note)
        self.cbar = pg.ColorBarItem(values=(0, 1), colorMap=colormap("cividis"), interactive=False, width=14,
                                    colorMapMenu=False, label="weight")
        self.cbar.setImageItem([self.heads_img, self.pattern_img])
        self.glw.addItem(self.cbar, row=0, col=1, rowspan=2)
        self.glw.ci.layout.setRowStretchFactor(1, 10)
        quiet_axes(self.glw)

        self.stack = QStackedWidget()
        self.stack.addWidget(message_page)
        self.stack.addWidget(self.glw)
        self.readout = QLabel(" ")
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        stack_view(self, bar, self.stack, self.readout)

        self._range_timer = QTimer(self, singleShot=True, interval=60)
        self._range_timer.timeout.connect(self.render)
        self.layer_box.currentIndexChanged.connect(self._emit_settings)
        self.head_box.currentIndexChanged.connect(self._emit_settings)
        self.capture_button.clicked.connect(self._capture_clicked)
        self.request_button.clicked.connect(self._request_clicked)
        self.fit_button.clicked.connect(self.fit)
        self.pattern_plot.getViewBox().sigRangeChangedManually.connect(self._user_moved_view)
        self.heads_plot.getViewBox().sigRangeChangedManually.connect(self._user_moved_view)
        self.pattern_plot.getViewBox().sigResized.connect(self._restart_range_timer)
        self._hover = pg.SignalProxy(self.glw.scene().sigMouseMoved, rateLimit=60, slot=self._mouse_moved)
        self.glw.scene().sigMouseClicked.connect(self._mouse_clicked)

    # ------------------------------------------------------------------ choices
    def set_layers(self, layers: list[int]) -> int | None:
        """Offer ``layers`` (keeping the one chosen if it is still offered); returns the one chosen."""
        if layers != [self.layer_box.itemData(i) for i in range(self.layer_box.count())]:
            current = self.layer_box.currentData()
            with QSignalBlocker(self.layer_box):
                self.layer_box.clear()
                for layer in layers:
                    self.layer_box.addItem(f"layer {layer}", layer)
                self.layer_box.setCurrentIndex(max(self.layer_box.findData(current), 0))
        return self.layer_box.currentData()

    def head(self) -> int:
        return max(self.head_box.currentIndex(), 0)

    def select_head(self, head: int) -> None:
        self.head_box.setCurrentIndex(head)  # emits settingsChanged: the window draws the head's pattern

    def set_colormap(self, name: str) -> None:
        self.cbar.setColorMap(colormap(name))

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _capture_clicked(self) -> None:
        self.captureRequested.emit([h.name for h in self.shown.to_capture])

    def _request_clicked(self) -> None:
        self.requestChosen.emit(self.shown.holders[0])

    # ------------------------------------------------------------------ data
    def draw(self, drawing: AttentionDrawing) -> None:
        self.show_attention(drawing.shown, drawing.can_capture, drawing.live)

    def show_attention(self, shown: AttentionShown, can_capture: bool = False, live: bool = False) -> None:
        """Draw ``shown``; ``can_capture``: the engine can capture what a message says is missing;
        ``live``: rows are arriving (the view then grows in steps, not token by token)."""
        self.shown = shown
        if shown.message:
            self.message.setText(shown.message)
            wanted = shown.to_capture
            self.capture_button.setVisible(can_capture and bool(wanted))
            self.capture_button.setText(f"Capture {wanted[0].alias}" if len(wanted) == 1 else
                                        "Capture the queries and keys of every layer")
            self.request_button.setVisible(bool(shown.holders))
            self.request_button.setText(f"Show {shown.holders[0]}" if shown.holders else "")
            self.stack.setCurrentIndex(0)
            return
        self.stack.setCurrentIndex(1)
        if self.head_box.count() != shown.heads:
            with QSignalBlocker(self.head_box):
                self.head_box.clear()
                self.head_box.addItems([f"head {h}" for h in range(shown.heads)])
            row_px = min(max(HEAD_ROWS_PX // shown.heads, HEAD_ROW_PX[0]), HEAD_ROW_PX[1])
            every = -(-ROW_LABEL_PX // row_px)  # a label per line of text
            self.heads_plot.getAxis("left").setTicks([[(h, f"H{h}") for h in range(0, shown.heads, every)]])
            self.glw.ci.layout.setRowFixedHeight(0, 12 + shown.heads * row_px)
        if self.head_box.currentIndex() != shown.head:
            with QSignalBlocker(self.head_box):
                self.head_box.setCurrentIndex(shown.head)
        for side in ("left", "bottom"):
            self.pattern_plot.getAxis(side).texts = shown.tokens
        query = "" if shown.query is None else f"above: token {shown.token(shown.query)} in every head · "
        self.query_label.setText(f"{query}below: head {shown.head}, every token")
        if not self._user_range:
            self.fit(user=False, live=live)
        self.render()

    def fit(self, *_, user: bool = True, live: bool = False) -> None:
        """Every token in view (the view follows the rows while the user has not zoomed or panned)."""
        self._user_range = self._user_range and not user
        n = max(len(self.shown.pattern), 1)
        first = int(self.shown.query_positions[0]) if len(self.shown.query_positions) else 0
        span = (first - 0.5, first + (follow_extent(n) if live else n) - 0.5)
        if self.pattern_plot.viewRange() != [list(span), list(span)]:
            self.pattern_plot.setRange(xRange=span, yRange=span, padding=0)
        self.heads_plot.setYRange(-0.5, max(self.shown.heads, 1) - 0.5, padding=0)
        if user:
            self.render()

    def _user_moved_view(self, *_) -> None:
        self._user_range = True
        self._range_timer.start()

    def _restart_range_timer(self, *_) -> None:
        self._range_timer.start()

    # ------------------------------------------------------------------ painting
    def _pixels(self, plot) -> tuple[int, int]:
        """(rows, columns) of device pixels the plot's view box covers."""
        ratio = self.devicePixelRatioF() or 1.0
        vb = plot.getViewBox()
        return int(vb.height() * ratio), int(vb.width() * ratio)

    def render(self) -> None:
        """Draw the part of both images in view: a cost set by the pixels and the tokens in view."""
        s = self.shown
        if s.message or not len(s.pattern):
            self.pattern_img.clear()
            self.heads_img.clear()
            return
        (x0, x1), (y0, y1) = self.pattern_plot.viewRange()
        k0, q0 = int(s.key_positions[0]), int(s.query_positions[0])
        image, a, b, row_bin, col_bin = pooled_window(s.pattern, (y0 - q0, y1 - q0), (x0 - k0, x1 - k0),
                                                      self._pixels(self.pattern_plot))
        last_query = np.minimum(q0 + a + row_bin * np.arange(1, len(image) + 1), q0 + len(s.pattern)) - 1
        first_key = k0 + b + col_bin * np.arange(image.shape[1])
        image[last_query[:, None] < first_key[None, :]] = np.nan  # later tokens: blank, not "weight 0"
        self._set_image(self.pattern_img, image, QRectF(k0 + b - 0.5, q0 + a - 0.5, image.shape[1] * col_bin,
                                                        len(image) * row_bin))
        self.query_band.setVisible(s.query is not None)
        if s.query is not None:
            self.query_band.setRegion((s.query - 0.5, s.query + 0.5))
        self.head_band.setRegion((s.head - 0.5, s.head + 0.5))
        self.note.setText(s.query_note)
        self.note.setPos(x0, (s.heads - 1) / 2)
        if s.query is None:
            self.heads_img.clear()
            return
        rows, columns = self._pixels(self.heads_plot)
        image, _, b, _, col_bin = pooled_window(s.query_weights, (-0.5, s.heads - 0.5), (x0 - k0, x1 - k0),
                                                (max(rows, s.heads), columns))
        self._set_image(self.heads_img, image, QRectF(k0 + b - 0.5, -0.5, image.shape[1] * col_bin, s.heads))

    @staticmethod
    def _set_image(item: pg.ImageItem, image: np.ndarray, rect: QRectF) -> None:
        item.setImage(image, autoLevels=False, levels=(0.0, 1.0))
        item.setRect(rect)

    # ------------------------------------------------------------------ hover and click
    def _pair_at(self, scene_pos) -> tuple[int, int, int] | None:
        """(head, query, key) under a scene point, or None."""
        s = self.shown
        if s.message or not len(s.pattern):
            return None
        for plot in (self.pattern_plot, self.heads_plot):
            vb = plot.getViewBox()
            if vb.sceneBoundingRect().contains(scene_pos):
                p = vb.mapSceneToView(scene_pos)
                x, y = int(np.floor(p.x() + 0.5)), int(np.floor(p.y() + 0.5))
                if plot is self.pattern_plot:
                    return s.head, y, x
                return (y, s.query, x) if s.query is not None and 0 <= y < s.heads else None
        return None

    def readout_at(self, scene_pos) -> str:
        pair = self._pair_at(scene_pos)
        return "" if pair is None else self.shown.describe(*pair)

    def _mouse_moved(self, args) -> None:
        self.last_readout = self.readout_at(args[0])
        self.readout.setText(self.last_readout or " ")

    def hover(self, plot, x: float, y: float) -> str:
        """Hover at data coordinates of ``plot`` (tests, screenshots); returns the read-out shown."""
        self._mouse_moved((plot.getViewBox().mapViewToScene(QPointF(x, y)),))
        return self.last_readout

    def _mouse_clicked(self, ev) -> None:
        pair = self._pair_at(ev.scenePos()) if ev.button() == Qt.MouseButton.LeftButton else None
        if pair is None:
            return
        head, query, _ = pair
        if self.heads_plot.getViewBox().sceneBoundingRect().contains(ev.scenePos()):
            self.select_head(head)
        elif 0 <= query - int(self.shown.query_positions[0]) < len(self.shown.pattern):
            self.positionClicked.emit(query)
