"""Every token of the selected request as a wrapping strip of chips (prompt grey, generated blue).

A custom-painted scroll area, not a QListView: a list view lays out every item again whenever one is
appended (thousands of Python sizeHint calls per frame in a long generation). Here chips are laid out
once, as they arrive (a relayout happens only when the width changes), and each visible line is
drawn into a pixmap that later paints reuse: during a generation a repaint draws only the new chips
(drawing a few hundred chips took 8-25 ms of the GUI thread per frame). Clicking a token emits its position (the heatmap selects that column); shift-click
selects a range and ctrl-click toggles, for steering-vector selections; arrow keys walk the tokens.
Tooltips show the id, the logprob and the most likely tokens (as text).
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from PySide6.QtCore import QEvent, QPoint, QRect, Qt, Signal
from PySide6.QtGui import QColor, QFontMetrics, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QAbstractScrollArea, QToolTip

from inspector.viewer.labels import display_token

PROMPT_BG = QColor(236, 236, 236)
GENERATED_BG = QColor(214, 232, 250)
INTERVENED = QColor(230, 159, 0)
SELECTED_BG = QColor(255, 205, 120)
BORDER = QColor(190, 190, 190)
SELECTED_BORDER = QColor(200, 80, 0)
MARGIN, SPACING, PAD, MAX_CHIP = 3, 3, 6, 240


class TokenStrip(QAbstractScrollArea):
    positionClicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._texts: list[str] = []
        self._shown: list[str] = []  # display_token(text), cached
        self._ids: list[int] = []
        self._n_prompt = 0
        self._logprobs: list = []
        self._top: list = []
        self._marks = None
        self._rects: list[QRect] = []  # laid-out chips, content coordinates
        self._line_tops: list[int] = []  # y of each line, and the index of its first chip
        self._line_first: list[int] = []
        self._layout_width = -1
        self._line_pixmaps: dict[int, tuple[QPixmap, int]] = {}  # line: (its pixmap, chips drawn), near view
        self._selected: set[int] = set()
        self._anchor: int | None = None
        self._current: int | None = None
        fm = QFontMetrics(self.font())
        self._chip_h = fm.height() + 6
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.setMouseTracking(True)
        self.viewport().setBackgroundRole(self.viewport().backgroundRole())
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    # ------------------------------------------------------------------ data
    def set_tokens(self, texts, ids, n_prompt, logprobs=(), top=(), marks=None, reset=False) -> None:
        old = len(self._texts)
        same_prefix = (not reset and old <= len(texts) and n_prompt == self._n_prompt
                       and (old == 0 or (self._texts[-1] == texts[old - 1] and self._texts[0] == texts[0])))
        at_end = self.verticalScrollBar().value() >= self.verticalScrollBar().maximum() - 4
        self._ids, self._n_prompt = list(ids), n_prompt
        self._logprobs, self._top = logprobs, top
        if same_prefix:
            self._redraw(self._changed_marks(self._marks, marks, old))
            self._texts.extend(texts[old:])
            self._shown.extend(display_token(t) for t in texts[old:])
        else:
            self._texts = list(texts)
            self._shown = [display_token(t) for t in texts]
            self._rects, self._line_tops, self._line_first = [], [], []
            self._line_pixmaps.clear()
            self._selected = {p for p in self._selected if p < len(texts)} if not reset else set()
        self._marks = marks
        self._layout(incremental=True)
        if at_end:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())
        self.viewport().update()

    @staticmethod
    def _changed_marks(before, after, n: int):
        """Positions below n whose intervention mark differs (the hook shown changed, say)."""
        a = np.zeros(n, dtype=np.int8) if before is None else np.asarray(before[:n], dtype=np.int8)
        b = np.zeros(n, dtype=np.int8) if after is None else np.asarray(after[:n], dtype=np.int8)
        a, b = np.pad(a, (0, n - len(a))), np.pad(b, (0, n - len(b)))
        return np.flatnonzero(a != b).tolist()

    def texts(self) -> list[str]:
        return list(self._texts)

    def display_text(self, position: int) -> str:
        return self._shown[position]

    # ------------------------------------------------------------------ layout
    def _layout(self, incremental: bool) -> None:
        width = max(self.viewport().width(), 60)
        if width != self._layout_width or not incremental:
            self._rects, self._line_tops, self._line_first = [], [], []
            self._line_pixmaps.clear()
            self._layout_width = width
        fm = QFontMetrics(self.font())
        start = len(self._rects)
        if start:
            last = self._rects[-1]
            x, y = last.right() + 1 + SPACING, last.top()
        else:
            x, y = MARGIN, MARGIN
        for i in range(start, len(self._shown)):
            w = min(fm.horizontalAdvance(self._shown[i]) + 2 * PAD, MAX_CHIP)
            if x + w > width - MARGIN and x > MARGIN:
                x, y = MARGIN, y + self._chip_h + SPACING
            if not self._line_tops or self._line_tops[-1] != y:
                self._line_tops.append(y)
                self._line_first.append(i)
            self._rects.append(QRect(x, y, w, self._chip_h))
            x += w + SPACING
        total = (self._rects[-1].bottom() + MARGIN) if self._rects else 0
        sb = self.verticalScrollBar()
        sb.setRange(0, max(0, total - self.viewport().height()))
        sb.setPageStep(self.viewport().height())
        sb.setSingleStep(self._chip_h + SPACING)

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        at_end = self.verticalScrollBar().value() >= self.verticalScrollBar().maximum() - 4
        self._layout(incremental=self.viewport().width() == self._layout_width)
        if at_end:
            self.verticalScrollBar().setValue(self.verticalScrollBar().maximum())

    def scrollContentsBy(self, dx, dy) -> None:
        self.viewport().update()

    # ------------------------------------------------------------------ painting
    def paintEvent(self, event) -> None:
        painter = QPainter(self.viewport())
        if not self._rects:
            painter.setPen(QColor(120, 120, 120))
            painter.drawText(self.viewport().rect(), Qt.AlignmentFlag.AlignCenter, "No tokens yet")
            painter.end()
            return
        dy = self.verticalScrollBar().value()
        first, last = self._visible_lines()
        for line in range(first, last):
            painter.drawPixmap(0, self._line_tops[line] - 1 - dy, self._line_pixmap(line))
        painter.end()
        for line in [k for k in self._line_pixmaps if not first - 4 <= k < last + 4]:
            del self._line_pixmaps[line]

    def _visible_lines(self) -> tuple[int, int]:
        top = self.verticalScrollBar().value()
        bottom = top + self.viewport().height()
        first = max(0, bisect.bisect_right(self._line_tops, top - self._chip_h) - 1)
        return first, bisect.bisect_right(self._line_tops, bottom)

    def _line_chips(self, line: int) -> range:
        end = self._line_first[line + 1] if line + 1 < len(self._line_first) else len(self._rects)
        return range(self._line_first[line], end)

    def _line_pixmap(self, line: int) -> QPixmap:
        """A line of chips, 1 px of room above and below for the antialiased borders; chips that
        joined the line since it was drawn are drawn onto it."""
        chips = self._line_chips(line)
        cached = self._line_pixmaps.get(line)
        if cached is None:
            ratio = self.devicePixelRatioF() or 1.0
            pixmap = QPixmap(int(self._layout_width * ratio), int((self._chip_h + 2) * ratio))
            pixmap.setDevicePixelRatio(ratio)
            pixmap.fill(Qt.GlobalColor.transparent)
            drawn = chips.start
        else:
            pixmap, drawn = cached
        if drawn < chips.stop:
            self._draw_chips(pixmap, line, range(drawn, chips.stop))
            self._line_pixmaps[line] = (pixmap, chips.stop)
        return pixmap

    def _draw_chips(self, pixmap: QPixmap, line: int, chips: range) -> None:
        painter = QPainter(pixmap)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing, True)
        dy = self._line_tops[line] - 1
        marks = self._marks
        for i in chips:
            r = self._rects[i].translated(0, -dy)
            selected = i in self._selected
            painter.setPen(QPen(SELECTED_BORDER if selected else BORDER, 1))
            painter.setBrush(SELECTED_BG if selected else (PROMPT_BG if i < self._n_prompt else GENERATED_BG))
            painter.drawRoundedRect(r, 3, 3)
            if marks is not None and i < len(marks) and marks[i]:
                painter.setPen(QPen(INTERVENED, 3))
                painter.drawLine(r.left() + 2, r.bottom() - 1, r.right() - 2, r.bottom() - 1)
            painter.setPen(QColor(20, 20, 20))
            painter.drawText(r.adjusted(PAD - 2, 0, -(PAD - 2), -1), Qt.AlignmentFlag.AlignCenter, self._shown[i])
        painter.end()

    def _redraw(self, positions) -> None:
        """Forget the drawn lines holding these positions (their look changed)."""
        for position in positions:
            if position < len(self._rects):
                self._line_pixmaps.pop(bisect.bisect_right(self._line_first, position) - 1, None)
        self.viewport().update()

    def changeEvent(self, event) -> None:
        if event.type() in (QEvent.Type.FontChange, QEvent.Type.PaletteChange, QEvent.Type.StyleChange):
            self._line_pixmaps.clear()
        super().changeEvent(event)

    # ------------------------------------------------------------------ hit testing
    def position_at(self, point: QPoint) -> int | None:
        """The token under a viewport point, or None."""
        y = point.y() + self.verticalScrollBar().value()
        line = bisect.bisect_right(self._line_tops, y) - 1
        if line < 0:
            return None
        a = self._line_first[line]
        b = self._line_first[line + 1] if line + 1 < len(self._line_first) else len(self._rects)
        for i in range(a, b):
            if self._rects[i].contains(point.x(), y):
                return i
        return None

    def position_rect(self, position: int) -> QRect:
        """A token's rectangle in viewport coordinates."""
        return self._rects[position].translated(0, -self.verticalScrollBar().value())

    def mousePressEvent(self, event) -> None:
        if event.button() != Qt.MouseButton.LeftButton:
            return super().mousePressEvent(event)
        event.accept()
        i = self.position_at(event.position().toPoint())
        if i is None:
            return
        mods = event.modifiers()
        if mods & Qt.KeyboardModifier.ShiftModifier and self._anchor is not None:
            a, b = sorted((self._anchor, i))
            self._select(set(range(a, b + 1)))
        elif mods & Qt.KeyboardModifier.ControlModifier:
            self._select(self._selected ^ {i})
            self._anchor = i
        else:
            self._select({i})
            self._anchor = i
        self._current = i
        self.positionClicked.emit(i)

    def mouseReleaseEvent(self, event) -> None:
        event.accept()

    def keyPressEvent(self, event) -> None:
        step = {Qt.Key.Key_Left: -1, Qt.Key.Key_Right: 1}.get(event.key())
        if step is None or not self._texts:
            return super().keyPressEvent(event)
        i = min(max((self._current if self._current is not None else -1) + step, 0), len(self._texts) - 1)
        self.click_position(i)

    def event(self, event) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            i = self.position_at(self.viewport().mapFromGlobal(event.globalPos()))
            if i is None:
                QToolTip.hideText()
            else:
                QToolTip.showText(event.globalPos(), self.tooltip_text(i), self)
            return True
        return super().event(event)

    def tooltip_text(self, i: int) -> str:
        tid = self._ids[i] if i < len(self._ids) else None
        lines = [f"position {i} · {'prompt' if i < self._n_prompt else 'generated'} · id {tid}",
                 f"text {self._texts[i]!r}"]
        g = i - self._n_prompt
        if 0 <= g < len(self._logprobs):
            lp = self._logprobs[g]
            if lp is not None and math.isfinite(lp):
                lines.append(f"logprob {lp:.3f} (p = {math.exp(lp):.3f})")
        if 0 <= g < len(self._top) and self._top[g]:
            alts = ", ".join(f"{display_token(top.text)!r} {top.logprob:.2f}" if top.text else
                             f"id {top.token_id} {top.logprob:.2f}" for top in self._top[g][:5])
            lines.append(f"most likely: {alts}")
        if self._marks is not None and i < len(self._marks) and self._marks[i]:
            lines.append("an intervention was active here")
        return "\n".join(lines)

    # ------------------------------------------------------------------ selection API
    def select_position(self, position: int | None, scroll: bool = True) -> None:
        if position is None or not 0 <= position < len(self._texts):
            self._select(set())
            self._current = None
        else:
            self._select({position})
            self._anchor, self._current = position, position
            if scroll:
                self._ensure_visible(position)

    def _ensure_visible(self, position: int) -> None:
        r = self._rects[position] if position < len(self._rects) else None
        if r is None:
            return
        sb = self.verticalScrollBar()
        if r.top() < sb.value():
            sb.setValue(r.top() - MARGIN)
        elif r.bottom() > sb.value() + self.viewport().height():
            sb.setValue(r.bottom() - self.viewport().height() + MARGIN)

    def select_range(self, first: int, last: int) -> None:
        self._select(set(range(max(first, 0), min(last, len(self._texts) - 1) + 1)))
        self._anchor, self._current = first, last

    def _select(self, positions: set[int]) -> None:
        changed, self._selected = self._selected ^ positions, positions
        self._redraw(changed)

    def selected_positions(self) -> tuple[int, ...]:
        return tuple(sorted(self._selected))

    def click_position(self, position: int) -> None:
        """What a plain click on a token does."""
        self.select_position(position)
        self.positionClicked.emit(position)
