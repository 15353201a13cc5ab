"""The Compare tab: a prompt's clean and intervened twins side by side.

The two texts sit next to each other with the first diverging token marked; under them a strip
gives, per generated token, the KL divergence between the twins' next-token distributions and the
logprob change of the clean twin's token; under that a heatmap shows intervened − clean at the hook
point the intervention is on (the one selected in the window where that was not captured), position
by position, on a diverging colour map centred on 0, at least a third of the tab high. Data come from
``inspector.viewer.compare`` at the window's repaint rate.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QSizePolicy, QSplitter, QStackedWidget, QTextEdit,
                               QVBoxLayout, QWidget)

from inspector.core.colormaps import DIFF_COLORMAP
from inspector.viewer.compare import CHANGE_TIP, KL_TIP, NO_TWINS, ComparisonShown
from inspector.viewer.labels import display_token
from inspector.viewer.tabs import CompareDrawing

from .heatmap import HeatmapWidget
from .view_kit import MARK_THIS, quiet_axes

PROMPT, SHARED, SPLIT, AFTER = "prompt", "shared", "split", "after"
KL_COLOUR, CHANGE_COLOUR = (213, 94, 0), (0, 114, 178)  # Okabe-Ito vermillion and blue
STRIP_HEIGHT = 130
DIFF_MIN_HEIGHT = 200  # the heatmap's controls, its intervention track and a readable band of features
AFTER_SPLIT_TIP = ("After the first diverging token the twins continue different texts: from there on the "
                   "measures compare the next tokens of two different contexts")


def _formats() -> dict[str, QTextCharFormat]:
    """Grey prompt, plain shared text, the first diverging token marked, the text after it in blue."""
    formats = {name: QTextCharFormat() for name in (PROMPT, SHARED, SPLIT, AFTER)}
    formats[PROMPT].setForeground(QColor(120, 120, 120))
    formats[SHARED].setForeground(QColor(10, 10, 10))
    formats[SPLIT].setBackground(MARK_THIS)
    formats[SPLIT].setFontWeight(QFont.Weight.Bold)
    formats[AFTER].setForeground(QColor(*CHANGE_COLOUR))
    return formats


class TwinText(QTextEdit):
    """One twin's prompt and generated text, grown by its new tokens (redrawn when the split moves)."""

    def __init__(self, parent=None):
        super().__init__(parent, readOnly=True)
        self.setLineWrapMode(QTextEdit.LineWrapMode.WidgetWidth)
        self.setMinimumHeight(3 * self.fontMetrics().lineSpacing() + 8)  # the room goes to the plots below
        self._formats = _formats()
        self._shown: tuple = (None, None, 0)  # (pair, divergence, tokens shown)

    def show_tokens(self, pair, texts: list[str], prompt_length: int, divergence: int | None) -> None:
        key, divergence_shown, n = self._shown
        if (key, divergence_shown) != (pair, divergence) or len(texts) < n:
            self.clear()
            n = 0
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        split = None if divergence is None else prompt_length + divergence
        for start, end, part in _segments(prompt_length, split, len(texts)):
            a, b = max(start, n), end
            if a >= b:
                continue
            if part == SPLIT and not texts[a].strip():  # a bare space or newline: mark a visible glyph of it
                cursor.insertText(display_token(texts[a]), self._formats[SPLIT])
                part = SHARED
            cursor.insertText("".join(texts[a:b]), self._formats[part])
        if len(texts) > n:
            self.ensureCursorVisible()
        self._shown = (pair, divergence, len(texts))

    def split_text(self) -> str:
        """The text marked as the first diverging token ('' if none; tests)."""
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                if fragment.charFormat().fontWeight() == QFont.Weight.Bold:
                    return fragment.text()
                it += 1
            block = block.next()
        return ""


def _segments(prompt_length: int, split: int | None, n: int) -> list[tuple[int, int, str]]:
    """(first token, end, part) runs of a twin's tokens."""
    if split is None:
        return [(0, min(prompt_length, n), PROMPT), (prompt_length, n, SHARED)]
    return [(0, min(prompt_length, n), PROMPT), (prompt_length, min(split, n), SHARED),
            (split, min(split + 1, n), SPLIT), (split + 1, n, AFTER)]


class CompareView(QWidget):
    pairChosen = Signal(str)  # a twin pair was picked: its intervened twin's request id
    positionClicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.shown = ComparisonShown(NO_TWINS)
        self.last_readout = ""
        self.empty = QLabel(NO_TWINS, wordWrap=True, alignment=Qt.AlignmentFlag.AlignCenter)
        self.empty.setContentsMargins(40, 0, 40, 0)
        self.empty.setStyleSheet("color: rgb(110, 110, 110)")

        self.pair_box = QComboBox(toolTip="The twin pair shown: a prompt's clean and intervened runs")
        self.pair_box.setMinimumContentsLength(24)
        self.pair_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.note = QLabel(wordWrap=True)
        self.note.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)  # never widens the window
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("Twins"))
        bar.addWidget(self.pair_box)
        bar.addWidget(self.note, 1)

        self.clean_text, self.intervened_text = TwinText(), TwinText()
        texts = QSplitter(Qt.Orientation.Horizontal)
        for title, pane in (("Clean", self.clean_text), ("Intervened", self.intervened_text)):
            texts.addWidget(_titled(title, pane))

        self.strip = pg.GraphicsLayoutWidget()
        self.strip.setBackground("w")
        self.strip.setToolTip(f"{KL_TIP}.\n{CHANGE_TIP}.")
        self.kl_plot = self._strip_plot(0, "KL ≥", KL_TIP)
        self.change_plot = self._strip_plot(1, "Δ logprob", CHANGE_TIP)
        self.change_plot.setXLink(self.kl_plot)
        self.change_plot.setLabel("bottom", "token position")
        self.kl_plot.hideAxis("bottom")
        self.kl_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=pg.mkBrush(*KL_COLOUR), pen=pg.mkPen(None))
        self.change_bars = pg.BarGraphItem(x=[], height=[], width=0.8, brush=pg.mkBrush(*CHANGE_COLOUR),
                                           pen=pg.mkPen(None))
        self.kl_plot.addItem(self.kl_bars)
        self.change_plot.addItem(self.change_bars)
        self.split_lines, self.after_split = [], []
        split_pen = pg.mkPen(MARK_THIS, width=2, style=Qt.PenStyle.DashLine)
        for plot in (self.kl_plot, self.change_plot):
            line = pg.InfiniteLine(angle=90, movable=False, pen=split_pen)
            shade = pg.LinearRegionItem(movable=False, brush=pg.mkBrush(0, 0, 0, 16), pen=pg.mkPen(None))
            shade.setToolTip(AFTER_SPLIT_TIP)
            for item in (line, shade):
                item.hide()
                plot.addItem(item, ignoreBounds=True)
            self.split_lines.append(line)
            self.after_split.append(shade)
        quiet_axes(self.strip)
        self.strip.setMinimumHeight(STRIP_HEIGHT)

        self.diff = HeatmapWidget()
        self.diff.set_colormap(DIFF_COLORMAP)
        self.diff.set_levels_mode("auto ±")
        self.diff.set_placeholder("No rows of the selected hook point for these twins: select a captured one")
        self.diff_title = QLabel()
        diff_box = QWidget()
        diff_layout = QVBoxLayout(diff_box)
        diff_layout.setContentsMargins(0, 0, 0, 0)
        diff_layout.setSpacing(1)
        diff_layout.addWidget(self.diff_title)
        diff_layout.addWidget(self.diff, 1)
        diff_box.setMinimumHeight(DIFF_MIN_HEIGHT)

        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(texts)
        split.addWidget(self.strip)
        split.addWidget(diff_box)
        split.setStretchFactor(0, 2)
        split.setStretchFactor(1, 1)
        split.setStretchFactor(2, 3)
        split.setSizes([60, STRIP_HEIGHT, 3 * DIFF_MIN_HEIGHT])
        self.readout = QLabel(" ")
        self.content = QWidget()
        layout = QVBoxLayout(self.content)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(2)
        layout.addLayout(bar)
        layout.addWidget(split, 1)
        layout.addWidget(self.readout)
        self.pages = QStackedWidget()
        self.pages.addWidget(self.empty)
        self.pages.addWidget(self.content)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.pages)

        self.pair_box.currentIndexChanged.connect(self._pair_chosen)
        self.diff.positionClicked.connect(self.positionClicked)
        self._hover = pg.SignalProxy(self.strip.scene().sigMouseMoved, rateLimit=60, slot=self._mouse_moved)
        self.strip.scene().sigMouseClicked.connect(self._mouse_clicked)

    def _strip_plot(self, row: int, label: str, tip: str) -> pg.PlotItem:
        plot = self.strip.addPlot(row=row, col=0)
        plot.setMouseEnabled(x=True, y=False)
        plot.hideButtons()
        plot.setMenuEnabled(False)
        plot.setLabel("left", label)
        plot.getAxis("left").setWidth(58)
        plot.getAxis("left").setToolTip(tip)
        plot.addLine(y=0, pen=pg.mkPen(160, 160, 160))
        return plot

    # ------------------------------------------------------------------ data
    def draw(self, drawing: CompareDrawing) -> None:
        self.show_comparison(drawing.shown, drawing.live)

    def show_comparison(self, shown: ComparisonShown, live: bool = False) -> None:
        """Draw ``shown`` (``live``: its rows are still arriving)."""
        self.shown = shown
        if shown.message:
            self.empty.setText(shown.message)
            self.pages.setCurrentWidget(self.empty)
            return
        self.pages.setCurrentWidget(self.content)
        self._show_pairs(shown)
        self.note.setText(shown.note)
        for pane, texts in ((self.clean_text, shown.clean_texts), (self.intervened_text, shown.intervened_texts)):
            pane.show_tokens(shown.twins, texts, shown.prompt_length, shown.divergence)
        self._show_strip(shown)
        self.diff.live = live
        self.diff_title.setText(f"<b>Intervened − clean</b> at {shown.hook_label or 'the intervened hook point'}, "
                                "position by position (diverging colours: 0 in the middle)")
        if shown.hook_label:
            self.diff.set_data(shown.diff_positions, shown.diff_values, shown.intervened_texts, shown.diff_source,
                               shown.marks)
        else:
            self.diff.clear()

    def _show_pairs(self, shown: ComparisonShown) -> None:
        current = [self.pair_box.itemData(i) for i in range(self.pair_box.count())]
        if current != [t.intervened for t in shown.pairs] or self.pair_box.currentData() != shown.twins.intervened:
            with QSignalBlocker(self.pair_box):
                self.pair_box.clear()
                for twins, label in zip(shown.pairs, shown.labels):
                    self.pair_box.addItem(label, twins.intervened)
                self.pair_box.setCurrentIndex(max(self.pair_box.findData(shown.twins.intervened), 0))

    def _show_strip(self, shown: ComparisonShown) -> None:
        x = shown.token_positions()
        for bars, values in ((self.kl_bars, shown.kl), (self.change_bars, shown.logprob_change)):
            known = np.isfinite(values)
            bars.setOpts(x=x[known], height=values[known])
        split = None if shown.divergence is None else shown.prompt_length + shown.divergence - 0.5
        end = shown.prompt_length + len(shown.kl) - 0.5
        for line, shade in zip(self.split_lines, self.after_split):
            line.setVisible(split is not None)
            shade.setVisible(split is not None)
            if split is not None:
                line.setValue(split)
                shade.setRegion((split, max(split, end)))

    def _pair_chosen(self, index: int) -> None:
        rid = self.pair_box.itemData(index)
        if rid is not None:
            self.pairChosen.emit(rid)

    # ------------------------------------------------------------------ hover and click
    def _token_at(self, scene_pos) -> int | None:
        """The generated token under a point of the strip, if any."""
        for plot in (self.kl_plot, self.change_plot):
            if plot.sceneBoundingRect().contains(scene_pos):
                k = int(round(plot.getViewBox().mapSceneToView(scene_pos).x())) - self.shown.prompt_length
                return k if 0 <= k < len(self.shown.kl) else None
        return None

    def _mouse_moved(self, args) -> None:
        k = self._token_at(args[0])
        self.last_readout = "" if k is None else self.shown.describe(k)
        self.readout.setText(self.last_readout or " ")

    def _mouse_clicked(self, event) -> None:
        k = self._token_at(event.scenePos()) if event.button() == Qt.MouseButton.LeftButton else None
        if k is not None:
            self.positionClicked.emit(self.shown.prompt_length + k)

    def hover_token(self, k: int) -> str:
        """Simulate hovering over generated token ``k`` in the strip (tests); returns the read-out."""
        vb = self.kl_plot.getViewBox()
        middle = sum(vb.viewRange()[1]) / 2
        self._mouse_moved((vb.mapViewToScene(pg.Point(self.shown.prompt_length + k, middle)),))
        return self.last_readout


def _titled(title: str, widget: QWidget) -> QWidget:
    box = QWidget()
    layout = QVBoxLayout(box)
    layout.setContentsMargins(0, 0, 0, 0)
    layout.setSpacing(1)
    layout.addWidget(QLabel(f"<b>{title}</b>"))
    layout.addWidget(widget, 1)
    return box
