"""The Lens tab: the logit lens of the shown request as a layers x tokens grid.

Each cell is what one residual-stream hook point, read through the model's own final norm and
unembedding, predicts comes after the token at that position: its most likely token, coloured by
its probability; or the probability or rank of the token that did come next. Clicking a cell lists
its top tokens; hovering reads it out (the grid is ``CellGrid``).
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget

from inspector.viewer.lens import ALL_RESIDUAL, MODES, NEXT_PROB, NEXT_RANK, TOP, LensGrid, percent
from inspector.viewer.tabs import LensDrawing

from .cell_grid import CellGrid, CellGridTab, elided_label
from .combo import offer
from .view_kit import stack_view

LEGEND = {TOP: "cell: the most likely next token at that point · colour: its probability",
          NEXT_PROB: "cell: the probability of the token that came next · colour: the same",
          NEXT_RANK: "cell: the rank of the token that came next (#1 = the top) · colour: 1 / rank"}
PROBABILITY_SCALE = ("0%", "50%", "100%", "colour: the probability, 0% (left) to 100% (right)")
SCALE = {TOP: PROBABILITY_SCALE, NEXT_PROB: PROBABILITY_SCALE,
         NEXT_RANK: ("#∞", "#2", "#1", "colour: 1 / rank of the token that came next, from far down the list "
                     "(left) through #2 (middle) to #1, the top (right)")}


class LensView(CellGridTab):
    positionClicked = Signal(int)
    settingsChanged = Signal()  # the rows' kind or what the cells show changed: the window feeds new data

    def __init__(self, parent=None):
        super().__init__(CellGrid("input →", "Computing the lens…"), parent=parent)
        self._scrolled_to: int | None = None  # the selected position last brought into view
        self.kind_box = QComboBox(toolTip="Which residual-stream hook points form the rows")
        self.kind_box.setMinimumContentsLength(len(ALL_RESIDUAL))
        self.kind_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.mode_box = QComboBox(toolTip="What each cell shows")
        self.mode_box.addItems(list(MODES))
        self.legend = elided_label()
        self.details = QLabel("Click a cell for its top tokens.", wordWrap=True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.details.setFixedWidth(210)
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

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _mode_changed(self, mode: str) -> None:
        self._show_legend()
        self.cells.set_grid(self.cells.grid, mode, self.cells.message)
        self.settingsChanged.emit()

    def _show_legend(self) -> None:
        self.legend.setText(LEGEND[self.mode()])
        self.legend.setToolTip(LEGEND[self.mode()])  # the text is cut where the window is narrow
        self.set_scale_numbers(*SCALE[self.mode()])

    def mode(self) -> str:
        return self.mode_box.currentText()

    def set_kinds(self, kinds: list[str]) -> str | None:
        """Offer ``kinds`` as the rows' choices (keeping the current one if it is still offered);
        returns the one chosen."""
        return offer(self.kind_box, kinds) or None

    def draw(self, drawing: LensDrawing) -> None:
        self.set_grid(drawing.grid, drawing.message)
        self.follow_position(drawing.position)

    def follow_position(self, position: int | None) -> None:
        """Bring a newly selected token's column into view (once: the user may scroll away from it)."""
        if position != self._scrolled_to and position is not None and self.cells.grid is not None \
                and position < self.cells.grid.shape[1]:
            self.cells.scroll_to_column(position)
            self._scrolled_to = position

    def set_grid(self, grid: LensGrid | None, message: str | None = None) -> None:
        """``message``: why there are no cells to show (instead of the grid)."""
        self.cells.set_grid(grid, self.mode(), message or "")
        if self.cells.selected is not None:
            self._show_details(*self.cells.selected)

    def _cell_clicked(self, r: int, c: int) -> None:
        self._show_details(r, c)
        self.positionClicked.emit(c)

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
