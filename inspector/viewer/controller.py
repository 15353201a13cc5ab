"""The app's behaviour without Qt, composed of its jobs: the engine's lifecycle and what each state
allows (``engine_control``), the runs and the one on show (``runs``), generating and steering
(``generating``), and what the engine computes besides (``experiments``: the logit lens, patching sweeps).

The window is a ``ControllerView``: it draws, asks and tells; the controller decides. Engine work runs
as jobs (``inspector.viewer.jobs``) on an ``engine`` runner that keeps one thread for the engine;
exports run on a ``files`` runner. Both runners deliver results on the GUI thread, so the controller
never needs a lock.
"""

from __future__ import annotations

from typing import Callable

from inspector.core.protocol import SessionFactory

from .app_state import ControllerView, TaskRunner
from .engine_control import EngineControl
from .experiments import Experiments
from .generating import Generating
from .runs import Runs


class Controller:
    def __init__(self, session_factory: SessionFactory, engine_tasks: TaskRunner, file_tasks: TaskRunner,
                 view: ControllerView):
        self.view, self.engine_tasks, self.file_tasks = view, engine_tasks, file_tasks
        self.engine = EngineControl(self, session_factory)
        self.runs = Runs(self)
        self.generating = Generating(self)
        self.experiments = Experiments(self)

    def shutdown(self, wait: Callable[[], bool]) -> bool:
        """Stop what runs, close the session on its thread; ``wait()`` waits for the runners."""
        self.runs.cancel_export()
        self.generating.cancel()
        self.experiments.cancel_sweep()
        self.engine.close_session()
        done = wait()
        self.runs.close()
        return done
