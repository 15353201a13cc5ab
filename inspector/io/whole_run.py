"""Writing a whole run at once (an export, a notebook's save): through ``CaptureWriter``, each (request,
hook) in chunks sized to its rows, in pieces that let progress be told."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np

from inspector.core.run import LensRows, Run

from .writer import CaptureWriter

WRITE_PIECE_BYTES = 32 << 20  # arrays are handed over in pieces of about this size (progress)


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
                chunk = writer.fit_chunks(req.request_id, name, n, rows.values.dtype)
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
