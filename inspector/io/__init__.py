"""Capture files: one HDF5 file per Run, written streaming or at once, read back lazily or in memory.

The layout is documented in ``docs/capture-format.md`` (format ``activation-inspector-capture``,
version ``FORMAT_VERSION``); any HDF5 tool (h5py, h5dump, HDFView) can read it without this code.
Modules: ``format`` (names, version, errors), ``layout`` (where things go), ``latching_file``, ``atomic_file``
(temp file renamed when finished), ``writer``, ``reader``.

API
---
``CaptureFileError(OSError)``
    Every file-level failure (cannot create, disk full, not an HDF5 file, foreign file, newer format,
    truncated/damaged file). ``str()`` names the path and the reason; ``.path`` and ``.reason`` hold
    them. Wrong *arguments* (unknown request, rows of the wrong width, ...) raise ``ValueError``.

``CaptureWriter(path, metadata, hooks, *, compression=None, fsync=True, buffer_bytes=128 MiB)``
    Streaming writer. ``add_request(req)``, ``append_rows(request_id, hook, positions, token_ids,
    values)``, ``update_request(req)`` (tokens, texts, logprobs, interventions, finish reason; may be
    called any number of times, the last call wins), ``release(request_id)`` (the request's rows are
    complete: write them out and free their buffers), ``close() -> Path``, ``abort()``. Use it as a
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
inside metadata/sampling/intervention dicts become lists); ``top_logprobs`` entries come back
as ``TopToken``s and ``intervention_log`` entries as tuples, as typed in ``RequestCapture``.
"""

from .format import FORMAT_NAME, FORMAT_VERSION, CaptureFileError
from .reader import H5Array, LazyHookRows, RunFile, open_run, read_run
from .whole_run import write_run
from .writer import CaptureWriter

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CaptureFileError", "CaptureWriter", "H5Array", "LazyHookRows",
           "RunFile", "open_run", "read_run", "write_run"]
