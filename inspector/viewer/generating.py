"""Generating and steering: a generation (plain, a comparison of clean and intervened twins, or a
patching cell's run), its progress and step events, stopping it, and the user's interventions on the
engine.
"""

from __future__ import annotations

import functools
import time

from inspector.core import resources
from inspector.core.dtypes import ROW_DTYPES
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, StepEvent
from inspector.experiments.compare import Twins, mark_twins, scoped_to_intervened, upcoming_twins

from . import jobs
from .app_state import (GENERATE_TIPS, Action, AppState, ControllerPart, GenerationProgress, describe_exception,
                        details_of)
from .jobs import GenerationResult, TaskState
from .lens import LensResult
from .run_view import RunView

# A live run that could keep more rows than this in memory writes its new rows through to a scratch file
# (RunView.write_through), so that a long run fits: 100,000 tokens of 32 hooks of 4,096 bf16 are 26 GB.
WRITE_THROUGH_BYTES = 512 << 20


class Generating(ControllerPart):
    def __init__(self, app):
        super().__init__(app)
        self.tasks = app.engine_tasks
        self.interventions: list[Intervention] = []
        self.compared: list[Twins] | None = None  # the twins of the comparison generating now
        self._compared_with: list[Intervention] = []  # the interventions its job was given
        self.patched_cell: Intervention | None = None  # the intervention of the patched run generating now
        self._patched_where = ""  # that patching cell, in words
        self.progress: GenerationProgress | None = None
        self.last_result: GenerationResult | None = None
        self.write_through_bytes = WRITE_THROUGH_BYTES
        self._generate_task: TaskState | None = None
        self._select_new = False

    def generate(self, prompts: list[str], sampling: Sampling, compare: bool = False,
                 cell: Intervention | None = None, cell_where: str = "") -> bool:
        """``compare``: each prompt twice in the batch, clean and with the interventions (the twins);
        ``cell``: a patching cell's intervention alone, not the user's (``open_patched_cell``), which
        ``cell_where`` names."""
        if not self.engine.enabled(Action.GENERATE):
            self.view.status("Not ready: " + GENERATE_TIPS[self.engine.state], 5000)
            return False
        if not prompts:
            self.view.status("Type a prompt first.", 5000)
            return False
        if self.runs.shown is not self.runs.live:
            self.runs.show(self.runs.live)
        copies = 2 if compare else 1
        self._write_through_if_long(prompts, sampling.max_tokens, copies)
        self.progress = GenerationProgress(time.perf_counter(), 0, sampling.max_tokens * len(prompts) * copies)
        self._select_new = True
        self.engine.set_state(AppState.GENERATING)
        if compare:
            self.compared, self._compared_with = upcoming_twins(self.engine.session, len(prompts)), list(self.interventions)
            job, args = jobs.compare, (self.engine.session, list(prompts), self._compared_with, sampling)
            if self.interventions:
                self.view.status(f"Comparing {sampling.max_tokens} tokens for {len(prompts)} prompt(s), each run "
                                 "clean and with the interventions…")
            else:
                self.view.status("Compare is on but no intervention is set: the twins will agree. Set one in the "
                                 "Interventions dock to see what it changes.", 15000)
        elif cell is not None:
            self.patched_cell, self._patched_where = cell, cell_where
            job, args = jobs.patched_run, (self.engine.session, prompts[0], cell, sampling)
        else:
            job, args = jobs.generate, (self.engine.session, list(prompts), sampling)
            self.view.status(f"Generating {sampling.max_tokens} tokens for {len(prompts)} prompt(s)…")
        self._generate_task = self.tasks.start(
            job, *args, self.experiments.lens_box, on_partial=functools.partial(self._generation_news, self.runs.live),
            on_done=self._generated, on_exception=self._generation_failed)
        return True

    def _write_through_if_long(self, prompts: list[str], max_tokens: int, copies: int) -> None:
        """Rows go to disk from this generation on if the run could outgrow ``write_through_bytes``
        (a prompt has at most about as many tokens as characters)."""
        if self.runs.live.spool is not None or self.engine.info is None:
            return
        width = sum(h.width for h in self.engine.info.installed.values())
        itemsize = ROW_DTYPES.get(self.engine.info.options.dtype, ROW_DTYPES["float32"]).itemsize
        coming = sum(len(p) + max_tokens for p in prompts) * copies * width * itemsize
        if self.runs.live.bytes_kept() + coming > self.write_through_bytes:
            self.runs.live.write_through(resources.cache_root() / "spool")
            self.view.status(f"A long run: its rows go to {self.runs.live.spool.path} as they come (read back as "
                             "you look), so that memory stays free. Export saves them.", 10000)

    def stop(self) -> None:
        """Works at any moment: before the first step, mid-generation; a no-op when idle."""
        if self.engine.enabled(Action.STOP):
            self.cancel()
            self.view.status("Stopping after the current step…")

    def cancel(self) -> None:
        """Stop the generation running now, if any, whatever the state (a new boot, the app closing)."""
        if self._generate_task is not None:
            self._generate_task.cancel()

    def _generation_news(self, live: RunView, news: StepEvent | LensResult) -> None:
        if isinstance(news, LensResult):
            self.experiments.lensed(news)
        else:
            self._event(live, news)

    def _event(self, live: RunView, event: StepEvent) -> None:
        live.apply(event)
        if live is self.runs.live and self.progress is not None:
            self.progress.tokens += sum(len(step.new_token_ids) for step in event.requests)
            if self._select_new and event.started:
                self._select_new = False
                live.select(request=event.started[0].request_id)
        if event.started and self.patched_cell is not None:
            live.patched.update((start.request_id, self._patched_where) for start in event.started)
        if event.started and self.compared:
            mark_twins(live.run, self.compared)
            if self.engine.state is AppState.GENERATING and self.interventions != self._compared_with:
                # edited before its job set the ones it was given: the edit wins
                self._compared_with = list(self.interventions)
                self.engine.session.set_interventions(self._as_sent(self.interventions))

    def _generation_over(self) -> bool:
        """Whether the generation that just ended is the app's current one (not one a new boot cut short)."""
        self._generate_task = None
        self.experiments.take_back_lens()
        compared, self.compared = self.compared, None
        if compared and self.engine.state is AppState.GENERATING and self.engine.session.alive:
            self.reapply_interventions("the comparison")  # for all requests again, not its twins alone
        patched, self.patched_cell = self.patched_cell, None
        if patched and self.engine.state is AppState.GENERATING and self.engine.session.alive:
            self.reapply_interventions("the patched run")  # the user's, set aside while it ran
        return self.engine.state is AppState.GENERATING

    def _generated(self, result: GenerationResult) -> None:
        self.last_result = result
        if self._generation_over():
            self.engine.set_state(AppState.READY)
            self.view.generation_finished(result)

    def _generation_failed(self, exc: BaseException) -> None:
        if not self._generation_over():
            return
        alive = self.engine.session is not None and self.engine.session.alive
        self.engine.set_state(AppState.READY if alive else AppState.DEAD)
        self.view.generation_finished(None)
        extra = "" if alive else "\n\nThe engine stopped. Engine ▸ Restart Engine boots it again."
        self.view.error(f"Generation failed.\n\n{describe_exception(exc, 'generating')}\n\n"
                        f"Everything captured so far is kept.{extra}", details_of(exc), title="Generation")

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """ValueError with the reason if the engine refuses them (then the previous set stays)."""
        engine = self.engine
        if engine.session is not None and engine.state in (AppState.READY, AppState.GENERATING) and not self.patched_cell:
            engine.session.set_interventions(self._as_sent(interventions))
        self.interventions = list(interventions)
        if interventions:
            where = "from the next token" if self.engine.state is AppState.GENERATING else "on the next generation"
            where = f"to the intervened twins {where}" if self.compared else where
            where = "after the patched run" if self.patched_cell else where
            self.view.status(f"{len(interventions)} intervention(s) set; they apply {where}.", 6000)

    def _as_sent(self, interventions: list[Intervention]) -> list[Intervention]:
        """What the engine gets: while a comparison generates, the set for its intervened twins only."""
        return scoped_to_intervened(interventions, self.compared) if self.compared else list(interventions)

    def reapply_interventions(self, doing: str) -> None:
        """The user's interventions to the engine again (none: clear what work of its own left there)."""
        try:
            self.engine.session.set_interventions(list(self.interventions))
        except ValueError as exc:
            self.interventions = []
            self.view.interventions_dropped(f"Interventions were dropped after {doing}: {exc}")
