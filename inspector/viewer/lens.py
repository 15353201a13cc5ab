"""The logit lens in the app, without Qt: which residual-stream rows of the shown request still need a
lens, the lens of each (request, hook) as it arrives, and the layers × tokens grid the Lens tab draws.

A live run is lensed as it grows: every row of the shown request not lensed yet, all hooks in one
engine call, one call at a time (``RunLens.pending`` → ``jobs.lens`` → ``RunLens.add``), and only
while the Lens tab is on show. A reopened capture shows the lens stored in it (``inspector capture
--lens K``); a file's own lens is never recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from inspector.core.hooks import RESIDUAL_KINDS, HookPoint
from inspector.core.lens import Lens
from inspector.core.run import LensRows, Run

from .labels import display_token, short_hook_label

LENS_K = 5  # top tokens kept per cell: the grid shows the first, a click all of them
MAX_BATCH_BYTES = 32 << 20  # rows sent to the engine in one call; the rest goes in the next one
ALL_RESIDUAL = "all residual"
PREFERRED_KINDS = ("resid_post", "resid_mid", "resid_pre")
TOP, NEXT_PROB, NEXT_RANK = "top token", "next token: probability", "next token: rank"
MODES = (TOP, NEXT_PROB, NEXT_RANK)


def lens_kinds(hooks: list[HookPoint]) -> list[str]:
    """The residual-stream kinds among ``hooks``, resid_post first, and all of them together when
    there are several."""
    kinds = [kind for kind in PREFERRED_KINDS if any(h.kind == kind for h in hooks)]
    return kinds + [ALL_RESIDUAL] if len(kinds) > 1 else kinds


def lens_hooks(hooks: list[HookPoint], kind: str | None) -> list[HookPoint]:
    """The grid's rows, top to bottom: ``hooks`` (in model order) of ``kind``."""
    kinds = RESIDUAL_KINDS if kind == ALL_RESIDUAL else (kind,)
    return [h for h in hooks if h.kind in kinds]


@dataclass(frozen=True)
class LensBatch:
    """Rows to lens in one engine call: ``values`` stacks a piece per (request, hook)."""

    target: "RunLens"
    pieces: tuple[tuple[str, str, np.ndarray, np.ndarray], ...]  # request, hook, positions, next token (-1: unknown)
    values: np.ndarray  # [rows, hidden] float32, a copy: the engine thread reads nothing the GUI thread writes

    @property
    def chosen(self) -> np.ndarray:
        return np.concatenate([next_ids for *_, next_ids in self.pieces])


@dataclass(frozen=True)
class LensResult:
    """A batch's lens and the texts of the token ids it names that the run did not know, or why it failed."""

    batch: LensBatch
    lens: Lens | None = None
    texts: dict[int, str] = field(default_factory=dict)
    error: BaseException | None = None


class RunLens:
    """The lens of one run's residual-stream rows by (request, hook), and the texts of the tokens it names."""

    def __init__(self, run: Run):
        self.rows: dict[tuple[str, str], LensRows] = {(rid, hook): rows for rid, req in run.requests.items()
                                                      for hook, rows in req.lens.items()}
        self.stored = set(self.rows)  # a file's own lens
        self.texts: dict[int, str] = {tid: text for req in run.requests.values()
                                      for tid, text in zip(req.token_ids, req.token_texts)}
        self.texts.update(run.vocabulary)
        self.revision = 0  # bumped by every result

    def pending(self, run: Run, rid: str | None, hooks: list[HookPoint]) -> LensBatch | None:
        """The rows of ``hooks`` of request ``rid`` not lensed yet, the same number of rows from each
        hook up to ``MAX_BATCH_BYTES`` in all (a long prompt fills the grid from left to right)."""
        req = run.requests.get(rid)
        todo = [h for h in hooks if (rid, h.name) not in self.stored and req is not None and h.name in req.hooks]
        if not todo:
            return None
        per_hook = max(1, MAX_BATCH_BYTES // (4 * sum(h.width for h in todo)))
        tokens = np.asarray(req.token_ids, dtype=np.int64)
        pieces, values = [], []
        for h in todo:
            rows = req.hooks[h.name]
            done = len(self.rows.get((rid, h.name), ()))
            end = min(len(rows), done + per_hook)
            if end <= done:
                continue
            positions = np.asarray(rows.positions[done:end], dtype=np.int64)
            following = positions + 1
            next_ids = np.where(following < len(tokens), tokens[np.minimum(following, len(tokens) - 1)], -1)
            pieces.append((rid, h.name, positions, next_ids))
            values.append(np.asarray(rows.values[done:end], dtype=np.float32))
        return LensBatch(self, tuple(pieces), np.concatenate(values)) if pieces else None

    def add(self, result: LensResult) -> None:
        lens, at = result.lens, 0
        for rid, hook, positions, next_ids in result.batch.pieces:
            piece, known = slice(at, at + len(positions)), next_ids >= 0
            at += len(positions)
            self.rows.setdefault((rid, hook), LensRows(LENS_K)).append(
                positions, lens.top_ids[piece], lens.top_logprobs[piece], next_ids,
                np.where(known, lens.chosen_logprobs[piece], np.nan), np.where(known, lens.chosen_ranks[piece], -1))
        self.texts.update(result.texts)
        self.revision += 1

    def has_any(self, rid: str | None, hooks: list[HookPoint]) -> bool:
        return any((rid, h.name) in self.rows for h in hooks)

    def grid(self, run: Run, rid: str | None, hooks: list[HookPoint]) -> "LensGrid":
        """A row per hook, a column per position with rows captured; cells not lensed (yet) empty."""
        req = run.requests.get(rid)
        captured = [req.hooks[h.name] for h in hooks if req is not None and h.name in req.hooks]
        n = max((int(rows.positions[-1]) + 1 for rows in captured if len(rows)), default=0)
        k = max((self.rows[(rid, h.name)].k for h in hooks if (rid, h.name) in self.rows), default=LENS_K)
        grid = LensGrid([short_hook_label(h) for h in hooks], list(req.token_texts) if req else [],
                        np.full((len(hooks), n, k), -1, np.int64), np.full((len(hooks), n, k), np.nan, np.float32),
                        np.full((len(hooks), n), -1, np.int64), np.full((len(hooks), n), np.nan, np.float32),
                        np.full((len(hooks), n), -1, np.int64), self.texts)
        for r, h in enumerate(hooks):
            lens = self.rows.get((rid, h.name))
            if lens is None:
                continue
            positions = lens.column("positions")
            keep = positions < n
            at = positions[keep]
            grid.top_ids[r, at, :lens.k] = lens.column("top_ids")[keep]
            grid.top_logprobs[r, at, :lens.k] = lens.column("top_logprobs")[keep]
            grid.chosen_ids[r, at] = lens.column("chosen_ids")[keep]
            grid.chosen_logprobs[r, at] = lens.column("chosen_logprobs")[keep]
            grid.chosen_ranks[r, at] = lens.column("chosen_ranks")[keep]
        return grid


@dataclass(frozen=True)
class LensGrid:
    """What the Lens tab draws: a row per hook (model order, top to bottom), a column per position.
    Cell (r, c) is what hook r's residual stream at position c predicts comes next."""

    labels: list[str]
    tokens: list[str]  # the request's token texts: column c's input is tokens[c], what came next tokens[c + 1]
    top_ids: np.ndarray  # [rows, columns, k] int64, best first; -1 where not lensed (yet)
    top_logprobs: np.ndarray  # [rows, columns, k] float32; NaN there
    chosen_ids: np.ndarray  # [rows, columns]: the token that came next; -1 where unknown
    chosen_logprobs: np.ndarray  # its logprob under the lens; NaN where unknown
    chosen_ranks: np.ndarray  # its rank, 0 = the top; -1 where unknown
    texts: dict[int, str]  # token id -> text

    @property
    def shape(self) -> tuple[int, int]:
        return self.chosen_ids.shape

    def token(self, token_id: int) -> str:
        """A token's text made visible; its id where the text is unknown."""
        return display_token(self.texts[token_id]) if token_id in self.texts else f"#{token_id}"

    def colour_values(self, mode: str) -> np.ndarray:
        """Per cell a value in 0..1 for the colour scale (NaN: empty): the top token's probability, the
        next token's probability, or 1 / (1 + its rank)."""
        with np.errstate(invalid="ignore", divide="ignore"):  # rank -1 (unknown): NaN, whatever 1 / 0 gave
            if mode == TOP:
                return np.exp(self.top_logprobs[:, :, 0])
            if mode == NEXT_PROB:
                return np.exp(self.chosen_logprobs)
            return np.where(self.chosen_ranks >= 0, 1.0 / (1.0 + self.chosen_ranks), np.nan).astype(np.float32)

    def cell_text(self, mode: str, r: int, c: int) -> str:
        if mode == TOP:
            top = int(self.top_ids[r, c, 0])
            return self.token(top) if top >= 0 else ""
        rank = int(self.chosen_ranks[r, c])
        if rank < 0:
            return ""
        return f"#{rank + 1}" if mode == NEXT_RANK else percent(float(np.exp(self.chosen_logprobs[r, c])))

    def top_k(self, r: int, c: int) -> list[tuple[str, float]]:
        """(text, probability) of the cell's top tokens, best first."""
        return [(self.token(int(t)), float(np.exp(lp))) for t, lp in zip(self.top_ids[r, c], self.top_logprobs[r, c])
                if t >= 0]

    def describe(self, r: int, c: int) -> str:
        """One line: where the cell is, what it predicts, how it ranks the token that came next."""
        where = f"{self.labels[r]} · position {c} {self.input(c)!r}"
        top = self.top_k(r, c)
        if not top:
            return f"{where} · not lensed yet"
        text = f"{where} · top {top[0][0]!r} p = {top[0][1]:.3f}"
        rank = int(self.chosen_ranks[r, c])
        if rank < 0:
            return f"{text} · next token unknown"
        return f"{text} · next {self.came_next(r, c)!r} p = {np.exp(self.chosen_logprobs[r, c]):.3f}, rank #{rank + 1}"

    def input(self, c: int) -> str:
        return display_token(self.tokens[c]) if c < len(self.tokens) else ""

    def came_next(self, r: int, c: int) -> str:
        """The text of the token that followed position ``c`` (the request's own, else the lens's id's)."""
        return display_token(self.tokens[c + 1]) if c + 1 < len(self.tokens) else self.token(int(self.chosen_ids[r, c]))


def percent(p: float) -> str:
    return "<1%" if p < 0.005 else f"{100 * p:.0f}%"
