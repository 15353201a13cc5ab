"""Running Qt-free jobs (``inspector.viewer.jobs``) off the GUI thread, as superqt's workers do.

A ``TaskRunner`` owns one thread for good: the engine's jobs (boot, generate, close) run one after
another on the same thread, as an in-process vLLM engine wants. It is a plain Python thread: a Qt
thread pool running the same generation job halved the app's decode rate (the figures are in
docs/performance-notes.md). Partial results, progress and outcomes cross back to the GUI thread as
queued signals of the runner itself, tagged with the task they belong to, in the order they were
sent; the callbacks are plain Python. No Qt object is made or dropped off the GUI thread.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
from typing import Callable

from PySide6.QtCore import QObject, Qt, Signal, Slot

from inspector.viewer.jobs import TaskState


class TaskRunner(QObject):
    _partial = Signal(int, object)
    _progress = Signal(int, float)
    _done = Signal(int, object)
    _failed = Signal(int, object)

    def __init__(self, name: str, parent: QObject | None = None):
        super().__init__(parent)
        self.setObjectName(name)
        queued = Qt.ConnectionType.QueuedConnection
        self._partial.connect(self._on_partial, queued)
        self._progress.connect(self._on_progress, queued)
        self._done.connect(self._on_done, queued)
        self._failed.connect(self._on_failed, queued)
        self._ids = itertools.count()
        self._tasks: dict[int, tuple[TaskState, dict[str, Callable | None]]] = {}  # running or queued
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def start(self, job: Callable, *args, on_done: Callable | None = None, on_partial: Callable | None = None,
              on_progress: Callable | None = None, on_exception: Callable | None = None) -> TaskState:
        task = next(self._ids)
        state = TaskState(functools.partial(self._partial.emit, task), functools.partial(self._progress.emit, task))
        self._tasks[task] = (state, {"done": on_done, "partial": on_partial, "progress": on_progress,
                                     "failed": on_exception})
        self._queue.put((task, job, args, state))
        return state

    def shutdown(self, timeout_ms: int) -> bool:
        """Cancel everything queued or running and wait for it; False if it did not end in time."""
        for state, _ in list(self._tasks.values()):
            state.cancel()
        self._queue.put(None)
        self._thread.join(timeout_ms / 1000)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the runner's thread
    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            task, job, args, state = item
            try:
                result = job(*args, state)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the GUI thread
                self._failed.emit(task, exc)
            else:
                self._done.emit(task, result)

    # ------------------------------------------------------------------ the GUI thread
    def _call(self, task: int, which: str, value) -> None:
        entry = self._tasks.get(task)
        if entry is not None and entry[1][which] is not None:
            entry[1][which](value)

    @Slot(int, object)
    def _on_partial(self, task: int, value) -> None:
        self._call(task, "partial", value)

    @Slot(int, float)
    def _on_progress(self, task: int, fraction: float) -> None:
        self._call(task, "progress", fraction)

    @Slot(int, object)
    def _on_done(self, task: int, result) -> None:
        _, callbacks = self._tasks.pop(task)
        if callbacks["done"] is not None:
            callbacks["done"](result)

    @Slot(int, object)
    def _on_failed(self, task: int, exc) -> None:
        _, callbacks = self._tasks.pop(task)
        if callbacks["failed"] is None:
            raise exc  # an unhandled failure reaches the app's excepthook (a dialog)
        callbacks["failed"](exc)
