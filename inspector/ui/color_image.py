"""A growing float image drawn through a colour map, recoloured incrementally.

pyqtgraph's ImageItem turns the whole float image into an indexed QImage on every update, and the
painter converts that to RGB on every paint: at 1,000 x 512 bins that alone is most of a 16 ms
frame budget. This item keeps an RGB32 buffer (features down, token bins across, capacity-doubling
along tokens): new token bins are coloured as they arrive, everything is recoloured only when the
levels or the colour map change, and painting draws the buffer in the painter's native format.

It implements what ``pg.ColorBarItem`` needs from an image item (setLevels/getLevels,
setColorMap/getColorMap), so the colour bar controls it like an ImageItem.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtGui import QImage

from inspector.core.colormaps import colour


class ColorImageItem(pg.GraphicsObject):
    def __init__(self):
        super().__init__()
        self._cmap = None
        self._lut = np.zeros(256, dtype=np.uint32)
        self._levels = (0.0, 1.0)
        self._image: np.ndarray | None = None  # float [token bins, feature bins]
        self._rgb = np.zeros((1, 64), dtype=np.uint32)  # [feature bins, token-bin capacity]
        self._coloured = 0  # token bins coloured under the current levels and map
        self._rect = QRectF()
        self._qimage: QImage | None = None
        self.recolour_count = 0

    # ---- the ImageItem surface ColorBarItem uses ----
    def setColorMap(self, cmap) -> None:
        if isinstance(cmap, str):
            cmap = pg.colormap.get(cmap)
        self._cmap = cmap
        rgb = cmap.getLookupTable(nPts=256, alpha=False).astype(np.uint32)
        self._lut = (0xFF000000 | (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]).astype(np.uint32)
        self._recolour_all()

    def getColorMap(self):
        return self._cmap

    def setLevels(self, levels, update: bool = True) -> None:
        lo, hi = float(levels[0]), float(levels[1])
        if (lo, hi) == self._levels:
            return
        self._levels = (lo, hi)
        self._recolour_all()

    def getLevels(self) -> np.ndarray:
        return np.array(self._levels)

    @property
    def image(self) -> np.ndarray | None:
        return self._image

    def clear(self) -> None:
        self._image, self._qimage, self._coloured = None, None, 0
        self.prepareGeometryChange()
        self._rect = QRectF()
        self.update()

    # ---- data ----
    def set_frame(self, image: np.ndarray, rect: QRectF, reset: bool,
                  levels: tuple[float, float] | None = None) -> None:
        """Show ``image`` ([token bins, feature bins]) in ``rect`` (data coordinates), at ``levels`` if given.

        ``reset``: the bins were recomputed (new source, zoom, bin sizes); otherwise the first
        ``len(previous image) - 1`` bins are unchanged and only the rest is coloured. New levels
        recolour the new image once (``setLevels`` would first recolour the old one)."""
        if levels is not None and (float(levels[0]), float(levels[1])) != self._levels:
            self._levels, reset = (float(levels[0]), float(levels[1])), True
        nt, nf = image.shape
        if reset or self._image is None or nf != self._rgb.shape[0] or nt < len(self._image):
            self._coloured = 0
        if nf != self._rgb.shape[0] or nt > self._rgb.shape[1]:
            cap = max(64, nt, 2 * self._rgb.shape[1] if nf == self._rgb.shape[0] else 0)
            new = np.zeros((nf, cap), dtype=np.uint32)
            if nf == self._rgb.shape[0] and self._coloured:
                new[:, : self._coloured] = self._rgb[:, : self._coloured]
            self._rgb = new
        self._image = image
        start = max(0, self._coloured - 1)  # the last bin may have been partial: colour it again
        self._colour(start, nt)
        self._coloured = nt
        if rect != self._rect:
            self.prepareGeometryChange()
            self._rect = QRectF(rect)
        self._make_qimage()
        self.update()

    def set_coloured(self, image: np.ndarray, rgb: np.ndarray, rect: QRectF, levels: tuple[float, float]) -> None:
        """Show ``image`` already coloured (``rgb = colour(image, *levels, self.lut)``, made off the GUI
        thread: a whole frame of bins takes tens of milliseconds to colour)."""
        self._levels, self._image, self._rgb, self._coloured = (float(levels[0]), float(levels[1])), image, rgb, len(image)
        if rect != self._rect:
            self.prepareGeometryChange()
            self._rect = QRectF(rect)
        self._make_qimage()
        self.update()

    @property
    def lut(self) -> np.ndarray:
        return self._lut

    def _colour(self, a: int, b: int) -> None:
        if b > a and self._image is not None:
            self._rgb[:, a:b] = colour(self._image[a:b], *self._levels, self._lut)

    def _recolour_all(self) -> None:
        if self._image is not None:
            self._colour(0, len(self._image))
            self._coloured = len(self._image)
            self.recolour_count += 1
            self._make_qimage()
        self.update()

    def _make_qimage(self) -> None:
        if self._image is None or not len(self._image):
            self._qimage = None
            return
        nf, cap = self._rgb.shape
        # no copy: the QImage reads the buffer, which stays alive (and unreallocated) until the next frame
        self._qimage = QImage(self._rgb.data, len(self._image), nf, cap * 4, QImage.Format.Format_RGB32)

    def rgb(self) -> np.ndarray:
        """The colours drawn, [feature bins, token bins] as 0xAARRGGBB (tests)."""
        n = 0 if self._image is None else len(self._image)
        return self._rgb[:, :n]

    # ---- QGraphicsItem ----
    def boundingRect(self) -> QRectF:
        return QRectF(self._rect)

    def paint(self, painter, option, widget=None) -> None:
        if self._qimage is None:
            return
        painter.drawImage(self._rect, self._qimage, QRectF(0, 0, self._qimage.width(), self._qimage.height()))

