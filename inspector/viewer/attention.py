"""Attention patterns in the app, without Qt: which layers of the shown request have queries and keys
captured, one head's tokens x tokens pattern and every head's weights for one token, recomputed from
the run's own rows (``attention_weights``), and in words why there is no pattern when there is none.

Under a causal mask a query's weights are final once its row exists: later tokens only add rows. So
a live pattern grows by its new queries' rows alone (``HeadPattern.grow``), and a repaint with no new
rows computes nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from inspector.core.attention import attention_weights
from inspector.core.hooks import ATTENTION_KINDS, HookPoint
from inspector.core.windows import CaptureWindow

from .labels import display_token
from .run_view import RunSource, RunView

QUERY, KEY = ATTENTION_KINDS
WHAT = {QUERY: "queries", KEY: "keys"}


def _empty(*shape: int, dtype=np.float32):
    return field(default_factory=lambda: np.zeros(shape, dtype))


def attention_layers(hooks: list[HookPoint]) -> list[int]:
    """Layers with queries or keys among ``hooks``, in order: the layer selector's choices."""
    return sorted({h.layer for h in hooks if h.kind in ATTENTION_KINDS})


@dataclass(frozen=True)
class AttentionShown:
    """What the Attention tab draws for one request, layer and head, or (``message``) why it cannot."""

    message: str = ""
    to_capture: tuple[HookPoint, ...] = ()  # hook points whose capture would give a pattern here
    layer: int | None = None
    heads: int = 0
    head: int = 0
    tokens: list[str] = field(default_factory=list)
    pattern: np.ndarray = _empty(0, 0)  # [queries, keys] of ``head``
    query_positions: np.ndarray = _empty(0, dtype=np.int64)
    key_positions: np.ndarray = _empty(0, dtype=np.int64)
    query: int | None = None  # the position whose weights ``query_weights`` holds (None: none)
    query_weights: np.ndarray = _empty(0, 0)  # [heads, keys up to the query's]
    query_note: str = ""  # why no token's weights are shown
    holders: tuple[str, ...] = ()  # the run's other requests that hold a layer's queries and keys

    def weight(self, head: int, query: int, key: int) -> float | None:
        """How much token ``query`` attends to token ``key`` in ``head``, if it is shown (else None)."""
        if not len(self.key_positions):
            return None
        column = key - int(self.key_positions[0])  # keys, like queries, are captured for consecutive positions
        if head == self.head and len(self.query_positions):
            row = query - int(self.query_positions[0])
            if 0 <= row < len(self.pattern) and 0 <= column < self.pattern.shape[1]:
                return float(self.pattern[row, column])
        if query == self.query and 0 <= head < len(self.query_weights) and 0 <= column < self.query_weights.shape[1]:
            return float(self.query_weights[head, column])
        return None

    def describe(self, head: int, query: int, key: int) -> str:
        """The hover read-out of a token pair: which tokens, and the weight."""
        if not (0 <= query < len(self.tokens) and 0 <= key < len(self.tokens)):
            return ""
        pair = f"head {head} · token {self.token(query)} → {self.token(key)}"
        if key > query:
            return f"{pair}: a later token, never attended to"
        weight = self.weight(head, query, key)
        return f"{pair}: weight {weight:.4f}" if weight is not None else ""

    def token(self, position: int) -> str:
        return f"{position} {display_token(self.tokens[position])!r}"


class HeadPattern:
    """One head's weights [queries, keys] of one request, grown by the rows of new queries only."""

    def __init__(self, expected_tokens: int):
        """``expected_tokens``: the room made at once (a request's prompt and token budget), so that the
        weights are seldom copied to grow."""
        self._weights = np.zeros((expected_tokens, expected_tokens), np.float32)
        self.rows = 0

    def grow(self, q_positions, q, k_positions, k, geometry, head: int) -> np.ndarray:
        n, m = len(q_positions), len(k_positions)
        if n > self.rows:
            new = attention_weights(q[self.rows:n], q_positions[self.rows:n], k[:m], k_positions, geometry, (head,))[0]
            room = self._weights.shape
            if n > room[0] or m > room[1]:
                grown = np.zeros((max(n, room[0] * 3 // 2), max(m, room[1] * 3 // 2)), np.float32)
                grown[:self.rows, :room[1]] = self._weights[:self.rows]
                self._weights = grown
            self._weights[self.rows:n, :m] = new
            self.rows = n
        return self._weights[:n, :m]


class AttentionPatterns:
    """The patterns of the run on show, kept between repaints: a repaint computes only what is new."""

    KEPT = 4  # head patterns kept (one of 2,048 tokens takes 16 MB)
    ROOM = 2048  # tokens a new pattern makes room for at most (it grows past them when it must)

    def __init__(self):
        self._view: RunView | None = None
        self._patterns: OrderedDict[tuple, HeadPattern] = OrderedDict()
        self._query_weights: tuple[tuple, np.ndarray] | None = None

    def show(self, view: RunView, rid: str | None, layer: int | None, head: int, position: int | None,
             capturing=()) -> AttentionShown:
        """Layer ``layer``'s pattern of ``head`` for request ``rid``, and every head's weights for the
        token at ``position`` (the newest with a row when None). ``capturing``: the hook points the
        engine captures now (what to tick is what it does not)."""
        if view is not self._view:
            self._view, self._query_weights = view, None
            self._patterns.clear()
        req = view.request(rid)
        if req is None:
            return AttentionShown("No request to show")
        captured = {h.kind: h for h in view.hooks_for(rid) if h.layer == layer and h.kind in ATTENTION_KINDS}
        if len(captured) < 2:
            return _not_captured(view, rid, layer, captured, capturing)
        geometry = captured[QUERY].attention
        if geometry is None:
            return AttentionShown(f"Layer {layer}: the capture says nothing of its attention's geometry (heads, "
                                  "scale, window), so no pattern is recomputed")
        windowed = _windowed(req, layer, captured)
        if windowed:
            return AttentionShown(windowed, layer=layer)
        head = min(max(head, 0), geometry.heads - 1)
        (q_positions, q), (k_positions, k) = view.rows(rid, captured[QUERY].name), view.rows(rid, captured[KEY].name)
        try:
            pattern = self._pattern(req, layer, head).grow(q_positions, q, k_positions, k, geometry, head)
            query, weights, note = self._weights_of(rid, layer, position, q_positions, q, k_positions, k, geometry)
        except ValueError as exc:
            return AttentionShown(f"Layer {layer}: {exc}.", layer=layer)
        return AttentionShown("", (), layer, geometry.heads, head, view.token_texts(rid), pattern,
                              np.asarray(q_positions[:len(pattern)]), np.asarray(k_positions[:pattern.shape[1]]),
                              query, weights, note)

    def _pattern(self, req, layer, head) -> HeadPattern:
        key = (req.request_id, layer, head)
        expected = len(req.prompt_token_ids) + int(req.sampling.get("max_tokens") or 0)
        pattern = self._patterns.pop(key, None) or HeadPattern(min(expected, self.ROOM))
        self._patterns[key] = pattern
        while len(self._patterns) > self.KEPT:
            self._patterns.popitem(last=False)
        return pattern

    def _weights_of(self, rid, layer, position, q_positions, q, k_positions, k, geometry):
        """(the query's position, every head's weights over its keys [heads, keys], note) for ``position``."""
        if not len(q_positions):
            return None, np.zeros((0, 0), np.float32), "No rows captured yet"
        row = len(q_positions) - 1 if position is None else int(np.searchsorted(q_positions, position))
        if position is not None and (row == len(q_positions) or q_positions[row] != position):
            return None, np.zeros((0, 0), np.float32), (f"Token {position} has no row (the last token is never "
                                                         "fed back): select an earlier one")
        query = int(q_positions[row])
        key = (rid, layer, query)
        if self._query_weights is None or self._query_weights[0] != key:
            seen = int(np.searchsorted(k_positions, query, side="right"))
            weights = attention_weights(q[row:row + 1], q_positions[row:row + 1], k[:seen], k_positions[:seen],
                                        geometry)[:, 0, :]
            self._query_weights = (key, weights)
        return query, self._query_weights[1], ""


def _windowed(req, layer: int, captured: dict[str, HookPoint]) -> str:
    """Why a capture window leaves no pattern to draw ("" if none does): a query attends to every key
    before it, so the keys must have every row; the pattern's rows must be consecutive queries."""
    for kind, point in captured.items():
        window = CaptureWindow.parse(req.windows.get(point.name, "all"))
        if (kind == KEY and not window.is_all) or (kind == QUERY and window.kind == "every" and window.n > 1):
            return (f"Layer {layer}: its {WHAT[kind]} were captured through the capture window {window}, which "
                    f"leaves out {WHAT[kind]} the pattern needs; capture {point.alias} with the window 'all'"
                    + (" (queries may use generated or last:N)" if kind == QUERY else ""))
    return ""


def _not_captured(view: RunView, rid: str, layer: int | None, captured: dict[str, HookPoint],
                  capturing) -> AttentionShown:
    """Why a layer has no pattern when its queries or keys are missing, and what to capture for one."""
    points = [h for h in view.catalogue.values() if h.kind in ATTENTION_KINDS]
    offered = [h for h in points if not h.withdrawn]  # the boot probe withdrew the others: they cannot be captured
    if captured:  # one of the pair
        have, = captured
        lacking = QUERY if have == KEY else KEY
        wanted = [h for h in offered if h.layer == layer and h.kind == lacking]
        missing = f"Layer {layer} has its {WHAT[have]} captured but not its {WHAT[lacking]}"
        tick = wanted[0].alias if wanted else f"blocks.{layer}.attn.hook_{lacking}"
    elif holders := _holders(view, rid):
        return _held_elsewhere(view, rid, holders, offered, capturing)
    elif view.source is RunSource.FILE:
        return AttentionShown("This capture holds no attention queries and keys (blocks.N.attn.hook_q and "
                              "hook_k): capture them to see attention patterns")
    elif not offered:
        why = f" (its queries and keys were withdrawn at boot: {points[0].withdrawn})" if points else ""
        return AttentionShown(f"This model offers no attention query and key hook points{why}, so no attention "
                              "patterns can be shown")
    else:
        wanted, missing = offered, f"No attention queries and keys captured for request {rid}"
        tick = "blocks.N.attn.hook_q and blocks.N.attn.hook_k of a layer N"
    if any(h.name in capturing for h in wanted):
        return AttentionShown(f"{missing}; they are captured from now on: generate again to see its patterns",
                              layer=layer)
    return AttentionShown(f"{missing}: tick {tick} in the model tree",
                          tuple(h for h in wanted if h.name not in capturing), layer)


def _holders(view: RunView, rid: str) -> list[str]:
    """The run's requests other than ``rid`` with some layer's queries and keys both captured (a request
    that ran before they were ticked has none)."""
    def holds(req) -> bool:
        points = [h for h in map(view.hook_info, req.hooks) if h is not None and h.kind in ATTENTION_KINDS]
        kinds = {(h.layer, h.kind) for h in points}
        return any((layer, KEY) in kinds for layer, kind in kinds if kind == QUERY)
    return [other for other, req in view.run.requests.items() if other != rid and holds(req)]


def _held_elsewhere(view: RunView, rid: str, holders: list[str], offered: list[HookPoint], capturing) -> AttentionShown:
    """Request ``rid`` has no queries and keys but ``holders`` do: say which, and offer to show one."""
    named = holders if len(holders) <= 4 else [*holders[:3], f"{len(holders) - 3} more"]
    listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
    message = (f"Request {rid} holds no attention queries and keys; {listed} {'does' if len(holders) == 1 else 'do'}: "
               "choose one in the Request box above to see its patterns")
    missing = [h for h in offered if h.name not in capturing] if view.source is not RunSource.FILE else []
    if missing:
        message += ", or tick blocks.N.attn.hook_q and hook_k of a layer N to capture them for new requests"
    return AttentionShown(message, tuple(missing), holders=tuple(holders))
