"""``session.patch(...)`` and ``session.compare(...)`` on every kind of session (in-process, remote,
the test fake): the experiments use only a session's public calls, so one implementation serves all."""

from __future__ import annotations

from typing import Callable, Iterator

from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, StepEvent

from . import compare, patching


class Experiments:
    """Mixed into the session classes."""

    def patch(self, spec: patching.PatchSpec, progress: patching.SweepProgress | None = None,
              cancelled: Callable[[], bool] = lambda: False) -> patching.SweepResult:
        """An activation-patching sweep (``inspector.experiments.patching.patch``)."""
        return patching.patch(self, spec, progress, cancelled)

    def compare(self, prompts: list[str], interventions: list[Intervention], sampling: Sampling = Sampling()
                ) -> tuple[list[compare.Twins], Iterator[StepEvent]]:
        """Each prompt clean and intervened in one batch (``inspector.experiments.compare.compare``)."""
        return compare.compare(self, prompts, interventions, sampling)
