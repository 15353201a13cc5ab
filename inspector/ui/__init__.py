"""The desktop app (PySide6 + pyqtgraph). The only package that imports Qt.

The engine runs on a worker QObject moved to a QThread (``engine_worker``); signals carry numpy
arrays and frozen dataclasses. Views repaint from accumulated data on a ~30 Hz timer, never per token.
Modules without Qt in their name-space (``capture_view_model``, ``image_pool``, ``intervention_rows``)
hold the state and arithmetic, so they can be unit-tested without a display.
"""

from .qt_compat import guard_refcounts as _guard_refcounts

_guard_refcounts()
