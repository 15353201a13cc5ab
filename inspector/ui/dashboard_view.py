"""The Dashboard tab: a corpus scan opened with File ▸ Open Scan… (``viewer.dashboard.ScanDashboard``).

On the left the units that were active, strongest first, with a filter box (an id or label text); on
the right the selected unit's strongest examples as text with the activating token marked, and the
histogram of all its activations, the counts outside the bars said in words.
"""

from __future__ import annotations

import html

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QSignalBlocker, Qt
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (QLabel, QLineEdit, QListWidget, QListWidgetItem, QSizePolicy, QSplitter,
                               QTextBrowser, QVBoxLayout, QWidget)

from inspector.viewer.dashboard import Example, ScanDashboard

from .view_kit import quiet_axes

NO_SCAN = "No scan open: File ▸ Open Scan… shows what a corpus scan (inspector scan) found, feature by feature"
HIGHLIGHT = "background-color:#ffd08a; color:#8a2c00; font-weight:bold"
BAR_COLOUR = (70, 110, 170)
HISTOGRAM_H = 150


def examples_html(examples: list[Example], mono: str = "monospace") -> str:
    """A table: activation, document, position, and the context (in font family ``mono``: code reads
    best so) with the activating token marked."""
    rows = "".join(
        f"<tr><td align='right'>{e.activation:.3f}</td><td align='right'>{e.document}</td>"
        f"<td align='right'>{e.position}</td><td style='white-space:pre; font-family:\"{mono}\"'>"
        f"{html.escape(e.before)}<span style='{HIGHLIGHT}'>{html.escape(e.token)}</span>{html.escape(e.after)}"
        "</td></tr>" for e in examples)
    return ("<table cellspacing='0' cellpadding='3'><tr style='color:#666'><th align='right'>activation</th>"
            "<th align='right'>document</th><th align='right'>position</th><th align='left'>context</th></tr>"
            f"{rows}</table>")


class DashboardView(QWidget):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.dashboard: ScanDashboard | None = None
        self.unit: int | None = None
        self.header = QLabel(NO_SCAN, wordWrap=True)
        self.header.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.unfinished = QLabel(wordWrap=True, visible=False)
        self.unfinished.setStyleSheet("color: #a05000; font-weight: bold")
        self.filter = QLineEdit(placeholderText="Filter: a feature id or label text", clearButtonEnabled=True)
        self.count = QLabel()
        self.units = QListWidget(toolTip="Units active in the scan, strongest first: click one to see its examples")
        self.title = QLabel(wordWrap=True)
        self.title.setStyleSheet("font-weight: bold")
        self.examples = QTextBrowser(openLinks=False)
        self.examples.setLineWrapMode(QTextBrowser.LineWrapMode.NoWrap)
        self.histogram_plot = pg.PlotWidget(background="w")
        self.histogram_plot.setMinimumHeight(HISTOGRAM_H // 2)
        self.histogram_plot.setMouseEnabled(x=False, y=False)
        self.histogram_plot.hideButtons()
        self.histogram_plot.setMenuEnabled(False)
        self.histogram_plot.getAxis("left").setWidth(48)
        self.histogram_plot.setLabel("bottom", "activation")
        self.bars = pg.BarGraphItem(x0=[], x1=[], height=[], brush=BAR_COLOUR, pen=pg.mkPen("w", width=0.5))
        self.histogram_plot.addItem(self.bars)
        quiet_axes(self.histogram_plot)
        self.overflow = QLabel()
        for line in (self.count, self.overflow):  # never widen the window
            line.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self._mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()

        left = QWidget()
        left_column = QVBoxLayout(left)
        left_column.setContentsMargins(0, 0, 0, 0)
        left_column.addWidget(self.filter)
        left_column.addWidget(self.units, 1)
        left_column.addWidget(self.count)
        histogram = QWidget()
        histogram_column = QVBoxLayout(histogram)
        histogram_column.setContentsMargins(0, 0, 0, 0)
        histogram_column.addWidget(QLabel("All its activations in the scan"))
        histogram_column.addWidget(self.histogram_plot, 1)
        histogram_column.addWidget(self.overflow)
        examples_and_histogram = QSplitter(Qt.Orientation.Vertical)
        examples_and_histogram.addWidget(self.examples)
        examples_and_histogram.addWidget(histogram)
        examples_and_histogram.setStretchFactor(0, 1)
        examples_and_histogram.setSizes([400, HISTOGRAM_H + 40])
        right = QWidget()
        right_column = QVBoxLayout(right)
        right_column.setContentsMargins(0, 0, 0, 0)
        right_column.addWidget(self.title)
        right_column.addWidget(examples_and_histogram, 1)
        self.body = QSplitter(Qt.Orientation.Horizontal, visible=False)
        self.body.addWidget(left)
        self.body.addWidget(right)
        self.body.setStretchFactor(1, 1)
        self.body.setSizes([300, 900])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.header)
        layout.addWidget(self.unfinished)
        layout.addWidget(self.body, 1)

        self.filter.textChanged.connect(self._list_units)
        self.units.currentItemChanged.connect(self._unit_chosen)

    def show_dashboard(self, dashboard: ScanDashboard) -> None:
        self.dashboard, self.unit = dashboard, None
        self.header.setText(dashboard.header())
        self.unfinished.setText(dashboard.unfinished())
        self.unfinished.setVisible(bool(dashboard.unfinished()))
        self.body.setVisible(True)
        with QSignalBlocker(self.filter):
            self.filter.clear()
        self._list_units()

    def listed_units(self) -> list[int]:
        return [self.units.item(i).data(Qt.ItemDataRole.UserRole) for i in range(self.units.count())]

    def _list_units(self, *_) -> None:
        """The units the filter lets through; the one shown stays selected if it is among them, else the first is."""
        d = self.dashboard
        listed = d.search(self.filter.text())
        with QSignalBlocker(self.units):
            self.units.clear()
            for unit in listed:
                item = QListWidgetItem(f"{d.peak(unit):8.3f}  {d.label(unit)}")
                item.setToolTip(d.describe_unit(unit))
                item.setData(Qt.ItemDataRole.UserRole, unit)
                self.units.addItem(item)
        self.count.setText(f"{len(listed)} of {len(d.units)} active units" if listed else "No unit matches")
        if self.unit in listed:
            with QSignalBlocker(self.units):
                self.units.setCurrentRow(listed.index(self.unit))
        elif listed:
            self.units.setCurrentRow(0)

    def select_unit(self, unit: int) -> None:
        """Show ``unit`` (a feature clicked elsewhere), clearing a filter that hides it."""
        if self.dashboard is None:
            return
        if unit not in self.listed_units():
            with QSignalBlocker(self.filter):
                self.filter.clear()
            self._list_units()
        listed = self.listed_units()
        if unit in listed:
            self.units.setCurrentRow(listed.index(unit))
        else:  # never active in the scan: say so
            with QSignalBlocker(self.units):
                self.units.setCurrentRow(-1)
            self._show_unit(unit)

    def _unit_chosen(self, item: QListWidgetItem | None, _previous=None) -> None:
        if item is not None:
            self._show_unit(int(item.data(Qt.ItemDataRole.UserRole)))

    def _show_unit(self, unit: int) -> None:
        d = self.dashboard
        self.unit = unit
        self.title.setText(d.describe_unit(unit))
        self.examples.setHtml(examples_html(d.examples(unit), self._mono))
        histogram = d.histogram(unit)
        if histogram is None:
            self.bars.setOpts(x0=[], x1=[], height=[])
            self.overflow.setText("No histogram yet (the scan stopped before its first batch)")
            return
        self.bars.setOpts(x0=histogram.edges[:-1], x1=histogram.edges[1:], height=histogram.counts.astype(np.float64))
        self.histogram_plot.setXRange(histogram.edges[0], histogram.edges[-1], padding=0.02)
        self.histogram_plot.setYRange(0, max(1, int(histogram.counts.max())), padding=0.05)
        self.overflow.setText(histogram.overflow_text())

    def bar_heights(self) -> np.ndarray:
        """The histogram's bars as drawn (tests)."""
        return np.asarray(self.bars.opts["height"], np.float64)
