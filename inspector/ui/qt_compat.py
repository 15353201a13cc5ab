"""Work-arounds for known defects of the Qt binding in use.

PySide6 6.12.0 on CPython 3.11 drops a reference to ``None`` on every call of a C++ method that
returns nothing, and one to ``True`` or ``False`` each time one travels through a ``Signal(object)``
(it relies on these being immortal, which they are only from CPython 3.12 on). A GUI makes such calls
thousands of times a second, so the interpreter aborts within minutes with "Fatal Python error:
none_dealloc" (or "bool_dealloc", at the latest when it exits). PySide6 6.11 does not have that
defect but mis-dispatches queued signals to this app's main window ("Slot 'MainWindow::' not
found"), so the project stays on 6.12 and ``guard_refcounts`` detects each leak and, only where it is
there, gives the object a reference count it cannot run out of (``None``, ``True`` and ``False`` are
static objects that are never freed, so this is what CPython 3.12 does for every interpreter).
"""

from __future__ import annotations

import ctypes
import sys

_GUARDED: set[str] = set()
PROBES = 64


def _leaks(obj, use) -> bool:
    """True if ``use()``, repeated, loses references to ``obj``."""
    before = sys.getrefcount(obj)
    for _ in range(PROBES):
        use()
    return before - sys.getrefcount(obj) >= PROBES // 2


def leaking_constants() -> dict[str, object]:
    """The constants this binding loses references to, by name."""
    if sys.version_info >= (3, 12):
        return {}
    from PySide6.QtCore import QObject, Signal

    class Probe(QObject):
        carried = Signal(object)

    probe = Probe()
    probe.carried.connect(lambda value: None)
    found = {}
    if _leaks(None, lambda: probe.setObjectName("probe")):
        found["None"] = None
    for value in (True, False):
        if _leaks(value, lambda: probe.carried.emit(value)):
            found[repr(value)] = value
    return found


def guard_refcounts() -> set[str]:
    """Apply the work-around where (and only where) a leak is present; returns the guarded names."""
    for name, obj in leaking_constants().items():
        if name not in _GUARDED:
            ctypes.c_ssize_t.from_address(id(obj)).value += 1 << 48
            _GUARDED.add(name)
    return set(_GUARDED)
