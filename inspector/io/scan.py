"""Scan files (``activation-inspector-scan``, layout in docs/scan-format.md): what a corpus scan found
(``experiments.scan.ScanState``) and what it ran on, rewritten whole to a hidden temp file and renamed
into place at every save, so an interrupted scan leaves the last complete save to resume from."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from inspector.experiments.scan import ScanState

from .format import CaptureFileError, get_text, read_texts, replaced_whole, set_text, to_json, write_texts

SCAN_FORMAT = "activation-inspector-scan"
SCAN_VERSION = 1
ARRAYS = ("top_activations", "top_documents", "top_positions", "top_windows", "histogram")


def write_scan(state: ScanState, settings: dict, vocabulary: dict[int, str], path) -> Path:
    """``settings``: what the scan ran on (model, corpus and its fingerprint, hook, SAE, …), JSON;
    ``vocabulary``: the texts of the token ids in the windows."""
    path = Path(path)
    with replaced_whole(path, SCAN_FORMAT, SCAN_VERSION) as f:
        set_text(f, "settings", to_json(settings, "the scan's settings"))
        for name in ("documents_done", "tokens_done", "units", "top"):
            f.attrs[name] = np.int64(getattr(state, name))
        for name in ARRAYS:
            f.create_dataset(name, data=getattr(state, name))
        if state.edges is not None:
            f.create_dataset("histogram_edges", data=np.asarray(state.edges, np.float64))
        f.create_dataset("truncated_documents", data=np.asarray(state.truncated, np.int64))
        ids = np.asarray(sorted(vocabulary), np.int64)
        g = f.create_group("vocabulary")
        g.create_dataset("ids", data=ids)
        write_texts(g, "texts", [vocabulary[int(i)] for i in ids])
    return path


def read_scan(path) -> tuple[ScanState, dict, dict[int, str]]:
    """(the state, the settings, the vocabulary) of a scan file; CaptureFileError if it is not one."""
    path = Path(path)

    def damaged(reason: str):
        return CaptureFileError(f"{path} is not a scan file this reads: {reason}", path, reason)

    try:
        with h5py.File(path, "r") as f:
            if get_text(f, "format") != SCAN_FORMAT or int(f.attrs.get("format_version", -1)) != SCAN_VERSION:
                raise damaged(f"format {get_text(f, 'format')!r} version {f.attrs.get('format_version')}")
            settings = json.loads(get_text(f, "settings") or "{}")
            state = ScanState(int(f.attrs["units"]), int(f.attrs["top"]), **{name: f[name][()] for name in ARRAYS},
                              edges=f["histogram_edges"][()] if "histogram_edges" in f else None,
                              documents_done=int(f.attrs["documents_done"]), tokens_done=int(f.attrs["tokens_done"]),
                              truncated=f["truncated_documents"][()].tolist())
            vocabulary = dict(zip(f["vocabulary/ids"][()].tolist(), read_texts(f["vocabulary/texts"]).tolist()))
    except (OSError, KeyError, ValueError) as e:
        raise damaged(str(e)) from None
    return state, settings, vocabulary
