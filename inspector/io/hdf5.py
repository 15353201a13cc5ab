"""Capture files: one HDF5 file per Run, written streaming or at once, read back lazily or in memory.

The layout is documented in ``docs/capture-format.md`` (format ``activation-inspector-capture``,
version ``FORMAT_VERSION``); any HDF5 tool (h5py, h5dump, HDFView) can read it without this code.

API
---
``CaptureFileError(OSError)``
    Every file-level failure (cannot create, disk full, not an HDF5 file, foreign file, newer format,
    truncated/damaged file). ``str()`` names the path and the reason; ``.path`` and ``.reason`` hold
    them. Wrong *arguments* (unknown request, rows of the wrong width, ...) raise ``ValueError``.

``CaptureWriter(path, metadata, hooks, *, compression=None, fsync=True, buffer_bytes=128 MiB)``
    Streaming writer. ``add_request(req)``, ``append_rows(request_id, hook, positions, token_ids,
    values)``, ``update_request(req)`` (tokens, texts, logprobs, interventions, finish reason; may be
    called any number of times, the last call wins), ``close() -> Path``, ``abort()``. Use it as a
    context manager: leaving the block normally closes, an exception inside aborts.
    It writes a hidden temp file (``.<name>.<random>.partial``) beside ``path`` and renames it onto
    ``path`` (atomically, replacing an existing file) only in ``close()``; so an abort, an error, a
    full disk or a crash never leaves a file under ``path``. Any I/O error removes the temp file and
    raises ``CaptureFileError`` (e.g. "no space left on device while writing /x/run.h5 ...").
    The directory is checked (and the temp file created) in the constructor, before anything is
    generated. After a hard kill (SIGKILL, power loss) a hidden ``.partial`` file may remain.
    Rows are buffered per (request, hook) up to one chunk (~256 KiB) and written as whole chunks, so
    a one-row decode-step append costs ~10 us; ``buffer_bytes`` bounds these buffers (over it,
    everything buffered is written). Positions/token ids (16 bytes a row) stay in memory until the
    request finishes (``update_request`` with a finish reason) or ``close()``; token data, texts and
    logprobs are written at ``close()``. ``compression``: None (default: export is I/O-bound and
    activations barely compress; see bench/export_bench.py), "lzf", "gzip" or ("gzip", level), each
    with the shuffle filter. Not thread-safe: call it from one thread.

``write_run(run, path, progress=None, **writer_options) -> Path``
    A whole Run through ``CaptureWriter``; ``progress(fraction)`` is called with 0..1 by bytes
    written. An exception raised by ``progress`` cancels the export (nothing is left at ``path``).

``open_run(path) -> RunFile``
    Validates and opens lazily: ``RunFile.run`` is a ``Run`` whose ``requests[rid].hooks[name]`` are
    ``LazyHookRows`` (``positions``, ``token_ids``, ``width``, ``len()`` like ``HookRows``; ``values``
    is an ``H5Array``: ``shape``, ``dtype``, ``[...]`` slicing and ``np.asarray()`` read from disk on
    demand). Opening a multi-GB file reads only the small per-request data. The file stays open until
    ``RunFile.close()`` (or ``with open_run(p) as rf:``); after that, reading hook values raises
    ``CaptureFileError``. Without ``close()`` it closes once neither the RunFile nor anything from
    its run is referenced any more (at the next garbage collection: the run refers back to the file).

``read_run(path) -> Run``
    Everything loaded into memory as plain ``HookRows``; the file is closed on return.

Round trip is exact: float32 values bit for bit, token ids, strings (including NUL and lone
surrogates, stored JSON-escaped), logprobs as float64. JSON values come back as JSON types (tuples
inside metadata/sampling/intervention dicts become lists); ``top_logprobs`` pairs and
``intervention_log`` entries come back as tuples, as typed in ``RequestCapture``.
"""

from __future__ import annotations

import datetime as _dt
import errno as _errno
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from inspector import __version__ as APP_VERSION
from inspector.capture.run import HookInfo, HookRows, RequestCapture, Run

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CaptureFileError", "CaptureWriter", "write_run", "open_run",
           "read_run", "RunFile", "LazyHookRows", "H5Array", "escape_name", "unescape_name"]

FORMAT_NAME = "activation-inspector-capture"
FORMAT_VERSION = 1

# Chunks of ~256 KiB: [rows, cols] with cols = the width split in equal parts of <= 1024 and rows =
# 256 KiB / (4 * cols), within [64, 4096]. HDF5 stores a partly filled chunk at full size (we do not
# compress), so small chunks bound the padding: <= 1 chunk row per (request, hook); none for
# requests that end up with fewer rows than a chunk (those get a chunk of exactly their size).
CHUNK_COLS = 1024
CHUNK_TARGET_BYTES = 1 << 18
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 64, 4096
INDEX_CHUNK = 4096          # chunk length of the 1-D positions/token_ids datasets
WRITE_PIECE_BYTES = 32 << 20  # write_run hands arrays over in pieces of about this size (progress)

_TEXT_ESCAPED = "json_escaped_attrs"  # attr listing attrs stored JSON-encoded (strings HDF5 cannot hold)
_REQUEST_DATASETS = ("token_ids", "positions", "is_prompt", "token_texts", "logprobs",
                     "top_logprob_ids", "top_logprob_values", "top_logprob_counts")


# --------------------------------------------------------------------------------------------- errors

class CaptureFileError(OSError):
    """A capture file could not be written or read; the message names the path and the reason."""

    def __init__(self, message: str, path: str | os.PathLike, reason: str):
        super().__init__(message)
        self.path = os.fspath(path)
        self.reason = reason

    def __str__(self) -> str:  # OSError's own __str__ would do, but keep it explicit
        return self.args[0]


_ERRNO_REASONS = {
    _errno.ENOSPC: "no space left on device",
    _errno.EFBIG: "file too large (the file-size limit was reached)",
    _errno.EDQUOT: "disk quota exceeded",
    _errno.EROFS: "read-only file system",
    _errno.EACCES: "permission denied",
    _errno.EPERM: "operation not permitted",
    _errno.ENOTDIR: "a component of the path is not a directory",
    _errno.ENOENT: "no such file or directory",
    _errno.EISDIR: "is a directory",
    _errno.EIO: "input/output error",
}


def _reason(exc: BaseException) -> str:
    """A short human reason for an OS/HDF5 error (HDF5 messages carry 'errno = N')."""
    code = getattr(exc, "errno", None)
    text = str(exc).strip()
    if not code:
        m = re.search(r"errno = (\d+)", text)
        code = int(m.group(1)) if m else None
    if code in _ERRNO_REASONS:
        return _ERRNO_REASONS[code]
    if code:
        return os.strerror(code).lower()
    return text.splitlines()[0] if text else type(exc).__name__


# ------------------------------------------------------------------------------------ names and text

def escape_name(name: str) -> str:
    """Hook name -> HDF5 link name: '%' -> '%25', '/' -> '%2F', and a name of only dots gets '%2E'.

    Dots are kept (``model.layers.0.resid_post`` stays readable); the mapping is reversible.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"hook names must be non-empty strings, got {name!r}")
    out = name.replace("%", "%25").replace("/", "%2F")
    if set(out) == {"."}:
        out = out.replace(".", "%2E")
    return out


def unescape_name(escaped: str) -> str:
    return re.sub(r"%(25|2F|2E)", lambda m: {"25": "%", "2F": "/", "2E": "."}[m.group(1)], escaped)


def _storable(s: str) -> bool:
    """HDF5 variable-length strings end at NUL and must be valid UTF-8."""
    if "\x00" in s:
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _set_text(obj, key: str, value: str) -> None:
    """A UTF-8 string attr; one HDF5 cannot hold (NUL, lone surrogates) is stored JSON-encoded and its
    key listed in the ``json_escaped_attrs`` attr."""
    value = str(value)
    storable = _storable(value)
    obj.attrs[key] = value if storable else json.dumps(value)  # JSON: ASCII, no NUL
    if storable and _TEXT_ESCAPED not in obj.attrs:
        return
    escaped = [k.decode() if isinstance(k, bytes) else str(k) for k in obj.attrs.get(_TEXT_ESCAPED, [])]
    escaped = [k for k in escaped if k != key] + ([] if storable else [key])
    if escaped:
        obj.attrs[_TEXT_ESCAPED] = np.array(escaped, dtype=h5py.string_dtype())
    else:
        del obj.attrs[_TEXT_ESCAPED]


def _get_text(obj, key: str, default: str | None = None) -> str | None:
    if key not in obj.attrs:
        return default
    value = obj.attrs[key]
    if isinstance(value, bytes):
        value = value.decode("utf-8", "surrogateescape")
    elif isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
        value = value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value
    value = str(value)
    escaped = {(k.decode() if isinstance(k, bytes) else str(k)) for k in obj.attrs.get(_TEXT_ESCAPED, [])}
    return json.loads(value) if key in escaped else value


def _json_default(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    if isinstance(o, (_dt.datetime, _dt.date)):
        return o.isoformat()
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    raise TypeError(f"a {type(o).__name__} cannot be stored as JSON")


def _to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, default=_json_default, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} cannot be stored in a capture file: {exc}") from exc


def chunk_cols_for(width: int) -> int:
    """Split the width into equal parts of at most CHUNK_COLS (edge chunks are stored full size)."""
    parts = -(-width // CHUNK_COLS)
    return -(-width // parts)


def chunk_rows_for(width: int) -> int:
    return int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, CHUNK_TARGET_BYTES // (chunk_cols_for(width) * 4))))


def _compression_kwargs(compression) -> dict:
    if compression is None:
        return {}
    if compression == "lzf":
        return {"compression": "lzf", "shuffle": True}
    if compression == "gzip" or (isinstance(compression, tuple) and compression[0] == "gzip"):
        level = 1 if compression == "gzip" else int(compression[1])
        return {"compression": "gzip", "compression_opts": level, "shuffle": True}
    raise ValueError(f"compression must be None, 'lzf', 'gzip' or ('gzip', level), not {compression!r}")


# ------------------------------------------------------------------------------------------- writer

class _LatchingFile:
    """The temp file as HDF5 sees it (h5py's "fileobj" driver): a write error is latched, never raised.

    HDF5 (2.0 via h5py 3.16) can crash the process when it closes a file whose writes failed: failed
    flushes happen again in object deallocators and it frees state twice. So the first OSError
    (ENOSPC, EFBIG, EIO, ...) is stored in ``.error`` and the file switches to *discard* mode, where
    writes land in a small in-memory overlay (reads see them) and always succeed. HDF5 never sees a
    failure; CaptureWriter checks ``.error`` after every operation and removes the file. Plain
    positioned reads/writes on one descriptor: as fast as HDF5's own POSIX driver (measured).
    """

    OVERLAY_MAX_WRITE = 1 << 20   # in discard mode, bigger writes (raw chunks) are dropped, not kept
    OVERLAY_MAX_TOTAL = 64 << 20

    def __init__(self, path: Path):
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
        self.fd: int | None = os.open(path, flags, 0o666)
        self.error: OSError | None = None
        self._discarding = False
        self._pos = 0
        self._size = 0        # logical size in discard mode
        self._overlay: list[tuple[int, bytes]] = []
        self._overlay_bytes = 0

    def _latch(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc
        self.discard()

    def discard(self) -> None:
        if not self._discarding and self.fd is not None:
            self._discarding = True
            try:
                self._size = os.fstat(self.fd).st_size
            except OSError:
                self._size = 0

    def _end(self) -> int:
        if self._discarding:
            return self._size
        return os.fstat(self.fd).st_size

    # -- the file-like interface h5py's fileobj driver uses

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self._end() + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n, pos = len(mv), self._pos
        if not self._discarding:
            try:
                done = 0
                while done < n:
                    wrote = os.pwrite(self.fd, mv[done:], pos + done)
                    if wrote <= 0:
                        raise OSError(_errno.ENOSPC, "no space left on device (short write)")
                    done += wrote
            except OSError as exc:
                self._latch(exc)
        if self._discarding:
            if n <= self.OVERLAY_MAX_WRITE and self._overlay_bytes + n <= self.OVERLAY_MAX_TOTAL:
                self._overlay.append((pos, bytes(mv)))
                self._overlay_bytes += n
            self._size = max(self._size, pos + n)
        self._pos = pos + n
        return n

    def readinto(self, buffer) -> int:
        mv = memoryview(buffer).cast("B")
        n, pos = len(mv), self._pos
        got = 0
        try:
            got = os.preadv(self.fd, [mv], pos) if hasattr(os, "preadv") else self._pread_copy(mv, pos)
        except OSError as exc:
            self._latch(exc)
        if got < n:
            mv[got:] = bytes(n - got)
        for at, blob in self._overlay:  # later writes win
            lo, hi = max(at, pos), min(at + len(blob), pos + n)
            if lo < hi:
                mv[lo - pos: hi - pos] = blob[lo - at: hi - at]
        self._pos = pos + n
        return n

    def _pread_copy(self, mv: memoryview, pos: int) -> int:
        data = os.pread(self.fd, len(mv), pos)
        mv[: len(data)] = data
        return len(data)

    def read(self, size: int = -1) -> bytes:
        size = max(0, self._end() - self._pos) if size is None or size < 0 else size
        buf = bytearray(size)
        self.readinto(buf)
        return bytes(buf)

    def truncate(self, size: int | None = None) -> int:
        size = self._pos if size is None else size
        if not self._discarding:
            try:
                os.ftruncate(self.fd, size)
            except OSError as exc:
                self._latch(exc)
        if self._discarding:
            self._size = size
        return size

    def flush(self) -> None:
        pass

    # -- ours

    def finish(self, fsync: bool) -> None:
        """After HDF5 closed the file: fsync (errors raise) and close the descriptor."""
        if self.error is not None:
            raise self.error
        try:
            if fsync:
                os.fsync(self.fd)
        finally:
            self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError as exc:
                if self.error is None and not self._discarding:
                    self.error = exc
            self.fd = None


class _HookBuffer:
    """One (request, hook): values not yet written (< one chunk, written chunk-aligned) and all its
    positions/token ids (16 bytes a row, kept in memory and written when the request finishes)."""

    __slots__ = ("name", "width", "chunk_rows", "chunk_cols", "count", "vals", "rows_written",
                 "idx_pos", "idx_tok", "n_idx", "idx_written", "d_values", "d_positions", "d_token_ids")

    def __init__(self, name: str, width: int):
        self.name, self.width = name, width
        self.chunk_rows, self.chunk_cols = chunk_rows_for(width), chunk_cols_for(width)
        self.count = 0
        self.vals: np.ndarray | None = None
        self.rows_written = 0
        self.idx_pos = np.empty(16, np.int64)
        self.idx_tok = np.empty(16, np.int64)
        self.n_idx = self.idx_written = 0
        self.d_values = self.d_positions = self.d_token_ids = None

    def gap(self) -> int:
        """Rows from what is written to the next chunk boundary, in 1..chunk_rows."""
        return self.chunk_rows - self.rows_written % self.chunk_rows

    def add_index(self, p: np.ndarray, t: np.ndarray) -> None:
        need = self.n_idx + len(p)
        if need > len(self.idx_pos):
            cap = max(need, 2 * len(self.idx_pos))
            for name in ("idx_pos", "idx_tok"):
                grown = np.empty(cap, np.int64)
                grown[: self.n_idx] = getattr(self, name)[: self.n_idx]
                setattr(self, name, grown)
        self.idx_pos[self.n_idx: need] = p
        self.idx_tok[self.n_idx: need] = t
        self.n_idx = need

    def stash(self, v: np.ndarray) -> None:
        need = self.count + len(v)
        if self.vals is None or need > len(self.vals):
            cap = max(need, min(self.chunk_rows, 2 * (0 if self.vals is None else len(self.vals)) or 16))
            vals = np.empty((cap, self.width), np.float32)
            if self.count:
                vals[: self.count] = self.vals[: self.count]
            self.vals = vals
        self.vals[self.count: need] = v
        self.count = need


class _Snapshot:
    """What update_request last said about a request (copied, so later mutation does not leak in)."""

    def __init__(self, req: RequestCapture):
        self.request_id = str(req.request_id)
        self.prompt = str(req.prompt)
        self.prompt_token_ids = np.asarray(req.prompt_token_ids, dtype=np.int64).reshape(-1)
        self.generated_token_ids = np.asarray(req.generated_token_ids, dtype=np.int64).reshape(-1)
        self.token_texts = [str(t) for t in req.token_texts]
        self.logprobs = np.asarray(req.logprobs, dtype=np.float64).reshape(-1)
        self.top_logprobs = [[(int(i), float(v)) for i, v in pairs] for pairs in req.top_logprobs]
        self.sampling = _to_json(req.sampling, f"the sampling parameters of request {req.request_id!r}")
        self.intervention_log = _to_json([[int(p), list(ivs)] for p, ivs in req.intervention_log],
                                         f"the intervention log of request {req.request_id!r}")
        self.finish_reason = None if req.finish_reason is None else str(req.finish_reason)


class _Request:
    __slots__ = ("index", "group", "snapshot", "buffers")

    def __init__(self, index: int, group, snapshot: _Snapshot):
        self.index, self.group, self.snapshot = index, group, snapshot
        self.buffers: dict[str, _HookBuffer] = {}


class CaptureWriter:
    """Streams a Run into an HDF5 capture file; see the module docstring."""

    def __init__(self, path: str | os.PathLike, metadata: dict, hooks: dict[str, HookInfo], *,
                 compression: str | tuple | None = None, fsync: bool = True, buffer_bytes: int = 128 << 20):
        self._state = "init"
        self._file = None
        self._io: _LatchingFile | None = None
        self._tmp: Path | None = None
        self.path = Path(os.path.abspath(os.fspath(path)))
        self._hooks: dict[str, HookInfo] = dict(hooks)
        for name, info in self._hooks.items():
            escape_name(name)
            if int(info.width) < 1:
                raise ValueError(f"hook {name!r} has width {info.width}; it must be at least 1")
        self._compression = _compression_kwargs(compression)
        self._fsync = fsync
        self._budget = int(buffer_bytes)
        self._buffered = 0
        self._requests: dict[str, _Request] = {}
        metadata = dict(metadata)
        meta_json = _to_json(metadata, "the run metadata")
        model_config = metadata.get("model_config", {})
        model_config = model_config if isinstance(model_config, str) else _to_json(model_config, "model_config")

        self._create_temp()
        self._state = "open"
        with self._guard("writing the header"):
            f = self._file
            f.attrs["format"] = FORMAT_NAME
            f.attrs["format_version"] = np.int64(FORMAT_VERSION)
            created = metadata.get("created") or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
            for key, value in (("app_version", metadata.get("app_version") or APP_VERSION),
                               ("vllm_version", metadata.get("vllm_version") or ""),
                               ("model_path", metadata.get("model_path") or ""),
                               ("model_config", model_config),
                               ("dtype", metadata.get("dtype") or ""),
                               ("engine_mode", metadata.get("engine_mode") or ""),
                               ("created", created.isoformat() if hasattr(created, "isoformat") else created),
                               ("metadata", meta_json)):
                _set_text(f, key, value)
            hooks_group = f.create_group("hooks")
            for index, (name, info) in enumerate(self._hooks.items()):
                g = hooks_group.create_group(escape_name(name))
                _set_text(g, "name", name)
                for key in ("alias", "module_path", "kind"):
                    _set_text(g, key, getattr(info, key))
                g.attrs["width"] = np.int64(info.width)
                g.attrs["layer"] = np.int64(info.layer)
                _set_text(g, "source_dtype", info.dtype)
                g.attrs["index"] = np.int64(index)
            f.create_group("requests")

    # -- lifecycle

    def _create_temp(self) -> None:
        final, parent = self.path, self.path.parent

        def fail(reason: str, exc: BaseException | None = None):
            err = CaptureFileError(f"cannot create capture file {final}: {reason}", final, reason)
            raise err from exc

        if final.is_dir():
            fail("a directory of that name exists")
        if not parent.exists():
            fail(f"the directory {parent} does not exist")
        if not parent.is_dir():
            fail(f"{parent} is not a directory")
        if not os.access(parent, os.W_OK | os.X_OK):
            fail(f"the directory {parent} is not writable")
        tmp = parent / f".{final.name}.{secrets.token_hex(4)}.partial"
        try:
            self._io = _LatchingFile(tmp)
        except OSError as exc:
            fail(_reason(exc), exc)
        self._tmp = tmp
        try:
            # no chunk cache: full chunks go straight to disk instead of piling up, dirty, per dataset
            self._file = h5py.File(self._io, "w", rdcc_nbytes=0, libver=("v110", "v110"))
            error = self._io.error
        except Exception as exc:  # noqa: BLE001 - any failure here means "cannot create"
            error = self._io.error or exc  # the latched OS error (e.g. disk full) says more than HDF5's
        if error is not None:
            self._discard()
            fail(_reason(error), error)

    def _discard(self) -> None:
        """Close and delete the temp file; safe after failed writes (see _LatchingFile)."""
        if self._io is not None:
            self._io.discard()  # from now on HDF5 writes into memory: closing cannot fail
        for req in self._requests.values():
            for buf in req.buffers.values():
                buf.d_values = buf.d_positions = buf.d_token_ids = None
                buf.vals = None
            req.group = None
        if self._file is not None:
            try:
                self._file.close()
            except Exception:  # noqa: BLE001 - already failing; the temp file goes anyway
                pass
            self._file = None
        if self._io is not None:
            self._io.close()
            self._io = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except OSError:
                pass

    def _check_open(self) -> None:
        if self._state != "open":
            what = {"closed": "closed", "aborted": "aborted", "failed": "stopped after an earlier error"}
            reason = f"the writer was {what.get(self._state, self._state)}"
            raise CaptureFileError(f"cannot write {self.path}: {reason}", self.path, reason)

    def _fail(self, error: BaseException, doing: str, cause: BaseException | None = None):
        reason = _reason(error)
        if not re.search(r"space|too large|quota", reason):
            try:
                if shutil.disk_usage(self.path.parent).free == 0:
                    reason = f"no space left on device ({reason})"
            except OSError:
                pass
        self._discard()
        self._state = "failed"
        raise CaptureFileError(f"{reason} while writing {self.path} ({doing}); nothing was saved",
                               self.path, reason) from (cause or error)

    @contextmanager
    def _guard(self, doing: str):
        """Run file operations; any error (raised, or latched by the file object) removes the temp file."""
        self._check_open()
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - any error leaves the file unusable: remove it
            latched = self._io.error if self._io is not None else None
            self._fail(latched or exc, doing, exc)
        if self._io is not None and self._io.error is not None:
            self._fail(self._io.error, doing)

    def close(self) -> Path:
        """Write what is buffered, finish the file and rename it onto ``path``. Idempotent."""
        if self._state == "closed":
            return self.path
        with self._guard("finishing the file"):
            for req in self._requests.values():
                self._flush_request(req, final=True)
                self._write_request_data(req)
            self._file.close()
            self._file = None
            self._io.finish(fsync=self._fsync)
        with self._guard("renaming the finished file"):
            os.replace(self._tmp, self.path)
            self._io = None
            if self._fsync:
                try:
                    fd = os.open(self.path.parent, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                except OSError:
                    pass  # some filesystems cannot fsync a directory
        self._state = "closed"
        return self.path

    def abort(self) -> None:
        """Drop everything: the temp file is removed, nothing appears at ``path``. Idempotent."""
        if self._state in ("open", "init"):
            self._discard()
            self._state = "aborted"

    def __enter__(self) -> "CaptureWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def __del__(self):
        try:
            if getattr(self, "_state", None) in ("open", "init"):
                self.abort()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass

    # -- requests

    def add_request(self, req: RequestCapture) -> None:
        """Register a request (prompt, sampling, ...). Its rows come through ``append_rows``."""
        self._check_open()
        rid = str(req.request_id)
        if rid in self._requests:
            raise ValueError(f"request {rid!r} was already added")
        snapshot = _Snapshot(req)
        with self._guard(f"adding request {rid!r}"):
            index = len(self._requests)
            g = self._file["requests"].create_group(str(index))
            _set_text(g, "request_id", rid)
            g.attrs["index"] = np.int64(index)
            _set_text(g, "prompt", snapshot.prompt)
            g.create_group("hooks")
        self._requests[rid] = _Request(index, g, snapshot)

    def update_request(self, req: RequestCapture) -> None:
        """Record the request's current tokens, texts, logprobs, interventions and finish reason.

        Written at ``close()``; a finish reason also writes out the request's buffered rows now.
        """
        self._check_open()
        self._request(req.request_id).snapshot = _Snapshot(req)
        if req.finish_reason is not None:
            self._release(req.request_id)

    def append_rows(self, request_id: str, hook: str, positions, token_ids, values) -> None:
        """Append ``values[n, width]`` (float32; other floats are converted) with their positions/token ids.

        Called once per decode step per (request, hook), so it is kept lean (~10 us for one row).
        """
        if self._state != "open":
            self._check_open()
        req = self._requests.get(request_id)
        if req is None:
            req = self._request(request_id)
        buf = req.buffers.get(hook)
        if buf is None:
            info = self._hooks.get(hook)
            if info is None:
                raise ValueError(f"unknown hook {hook!r}; this writer was opened with {list(self._hooks)[:8]}")
            buf = req.buffers[hook] = _HookBuffer(hook, int(info.width))
        if type(values) is not np.ndarray or values.dtype != np.float32:
            values = np.asarray(values).astype(np.float32, copy=False)
        if type(positions) is not np.ndarray or positions.dtype != np.int64 or positions.ndim != 1:
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if type(token_ids) is not np.ndarray or token_ids.dtype != np.int64 or token_ids.ndim != 1:
            token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if values.ndim != 2 or values.shape[1] != buf.width:
            raise ValueError(f"rows of shape {values.shape} do not fit hook {hook!r} of width {buf.width}")
        n = len(values)
        if not len(positions) == len(token_ids) == n:
            raise ValueError(f"{n} rows but {len(positions)} positions and {len(token_ids)} token ids")
        try:
            buf.add_index(positions, token_ids)
            if n and buf.count + n < buf.gap():  # the common decode step: just buffer it
                buf.stash(values)
                self._buffered += n * buf.width * 4
            elif n:
                self._push(req, buf, values)
            if self._buffered > self._budget:
                for r in self._requests.values():
                    self._flush_request(r, final=False)
        except Exception as exc:  # noqa: BLE001 - see _guard
            self._fail(self._io.error or exc, f"appending rows of hook {hook!r}", exc)
        if self._io.error is not None:
            self._fail(self._io.error, f"appending rows of hook {hook!r}")

    def _release(self, request_id: str) -> None:
        """Write a request's buffered rows now (as when it finishes), freeing its buffers."""
        state = self._request(request_id)
        with self._guard(f"writing the rows of request {state.snapshot.request_id!r}"):
            self._flush_request(state, final=True)

    def _request(self, request_id) -> _Request:
        state = self._requests.get(str(request_id))
        if state is None:
            raise ValueError(f"unknown request {request_id!r}; call add_request() first")
        return state

    # -- rows

    def _push(self, req: _Request, buf: _HookBuffer, v: np.ndarray) -> None:
        n, i = len(v), 0
        while i < n:
            gap = buf.gap()
            if buf.count == 0 and n - i >= gap:  # chunk-aligned: write straight from the caller's array
                k = gap + ((n - i - gap) // buf.chunk_rows) * buf.chunk_rows
                self._write_values(req, buf, v[i: i + k], exact=False)
                i += k
                continue
            take = min(gap - buf.count, n - i)
            buf.stash(v[i: i + take])
            self._buffered += take * buf.width * 4
            i += take
            if buf.count == gap:
                self._flush(req, buf, final=False)

    def _flush(self, req: _Request, buf: _HookBuffer, final: bool) -> None:
        if buf.count or (final and buf.d_values is None):
            c = buf.count
            self._write_values(req, buf, buf.vals[:c] if c else np.zeros((0, buf.width), np.float32),
                               exact=final and buf.d_values is None)
            self._buffered -= c * buf.width * 4
            buf.count = 0
        if final:
            buf.vals = None
            self._write_index(buf)

    def _flush_request(self, req: _Request, final: bool) -> None:
        for buf in req.buffers.values():
            self._flush(req, buf, final)

    def _write_values(self, req: _Request, buf: _HookBuffer, v: np.ndarray, exact: bool) -> None:
        if buf.d_values is None:
            if exact:  # everything this hook will get: chunks fit the data, no padding on disk
                buf.chunk_rows = max(1, len(v))
            link = escape_name(buf.name)
            g = req.group["hooks"].create_group(link)
            if link != buf.name:  # the hook's own name, where the link name had to be escaped
                _set_text(g, "name", buf.name)
            buf.d_values = g.create_dataset("values", shape=(0, buf.width), maxshape=(None, buf.width),
                                            dtype="<f4", chunks=(buf.chunk_rows, buf.chunk_cols),
                                            **self._compression)
        n = len(v)
        if n == 0:
            return
        a, b, rows, cols, width = buf.rows_written, buf.rows_written + n, buf.chunk_rows, buf.chunk_cols, buf.width
        d = buf.d_values
        d.id.set_extent((b, width))
        if not self._compression and a % rows == 0 and n % rows == 0 and v.dtype == np.dtype("<f4"):
            # whole chunks: hand HDF5 the chunk bytes directly (no selection, no gather copy)
            for r0 in range(0, n, rows):
                block = v[r0: r0 + rows]
                for c0 in range(0, width, cols):
                    if c0 == 0 and cols == width:
                        data = block if block.flags.c_contiguous else np.ascontiguousarray(block)
                    elif c0 + cols <= width:
                        data = np.ascontiguousarray(block[:, c0: c0 + cols])
                    else:  # the last column chunk sticks out: pad it like HDF5 would
                        data = np.zeros((rows, cols), np.float32)
                        data[:, : width - c0] = block[:, c0:]
                    d.id.write_direct_chunk((a + r0, c0), data)
        else:
            d[a:b] = v
        buf.rows_written = b

    def _write_index(self, buf: _HookBuffer) -> None:
        """Write positions/token ids up to the rows appended so far (called when a request finishes)."""
        n, have = buf.n_idx, buf.idx_written
        if buf.d_positions is None:
            g = buf.d_values.parent
            chunk = (max(1, min(n, INDEX_CHUNK)),)
            buf.d_positions = g.create_dataset("positions", shape=(0,), maxshape=(None,), dtype="<i8",
                                               chunks=chunk, **self._compression)
            buf.d_token_ids = g.create_dataset("token_ids", shape=(0,), maxshape=(None,), dtype="<i8",
                                               chunks=chunk, **self._compression)
        if n > have:
            for d, data in ((buf.d_positions, buf.idx_pos), (buf.d_token_ids, buf.idx_tok)):
                d.resize(n, axis=0)
                d[have:n] = data[have:n]
            buf.idx_written = n

    def _write_request_data(self, req: _Request) -> None:
        g, s = req.group, req.snapshot
        for name in _REQUEST_DATASETS:
            if name in g:
                del g[name]
        tokens = np.concatenate([s.prompt_token_ids, s.generated_token_ids])
        n_prompt = len(s.prompt_token_ids)
        g.create_dataset("token_ids", data=tokens)
        g.create_dataset("positions", data=np.arange(len(tokens), dtype=np.int64))
        is_prompt = np.zeros(len(tokens), dtype=np.uint8)
        is_prompt[:n_prompt] = 1
        g.create_dataset("is_prompt", data=is_prompt)
        stored, escaped = [], []
        for i, text in enumerate(s.token_texts):
            if _storable(text):
                stored.append(text)
            else:
                stored.append(json.dumps(text))
                escaped.append(i)
        d = g.create_dataset("token_texts", data=np.array(stored, dtype=object), dtype=h5py.string_dtype())
        if escaped:
            d.attrs["json_escaped"] = np.array(escaped, dtype=np.int64)
        g.create_dataset("logprobs", data=s.logprobs)
        rows, k = len(s.top_logprobs), max((len(x) for x in s.top_logprobs), default=0)
        ids = np.full((rows, k), -1, dtype=np.int64)
        vals = np.full((rows, k), np.nan, dtype=np.float64)
        counts = np.zeros(rows, dtype=np.int64)
        for r, pairs in enumerate(s.top_logprobs):
            counts[r] = len(pairs)
            for c, (tid, lp) in enumerate(pairs):
                ids[r, c], vals[r, c] = tid, lp
        g.create_dataset("top_logprob_ids", data=ids)
        g.create_dataset("top_logprob_values", data=vals)
        g.create_dataset("top_logprob_counts", data=counts)
        _set_text(g, "request_id", s.request_id)
        _set_text(g, "prompt", s.prompt)
        g.attrs["num_prompt_tokens"] = np.int64(n_prompt)
        _set_text(g, "sampling", s.sampling)
        _set_text(g, "intervention_log", s.intervention_log)
        if s.finish_reason is not None:
            _set_text(g, "finish_reason", s.finish_reason)
        elif "finish_reason" in g.attrs:
            del g.attrs["finish_reason"]


def write_run(run: Run, path: str | os.PathLike, progress: Callable[[float], None] | None = None,
              **writer_options) -> Path:
    """Write a whole Run (in memory or lazily opened) to ``path``; returns the final path."""
    total = sum(len(rows) * (rows.width * 4 + 16) for req in run.requests.values() for rows in req.hooks.values())
    done = 0
    if progress:
        progress(0.0)
    with CaptureWriter(path, run.metadata, run.hooks, **writer_options) as writer:
        for req in run.requests.values():
            writer.add_request(req)
            for name, rows in req.hooks.items():
                n = len(rows)
                positions, token_ids, values = rows.positions, rows.token_ids, rows.values
                chunk = chunk_rows_for(rows.width)
                step = max(chunk, (WRITE_PIECE_BYTES // (rows.width * 4)) // chunk * chunk)
                if n == 0:
                    writer.append_rows(req.request_id, name, positions, token_ids,
                                       np.zeros((0, rows.width), np.float32))
                for a in range(0, n, step):
                    b = min(n, a + step)
                    writer.append_rows(req.request_id, name, positions[a:b], token_ids[a:b], np.asarray(values[a:b]))
                    done += (b - a) * (rows.width * 4 + 16)
                    if progress and total:
                        progress(min(1.0, done / total))
            writer.update_request(req)
            if req.finish_reason is None:  # update_request wrote a finished one's rows already
                writer._release(req.request_id)  # write its last rows now and free the buffers
    if progress:
        progress(1.0)
    return Path(writer.path)


# ------------------------------------------------------------------------------------------- reader

class H5Array:
    """A read-only, h5py-backed array: ``shape``, ``dtype``, slicing and ``np.asarray()`` read on demand."""

    def __init__(self, dataset: h5py.Dataset, owner: "RunFile"):
        self._dataset, self._owner = dataset, owner
        self.shape: tuple[int, ...] = tuple(dataset.shape)
        self.dtype = dataset.dtype

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        self._owner._check_open()
        try:
            return self._dataset[key]
        except (TypeError, ValueError, IndexError):  # indexing h5py does not do: read all, let numpy index
            try:
                everything = self._dataset[...]
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc) from exc
            return everything[key]
        except Exception as exc:  # noqa: BLE001 - OSError/RuntimeError/MemoryError from a damaged file
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> CaptureFileError:
        path, name = self._owner.path, self._dataset.name
        if isinstance(exc, MemoryError):
            reason = f"not enough memory for {self.shape} {self.dtype} (is the file damaged?)"
            return CaptureFileError(f"cannot read {name} from {path}: {reason}", path, reason)
        reason = f"damaged: {_reason(exc)}"
        return CaptureFileError(f"cannot read {name} from {path}: the file is {reason}", path, reason)

    def read(self) -> np.ndarray:
        return self[...]

    def __array__(self, dtype=None, copy=None):
        out = self.read()
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"H5Array({self._dataset.name!r}, shape={self.shape}, dtype={self.dtype})"


class LazyHookRows(HookRows):
    """Rows of one hook of one request in an open capture file; read-only, values read on demand."""

    def __init__(self, group: h5py.Group, width: int, owner: "RunFile"):
        super().__init__(width)
        self._group, self._owner = group, owner
        self._lazy_values: H5Array | None = None
        self._lazy_positions: np.ndarray | None = None
        self._lazy_token_ids: np.ndarray | None = None

    def _damaged(self, what: str) -> CaptureFileError:
        return CaptureFileError(f"{self._owner.path} is damaged: {self._group.name} {what}", self._owner.path,
                                f"damaged: {what}")

    @property
    def values(self) -> H5Array:
        if self._lazy_values is None:
            self._owner._check_open()
            try:
                d = self._group.get("values")
                if not isinstance(d, h5py.Dataset):
                    raise self._damaged("has no 'values' dataset")
                if d.ndim != 2 or d.shape[1] != self.width:
                    raise self._damaged(f"holds values of shape {d.shape}, not [rows, {self.width}]")
                if d.dtype.kind != "f":
                    raise self._damaged(f"holds values of type {d.dtype}, not float")
                self._lazy_values = H5Array(d, self._owner)
            except CaptureFileError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreadable dataset header
                raise self._damaged(f"has an unreadable 'values' dataset ({_reason(exc)})") from exc
        return self._lazy_values

    def _index(self, name: str) -> np.ndarray:
        self._owner._check_open()
        try:
            d = self._group.get(name)
            if not isinstance(d, h5py.Dataset):
                raise self._damaged(f"has no {name!r} dataset")
            if d.shape != (len(self),):
                raise self._damaged(f"has {name} of shape {d.shape} for {len(self)} rows")
            array = H5Array(d, self._owner)
        except CaptureFileError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._damaged(f"has an unreadable {name!r} dataset ({_reason(exc)})") from exc
        return array[...].astype(np.int64, copy=False)

    @property
    def positions(self) -> np.ndarray:
        if self._lazy_positions is None:
            self._lazy_positions = self._index("positions")
        return self._lazy_positions

    @property
    def token_ids(self) -> np.ndarray:
        if self._lazy_token_ids is None:
            self._lazy_token_ids = self._index("token_ids")
        return self._lazy_token_ids

    def __len__(self) -> int:
        return self.values.shape[0]

    def append(self, *args, **kwargs):
        raise TypeError("hook rows read from a capture file are read-only; use read_run() for an in-memory copy")

    def load(self) -> HookRows:
        rows = HookRows(self.width)
        if len(self):
            rows.append(self.positions, self.token_ids, self.values.read())
        return rows


class RunFile:
    """An open capture file: ``.run`` (lazy hook values), ``.path``, ``.close()``; a context manager."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.fspath(path))
        self._file: h5py.File | None = None
        self._file = _open_validated(self.path)
        try:
            self.run = _build_run(self._file, self.path, self)
        except CaptureFileError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - anything unexpected in a validated file means damage
            self.close()
            reason = _reason(exc)
            raise CaptureFileError(f"{self.path} is damaged: {reason}", self.path, f"damaged: {reason}") from exc

    @property
    def closed(self) -> bool:
        return self._file is None

    def _check_open(self) -> None:
        if self._file is None:
            raise CaptureFileError(f"{self.path} has been closed; reopen it with open_run()", self.path, "closed")

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None

    def __enter__(self) -> "RunFile":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def __repr__(self) -> str:
        return f"RunFile({str(self.path)!r}, {'closed' if self.closed else 'open'})"


def _open_validated(path: Path) -> h5py.File:
    def fail(reason: str, message: str | None = None, exc: BaseException | None = None):
        raise CaptureFileError(message or f"cannot open {path}: {reason}", path, reason) from exc

    if not path.exists():
        fail("no such file")
    if path.is_dir():
        fail("it is a directory, not a capture file")
    try:
        is_hdf5 = h5py.is_hdf5(path)
    except Exception as exc:  # noqa: BLE001
        fail(_reason(exc), exc=exc)
    if not is_hdf5:
        size = path.stat().st_size
        fail("not an HDF5 file" + (" (it is empty)" if size == 0 else " (no HDF5 signature found)"),
             f"cannot open {path}: it is not an HDF5 file" + (" (it is empty)" if size == 0 else "")
             + "; capture files are written by Activation Inspector's export")
    try:
        f = h5py.File(path, "r")
    except Exception as exc:  # noqa: BLE001
        text = str(exc)
        m = re.search(r"eof = (\d+).*stored_eof = (\d+)", text)
        if "truncated" in text:
            have = f" ({int(m.group(1)):,} of {int(m.group(2)):,} bytes present)" if m else ""
            fail("truncated file", f"cannot open {path}: the file is truncated{have}; it was cut short or "
                 "not completely written", exc)
        reason = _reason(exc)
        fail(f"damaged: {reason}", f"cannot open {path}: the file is damaged ({reason})", exc)
    try:
        fmt = _get_text(f, "format")
        if fmt is None:
            fail("not a capture file", f"cannot open {path}: it is an HDF5 file but not an Activation Inspector "
                 "capture (it has no 'format' attribute)")
        if fmt != FORMAT_NAME:
            fail("not a capture file", f"cannot open {path}: it is an HDF5 file of another kind "
                 f"(format {fmt!r}, expected {FORMAT_NAME!r})")
        if "format_version" not in f.attrs:
            fail("damaged: no format_version",
                 f"cannot open {path}: the file is damaged (no 'format_version' attribute)")
        try:
            version = int(np.asarray(f.attrs["format_version"]).reshape(()))
        except (TypeError, ValueError) as exc:
            fail("damaged: bad format_version", f"cannot open {path}: the file is damaged "
                 f"(format_version is {f.attrs['format_version']!r})", exc)
        if version > FORMAT_VERSION:
            fail(f"format version {version} is newer than {FORMAT_VERSION}",
                 f"cannot open {path}: it uses capture format version {version}, newer than this version of "
                 f"Activation Inspector can read (up to {FORMAT_VERSION}); update Activation Inspector to open it")
        if version < 1:
            fail(f"invalid format version {version}", f"cannot open {path}: invalid format version {version}")
    except CaptureFileError:
        f.close()
        raise
    except Exception as exc:  # noqa: BLE001 - unreadable root attributes
        f.close()
        reason = _reason(exc)
        fail(f"damaged: {reason}", f"cannot open {path}: the file is damaged ({reason})", exc)
    return f


def _build_run(f: h5py.File, path: Path, owner: RunFile) -> Run:
    def damaged(what: str) -> CaptureFileError:
        return CaptureFileError(f"cannot open {path}: the file is damaged ({what})", path, f"damaged: {what}")

    def group(parent, name: str) -> h5py.Group:
        g = parent.get(name)
        if not isinstance(g, h5py.Group):
            raise damaged(f"{parent.name.rstrip('/')}/{name} is missing")
        return g

    def dataset(parent, name: str) -> np.ndarray:
        d = parent.get(name)
        if not isinstance(d, h5py.Dataset):
            raise damaged(f"the {name!r} dataset of {parent.name} is missing")
        return d[...]

    def json_attr(obj, key: str, default):
        text = _get_text(obj, key)
        if text is None:
            return default
        try:
            return json.loads(text)
        except ValueError as exc:
            raise damaged(f"the {key!r} attribute of {obj.name} is not valid JSON: {exc}") from exc

    meta_text = _get_text(f, "metadata")
    if meta_text is not None:
        metadata = json_attr(f, "metadata", {})
    else:  # written by another tool: take the documented root attributes
        metadata = {k: _get_text(f, k) for k in ("app_version", "vllm_version", "model_path", "dtype",
                                                  "engine_mode", "created") if k in f.attrs}
        if "model_config" in f.attrs:
            metadata["model_config"] = json_attr(f, "model_config", {})

    hooks_group = group(f, "hooks")
    infos = []
    for link, g in hooks_group.items():
        if not isinstance(g, h5py.Group):
            continue
        if "width" not in g.attrs:
            raise damaged(f"{g.name} has no 'width' attribute")
        name = _get_text(g, "name") or unescape_name(link)
        info = HookInfo(name, _get_text(g, "alias", name), _get_text(g, "module_path", ""), _get_text(g, "kind", ""),
                        int(g.attrs["width"]), int(g.attrs.get("layer", -1)), _get_text(g, "source_dtype", "float32"))
        infos.append((int(g.attrs.get("index", len(infos))), name, info))
    infos.sort(key=lambda x: x[0])
    hooks = {name: info for _, name, info in infos}
    order = {name: i for i, name in enumerate(hooks)}

    requests: dict[str, RequestCapture] = {}
    req_groups = group(f, "requests")
    for link in sorted(req_groups.keys(), key=lambda s: (0, int(s)) if s.isdigit() else (1, s)):
        g = req_groups[link]
        if not isinstance(g, h5py.Group):
            continue
        rid = _get_text(g, "request_id")
        if rid is None:
            raise damaged(f"{g.name} has no 'request_id' attribute")
        tokens = dataset(g, "token_ids").astype(np.int64, copy=False)
        is_prompt = dataset(g, "is_prompt").astype(bool)
        if len(is_prompt) != len(tokens):
            raise damaged(f"{g.name} has {len(is_prompt)} is_prompt flags for {len(tokens)} tokens")
        n_prompt = int(is_prompt.sum())
        td = g.get("token_texts")
        if not isinstance(td, h5py.Dataset):
            raise damaged(f"the 'token_texts' dataset of {g.name} is missing")
        texts = [t if isinstance(t, str) else str(t) for t in td.asstr(errors="surrogateescape")[...].tolist()]
        for i in td.attrs.get("json_escaped", []):
            texts[int(i)] = json.loads(texts[int(i)])
        logprobs = dataset(g, "logprobs").astype(np.float64, copy=False).tolist()
        ids, vals = dataset(g, "top_logprob_ids"), dataset(g, "top_logprob_values")
        counts = dataset(g, "top_logprob_counts")
        if ids.ndim != 2 or vals.shape != ids.shape or counts.shape != (ids.shape[0],):
            raise damaged(f"the top-logprob datasets of {g.name} have shapes {ids.shape}, {vals.shape}, {counts.shape}")
        top = [list(zip(ids[r, :c].tolist(), vals[r, :c].tolist())) for r, c in enumerate(counts.tolist())]
        req = RequestCapture(
            request_id=rid,
            prompt=_get_text(g, "prompt", ""),
            prompt_token_ids=tokens[:n_prompt].tolist(),
            sampling=json_attr(g, "sampling", {}),
            generated_token_ids=tokens[n_prompt:].tolist(),
            token_texts=texts,
            logprobs=logprobs,
            top_logprobs=top,
            intervention_log=[(int(p), list(ivs)) for p, ivs in json_attr(g, "intervention_log", [])],
            finish_reason=_get_text(g, "finish_reason"),
        )
        hook_rows = []
        for hlink, hg in group(g, "hooks").items():
            if not isinstance(hg, h5py.Group):
                continue
            name = _get_text(hg, "name") or unescape_name(hlink)
            if name not in hooks:
                raise damaged(f"{hg.name} holds rows of hook {name!r}, which /hooks does not describe")
            missing = {"values", "positions", "token_ids"} - set(hg.keys())
            if missing:
                raise damaged(f"{hg.name} has no {sorted(missing)} dataset(s)")
            hook_rows.append((order[name], name, LazyHookRows(hg, hooks[name].width, owner)))
        hook_rows.sort(key=lambda x: x[0])
        req.hooks = {name: rows for _, name, rows in hook_rows}
        requests[rid] = req
    return Run(metadata=metadata, hooks=hooks, requests=requests)


def open_run(path: str | os.PathLike) -> RunFile:
    """Open and validate a capture file; hook values stay on disk until read (see RunFile)."""
    return RunFile(path)


def read_run(path: str | os.PathLike) -> Run:
    """Read a capture file completely into memory (plain HookRows); the file is closed on return."""
    with open_run(path) as rf:
        run = rf.run
        for req in run.requests.values():
            req.hooks = {name: rows.load() for name, rows in req.hooks.items()}
        return Run(metadata=run.metadata, hooks=run.hooks, requests=run.requests)
