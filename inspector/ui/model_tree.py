"""The model's module tree with its hook points as checkable leaves.

Hook points (``HookPoint``) are grouped by the components of their module path; a module node checks
or unchecks everything below it (tri-state). Each leaf shows its kind, width and TransformerLens-style
alias, and its capture window (which rows to keep: all, generated, last:N, every:K), edited in place
with a combo box and sent to the engine at once. Presets and glob patterns add to (or, for "None",
clear) the checked set. The checked set is what the user *wants*; ``installed`` is what the engine
captures now. In eager mode changes apply on their own after a short pause; in compiled mode the
Apply button asks first (the engine restarts).
"""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker, QSortFilterProxyModel, Qt, QTimer, Signal
from PySide6.QtGui import QBrush, QColor, QFont, QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QMenu, QPushButton,
                               QStyledItemDelegate, QToolButton, QTreeView, QVBoxLayout, QWidget)

from inspector.core.hooks import HookPoint
from inspector.core.windows import ALL, CaptureWindow

NAME_ROLE = Qt.ItemDataRole.UserRole + 1
PRESETS = {
    "All residual stream": lambda h: h.kind == "resid_post",
    "All attention out": lambda h: h.kind == "attn_out",
    "All MLP out": lambda h: h.kind == "mlp_out",
    "All residual (pre, mid, post)": lambda h: h.kind in ("resid_pre", "resid_mid", "resid_post"),
}
WINDOW_COLUMN = 3  # shown next to the check boxes (the header moves it there)
WINDOW_CHOICES = ("all", "generated", "last:16", "every:4")
WINDOW_TIP = ("Capture window: which rows of this hook each request keeps (the engine drops the others on its "
              "device).\nall: every row\ngenerated: the rows that predict the generated tokens (the prompt's last "
              "position and every generated one)\nlast:N: the prompt's last N positions and every one after\n"
              "every:K: positions 0, K, 2K, …\nType another N or K to use it.")
MODES = {"compiled": "compiled — fastest; hook set fixed (changes restart the engine)",
         "eager": "eager — slower; hook changes apply live"}


class HookFilterProxy(QSortFilterProxyModel):
    def __init__(self, parent=None):
        super().__init__(parent)
        self.setRecursiveFilteringEnabled(True)
        self.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.setFilterKeyColumn(-1)
        self.setAutoAcceptChildRows(True)


class WindowDelegate(QStyledItemDelegate):
    """A hook's capture window: an editable combo box of the usual ones (any last:N or every:K may be typed)."""

    def createEditor(self, parent, option, index):
        box = QComboBox(parent, editable=True, toolTip=WINDOW_TIP)
        box.addItems(WINDOW_CHOICES)
        return box

    def setEditorData(self, editor, index):
        editor.setCurrentText(index.data())

    def setModelData(self, editor, model, index):
        model.setData(index, editor.currentText().strip())


class ModelTreeWidget(QWidget):
    checkedChanged = Signal()
    windowsChanged = Signal(dict)  # hook name -> CaptureWindow, the hooks that keep some rows only
    applyRequested = Signal(list)  # hook names wanted
    modeChangeRequested = Signal(str)
    hookActivated = Signal(str)  # a hook point was selected (show it in the heatmap)

    def __init__(self, parent=None):
        super().__init__(parent)
        self._infos: dict[str, HookPoint] = {}
        self._leaves: dict[str, QStandardItem] = {}
        self._installed: set[str] = set()
        self._windows: dict[str, CaptureWindow] = {}  # the hooks that keep some rows only
        self._mode = "compiled"
        self._busy = False

        self.mode_box = QComboBox(toolTip="\n".join(MODES.values()))
        for key, label in MODES.items():
            self.mode_box.addItem(label, key)
        self.mode_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.mode_box.setMinimumContentsLength(16)
        self.filter_box = QLineEdit(placeholderText="Filter: name, alias or kind (e.g. mlp, blocks.3)",
                                    clearButtonEnabled=True)
        self.presets_button = QToolButton(text="Presets", popupMode=QToolButton.ToolButtonPopupMode.InstantPopup,
                                          toolTip="Add a family of hook points to the checked set")
        menu = QMenu(self.presets_button)
        for name in PRESETS:
            menu.addAction(name).setData(name)
        menu.addSeparator()
        menu.addAction("None").setData("None")
        menu.triggered.connect(self._preset_triggered)
        self.presets_button.setMenu(menu)
        self.glob_box = QLineEdit(placeholderText="Glob, e.g. blocks.*.hook_mlp_out", clearButtonEnabled=True)
        self.glob_box.setMinimumWidth(60)
        self.filter_box.setMinimumWidth(60)
        self.glob_check = QToolButton(text="Check", toolTip="Check every hook point whose name or alias matches")
        self.glob_uncheck = QToolButton(text="Uncheck", toolTip="Uncheck every matching hook point")

        self.model = QStandardItemModel(0, 4, self)
        self.model.setHorizontalHeaderLabels(["Module / hook point", "Width", "Alias", "Window"])
        self.model.horizontalHeaderItem(WINDOW_COLUMN).setToolTip(WINDOW_TIP)
        self.proxy = HookFilterProxy(self)
        self.proxy.setSourceModel(self.model)
        self.tree = QTreeView()
        self.tree.setModel(self.proxy)
        self.tree.setUniformRowHeights(True)
        self.tree.setAlternatingRowColors(True)
        self.tree.setIndentation(14)  # deep module paths keep room for their names
        self.tree.header().setStretchLastSection(False)  # a stretched last column may be narrower than its cells
        self._arrange_columns()
        self.tree.setItemDelegateForColumn(WINDOW_COLUMN, WindowDelegate(self.tree))
        self.tree.setEditTriggers(QTreeView.EditTrigger.DoubleClicked | QTreeView.EditTrigger.SelectedClicked
                                  | QTreeView.EditTrigger.EditKeyPressed)

        self.summary = QLabel("No model loaded")
        self.summary.setWordWrap(True)
        self.apply_button = QPushButton("Apply", enabled=False)
        self.revert_button = QPushButton("Revert", enabled=False, toolTip="Check exactly the captured hook points")

        top = QHBoxLayout()
        top.addWidget(QLabel("Mode"))
        top.addWidget(self.mode_box, 1)
        glob = QHBoxLayout()
        glob.addWidget(self.presets_button)
        glob.addWidget(self.glob_box, 1)
        glob.addWidget(self.glob_check)
        glob.addWidget(self.glob_uncheck)
        bottom = QHBoxLayout()
        bottom.addWidget(self.summary, 1)
        bottom.addWidget(self.revert_button)
        bottom.addWidget(self.apply_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.filter_box)
        layout.addLayout(glob)
        layout.addWidget(self.tree, 1)
        layout.addLayout(bottom)

        self._auto_apply = QTimer(self, singleShot=True, interval=500)
        self._auto_apply.timeout.connect(self._eager_apply)
        self.filter_box.textChanged.connect(self._filter_changed)
        self.glob_check.clicked.connect(self._glob_check_clicked)
        self.glob_uncheck.clicked.connect(self._glob_uncheck_clicked)
        self.glob_box.returnPressed.connect(self._glob_check_clicked)
        self.model.itemChanged.connect(self._item_changed)
        self.apply_button.clicked.connect(self.request_apply)
        self.revert_button.clicked.connect(self._revert)
        self.mode_box.currentIndexChanged.connect(self._mode_edited)
        self.tree.selectionModel().currentChanged.connect(self._current_changed)

    def _arrange_columns(self) -> None:
        """The window column sits beside the check box; a model reset undoes this, so it is reapplied."""
        header = self.tree.header()  # every column as wide as its header and cells: none is cut
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.moveSection(header.visualIndex(WINDOW_COLUMN), 1)

    # ------------------------------------------------------------------ content
    def set_catalogue(self, catalogue: list[HookPoint], installed) -> None:
        self._infos = {h.name: h for h in catalogue}
        self._leaves = {}
        # Rebuilt with the filter detached, which then takes the new tree in whole: a layout change
        # signalled afterwards would leave indexes the view still holds pointing at freed mappings.
        self.proxy.setSourceModel(None)
        with QSignalBlocker(self.model):
            self.model.removeRows(0, self.model.rowCount())
            nodes: dict[str, QStandardItem] = {}
            root = self.model.invisibleRootItem()
            for info in catalogue:
                parent, path = root, ""
                for part in [p for p in info.module_path.split(".") if p]:
                    path = f"{path}.{part}" if path else part
                    node = nodes.get(path)
                    if node is None:
                        node = QStandardItem(part)
                        node.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable |
                                      Qt.ItemFlag.ItemIsUserCheckable)
                        node.setCheckState(Qt.CheckState.Unchecked)
                        node.setToolTip(path)
                        cells = [node, QStandardItem(""), QStandardItem(""), QStandardItem("")]
                        for c in cells[1:]:
                            c.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
                        parent.appendRow(cells)
                        nodes[path] = node
                    parent = node
                leaf = QStandardItem(f"◆ {info.kind}" + (" (withdrawn)" if info.withdrawn else
                                                         " (read only)" if info.unsteerable else ""))
                leaf.setData(info.name, NAME_ROLE)
                tip = (f"{info.name}\nalias {info.alias}\nmodule {info.module_path}\n"
                       f"kind {info.kind}, width {info.width}, dtype {info.dtype}")
                if info.withdrawn:  # greyed out, with the reason: it cannot be captured
                    leaf.setFlags(Qt.ItemFlag.ItemIsSelectable)
                    leaf.setToolTip(f"{tip}\nwithdrawn: {info.withdrawn}")
                else:
                    leaf.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable
                                  | Qt.ItemFlag.ItemIsUserCheckable)
                    leaf.setCheckState(Qt.CheckState.Unchecked)
                    leaf.setToolTip(f"{tip}\nread only: {info.unsteerable}" if info.unsteerable else tip)
                    if info.unsteerable:  # in italics, so a narrow column that cuts the label still shows it
                        font = leaf.font()
                        font.setItalic(True)
                        leaf.setFont(font)
                width = QStandardItem(str(info.width))
                width.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                alias = QStandardItem(info.alias)
                alias.setForeground(QBrush(QColor(70, 70, 160)))
                window = QStandardItem(str(self._windows.get(info.name, ALL)))
                for c in (width, alias, window):
                    c.setData(info.name, NAME_ROLE)
                    c.setFlags(Qt.ItemFlag.ItemIsEnabled | Qt.ItemFlag.ItemIsSelectable)
                if not info.withdrawn:
                    window.setFlags(window.flags() | Qt.ItemFlag.ItemIsEditable)
                    window.setToolTip(WINDOW_TIP)
                parent.appendRow([leaf, width, alias, window])
                if not info.withdrawn:
                    self._leaves[info.name] = leaf
        self.proxy.setSourceModel(self.model)
        self._arrange_columns()  # the reset on re-attaching put the header's sections back in order
        self._installed = set(installed)
        self.set_checked(self._installed)
        self.tree.expandToDepth(2)
        self._refresh_badges()

    def set_installed(self, installed) -> None:
        self._installed = set(installed)
        self._refresh_badges()

    def installed(self) -> set[str]:
        return set(self._installed)

    def hook_names(self) -> list[str]:
        return list(self._leaves)

    def checked(self) -> list[str]:
        return [n for n, it in self._leaves.items() if it.checkState() == Qt.CheckState.Checked]

    def pending(self) -> bool:
        return set(self.checked()) != self._installed

    def set_checked(self, names) -> None:
        names = set(names)
        with QSignalBlocker(self.model):
            for name, leaf in self._leaves.items():
                leaf.setCheckState(Qt.CheckState.Checked if name in names else Qt.CheckState.Unchecked)
        self._sync_parents()
        self._after_change()

    def set_hook_checked(self, name: str, on: bool) -> None:
        """A click on one leaf's check box (tests use it; the user clicks)."""
        self._leaves[name].setCheckState(Qt.CheckState.Checked if on else Qt.CheckState.Unchecked)

    def windows(self) -> dict[str, CaptureWindow]:
        return dict(self._windows)

    def set_window(self, name: str, text: str) -> None:
        """A hook's window, as if typed in its Window cell (tests use it; the user edits the cell)."""
        self._window_item(name).setText(text)

    def _window_item(self, name: str) -> QStandardItem:
        leaf = self._leaves[name]
        return (leaf.parent() or self.model.invisibleRootItem()).child(leaf.row(), WINDOW_COLUMN)

    def _window_edited(self, item: QStandardItem) -> None:
        name = item.data(NAME_ROLE)
        try:
            window = CaptureWindow.parse(item.text())
        except ValueError as exc:
            self.summary.setText(str(exc))
            window = self._windows.get(name, ALL)  # the cell shows the window in force again
        else:
            self._windows.pop(name, None)
            if not window.is_all:
                self._windows[name] = window
            self.windowsChanged.emit(self.windows())
        with QSignalBlocker(self.model):
            item.setText(str(window))
        self.tree.viewport().update()

    def apply_preset(self, name: str) -> None:
        if name == "None":
            self.set_checked(())
            return
        rule = PRESETS[name]
        self.set_checked(set(self.checked()) | {n for n, h in self._infos.items() if rule(h)})

    def _preset_triggered(self, action) -> None:
        self.apply_preset(action.data())

    def _glob_check_clicked(self, *_) -> None:
        self._glob_clicked(True)

    def _glob_uncheck_clicked(self, *_) -> None:
        self._glob_clicked(False)

    def _revert(self, *_) -> None:
        self.set_checked(self._installed)

    def _glob_clicked(self, on: bool) -> None:
        n = self.check_glob(self.glob_box.text(), on)
        if not n:
            self.summary.setText(f"No hook point matches {self.glob_box.text()!r}")

    def check_glob(self, pattern: str, on: bool = True) -> int:
        pattern = pattern.strip()
        matches = {n for n, h in self._infos.items() if pattern and h.matches(pattern)}
        current = set(self.checked())
        self.set_checked(current | matches if on else current - matches)
        return len(matches)

    # ------------------------------------------------------------------ mode and busy state
    def set_mode(self, mode: str) -> None:
        self._mode = mode
        with QSignalBlocker(self.mode_box):
            self.mode_box.setCurrentIndex(max(self.mode_box.findData(mode), 0))
        self._refresh_badges()

    def mode(self) -> str:
        return self._mode

    def set_busy(self, busy: bool) -> None:
        """While the engine boots or restarts, hook changes cannot be applied."""
        self._busy = busy
        self._refresh_badges()

    def _mode_edited(self, _index) -> None:
        wanted = self.mode_box.currentData()
        if wanted != self._mode:
            with QSignalBlocker(self.mode_box):  # the window confirms, then calls set_mode
                self.mode_box.setCurrentIndex(self.mode_box.findData(self._mode))
            self.modeChangeRequested.emit(wanted)

    # ------------------------------------------------------------------ internals
    def _filter_changed(self, text: str) -> None:
        self.proxy.setFilterFixedString(text.strip())
        if text.strip():
            self.tree.expandAll()

    def _item_changed(self, item: QStandardItem) -> None:
        if item.column() == WINDOW_COLUMN:
            if item.data(NAME_ROLE) is not None:
                self._window_edited(item)
            return
        if item.data(NAME_ROLE) is None and item.column() == 0 and item.hasChildren():
            state = item.checkState()
            if state != Qt.CheckState.PartiallyChecked:  # a module node was clicked: apply to its subtree
                with QSignalBlocker(self.model):
                    self._set_subtree(item, state)
        # Repainted, not laid out again: this runs inside the view's click on a check box, and a layout
        # change there freed the mapping of the index the view goes on to use (a crash).
        with QSignalBlocker(self.model):
            self._sync_parents()
        self._after_change()

    def _set_subtree(self, item: QStandardItem, state) -> None:
        for r in range(item.rowCount()):
            child = item.child(r, 0)
            if child.isCheckable():
                child.setCheckState(state)
            self._set_subtree(child, state)

    def _sync_parents(self) -> None:
        def visit(item: QStandardItem):
            if not item.hasChildren():  # a leaf; None: withdrawn, it has no state
                return item.checkState() if item.isCheckable() else None
            states = [s for s in (visit(item.child(r, 0)) for r in range(item.rowCount())) if s is not None]
            if not states:
                return None
            if all(s == Qt.CheckState.Checked for s in states):
                s = Qt.CheckState.Checked
            elif all(s == Qt.CheckState.Unchecked for s in states):
                s = Qt.CheckState.Unchecked
            else:
                s = Qt.CheckState.PartiallyChecked
            if item.checkState() != s:
                item.setCheckState(s)
            return s

        with QSignalBlocker(self.model):
            root = self.model.invisibleRootItem()
            for r in range(root.rowCount()):
                visit(root.child(r, 0))
        self.tree.viewport().update()

    def _after_change(self) -> None:
        self._refresh_badges()
        self.checkedChanged.emit()
        if self._mode == "eager" and self.pending() and not self._busy:
            self._auto_apply.start()

    def _eager_apply(self) -> None:
        if self._mode == "eager" and self.pending() and not self._busy:
            self.applyRequested.emit(self.checked())

    def request_apply(self) -> None:
        if self.pending():
            self.applyRequested.emit(self.checked())

    def _refresh_badges(self) -> None:
        checked = set(self.checked())
        with QSignalBlocker(self.model):
            for name, leaf in self._leaves.items():
                font = QFont(leaf.font())
                installed = name in self._installed
                font.setBold(installed)
                font.setStrikeOut(installed and name not in checked)
                leaf.setFont(font)
                if name in checked and not installed:
                    leaf.setForeground(QBrush(QColor(0, 120, 60)))
                elif installed and name not in checked:
                    leaf.setForeground(QBrush(QColor(170, 40, 40)))
                else:
                    leaf.setForeground(QBrush(self.palette().text().color()))
        self.tree.viewport().update()
        added, removed = len(checked - self._installed), len(self._installed - checked)
        if self._busy and self._leaves and not (added or removed) and "no model" in self.summary.text():
            pass  # keep "N hook points in file.h5 (no model loaded)"
        elif not self._leaves:
            self.summary.setText("No model loaded")
        else:
            text = f"{len(self._installed)} of {len(self._leaves)} hook points captured"
            if added or removed:
                how = "restarts the engine" if self._mode == "compiled" else "applies live"
                text += f" · pending +{added} −{removed} ({how})"
            self.summary.setText(text)
        pending = bool(added or removed)
        self.apply_button.setEnabled(pending and not self._busy)
        self.apply_button.setText("Apply && restart" if self._mode == "compiled" else "Apply")
        self.revert_button.setEnabled(pending)

    def _current_changed(self, current, _previous) -> None:
        name = current.data(NAME_ROLE)
        if name:
            self.hookActivated.emit(name)

    def leaf_index(self, name: str):
        """The proxy index of a leaf (tests click it)."""
        return self.proxy.mapFromSource(self._leaves[name].index())

    def visible_hooks(self) -> list[str]:
        """Hook names not hidden by the filter."""
        return [n for n, leaf in self._leaves.items() if self.proxy.mapFromSource(leaf.index()).isValid()]
