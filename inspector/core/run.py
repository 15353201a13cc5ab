"""A captured run as plain data (numpy only): what the engine yields, the app shows and io writes.

Rows of a hook are the forwards' rows for one request: row k holds the activation at ``positions[k]``,
computed while ``token_ids[k]`` was the input. The last generated token is never fed back, so a
request with T tokens normally has T - 1 rows per hook.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .arrays import GrowableArray
from .blocks import RowBlocks
from .hooks import HookPoint


class TopToken(NamedTuple):
    """One of the most likely tokens at a generated position."""

    token_id: int
    logprob: float
    text: str


class HookRows:
    """Rows of one hook for one request, appended step by step, kept in the engine's dtype
    (``dtypes.ROW_DTYPES``: a bf16 engine's rows stay bfloat16).

    Rows handed over with ``keep`` are held as they came and joined into the arrays only when read: a
    batch-32 step of 32 hooks adds 1,024 pieces, and copying each as it came took most of a step's
    host time (page faults of the fresh memory included; docs/performance-notes.md). Reads may come
    from another thread than the one adding rows: joining is locked."""

    _source: "tuple[RunBlocks, str, str] | None" = None  # (the run's bulk steps, request, hook) it follows
    _seen = 0  # the source's steps taken into _kept so far

    def __init__(self, width: int, expected_rows: int = 16, dtype=np.float32):
        """``expected_rows``: room made at once (a request's prompt and token budget), so rows are
        copied once instead of again at every regrowth; untouched room costs address space, not memory."""
        self.width = width
        self._positions = GrowableArray(np.int64, capacity=expected_rows)
        self._token_ids = GrowableArray(np.int64, capacity=expected_rows)
        self._values = GrowableArray(np.dtype(dtype), (width,), capacity=expected_rows)
        self._kept: list[tuple] = []  # (positions, token_ids, values) handed over, not joined yet
        self._rows = 0
        self._join_lock = threading.Lock()

    @property
    def dtype(self) -> np.dtype:
        return self._values.dtype

    def follow(self, blocks: "RunBlocks", request_id: str, hook: str) -> None:
        """Take this (request, hook)'s rows from the run's steps in bulk from the next one added on,
        when they are read (``RunBlocks``)."""
        self._sync()
        self._source, self._seen = (blocks, request_id, hook), len(blocks.steps)

    def _sync(self) -> None:
        """Views of the rows in bulk steps added since the last read, kept for joining."""
        if self._source is not None and self._seen < len(self._source[0].steps):
            with self._join_lock:
                blocks, rid, hook = self._source
                self._seen, parts = blocks.take(rid, hook, self._seen)
                self._kept += parts
                self._rows += sum(len(part[0]) for part in parts)

    def append(self, positions, token_ids, values) -> None:
        """Copy the rows in (the caller may write its arrays again)."""
        values = self._checked(positions, token_ids, values)
        self._joined()  # in order; with nothing kept, no reader's join can touch the arrays meanwhile
        self._positions.append(positions)
        self._token_ids.append(token_ids)
        self._values.append(values)
        self._rows += len(values)

    def keep(self, positions, token_ids, values) -> None:
        """Add rows whose arrays the caller hands over and nothing writes again (a step event's that
        owns them): held as they are, joined when read."""
        values = self._checked(positions, token_ids, values)
        self._sync()
        self._kept.append((positions, token_ids, values))
        self._rows += len(values)

    def _joined(self) -> None:
        self._sync()
        if self._kept:
            with self._join_lock:
                self._join_kept()

    def _join_kept(self) -> None:
        """Under the lock; rows kept meanwhile (by the adding thread) wait for the next read."""
        parts = self._kept[:]
        if parts:
            for array, column in zip((self._positions, self._token_ids, self._values), zip(*parts)):
                array.extend(column)
            del self._kept[:len(parts)]

    def _checked(self, positions, token_ids, values) -> np.ndarray:
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[1] != self.width or not len(values) == len(positions) == len(token_ids):
            raise ValueError(f"rows of shape {values.shape} with {len(positions)} positions do not fit "
                             f"a hook of width {self.width}")
        return values

    def snapshot(self) -> "HookRows":
        """The rows so far, shared (no copy), for another thread: later appends never change them."""
        self._joined()
        copy = HookRows.__new__(HookRows)
        copy.width, copy._kept, copy._join_lock = self.width, [], threading.Lock()
        copy._positions, copy._token_ids, copy._values = (
            self._positions.snapshot(), self._token_ids.snapshot(), self._values.snapshot())
        copy._rows = len(copy._positions)
        return copy

    @property
    def positions(self) -> np.ndarray:
        self._joined()
        return self._positions.view()

    @property
    def token_ids(self) -> np.ndarray:
        self._joined()
        return self._token_ids.view()

    @property
    def values(self) -> np.ndarray:
        self._joined()
        return self._values.view()

    def __len__(self) -> int:
        self._sync()
        return self._rows


class RunBlocks:
    """A run's steps that came in bulk (``RowBlocks``), kept as they came: a step costs a few calls
    whatever its number of requests and hooks, and each (request, hook)'s ``HookRows`` takes its
    rows out when read. A step is let go once every one of its (request, hook)s has taken its rows."""

    def __init__(self):
        self.steps: list[RowBlocks | None] = []
        self._untaken: list[int] = []  # per step: (request, hook)s that have not taken their rows yet
        self._lock = threading.Lock()

    def add(self, blocks: RowBlocks) -> None:
        self._untaken.append(len(blocks.request_ids) * len(blocks.values))
        self.steps.append(blocks)

    def take(self, request_id: str, hook: str, start: int) -> tuple[int, list[tuple]]:
        """The (request, hook)'s rows in steps ``start`` on: (the step to go on from, their parts)."""
        end, parts = len(self.steps), []
        with self._lock:
            for i in range(start, end):
                blocks = self.steps[i]
                where = None if blocks is None or hook not in blocks.values else blocks.span(request_id)
                if where is None:
                    continue
                parts.append((blocks.positions[where], blocks.token_ids[where], blocks.values[hook][where]))
                self._untaken[i] -= 1
                if not self._untaken[i]:
                    self.steps[i] = None
        return end, parts


class LensRows:
    """The logit lens of one hook's rows for one request: per position, the top ``k`` next tokens, and
    the token that did come next (its id, logprob and rank, 0 = the top; -1, NaN, -1 where unknown)."""

    COLUMNS = ("positions", "top_ids", "top_logprobs", "chosen_ids", "chosen_logprobs", "chosen_ranks")

    def __init__(self, k: int):
        self.k = k
        self._columns = {"positions": GrowableArray(np.int64), "top_ids": GrowableArray(np.int64, (k,)),
                         "top_logprobs": GrowableArray(np.float32, (k,)), "chosen_ids": GrowableArray(np.int64),
                         "chosen_logprobs": GrowableArray(np.float32), "chosen_ranks": GrowableArray(np.int64)}

    def append(self, positions, top_ids, top_logprobs, chosen_ids, chosen_logprobs, chosen_ranks) -> None:
        given = dict(zip(self.COLUMNS, (positions, top_ids, top_logprobs, chosen_ids, chosen_logprobs, chosen_ranks)))
        arrays = {name: np.asarray(given[name], self._columns[name].dtype) for name in self.COLUMNS}
        n = len(arrays["positions"])
        for name, a in arrays.items():
            if a.shape != (n, *self._columns[name].row_shape):
                raise ValueError(f"a lens of {n} positions and k = {self.k} takes {name} of shape "
                                 f"{(n, *self._columns[name].row_shape)}, not {a.shape}")
        for name, a in arrays.items():
            self._columns[name].append(a)

    def column(self, name: str) -> np.ndarray:
        """One of ``COLUMNS``, a row per position."""
        return self._columns[name].view()

    def __len__(self) -> int:
        return len(self._columns["positions"])


class FeatureRows:
    """An attached SAE's strongest features for one request: per row (position), the ids (-1 where
    fewer were active) and activations of its ``k`` strongest features, strongest first."""

    def __init__(self, k: int):
        self.k = k
        self._positions, self._ids = GrowableArray(np.int64), GrowableArray(np.int32, (k,))
        self._activations = GrowableArray(np.float32, (k,))

    def append(self, positions, ids, activations) -> None:
        self._positions.append(positions)
        self._ids.append(ids)
        self._activations.append(activations)

    @property
    def positions(self) -> np.ndarray:
        return self._positions.view()

    @property
    def ids(self) -> np.ndarray:
        return self._ids.view()

    @property
    def activations(self) -> np.ndarray:
        return self._activations.view()

    def __len__(self) -> int:
        return len(self._positions)


@dataclass
class RequestCapture:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    sampling: dict
    generated_token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # one per token, prompt then generated
    # per generated token: the chosen token's logprob, and the most likely tokens
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopToken]] = field(default_factory=list)
    # (first position computed under this set, the interventions active for this request then, as dicts)
    intervention_log: list[tuple[int, list[dict]]] = field(default_factory=list)
    hooks: dict[str, HookRows] = field(default_factory=dict)
    lens: dict[str, LensRows] = field(default_factory=dict)  # by hook: the logit lens of its rows, if asked for
    # position -> logprobs of sampling["score_token_ids"] predicted there, if asked for
    scores: dict[int, np.ndarray] = field(default_factory=dict)
    features: dict[str, FeatureRows] = field(default_factory=dict)  # by attached SAE
    # hook -> the capture window in force (the last one given, if it changed while the request ran); hooks
    # not named: all. The rows' positions say which were kept.
    windows: dict[str, str] = field(default_factory=dict)
    twin_role: str | None = None  # a comparison's "clean" or "intervened" run of a prompt (experiments.compare)
    twin_of: str | None = None  # the other twin's request id
    finish_reason: str | None = None
    bulk_hooks: tuple = field(default=(), repr=False, compare=False)  # the hooks following the run's bulk steps

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.generated_token_ids


@dataclass
class Run:
    """Everything one generation produced, plus what is needed to reproduce and cite it."""

    metadata: dict  # app/vLLM versions, model path and config, dtype, engine mode, created time
    hooks: dict[str, HookPoint] = field(default_factory=dict)
    requests: dict[str, RequestCapture] = field(default_factory=dict)
    vocabulary: dict[int, str] = field(default_factory=dict)  # texts of other token ids it names (the lens's)
    bulk: RunBlocks = field(default_factory=RunBlocks, repr=False, compare=False)  # steps kept in bulk
