"""Every token of the selected request as a wrapping strip of chips (prompt grey, generated blue).

Tokens are appended incrementally (``beginInsertRows``), so a long generation never rebuilds the
strip. Clicking a token emits its position (the heatmap selects that column); shift/ctrl-click
select ranges for steering-vector selections. Tooltips show the id, logprob and top alternatives.
"""

from __future__ import annotations

import math

from PySide6.QtCore import QAbstractListModel, QItemSelection, QItemSelectionModel, QModelIndex, QSize, Qt, Signal
from PySide6.QtGui import QColor, QPen
from PySide6.QtWidgets import QAbstractItemView, QListView, QStyle, QStyledItemDelegate

from .capture_view_model import display_token

PROMPT_BG = QColor(236, 236, 236)
GENERATED_BG = QColor(214, 232, 250)
INTERVENED = QColor(230, 159, 0)
SELECTED_BG = QColor(255, 205, 120)


class TokenListModel(QAbstractListModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self._texts: list[str] = []
        self._ids: list[int] = []
        self._n_prompt = 0
        self._logprobs: list[float] = []
        self._top: list = []
        self._marks = None
        self._rows_captured = -1

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self._texts)

    def set_tokens(self, texts: list[str], ids: list[int], n_prompt: int, logprobs=(), top=(), marks=None,
                   reset: bool = False) -> None:
        old = len(self._texts)
        same_prefix = not reset and old <= len(texts) and self._texts == texts[:old] and n_prompt == self._n_prompt
        self._ids, self._n_prompt = list(ids), n_prompt
        self._logprobs, self._top = list(logprobs), list(top)
        marks_changed = (marks is not None and self._marks is not None and len(marks) and
                         (len(marks) != len(self._marks) or (marks[:old] != self._marks[:old]).any()))
        self._marks = marks
        if same_prefix:
            if len(texts) > old:
                self.beginInsertRows(QModelIndex(), old, len(texts) - 1)
                self._texts = list(texts)
                self.endInsertRows()
            if marks_changed and old:
                self.dataChanged.emit(self.index(0), self.index(old - 1))
            return
        self.beginResetModel()
        self._texts = list(texts)
        self.endResetModel()

    def texts(self) -> list[str]:
        return list(self._texts)

    def data(self, index: QModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        i = index.row()
        if role == Qt.ItemDataRole.DisplayRole:
            return display_token(self._texts[i])
        if role == Qt.ItemDataRole.UserRole:
            return self._texts[i]
        if role == Qt.ItemDataRole.BackgroundRole:
            return PROMPT_BG if i < self._n_prompt else GENERATED_BG
        if role == Qt.ItemDataRole.UserRole + 1:  # intervention mark
            if self._marks is not None and i < len(self._marks):
                return int(self._marks[i])
            return 0
        if role == Qt.ItemDataRole.ToolTipRole:
            return self._tooltip(i)
        return None

    def _tooltip(self, i: int) -> str:
        tid = self._ids[i] if i < len(self._ids) else None
        lines = [f"position {i} · {'prompt' if i < self._n_prompt else 'generated'} · id {tid}",
                 f"text {self._texts[i]!r}"]
        g = i - self._n_prompt
        if 0 <= g < len(self._logprobs):
            lp = self._logprobs[g]
            if lp is not None and math.isfinite(lp):
                lines.append(f"logprob {lp:.3f} (p = {math.exp(lp):.3f})")
        if 0 <= g < len(self._top) and self._top[g]:
            alts = ", ".join(f"{tok}: {lp:.2f}" for tok, lp in list(self._top[g])[:5])
            lines.append(f"top: {alts}")
        if self._marks is not None and i < len(self._marks) and self._marks[i]:
            lines.append("an intervention was active here")
        return "\n".join(lines)


class ChipDelegate(QStyledItemDelegate):
    """Rounded chips; an orange underline where an intervention was active."""

    def paint(self, painter, option, index):
        painter.save()
        rect = option.rect.adjusted(1, 1, -1, -1)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        bg = SELECTED_BG if selected else index.data(Qt.ItemDataRole.BackgroundRole)
        painter.setRenderHint(painter.RenderHint.Antialiasing, True)
        painter.setPen(QPen(QColor(200, 80, 0) if selected else QColor(190, 190, 190), 1))
        painter.setBrush(bg)
        painter.drawRoundedRect(rect, 3, 3)
        if index.data(Qt.ItemDataRole.UserRole + 1):
            painter.setPen(QPen(INTERVENED, 3))
            painter.drawLine(rect.left() + 2, rect.bottom() - 1, rect.right() - 2, rect.bottom() - 1)
        painter.setPen(QColor(20, 20, 20))
        painter.drawText(rect.adjusted(4, 0, -4, -1), Qt.AlignmentFlag.AlignCenter, index.data())
        painter.restore()

    def sizeHint(self, option, index):
        fm = option.fontMetrics
        text = index.data() or ""
        return QSize(min(fm.horizontalAdvance(text) + 12, 240), fm.height() + 8)


class TokenStrip(QListView):
    positionClicked = Signal(int)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.token_model = TokenListModel(self)
        self.setModel(self.token_model)
        self.setItemDelegate(ChipDelegate(self))
        self.setViewMode(QListView.ViewMode.ListMode)
        self.setFlow(QListView.Flow.LeftToRight)
        self.setWrapping(True)
        self.setResizeMode(QListView.ResizeMode.Adjust)
        self.setLayoutMode(QListView.LayoutMode.Batched)
        self.setBatchSize(500)
        self.setSpacing(1)
        self.setUniformItemSizes(False)
        self.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.setMouseTracking(True)
        self.clicked.connect(lambda idx: self.positionClicked.emit(idx.row()))
        self.selectionModel().currentChanged.connect(self._current_changed)
        self._follow = True

    def _current_changed(self, current, _previous) -> None:
        if current.isValid() and self.hasFocus():  # arrow keys walk the tokens
            self.positionClicked.emit(current.row())

    def set_tokens(self, texts, ids, n_prompt, logprobs=(), top=(), marks=None, reset=False) -> None:
        sb = self.verticalScrollBar()
        at_end = sb.value() >= sb.maximum() - 4
        self.token_model.set_tokens(texts, ids, n_prompt, logprobs, top, marks, reset)
        if at_end and self._follow:
            self.scrollToBottom()

    def texts(self) -> list[str]:
        return self.token_model.texts()

    def select_position(self, position: int | None, scroll: bool = True) -> None:
        sm = self.selectionModel()
        if position is None or not 0 <= position < self.token_model.rowCount():
            sm.clearSelection()
            return
        idx = self.token_model.index(position)
        sm.select(idx, QItemSelectionModel.SelectionFlag.ClearAndSelect)
        sm.setCurrentIndex(idx, QItemSelectionModel.SelectionFlag.NoUpdate)
        if scroll:
            self.scrollTo(idx)

    def select_range(self, first: int, last: int) -> None:
        sel = QItemSelection(self.token_model.index(first), self.token_model.index(last))
        self.selectionModel().select(sel, QItemSelectionModel.SelectionFlag.ClearAndSelect)

    def selected_positions(self) -> tuple[int, ...]:
        return tuple(sorted(i.row() for i in self.selectionModel().selectedIndexes()))

    def click_position(self, position: int) -> None:
        """What a mouse click does (tests)."""
        self.select_position(position)
        self.positionClicked.emit(position)

    def position_rect(self, position: int):
        return self.visualRect(self.token_model.index(position))
