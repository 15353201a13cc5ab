"""Combo boxes whose choices follow the engine (hook kinds come and go with the hook set)."""

from __future__ import annotations

from PySide6.QtCore import QSignalBlocker
from PySide6.QtWidgets import QComboBox


def offer(box: QComboBox, items: list[str]) -> str:
    """Make ``items`` the choices, keeping the current one if it is still offered (else the first),
    without a change signal for the refill itself; returns the one chosen ("" if none)."""
    if items != [box.itemText(i) for i in range(box.count())]:
        current = box.currentText()
        with QSignalBlocker(box):
            box.clear()
            box.addItems(items)
            box.setCurrentIndex(max(box.findText(current), 0))
    return box.currentText()
