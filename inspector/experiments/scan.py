"""Corpus scans: a corpus's documents run through the engine prefill-only, a batch at a time, and per
unit (an attached SAE's feature, or else one of a hook's neurons) the ``top`` strongest activations kept
with where they occurred and the tokens around them, and a histogram of every activation seen. What is
kept is units × ``top`` whatever the corpus's size, and it is all there is to resume from.

A batch is sized in prompt tokens, several engine steps' worth, so that the engine's steps stay full
(a batch's last step is its only part-filled one). Each document is taken in on a thread of its own as
soon as the engine finishes it, while the engine goes on (at the lowest scheduling priority: on a
machine whose cores the engine keeps busy, as a CPU engine does, it waits for idle moments instead of
stalling the engine's threads); candidates for the tops are merged once
there are as many as the tops hold (bounded memory), and the tokens around an activation are looked
up only for those that make a top.

With an SAE, the activations seen are each token's strongest features as the engine sends them
(``k`` per token): a feature's histogram counts the tokens where it was among them.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from inspector.core.protocol import Sampling, SessionProtocol
from inspector.core.windows import every_row

BEFORE, AFTER = 8, 3  # tokens kept around each top activation
BINS = 48  # histogram bins between the edges, plus one below and one above
# engine steps' worth of prompt tokens per batch, by default: a batch's last step is part-filled, half a
# step lost on average (8 steps a batch cost 6% of the CPU bench's throughput)
STEPS_PER_BATCH = 32
ROWS_BATCH_BYTES = 256 << 20  # a neuron scan's batch brings its rows to the host: at most this much of them
MERGE_ENTRIES = 1 << 18  # candidates for the tops held before they are merged in (or units x top, if more)


@dataclass(frozen=True)
class ScanSpec:
    hook: str  # an installed hook's name
    sae: str | None = None  # an attached SAE's name: its features are the units; None: the hook's neurons
    top: int = 20
    batch_tokens: int = 0  # prompt tokens per engine call (documents are added until it is reached); 0: automatic

    def tokens_per_batch(self, max_num_batched_tokens: int, width: int) -> int:
        """``batch_tokens``, or by default ``STEPS_PER_BATCH`` engine steps' worth (bounded, for a scan
        of neurons, by the rows it brings to the host)."""
        if self.batch_tokens:
            return self.batch_tokens
        tokens = STEPS_PER_BATCH * max_num_batched_tokens
        return tokens if self.sae else max(1, min(tokens, ROWS_BATCH_BYTES // (4 * width)))


@dataclass
class ScanState:
    """What a scan found so far, and how far it got (what a scan file holds)."""

    units: int
    top: int
    top_activations: np.ndarray = None  # [units, top] float32, strongest first; -inf: empty
    top_documents: np.ndarray = None  # [units, top] int64 (corpus index), -1: empty
    top_positions: np.ndarray = None  # [units, top] int32 (token position in its document)
    top_windows: np.ndarray = None  # [units, top, BEFORE + 1 + AFTER] int32 token ids, -1 outside the document
    histogram: np.ndarray = None  # [units, BINS + 2] int64: below the first edge, the bins, above the last
    edges: np.ndarray | None = None  # [BINS + 1], fixed by the first batch
    documents_done: int = 0
    tokens_done: int = 0
    truncated: list[int] = field(default_factory=list)  # documents cut to fit the engine's context
    _bins: list = field(default_factory=list, repr=False)  # added since the last flush: histogram cells
    _pending: list = field(default_factory=list, repr=False)  # and candidates for the tops (``_candidates``)
    _documents: list = field(default_factory=list, repr=False)  # and their documents' token ids
    _held: int = field(default=0, repr=False)  # candidates in _pending

    def __post_init__(self):
        if self.top_activations is None:
            self.top_activations = np.full((self.units, self.top), -np.inf, np.float32)
            self.top_documents = np.full((self.units, self.top), -1, np.int64)
            self.top_positions = np.zeros((self.units, self.top), np.int32)
            self.top_windows = np.full((self.units, self.top, BEFORE + 1 + AFTER), -1, np.int32)
            self.histogram = np.zeros((self.units, BINS + 2), np.int64)

    def add(self, units: np.ndarray, activations: np.ndarray, document: int, positions: np.ndarray,
            tokens: np.ndarray) -> None:
        """Activations of one document: ``units[i]`` was ``activations[i]`` at ``positions[i]`` (flat
        arrays); ``tokens`` are the document's token ids. Taken in by ``flush``."""
        units, activations = np.asarray(units, np.int64), np.asarray(activations, np.float32)
        self._count(units, activations)
        better = activations > self.top_activations[units, -1]  # only these can enter a unit's top
        self._candidates(units[better], activations[better], document, np.asarray(positions)[better], tokens)
        if self._held >= max(MERGE_ENTRIES, self.top_activations.size):
            self.flush()

    def add_rows(self, values: np.ndarray, document: int, positions: np.ndarray, tokens: np.ndarray) -> None:
        """A document's dense rows [rows, units] (a hook's neurons): every value counts in the histograms,
        each unit's ``top`` strongest rows are candidates. Taken in by ``flush``."""
        values = np.asarray(values, np.float32)
        rows, units = values.shape
        self._count(np.broadcast_to(np.arange(units), values.shape).ravel(), values.ravel())
        n = min(self.top, rows)
        best = np.argpartition(-values, n - 1, axis=0)[:n] if n < rows else np.broadcast_to(
            np.arange(rows)[:, None], (rows, units))
        chosen = values[best, np.arange(units)]
        unit_ids = np.broadcast_to(np.arange(units), best.shape)
        better = chosen > self.top_activations[unit_ids, -1]
        self._candidates(unit_ids[better], chosen[better], document, np.asarray(positions)[best[better]], tokens)
        if self._held >= max(MERGE_ENTRIES, self.top_activations.size):
            self.flush()

    def flush(self) -> None:
        """Take in what was added since the last flush: one histogram update and one merge of the
        candidates into each unit's top (a scan flushes once a batch: far fewer sorts than once a
        document)."""
        if self._bins:
            self.histogram += np.bincount(np.concatenate(self._bins), minlength=self.histogram.size).reshape(
                self.histogram.shape)
        if self._pending:
            self._merge(*(np.concatenate(column) for column in zip(*self._pending)))
        self._bins, self._pending, self._documents, self._held = [], [], [], 0

    def _count(self, units: np.ndarray, activations: np.ndarray) -> None:
        if self.edges is None:
            self.edges = histogram_edges(activations)
        self._bins.append(units * (BINS + 2) + np.searchsorted(self.edges, activations, side="right"))

    def _candidates(self, units, activations, document: int, positions, tokens) -> None:
        if len(units):
            self._pending.append((units, activations, np.full(len(units), document, np.int64),
                                  positions.astype(np.int32), np.full(len(units), len(self._documents), np.int64)))
            self._documents.append(np.asarray(tokens, np.int32))
            self._held += len(units)

    def _merge(self, units, activations, documents, positions, sources) -> None:
        """Each touched unit's top: its kept entries and the candidates (``sources``: each one's index in
        ``_documents``), strongest first; the tokens around a candidate are looked up once it is kept."""
        touched = np.unique(units)
        n, kept_before = self.top, len(touched) * self.top
        all_units = np.concatenate([np.repeat(touched, n), units])
        all_acts = np.concatenate([self.top_activations[touched].ravel(), activations])
        all_docs = np.concatenate([self.top_documents[touched].ravel(), documents])
        all_pos = np.concatenate([self.top_positions[touched].ravel(), positions])
        order = np.argsort(_strongest_first(all_units, all_acts), kind="stable")
        sorted_units = all_units[order]
        first = np.flatnonzero(np.r_[True, sorted_units[1:] != sorted_units[:-1]])
        rank = np.arange(len(order)) - np.repeat(first, np.diff(np.r_[first, len(order)]))
        keep = order[rank < n]
        old, new = keep[keep < kept_before], keep[keep >= kept_before]
        windows = np.empty((len(keep), BEFORE + 1 + AFTER), np.int32)
        windows[keep < kept_before] = self.top_windows[touched].reshape(-1, windows.shape[1])[old]
        windows[keep >= kept_before] = windows_at(self._documents, all_pos[new], sources[new - kept_before])
        rows, cols = all_units[keep], rank[rank < n]
        self.top_activations[rows, cols] = all_acts[keep]
        self.top_documents[rows, cols] = all_docs[keep]
        self.top_positions[rows, cols] = all_pos[keep]
        self.top_windows[rows, cols] = windows


def histogram_edges(first: np.ndarray) -> np.ndarray:
    """Bins over the first batch's range, widened by half on each side (nonnegative data stays so);
    later values beyond them fall in the end bins."""
    finite = first[np.isfinite(first)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = max(hi - lo, 1e-6)
    lo = 0.0 if lo >= 0 else lo - span / 2
    return np.linspace(lo, hi + span / 2, BINS + 1)


def _strongest_first(units: np.ndarray, activations: np.ndarray) -> np.ndarray:
    """One sort key: by unit, then by activation from the strongest (a float32's bits made to order as
    the numbers do, then turned around), so that one integer sort stands for a sort on two keys."""
    bits = np.ascontiguousarray(activations, np.float32).view(np.uint32)
    ordered = np.where(bits >> 31, ~bits, bits | np.uint32(1 << 31))
    return (units.astype(np.uint64) << np.uint64(32)) | (~ordered).astype(np.uint64)


def windows_at(documents: list[np.ndarray], positions: np.ndarray, which: np.ndarray) -> np.ndarray:
    """[len(positions), BEFORE + 1 + AFTER] token ids around each position (-1 outside the document):
    position ``i`` in ``documents[which[i]]``."""
    pad = [np.full(BEFORE, -1, np.int32), np.full(AFTER, -1, np.int32)]
    lengths = np.array([len(d) + BEFORE + AFTER for d in documents], np.int64)
    padded = np.concatenate([piece for d in documents for piece in (pad[0], np.asarray(d, np.int32), pad[1])])
    starts = np.cumsum(lengths) - lengths
    window = np.lib.stride_tricks.sliding_window_view(padded, BEFORE + 1 + AFTER)
    return window[starts[np.asarray(which, np.int64)] + np.asarray(positions, np.int64)]


def scan(session: SessionProtocol, documents: list[str], spec: ScanSpec, state: ScanState,
         progress: Callable[[ScanState, float], None] = lambda state, seconds: None,
         cancelled: Callable[[], bool] = lambda: False, save: Callable[[ScanState], None] = lambda state: None,
         save_every_s: float = 30.0) -> ScanState:
    """Go on from ``state.documents_done``: batches of documents (``spec.tokens_per_batch``), each
    prefilled (one token generated, nothing of it captured beyond the prompt), each document taken in
    as the engine finishes it; ``save(state)`` after a batch at most every ``save_every_s`` and at the
    end, or when ``cancelled()`` (checked between batches: the batch running then is finished and kept)."""
    options = session.options
    budget = spec.tokens_per_batch(options.max_num_batched_tokens, session.installed[spec.hook].width)
    started, saved = time.perf_counter(), time.perf_counter()
    # an SAE's features come without the hook's rows (they never leave the device)
    sampling = Sampling(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True, capture=spec.sae is None)
    following = state.documents_done  # the first document of the next batch
    taken_in: Future | None = None  # the batch before, once all of it is taken in
    # one thread: documents are taken in in order
    with every_row(session), ThreadPoolExecutor(1, thread_name_prefix="scan-take-in",
                                                initializer=_yield_to_the_engine) as taker:
        while following < len(documents) and not cancelled():
            first, batch, truncated, tokens = following, [], [], 0
            while following < len(documents) and (not batch or tokens < budget):
                text, n = _fitted(session, documents[following], options.max_model_len - 1)
                batch.append(text)
                tokens += n
                if text != documents[following]:
                    truncated.append(following)
                following += 1
            taking_in = _prefill(session, batch, sampling,
                                 lambda document, steps, tokens: taker.submit(_add_document, state, spec, steps,
                                                                              first + document, tokens))
            if taken_in is not None:
                taken_in.result()
                saved = _report(state, started, saved, save_every_s, progress, save)
            taken_in = taker.submit(_batch_done, state, taking_in, following, truncated)
        if taken_in is not None:
            taken_in.result()
            progress(state, time.perf_counter() - started)
    save(state)
    return state


def _yield_to_the_engine() -> None:
    """This thread at the lowest priority (Linux: a thread's own nice value), where that can be set."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _prefill(session: SessionProtocol, batch: list[str], sampling: Sampling,
             finished: Callable[[int, list, np.ndarray], Future]) -> list[Future]:
    """Prefill the batch; ``finished(i, steps, prompt tokens)`` as each document ``i`` of it finishes.
    Returns what those calls returned."""
    ids = session.upcoming_request_ids(len(batch))
    index = {rid: i for i, rid in enumerate(ids)}
    tokens, pieces, taking_in = {}, {rid: [] for rid in ids}, []
    session.new_run()
    for event in session.generate(batch, sampling):
        for start in event.started:
            tokens[start.request_id] = np.asarray(start.prompt_token_ids)
        for step in event.requests:
            if step.request_id in pieces:
                pieces[step.request_id].append(step)
                if step.finished:
                    rid = step.request_id
                    taking_in.append(finished(index[rid], pieces.pop(rid), tokens[rid]))
    return taking_in


def _batch_done(state: ScanState, taking_in: list[Future], done: int, truncated: list[int]) -> None:
    """After a batch's documents were taken in (queued before this on the same thread)."""
    for future in taking_in:
        future.result()  # an error taking one in, here
    state.flush()
    state.truncated += truncated
    state.documents_done = done


def _report(state: ScanState, started: float, saved: float, save_every_s: float, progress, save) -> float:
    """Progress after a batch, and a save if the last is ``save_every_s`` old; when it last saved."""
    progress(state, time.perf_counter() - started)
    if time.perf_counter() - saved < save_every_s:
        return saved
    save(state)
    return time.perf_counter()


def _add_document(state: ScanState, spec: ScanSpec, steps, document: int, tokens: np.ndarray) -> None:
    prompt = len(tokens)
    if spec.sae is None:
        parts = [s.rows[spec.hook] for s in steps if spec.hook in s.rows]
        positions = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        keep = positions < prompt
        if keep.any():
            values = np.concatenate([p[2] for p in parts])[keep]
            state.add_rows(values, document, positions[keep], tokens)
    else:
        parts = [s.features[spec.sae] for s in steps if spec.sae in s.features]
        positions = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        keep = positions < prompt
        if keep.any():
            ids, acts = np.concatenate([p[1] for p in parts])[keep], np.concatenate([p[2] for p in parts])[keep]
            active = ids >= 0
            state.add(ids[active], acts[active], document, np.broadcast_to(positions[keep][:, None], ids.shape)[active],
                      tokens)
    state.tokens_done += int(keep.sum())


def _fitted(session: SessionProtocol, text: str, limit: int) -> tuple[str, int]:
    """The document, cut to fit the engine's context, and about how many tokens it is."""
    n = len(session.tokenize(text)) + 1  # a beginning-of-text token may come first
    while n > limit:
        text = text[:max(1, int(len(text) * limit / n * 0.95))]
        n = len(session.tokenize(text)) + 1
    return text, n
