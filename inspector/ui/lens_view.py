"""The Lens tab: the logit lens of the shown request as a layers x tokens grid.

Each cell is what one residual-stream hook point, read through the model's own final norm and
unembedding, predicts comes after the token at that position: its most likely token, coloured by
its probability; or the probability or rank of the token that did come next. Clicking a cell lists
its top tokens; hovering reads it out. The grid is custom-painted and only the visible cells are
drawn, so a long generation costs a repaint of what is on screen, not of every cell.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QEvent, QPoint, QRect, QSignalBlocker, Qt, Signal
from PySide6.QtGui import QColor, QFontDatabase, QImage, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QAbstractScrollArea, QComboBox, QHBoxLayout, QLabel, QSizePolicy, QToolTip, QWidget

from inspector.viewer.lens import ALL_RESIDUAL, MODES, NEXT_PROB, NEXT_RANK, TOP, LensGrid, percent

from .heatmap import colormap, stack_view

CELL_W, LABEL_W, HEADER_H = 66, 116, 24
ROW_H = (24, 44)  # a row's height: rows share the room within these bounds (few layers: taller)
EMPTY_BG = QColor(242, 242, 242)
HEADER_BG = QColor(230, 230, 230)
SELECTED = QColor(200, 80, 0)
LEGEND = {TOP: "cell: the most likely next token at that point · colour: its probability",
          NEXT_PROB: "cell: the probability of the token that came next · colour: the same",
          NEXT_RANK: "cell: the rank of the token that came next (#1 = the top) · colour: 1 / rank"}


class LensCells(QAbstractScrollArea):
    """The grid itself: layer labels down the left, the input tokens along the top."""

    cellClicked = Signal(int, int)
    cellHovered = Signal(int, int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.grid: LensGrid | None = None
        self.mode = TOP
        self.message = ""
        self.selected: tuple[int, int] | None = None
        self.row_h = ROW_H[0]
        self._colours = np.zeros((0, 0), np.uint32)  # ARGB per cell, 0 where empty
        self._lut = np.zeros((256, 3), np.uint8)
        self.set_colormap("cividis")
        self.setMouseTracking(True)

    def set_colormap(self, name: str) -> None:
        self._lut = colormap(name).getLookupTable(nPts=256, alpha=False).astype(np.uint8)
        if self.grid is not None:
            self.set_grid(self.grid, self.mode, self.message)

    def lookup(self) -> np.ndarray:
        return self._lut

    def set_grid(self, grid: LensGrid | None, mode: str, message: str = "") -> None:
        bar = self.horizontalScrollBar()
        following = bar.value() >= bar.maximum() - CELL_W  # the newest tokens were in view: keep them there
        self.grid, self.mode, self.message = grid, mode, message
        values = grid.colour_values(mode) if grid is not None else np.zeros((0, 0), np.float32)
        rgb = self._lut[np.clip(np.nan_to_num(values) * 255, 0, 255).astype(np.uint8)].astype(np.uint32)
        argb = 0xFF000000 | rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]
        self._colours = np.where(np.isfinite(values), argb, 0)
        self._update_ranges()
        if following:
            bar.setValue(bar.maximum())
        self.viewport().update()

    def _update_ranges(self) -> None:
        rows, cols = self.grid.shape if self.grid is not None else (0, 0)
        width, height = self.viewport().width() - LABEL_W, self.viewport().height() - HEADER_H
        self.row_h = min(max(height // max(rows, 1), ROW_H[0]), ROW_H[1])
        for bar, total, room, step in ((self.horizontalScrollBar(), cols * CELL_W, width, CELL_W),
                                       (self.verticalScrollBar(), rows * self.row_h, height, self.row_h)):
            bar.setRange(0, max(0, total - room))
            bar.setPageStep(max(room, step))
            bar.setSingleStep(step)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._update_ranges()

    def scrollContentsBy(self, dx, dy) -> None:
        self.viewport().update()

    # ------------------------------------------------------------------ painting
    def paintEvent(self, event) -> None:
        painter = QPainter(self.viewport())
        area = self.viewport().rect()
        if self.message or self.grid is None or 0 in self.grid.shape:
            painter.setPen(QColor(110, 110, 110))
            painter.drawText(area.adjusted(20, 0, -20, 0), Qt.AlignmentFlag.AlignCenter | Qt.TextFlag.TextWordWrap,
                             self.message or "Computing the lens…")
            painter.end()
            return
        grid, fm = self.grid, painter.fontMetrics()
        rows, cols = self._visible()
        painter.setClipRect(QRect(LABEL_W, HEADER_H, area.width(), area.height()))
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
        if self.selected is not None and self.selected[0] < grid.shape[0] and self.selected[1] < grid.shape[1]:
            painter.setPen(QPen(SELECTED, 2))
            painter.drawRect(self.cell_rect(*self.selected).adjusted(1, 1, -1, -1))
        painter.setClipRect(QRect(LABEL_W, 0, area.width(), HEADER_H))
        for c in cols:
            rect = QRect(self.cell_rect(0, c).left(), 0, CELL_W, HEADER_H)
            painter.fillRect(rect.adjusted(0, 0, -1, -1), HEADER_BG)
            painter.setPen(QColor(60, 60, 60))
            painter.drawText(rect.adjusted(3, 0, -3, 0), Qt.AlignmentFlag.AlignCenter,
                             fm.elidedText(grid.input(c), Qt.TextElideMode.ElideRight, CELL_W - 6))
        painter.setClipRect(QRect(0, HEADER_H, LABEL_W, area.height()))
        painter.setPen(QColor(40, 40, 40))
        for r in rows:
            rect = self.cell_rect(r, 0)
            painter.drawText(QRect(4, rect.top(), LABEL_W - 8, self.row_h), Qt.AlignmentFlag.AlignVCenter,
                             grid.labels[r])
        painter.setClipping(False)
        painter.setPen(QColor(110, 110, 110))
        painter.drawText(QRect(4, 0, LABEL_W - 8, HEADER_H), Qt.AlignmentFlag.AlignVCenter, "input →")
        painter.end()

    def _visible(self) -> tuple[range, range]:
        rows, cols = self.grid.shape
        x0, y0 = self.horizontalScrollBar().value(), self.verticalScrollBar().value()
        width, height = self.viewport().width() - LABEL_W, self.viewport().height() - HEADER_H
        return (range(y0 // self.row_h, min(rows, (y0 + height) // self.row_h + 1)),
                range(x0 // CELL_W, min(cols, (x0 + width) // CELL_W + 1)))

    # ------------------------------------------------------------------ hit testing
    def cell_rect(self, r: int, c: int) -> QRect:
        """A cell's rectangle in viewport coordinates."""
        return QRect(LABEL_W + c * CELL_W - self.horizontalScrollBar().value(),
                     HEADER_H + r * self.row_h - self.verticalScrollBar().value(), CELL_W, self.row_h)

    def cell_at(self, point: QPoint) -> tuple[int, int] | None:
        if self.grid is None or self.message or point.x() < LABEL_W or point.y() < HEADER_H:
            return None
        c = (point.x() - LABEL_W + self.horizontalScrollBar().value()) // CELL_W
        r = (point.y() - HEADER_H + self.verticalScrollBar().value()) // self.row_h
        rows, cols = self.grid.shape
        return (r, c) if r < rows and c < cols else None

    def mousePressEvent(self, event) -> None:
        cell = self.cell_at(event.position().toPoint()) if event.button() == Qt.MouseButton.LeftButton else None
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


class LensView(QWidget):
    positionClicked = Signal(int)
    settingsChanged = Signal()  # the rows' kind or what the cells show changed: the window feeds new data

    def __init__(self, parent=None):
        super().__init__(parent)
        self.kind_box = QComboBox(toolTip="Which residual-stream hook points form the rows")
        self.kind_box.setMinimumContentsLength(len(ALL_RESIDUAL))
        self.kind_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.mode_box = QComboBox(toolTip="What each cell shows")
        self.mode_box.addItems(list(MODES))
        self.legend = QLabel()
        self.legend.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)  # never widens the window
        self.scale = QLabel()
        self.cells = LensCells()
        self.details = QLabel("Click a cell for its top tokens.", wordWrap=True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setFixedWidth(210)
        self.readout = QLabel(" ")
        self.last_readout = ""
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("Rows"))
        bar.addWidget(self.kind_box)
        bar.addWidget(QLabel("Show"))
        bar.addWidget(self.mode_box)
        bar.addWidget(self.scale)
        bar.addWidget(self.legend, 1)
        body = QWidget()
        row = QHBoxLayout(body)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.cells, 1)
        row.addWidget(self.details)
        stack_view(self, bar, body, self.readout)
        self._show_legend()

        self.kind_box.currentTextChanged.connect(self._emit_settings)
        self.mode_box.currentTextChanged.connect(self._mode_changed)
        self.cells.cellClicked.connect(self._cell_clicked)
        self.cells.cellHovered.connect(self._cell_hovered)

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _mode_changed(self, mode: str) -> None:
        self._show_legend()
        self.cells.set_grid(self.cells.grid, mode, self.cells.message)
        self.settingsChanged.emit()

    def _show_legend(self) -> None:
        self.legend.setText(LEGEND[self.mode()])
        lut = self.cells.lookup()
        strip = np.ascontiguousarray(np.repeat(lut[None, :, :], 12, axis=0))
        image = QImage(strip.data, 256, 12, 3 * 256, QImage.Format.Format_RGB888)
        self.scale.setPixmap(QPixmap.fromImage(image).scaled(96, 12))
        self.scale.setToolTip("colour scale: 0 (left) to 1 (right)")

    def set_colormap(self, name: str) -> None:
        self.cells.set_colormap(name)
        self._show_legend()

    def mode(self) -> str:
        return self.mode_box.currentText()

    def set_kinds(self, kinds: list[str]) -> str | None:
        """Offer ``kinds`` as the rows' choices (keeping the current one if it is still offered);
        returns the one chosen."""
        if kinds != [self.kind_box.itemText(i) for i in range(self.kind_box.count())]:
            current = self.kind_box.currentText()
            with QSignalBlocker(self.kind_box):
                self.kind_box.clear()
                self.kind_box.addItems(kinds)
                self.kind_box.setCurrentIndex(max(self.kind_box.findText(current), 0))
        return self.kind_box.currentText() or None

    def set_grid(self, grid: LensGrid | None, message: str | None = None) -> None:
        """``message``: why there are no cells to show (instead of the grid)."""
        self.cells.set_grid(grid, self.mode(), message or "")
        if self.cells.selected is not None:
            self._show_details(*self.cells.selected)

    def click_cell(self, r: int, c: int) -> None:
        """What a click on a cell does."""
        self.cells.selected = (r, c)
        self.cells.viewport().update()
        self._cell_clicked(r, c)

    def _cell_clicked(self, r: int, c: int) -> None:
        self._show_details(r, c)
        self.positionClicked.emit(c)

    def _cell_hovered(self, r: int, c: int) -> None:
        self.last_readout = self.cells.grid.describe(r, c)
        self.readout.setText(self.last_readout)

    def _show_details(self, r: int, c: int) -> None:
        grid = self.cells.grid
        if grid is None or r >= grid.shape[0] or c >= grid.shape[1]:
            self.details.setText("Click a cell for its top tokens.")
            return
        lines = [grid.labels[r], f"position {c}: {grid.input(c)!r}", "", "top tokens next:"]
        lines += [f"{i:2d}  {percent(p):>4}  {text!r}" for i, (text, p) in enumerate(grid.top_k(r, c), 1)]
        rank = int(grid.chosen_ranks[r, c])
        if rank >= 0:
            p = float(np.exp(grid.chosen_logprobs[r, c]))
            lines += ["", "came next:", f"{grid.came_next(r, c)!r}", f"rank #{rank + 1}, {percent(p)}"]
        self.details.setText("\n".join(lines))

    def details_text(self) -> str:
        return self.details.text()
