"""The interventions table: scale/bias edits at hook points, live during generation.

Every edit goes through ``InterventionTableModel.setData``, which builds a new row with
``InterventionRow.with_field`` (validating numbers, vector lengths, positions) and refuses the edit
with a message if it is invalid; the old value stays. The panel then emits the enabled rows as
``Intervention`` objects; if the engine refuses them too (it validates again), the table goes back
to the last set the engine accepted and the reason is shown.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDialog, QHBoxLayout, QHeaderView,
                               QLabel, QPushButton, QStyledItemDelegate, QTableView, QVBoxLayout, QWidget)

from inspector.core.hooks import HookPoint
from inspector.core.vectors import check_vector, load_vector
from inspector.viewer.intervention_rows import SCOPE_LABELS, SCOPES, InterventionRow, active_interventions
from inspector.viewer.labels import short_hook_label

from .file_dialogs import open_file
from .steering_dialog import SteeringDialog

COLUMNS = ("On", "Hook", "Scope", "Request", "Positions", "Scale", "Bias", "Source")
HEADERS = ("On", "Hook", "Scope", "Req.", "Pos.", "Scale", "Bias", "Source")
HEADER_TIPS = ("Enabled", "Hook point", "Which rows: all, one request, given positions, or both",
               "The request a 'request' scope applies to", "Positions a 'positions' scope applies to",
               "Multiply the activation (scalar or per-feature vector)",
               "Then add (scalar or per-feature vector)", "Where a vector came from")
SCOPE_SHORT = {"all": "all", "request": "request", "positions": "positions", "request+positions": "req+pos"}
NO_EFFECT = "no effect yet: set its Scale or Bias"
FIELD_OF = {0: "enabled", 1: "hook", 2: "scope", 3: "request_id", 4: "positions", 5: "scale", 6: "bias"}


class InterventionTableModel(QAbstractTableModel):
    rejected = Signal(str)  # an edit was refused: the reason
    edited = Signal()  # rows changed (valid)

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[InterventionRow] = []
        self.hooks: dict[str, HookPoint] = {}
        self.default_positions: Callable[[], tuple[int, ...]] = lambda: ()
        self.default_request: Callable[[], str | None] = lambda: None

    # ---- Qt model ----
    def rowCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()):
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return HEADERS[section]
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.ToolTipRole:
            return HEADER_TIPS[section]
        return None

    def flags(self, index):
        f = Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable
        if index.column() == 0:
            return f | Qt.ItemFlag.ItemIsUserCheckable
        if index.column() in FIELD_OF:
            return f | Qt.ItemFlag.ItemIsEditable
        return f

    def data(self, index, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row, col = self.rows[index.row()], index.column()
        if role == Qt.ItemDataRole.CheckStateRole and col == 0:
            return Qt.CheckState.Checked if row.enabled else Qt.CheckState.Unchecked
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            display = role == Qt.ItemDataRole.DisplayRole
            if col == 1:
                info = self.hooks.get(row.hook)
                return short_hook_label(info) if info and display else row.hook
            if col == 2:
                return SCOPE_SHORT[row.scope] if display else row.scope
            if col == 3:
                if display and "request" not in row.scope:
                    return "—"
                return row.request_id or ("—" if display else "")
            if col == 4:
                if display and "positions" not in row.scope:
                    return "—"
                return row.positions_text() or ("—" if display else "")
            if col in (5, 6):
                which = "scale" if col == 5 else "bias"
                v = getattr(row, which)
                return f"vec[{v.shape[0]}]" if display and isinstance(v, np.ndarray) else row.value_text(which)
            if col == 7:
                return row.problem or row.source or (NO_EFFECT if row.is_identity() else "")
        if role == Qt.ItemDataRole.ForegroundRole:
            if row.problem:
                return QBrush(QColor(180, 30, 30))
            if not row.enabled or row.is_identity():
                return QBrush(QColor(140, 140, 140))
        if role == Qt.ItemDataRole.ToolTipRole:
            info = self.hooks.get(row.hook)
            tip = [f"hook {row.hook}" + (f" ({info.alias}, width {info.width})" if info else ""),
                   f"scope {SCOPE_LABELS[row.scope]}", f"scale {row.value_text('scale')}",
                   f"clamps feature {row.clamp.label} to {row.clamp.value:g}" if row.clamp is not None
                   else f"bias {row.value_text('bias')}"]
            if row.problem:
                tip.append(f"not applied: {row.problem}")
            elif row.is_identity():
                tip.append(f"not applied: {NO_EFFECT}")
            if row.source:
                tip.append(row.source)
            return "\n".join(tip)
        return None

    def setData(self, index, value, role=Qt.ItemDataRole.EditRole) -> bool:
        if not index.isValid():
            return False
        col = index.column()
        if col == 0 and role == Qt.ItemDataRole.CheckStateRole:
            value = Qt.CheckState(value) == Qt.CheckState.Checked if not isinstance(value, bool) else value
            return self.replace_field(index.row(), "enabled", value)
        if role != Qt.ItemDataRole.EditRole or col not in FIELD_OF:
            return False
        if col in (3, 4) and value == "—":
            value = ""
        return self.replace_field(index.row(), FIELD_OF[col], value)

    # ---- edits ----
    def width_of(self, hook: str) -> int | None:
        info = self.hooks.get(hook)
        return info.width if info else None

    def replace_field(self, i: int, name: str, value) -> bool:
        old = self.rows[i]
        try:
            new = old.with_field(name, value, self.width_of(old.hook if name != "hook" else str(value)))
            if name == "scope":  # fill what the scope needs from the current selection, if there is one
                if "positions" in new.scope and not new.positions:
                    positions = tuple(self.default_positions())
                    if not positions:
                        raise ValueError("scope 'positions' needs positions: type them in the Positions column "
                                         "(e.g. 3-7, 10) or select tokens in the strip first")
                    new = replace(new, positions=positions)
                if "request" in new.scope and not new.request_id:
                    new = replace(new, request_id=self.default_request())
            if name == "hook":
                if self.hooks and new.hook not in self.hooks:
                    raise ValueError(f"{new.hook!r} is not an installed hook point")
                width = self.width_of(new.hook)
                for which in ("scale", "bias"):
                    v = getattr(new, which)
                    if isinstance(v, np.ndarray) and width is not None and v.shape[0] != width:
                        raise ValueError(f"the {which} vector has {v.shape[0]} values but {new.hook} is {width} wide; "
                                         "load a matching vector first or set a scalar")
            if new.enabled:
                new.validate({h: info.width for h, info in self.hooks.items()} if self.hooks else {})
        except ValueError as exc:
            self.rejected.emit(f"Row {i + 1}: {exc}. The previous value was kept.")
            return False
        self.rows[i] = new
        self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))
        self.edited.emit()
        return True

    def add(self, row: InterventionRow) -> int:
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows))
        self.rows.append(row)
        self.endInsertRows()
        self.edited.emit()
        return len(self.rows) - 1

    def remove(self, indices) -> None:
        for i in sorted(set(indices), reverse=True):
            self.beginRemoveRows(QModelIndex(), i, i)
            del self.rows[i]
            self.endRemoveRows()
        self.edited.emit()

    def set_rows(self, rows: list[InterventionRow]) -> None:
        self.beginResetModel()
        self.rows = [replace(r) for r in rows]
        self.endResetModel()

    def set_hooks(self, hooks: dict[str, HookPoint]) -> None:
        """Installed hooks changed: rows on hooks that are gone (or now the wrong width) are parked."""
        self.hooks = dict(hooks)
        for i, row in enumerate(self.rows):
            problem = ""
            if hooks and row.hook not in hooks:
                problem = "hook point not captured now"
            else:
                width = self.width_of(row.hook)
                for which in ("scale", "bias"):
                    v = getattr(row, which)
                    if isinstance(v, np.ndarray) and width is not None and v.shape[0] != width:
                        problem = f"{which} vector has {v.shape[0]} values, hook is {width} wide"
            self.rows[i] = replace(row, problem=problem)
        if self.rows:
            self.dataChanged.emit(self.index(0, 0), self.index(len(self.rows) - 1, len(COLUMNS) - 1))


class ChoiceDelegate(QStyledItemDelegate):
    """A combo box editor whose choices come from a callable: [(label, value)]."""

    def __init__(self, choices: Callable[[], list[tuple[str, str]]], parent=None):
        super().__init__(parent)
        self._choices = choices

    def createEditor(self, parent, option, index):
        box = QComboBox(parent)
        for label, value in self._choices():
            box.addItem(label, value)
        box.activated.connect(self._activated)
        return box

    def _activated(self, _index: int) -> None:
        self.commitData.emit(self.sender())

    def setEditorData(self, editor, index):
        i = editor.findData(index.data(Qt.ItemDataRole.EditRole))
        editor.setCurrentIndex(max(i, 0))

    def setModelData(self, editor, model, index):
        model.setData(index, editor.currentData(), Qt.ItemDataRole.EditRole)


class DockContext(Protocol):
    """What the dock asks of the window it sits in: the request and hook on show, the token strip's
    selection, a steering vector from the run on show, and the hook points that run captured."""

    def current_request(self) -> str | None: ...

    def current_hook(self) -> str | None: ...

    def strip_selection(self) -> tuple[str | None, tuple[int, ...]]: ...

    def steering_vector(self, hook: str, a, b) -> np.ndarray: ...

    def captured_hooks(self) -> list[HookPoint]: ...


class NoContext:
    """A dock in no window: nothing on show, nothing captured (so no steering vector to compute)."""

    def current_request(self) -> None:
        return None

    def current_hook(self) -> None:
        return None

    def strip_selection(self) -> tuple[None, tuple]:
        return None, ()

    def steering_vector(self, hook: str, a, b):
        raise RuntimeError("no run on show")

    def captured_hooks(self) -> list[HookPoint]:
        return []


class InterventionsPanel(QWidget):
    interventionsChanged = Signal(list)  # list[Intervention] of enabled rows

    def __init__(self, parent=None):
        super().__init__(parent)
        self.model = InterventionTableModel(self)
        self._accepted: list[InterventionRow] = []
        self._request_ids: list[str] = []
        self.context: DockContext = NoContext()  # the window sets its own

        self.table = QTableView()
        self.table.setModel(self.model)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.DoubleClicked |
                                   QAbstractItemView.EditTrigger.EditKeyPressed |
                                   QAbstractItemView.EditTrigger.SelectedClicked)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()  # every column as wide as its header and cells, Source the rest
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setStretchLastSection(True)
        header.setMinimumSectionSize(24)
        self.table.setWordWrap(False)
        self.table.verticalHeader().setDefaultSectionSize(self.table.fontMetrics().height() + 8)
        self.table.setItemDelegateForColumn(1, ChoiceDelegate(
            lambda: [(f"{h.alias}  ({h.width})", h.name) for h in self.model.hooks.values()], self))
        self.table.setItemDelegateForColumn(2, ChoiceDelegate(
            lambda: [(SCOPE_LABELS[s], s) for s in SCOPES], self))
        self.table.setItemDelegateForColumn(3, ChoiceDelegate(
            lambda: [("—", "")] + [(r, r) for r in self._request_ids], self))

        self.add_button = QPushButton("Add", toolTip="New row on the hook shown in the heatmap (no effect until its "
                                                             "Scale or Bias is set)")
        self.remove_button = QPushButton("Remove")
        self.scale_file = QPushButton("Scale file…", toolTip="Per-feature scale vector from a .npy file")
        self.bias_file = QPushButton("Bias file…", toolTip="Per-feature bias vector from a .npy file")
        self.steer_button = QPushButton("Steering…",
                                        toolTip="Bias = k × (mean of selection A − mean of selection B) in this run")
        self.clear_button = QPushButton("Clear")
        self.message = QLabel("")
        self.message.setWordWrap(True)
        self.message.setVisible(False)
        self.status = QLabel("No interventions: generation runs unchanged.")
        self.status.setWordWrap(True)
        self.details = QLabel("")
        self.details.setWordWrap(True)
        self.details.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        buttons = QHBoxLayout()
        for b in (self.add_button, self.remove_button, self.clear_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        vectors = QHBoxLayout()
        for b in (self.scale_file, self.bias_file, self.steer_button):
            vectors.addWidget(b)
        vectors.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(buttons)
        layout.addWidget(self.table, 1)
        layout.addLayout(vectors)
        layout.addWidget(self.details)
        layout.addWidget(self.message)
        layout.addWidget(self.status)

        self.add_button.clicked.connect(self._add_clicked)
        self.remove_button.clicked.connect(self.remove_selected)
        self.clear_button.clicked.connect(self.clear)
        self.scale_file.clicked.connect(self._scale_file_clicked)
        self.bias_file.clicked.connect(self._bias_file_clicked)
        self.steer_button.clicked.connect(self.open_steering_dialog)
        self.model.default_positions = lambda: self.context.strip_selection()[1]
        self.model.default_request = lambda: self.context.current_request()
        self.model.rejected.connect(self.show_message)
        self.table.selectionModel().selectionChanged.connect(self._show_details)
        self.model.dataChanged.connect(self._show_details)
        self.model.edited.connect(self._edited)

    # ---- outside world ----
    def set_hooks(self, hooks: dict[str, HookPoint]) -> None:
        self.model.set_hooks(hooks)
        self._accepted = [replace(r) for r in self.model.rows]
        self._update_status()

    def set_requests(self, request_ids: list[str]) -> None:
        self._request_ids = list(request_ids)

    def interventions(self) -> list:
        widths = {h: info.width for h, info in self.model.hooks.items()}
        return active_interventions(self.model.rows, widths)

    def engine_refused(self, reason: str) -> None:
        """The session refused the last set: go back to the last accepted rows, keep the reason visible."""
        self.model.set_rows(self._accepted)
        self.show_message(f"The engine refused the change: {reason}. The previous interventions stay in effect.")
        self._update_status()

    def engine_accepted(self) -> None:
        self._accepted = [replace(r) for r in self.model.rows]
        self._update_status()

    def show_message(self, text: str) -> None:
        self.message.setText(f"<span style='color:#b01e1e'>⚠ {text}</span>")
        self.message.setToolTip(text)
        self.message.setVisible(True)
        self.last_message = text

    def clear_message(self) -> None:
        self.message.setVisible(False)
        self.message.setText("")

    last_message = ""

    # ---- actions ----
    def add_row(self, hook: str | None = None, **fields) -> int:
        hook = hook or self.context.current_hook() or next(iter(self.model.hooks), "")
        if self.model.hooks and hook not in self.model.hooks:
            hook = next(iter(self.model.hooks))
        row = InterventionRow(hook=hook, request_id=self.context.current_request())
        for name, value in fields.items():
            try:
                row = row.with_field(name, value, self.model.width_of(row.hook))
            except ValueError as exc:
                self.show_message(f"New row: {exc}")
                return -1
        if row.enabled:
            try:
                row.validate({h: i.width for h, i in self.model.hooks.items()})
            except ValueError as exc:
                self.show_message(f"New row: {exc}")
                return -1
        return self.model.add(row)

    def _show_details(self, *_) -> None:
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        if not rows or rows[0] >= len(self.model.rows):
            self.details.setText("")
            return
        self.details.setText(self.model.data(self.model.index(rows[0], 1), Qt.ItemDataRole.ToolTipRole))

    def _scale_file_clicked(self, *_) -> None:
        self.load_vector_dialog("scale")

    def _bias_file_clicked(self, *_) -> None:
        self.load_vector_dialog("bias")

    def _add_clicked(self) -> None:
        self.add_row()

    def edit(self, row: int, column: str, value) -> bool:
        """Edit a cell as the editor would (tests and scripted use): False and a message if refused."""
        col = COLUMNS.index(column)
        if col == 0:
            return self.model.setData(self.model.index(row, 0), bool(value), Qt.ItemDataRole.CheckStateRole)
        return self.model.setData(self.model.index(row, col), value, Qt.ItemDataRole.EditRole)

    def remove_selected(self) -> None:
        rows = {i.row() for i in self.table.selectionModel().selectedRows()}
        if rows:
            self.model.remove(rows)

    def clear(self) -> None:
        if self.model.rows:
            self.model.remove(range(len(self.model.rows)))

    def _target_row(self) -> int | None:
        rows = sorted({i.row() for i in self.table.selectionModel().selectedRows()})
        if rows:
            return rows[0]
        if len(self.model.rows) == 1:
            return 0
        self.show_message("Select the row the vector is for first.")
        return None

    def load_vector_dialog(self, which: str) -> None:
        i = self._target_row()
        if i is None:
            return
        path = open_file(self, f"Load {which.capitalize()} Vector", "NumPy arrays (*.npy *.npz)")
        if path:
            self.load_vector(i, which, path)

    def load_vector(self, row: int, which: str, path: str | Path) -> bool:
        hook = self.model.rows[row].hook
        try:
            vec = load_vector(path, self.model.width_of(hook), which)
        except ValueError as exc:
            self.show_message(f"{exc}. The row was not changed.")
            return False
        ok = self.model.replace_field(row, which, vec)
        if ok:
            self.model.rows[row] = replace(self.model.rows[row], source=f"{which} from {Path(path).name}")
            self.model.dataChanged.emit(self.model.index(row, 0), self.model.index(row, len(COLUMNS) - 1))
        return ok

    def set_vector(self, row: int, which: str, vector, source: str = "") -> bool:
        try:
            vec = check_vector(vector, self.model.width_of(self.model.rows[row].hook), which)
        except ValueError as exc:
            self.show_message(f"{exc}. The row was not changed.")
            return False
        ok = self.model.replace_field(row, which, vec)
        if ok and source:
            self.model.rows[row] = replace(self.model.rows[row], source=source)
        return ok

    def open_steering_dialog(self) -> SteeringDialog | None:
        hooks = self.context.captured_hooks()
        if not hooks or not self._request_ids:
            self.show_message("Generate (or open a capture) first: a steering vector is computed from captured rows.")
            return None
        dialog = SteeringDialog(hooks, self._request_ids, self.context.steering_vector, self.context.strip_selection,
                                default_hook=self.context.current_hook(), parent=self)
        dialog.finished.connect(self._steering_finished)
        dialog.open()
        return dialog

    def _steering_finished(self, code: int) -> None:
        self._steering_done(self.sender(), code)

    def _steering_done(self, dialog: SteeringDialog, code: int) -> None:
        if code == QDialog.DialogCode.Accepted and dialog.result_vector is not None:
            self.add_steering(dialog.hook_box.currentData(), dialog.description, bias=dialog.result_vector)

    def add_steering(self, hook: str, source: str, **fields) -> int:
        """A new row steering ``hook`` (``fields``: a bias vector, or a feature clamp), saying where it came
        from; -1 and a message if it cannot be added."""
        if self.model.hooks and hook not in self.model.hooks:
            self.show_message(f"{hook} is not captured by the engine now; check it in the model tree first.")
            return -1
        i = self.add_row(hook=hook, **fields)
        if i >= 0:
            self.model.rows[i] = replace(self.model.rows[i], source=source)
            self.model.dataChanged.emit(self.model.index(i, 0), self.model.index(i, len(COLUMNS) - 1))
        return i

    def _edited(self) -> None:
        self.clear_message()
        try:
            ivs = self.interventions()
        except ValueError as exc:  # cannot normally happen: rows are validated on edit
            self.show_message(str(exc))
            return
        self.interventionsChanged.emit(ivs)

    def _update_status(self) -> None:
        n = sum(1 for r in self.model.rows if r.is_active())
        parked = sum(1 for r in self.model.rows if r.problem)
        idle = sum(1 for r in self.model.rows if r.enabled and not r.problem and r.is_identity())
        text = f"{n} intervention(s) active" if n else "No interventions: generation runs unchanged."
        if parked:
            text += f" · {parked} parked (hook not captured)"
        if idle:
            text += f" · {idle} row(s) with no effect yet (scale 1, bias 0)"
        self.status.setText(text + ("  · takes effect on the next forward" if n else ""))
