"""Writing capture files: streamed as a run is generated (``CaptureWriter``) or a whole run at once
(``write_run``), always through a hidden temp file renamed onto the target at the end (``atomic_file``),
so that an abort, an error, a full disk or a crash never leaves a file under the target's name. This
module buffers the rows and writes them chunk by chunk; ``layout`` says where everything goes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable

import h5py
import numpy as np

from inspector.core.arrays import GrowableArray
from inspector.core.blocks import RowBlocks
from inspector.core.dtypes import BFLOAT16, ROW_DTYPES
from inspector.core.hooks import HookPoint
from inspector.core.run import FeatureRows, LensRows, RequestCapture, Run

from .atomic_file import AtomicFile
from .format import (EXPORT_CHUNK_BYTES, check_compression, chunk_cols_for, chunk_rows_for, extendable_dataset,
                     set_text, write_texts)
from .layout import (RequestSnapshot, add_request_group, check_hook, header_texts, named_group, write_expert_choice,
                     write_header, write_hook, write_request_data)

INDEX_CHUNK = 4096  # chunk length of the 1-D positions/token_ids datasets
WRITE_PIECE_BYTES = 32 << 20  # write_run hands arrays over in pieces of about this size (progress)


class _HookBuffer:
    """One (request, hook): values not yet written (< one chunk, written chunk-aligned) and all its
    positions/token ids (16 bytes a row, kept in memory and written when the request finishes)."""

    __slots__ = ("name", "width", "dtype", "chunk_rows", "chunk_cols", "pending", "rows_written", "positions",
                 "token_ids", "idx_written", "index_shared", "group", "d_values", "d_positions", "d_token_ids")

    def __init__(self, name: str, width: int, dtype: np.dtype):
        self.name, self.width, self.dtype = name, width, dtype
        self.chunk_rows, self.chunk_cols = chunk_rows_for(width, dtype.itemsize), chunk_cols_for(width, dtype.itemsize)
        self.pending = self.new_pending()
        self.rows_written = 0
        self.positions, self.token_ids = GrowableArray(np.int64), GrowableArray(np.int64)
        self.idx_written = 0
        self.index_shared = False  # its positions/token ids datasets are another hook's too: never extended
        self.group = self.d_values = self.d_positions = self.d_token_ids = None  # the group: made with the values

    def new_pending(self) -> GrowableArray:
        return GrowableArray(self.dtype, (self.width,), capacity=self.chunk_rows, max_capacity=self.chunk_rows)

    def gap(self) -> int:
        """Rows from what is written to the next chunk boundary, in 1..chunk_rows."""
        return self.chunk_rows - self.rows_written % self.chunk_rows


class _Request:
    __slots__ = ("index", "group", "hooks_group", "snapshot", "buffers", "index_owners", "lens", "features")

    def __init__(self, index: int, group, snapshot: RequestSnapshot):
        self.index, self.group, self.snapshot = index, group, snapshot
        self.hooks_group = group["hooks"]
        self.buffers: dict[str, _HookBuffer] = {}
        self.index_owners: list[_HookBuffer] = []  # hooks whose positions/token ids others may link to
        self.lens: dict[str, LensRows] = {}  # small (k ids and logprobs a row): written with the request's data
        self.features: dict[str, FeatureRows] = {}  # small too (k ids and activations a row): likewise


class CaptureWriter(AtomicFile):
    """Streams a Run into an HDF5 capture file; see ``inspector.io``'s docstring."""

    def __init__(self, path: str | os.PathLike, metadata: dict, hooks: dict[str, HookPoint], *,
                 compression: str | tuple | None = None, fsync: bool = True, buffer_bytes: int = 128 << 20):
        super().__init__(path, fsync)
        self._hooks: dict[str, HookPoint] = dict(hooks)
        for name, info in self._hooks.items():
            check_hook(name, info)
        check_compression(compression)
        self._compression = compression
        # Rows buffered beyond the budget are written out before their chunks are full, which HDF5 then
        # rewrites piece by piece: 1,024 (request, hook)s of a batch-32 step held a capture to a tenth
        # of the disk's speed on the H200. So the budget grows to a chunk per (request, hook), up to a
        # quarter of the machine's memory (docs/performance-notes.md).
        self._budget = self._given_budget = int(buffer_bytes)
        self._chunk_room = 0  # a chunk of every (request, hook)'s
        self._buffered = 0
        self._requests: dict[str, _Request] = {}
        self._staged: list[RowBlocks] = []  # bulk steps not written yet (append_blocks)
        self._staged_bytes = 0
        self._finished: set[str] = set()  # finished requests whose rows are still staged
        # a hook's staged rows, gathered (_gathered), in two arrays that hooks take turns in: each is
        # written from where it lies, and waits for those writes before it is filled again
        self._scratch: list[tuple[np.ndarray | None, int]] = [(None, 0), (None, 0)]  # (array, its last write)
        self._vocabulary: dict[int, str] = {}  # small (a text per token id the lens names): written at the end
        header = header_texts(metadata)
        self._create_temp()
        with self._guard("writing the header"):
            write_header(self._file, header, self._hooks)

    def add_hook(self, name: str, info: HookPoint) -> None:
        """A hook that was not known at opening (a live run learns its hooks as rows come)."""
        self._check_open()
        if name in self._hooks:
            raise ValueError(f"hook {name!r} was already added")
        check_hook(name, info)
        with self._guard(f"adding hook {name!r}"):
            write_hook(self._file, len(self._hooks), name, info)
        self._hooks[name] = info

    # -- lifecycle

    def _drop_datasets(self) -> None:
        for req in self._requests.values():
            for buf in req.buffers.values():
                buf.d_values = buf.d_positions = buf.d_token_ids = None
                buf.pending = None
            req.group = req.hooks_group = None

    def close(self) -> Path:
        """Write what is buffered, finish the file and rename it onto ``path``. Idempotent."""
        if self._state == "closed":
            return self.path
        with self._guard("finishing the file"):
            self._write_staged()
            for req in self._requests.values():
                self._flush_request(req, final=True)
                self._write_request_data(req)
            if self._vocabulary:
                g = self._file.create_group("vocabulary")
                g.create_dataset("ids", data=np.fromiter(self._vocabulary, np.int64, len(self._vocabulary)))
                write_texts(g, "texts", list(self._vocabulary.values()))
            self._finish()
        self._rename()
        return self.path

    # -- requests

    def add_request(self, req: RequestCapture) -> None:
        """Register a request (prompt, sampling, ...). Its rows come through ``append_rows``."""
        self._check_open()
        rid = str(req.request_id)
        if rid in self._requests:
            raise ValueError(f"request {rid!r} was already added")
        snapshot = RequestSnapshot(req)
        with self._guard(f"adding request {rid!r}"):
            index = len(self._requests)
            g = add_request_group(self._file, index, rid, snapshot.prompt)
        self._requests[rid] = _Request(index, g, snapshot)

    def update_request(self, req: RequestCapture) -> None:
        """Record the request's current tokens, texts, logprobs, interventions and finish reason.

        Written at ``close()``; a finish reason also writes out the request's buffered rows: now, or
        with the staged steps that hold some of them (writing those early would cut the staging short).
        """
        self._check_open()
        self._request(req.request_id).snapshot = RequestSnapshot(req)
        if req.finish_reason is None:
            return
        rid = str(req.request_id)
        if any(blocks.span(rid) is not None for blocks in self._staged):
            self._finished.add(rid)
        else:
            self.release(rid)

    def append_rows(self, request_id: str, hook: str, positions, token_ids, values) -> None:
        """Append ``values[n, width]`` with their positions/token ids. A hook's values are stored in the
        dtype of its first rows if that is a row dtype (``dtypes.ROW_DTYPES``: float32, float16,
        bfloat16), else as float32; later rows are converted to it.

        Called once per decode step per (request, hook), so it is kept lean (~10 us for one row); a
        step of many is cheaper through ``append_blocks``.
        """
        self.write_staged()  # checks the file is open
        self._append_rows(request_id, hook, positions, token_ids, [values])

    def append_blocks(self, blocks: RowBlocks) -> None:
        """A step's rows of all its requests and hooks at once (``StepEvent.blocks``), handed over (the
        caller writes its arrays no more): held as they are, and written a hook at a time once half the
        buffer budget has gathered or the file closes. So a step costs a few calls, not one per
        (request, hook), and each (request, hook) is written in pieces of many steps."""
        self._check_open()
        for rid in blocks.request_ids:
            self._request(rid)
        unknown = [hook for hook in blocks.values if hook not in self._hooks]
        if unknown:
            raise ValueError(f"unknown hook {unknown[0]!r}; this writer was opened with {list(self._hooks)[:8]}")
        self._staged.append(blocks)
        self._staged_bytes += blocks.nbytes
        if self._staged_bytes >= self._budget // 2:
            with self._guard("writing rows"):
                self._write_staged()

    @property
    def holding_blocks(self) -> bool:
        """Whether arrays given to ``append_blocks`` are still held, unwritten."""
        return bool(self._staged)

    def write_staged(self) -> None:
        """Write the steps ``append_blocks`` holds now: afterwards their arrays may be reused."""
        if self._state != "open":
            self._check_open()
        if self._staged:
            with self._guard("writing rows"):
                self._write_staged()

    def _write_staged(self) -> None:
        """The staged bulk steps, a hook at a time: the hook's rows of every staged step gathered
        request after request in one copy, then each request's handed on in one piece. So a (request,
        hook) costs a call for all the staged steps, not one a step (at 256 requests and 32 hooks a
        step, those calls had set the writer's pace). Requests that finished meanwhile are released."""
        staged, self._staged, self._staged_bytes = self._staged, [], 0
        orders: dict[tuple, tuple] = {}  # the staged steps a hook has -> where each request's rows lie
        for hook in dict.fromkeys(h for blocks in staged for h in blocks.values):
            having = tuple(k for k, blocks in enumerate(staged) if hook in blocks.values)
            if having not in orders:
                orders[having] = _request_order([staged[k] for k in having])
            spans, gathered = orders[having]
            arrays = [staged[k].values[hook] for k in having]
            rows = None if gathered is None else self._gathered(arrays, gathered[2])
            for rid, k, where in spans:
                if k is None:
                    positions, token_ids, values = gathered[0][where], gathered[1][where], rows[where]
                else:
                    blocks = staged[having[k]]
                    positions, token_ids, values = blocks.positions[where], blocks.token_ids[where], arrays[k][where]
                self._append_rows(rid, hook, positions, token_ids, [values], lend=True)
            if gathered is not None:  # the other scratch array's turn; this one waits for its writes
                self._scratch = [self._scratch[1], (self._scratch[0][0], self._io.ticket)]
        for rid in [rid for rid in self._finished if rid in self._requests]:
            self._flush_request(self._requests[rid], final=True)
        self._finished.clear()
        self._io.wait_written(self._io.ticket)  # the staged arrays were lent: the caller may reuse them now

    def _gathered(self, arrays: list[np.ndarray], places: list[np.ndarray]) -> np.ndarray:
        """``arrays``' rows at ``places`` in the scratch array whose turn it is (``_write_staged`` hands
        the turn on)."""
        n, first = sum(len(a) for a in arrays), arrays[0]
        scratch, written_at = self._scratch[0]
        self._io.wait_written(written_at)
        if scratch is None or scratch.dtype != first.dtype or scratch.shape[1:] != first.shape[1:] or len(scratch) < n:
            scratch = np.empty((n, *first.shape[1:]), first.dtype)
            self._scratch[0] = (scratch, 0)
        out = scratch[:n]
        for a, where in zip(arrays, places):
            out[where] = a
        return out

    def _append_rows(self, request_id: str, hook: str, positions, token_ids, parts: list, lend: bool = False) -> None:
        """``parts``: the rows' values in pieces, appended in order (never joined first). ``lend``: the
        file may write from them until its writes are done (``LatchingFile.lending``)."""
        req = self._requests.get(request_id)
        if req is None:
            req = self._request(request_id)
        buf = req.buffers.get(hook) or self._new_buffer(req, hook, np.asarray(parts[0]).dtype)
        parts = [v if type(v) is np.ndarray and v.dtype == buf.dtype else np.asarray(v).astype(buf.dtype, copy=False)
                 for v in parts]
        if type(positions) is not np.ndarray or positions.dtype != np.int64 or positions.ndim != 1:
            positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        if type(token_ids) is not np.ndarray or token_ids.dtype != np.int64 or token_ids.ndim != 1:
            token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        for v in parts:
            if v.ndim != 2 or v.shape[1] != buf.width:
                raise ValueError(f"rows of shape {v.shape} do not fit hook {hook!r} of width {buf.width}")
        n = sum(len(v) for v in parts)
        if not len(positions) == len(token_ids) == n:
            raise ValueError(f"{n} rows but {len(positions)} positions and {len(token_ids)} token ids")
        try:
            buf.positions.append(positions)
            buf.token_ids.append(token_ids)
            if n and len(buf.pending) + n < buf.gap():  # the common decode step: just buffer it
                buf.pending.extend(parts)
                self._buffered += n * buf.width * buf.dtype.itemsize
            elif n:
                for v in parts:
                    self._push(req, buf, v, lend)
            if self._buffered > self._budget:
                for r in self._requests.values():
                    self._flush_request(r, final=False)
        except Exception as exc:  # noqa: BLE001 - see _guard
            self._fail(self._io.error or exc, f"appending rows of hook {hook!r}", exc)
        if self._io.error is not None:
            self._fail(self._io.error, f"appending rows of hook {hook!r}")

    def _new_buffer(self, req: _Request, hook: str, dtype: np.dtype) -> _HookBuffer:
        info = self._hooks.get(hook)
        if info is None:
            raise ValueError(f"unknown hook {hook!r}; this writer was opened with {list(self._hooks)[:8]}")
        buf = req.buffers[hook] = _HookBuffer(hook, int(info.width),
                                              dtype if dtype in ROW_DTYPES.values() else np.dtype(np.float32))
        self._chunk_room += buf.chunk_rows * buf.width * buf.dtype.itemsize
        self._budget = max(self._given_budget, min(self._chunk_room, _MEMORY_BYTES // 4))
        return buf

    def _fit_chunks(self, request_id: str, hook: str, rows: int, dtype: np.dtype) -> int:
        """Size the chunks of a (request, hook) that will get exactly ``rows`` rows (write_run knows):
        uncompressed, about 4 MiB each rather than 256 KiB (a chunk is an HDF5 call and an index entry),
        all of one size so that the padding stays under one row per chunk. Returns a chunk's rows."""
        req = self._request(request_id)
        buf = req.buffers.get(hook) or self._new_buffer(req, hook, dtype)
        if self._compression is None and buf.rows_written == 0 and not len(buf.pending):
            pieces = max(1, -(-rows // chunk_rows_for(buf.width, buf.dtype.itemsize, EXPORT_CHUNK_BYTES)))
            buf.chunk_rows = max(1, -(-rows // pieces))
            buf.pending = buf.new_pending()
        return buf.chunk_rows

    def append_lens(self, request_id: str, hook: str, columns: dict) -> None:
        """Append the logit lens of rows of ``hook``: ``columns`` as ``LensRows.COLUMNS`` name them."""
        self._check_open()
        req = self._request(request_id)
        if hook not in self._hooks:
            raise ValueError(f"unknown hook {hook!r}; this writer was opened with {list(self._hooks)[:8]}")
        rows = req.lens.get(hook)
        if rows is None:
            top_ids = columns["top_ids"]
            rows = req.lens[hook] = LensRows(np.shape(top_ids)[1] if np.ndim(top_ids) == 2 else 0)
        rows.append(*(columns[name] for name in LensRows.COLUMNS))

    def append_features(self, request_id: str, sae: str, positions, ids, activations) -> None:
        """Append an attached SAE's strongest features of a request's rows (``RequestStep.features``)."""
        self._check_open()
        req = self._request(request_id)
        ids = np.asarray(ids, np.int32)
        if ids.ndim != 2 or np.shape(activations) != ids.shape or len(positions) != len(ids):
            raise ValueError(f"features of SAE {sae!r}: positions [n], ids and activations [n, k] expected, got "
                             f"{np.shape(positions)}, {ids.shape} and {np.shape(activations)}")
        req.features.setdefault(sae, FeatureRows(ids.shape[1])).append(positions, ids, activations)

    def add_vocabulary(self, texts: dict[int, str]) -> None:
        """Texts of token ids the file names beyond its tokens (the lens's top tokens), so a reader
        without the model can show them."""
        self._check_open()
        self._vocabulary.update((int(i), str(t)) for i, t in texts.items())

    def release(self, request_id: str) -> None:
        """Write a request's buffered rows now (as when it finishes), freeing its buffers: its rows
        are complete."""
        state = self._request(request_id)
        with self._guard(f"writing the rows of request {state.snapshot.request_id!r}"):
            if any(blocks.span(state.snapshot.request_id) is not None for blocks in self._staged):
                self._write_staged()
            self._flush_request(state, final=True)

    def read_values(self, request_id: str, hook: str, rows: slice, columns: slice = slice(None)) -> np.ndarray:
        """Rows ``rows`` (a slice with step 1 within the rows appended) of a (request, hook) as appended
        so far, in their stored dtype: those written from the file, the rest from the buffer. What a
        write-through run reads back (``inspector.io.spool``)."""
        self.write_staged()
        buf = self._request(request_id).buffers[hook]
        a, b = rows.start, rows.stop
        parts = []
        if a < buf.rows_written:
            with self._guard(f"reading back rows of hook {hook!r}"):
                part = buf.d_values[a:min(b, buf.rows_written), columns]
            parts.append(part.view(BFLOAT16) if buf.dtype == BFLOAT16 else part)
        if b > buf.rows_written:
            parts.append(buf.pending.view()[max(a, buf.rows_written) - buf.rows_written:b - buf.rows_written, columns])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _request(self, request_id) -> _Request:
        state = self._requests.get(str(request_id))
        if state is None:
            raise ValueError(f"unknown request {request_id!r}; call add_request() first")
        return state

    # -- rows

    def _push(self, req: _Request, buf: _HookBuffer, v: np.ndarray, lend: bool) -> None:
        n, i = len(v), 0
        while i < n:
            gap = buf.gap()
            if not len(buf.pending) and n - i >= gap:  # chunk-aligned: write straight from the caller's array
                k = gap + ((n - i - gap) // buf.chunk_rows) * buf.chunk_rows
                self._write_values(req, buf, v[i: i + k], exact=False, lend=lend)
                i += k
                continue
            take = min(gap - len(buf.pending), n - i)
            buf.pending.append(v[i: i + take])
            self._buffered += take * buf.width * buf.dtype.itemsize
            i += take
            if len(buf.pending) == gap:
                self._flush(req, buf, final=False)

    def _flush(self, req: _Request, buf: _HookBuffer, final: bool) -> None:
        c = len(buf.pending)
        if c or (final and buf.d_values is None):
            # copied by the file, not lent: its chunk is filled again at once
            self._write_values(req, buf, buf.pending.view(), exact=final and buf.d_values is None, lend=False)
            self._buffered -= c * buf.width * buf.dtype.itemsize
            buf.pending.clear()
        if final:
            buf.pending = buf.new_pending()  # frees the chunk's memory
            self._write_index(req, buf)
            routing = self._hooks[buf.name].routing
            if routing is not None and not routing.unsupported:
                write_expert_choice(buf.group, buf.d_values[:], routing)

    def _flush_request(self, req: _Request, final: bool) -> None:
        for buf in req.buffers.values():
            self._flush(req, buf, final)

    def _write_values(self, req: _Request, buf: _HookBuffer, v: np.ndarray, exact: bool, lend: bool) -> None:
        """``v`` appended to the hook's values; ``lend``: its whole chunks written from where they lie
        (its owner waits for them before writing into it again)."""
        if buf.d_values is None:
            if exact:  # everything this hook will get: chunks fit the data, no padding on disk
                buf.chunk_rows = max(1, len(v))
            g = buf.group = named_group(req.hooks_group, buf.name)
            bf16 = buf.dtype == BFLOAT16
            buf.d_values = extendable_dataset(g, "values", "<u2" if bf16 else buf.dtype.newbyteorder("<"),
                                              (0, buf.width), (buf.chunk_rows, buf.chunk_cols), self._compression)
            if bf16:  # HDF5 has no bfloat16: its bit patterns, named
                set_text(buf.d_values, "dtype", "bfloat16", new=True)
        if v.dtype == BFLOAT16:
            v = v.view(np.uint16)
        n = len(v)
        if n == 0:
            return
        a, b = buf.rows_written, buf.rows_written + n
        d = buf.d_values
        d.id.set_extent((b, buf.width))
        if not self._compression and a % buf.chunk_rows == 0 and n % buf.chunk_rows == 0:
            # whole chunks: hand HDF5 the chunk bytes directly (no selection, no gather copy)
            with self._io.lending(v) if lend and v.flags.c_contiguous else contextlib.nullcontext():
                _write_chunks(d, v, a, buf.chunk_rows, buf.chunk_cols)
        else:
            d[a:b] = v
        buf.rows_written = b

    def _write_index(self, req: _Request, buf: _HookBuffer) -> None:
        """Write positions/token ids up to the rows appended so far (called when a request finishes). A
        request's hooks mostly keep the same rows: a hook whose index equals one already written links
        to its datasets (HDF5 hard links, the same to a reader) instead of writing its own, and a shared
        index is never extended: a hook with more rows later gets one of its own."""
        n, have = len(buf.positions), buf.idx_written
        if buf.index_shared and n > have:
            for name in ("positions", "token_ids"):
                del buf.group[name]
            buf.d_positions = buf.d_token_ids = None
            buf.index_shared = False
        if buf.d_positions is None:  # made with what there is
            g = buf.group
            owner = next((o for o in req.index_owners if o.idx_written == n and o.d_positions is not None
                          and np.array_equal(o.positions.view()[:n], buf.positions.view())
                          and np.array_equal(o.token_ids.view()[:n], buf.token_ids.view())), None)
            if owner is not None:
                for name in (b"positions", b"token_ids"):
                    g.id.links.create_hard(name, owner.group.id, name)
                buf.d_positions, buf.d_token_ids = owner.d_positions, owner.d_token_ids
                buf.idx_written, buf.index_shared, owner.index_shared = n, True, True
                return
            chunk = (max(1, min(n, INDEX_CHUNK)),)
            buf.d_positions, buf.d_token_ids = (extendable_dataset(g, name, "<i8", (n,), chunk, self._compression)
                                                for name in ("positions", "token_ids"))
            for d, data in ((buf.d_positions, buf.positions.view()), (buf.d_token_ids, buf.token_ids.view())):
                d.id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))
            buf.idx_written = have = n
            if buf not in req.index_owners:
                req.index_owners.append(buf)
        if n > have:
            for d, data in ((buf.d_positions, buf.positions.view()), (buf.d_token_ids, buf.token_ids.view())):
                d.resize(n, axis=0)
                d[have:n] = data[have:n]
            buf.idx_written = n

    def _write_request_data(self, req: _Request) -> None:
        write_request_data(req.group, req.snapshot, {name: buf.group for name, buf in req.buffers.items()
                                                     if buf.d_values is not None}, req.lens, req.features)


_MEMORY_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _write_chunks(d, v: np.ndarray, a: int, rows: int, cols: int) -> None:
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


def _request_order(staged: list[RowBlocks]) -> tuple:
    """Where each request's rows of ``staged`` steps lie: (spans, None) with spans (request id, step,
    slice of its rows) where each request's lie within one step (one step, or a prefill sent in
    pieces: handed on from there), else (spans, (positions, token ids, places)) with spans (request
    id, None, slice), for the rows laid request after request (each step's going to its ``places``)."""
    runs: dict[str, list[tuple[int, int, int]]] = {}
    for k, blocks in enumerate(staged):
        bounds = blocks.bounds.tolist()
        for rid, a, b in zip(blocks.request_ids, bounds, bounds[1:]):
            runs.setdefault(rid, []).append((k, a, b))
    if all(len(pieces) == 1 for pieces in runs.values()):
        return [(rid, k, slice(a, b)) for rid, ((k, a, b),) in runs.items()], None
    spans, at = [], 0
    places = [np.empty(blocks.rows, np.int64) for blocks in staged]
    for rid, pieces in runs.items():
        start = at
        for k, a, b in pieces:
            places[k][a:b] = np.arange(at, at + b - a)
            at += b - a
        spans.append((rid, None, slice(start, at)))
    positions, token_ids = np.empty(at, np.int64), np.empty(at, np.int64)
    for blocks, where in zip(staged, places):
        positions[where], token_ids[where] = blocks.positions, blocks.token_ids
    return spans, (positions, token_ids, places)


def write_run(run: Run, path: str | os.PathLike, progress: Callable[[float], None] | None = None,
              **writer_options) -> Path:
    """Write a whole Run (in memory or lazily opened) to ``path``; returns the final path."""
    def row_bytes(rows) -> int:
        return rows.width * rows.values.dtype.itemsize + 16

    total = sum(len(rows) * row_bytes(rows) for req in run.requests.values() for rows in req.hooks.values())
    done = 0
    if progress:
        progress(0.0)
    with CaptureWriter(path, run.metadata, run.hooks, **writer_options) as writer:
        writer.add_vocabulary(run.vocabulary)
        for req in run.requests.values():
            writer.add_request(req)
            for name, rows in req.hooks.items():
                n = len(rows)
                positions, token_ids, values = rows.positions, rows.token_ids, rows.values
                chunk = writer._fit_chunks(req.request_id, name, n, rows.values.dtype)
                step = max(chunk, (WRITE_PIECE_BYTES // row_bytes(rows)) // chunk * chunk)
                if n == 0:
                    writer.append_rows(req.request_id, name, positions, token_ids,
                                       np.zeros((0, rows.width), rows.values.dtype))
                for a in range(0, n, step):
                    b = min(n, a + step)
                    writer.append_rows(req.request_id, name, positions[a:b], token_ids[a:b], np.asarray(values[a:b]))
                    done += (b - a) * row_bytes(rows)
                    if progress and total:
                        progress(min(1.0, done / total))
            for name, lens in req.lens.items():
                writer.append_lens(req.request_id, name, {c: lens.column(c) for c in LensRows.COLUMNS})
            for name, features in req.features.items():
                writer.append_features(req.request_id, name, features.positions, features.ids, features.activations)
            writer.update_request(req)
            if req.finish_reason is None:  # update_request wrote a finished one's rows already
                writer.release(req.request_id)
    if progress:
        progress(1.0)
    return Path(writer.path)
