"""The desktop app (PySide6 + pyqtgraph). The only package that imports Qt, and it imports neither
torch nor vLLM: it draws ``inspector.viewer`` (the app's state and behaviour) and reaches the engine
only through the session factory it is given.

Engine work runs as Qt-free jobs on a ``tasks.TaskRunner`` thread; results come back as queued
signals carrying numpy arrays and frozen dataclasses. Views repaint from accumulated data on a ~30 Hz
timer, never per token.
"""

from .qt_compat import guard_refcounts as _guard_refcounts

_guard_refcounts()
