"""What every kind of session does alike (the engine's in this process, a server's, the test fake):
request ids unique in the process, the run it folds its step events into (rows in memory or written
through), the SAEs its run says it used and, where interventions apply between engine steps, the set
that waits for the next one."""

from __future__ import annotations

import threading

from .interventions import Intervention
from .protocol import NewRows, StepEvent, checked_interventions, fold_event
from .run import Run


class SessionBase:
    """Mixed into the session classes; each says what its runs record (``_run_metadata``) and sets
    ``options``, ``installed`` and ``saes`` before its first ``new_run``."""

    # Class-wide, so request ids stay unique across the sessions of one process: the app keeps
    # showing a run while it reopens the engine, and a new "req0" would land in the old one.
    _next_id = 0

    def upcoming_request_ids(self, n: int) -> list[str]:
        return [f"req{self._next_id + i}" for i in range(n)]

    def _take_request_ids(self, n: int, prefix: str = "req") -> list[str]:
        """The next ``n`` ids, spent (``prefix`` "req": those ``upcoming_request_ids`` announced)."""
        first = type(self)._next_id
        type(self)._next_id += n
        return [f"{prefix}{first + i}" for i in range(n)]

    def new_run(self) -> None:
        self.run = Run(metadata=self._run_metadata(), hooks=dict(self.installed))
        self._new_rows: NewRows | None = None

    def write_through(self, new_rows: NewRows) -> None:
        self._new_rows = new_rows

    def _run_metadata(self) -> dict:
        raise NotImplementedError

    def _fold(self, event: StepEvent) -> None:
        """``event`` into ``run``: its rows kept as the options say, where ``write_through`` puts them."""
        fold_event(self.run, event, keep_rows=self.options.retain_rows, new_rows=self._new_rows)

    def _sae_metadata(self) -> list[dict]:
        """The SAEs attached now, as a run's metadata names them (what its features come from)."""
        return [sae.as_dict() for sae in self.saes.values()]

    def _note_saes(self) -> None:
        self.run.metadata["saes"] = self._sae_metadata()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class HeldInterventions:
    """For a session that applies interventions between engine steps: a set given from any thread is
    checked at once and held until the next step takes it (``_take_pending``). Call
    ``_hold_interventions`` in ``__init__``; ``_lock`` may guard the session's other cross-thread state."""

    def _hold_interventions(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Intervention] | None = None  # given, not applied yet
        self._interventions: list[Intervention] = []  # applied

    @property
    def interventions(self) -> list[Intervention]:
        """The set last given."""
        with self._lock:
            return list(self._pending if self._pending is not None else self._interventions)

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """Thread-safe. Validated at once (ValueError); applied before the next forward."""
        checked = checked_interventions(interventions, self.installed, self.options)
        with self._lock:
            self._pending = checked

    def _take_pending(self) -> list[Intervention] | None:
        """The set given since the last call, or None; the caller applies it."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def _keep_installed_interventions(self) -> None:
        """After a hook change: the set last given (one not applied yet included), less what lost its
        hook, waits for the next step."""
        with self._lock:
            wanted = self._pending if self._pending is not None else self._interventions
            self._interventions = [iv for iv in wanted if iv.hook in self.installed]
            self._pending = list(self._interventions)
