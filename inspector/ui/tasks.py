"""Running Qt-free jobs (``inspector.viewer.jobs``) off the GUI thread, as superqt's workers do.

A ``TaskRunner`` owns one thread for good: the engine's jobs (boot, generate, close) run one after
another on the same thread, as an in-process vLLM engine wants. It is a plain Python thread: a Qt
thread pool running the same generation job halved the app's decode rate (the figures are in
docs/performance-notes.md). Partial results, progress and the outcome cross back to the GUI thread
as queued signals of a relay object that lives there, in the order they were sent; the callbacks are
plain Python.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot

from inspector.viewer.jobs import TaskState


class _Relay(QObject):
    """One task's signals, received on the GUI thread."""

    partial = Signal(object)
    progress = Signal(float)
    done = Signal(object)
    failed = Signal(object)

    def __init__(self, runner: "TaskRunner", on_done, on_partial, on_progress, on_exception):
        super().__init__(runner)
        self._runner = runner
        self.state: TaskState | None = None
        self._on = {"done": on_done, "partial": on_partial, "progress": on_progress, "failed": on_exception}
        queued = Qt.ConnectionType.QueuedConnection
        self.partial.connect(self._partial, queued)
        self.progress.connect(self._progress, queued)
        self.done.connect(self._done, queued)
        self.failed.connect(self._failed, queued)

    def _call(self, which: str, value) -> None:
        if self._on[which] is not None:
            self._on[which](value)

    @Slot(object)
    def _partial(self, value) -> None:
        self._call("partial", value)

    @Slot(float)
    def _progress(self, fraction: float) -> None:
        self._call("progress", fraction)

    @Slot(object)
    def _done(self, result) -> None:
        self._finish()
        self._call("done", result)

    @Slot(object)
    def _failed(self, exc) -> None:
        self._finish()
        if self._on["failed"] is None:
            raise exc  # an unhandled failure reaches the app's excepthook (a dialog)
        self._call("failed", exc)

    def _finish(self) -> None:
        self._runner.running.discard(self)
        self.deleteLater()


class TaskRunner(QObject):
    def __init__(self, name: str, parent: QObject | None = None):
        super().__init__(parent)
        self.setObjectName(name)
        self.running: set[_Relay] = set()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            _run(*item)

    def start(self, job: Callable, *args, on_done: Callable | None = None, on_partial: Callable | None = None,
              on_progress: Callable | None = None, on_exception: Callable | None = None) -> TaskState:
        relay = _Relay(self, on_done, on_partial, on_progress, on_exception)
        state = relay.state = TaskState(relay.partial.emit, relay.progress.emit)
        self.running.add(relay)
        self._queue.put((job, args, state, relay))
        return state

    def shutdown(self, timeout_ms: int) -> bool:
        """Cancel everything queued or running and wait for it; False if it did not end in time."""
        for relay in self.running:
            relay.state.cancel()
        self._queue.put(None)
        self._thread.join(timeout_ms / 1000)
        return not self._thread.is_alive()


def _run(job: Callable, args: tuple, state: TaskState, relay: _Relay) -> None:
    try:
        result = job(*args, state)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the GUI thread
        relay.failed.emit(exc)
    else:
        relay.done.emit(result)
