"""A captured run as plain data (numpy only): what the engine yields, the UI shows and io writes.

Rows of a hook are the forwards' rows for one request: row k holds the activation at ``positions[k]``,
computed while ``token_ids[k]`` was the input. The last generated token is never fed back, so a
request with T tokens normally has T - 1 rows per hook.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np


def matches_pattern(name: str, alias: str, pattern: str) -> bool:
    """How a hook selection picks points, everywhere (worker, session, app): a glob on the stable
    name or on the TransformerLens-style alias."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(alias, pattern)


@dataclass(frozen=True)
class HookInfo:
    name: str
    alias: str
    module_path: str
    kind: str
    width: int
    layer: int = -1
    dtype: str = "float32"  # the engine's dtype the rows were captured in

    def matches(self, pattern: str) -> bool:
        return matches_pattern(self.name, self.alias, pattern)

    @classmethod
    def from_point(cls, point: dict, dtype: str) -> "HookInfo":
        return cls(point["name"], point["alias"], point["module_path"], point["kind"], int(point["width"]),
                   int(point.get("layer", -1)), dtype)


class HookRows:
    """Rows of one hook for one request, appended chunk by chunk; concatenated lazily."""

    def __init__(self, width: int):
        self.width = width
        self._positions: list[np.ndarray] = []
        self._token_ids: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self._cache: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def append(self, positions: np.ndarray, token_ids: np.ndarray, values: np.ndarray) -> None:
        if values.ndim != 2 or values.shape[1] != self.width or len(values) != len(positions):
            raise ValueError(f"rows of shape {values.shape} do not fit a hook of width {self.width}")
        self._positions.append(np.asarray(positions, dtype=np.int64))
        self._token_ids.append(np.asarray(token_ids, dtype=np.int64))
        self._values.append(values)
        self._cache = None

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._cache is None:
            if not self._values:
                empty = np.zeros(0, dtype=np.int64)
                self._cache = (empty, empty, np.zeros((0, self.width), dtype=np.float32))
            else:
                self._cache = (np.concatenate(self._positions), np.concatenate(self._token_ids),
                               np.concatenate(self._values))
                self._positions, self._token_ids, self._values = (
                    [self._cache[0]], [self._cache[1]], [self._cache[2]])
        return self._cache

    @property
    def positions(self) -> np.ndarray:
        return self._arrays()[0]

    @property
    def token_ids(self) -> np.ndarray:
        return self._arrays()[1]

    @property
    def values(self) -> np.ndarray:
        return self._arrays()[2]

    def __len__(self) -> int:
        return sum(len(p) for p in self._positions)


@dataclass
class RequestCapture:
    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    sampling: dict
    generated_token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # one per token, prompt then generated
    # per generated token: the chosen token's logprob, and the top-k (token id, logprob) pairs
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # (first position computed under this set, the interventions active for this request then)
    intervention_log: list[tuple[int, list[dict]]] = field(default_factory=list)
    hooks: dict[str, HookRows] = field(default_factory=dict)
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.generated_token_ids

    @property
    def is_prompt(self) -> np.ndarray:
        flags = np.zeros(len(self.token_ids), dtype=bool)
        flags[: len(self.prompt_token_ids)] = True
        return flags


@dataclass
class Run:
    """Everything one generation produced, plus what is needed to reproduce and cite it."""

    metadata: dict  # app/vLLM versions, model path and config, dtype, engine mode, created time
    hooks: dict[str, HookInfo] = field(default_factory=dict)
    requests: dict[str, RequestCapture] = field(default_factory=dict)
