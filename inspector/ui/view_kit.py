"""The view kit the plot views share: colour maps, the layout of a plot view, quiet axes, the token axis
and the message of an empty plot."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QGraphicsItem, QVBoxLayout

COLORMAPS = ("cividis", "viridis", "CET-CBD1", "CET-CBL2", "inferno", "plasma", "magma", "turbo")
COLORMAP_HINTS = {"cividis": "colour-blind safe", "viridis": "colour-blind safe",
                  "CET-CBD1": "diverging, colour-blind safe", "CET-CBL2": "colour-blind safe",
                  "turbo": "not colour-blind safe"}
MARK_OTHER = QColor(150, 150, 150)
MARK_THIS = QColor(230, 159, 0)  # Okabe-Ito orange: distinguishable under common colour blindness


def colormap(name: str) -> pg.ColorMap:
    try:
        return pg.colormap.get(name)
    except Exception:  # noqa: BLE001 - unknown name in old settings: fall back to the default
        return pg.colormap.get("cividis")


class PositionAxis(pg.AxisItem):
    """The token axis: x is the position, except where rows are sparse (a capture window), where row k
    stands at x = p0 + k and is labelled with its position."""

    positions: np.ndarray | None = None  # None: x is the position
    p0 = 0

    def show_rows(self, positions: np.ndarray | None, p0: int, new_source: bool) -> None:
        """Rows that grow keep their labels (new ones come with a new range, which redraws the axis)."""
        stale = (positions is None) != (self.positions is None) or (positions is not None and (new_source or p0 != self.p0))
        self.positions, self.p0 = positions, p0
        if stale:
            self.picture = None
            self.update()

    def x_of(self, position: int) -> int | None:
        """Where a position's row stands (None: no row there)."""
        if self.positions is None:
            return position
        i = int(np.searchsorted(self.positions, position))
        return self.p0 + i if i < len(self.positions) and self.positions[i] == position else None

    def tickStrings(self, values, scale, spacing):
        if self.positions is None:
            return super().tickStrings(values, scale, spacing)
        rows = [int(round(v)) - self.p0 for v in values]
        return [str(int(self.positions[r])) if 0 <= r < len(self.positions) else "" for r in rows]


class Placeholder(pg.TextItem):
    """The grey message of an empty plot, laid out only when it is shown and its text changed: a
    layout of it on every frame (the app sets the message for the state it is in) cost the first
    frame of a live run milliseconds, when the plot fills and the message hides."""

    def __init__(self, text: str):
        super().__init__(text, color=(110, 110, 110), anchor=(0.5, 0.5))
        self._wanted = text

    def want(self, text: str) -> None:
        self._wanted = text
        if self.isVisible():
            self._lay_out()

    def show_if(self, empty: bool) -> None:
        if empty:
            self._lay_out()
        self.setVisible(empty)

    def _lay_out(self) -> None:
        if self.toPlainText() != self._wanted:
            self.setText(self._wanted)


def quiet_axes(view: pg.GraphicsView) -> None:
    """Axes that cost the GUI thread little while rows stream in (each item below cost milliseconds
    per frame): drawn once into pixmaps (a repaint of the image repainted every axis); ticks outside
    (an axis reaching into the image repaints with it); two tick levels (a third, too fine to read,
    took a third of each redraw); no automatic SI prefix (it re-laid-out the plot at every change of
    the range, and the axes then drew twice), and no prefix scale left behind: switching it off keeps
    the scale of the range at that moment (0 to 0.5: ticks x1000), so no range may ask for one."""
    for item in view.scene().items():
        if isinstance(item, pg.AxisItem):
            item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
            item.setStyle(tickLength=5, maxTickLevel=1, maxTextLevel=1)
            item.setSIPrefixEnableRanges(())
            item.enableAutoSIPrefix(False)


def stack_view(widget, bar, plot_area, readout) -> None:
    """The layout both plot views share: controls on top, the plot taking the room, a read-out below."""
    layout = QVBoxLayout(widget)
    layout.setContentsMargins(2, 2, 2, 2)
    layout.setSpacing(2)
    layout.addLayout(bar)
    layout.addWidget(plot_area, 1)
    layout.addWidget(readout)


def clear_readout(tab) -> None:
    """Empty a tab's hover read-out: what it described is no longer on show."""
    tab.last_readout = ""
    tab.readout.setText(" ")
