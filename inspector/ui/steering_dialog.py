"""A steering vector computed in the app: k × (mean activation over selection A − mean over selection B)
at one hook point, from the captured rows of the shown run."""

from __future__ import annotations

import numpy as np
from PySide6.QtWidgets import (QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QGroupBox,
                               QLabel, QLineEdit, QPushButton)

from inspector.core.hooks import HookPoint
from inspector.core.positions import format_positions, parse_positions


class SteeringDialog(QDialog):
    """Bias = k x (mean activation over selection A - mean over selection B) at one hook."""

    def __init__(self, hooks: list[HookPoint], requests: list[str], compute, strip_selection, default_hook=None,
                 parent=None):
        super().__init__(parent)
        self.setWindowTitle("Steering Vector")
        self._compute, self._strip = compute, strip_selection
        self.result_vector: np.ndarray | None = None
        self.description = ""
        self.hook_box = QComboBox()
        for h in hooks:
            self.hook_box.addItem(f"{h.alias}  ({h.width})", h.name)
        if default_hook:
            self.hook_box.setCurrentIndex(max(self.hook_box.findData(default_hook), 0))
        self.sel = {}
        form = QFormLayout(self)
        form.addRow("Hook point", self.hook_box)
        for key, title in (("A", "Selection A (towards)"), ("B", "Selection B (away from)")):
            group = QGroupBox(title)
            req = QComboBox()
            req.addItems(requests)
            pos = QLineEdit(placeholderText="positions, e.g. 3-7, 10")
            use = QPushButton("Use token-strip selection")
            use.setProperty("selection", key)
            use.clicked.connect(self._use_clicked)
            g = QFormLayout(group)
            g.addRow("Request", req)
            g.addRow("Positions", pos)
            g.addRow(use)
            form.addRow(group)
            self.sel[key] = (req, pos)
        self.k = QDoubleSpinBox(decimals=3, minimum=-1000, maximum=1000, value=1.0, singleStep=0.5)
        form.addRow("Multiplier k", self.k)
        self.info = QLabel("Pick two selections, then Compute.")
        self.info.setWordWrap(True)
        form.addRow(self.info)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        compute_button = self.buttons.addButton("Compute", QDialogButtonBox.ButtonRole.ApplyRole)
        compute_button.clicked.connect(self.compute)
        self.buttons.accepted.connect(self._accept)
        self.buttons.rejected.connect(self.reject)
        form.addRow(self.buttons)

    def _use_clicked(self, *_) -> None:
        self._fill_from_strip(*self.sel[self.sender().property("selection")])

    def _fill_from_strip(self, req_box: QComboBox, pos_edit: QLineEdit) -> None:
        rid, positions = self._strip()
        if rid is not None:
            req_box.setCurrentText(rid)
        if positions:
            pos_edit.setText(format_positions(positions))

    def set_selection(self, key: str, rid: str, positions) -> None:
        req, pos = self.sel[key]
        req.setCurrentText(rid)
        pos.setText(positions if isinstance(positions, str) else format_positions(positions))

    def compute(self) -> bool:
        hook = self.hook_box.currentData()
        try:
            sel = {}
            for key, (req, pos) in self.sel.items():
                if not pos.text().strip():
                    raise ValueError(f"selection {key} has no positions")
                sel[key] = [(req.currentText(), parse_positions(pos.text()))]
            vec, na, nb = self._compute(hook, sel["A"], sel["B"])
        except ValueError as exc:
            self.result_vector = None
            self.info.setText(f"<span style='color:#b01e1e'>Cannot compute: {exc}</span>")
            return False
        k = self.k.value()
        self.result_vector = (k * vec).astype(np.float32)
        a_req, a_pos = self.sel["A"]
        b_req, b_pos = self.sel["B"]
        self.description = (f"steer {k:g}×(mean {a_req.currentText()}[{a_pos.text()}] − "
                            f"mean {b_req.currentText()}[{b_pos.text()}])")
        self.info.setText(f"‖v‖ = {np.linalg.norm(self.result_vector):.4g} from {na} row(s) in A and {nb} in B.")
        return True

    def _accept(self) -> None:
        if self.compute():
            self.accept()
