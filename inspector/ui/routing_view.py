"""The Experts tab: which experts of one mixture-of-experts layer each token was routed to.

A row per expert, a column per token (``CellGrid`` over ``viewer.routing.ExpertGrid``): in weight
mode only each token's chosen experts are filled, with their routing weights; in logit mode every
cell holds the router logit the choice was made from. Hover reads a cell out, a click selects its
token everywhere. Where the layer's rule cannot be recomputed only the logits are shown, and a note
says why.
"""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, Qt, Signal
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from inspector.viewer.lens import percent
from inspector.viewer.routing import LOGIT, MODES, WEIGHT, ExpertGrid, ExpertsShown

from .cell_grid import CellGrid, CellGridTab, elided_label
from .combo import offer
from .view_kit import stack_view

LEGEND = {WEIGHT: "weight (blank: not chosen)", LOGIT: "router logit"}
NOTE_COLOUR = QColor(170, 80, 0)


def layer_label(layer: int) -> str:
    return f"L{layer}"


def colour_range(grid: ExpertGrid | None, mode: str) -> tuple[str, str, str]:
    """What the colour scale's left end, middle and right end stand for in ``grid``, as text."""
    if grid is None or 0 in grid.shape:
        return "", "", ""
    lo, hi = grid.colour_ends(mode)
    if mode == WEIGHT:
        return "0%", percent(hi / 2), percent(hi)
    return f"{lo:.2f}", f"{(lo + hi) / 2:.2f}", f"{hi:.2f}"


class ExpertsView(CellGridTab):
    positionClicked = Signal(int)  # a cell was clicked: select its token everywhere
    settingsChanged = Signal()  # the layer changed: the window feeds its routing

    def __init__(self, parent=None):
        super().__init__(CellGrid("expert ↓ token →", "No expert routing yet", row_heights=(22, 40)), parent=parent)
        self.shown = ExpertsShown("No expert routing yet")
        self.last_readout = ""
        self._wanted_mode = WEIGHT  # the user's choice, back in force once a layer's choice can be recomputed
        self.layer_box = QComboBox(toolTip="Mixture-of-experts layers whose router logits are captured")
        self.mode_box = QComboBox(toolTip="What each cell shows")
        self.mode_box.addItems(list(MODES))
        self.legend = elided_label()
        self.note = QLabel(wordWrap=True, visible=False)
        palette = self.note.palette()
        palette.setColor(QPalette.ColorRole.WindowText, NOTE_COLOUR)
        self.note.setPalette(palette)
        self.readout.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        bar = QHBoxLayout()
        bar.setContentsMargins(0, 0, 0, 0)
        bar.addWidget(QLabel("Layer"))
        bar.addWidget(self.layer_box)
        bar.addWidget(QLabel("Show"))
        bar.addWidget(self.mode_box)
        bar.addWidget(self.scale)
        bar.addWidget(self.legend, 1)
        body = QWidget()
        column = QVBoxLayout(body)
        column.setContentsMargins(0, 0, 0, 0)
        column.addWidget(self.note)
        column.addWidget(self.cells, 1)
        stack_view(self, bar, body, self.readout)
        self._show_legend()

        self.layer_box.currentTextChanged.connect(self._emit_settings)
        self.mode_box.currentTextChanged.connect(self._mode_chosen)

    # ------------------------------------------------------------------ choices
    def set_layers(self, layers: list[int]) -> int | None:
        """Offer ``layers`` (keeping the one chosen if it is still offered); returns the one chosen."""
        offer(self.layer_box, [layer_label(layer) for layer in layers])
        return self.layer()

    def layer(self) -> int | None:
        text = self.layer_box.currentText()
        return int(text[1:]) if text else None

    def mode(self) -> str:
        """What the cells show now (router logits whatever was chosen where the choice is unknown)."""
        return self.mode_box.currentText()

    def _emit_settings(self, *_) -> None:
        self.settingsChanged.emit()

    def _mode_chosen(self, mode: str) -> None:
        self._wanted_mode = mode
        self._draw()

    # ------------------------------------------------------------------ data
    def show_experts(self, shown: ExpertsShown) -> None:
        """Draw ``shown``: its grid, or its message where it has none."""
        self.shown = shown
        if shown.layer is not None and shown.layer != self.layer():
            with QSignalBlocker(self.layer_box):
                self.layer_box.setCurrentText(layer_label(shown.layer))
        why = shown.grid.why_no_choice if shown.grid is not None else ""
        self.note.setText(f"{layer_label(shown.layer)}: which experts were chosen cannot be recomputed ({why}); "
                          "only the router logits are shown" if why else "")
        self.note.setVisible(bool(why))
        self.mode_box.setEnabled(not why)
        with QSignalBlocker(self.mode_box):
            self.mode_box.setCurrentText(LOGIT if why else self._wanted_mode)
        self._draw()

    draw = show_experts  # what its presenter decides is an ExpertsShown

    def _draw(self) -> None:
        self.cells.set_grid(self.shown.grid, self.mode(), self.shown.message)
        self._show_legend()

    def _show_legend(self) -> None:
        mode = self.mode()
        self.set_scale_numbers(*colour_range(self.shown.grid, mode), f"colour: the {LEGEND[mode]}")
        self.legend.setText(LEGEND[mode])
        self.legend.setToolTip(LEGEND[mode])  # the text is cut where the window is narrow

    def _cell_clicked(self, r: int, c: int) -> None:
        self.positionClicked.emit(int(self.shown.grid.positions[c]))
