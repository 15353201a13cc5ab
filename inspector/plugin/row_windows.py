"""Capture windows on the worker: which of a forward's rows each hook keeps, so that the runtime copies
only those off the device (``capture.windows`` says what one window keeps).

Host-side bookkeeping over a step's row offsets and positions, apart from the runtime that owns the
buffers: per request its windows, and how far its windowed forwards ran (where a new intervention
starts to apply, when a window kept none of a forward's rows).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from inspector.core.windows import ALL, CaptureWindow

from .vllm_compat import StepInfo


class SlotIndex(NamedTuple):
    """Where the copied hooks' rows sit in the stacks; rebuilt when hooks change, read every windowed
    forward."""

    slots: list[tuple[int, int, str]]  # (stack, slot, hook name) of every copied hook
    names: frozenset[str]
    by_stack: dict[int, list[int]]  # stack -> its slots in use


class RequestWindows(NamedTuple):
    """A request's capture windows: those of its hooks that keep fewer than all rows."""

    prompt_tokens: int  # where "generated" and "last" count from
    by_hook: dict[str, CaptureWindow]  # hooks not named keep every row
    shared: CaptureWindow | None  # the one window of every named hook, if they all have the same


class WindowTable:
    """The windowed requests: their windows, and where their rows stand."""

    def __init__(self):
        self.by_request: dict[str, RequestWindows] = {}
        self.whole_from: dict[str, float] = {}  # windowed request -> the position from which it keeps every row
        self.ran_to: dict[str, int] = {}  # windowed request -> the position after its last forward's rows

    def forget(self, rid: str) -> None:
        self.by_request.pop(rid, None)
        self.whole_from.pop(rid, None)
        self.ran_to.pop(rid, None)

    def set(self, rid: str, texts: dict[str, str], prompt_tokens: int) -> None:
        """A request's windows: installed hook name -> capture window text (hooks not named keep every
        row), counted from a prompt of ``prompt_tokens``."""
        parsed = {text: CaptureWindow.parse(text) for text in set(texts.values())}
        distinct = {w for w in parsed.values() if not w.is_all}
        if distinct:
            windows = {name: parsed[text] for name, text in texts.items() if not parsed[text].is_all}
            self.by_request[rid] = RequestWindows(prompt_tokens, windows,
                                                  next(iter(distinct)) if len(distinct) == 1 else None)
            self.whole_from[rid] = max(w.keeps_all_from(prompt_tokens) for w in distinct)
        else:
            self.by_request.pop(rid, None)
            self.whole_from.pop(rid, None)

    def applies(self, step: StepInfo) -> bool:
        """Whether some request of ``step`` has a window that keeps fewer than all of its rows there."""
        return (bool(self.by_request) and not self.by_request.keys().isdisjoint(step.req_ids)
                and not self._keep_all(step))

    def _keep_all(self, step: StepInfo) -> bool:
        """Whether every window keeps all of this step's rows (a decode step under "generated", say): then
        the step is sent as it is, without choosing rows hook by hook."""
        bounds, positions = step.query_start_loc.tolist(), step.positions
        return all(b == a or positions[a] >= self.whole_from.get(rid, 0)  # a request's rows ascend
                   for rid, a, b in zip(step.req_ids, bounds, bounds[1:]))

    def note_forward(self, step: StepInfo, spans: list[tuple[str, slice]]) -> None:
        """Where each windowed request of a forward stands after it (``spans``: request -> its rows)."""
        for rid, rows in spans:
            if rid in self.by_request:
                self.ran_to[rid] = int(step.positions[rows.stop - 1]) + 1

    def row_groups(self, step: StepInfo, spans: list[tuple[str, slice]], index: SlotIndex, no_capture: set[str]
                   ) -> list[tuple[np.ndarray, dict[int, list[int]]]]:
        """The rows of this step each hook keeps, as (mask over the rows, stack -> its hooks keeping them);
        requests in ``no_capture`` keep none. One mask per distinct combination of the requests' windows;
        when every request has one window for all hooks (the usual case) that is a single mask, found
        without going hook by hook."""
        slots, names, by_stack = index
        columns = []  # per request: its window at each slot, or one window for all (None: it keeps no rows)
        for rid, _ in spans:
            if rid in no_capture:
                columns.append((None,))
            elif rid in self.by_request:
                windows = self.by_request[rid]
                columns.append((windows.shared,) if windows.shared is not None and names <= windows.by_hook.keys()
                               else tuple(windows.by_hook.get(name, ALL) for _, _, name in slots))
            else:
                columns.append((ALL,))
        if all(len(column) == 1 for column in columns):  # one mask for all hooks
            return [(self._keep_mask(step, spans, [column[0] for column in columns]), by_stack)]
        by_windows: dict[tuple, list[int]] = {}  # the requests' windows -> the slots that have them
        for i, key in enumerate(zip(*(column * len(slots) if len(column) == 1 else column for column in columns))):
            by_windows.setdefault(key, []).append(i)
        groups: dict[bytes, tuple[np.ndarray, dict[int, list[int]]]] = {}  # rows kept -> (them, stack -> hooks)
        for windows, members in by_windows.items():
            keep = self._keep_mask(step, spans, windows)
            hooks = groups.setdefault(keep.tobytes(), (keep, {}))[1]
            for i in members:
                hooks.setdefault(slots[i][0], []).append(slots[i][1])
        return list(groups.values())

    def _keep_mask(self, step: StepInfo, spans: list[tuple[str, slice]], windows) -> np.ndarray:
        """The step's rows that the requests' ``windows`` (one per span; None: no rows) keep."""
        keep = np.zeros(step.num_tokens, dtype=bool)
        for window, (rid, rows) in zip(windows, spans):
            if window is not None:
                prompt_tokens = self.by_request[rid].prompt_tokens if rid in self.by_request else 0  # "all" needs none
                keep[rows] = window.keeps(step.positions[rows], prompt_tokens)
        return keep
