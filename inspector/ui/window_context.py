"""The interventions dock's view of the main window (``interventions_dock.DockContext``): the request and
hook on show, the token strip's selection, steering vectors from the run on show."""

from __future__ import annotations

import numpy as np

from inspector.core.hooks import HookPoint


class ShownRunContext:
    def __init__(self, window):
        self._window = window

    def current_request(self) -> str | None:
        return self._window.shown.selection.request

    def current_hook(self) -> str | None:
        return self._window.shown.selection.hook

    def strip_selection(self) -> tuple[str | None, tuple[int, ...]]:
        return self._window.shown.selection.request, self._window.strip.selected_positions()

    def steering_vector(self, hook: str, a, b) -> np.ndarray:
        return self._window.shown.steering_vector(hook, a, b)

    def captured_hooks(self) -> list[HookPoint]:
        return self._window.shown.hooks_for(None)
