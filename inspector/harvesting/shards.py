"""A harvest on disk: shards and the manifest that lists them.

Layouts: ``safetensors`` (one file a shard: each hook's rows [n, width] in the model's dtype, and
``token_ids``, ``sequence`` (the context's index in the harvest), ``position`` [n]); ``saelens``
(the directory is a Hugging Face ``datasets`` dataset, one Arrow file a shard, with a column per hook
of [context, width] per context and ``token_ids``: what SAELens's ``cached_activations_path`` reads).
A shard is written under a temporary name, synced and renamed, then the manifest (``harvest.json``)
is rewritten the same way: the manifest lists only complete shards, and a harvest killed at any moment
resumes after the last one it lists (a shard file it does not list is written again). The syncing,
renaming and listing run on a committer thread while the next shard is written: done in line they
left the disk idle after every shard."""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inspector.core import writeback
from inspector.core.dtypes import BFLOAT16

MANIFEST = "harvest.json"
FORMAT = "inspector-harvest/1"
LAYOUTS = ("safetensors", "saelens")


@dataclass
class Chunk:
    """Consecutive contexts' rows: hook → [rows, width] (the engine's dtype), and per row its token id,
    context (``sequence``) and position in it."""

    activations: dict[str, np.ndarray]
    token_ids: np.ndarray
    sequence: np.ndarray
    position: np.ndarray
    contexts: tuple[int, int]  # first context, how many

    @property
    def rows(self) -> int:
        return len(self.token_ids)


@dataclass
class NormEstimate:
    """Per hook, the mean L2 norm of its rows so far: SAELens's scaling factor is sqrt(width) / that.
    Every ``SAMPLE``-th row is measured (SAELens estimates from a sample too): measuring every row of
    a bfloat16 harvest cost more than writing it."""

    SAMPLE = 8
    sums: dict[str, float] = field(default_factory=dict)
    rows: int = 0

    def add(self, chunk: Chunk) -> None:
        import torch

        for hook, values in chunk.activations.items():
            norms = torch.linalg.vector_norm(as_torch(values[::self.SAMPLE]), dim=1, dtype=torch.float32)
            self.sums[hook] = self.sums.get(hook, 0.0) + float(norms.double().sum())
        self.rows += len(range(0, chunk.rows, self.SAMPLE))

    def factors(self, widths: dict[str, int]) -> dict[str, float]:
        return {hook: math.sqrt(widths[hook]) * self.rows / total for hook, total in self.sums.items() if total > 0}


def earlier_manifest(out: Path, settings: dict) -> dict | None:
    """The manifest of the harvest in ``out`` to resume, None where ``out`` is new or empty. ValueError
    where it holds anything else, or a harvest of other settings (the tokens asked for aside: a
    harvest can be taken further)."""
    path = out / MANIFEST
    if path.exists():
        manifest = json.loads(path.read_text())
        earlier = manifest.get("settings", {})
        differs = sorted(k for k in settings if k != "tokens" and earlier.get(k) != settings[k])
        if manifest.get("format") != FORMAT or differs:
            raise ValueError(f"{out} holds a harvest of other settings ({', '.join(differs) or 'format'} differ): "
                             "give another --out, or remove it to start again")
        return manifest
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory (nor a harvest to resume)")
    return None


class HarvestDirectory:
    """The output directory of a harvest: ``open`` checks (or starts) it, ``write`` adds a shard (listed
    once the committer has made it durable), ``settle`` waits until every shard written is listed."""

    def __init__(self, out: Path, manifest: dict):
        self.out, self.manifest = out, manifest
        self._written = [s["file"] for s in manifest["shards"]]  # listed, or on their way to the committer
        self._next_context = manifest["contexts_done"]
        self._committer = _Committer(self._commit, self._drop)

    @classmethod
    def open(cls, out, settings: dict, widths: dict[str, int], extra: dict) -> "HarvestDirectory":
        """Resume the harvest in ``out`` if it was started with the same ``settings``; start one in an
        empty or new directory. ValueError for a directory holding something else."""
        out = Path(out)
        if settings["layout"] not in LAYOUTS:
            raise ValueError(f"format must be one of {LAYOUTS}, got {settings['layout']!r}")
        manifest = earlier_manifest(out, settings)
        if manifest is not None:
            manifest["settings"]["tokens"] = settings["tokens"]
            return cls(out, manifest)
        out.mkdir(parents=True, exist_ok=True)
        manifest = {"format": FORMAT, "settings": settings, "hooks": {h: {"width": w} for h, w in widths.items()},
                    **extra, "shards": [], "contexts_done": 0, "rows": 0, "norm": {"sums": {}, "rows": 0},
                    "norm_scaling_factors": {}, "complete": False}
        directory = cls(out, manifest)
        directory._save_manifest()
        return directory

    @property
    def contexts_done(self) -> int:
        return self.manifest["contexts_done"]

    @property
    def rows(self) -> int:
        return self.manifest["rows"]

    def norm(self) -> NormEstimate:
        return NormEstimate(dict(self.manifest["norm"]["sums"]), self.manifest["norm"]["rows"])

    def write(self, chunk: Chunk, norm: NormEstimate) -> None:
        """Write ``chunk`` as the next shard; the committer lists it (a failure there is raised by a
        later ``write`` or by ``settle``). ``norm``: the estimate with this chunk's rows in it."""
        number = len(self._written)
        first, count = chunk.contexts
        if first != self._next_context:
            raise RuntimeError(f"shard {number} starts at context {first}, after {self._next_context}")
        self._committer.raise_failure()  # before writing a shard that could not be listed
        try:
            if self.manifest["settings"]["layout"] == "saelens":
                name, scratch = self._write_arrow(number, chunk), None
            else:
                name = f"shard-{number:05d}.safetensors"
                scratch = self._write_safetensors(self.out / name, chunk)
        except OSError as e:
            raise self._failed(e) from e
        self._written.append(name)
        self._next_context = first + count
        item = (scratch, {"file": name, "rows": chunk.rows, "contexts": [first, count]},
                {"sums": dict(norm.sums), "rows": norm.rows})
        try:
            self._committer.put(item)
        except BaseException:
            self._drop(*item)  # an earlier shard failed to commit: this one is not listed either
            raise

    def settle(self) -> None:
        """Wait until every shard written is durable and listed; raise what failed on the way."""
        self._committer.drain()

    def _commit(self, scratch: Path | None, entry: dict, norm: dict) -> None:
        """On the committer's thread: the shard synced and given its name, then listed."""
        try:
            if scratch is not None:
                _sync(scratch)
                os.replace(scratch, self.out / entry["file"])
            self._list(entry, norm)
        except OSError as e:
            if scratch is not None:
                scratch.unlink(missing_ok=True)
            raise self._failed(e) from e

    @staticmethod
    def _drop(scratch: Path | None, entry: dict, norm: dict) -> None:
        """A shard written after one that failed to commit: not listed, its room given back."""
        if scratch is not None:
            scratch.unlink(missing_ok=True)

    def _failed(self, e: OSError) -> OSError:
        """A disk's failure, said with what it leaves: the shards listed are whole, the harvest resumes."""
        return OSError(e.errno, f"{e.strerror or e} while writing the harvest in {self.out}; the shards "
                                f"{MANIFEST} lists are complete: make room (or mend the disk) and run the same "
                                "command to resume")

    def _list(self, entry: dict, norm: dict) -> None:
        first, count = entry["contexts"]
        self.manifest["shards"].append(entry)
        self.manifest["contexts_done"] = first + count
        self.manifest["rows"] += entry["rows"]
        self.manifest["norm"] = norm
        self.manifest["norm_scaling_factors"] = NormEstimate(norm["sums"], norm["rows"]).factors(
            {h: v["width"] for h, v in self.manifest["hooks"].items()})
        self._save_manifest()

    def finish(self, complete: bool, why: str) -> None:
        self.settle()
        self.manifest["complete"], self.manifest["stopped_because"] = complete, why
        self._save_manifest()

    def _save_manifest(self) -> None:
        _replace_atomically(self.out / MANIFEST, json.dumps(self.manifest, indent=1).encode())

    def _write_safetensors(self, path: Path, chunk: Chunk) -> Path:
        """The shard under its temporary name, not yet synced (the committer syncs and renames it)."""
        arrays = {"token_ids": chunk.token_ids.astype(np.int64), "sequence": chunk.sequence.astype(np.int64),
                  "position": chunk.position.astype(np.int64), **chunk.activations}
        scratch = path.with_name(f".{path.name}.partial")
        try:
            write_safetensors(scratch, arrays, {"format": FORMAT}, sync=False)
        except BaseException:
            scratch.unlink(missing_ok=True)  # the room it took is the disk's again
            raise
        return scratch

    def _write_arrow(self, number: int, chunk: Chunk) -> str:
        """The shard as one more Arrow file of the dataset in ``out``, and the dataset's state listing
        the shards written so far (so the directory loads after every shard)."""
        import datasets

        context = self.manifest["settings"]["context_size"]
        first, count = chunk.contexts
        stored = self.manifest["stored_dtype"]
        hooks = list(chunk.activations)
        features = datasets.Features({**{h: datasets.Array2D((context, self.manifest["hooks"][h]["width"]), stored)
                                         for h in hooks},
                                      "token_ids": datasets.Sequence(datasets.Value("int32"), length=context)})
        columns = {h: v.astype(stored).reshape(count, context, -1) for h, v in chunk.activations.items()}
        columns["token_ids"] = chunk.token_ids.astype(np.int32).reshape(count, context)
        name = f"data-{number:05d}.arrow"
        with tempfile.TemporaryDirectory(dir=self.out, prefix=".shard-") as scratch:
            datasets.Dataset.from_dict(columns, features=features).save_to_disk(scratch, num_shards=1)
            state = json.loads((Path(scratch) / "state.json").read_text())
            written = Path(scratch) / state["_data_files"][0]["filename"]
            os.replace(written, self.out / name)
            shutil.copyfile(Path(scratch) / "dataset_info.json", Path(scratch) / "info")
            os.replace(Path(scratch) / "info", self.out / "dataset_info.json")
        files = [{"filename": f} for f in self._written] + [{"filename": name}]
        state = {"_data_files": files, "_fingerprint": f"inspector-harvest-{number:05d}", "_format_columns": None,
                 "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
        _replace_atomically(self.out / "state.json", json.dumps(state, indent=1).encode())
        return name


SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "bool": "BOOL"}


def write_safetensors(path: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str], sync: bool = True) -> None:
    """``arrays`` as a safetensors file (synced unless ``sync`` is False): written a piece at a time with
    the kernel asked to write each out at once (``core.writeback``), so that the disk works while the
    shard is still being written, where ``safetensors.save_file`` left it all in memory for the
    ``fsync`` (the disk idle meanwhile). Arrays in the order given, each starting on an 8-byte
    boundary where those before it end on one (put the int64 ones first). The header is padded so that
    the largest array starts on a page: its whole pages (and those of the arrays after it, where they
    are whole pages too) go to the disk past the page cache where their memory is page-aligned."""
    contiguous = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    header, at = {"__metadata__": metadata}, 0
    for name, a in contiguous.items():
        header[name] = {"dtype": SAFETENSORS_DTYPES[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    largest = max(contiguous, key=lambda name: contiguous[name].nbytes, default=None)
    before = header[largest]["data_offsets"][0] if largest else 0
    # the data starts 8-byte aligned, as safetensors pads it; the largest array on a page where that keeps it so
    text += b" " * (-(8 + len(text) + before) % writeback.ALIGN if before % 8 == 0 else -(8 + len(text)) % 8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    direct = writeback.open_direct(path)
    try:
        pos = 0
        pieces = [len(text).to_bytes(8, "little") + text, *(a.reshape(-1).view(np.uint8) for a in contiguous.values())]
        for piece in pieces:
            data = memoryview(piece)
            for start in range(0, len(data), writeback.EVERY):
                if writeback.write_range(fd, data[start:start + writeback.EVERY], pos + start, direct):
                    writeback.start_writeback(fd)
            pos += len(data)
        if sync:
            os.fsync(fd)
    finally:
        if direct is not None:
            os.close(direct)
        os.close(fd)


class _Committer:
    """Runs ``commit(*item)`` for each item put, in order, on a thread of its own; one item waits at most
    (the writer is held back while two shards are unsynced). After a failure each item left goes to
    ``drop(*item)`` instead, and ``put`` and ``drain`` raise the failure."""

    def __init__(self, commit, drop):
        self.commit, self.drop = commit, drop
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def put(self, item: tuple) -> None:
        self.raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="harvest-committer", daemon=True)
            self._thread.start()
        self.queue.put(item)

    def drain(self) -> None:
        """Return once the items put so far are committed; the thread ends (a later ``put`` starts one)."""
        if self._thread is not None:
            self.queue.put(None)
            self._thread.join()
            self._thread = None
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                (self.commit if self.error is None else self.drop)(*item)
            except BaseException as e:  # noqa: BLE001 - raised again by the writer's next call
                self.error = self.error or e


def as_torch(values: np.ndarray):
    """A torch tensor of the rows (numpy's bfloat16 is ml_dtypes', which torch reads as its bits)."""
    import torch

    if values.dtype == BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(values))


def _sync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_atomically(path: Path, data: bytes) -> None:
    scratch = path.with_name(f".{path.name}.partial")
    with scratch.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(scratch, path)
