"""The capture file format's names and small helpers: version, chunk sizes, errors, escaped names,
text attributes and JSON. The layout itself is documented in ``docs/capture-format.md``."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import functools
import json
import os
import re
import tempfile
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

FORMAT_NAME = "activation-inspector-capture"
FORMAT_VERSION = 2  # 2: values in the engine's dtype (bfloat16 as its bits); 1: float32

# Chunks of ~256 KiB when rows stream in: [rows, cols] with cols = the whole width (rows are written as they
# lie, no gather: a capture of 4096-wide rows went 1.2-1.3x faster than with 1024-column chunks) unless 64
# rows of it pass 4 MiB (a logits-wide hook), then equal parts that do not; rows = 256 KiB / (itemsize *
# cols), within [32, 4096] (a (request, hook)'s last chunk is written once the request ends: after a
# batch's last step, every request's last chunk waits for the disk). HDF5 stores a partly filled chunk at
# full size (we do not compress), so small chunks bound the padding: <= 1 chunk row per (request, hook);
# none for requests that end up with fewer rows than a chunk (those get a chunk of exactly their size). A whole run
# written at once (write_run), uncompressed, has chunks of up to ~4 MiB that split each (request, hook)'s rows
# evenly: each chunk is an HDF5 call and an index entry (docs/performance-notes.md). Compressed chunks are
# read whole, so those stay small.
CHUNK_TARGET_BYTES = 1 << 18
EXPORT_CHUNK_BYTES = 1 << 22
MIN_CHUNK_ROWS, MAX_CHUNK_ROWS = 32, 4096
SPLIT_ROWS = 64  # a hook wider than 4 MiB in this many rows has its width split

_TEXT_ESCAPED = "json_escaped_attrs"  # attr listing attrs stored JSON-encoded (strings HDF5 cannot hold)


class CaptureFileError(OSError):
    """A capture file could not be written or read; the message names the path and the reason."""

    def __init__(self, message: str, path: str | os.PathLike, reason: str):
        super().__init__(message)
        self.path = os.fspath(path)
        self.reason = reason

    def __str__(self) -> str:  # OSError's own would add the errno
        return self.args[0]

    def __reduce__(self):  # raised in a writer's process, re-raised in the caller's (io.background)
        return type(self), (self.args[0], self.path, self.reason)


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


def os_reason(exc: BaseException) -> str:
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


def storable(s: str) -> bool:
    """HDF5 variable-length strings end at NUL and must be valid UTF-8."""
    if "\x00" in s:
        return False
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def set_text(obj, key: str, value: str, new: bool = False) -> None:
    """A UTF-8 string attr; one HDF5 cannot hold (NUL, lone surrogates) is stored JSON-encoded and its
    key listed in the ``json_escaped_attrs`` attr. ``new``: ``obj`` has no attrs yet (nothing to
    replace or unlist: a capture file's writer makes thousands of such objects)."""
    value = str(value)
    plain = storable(value)
    _put_text_attr(obj.id, key.encode(), value if plain else json.dumps(value), new)  # JSON: ASCII, no NUL
    if plain and (new or _TEXT_ESCAPED not in obj.attrs):
        return
    escaped = [k.decode() if isinstance(k, bytes) else str(k) for k in obj.attrs.get(_TEXT_ESCAPED, [])]
    escaped = [k for k in escaped if k != key] + ([] if plain else [key])
    if escaped:
        obj.attrs[_TEXT_ESCAPED] = np.array(escaped, dtype=h5py.string_dtype())
    else:
        del obj.attrs[_TEXT_ESCAPED]


_TEXT_TYPE = h5py.h5t.py_create(h5py.string_dtype(), logical=True)  # variable-length UTF-8, as h5py writes str
_SCALAR = h5py.h5s.create(h5py.h5s.SCALAR)


def _put_text_attr(oid, key: bytes, value: str, new: bool = False) -> None:
    """What ``obj.attrs[key] = value`` stores, through HDF5's own calls at half its cost: an export
    writes a few hundred of these (docs/performance-notes.md)."""
    if not new and h5py.h5a.exists(oid, key):
        h5py.h5a.delete(oid, key)
    h5py.h5a.create(oid, key, _TEXT_TYPE, _SCALAR).write(np.array(value, dtype=_TEXT_TYPE.dtype))


def get_text(obj, key: str, default: str | None = None) -> str | None:
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


def to_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, default=_json_default, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} cannot be stored in a capture file: {exc}") from exc


def chunk_cols_for(width: int, itemsize: int = 4) -> int:
    """The whole width, or equal parts of it where a chunk of SPLIT_ROWS rows would pass
    EXPORT_CHUNK_BYTES (edge chunks are stored full size)."""
    parts = -(-width * itemsize * SPLIT_ROWS // EXPORT_CHUNK_BYTES)
    return -(-width // parts)


def chunk_rows_for(width: int, itemsize: int = 4, target_bytes: int = CHUNK_TARGET_BYTES) -> int:
    """Rows of a chunk of about ``target_bytes``: a chunk is one HDF5 call, whatever the dtype's size."""
    return int(min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, target_bytes // (chunk_cols_for(width, itemsize) * itemsize))))


def check_compression(compression) -> None:
    if not (compression in (None, "lzf", "gzip") or (isinstance(compression, tuple) and len(compression) == 2
                                                     and compression[0] == "gzip")):
        raise ValueError(f"compression must be None, 'lzf', 'gzip' or ('gzip', level), not {compression!r}")


def create_group(parent: h5py.Group, link: str) -> h5py.Group:
    """What ``parent.create_group(link)`` makes (a non-ASCII link named in UTF-8, as h5py names it),
    through HDF5's own call at half the cost: a capture file's writer makes one per request and hook."""
    try:
        name, lcpl = link.encode("ascii"), None
    except UnicodeEncodeError:
        name, lcpl = link.encode(), _UTF8_LINK
    return h5py.Group(h5py.h5g.create(parent.id, name, lcpl=lcpl))


_UTF8_LINK = h5py.h5p.create(h5py.h5p.LINK_CREATE)
_UTF8_LINK.set_char_encoding(h5py.h5t.CSET_UTF8)


def extendable_dataset(group: h5py.Group, name: str, dtype, shape: tuple[int, ...], chunks: tuple[int, ...],
                       compression=None) -> h5py.Dataset:
    """A chunked dataset that grows along its first axis, made with HDF5's own calls: h5py's
    ``create_dataset`` spends ~45 µs of Python on each, and an export makes three per request and hook
    (docs/performance-notes.md). Shuffle + lzf or gzip (level 1 unless given) if compressed."""
    check_compression(compression)
    plist, space, tid = _dataset_parts(np.dtype(dtype).str, shape, chunks, compression)
    return h5py.Dataset(h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=plist))


@functools.lru_cache(maxsize=256)
def _dataset_parts(dtype: str, shape: tuple[int, ...], chunks: tuple[int, ...], compression):
    """The creation property list, dataspace and type of an extendable dataset, made once per kind:
    HDF5 copies them into each dataset, and making them took half of a dataset's creation time."""
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_chunk(chunks)
    plist.set_obj_track_times(False)  # as h5py: a file's bytes do not depend on when it was written
    if compression is not None:
        plist.set_shuffle()
        if compression == "lzf":
            plist.set_filter(h5py.h5z.FILTER_LZF, h5py.h5z.FLAG_OPTIONAL)
        else:
            plist.set_deflate(1 if compression == "gzip" else int(compression[1]))
    space = h5py.h5s.create_simple(shape, (h5py.h5s.UNLIMITED, *shape[1:]))
    return plist, space, h5py.h5t.py_create(np.dtype(dtype))


def write_texts(group, name: str, texts) -> None:
    """A (1-D or 2-D) UTF-8 string dataset; strings HDF5 cannot hold are stored JSON-encoded and their
    flat indices listed in the dataset's ``json_escaped`` attr."""
    texts = np.asarray(texts, dtype=object)
    stored = np.empty(texts.shape, dtype=object)
    escaped = []
    for i, text in enumerate(texts.reshape(-1)):
        text = str(text)
        if not storable(text):
            escaped.append(i)
            text = json.dumps(text)
        stored.reshape(-1)[i] = text
    d = group.create_dataset(name, data=stored, dtype=h5py.string_dtype())
    if escaped:
        d.attrs["json_escaped"] = np.array(escaped, dtype=np.int64)


def read_texts(dataset) -> np.ndarray:
    """The strings ``write_texts`` stored, as an object array of the dataset's shape."""
    texts = dataset.asstr(errors="surrogateescape")[...]
    texts = np.asarray(texts, dtype=object)
    flat = texts.reshape(-1)
    for i in dataset.attrs.get("json_escaped", []):
        flat[int(i)] = json.loads(flat[int(i)])
    return flat.reshape(texts.shape)


@contextlib.contextmanager
def replaced_whole(path: Path, format_name: str, version: int):
    """An HDF5 file to write whole, with its ``format`` and ``format_version``: a hidden temp file beside
    ``path``, renamed onto it when the block ends, removed if it fails (CaptureFileError for OS errors)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        os.close(fd)
    except OSError as e:
        raise CaptureFileError(f"cannot write {path}: {os_reason(e)}", path, os_reason(e)) from None
    try:
        with h5py.File(tmp, "w", libver=("v110", "v110")) as f:
            f.attrs["format"] = format_name
            f.attrs["format_version"] = np.int64(version)
            yield f
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise CaptureFileError(f"cannot write {path}: {os_reason(e)}", path, os_reason(e)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_whole_chunks(d, v: np.ndarray, a: int, rows: int, cols: int) -> None:
    """``v``'s whole chunks (``rows`` x ``cols``) into ``d`` from row ``a`` on, each as it lies where it can."""
    width = v.shape[1]
    for r0 in range(0, len(v), rows):
        block = v[r0: r0 + rows]
        for c0 in range(0, width, cols):
            if c0 == 0 and cols == width:
                data = block if block.flags.c_contiguous else np.ascontiguousarray(block)
            elif c0 + cols <= width:
                data = np.ascontiguousarray(block[:, c0: c0 + cols])
            else:  # the last column chunk sticks out: pad it like HDF5 would
                data = np.zeros((rows, cols), v.dtype)
                data[:, : width - c0] = block[:, c0:]
            d.id.write_direct_chunk((a + r0, c0), data)
