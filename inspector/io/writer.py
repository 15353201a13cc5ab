"""Writing capture files: streamed as a run is generated (``CaptureWriter``) or a whole run at once
(``write_run``), always through a hidden temp file renamed onto the target at the end (``atomic_file``),
so that an abort, an error, a full disk or a crash never leaves a file under the target's name. This
module buffers the rows and writes them chunk by chunk; ``layout`` says where everything goes."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import h5py
import numpy as np

from inspector.core.arrays import GrowableArray
from inspector.core.blocks import RowBlocks
from inspector.core.dtypes import BFLOAT16, ROW_DTYPES
from inspector.core.hooks import HookPoint
from inspector.core.run import FeatureRows, LensRows, RequestCapture
from inspector.core.shared_ring import MEMORY_BYTES

from .atomic_file import AtomicFile
from .format import (EXPORT_CHUNK_BYTES, check_compression, chunk_cols_for, chunk_rows_for, extendable_dataset,
                     set_text, write_texts, write_whole_chunks)
from .pending import ChunkSlab, Slots, SlotRows
from .layout import (RequestSnapshot, add_request_group, check_hook, header_texts, named_group, write_expert_choice,
                     write_header, write_hook, write_request_data)

INDEX_CHUNK = 4096  # chunk length of the 1-D positions/token_ids datasets


class _HookBuffer:
    """One (request, hook): values not yet written (``pending``: < one chunk, written chunk-aligned; None
    once the request's rows were written out) and its positions/token ids (16 bytes a row, kept in
    memory and written when the request finishes): its request's (``_Request.positions``) while it
    has the same rows as those, else its own."""

    __slots__ = ("name", "width", "dtype", "chunk_rows", "chunk_cols", "pending", "rows_written", "positions",
                 "token_ids", "idx_written", "index_shared", "group", "d_values", "d_positions", "d_token_ids")

    def __init__(self, name: str, width: int, dtype: np.dtype):
        self.name, self.width, self.dtype = name, width, dtype
        self.chunk_rows, self.chunk_cols = chunk_rows_for(width, dtype.itemsize), chunk_cols_for(width, dtype.itemsize)
        self.pending: GrowableArray | SlotRows | None = None
        self.rows_written = 0
        self.positions = self.token_ids = None  # its own, once they differ from its request's
        self.idx_written = 0
        self.index_shared = False  # its positions/token ids datasets are another hook's too: never extended
        self.group = self.d_values = self.d_positions = self.d_token_ids = None  # the group: made with the values

    def gap(self) -> int:
        """Rows from what is written to the next chunk boundary, in 1..chunk_rows."""
        return self.chunk_rows - self.rows_written % self.chunk_rows

    def rows(self) -> int:
        return self.rows_written + (len(self.pending) if self.pending is not None else 0)


class _Request:
    __slots__ = ("index", "group", "hooks_group", "snapshot", "buffers", "index_owners", "lens", "features",
                 "positions", "token_ids", "slot", "in_step")

    def __init__(self, index: int, group, snapshot: RequestSnapshot):
        self.index, self.group, self.snapshot = index, group, snapshot
        self.hooks_group = group["hooks"]
        self.buffers: dict[str, _HookBuffer] = {}
        self.index_owners: list[_HookBuffer] = []  # hooks whose positions/token ids others may link to
        self.lens: dict[str, LensRows] = {}  # small (k ids and logprobs a row): written with the request's data
        self.features: dict[str, FeatureRows] = {}  # small too (k ids and activations a row): likewise
        self.positions, self.token_ids = GrowableArray(np.int64), GrowableArray(np.int64)  # its hooks' rows
        self.slot: int | None = None  # its hooks' chunk buffers' place in their slabs
        # hooks whose rows of a bulk step it takes with one scatter a hook (_in_step; None: not known
        # since its buffers last changed)
        self.in_step: frozenset | None = None


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
        self._lent_ticket = 0  # the file's last write from a staged array (LatchingFile.lending)
        self._slots = Slots()  # a request's place in every hook's slab
        self._slabs: dict[str, ChunkSlab] = {}  # a hook's chunk buffers: of the dtype and chunk rows it began with
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

    def append_blocks(self, blocks: RowBlocks, at_once: bool = False) -> int:
        """A step's rows of all its requests and hooks at once (``StepEvent.blocks``), handed over (the
        caller writes its arrays no more): held as they are, and written a hook at a time once half the
        buffer budget has gathered or the file closes. So a step costs a few calls, not one per
        (request, hook). ``at_once``: written now, not waited for: its arrays may be reused once the
        file's writes up to the ticket returned are done (``wait_written``)."""
        self._check_open()
        for rid in blocks.request_ids:
            self._request(rid)
        unknown = [hook for hook in blocks.values if hook not in self._hooks]
        if unknown:
            raise ValueError(f"unknown hook {unknown[0]!r}; this writer was opened with {list(self._hooks)[:8]}")
        self._staged.append(blocks)
        self._staged_bytes += blocks.nbytes
        if at_once or self._staged_bytes >= self._budget // 2:
            with self._guard("writing rows"):
                self._write_staged(wait=not at_once)
        return self._lent_ticket

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

    def wait_written(self, ticket: int) -> None:
        """(Any thread.) Once the file's writes up to ``ticket`` are done, or the file is closed."""
        io = self._io
        if io is not None:
            io.wait_written(ticket)

    def _write_staged(self, wait: bool = True) -> None:
        """The staged bulk steps in order; requests that finished meanwhile are released."""
        staged, self._staged, self._staged_bytes = self._staged, [], 0
        for blocks in staged:
            self._write_step(blocks)
        for rid in [rid for rid in self._finished if rid in self._requests]:
            self._flush_request(self._requests[rid], final=True)
        self._finished.clear()
        if wait:  # the staged arrays were lent: the caller may reuse them now
            self._io.wait_written(self._lent_ticket)

    def _write_step(self, blocks: RowBlocks) -> None:
        """A bulk step. The requests whose buffers of its hooks are in slabs and hold all their positions
        take their rows together, one scatter a hook (a decode step); others a (request, hook) at a time."""
        hooks = frozenset(blocks.values)
        bounds = blocks.bounds.tolist()
        together: list[tuple[_Request, int, int]] = []
        for rid, a, b in zip(blocks.request_ids, bounds, bounds[1:]):
            if a == b:
                continue
            req = self._requests[rid]
            if req.in_step is None:
                req.in_step = self._in_step(req)
            if hooks <= req.in_step:
                req.positions.append(blocks.positions[a:b])
                req.token_ids.append(blocks.token_ids[a:b])
                together.append((req, a, b - a))
                if hooks != req.in_step:
                    req.in_step = hooks  # the others fall behind its positions
            else:
                for hook, values in blocks.values.items():
                    self._append_rows(rid, hook, blocks.positions[a:b], blocks.token_ids[a:b], [values[a:b]], lend=True)
        if together:
            self._scatter_step(blocks, together)
            if self._buffered > self._budget:
                for r in self._requests.values():
                    self._flush_request(r, final=False)

    @staticmethod
    def _in_step(req: _Request) -> frozenset:
        """The hooks whose buffers are in slabs and hold all of ``req``'s positions (see ``_write_step``)."""
        if req.slot is None:
            return frozenset()
        n = len(req.positions)
        return frozenset(hook for hook, buf in req.buffers.items()
                         if type(buf.pending) is SlotRows and buf.positions is None and buf.rows() == n)

    def _scatter_step(self, blocks: RowBlocks, together: list) -> None:
        """``together``'s rows of ``blocks`` (request, first row, rows) to their slots, a hook at a time;
        a (request, hook) whose rows would pass its slot's room (a chunk boundary) goes on its own."""
        slots = np.fromiter((req.slot for req, _, _ in together), np.int64, len(together))
        starts = np.fromiter((a for _, a, _ in together), np.int64, len(together))
        counts = np.fromiter((n for _, _, n in together), np.int64, len(together))
        for hook, values in blocks.values.items():
            slab = self._slabs[hook]
            if values.dtype != slab.dtype:
                values = values.astype(slab.dtype)
            fits = slab.fill[slots] + counts <= slab.room[slots]
            chosen = None if fits.all() else np.flatnonzero(fits)
            for i in np.flatnonzero(~fits):
                req, a, n = together[i]
                self._push(req, req.buffers[hook], values[a: a + n], lend=True)
            s, c, a = (slots, counts, starts) if chosen is None else (slots[chosen], counts[chosen], starts[chosen])
            if not len(s):
                continue
            slab.scatter(s, c, a, values)  # a slot filled to its room is written with its next rows (_push)
            self._buffered += int(c.sum()) * values.shape[1] * values.dtype.itemsize

    def _append_rows(self, request_id: str, hook: str, positions, token_ids, parts: list, lend: bool = False) -> None:
        """``parts``: the rows' values in pieces, appended in order (never joined first). ``lend``: the
        file may write from them until its writes are done (``LatchingFile.lending``)."""
        req = self._requests.get(request_id)
        if req is None:
            req = self._request(request_id)
        buf = req.buffers.get(hook) or self._new_buffer(req, hook, np.asarray(parts[0]).dtype)
        if buf.pending is None:
            buf.pending = self._new_pending(req, buf)
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
            self._index_rows(req, buf, positions, token_ids)
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

    @staticmethod
    def _index_rows(req: _Request, buf: _HookBuffer, positions: np.ndarray, token_ids: np.ndarray) -> None:
        """Positions/token ids of rows appended to ``buf``: its request's while they agree."""
        if buf.positions is None:
            have, n = buf.rows(), len(positions)
            if have == len(req.positions):
                req.positions.append(positions)
                req.token_ids.append(token_ids)
                req.in_step = None
                return
            if (have + n <= len(req.positions) and np.array_equal(req.positions.view()[have:have + n], positions)
                    and np.array_equal(req.token_ids.view()[have:have + n], token_ids)):
                return
            buf.positions, buf.token_ids = GrowableArray(np.int64), GrowableArray(np.int64)
            buf.positions.append(req.positions.view()[:have])
            buf.token_ids.append(req.token_ids.view()[:have])
            req.in_step = None
        buf.positions.append(positions)
        buf.token_ids.append(token_ids)

    @staticmethod
    def _index(req: _Request, buf: _HookBuffer) -> tuple[np.ndarray, np.ndarray]:
        """``buf``'s positions and token ids so far."""
        if buf.positions is not None:
            return buf.positions.view(), buf.token_ids.view()
        n = buf.rows()
        return req.positions.view()[:n], req.token_ids.view()[:n]

    def _new_buffer(self, req: _Request, hook: str, dtype: np.dtype) -> _HookBuffer:
        info = self._hooks.get(hook)
        if info is None:
            raise ValueError(f"unknown hook {hook!r}; this writer was opened with {list(self._hooks)[:8]}")
        buf = req.buffers[hook] = _HookBuffer(hook, int(info.width),
                                              dtype if dtype in ROW_DTYPES.values() else np.dtype(np.float32))
        req.in_step = None
        self._chunk_room += buf.chunk_rows * buf.width * buf.dtype.itemsize
        self._budget = max(self._given_budget, min(self._chunk_room, MEMORY_BYTES // 4))
        return buf

    def _new_pending(self, req: _Request, buf: _HookBuffer) -> GrowableArray | SlotRows:
        """A chunk buffer: the request's slot of its hook's slab where the slab's dtype and chunk rows
        are the buffer's, else one of its own."""
        slab = self._slabs.get(buf.name)
        if slab is None:
            slab = self._slabs[buf.name] = ChunkSlab(buf.width, buf.dtype, buf.chunk_rows, self._io,
                                                     slots=min(len(self._requests), _SLAB_SLOTS))
        if slab.dtype != buf.dtype or slab.chunk_rows != buf.chunk_rows:
            return GrowableArray(buf.dtype, (buf.width,), capacity=buf.chunk_rows, max_capacity=buf.chunk_rows)
        if req.slot is None:
            req.slot = self._slots.take()
        req.in_step = None
        return SlotRows(slab, req.slot, buf.gap())

    def fit_chunks(self, request_id: str, hook: str, rows: int, dtype: np.dtype) -> int:
        """Size the chunks of a (request, hook) that will get exactly ``rows`` rows (write_run knows):
        uncompressed, about 4 MiB each rather than 256 KiB (a chunk is an HDF5 call and an index entry),
        all of one size so that the padding stays under one row per chunk. Returns a chunk's rows."""
        req = self._request(request_id)
        buf = req.buffers.get(hook) or self._new_buffer(req, hook, dtype)
        if self._compression is None and buf.rows() == 0:
            pieces = max(1, -(-rows // chunk_rows_for(buf.width, buf.dtype.itemsize, EXPORT_CHUNK_BYTES)))
            buf.chunk_rows = max(1, -(-rows // pieces))
            buf.pending = req.in_step = None  # made for these chunks with the first rows
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
        if b > buf.rows_written and buf.pending is not None:
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
                ticket = self._write_values(req, buf, v[i: i + k], exact=False, lend=lend)
                self._lent_ticket = ticket or self._lent_ticket
                i += k
                continue
            take = min(gap - len(buf.pending), n - i)
            buf.pending.append(v[i: i + take])
            self._buffered += take * buf.width * buf.dtype.itemsize
            i += take
            if len(buf.pending) == gap:
                self._flush(req, buf, final=False)

    def _flush(self, req: _Request, buf: _HookBuffer, final: bool) -> None:
        pending = buf.pending
        c = 0 if pending is None else len(pending)
        if c or (final and buf.d_values is None):
            # a slot's whole chunk is lent, the slot filling a spare meanwhile; others are copied by the
            # file, as their buffer is filled again at once
            slot = type(pending) is SlotRows
            # a request's last rows from the start of a chunk: written as the whole chunk, its rows past
            # them zero (as HDF5 pads an edge chunk), not through a selection
            edge = slot and final and c and buf.d_values is not None and buf.rows_written % buf.chunk_rows == 0
            rows = pending.padded() if edge else pending.view() if c else np.empty((0, buf.width), buf.dtype)
            ticket = self._write_values(req, buf, rows, exact=final and buf.d_values is None, lend=slot, rows=c)
            self._buffered -= c * buf.width * buf.dtype.itemsize
            if ticket is not None:
                pending.lend(ticket)
            elif c:
                pending.clear()
        if final:
            buf.pending = None
            self._write_index(req, buf)
            routing = self._hooks[buf.name].routing
            if routing is not None and not routing.unsupported:
                write_expert_choice(buf.group, buf.d_values[:], routing)

    def _flush_request(self, req: _Request, final: bool) -> None:
        for buf in req.buffers.values():
            self._flush(req, buf, final)
        if final and req.slot is not None:
            self._slots.give_back(req.slot)
            req.slot = req.in_step = None

    def _write_values(self, req: _Request, buf: _HookBuffer, v: np.ndarray, exact: bool, lend: bool,
                      rows: int | None = None) -> int | None:
        """``v`` (its first ``rows``, the rest padding to a chunk) appended to the hook's values; ``lend``:
        its whole chunks written from where they lie. Returns the ticket its owner waits for before
        writing there again, None if nothing was lent."""
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
        n, ticket = len(v) if rows is None else rows, None
        if n == 0:
            return None
        a, b = buf.rows_written, buf.rows_written + n
        d = buf.d_values
        d.id.set_extent((b, buf.width))
        if not self._compression and a % buf.chunk_rows == 0 and len(v) % buf.chunk_rows == 0:
            # whole chunks: hand HDF5 the chunk bytes directly (no selection, no gather copy)
            lend = lend and v.flags.c_contiguous
            with self._io.lending(v) if lend else contextlib.nullcontext():
                write_whole_chunks(d, v, a, buf.chunk_rows, buf.chunk_cols)
            ticket = self._io.ticket if lend else None
        else:
            d[a:b] = v[:n]
        buf.rows_written = b
        if type(buf.pending) is SlotRows:
            buf.pending.set_room(buf.gap())
        return ticket

    def _write_index(self, req: _Request, buf: _HookBuffer) -> None:
        """Write positions/token ids up to the rows appended so far (called when a request finishes). A
        request's hooks mostly keep the same rows: a hook whose index equals one already written links
        to its datasets (HDF5 hard links, the same to a reader) instead of writing its own, and a shared
        index is never extended: a hook with more rows later gets one of its own."""
        positions, token_ids = self._index(req, buf)
        n, have = len(positions), buf.idx_written
        if buf.index_shared and n > have:
            for name in ("positions", "token_ids"):
                del buf.group[name]
            buf.d_positions = buf.d_token_ids = None
            buf.index_shared = False
        if buf.d_positions is None:  # made with what there is
            g = buf.group
            owner = next((o for o in req.index_owners if o.idx_written == n and o.d_positions is not None
                          and all(map(np.array_equal, self._index(req, o), (positions, token_ids)))), None)
            if owner is not None:
                for name in (b"positions", b"token_ids"):
                    g.id.links.create_hard(name, owner.group.id, name)
                buf.d_positions, buf.d_token_ids = owner.d_positions, owner.d_token_ids
                buf.idx_written, buf.index_shared, owner.index_shared = n, True, True
                return
            chunk = (max(1, min(n, INDEX_CHUNK)),)
            buf.d_positions, buf.d_token_ids = (extendable_dataset(g, name, "<i8", (n,), chunk, self._compression)
                                                for name in ("positions", "token_ids"))
            for d, data in ((buf.d_positions, positions), (buf.d_token_ids, token_ids)):
                d.id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data))
            buf.idx_written = have = n
            if buf not in req.index_owners:
                req.index_owners.append(buf)
        if n > have:
            for d, data in ((buf.d_positions, positions), (buf.d_token_ids, token_ids)):
                d.resize(n, axis=0)
                d[have:n] = data[have:n]
            buf.idx_written = n

    def _write_request_data(self, req: _Request) -> None:
        write_request_data(req.group, req.snapshot, {name: buf.group for name, buf in req.buffers.items()
                                                     if buf.d_values is not None}, req.lens, req.features)


_SLAB_SLOTS = 256  # at most a slot for each request known when a hook's slab is made (memory is touched as used)
