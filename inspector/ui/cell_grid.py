"""A labelled grid of coloured cells: hook points (or experts, or features) down the left, the input
tokens along the top.

The Lens, Patching, Experts and Features tabs draw their results with it, each a ``CellGridTab``. It is
custom-painted and only the visible cells are drawn, so a long prompt costs a repaint of what is on
screen, not of every cell. What it draws is any object with the methods of ``Cells``; ``mode`` is passed
through untouched.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from PySide6.QtCore import QEvent, QPoint, QRect, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QImage, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QAbstractScrollArea, QLabel, QSizePolicy, QToolTip, QWidget

from .view_kit import colormap

CELL_W, LABEL_W, HEADER_H = 66, 116, 24  # LABEL_W: the label column's least width
MAX_LABEL_W = 240  # longer labels are elided: the cells keep most of the room
EMPTY_BG = QColor(242, 242, 242)
HEADER_BG = QColor(230, 230, 230)
SELECTED = QColor(200, 80, 0)
SCALE_W, STRIP_H = 150, 10


class Cells(Protocol):
    labels: list[str]  # a row's label, top to bottom

    @property
    def shape(self) -> tuple[int, int]: ...

    def colour_values(self, mode: str) -> np.ndarray:
        """[rows, columns] in 0..1 along the colour scale; NaN: an empty cell."""

    def cell_text(self, mode: str, r: int, c: int) -> str: ...

    def input(self, c: int) -> str:
        """The header of column ``c``: its token."""

    def describe(self, r: int, c: int) -> str:
        """One line for the read-out and the tooltip."""


def lookup_strip(lut: np.ndarray, width: int = SCALE_W, height: int = STRIP_H) -> QPixmap:
    """A colour scale's legend: the lookup table from left (0) to right (1)."""
    strip = np.ascontiguousarray(np.repeat(lut[None, :, :], height, axis=0))
    image = QImage(strip.data, len(lut), height, 3 * len(lut), QImage.Format.Format_RGB888)
    return QPixmap.fromImage(image).scaled(width, height)


class ColourScale(QWidget):
    """A colour scale's legend: the strip, and under it the values at its left end, middle and right end
    (a colour alone says nothing of how much)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self._strip = QPixmap()
        self._numbers = ("", "", "")
        small = QFont(self.font())
        small.setPointSizeF(max(6.0, small.pointSizeF() * 0.85))
        self.setFont(small)
        self.setFixedSize(SCALE_W, STRIP_H + QFontMetrics(small).height() + 1)

    def set_lookup(self, lut: np.ndarray) -> None:
        self._strip = lookup_strip(lut)
        self.update()

    def set_numbers(self, low: str, middle: str, high: str) -> None:
        self._numbers = (low, middle, high)
        self.update()

    def numbers(self) -> tuple[str, str, str]:
        return self._numbers

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._strip)
        painter.setPen(self.palette().windowText().color())
        below = QRect(0, STRIP_H + 1, self.width(), self.height() - STRIP_H - 1)
        for text, where in zip(self._numbers, (Qt.AlignmentFlag.AlignLeft, Qt.AlignmentFlag.AlignHCenter,
                                               Qt.AlignmentFlag.AlignRight)):
            painter.drawText(below, where | Qt.AlignmentFlag.AlignTop, text)
        painter.end()


def elided_label(text: str = "", **options) -> QLabel:
    """A one-line label that is cut where the window is narrow instead of widening it."""
    label = QLabel(text, **options)
    label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
    return label


class CellGrid(QAbstractScrollArea):
    cellClicked = Signal(int, int)
    cellHovered = Signal(int, int)
    labelClicked = Signal(int)  # a row's label

    def __init__(self, corner: str, waiting: str, row_heights: tuple[int, int] = (24, 44), parent=None):
        """``corner``: the text above the row labels; ``waiting``: what shows before the first cells;
        ``row_heights``: rows share the room within these bounds (few rows: taller)."""
        super().__init__(parent)
        self.corner, self.waiting, self.row_heights = corner, waiting, row_heights
        self.grid: Cells | None = None
        self.mode = ""
        self.message = ""
        self.selected: tuple[int, int] | None = None
        self.highlighted_row: int | None = None  # outlined, its label in bold
        self.row_h = row_heights[0]
        self.label_w = LABEL_W  # as wide as the labels need, within LABEL_W..MAX_LABEL_W
        self._colours = np.zeros((0, 0), np.uint32)  # ARGB per cell, 0 where empty
        self._lut = np.zeros((256, 3), np.uint8)
        self.set_colormap("cividis")
        self.setMouseTracking(True)

    def set_colormap(self, name: str) -> None:
        self.set_lookup(colormap(name).getLookupTable(nPts=256, alpha=False).astype(np.uint8))

    def set_lookup(self, lut: np.ndarray) -> None:
        """Colours from a [n, 3] uint8 table, 0 to 1."""
        self._lut = lut
        if self.grid is not None:
            self.set_grid(self.grid, self.mode, self.message)

    def lookup(self) -> np.ndarray:
        return self._lut

    def set_grid(self, grid: Cells | None, mode: str, message: str = "") -> None:
        bar = self.horizontalScrollBar()
        following = bar.value() >= bar.maximum() - CELL_W  # the newest tokens were in view: keep them there
        self.grid, self.mode, self.message = grid, mode, message
        self.label_w = self._label_width()
        values = grid.colour_values(mode) if grid is not None else np.zeros((0, 0), np.float32)
        top = len(self._lut) - 1
        rgb = self._lut[np.clip(np.nan_to_num(values) * top, 0, top).astype(np.int64)].astype(np.uint32)
        argb = 0xFF000000 | rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]
        self._colours = np.where(np.isfinite(values), argb, 0)
        self._update_ranges()
        if following:
            bar.setValue(bar.maximum())
        self.viewport().update()

    def _label_width(self) -> int:
        if self.grid is None or not self.grid.labels:
            return LABEL_W
        bold = QFont(self.font())
        bold.setBold(True)  # the highlighted row's label
        widest = max(QFontMetrics(bold).horizontalAdvance(label) for label in self.grid.labels)
        return min(max(LABEL_W, widest + 12), MAX_LABEL_W)

    def _update_ranges(self) -> None:
        rows, cols = self.grid.shape if self.grid is not None else (0, 0)
        width, height = self.viewport().width() - self.label_w, self.viewport().height() - HEADER_H
        self.row_h = min(max(height // max(rows, 1), self.row_heights[0]), self.row_heights[1])
        for bar, total, room, step in ((self.horizontalScrollBar(), cols * CELL_W, width, CELL_W),
                                       (self.verticalScrollBar(), rows * self.row_h, height, self.row_h)):
            bar.setRange(0, max(0, total - room))
            bar.setPageStep(max(room, step))
            bar.setSingleStep(step)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._update_ranges()

    def scroll_to_column(self, c: int) -> None:
        """Scroll the least that brings column ``c`` into view."""
        bar, room = self.horizontalScrollBar(), self.viewport().width() - self.label_w
        left = c * CELL_W
        if left < bar.value():
            bar.setValue(left)
        elif left + CELL_W > bar.value() + room:
            bar.setValue(left + CELL_W - room)

    def scrollContentsBy(self, dx, dy) -> None:
        self.viewport().update()

    # ------------------------------------------------------------------ painting
    def paintEvent(self, event) -> None:
        painter = QPainter(self.viewport())
        area = self.viewport().rect()
        if self.message or self.grid is None or 0 in self.grid.shape:
            painter.setPen(QColor(110, 110, 110))
            painter.drawText(area.adjusted(20, 0, -20, 0), Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                             self.message or self.waiting)
            painter.end()
            return
        grid, fm = self.grid, painter.fontMetrics()
        rows, cols = self._visible()
        painter.setClipRect(QRect(self.label_w, HEADER_H, area.width(), area.height()))
        for r in rows:
            for c in cols:
                rect = self.cell_rect(r, c)
                argb = int(self._colours[r, c])
                painter.fillRect(rect, QColor.fromRgba(argb) if argb else EMPTY_BG)
                text = grid.cell_text(self.mode, r, c)
                if text:
                    red, green, blue = argb >> 16 & 255, argb >> 8 & 255, argb & 255
                    dark = 0.299 * red + 0.587 * green + 0.114 * blue < 140
                    painter.setPen(QColor(255, 255, 255) if dark else QColor(20, 20, 20))
                    painter.drawText(rect.adjusted(3, 0, -3, 0), Qt.AlignmentFlag.AlignCenter,
                                     fm.elidedText(text, Qt.TextElideMode.ElideRight, CELL_W - 6))
        painter.setPen(QColor(255, 255, 255))
        for c in cols:  # thin gaps between the columns
            x = self.cell_rect(0, c).left()
            painter.drawLine(x, HEADER_H, x, area.height())
        if self.highlighted_row is not None and self.highlighted_row < grid.shape[0]:
            painter.setPen(QPen(SELECTED, 1))
            row = self.cell_rect(self.highlighted_row, 0)
            painter.drawRect(row.left(), row.top(), grid.shape[1] * CELL_W - 1, self.row_h - 1)
        if self.selected is not None and self.selected[0] < grid.shape[0] and self.selected[1] < grid.shape[1]:
            painter.setPen(QPen(SELECTED, 2))
            painter.drawRect(self.cell_rect(*self.selected).adjusted(1, 1, -1, -1))
        painter.setClipRect(QRect(self.label_w, 0, area.width(), HEADER_H))
        for c in cols:
            rect = QRect(self.cell_rect(0, c).left(), 0, CELL_W, HEADER_H)
            painter.fillRect(rect.adjusted(0, 0, -1, -1), HEADER_BG)
            painter.setPen(QColor(60, 60, 60))
            painter.drawText(rect.adjusted(3, 0, -3, 0), Qt.AlignmentFlag.AlignCenter,
                             fm.elidedText(grid.input(c), Qt.TextElideMode.ElideRight, CELL_W - 6))
        painter.setClipRect(QRect(0, HEADER_H, self.label_w, area.height()))
        plain, bold = painter.font(), QFont(painter.font())
        bold.setBold(True)
        for r in rows:
            rect = self.cell_rect(r, 0)
            highlighted = r == self.highlighted_row
            painter.setFont(bold if highlighted else plain)
            painter.setPen(SELECTED if highlighted else QColor(40, 40, 40))
            painter.drawText(QRect(4, rect.top(), self.label_w - 8, self.row_h), Qt.AlignmentFlag.AlignVCenter,
                             painter.fontMetrics().elidedText(grid.labels[r], Qt.TextElideMode.ElideRight,
                                                              self.label_w - 8))
        painter.setFont(plain)
        painter.setClipping(False)
        painter.setPen(QColor(110, 110, 110))
        painter.drawText(QRect(4, 0, self.label_w - 8, HEADER_H), Qt.AlignmentFlag.AlignVCenter, self.corner)
        painter.end()

    def _visible(self) -> tuple[range, range]:
        rows, cols = self.grid.shape
        x0, y0 = self.horizontalScrollBar().value(), self.verticalScrollBar().value()
        width, height = self.viewport().width() - self.label_w, self.viewport().height() - HEADER_H
        return (range(y0 // self.row_h, min(rows, (y0 + height) // self.row_h + 1)),
                range(x0 // CELL_W, min(cols, (x0 + width) // CELL_W + 1)))

    # ------------------------------------------------------------------ hit testing
    def cell_rect(self, r: int, c: int) -> QRect:
        """A cell's rectangle in viewport coordinates."""
        return QRect(self.label_w + c * CELL_W - self.horizontalScrollBar().value(),
                     HEADER_H + r * self.row_h - self.verticalScrollBar().value(), CELL_W, self.row_h)

    def label_at(self, point: QPoint) -> int | None:
        """The row whose label is at ``point``, if any."""
        if self.grid is None or self.message or point.x() >= self.label_w or point.y() < HEADER_H:
            return None
        r = (point.y() - HEADER_H + self.verticalScrollBar().value()) // self.row_h
        return r if r < self.grid.shape[0] else None

    def cell_at(self, point: QPoint) -> tuple[int, int] | None:
        if self.grid is None or self.message or point.x() < self.label_w or point.y() < HEADER_H:
            return None
        c = (point.x() - self.label_w + self.horizontalScrollBar().value()) // CELL_W
        r = (point.y() - HEADER_H + self.verticalScrollBar().value()) // self.row_h
        rows, cols = self.grid.shape
        return (r, c) if r < rows and c < cols else None

    def mousePressEvent(self, event) -> None:
        left = event.button() == Qt.MouseButton.LeftButton
        label = self.label_at(event.position().toPoint()) if left else None
        if label is not None:
            event.accept()
            self.labelClicked.emit(label)
            return
        cell = self.cell_at(event.position().toPoint()) if left else None
        if cell is None:
            return super().mousePressEvent(event)
        event.accept()
        self.selected = cell
        self.viewport().update()
        self.cellClicked.emit(*cell)

    def mouseMoveEvent(self, event) -> None:
        cell = self.cell_at(event.position().toPoint())
        if cell is not None:
            self.cellHovered.emit(*cell)
        super().mouseMoveEvent(event)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            cell = self.cell_at(self.viewport().mapFromGlobal(event.globalPos()))
            if cell is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.grid.describe(*cell), self)
            return True
        return super().event(event)


class CellGridTab(QWidget):
    """What the four cell-grid tabs share: the grid, its colour scale with the values at its ends and
    middle, the read-out of the cell under the cursor, and what a click on a cell does (``_cell_clicked``,
    each tab's own)."""

    def __init__(self, cells: CellGrid, parent=None):
        super().__init__(parent)
        self.cells = cells
        self.scale = ColourScale()
        self.readout = QLabel(" ")
        self.last_readout = ""
        self.show_scale()
        cells.cellClicked.connect(self._cell_clicked)
        cells.cellHovered.connect(self._cell_hovered)

    def set_colormap(self, name: str) -> None:
        self.cells.set_colormap(name)
        self.show_scale()

    def show_scale(self) -> None:
        self.scale.set_lookup(self.cells.lookup())

    def set_scale_numbers(self, low: str, middle: str, high: str, tip: str) -> None:
        """The values the colour scale's left end, middle and right end stand for, and what they are."""
        self.scale.set_numbers(low, middle, high)
        self.scale.setToolTip(tip)

    def click_cell(self, r: int, c: int) -> None:
        """What a click on a cell does."""
        self.cells.selected = (r, c)
        self.cells.viewport().update()
        self._cell_clicked(r, c)

    def _cell_clicked(self, r: int, c: int) -> None:
        raise NotImplementedError

    def _cell_hovered(self, r: int, c: int) -> None:
        self.last_readout = self.cells.grid.describe(r, c)
        self.readout.setText(self.last_readout)
