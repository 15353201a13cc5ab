"""A harvest's two destinations: shards on disk (``harvest_to_disk``, resumable) and shuffled batches
in memory (``harvest``, the way SAELens's ``ActivationsStore`` feeds its trainer)."""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from inspector import __version__
from inspector.core.dtypes import BFLOAT16
from inspector.core.protocol import BootProgress

from .corpus import Corpus
from .mixing import check_mixing, mixed_batches
from .run import Engine, HarvestSpec, put_unless
from .shards import LAYOUTS, Chunk, HarvestDirectory, NormEstimate, as_torch, earlier_manifest


@dataclass(frozen=True)
class HarvestProgress:
    rows: int  # rows delivered so far (this run and the runs it resumes)
    total: int | None  # rows asked for (None: the whole corpus, size unknown until packed)
    seconds: float  # this run's
    rows_this_run: int


def harvest_to_disk(spec: HarvestSpec, out, layout: str = "safetensors",
                    boot: Callable[[BootProgress], None] | None = None,
                    progress: Callable[[HarvestProgress], None] | None = None,
                    stop: threading.Event | None = None) -> dict:
    """Harvest into directory ``out`` (resuming what a harvest of the same settings left there) and
    return its manifest. ``stop`` set: the chunk under way is dropped, the shards written stay."""
    spec = spec.checked()
    if layout not in LAYOUTS:
        raise ValueError(f"format must be one of {LAYOUTS}, got {layout!r}")
    if layout == "saelens" and spec.exclude_special:
        raise ValueError("the saelens format keeps whole contexts (SAELens's exclude_special_tokens drops special "
                         "tokens' rows when it trains): leave out --exclude-special")
    corpus = Corpus.open(spec.corpus)
    settings = spec.settings(corpus, layout)
    earlier = earlier_manifest(Path(out), settings)  # refused before the engine boots
    if earlier is not None and _nothing_left(earlier, spec):
        return earlier
    engine = Engine(spec, boot, corpus)
    try:
        stored = "float32" if layout == "saelens" and engine.row_dtype == BFLOAT16 else np.dtype(engine.row_dtype).name
        directory = HarvestDirectory.open(out, settings, engine.widths, _description(engine, corpus, stored))
        if directory.contexts_done and boot:
            boot(BootProgress("ready", f"resuming {out} after {directory.contexts_done} contexts "
                                          f"({len(directory.manifest['shards'])} shards)"))
        norm, started, first_rows = directory.norm(), time.perf_counter(), directory.rows
        total = math.ceil(spec.tokens / spec.context_size) * spec.context_size if spec.tokens else None  # whole contexts
        written = first_rows

        def write(chunk: Chunk) -> None:
            nonlocal written
            norm.add(chunk)
            directory.write(chunk, norm)
            written += chunk.rows
            if progress:
                progress(HarvestProgress(written, total, time.perf_counter() - started, written - first_rows))

        skip = directory.contexts_done
        try:
            finished = engine.run(engine.contexts(corpus, skip), skip, write, stop or threading.Event(),
                                  keeps_chunks=False)
        finally:
            directory.settle()  # every shard written is listed, however the run ended
        if finished:
            asked = spec.tokens is None or directory.contexts_done * spec.context_size >= spec.tokens
            why = "done" if asked else f"the corpus ran out after {directory.contexts_done} contexts"
        else:
            why = "stopped"
        directory.finish(finished, why)
        return directory.manifest
    finally:
        engine.close()


def _nothing_left(manifest: dict, spec: HarvestSpec) -> bool:
    """A finished harvest that this one would not take further (more tokens asked of a corpus not
    used up take it further)."""
    if not manifest["complete"]:
        return False
    if manifest["stopped_because"] != "done" or manifest["settings"]["tokens"] is None:
        return True  # the corpus is used up
    return spec.tokens is not None and manifest["contexts_done"] * spec.context_size >= spec.tokens


def _description(engine: Engine, corpus: Corpus, stored: str) -> dict:
    import torch
    import vllm

    bos, separator = engine.boundary_tokens()
    return {"model_path": str(engine.session.model_path), "stored_dtype": stored,
            "hook_names": {alias: name for name, alias in engine.hooks.items()},
            "kept_layers": engine.session.options.kept_layers, "corpus_documents": corpus.documents,
            "bos_token_id": bos, "separator_token_id": separator,
            "excluded_token_ids": engine.special.tolist(), "inspector_version": __version__,
            "vllm_version": str(vllm.__version__), "torch_version": str(torch.__version__),
            "engine_mode": engine.spec.mode}


class Harvest:
    """Shuffled batches of activations, made while you iterate: each a dict hook → [batch_size, width]
    tensor on ``device`` in the model's dtype (rows of one batch are the same tokens' for every hook).
    ``for_saelens(hook)`` is the same stream as SAELens's trainer takes it (one tensor a batch). Close
    it (or use ``with``) to free the engine."""

    def __init__(self, spec: HarvestSpec, batch_size: int = 4096, buffer_rows: int | None = None,
                 mix_fraction: float = 0.5, device="cpu", seed: int = 0,
                 boot: Callable[[BootProgress], None] | None = None, engine: Engine | None = None):
        """``engine``: one booted already for ``spec`` (benchmarks run several harvests on one); it is
        left open on ``close``."""
        self.spec = spec.checked()
        self.batch_size, self.buffer_rows = batch_size, buffer_rows or 16 * batch_size
        self.mix_fraction, self.device, self.seed = mix_fraction, device, seed
        check_mixing(batch_size, self.buffer_rows, mix_fraction)  # before the boot
        self.corpus = Corpus.open(spec.corpus)
        self._owns_engine = engine is None
        self.engine = engine or Engine(spec, boot, self.corpus)
        self.norm = NormEstimate()
        self._chunks: queue.Queue = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def hooks(self) -> list[str]:
        return list(self.engine.widths)

    @property
    def norm_scaling_factors(self) -> dict[str, float]:
        """Per hook, sqrt(width) / the mean L2 norm of the rows delivered so far (SAELens's estimate)."""
        return self.norm.factors(self.engine.widths)

    def __iter__(self) -> Iterator[dict]:
        if self._thread is not None:
            raise RuntimeError("a harvest is iterated once; start another for a second pass")
        self._thread = threading.Thread(target=self._produce, name="harvest-engine", daemon=True)
        self._thread.start()
        return mixed_batches(self._tensors(), self.batch_size, self.buffer_rows, self.mix_fraction, self.seed)

    def for_saelens(self, hook: str) -> Iterator:
        """One hook's batches, as SAELens's ``SAETrainer`` takes its ``data_provider``."""
        if hook not in self.engine.widths:
            raise ValueError(f"{hook} is not harvested here; the hooks are {', '.join(self.engine.widths)}")
        return (batch[hook] for batch in self)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            while self._thread.is_alive():
                try:
                    self._chunks.get(timeout=0.1)
                except queue.Empty:
                    pass
        if self._owns_engine:
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _produce(self) -> None:
        try:
            self.engine.run(self.engine.contexts(self.corpus, 0), 0, self._hand_on, self._stop)
        except BaseException as e:  # noqa: BLE001 - raised again in the consumer's thread
            self._error = e
        finally:
            self._put(None)

    def _hand_on(self, chunk: Chunk) -> None:
        self.norm.add(chunk)
        self._put(chunk)

    def _put(self, item) -> None:
        put_unless(self._chunks, item, self._stop)

    def _tensors(self) -> Iterator[dict]:
        while (chunk := self._chunks.get()) is not None:
            yield {hook: as_torch(values).to(self.device) for hook, values in chunk.activations.items()}
        if self._error is not None:
            raise self._error


def harvest(model: str, corpus, hooks, context_size: int = 128, tokens: int | None = None, *,
            batch_size: int = 4096, buffer_rows: int | None = None, mix_fraction: float = 0.5, device="cpu",
            seed: int = 0, **options) -> Harvest:
    """An in-memory harvest (see ``Harvest``); ``options``: the rest of ``HarvestSpec``'s fields."""
    spec = HarvestSpec(model, corpus, (hooks,) if isinstance(hooks, str) else tuple(hooks), context_size, tokens,
                       **options)
    return Harvest(spec, batch_size, buffer_rows, mix_fraction, device, seed)
