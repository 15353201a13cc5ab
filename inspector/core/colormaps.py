"""The app's colour scales without Qt, so that the notebook's views colour values exactly as the app does: the
colour tables of pyqtgraph's named maps, read from the data files pyqtgraph ships (pyqtgraph itself, and Qt, are
never imported), the rules from values to table indices, the robust levels and the max-abs pooling of big images."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

DEFAULT_COLORMAP = "cividis"  # the app's and the notebook views'
DIFF_COLORMAP = "CET-CBD1"  # twin comparisons': diverging, colour-blind safe; "auto ±" levels centre 0


def _maps_folder() -> Path:
    spec = importlib.util.find_spec("pyqtgraph")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pyqtgraph is not installed: the colour maps are read from its data files")
    return Path(next(iter(spec.submodule_search_locations))) / "colors" / "maps"


@functools.cache
def lookup_table(name: str) -> np.ndarray:
    """[256, 3] uint8 (read only): ``pyqtgraph.colormap.get(name).getLookupTable(nPts=256, alpha=False)``, the
    table the app colours with, computed as pyqtgraph does from the map's file."""
    folder = _maps_folder()
    path = folder / f"{name}.csv"
    if "/" in name or "\\" in name or not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.csv")))
        raise ValueError(f"unknown colour map {name!r}; the known ones: {known}")
    stops = []
    for line in path.read_text().splitlines():
        line = line.strip()
        parts = line.split(";", 1)[0].split(",")
        if line and not line.startswith(";") and len(parts) >= 3:
            stops.append([int(255 * float(c) + 0.5) for c in parts[:3]])
    stops = np.array(stops, dtype=np.float64)
    at = np.linspace(0.0, 1.0, 256)
    table = np.empty((256, 3), np.uint8)  # pyqtgraph interpolates the stops into bytes, truncating
    for channel in range(3):
        table[:, channel] = np.interp(at, np.linspace(0.0, 1.0, len(stops)), stops[:, channel])
    table.flags.writeable = False
    return table


def colour_indices(values: np.ndarray, lo: float, hi: float, span: int = 255) -> np.ndarray:
    """Indices into a 256-colour table: (value - lo) * span / (hi - lo), clipped to 0..255 and truncated; NaN as 0.
    ``span`` 255 is the app's own rule (its heatmaps and cell grids), 256 pyqtgraph's ImageItem's (the Attention
    tab draws through one)."""
    scale = span / (hi - lo) if hi > lo else 0.0
    idx = np.nan_to_num((values - lo) * scale, nan=0.0, posinf=255.0, neginf=0.0)
    np.clip(idx, 0, 255, out=idx)
    return idx.astype(np.uint8)


def colour(image: np.ndarray, lo: float, hi: float, lut: np.ndarray, piece: int = 256) -> np.ndarray:
    """[token bins, feature bins] floats as [feature bins, token bins] 0xAARRGGBB through ``lut`` (256
    colours spanning lo..hi; NaN as the lowest). In pieces of ``piece`` token bins: off the GUI thread,
    no step may hold the GIL long (indexing by the colour table does)."""
    out = np.empty((image.shape[1], image.shape[0]), dtype=np.uint32)
    for a in range(0, image.shape[0], piece):
        out[:, a:a + piece] = lut[colour_indices(image[a:a + piece], lo, hi)].T
    return out


def robust_levels(image: np.ndarray, symmetric: bool, max_samples: int = 16384) -> tuple[float, float]:
    """Colour levels from the 0.5th/99.5th percentiles of (a strided sample of) the image."""
    flat = image.reshape(-1)
    if flat.size == 0:
        return (-1.0, 1.0) if symmetric else (0.0, 1.0)
    step = max(1, flat.size // max_samples)
    sample = flat[::step]
    sample = sample[np.isfinite(sample)]
    if sample.size == 0:
        return (-1.0, 1.0) if symmetric else (0.0, 1.0)
    if symmetric:
        m = float(np.percentile(np.abs(sample), 99.5))
        m = m if m > 0 else 1.0
        return -m, m
    lo, hi = (float(v) for v in np.percentile(sample, [0.5, 99.5]))
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def pool_maxabs(block: np.ndarray, tbin: int, fbin: int) -> np.ndarray:
    """[nt, nf] -> [ceil(nt/tbin), ceil(nf/fbin)], each bin the value of largest magnitude."""
    nt, nf = block.shape
    if tbin == 1 and fbin == 1:
        return np.asarray(block, dtype=np.float32)
    bt, bf = -(-nt // tbin), -(-nf // fbin)
    if nt % tbin or nf % fbin:
        padded = np.zeros((bt * tbin, bf * fbin), dtype=np.float32)  # 0 is neutral for max-abs
        padded[:nt, :nf] = block
        block = padded
    shaped = block.reshape(bt, tbin, bf, fbin)
    hi = shaped.max(axis=(1, 3))
    lo = shaped.min(axis=(1, 3))
    return np.where(hi >= -lo, hi, lo).astype(np.float32, copy=False)
