"""Patching-sweep files (``activation-inspector-sweep``, layout in docs/sweep-format.md): one HDF5 file
per sweep, plain types only, written to a hidden temp file and renamed into place."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from inspector.experiments.patching import Metric, PatchSpec, SweepResult

from .format import CaptureFileError, get_text, os_reason, read_texts, replaced_whole, set_text, to_json, write_texts

SWEEP_FORMAT = "activation-inspector-sweep"
SWEEP_VERSION = 1
PROMPTS = ("clean", "corrupted")


def write_sweep(result: SweepResult, path: str | os.PathLike, metadata: dict | None = None) -> Path:
    """The sweep (finished or not: cells not run are NaN) and what it ran on, at ``path``."""
    path = Path(path)
    spec = result.spec
    settings = {"clean": spec.clean, "corrupted": spec.corrupted, "direction": spec.direction,
                "answer": spec.metric.answer, "foil": spec.metric.foil, "metric": spec.metric.describe(),
                "hooks": list(spec.hooks), "positions": None if spec.positions is None else list(spec.positions),
                "engine_calls": result.engine_calls, "cells_per_call": result.cells_per_call, **result.settings}
    with replaced_whole(path, SWEEP_FORMAT, SWEEP_VERSION) as f:
        set_text(f, "metadata", to_json(metadata or {}, "the sweep's metadata"))
        set_text(f, "settings", to_json(settings, "the sweep's settings"))
        f.attrs["clean_metric"] = np.float64(result.clean_metric)
        f.attrs["corrupted_metric"] = np.float64(result.corrupted_metric)
        f.attrs["complete"] = np.uint8(result.complete)
        write_texts(f, "hooks", result.hooks)
        f.create_dataset("positions", data=np.asarray(result.positions, np.int64))
        f.create_dataset("raw", data=np.asarray(result.raw, np.float64))
        f.create_dataset("normalized", data=np.asarray(result.normalized, np.float64))
        f.create_dataset("source", data=np.asarray(result.source, np.float32))
        for name in PROMPTS:
            g = f.create_group(f"prompts/{name}")
            g.create_dataset("token_ids", data=np.asarray(result.token_ids[name], np.int64))
            write_texts(g, "token_texts", result.token_texts[name])
    return path


def read_sweep(path: str | os.PathLike) -> tuple[SweepResult, dict]:
    """(the sweep, the metadata it was written with)."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as f:
            if get_text(f, "format") != SWEEP_FORMAT:
                raise CaptureFileError(f"{path} is not an {SWEEP_FORMAT} file", path, "not a sweep file")
            version = int(f.attrs.get("format_version", 0))
            if version > SWEEP_VERSION:
                raise CaptureFileError(f"{path} is sweep format {version}; this version reads up to "
                                       f"{SWEEP_VERSION}: update Activation Inspector", path, "newer format")
            settings = json.loads(get_text(f, "settings"))
            metadata = json.loads(get_text(f, "metadata", "{}"))
            spec = PatchSpec(settings["clean"], settings["corrupted"], tuple(settings["hooks"]),
                             Metric(int(settings["answer"]), None if settings["foil"] is None else int(settings["foil"])),
                             settings["direction"], None if settings["positions"] is None else tuple(settings["positions"]))
            prompts = {name: (f[f"prompts/{name}/token_ids"][()].tolist(),
                              read_texts(f[f"prompts/{name}/token_texts"]).tolist()) for name in PROMPTS}
            extra = {k: v for k, v in settings.items()
                     if k not in ("clean", "corrupted", "direction", "answer", "foil", "metric", "hooks", "positions",
                                  "engine_calls", "cells_per_call")}
            result = SweepResult(spec, read_texts(f["hooks"]).tolist(), f["positions"][()],
                                 {n: p[0] for n, p in prompts.items()}, {n: p[1] for n, p in prompts.items()},
                                 f["source"][()], float(f.attrs["clean_metric"]), float(f.attrs["corrupted_metric"]),
                                 f["raw"][()], int(settings["engine_calls"]), int(settings["cells_per_call"]),
                                 settings=extra)
    except (OSError, KeyError, ValueError) as e:
        if isinstance(e, CaptureFileError):
            raise
        raise CaptureFileError(f"cannot read the sweep {path}: {os_reason(e)}", path, "damaged") from None
    result.stopped = not result.complete
    return result, metadata
