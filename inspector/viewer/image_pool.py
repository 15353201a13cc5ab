"""Incremental max-abs pooling of a growing [tokens, features] array down to screen resolution.

A wide layer (4,096 features) on a 600-pixel-high view, or 2,000 tokens on 1,000 pixels, would make
the image item scale (and drop) rows on every repaint. Instead the image shown is pooled to about one
bin per pixel, with power-of-two bin sizes. Bins are cached: as tokens arrive only the new bins (and
the last, partial one) are pooled, so a frame costs O(new tokens), not O(all tokens). The cache is
rebuilt only when the window, feature range or bin sizes change (bins change only when the token
count doubles), which amortises to O(1) per token.

Max-abs keeps the sign of the value with the largest magnitude in each bin, so a single large
activation stays visible however far the view is zoomed out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inspector.core.colormaps import pool_maxabs, robust_levels  # noqa: F401 - the app's modules take them from here


READ_BYTES = 2 << 20  # rows pooled at a time


def pow2_at_least(x: float) -> int:
    """The smallest power of two >= x (>= 1)."""
    if x <= 1:
        return 1
    return 1 << int(np.ceil(np.log2(x) - 1e-12))


@dataclass(frozen=True)
class PoolKey:
    t0: int  # first row of the window
    tbin: int
    f0: int  # feature range [f0, f1)
    f1: int
    fbin: int
    tmax: int  # rows beyond t0 + tmax are not pooled (zoomed-in views)


@dataclass(frozen=True)
class PooledFrame:
    image: np.ndarray  # [token bins, feature bins] float32
    x0: float  # data rect of the image: rows [x0, x0 + width), features [y0, y0 + height)
    y0: float
    width: float
    height: float
    tbin: int
    fbin: int


def choose_key(n_rows: int, n_features: int, visible_rows: tuple[float, float], visible_features: tuple[float, float],
               px_width: int, px_height: int) -> PoolKey:
    """Bins of about one pixel for the visible window; the window starts at its left edge."""
    px_width, px_height = max(int(px_width), 16), max(int(px_height), 16)
    r0 = int(np.clip(np.floor(visible_rows[0]), 0, max(n_rows - 1, 0)))
    span_rows = max(visible_rows[1] - max(visible_rows[0], 0), 1.0)
    tbin = pow2_at_least(span_rows / px_width)
    t0 = (r0 // tbin) * tbin
    f0 = int(np.clip(np.floor(visible_features[0]), 0, max(n_features - 1, 0)))
    f1 = int(np.clip(np.ceil(visible_features[1]), f0 + 1, max(n_features, 1)))
    fbin = pow2_at_least((f1 - f0) / px_height)
    f0 = (f0 // fbin) * fbin
    return PoolKey(t0, tbin, f0, f1, fbin, tmax=4 * px_width * tbin)


class PooledImage:
    """The cache of pooled bins for one source array and one key."""

    def __init__(self):
        self.key: PoolKey | None = None
        self._buf: np.ndarray | None = None
        self._done = 0  # complete token bins pooled into _buf
        self._source_id = None
        self.last_reset = True  # the last update rebuilt every bin

    def update(self, values: np.ndarray, key: PoolKey, source_id=None) -> PooledFrame | None:
        """Pool rows of ``values`` ([n, width], may be a growing view) under ``key``."""
        n = len(values)
        self.last_reset = key != self.key or source_id != self._source_id or self._buf is None
        if self.last_reset:
            self.key, self._source_id, self._done = key, source_id, 0
            nfb = -(-(key.f1 - key.f0) // key.fbin)
            self._buf = np.empty((64, nfb), dtype=np.float32)
        k = key
        end = min(n, k.t0 + k.tmax)
        if end <= k.t0:
            return None
        complete = (end - k.t0) // k.tbin
        partial = (end - k.t0) % k.tbin
        total = complete + (1 if partial else 0)
        if total > len(self._buf):
            new = np.empty((max(total, 2 * len(self._buf)), self._buf.shape[1]), dtype=np.float32)
            new[: self._done] = self._buf[: self._done]
            self._buf = new
        # Complete bins, read a few MiB at a time: rows read from disk hold the GIL while h5py reads them, and
        # the GUI thread must get it back between reads (pooling runs on a thread of its own for those).
        step = max(1, READ_BYTES // max(1, (k.f1 - k.f0) * values.dtype.itemsize * k.tbin))
        for done in range(self._done, complete, step):
            upto = min(complete, done + step)
            a, b = k.t0 + done * k.tbin, k.t0 + upto * k.tbin
            self._buf[done:upto] = pool_maxabs(np.asarray(values[a:b, k.f0:k.f1]), k.tbin, k.fbin)
            self._done = upto
        if partial:
            a = k.t0 + complete * k.tbin
            self._buf[complete] = pool_maxabs(np.asarray(values[a:end, k.f0:k.f1]), k.tbin, k.fbin)[0]
        image = self._buf[:total]
        width_features = image.shape[1] * k.fbin
        return PooledFrame(image, float(k.t0), float(k.f0), float(total * k.tbin), float(width_features),
                           k.tbin, k.fbin)


def follow_extent(n: int) -> int:
    """Where a following view ends for n tokens: two fixed steps per doubling, so the axis (and the
    bin size) change now and then instead of on every token. Each step redraws the token axis (about
    a millisecond of the GUI thread); a third of the view is empty at most."""
    if n <= 16:
        return 16
    step = 1 << (int(n - 1).bit_length() - 1)  # half of the enclosing power of two
    return -(-n // step) * step
