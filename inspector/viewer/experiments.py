"""What the engine computes besides generating: the logit lens of the rows on show, and patching sweeps
(the Patching tab), whose cells open as runs of their own.
"""

from __future__ import annotations

from pathlib import Path

from inspector.core.protocol import Sampling
from inspector.experiments.patching import SweepResult

from . import jobs
from .app_state import GENERATE_TIPS, Action, AppState, ControllerPart, describe_exception, details_of
from .jobs import LensBox, TaskState
from .lens import LensResult
from .patching import PatchingSweep, SweepRequest
from .run_view import RunSource, RunView


class Experiments(ControllerPart):
    def __init__(self, app):
        super().__init__(app)
        self.tasks, self.files = app.engine_tasks, app.file_tasks
        self.lens_box = LensBox()  # a lens batch for the generation to compute between steps
        self._lens_out = False  # a lens batch is being computed: the next waits, and takes all that is new
        self.lens_problem: str | None = None  # the lens failed with this session: why
        self.sweep = PatchingSweep()  # the Patching tab's sweep, as its job last reported it
        self._sweep_task: TaskState | None = None

    def can_lens(self, view: RunView) -> bool:
        """Whether the engine can lens ``view``'s rows: it runs the model they were captured with."""
        return (self.engine.session is not None  # while a sweep runs, a lens job waits for it on the engine thread
                and self.engine.state in (AppState.READY, AppState.GENERATING, AppState.PATCHING)
                and self.lens_problem is None
                and view.run.metadata.get("model_path") == self.engine.info.metadata.get("model_path"))

    def follow_lens(self, view: RunView, rid: str | None, hooks: list) -> None:
        """The Lens tab shows ``hooks`` of request ``rid``: lens their rows not lensed yet, all in one
        engine call (between two steps while generating). None while another is out: when it is back,
        the next takes everything that came meanwhile."""
        if self._lens_out or not self.can_lens(view):
            return
        batch = view.lens.pending(view.run, rid, hooks)
        if batch is None:
            return
        self._lens_out = True
        if self.engine.state is AppState.GENERATING:
            self.lens_box.put(batch)
        else:
            self.tasks.start(jobs.lens, self.engine.session, batch, on_done=self.lensed)

    def take_back_lens(self) -> None:
        """A generation ended: a lens batch it did not compute is asked for again by the next paint."""
        if self.lens_box.take() is not None:
            self._lens_out = False

    def lensed(self, result: LensResult) -> None:
        self._lens_out = False
        if result.error is None:
            result.batch.target.add(result)
            return
        self.lens_problem = describe_exception(result.error, "computing the logit lens")
        self.view.error(f"The logit lens failed; no more is computed until the engine restarts.\n\n"
                        f"{self.lens_problem}", details_of(result.error), title="Lens")

    def lens_message(self, view: RunView, rid: str | None, hooks: list) -> str | None:
        """Why the Lens tab shows no cells for ``hooks`` of ``rid`` and will not, or None."""
        if view.request(rid) is None:
            return "No request to show"
        if not hooks:
            return ("No residual-stream hook point captured: select a resid_post hook point (Model tree) "
                    "to see the lens")
        if self.lens_problem is not None and not view.lens.has_any(rid, hooks):
            return f"The logit lens failed: {self.lens_problem}"
        if self.can_lens(view) or view.lens.has_any(rid, hooks):
            return None
        if view.source is RunSource.FILE:
            return "No lens stored in this file: capture with --lens K, or open its model, to see it"
        return "The lens needs the model this run was captured with, running: open it again to see it"

    def start_sweep(self, request: SweepRequest) -> bool:
        """Run ``request`` on the engine thread; ``self.sweep`` fills in as cells finish. A sweep and a
        generation never run at once; a request that cannot run says why in ``self.sweep.problem``."""
        if not self.engine.enabled(Action.PATCH):
            self.view.status("Not ready: " + GENERATE_TIPS[self.engine.state], 5000)
            return False
        problem = request.problem()
        if problem:
            self.sweep.fail(problem)
            return False
        self.sweep.start(request, {h: self.engine.info.installed[h] for h in request.hooks}, self.engine.info.metadata)
        self.engine.set_state(AppState.PATCHING)
        self.view.status(f"Patching sweep over {len(request.hooks)} hook points…")
        self._sweep_task = self.tasks.start(jobs.sweep, self.engine.session, request, on_partial=self.sweep.news,
                                             on_done=self._swept, on_exception=self._sweep_failed)
        return True

    def stop_sweep(self) -> None:
        """The cells done so far stay, marked incomplete."""
        if self.engine.enabled(Action.STOP_PATCH):
            self.cancel_sweep()
            self.view.status("Stopping the sweep after the current engine step…")

    def cancel_sweep(self) -> None:
        """Stop the sweep running now, if any, whatever the state (a new boot, the app closing)."""
        if self._sweep_task is not None:
            self._sweep_task.cancel()

    def _sweep_over(self) -> bool:
        """Whether the sweep that just ended is the app's current work (not one a new boot cut short)."""
        self._sweep_task = None
        if self.engine.state is not AppState.PATCHING:
            return False
        alive = self.engine.session.alive
        self.engine.set_state(AppState.READY if alive else AppState.DEAD)
        if alive:
            self.generating.reapply_interventions("the sweep")  # edited while it ran: the engine has the ones from before
        return True

    def _swept(self, result: SweepResult) -> None:
        self.sweep.finish(result)
        if self._sweep_over():
            self.view.status(self.sweep.message, 10000)

    def _sweep_failed(self, exc: BaseException) -> None:
        refused = isinstance(exc, ValueError)  # the request does not fit the session: the session's reason
        self.sweep.fail(str(exc) if refused else describe_exception(exc, "patching"))
        if not self._sweep_over():
            return
        if refused:  # the tab says why in red; the status line no longer says it runs
            self.view.status("The patching sweep was refused: the Patching tab says why.", 10000)
            return
        self.view.status("The patching sweep failed; the cells that ran are kept.", 10000)
        self.view.error(f"The patching sweep failed.\n\n{self.sweep.problem}\n\nThe cells that ran are kept.",
                        details_of(exc), title="Patching")

    def open_patched_cell(self, row: int, column: int, sampling: Sampling) -> bool:
        """Generate the sweep's target prompt with cell (row, column) patched and nothing else: a run in
        the main views like any other."""
        result = self.sweep.result
        if result is None:
            return False
        hook = result.hooks[row]
        if self.engine.info is not None and (hook not in self.engine.info.installed or self.sweep.metadata.get("model_path")
                                      != self.engine.info.metadata.get("model_path")):
            self.view.error(f"This sweep ran on hook points the engine no longer captures ({hook}): run the sweep "
                            "again to open its cells.", title="Patching")
            return False
        where = self.sweep.grid().where(row, column)
        if not self.generating.generate([self.sweep.target_prompt()], sampling, cell=result.cell_intervention(row, column),
                                        cell_where=where):
            return False
        self.view.status(f"Patched run: {where}; your own interventions are not applied to it.", 15000)
        return True

    def save_sweep(self, path: str) -> bool:
        """Write the sweep on show (finished or not) with its run's metadata, off the GUI thread."""
        if self.sweep.result is None:
            self.view.error("No sweep to save yet: run one first.", title="Save sweep")
            return False
        self.files.start(jobs.save_sweep, self.sweep.result, path, self.sweep.metadata, on_done=self._sweep_saved,
                         on_exception=self._sweep_save_failed)
        return True

    def _sweep_saved(self, path: Path) -> None:
        self.view.status(f"Saved the sweep to {path}", 10000)

    def _sweep_save_failed(self, exc: BaseException) -> None:
        self.view.error(f"Saving the sweep failed; nothing was written.\n\n{exc}", title="Save sweep")
