"""Work-arounds for known defects of the Qt binding in use.

PySide6 6.12.0 on CPython 3.11 drops a reference to ``None`` on every call of a C++ method that
returns nothing (it relies on ``None`` being immortal, which it is only from CPython 3.12 on).
A GUI makes such calls thousands of times a second, so the interpreter aborts within minutes with
"Fatal Python error: none_dealloc". PySide6 6.11 does not have that defect but mis-dispatches queued
signals to this app's main window ("Slot 'MainWindow::' not found"), so the project stays on 6.12 and
``guard_none_refcount`` detects the leak and, only if it is there, gives ``None`` a reference count it
cannot run out of (``None`` is a static object that is never freed, so this is what CPython 3.12
does for every interpreter).
"""

from __future__ import annotations

import ctypes
import sys

_GUARDED = False


def none_refcount_leak() -> bool:
    """True if calling a void Qt method loses references to None."""
    if sys.version_info >= (3, 12):
        return False
    from PySide6.QtCore import QObject

    obj = QObject()
    obj.setObjectName("probe")
    before = sys.getrefcount(None)
    for _ in range(64):
        obj.setObjectName("probe")
    return before - sys.getrefcount(None) >= 32


def guard_none_refcount() -> bool:
    """Apply the work-around if (and only if) the leak is present; returns whether it was applied."""
    global _GUARDED
    if _GUARDED:
        return True
    if not none_refcount_leak():
        return False
    ctypes.c_ssize_t.from_address(id(None)).value += 1 << 48
    _GUARDED = True
    return True
