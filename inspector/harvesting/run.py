"""Driving a harvest: a corpus packed into contexts, run prefill-only through an in-process engine at
full batch, each context's rows of the chosen hooks gathered into chunks of consecutive contexts.

Three threads keep the engine busy: one tokenizes and packs the corpus ahead of the engine, the
engine's loop (``Session.prefill``) only queues what finished, and an assembler copies rows out of
the engine's host copies into the chunk's arrays and hands each complete chunk, in order, to the
sink (a shard writer, or the in-memory iterator's queue). A bounded queue between the engine and the
assembler holds the engine back when the sink is slower (a disk), so memory stays bounded."""

from __future__ import annotations

import contextlib
import math
import queue
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from inspector.core.dtypes import BFLOAT16, ROW_DTYPES, as_bits
from inspector.core.protocol import BootProgress, SessionError, SessionOptions
from inspector.core.reused_memory import mapped_empty

from .corpus import Corpus, CorpusError
from .packing import pack
from .shards import Chunk

SEPARATORS = ("bos", "eos", "none")
CHUNK_BYTES = 256 << 20  # rows a chunk (a shard on disk) holds, at most, unless one context is larger
_DONE = object()


@dataclass(frozen=True)
class HarvestSpec:
    """What to harvest: the model, the corpus, the hooks (names, aliases or globs) and how contexts are
    made (``context_size`` tokens; ``prepend_bos``, ``separator`` between documents, as SAELens)."""

    model: str
    corpus: str | Path
    hooks: tuple[str, ...]
    context_size: int = 128
    tokens: int | None = None  # stop after this many tokens' rows (whole contexts); None: the whole corpus
    prepend_bos: bool = True
    separator: str = "bos"
    exclude_special: bool = False  # drop rows of special tokens (BOS, EOS, padding)
    full_depth: bool = False  # run every block even past the deepest hooked one
    mode: str = "compiled"
    dtype: str = "float32"
    max_num_batched_tokens: int = 0  # 0: max(context size, 8192)
    chunk_bytes: int = CHUNK_BYTES
    engine_args: dict = field(default_factory=dict)

    def checked(self) -> "HarvestSpec":
        if self.context_size < 2:
            raise ValueError(f"context size must be at least 2 tokens, got {self.context_size}")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens must be positive, got {self.tokens}")
        if self.separator not in SEPARATORS:
            raise ValueError(f"separator must be one of {SEPARATORS}, got {self.separator!r}")
        if not self.hooks:
            raise ValueError("no hooks to harvest: name at least one (a name, alias or glob)")
        if self.chunk_bytes < 0:
            raise ValueError(f"a shard's size cannot be negative (--shard-mb; 0: a context a shard), got "
                             f"{self.chunk_bytes} bytes")
        return self

    def kept_layers(self) -> int:
        """The blocks the engine needs: up to the deepest block a hook pattern names, and at least one
        for each pipeline stage (vLLM gives each stage some) (0: all of them, when a pattern names no
        block, or a glob could reach any)."""
        if self.full_depth:
            return 0
        deepest = []
        for pattern in self.hooks:
            found = re.fullmatch(r"blocks\.(\d+)\.[^*?\[]+", pattern)
            if found:
                deepest.append(int(found.group(1)))
            elif pattern in ("hook_embed", "hook_pos_embed"):
                deepest.append(0)
            else:
                return 0
        return max(max(deepest) + 1, int(self.engine_args.get("pipeline_parallel_size", 1)))

    def settings(self, corpus: Corpus, layout: str) -> dict:
        """What a harvest's rows depend on (a resumed harvest must match them)."""
        return {"model": self.model, "corpus": str(Path(corpus.path).resolve()), "corpus_sha256": corpus.sha256,
                "hooks": list(self.hooks), "context_size": self.context_size, "tokens": self.tokens,
                "prepend_bos": self.prepend_bos, "separator": self.separator, "exclude_special": self.exclude_special,
                "dtype": self.dtype, "layout": layout}


class Engine:
    """The harvest's engine: a session with the hooks installed, cut after the deepest of them."""

    def __init__(self, spec: HarvestSpec, progress: Callable[[BootProgress], None] | None = None,
                 corpus: Corpus | None = None):
        """``corpus``: checked before the boot to fill at least one context."""
        from transformers import AutoTokenizer

        from inspector.core.models import resolve_model
        from inspector.engine.boot import layer_overrides
        from inspector.engine.opening import context_limit
        from inspector.engine.session import Session

        self.spec = spec.checked()
        path = resolve_model(spec.model)
        longest = context_limit(path)  # refused before a boot, not by the engine after it
        if longest is not None and spec.context_size >= longest:
            raise ValueError(f"contexts of {spec.context_size} tokens are longer than {spec.model} reads: at most "
                             f"{longest - 1} (a context and the one token a prefill samples)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        if corpus is not None:
            self._refuse_a_corpus_short_of_a_context(corpus)
        batched = spec.max_num_batched_tokens or max(spec.context_size, 8192)
        options = SessionOptions(model=spec.model, mode=spec.mode, hooks=tuple(spec.hooks), dtype=spec.dtype,
                                 max_model_len=spec.context_size + 1, max_num_batched_tokens=batched,
                                 enable_position_interventions=False, retain_rows=False,
                                 kept_layers=spec.kept_layers(), engine_args=dict(spec.engine_args))
        try:
            self.session = Session.open(options, progress)
        except SessionError as e:
            cut = False
            with contextlib.suppress(ValueError):  # a config without a layer count: the boot said so itself
                cut = bool(options.kept_layers and layer_overrides(path, options.kept_layers))
            if not cut:  # the model has no blocks past the deepest hooked one: not the cut's doing
                raise
            raise SessionError(f"{e} (the engine was cut after block {options.kept_layers - 1}, the deepest one "
                               "hooked; where a model cannot be cut there, harvest with --full-depth, or "
                               "full_depth=True)") from e
        try:
            self.hooks = {name: point.alias or name for name, point in self.session.installed.items()}
            if not self.hooks:
                raise ValueError(f"no hook point of this model matches {', '.join(spec.hooks)}")
            self.widths = {self.hooks[name]: point.width for name, point in self.session.installed.items()}
            self.row_dtype = ROW_DTYPES[spec.dtype]
            special = self.tokenizer.all_special_ids if spec.exclude_special else []
            self.special = np.asarray(sorted(set(special)), dtype=np.int64)
        except Exception:
            self.session.close()
            raise

    def close(self) -> None:
        self.session.close()

    def _refuse_a_corpus_short_of_a_context(self, corpus: Corpus) -> None:
        """A corpus too short for one context would boot an engine to harvest nothing."""
        if next(self.contexts(corpus, 0), None) is None:
            count = sum(len(ids) for ids in _token_ids(self.tokenizer, corpus.texts()))
            raise CorpusError(f"{corpus.path}: its {corpus.documents} document(s) hold {count} tokens, too few to fill "
                              f"one context of {self.spec.context_size}: nothing to harvest (a smaller --context-size, "
                              "or a longer corpus)")

    def boundary_tokens(self) -> tuple[int | None, int | None]:
        """The token each context starts with and the one between documents (None: none)."""
        t = self.tokenizer
        bos = t.bos_token_id if self.spec.prepend_bos else None
        separator = {"bos": t.bos_token_id, "eos": t.eos_token_id, "none": None}[self.spec.separator]
        return bos, separator

    def contexts(self, corpus: Corpus, skip: int) -> Iterator[np.ndarray]:
        """The corpus packed into contexts, after the first ``skip``, up to the tokens asked for."""
        limit = math.ceil(self.spec.tokens / self.spec.context_size) if self.spec.tokens else None
        bos, separator = self.boundary_tokens()
        packed = pack(_token_ids(self.tokenizer, corpus.texts()), self.spec.context_size, bos, separator)
        for number, context in enumerate(packed):
            if limit is not None and number >= limit:
                return
            if number >= skip:
                yield context

    def chunk_contexts(self) -> int:
        """Contexts a chunk holds: ``chunk_bytes`` of rows, at least one context."""
        row_bytes = sum(self.widths.values()) * self.row_dtype.itemsize
        return max(1, self.spec.chunk_bytes // (row_bytes * self.spec.context_size))

    def run(self, contexts: Iterator[np.ndarray], first: int, sink: Callable[[Chunk], None],
            stop: threading.Event, keeps_chunks: bool = True) -> bool:
        """Prefill ``contexts`` (the first is context number ``first``), handing each complete chunk to
        ``sink`` in order (on the assembler's thread). True when the contexts ran out, False when
        ``stop`` was set (the chunk under way is dropped). Errors of the sink come out here. A sink that
        does not keep the chunks it is given (``keeps_chunks=False``: it writes them) gets its arrays
        back for later chunks: fresh pages cost more than the copy into them."""
        size = self.chunk_contexts()
        assembler = _Assembler(self, first, size, sink, reuse=not keeps_chunks)
        ahead = _Prefetched(contexts, depth=4 * size + 64)
        given: dict[int, np.ndarray] = {}

        def numbered():
            for index, context in enumerate(ahead):
                given[index] = context
                yield context

        worker = threading.Thread(target=assembler.loop, name="harvest-assembler", daemon=True)
        worker.start()
        finished = False
        prefilled = self.session.prefill(numbered())
        try:
            for item in prefilled:
                if stop.is_set() or assembler.failed.is_set():
                    break
                assembler.put((item, given.pop(item.index)))
            else:
                finished = True
        finally:
            prefilled.close()  # requests still in the engine are aborted
            ahead.close()
            assembler.put(_DONE if finished else None)
            worker.join()
        assembler.raise_failure()
        ahead.raise_failure()
        return finished


class _Assembler:
    """Copies each prefilled context's rows into its chunk's arrays; hands complete chunks on in order."""

    def __init__(self, engine: Engine, first: int, size: int, sink: Callable[[Chunk], None], reuse: bool):
        self.engine, self.first, self.size = engine, first, size
        self.spare: list[dict] = []  # arrays of chunks the sink is done with, for later ones (``reuse``)
        self.queue: queue.Queue = queue.Queue(maxsize=2 * size + 8)
        self.failed = threading.Event()
        self.error: BaseException | None = None
        self.chunks: dict[int, dict] = {}  # chunk number -> arrays being filled, contexts in
        self.next_chunk = 0
        # the sink on a thread of its own: a chunk is written while the next one is filled
        self.out = _SinkThread(sink, self.spare if reuse else None, self.failed)

    def put(self, item) -> None:
        put_unless(self.queue, item, self.failed)

    def loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if item is _DONE:
                    self._flush_last()
                    break
                self._place(*item)
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread
            self.error = e
            self.failed.set()
        finally:
            self.out.close()  # the chunks handed on are all through the sink

    def raise_failure(self) -> None:
        if self.error is not None:
            raise self.error
        if self.out.error is not None:
            raise self.out.error

    def _place(self, item, ids: np.ndarray) -> None:
        number, slot = divmod(item.index, self.size)
        chunk = self.chunks.get(number) or self._new_chunk(number)
        length = self.engine.spec.context_size
        start = slot * length
        for rows in item.parts:
            for name, r in rows.items():
                hook = self.engine.hooks.get(name)
                if hook is not None:
                    _copy_rows(chunk["activations"][hook], start, r["positions"], r["values"])
        chunk["token_ids"][start:start + length] = ids
        chunk["in"] += 1
        while self.next_chunk in self.chunks and self.chunks[self.next_chunk]["in"] == self.chunks[self.next_chunk]["of"]:
            self._hand_on(self.chunks.pop(self.next_chunk), self.size)
            self.next_chunk += 1

    def _new_chunk(self, number: int) -> dict:
        rows = self.size * self.engine.spec.context_size
        arrays = self.spare.pop() if self.spare else {
            "activations": {hook: _host_rows(rows, width, self.engine.row_dtype) for hook, width in self.engine.widths.items()},
            "token_ids": np.empty(rows, np.int64)}
        chunk = {**arrays, "in": 0, "of": self.size, "number": number}
        self.chunks[number] = chunk
        return chunk

    def _flush_last(self) -> None:
        """The contexts ran out: the last chunk is complete with the contexts it has."""
        for number in sorted(self.chunks):
            chunk = self.chunks.pop(number)
            if number != self.next_chunk:
                raise RuntimeError(f"harvest chunk {number} is missing contexts")
            self._hand_on(chunk, chunk["in"])
            self.next_chunk += 1

    def _hand_on(self, chunk: dict, contexts: int) -> None:
        length = self.engine.spec.context_size
        rows = contexts * length
        sequence = self.first + chunk["number"] * self.size + np.repeat(np.arange(contexts), length)
        position = np.tile(np.arange(length), contexts)
        token_ids = chunk["token_ids"][:rows]
        keep = ~np.isin(token_ids, self.engine.special) if len(self.engine.special) else slice(None)
        self.out.put(Chunk({hook: values[:rows][keep] for hook, values in chunk["activations"].items()},
                           token_ids[keep], sequence[keep], position[keep],
                           (self.first + chunk["number"] * self.size, contexts)),
                     {"activations": chunk["activations"], "token_ids": chunk["token_ids"]})


class _SinkThread:
    """Calls the sink with each chunk on a thread of its own, one chunk waiting at most; gives a chunk's
    arrays to ``spare`` once the sink is done with them (where the sink keeps none)."""

    def __init__(self, sink: Callable[[Chunk], None], spare: list | None, failed: threading.Event):
        self.sink, self.spare, self.failed = sink, spare, failed
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="harvest-sink", daemon=True)
        self.thread.start()

    def put(self, chunk: Chunk, arrays: dict) -> None:
        if not put_unless(self.queue, (chunk, arrays), self.failed):
            raise RuntimeError("the harvest's sink failed")

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # drained, not written: the harvest is failing
            chunk, arrays = item
            try:
                self.sink(chunk)
            except BaseException as e:  # noqa: BLE001 - raised again on the engine's thread
                self.error = e
                self.failed.set()
                continue
            if self.spare is not None:
                self.spare.append(arrays)


def put_unless(into: queue.Queue, item, given_up: threading.Event) -> bool:
    """Put ``item`` into a bounded queue, waiting for room unless ``given_up`` is set meanwhile (then
    False): a thread handing work on must not wait for a consumer that has stopped."""
    while True:
        try:
            into.put(item, timeout=0.5)
            return True
        except queue.Full:
            if given_up.is_set():
                return False


def _host_rows(rows: int, width: int, dtype: np.dtype) -> np.ndarray:
    """Memory for a chunk's rows of a hook, page-aligned (a shard's rows go to the disk past the page
    cache). Where there is a GPU, pinned memory from torch's caching host allocator: the blocks of
    chunks their consumer let go of come back already mapped (fresh pages for every chunk held a 4-hook
    harvest on the H200 to 0.7-0.8x of vanilla), and a consumer's copy to the GPU is direct."""
    import torch

    if not torch.cuda.is_available():
        return mapped_empty((rows, width), dtype)
    kind = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16, BFLOAT16: torch.bfloat16}[dtype]
    block = torch.empty((rows, width), dtype=kind, pin_memory=True)
    return block.view(torch.int16).numpy().view(BFLOAT16) if kind == torch.bfloat16 else block.numpy()


def _copy_rows(into: np.ndarray, start: int, positions: np.ndarray, values: np.ndarray) -> None:
    """``into[start + positions] = values``, as one block copy where the positions run on (as a
    prefill's do), and as integers for bfloat16 rows (ml_dtypes' type would hold the GIL while it
    copies, which the engine's thread needs)."""
    into, values = as_bits(into), as_bits(values)
    if len(positions) and positions[-1] - positions[0] + 1 == len(positions):
        into[start + positions[0]:start + positions[-1] + 1] = values
    else:
        into[start + positions] = values


class _Prefetched:
    """An iterator run ahead on a thread of its own (tokenizing and packing while the engine runs)."""

    def __init__(self, source: Iterable, depth: int):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.closed = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fill, args=(iter(source),), name="harvest-tokenizer", daemon=True)
        self.thread.start()

    def _fill(self, source) -> None:
        try:
            for item in source:
                if not put_unless(self.queue, item, self.closed) or self.closed.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 - raised again on the engine's thread
            self.error = e
        finally:
            self.queue.put(_DONE)

    def __iter__(self):
        while (item := self.queue.get()) is not _DONE:
            yield item
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed.set()
        while self.thread.is_alive():
            try:
                self.queue.get(timeout=0.1)
            except queue.Empty:
                pass


def _token_ids(tokenizer, texts: Iterable[str], batch: int = 256) -> Iterator[list[int]]:
    """Each document's token ids, without special tokens (tokenized a batch at a time: the tokenizer
    works on several cores then)."""
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            yield from tokenizer(pending, add_special_tokens=False)["input_ids"]
            pending = []
    if pending:
        yield from tokenizer(pending, add_special_tokens=False)["input_ids"]
