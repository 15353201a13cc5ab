"""Python functions run on a hook point's rows at every forward (eager mode, engine in the caller's
process): what a notebook's ``run_with_hooks`` needs. Each function sees one request's rows of the
forward at a time, as a view it may edit in place, or returns new rows of the same shape. Their edit
reaches the model as a per-row bias (the delta), through the same site code as the interventions.

A function that raises leaves the rows as they were and is kept as ``error`` for its caller to raise
after the run: an exception inside a step would fail the engine."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

# (one request's rows [tokens, width], its request id, their positions) -> new rows, or None (edited in place)
RowFunction = Callable[[torch.Tensor, str, np.ndarray], torch.Tensor | None]


class PythonHooks:
    def __init__(self):
        self.functions: dict[str, RowFunction] = {}  # installed hook name -> its function
        self.error: BaseException | None = None  # the first a function raised since it was last taken

    def set(self, functions: dict[str, RowFunction]) -> None:
        self.functions = dict(functions)

    def take_error(self) -> BaseException | None:
        error, self.error = self.error, None
        return error

    def delta(self, name: str, value: torch.Tensor, req_ids: list[str], starts: np.ndarray,
              positions: np.ndarray) -> torch.Tensor | None:
        """What the function of ``name`` adds to ``value`` [rows, width], the forward's rows (requests in
        batch order, ``starts`` their row offsets); None where it has none, or failed before."""
        function = self.functions.get(name)
        if function is None or self.error is not None:
            return None
        edited = value.clone()
        try:
            for i, rid in enumerate(req_ids):
                rows = slice(int(starts[i]), int(starts[i + 1]))
                view = edited[rows]
                out = function(view, rid, positions[rows])
                if out is not None and out is not view:
                    view.copy_(out)
        except Exception as e:  # kept for the caller; the forward goes on unedited
            self.error = e
            return None
        return edited - value
