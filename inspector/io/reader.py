"""Reading capture files: validated on open, with clear errors for foreign or damaged files; hook
values stay on disk until read (``open_run``), or everything is loaded at once (``read_run``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import h5py
import numpy as np

from inspector.core.attention import AttentionGeometry
from inspector.core.dtypes import BFLOAT16, ROW_DTYPES
from inspector.core.routing import Routing
from inspector.core.hooks import HookPoint
from inspector.core.run import FeatureRows, HookRows, LensRows, RequestCapture, Run, TopToken

from .format import FORMAT_NAME, FORMAT_VERSION, CaptureFileError, get_text, os_reason, read_texts, unescape_name


class H5Array:
    """A read-only, h5py-backed array: ``shape``, ``dtype``, slicing and ``np.asarray()`` read on demand.
    A dataset of bfloat16 bit patterns (its ``dtype`` attribute says "bfloat16") reads as bfloat16."""

    def __init__(self, dataset: h5py.Dataset, owner: "RunFile"):
        self._dataset, self._owner = dataset, owner
        self.shape: tuple[int, ...] = tuple(dataset.shape)
        self._bf16 = dataset.dtype == np.uint16 and get_text(dataset, "dtype") == "bfloat16"
        self.dtype = BFLOAT16 if self._bf16 else dataset.dtype

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape)))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> np.ndarray:
        out = self._read(key)
        return out.view(BFLOAT16) if self._bf16 else out

    def _read(self, key) -> np.ndarray:
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
        reason = f"damaged: {os_reason(exc)}"
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
                values = H5Array(d, self._owner)
                if values.dtype not in ROW_DTYPES.values():
                    raise self._damaged(f"holds values of type {d.dtype}, not float32, float16 or bfloat16")
                self._lazy_values = values
            except CaptureFileError:
                raise
            except Exception as exc:  # noqa: BLE001 - unreadable dataset header
                raise self._damaged(f"has an unreadable 'values' dataset ({os_reason(exc)})") from exc
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
            raise self._damaged(f"has an unreadable {name!r} dataset ({os_reason(exc)})") from exc
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

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def append(self, *args, **kwargs):
        raise TypeError("hook rows read from a capture file are read-only; use read_run() for an in-memory copy")

    keep = append

    def snapshot(self) -> "LazyHookRows":
        return self  # never grows

    def load(self) -> HookRows:
        rows = HookRows(self.width, dtype=self.dtype)
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
            reason = os_reason(exc)
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
        fail(os_reason(exc), exc=exc)
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
        reason = os_reason(exc)
        fail(f"damaged: {reason}", f"cannot open {path}: the file is damaged ({reason})", exc)
    try:
        fmt = get_text(f, "format")
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
        reason = os_reason(exc)
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
        text = get_text(obj, key)
        if text is None:
            return default
        try:
            return json.loads(text)
        except ValueError as exc:
            raise damaged(f"the {key!r} attribute of {obj.name} is not valid JSON: {exc}") from exc

    def read_lens(request_group) -> dict[str, LensRows]:
        """The request's logit lens by hook (absent in files written without one)."""
        lens = {}
        for link, hg in (group(request_group, "lens").items() if "lens" in request_group else ()):
            name = get_text(hg, "name") or unescape_name(link)
            if name not in hooks:
                raise damaged(f"{hg.name} holds a lens of hook {name!r}, which /hooks does not describe")
            columns = {column: dataset(hg, column) for column in LensRows.COLUMNS}
            n, ids = len(columns["positions"]), columns["top_ids"]
            if ids.ndim != 2 or any(len(a) != n for a in columns.values()):
                raise damaged(f"the lens datasets of {hg.name} have shapes "
                              f"{ {c: a.shape for c, a in columns.items()} }")
            lens[name] = LensRows(ids.shape[1])
            lens[name].append(*columns.values())
        return lens

    def read_features(request_group) -> dict[str, FeatureRows]:
        """The request's SAE features by SAE (absent in files written without one)."""
        features = {}
        for link, fg in (group(request_group, "features").items() if "features" in request_group else ()):
            columns = {column: dataset(fg, column) for column in ("positions", "ids", "activations")}
            ids = columns["ids"]
            if ids.ndim != 2 or columns["activations"].shape != ids.shape or len(columns["positions"]) != len(ids):
                raise damaged(f"the feature datasets of {fg.name} have shapes "
                              f"{ {c: a.shape for c, a in columns.items()} }")
            name = get_text(fg, "name") or unescape_name(link)
            features[name] = FeatureRows(ids.shape[1])
            features[name].append(*columns.values())
        return features

    meta_text = get_text(f, "metadata")
    if meta_text is not None:
        metadata = json_attr(f, "metadata", {})
    else:  # written by another tool: take the documented root attributes
        metadata = {k: get_text(f, k) for k in ("app_version", "vllm_version", "model_path", "dtype",
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
        name = get_text(g, "name") or unescape_name(link)
        attention, routing = json_attr(g, "attention", None), json_attr(g, "routing", None)
        try:
            attention = AttentionGeometry(**attention) if attention is not None else None
        except TypeError as exc:
            raise damaged(f"the 'attention' attribute of {g.name} is not an attention geometry: {exc}") from exc
        try:
            routing = Routing.from_dict(routing) if routing is not None else None
        except TypeError as exc:
            raise damaged(f"the 'routing' attribute of {g.name} is not a routing rule: {exc}") from exc
        info = HookPoint(name, get_text(g, "alias", name), get_text(g, "module_path", ""), get_text(g, "kind", ""),
                        int(g.attrs["width"]), int(g.attrs.get("layer", -1)), get_text(g, "source_dtype", "float32"),
                        attention, routing=routing)
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
        rid = get_text(g, "request_id")
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
        texts = read_texts(td).tolist()
        logprobs = dataset(g, "logprobs").astype(np.float64, copy=False).tolist()
        ids, vals = dataset(g, "top_logprob_ids"), dataset(g, "top_logprob_values")
        counts = dataset(g, "top_logprob_counts")
        if ids.ndim != 2 or vals.shape != ids.shape or counts.shape != (ids.shape[0],):
            raise damaged(f"the top-logprob datasets of {g.name} have shapes {ids.shape}, {vals.shape}, {counts.shape}")
        td = g.get("top_logprob_texts")  # absent in files written before the texts were stored
        top_texts = read_texts(td) if isinstance(td, h5py.Dataset) else np.full(ids.shape, "", dtype=object)
        if top_texts.shape != ids.shape:
            raise damaged(f"the top-logprob texts of {g.name} have shape {top_texts.shape}, not {ids.shape}")
        top = [[TopToken(*entry) for entry in zip(ids[r, :c].tolist(), vals[r, :c].tolist(), top_texts[r, :c].tolist())]
               for r, c in enumerate(counts.tolist())]
        req = RequestCapture(
            request_id=rid,
            prompt=get_text(g, "prompt", ""),
            prompt_token_ids=tokens[:n_prompt].tolist(),
            sampling=json_attr(g, "sampling", {}),
            generated_token_ids=tokens[n_prompt:].tolist(),
            token_texts=texts,
            logprobs=logprobs,
            top_logprobs=top,
            intervention_log=[(int(p), list(ivs)) for p, ivs in json_attr(g, "intervention_log", [])],
            finish_reason=get_text(g, "finish_reason"),
            twin_role=get_text(g, "twin_role"),
            twin_of=get_text(g, "twin_of"),
        )
        hook_rows = []
        for hlink, hg in group(g, "hooks").items():
            if not isinstance(hg, h5py.Group):
                continue
            name = get_text(hg, "name") or unescape_name(hlink)
            if name not in hooks:
                raise damaged(f"{hg.name} holds rows of hook {name!r}, which /hooks does not describe")
            missing = {"values", "positions", "token_ids"} - set(hg.keys())
            if missing:
                raise damaged(f"{hg.name} has no {sorted(missing)} dataset(s)")
            hook_rows.append((order[name], name, LazyHookRows(hg, hooks[name].width, owner)))
            if get_text(hg, "window"):
                req.windows[name] = get_text(hg, "window")
        hook_rows.sort(key=lambda x: x[0])
        req.hooks = {name: rows for _, name, rows in hook_rows}
        req.lens = read_lens(g)
        req.features = read_features(g)
        requests[rid] = req
    vocabulary = {}
    if "vocabulary" in f:  # absent in files without a lens
        vg = group(f, "vocabulary")
        ids, vd = dataset(vg, "ids"), vg.get("texts")
        if not isinstance(vd, h5py.Dataset) or vd.shape != ids.shape:
            raise damaged(f"{vg.name} needs a 'texts' dataset of the shape of 'ids' {ids.shape}")
        vocabulary = dict(zip(ids.tolist(), read_texts(vd).tolist()))
    return Run(metadata=metadata, hooks=hooks, requests=requests, vocabulary=vocabulary)


def open_run(path: str | os.PathLike) -> RunFile:
    """Open and validate a capture file; hook values stay on disk until read (see RunFile)."""
    return RunFile(path)


def read_run(path: str | os.PathLike) -> Run:
    """Read a capture file completely into memory (plain HookRows); the file is closed on return."""
    with open_run(path) as rf:
        run = rf.run
        for req in run.requests.values():
            req.hooks = {name: rows.load() for name, rows in req.hooks.items()}
        return Run(metadata=run.metadata, hooks=run.hooks, requests=run.requests, vocabulary=run.vocabulary)
