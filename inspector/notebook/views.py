"""Inline views for a notebook: a cache entry, an attention pattern, a logit lens, a twin comparison and a run show
themselves in Jupyter (``_repr_html_``: an inline PNG with the tokens along its axes, a title and a colour legend;
``_repr_png_`` where HTML is not shown), coloured through the app's own colour tables and level rules
(``inspector.core.colormaps``), so that a figure reads as the app's. Self-contained: no script, no widget, no
file beside the notebook."""

from __future__ import annotations

import base64
import html
import math
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inspector.core.colormaps import (DEFAULT_COLORMAP, DIFF_COLORMAP, colour_indices, lookup_table, pool_maxabs,
                                         robust_levels)
from inspector.core.dtypes import as_float32
from inspector.core.hooks import HookPoint, installed_name
from inspector.core.labels import default_hook, display_token, short_hook_label
from inspector.core.run import Run

MAX_BINS = (1024, 320)  # (columns, rows) drawn at most: past them bins are pooled max-abs, as the app pools to pixels
HEATMAP_PX = (720, 320)  # about the room a heatmap takes: smaller ones get bigger cells ...
CELL_PX = 32  # ... up to this many pixels a side
PATTERN_PX = (480, 240)  # the room of a head's pattern shown alone, or among other heads
PATTERN_BINS = 512  # queries or keys drawn at most (pooled by their maximum beyond, as the Attention tab pools)
WRAP_PX, GAP_PX = 1000, 12  # a PNG's panels stand side by side up to this width
BAR_PX = 40  # the height of a comparison's relative-change strip
LABEL_PX, LABEL_CHARS = 12, 12  # room a label needs across (narrower cells are labelled every k-th); its length
LENS_CELL_PX = 66  # the Lens tab's cell width (ui.cell_grid.CELL_W)
EMPTY = (242, 242, 242)  # an empty lens cell (ui.cell_grid.EMPTY_BG)
BLANK = (255, 255, 255)  # the later keys of a pattern: the Attention tab's white background shows through there
BAR = (0, 114, 178)  # Okabe-Ito blue, the Compare tab's change colour
FONT = "font-family:ui-monospace,Menlo,Consolas,monospace;font-size:10px"


@dataclass
class Panel:
    """One image of a figure: ``values`` [rows, columns] as coloured, ``rgb`` a pixel per cell, drawn with cells of
    ``cell`` (width, height) pixels; ``columns``/``rows``: per column/row its (number, text or None), the text
    shown where each has room, else the number (as the Attention tab's axes); ``bars``: per column a value drawn as
    a bar under the image."""

    title: str
    values: np.ndarray
    rgb: np.ndarray
    cell: tuple[int, int]
    columns: list[tuple[int, str | None]] = field(default_factory=list)
    rows: list[tuple[int, str | None]] = field(default_factory=list)
    bars: np.ndarray | None = None

    def picture(self) -> np.ndarray:
        """The panel's pixels: its cells upscaled by nearest neighbour, then its bars."""
        width, height = self.cell
        image = np.repeat(np.repeat(self.rgb, height, axis=0), width, axis=1)
        if self.bars is None:
            return image
        bars = np.nan_to_num(self.bars, nan=0.0)
        peak = bars.max(initial=0.0)
        heights = np.repeat(np.round(bars / peak * (BAR_PX - 1)) if peak > 0 else np.zeros_like(bars), width)
        strip = np.full((BAR_PX + 4, image.shape[1], 3), 255, np.uint8)  # a gap, the bars, their baseline
        strip[-1] = 160
        strip[4:-1][np.arange(BAR_PX - 1)[:, None] >= BAR_PX - 1 - heights[None, :]] = BAR
        return np.concatenate([image, strip])


class Figure:
    """Panels on one colour scale: ``colormap`` spanning ``levels`` (lo, hi); ``scale`` says what the colour shows,
    ``note`` how to read the panels."""

    def __init__(self, title: str, panels: list[Panel], colormap: str, levels: tuple[float, float], scale: str,
                 note: str = ""):
        self.title, self.panels, self.colormap, self.levels, self.scale, self.note = (
            title, panels, colormap, levels, scale, note)

    def _repr_png_(self) -> bytes:
        return encode_png(_compose([panel.picture() for panel in self.panels]))

    def save(self, path) -> Path:
        """The PNG, written to ``path``."""
        path = Path(path)
        path.write_bytes(self._repr_png_())
        return path

    def _repr_html_(self) -> str:
        panels = "".join(_panel_html(panel) for panel in self.panels)
        return self._frame(f'<div style="display:flex;flex-wrap:wrap;gap:10px 18px;align-items:flex-start">'
                           f'{panels}</div>')

    def _frame(self, body: str) -> str:
        lo, hi = self.levels
        strip = np.repeat(lookup_table(self.colormap)[None], 10, axis=0)
        legend = (f'<div style="display:flex;align-items:center;gap:6px;margin-top:6px;{FONT}">'
                  f'<span>{lo:.4g}</span>{_img(strip, "colour scale")}<span>{hi:.4g}</span>'
                  f'<span style="color:#666">{html.escape(self.scale)} · {html.escape(self.colormap)}</span></div>')
        note = f'<div style="color:#666;margin-top:4px">{html.escape(self.note)}</div>' if self.note else ""
        return (f'<div style="font-family:sans-serif;font-size:12px;color:#222;overflow-x:auto">'
                f'<div style="font-weight:600;font-size:13px;margin-bottom:4px">{html.escape(self.title)}</div>'
                f'{body}{legend}{note}</div>')


class CompareView(Figure):
    """A twin comparison: ``difference`` [positions, features] b − a, and ``relative_change`` per position
    ‖b − a‖ / ‖a‖ (NaN where ‖a‖ = 0)."""

    def __init__(self, difference: np.ndarray, relative_change: np.ndarray, **figure):
        super().__init__(**figure)
        self.difference, self.relative_change = difference, relative_change


class LensView(Figure):
    """A logit lens grid: in HTML a table of coloured cells, each naming its top token, as the Lens tab draws it."""

    def __init__(self, top_tokens: np.ndarray, **figure):
        super().__init__(**figure)
        self.top_tokens = top_tokens  # [layers, pos] texts, made visible

    def _repr_html_(self) -> str:
        panel = self.panels[0]
        inputs = [str(c) if text is None else text for c, text in panel.columns]
        cell = f"width:{LENS_CELL_PX - 6}px;overflow:hidden;text-overflow:ellipsis;white-space:pre;text-align:center"
        head = "".join(f'<th title="{html.escape(text)}" style="background:#e6e6e6;color:#3c3c3c;font-weight:normal;'
                       f'padding:2px 3px;border:1px solid #fff"><div style="{cell}">{html.escape(text)}</div></th>'
                       for text in inputs)
        lines = []
        for r, (_, label) in enumerate(panel.rows):
            cells = []
            for c in range(panel.values.shape[1]):
                p = float(panel.values[r, c])
                if not np.isfinite(p):
                    cells.append(f'<td style="background:rgb{EMPTY};border:1px solid #fff"></td>')
                    continue
                red, green, blue = (int(v) for v in panel.rgb[r, c])
                ink = "#fff" if 0.299 * red + 0.587 * green + 0.114 * blue < 140 else "rgb(20,20,20)"  # the app's rule
                text = self.top_tokens[r, c]
                tip = f"{label} · position {c} {inputs[c]!r} · top {text!r} p = {p:.3f}"
                cells.append(f'<td title="{html.escape(tip)}" style="background:rgb({red},{green},{blue});color:{ink};'
                             f'padding:3px;border:1px solid #fff"><div style="{cell}">{html.escape(text)}</div></td>')
            lines.append(f'<tr><th style="text-align:left;font-weight:normal;padding:2px 6px;background:#fff;'
                         f'white-space:nowrap">{html.escape(label)}</th>{"".join(cells)}</tr>')
        table = (f'<table style="border-collapse:collapse;{FONT};font-size:11px;margin:0">'
                 f'<tr><th style="color:#6e6e6e;font-weight:normal;background:#fff;text-align:left;padding:2px 6px;'
                 f'white-space:nowrap">'
                 f'input →</th>{head}</tr>{"".join(lines)}</table>')
        return self._frame(table)


def activation_view(values, tokens=None, title: str = "", heads: bool = False,
                    colormap: str = DEFAULT_COLORMAP) -> Figure:
    """A cache entry drawn as the app's heatmap draws a hook's rows: a column per position, a row per feature (0 at
    the top), coloured between robust levels (the 0.5th and 99.5th percentiles). ``values``: [pos, d] or
    [batch, pos, d]; with ``heads``, [pos, head, d_head] or [batch, pos, head, d_head], the heads one after another
    down the side as the app's rows hold them. ``tokens``: the prompt's token texts, or a list per prompt; positions
    past them (a shorter prompt's padding) are left out. A batch is drawn a prompt per panel, on one scale."""
    batch = _prompts(values, heads)
    texts = _prompt_tokens(tokens, len(batch), batch.shape[1])
    blocks = []
    for i, (rows, prompt) in enumerate(zip(batch, texts)):
        n = len(prompt) if prompt is not None else len(rows)
        blocks.append((f"prompt {i}" if len(batch) > 1 else "", rows[:n], _position_labels(range(n), prompt)))
    panels, levels = _heatmap_panels(blocks, colormap, symmetric=False)
    what = "head × d_head" if heads else "feature"
    return Figure(title, panels, colormap, levels, "value (robust levels: 0.5th–99.5th percentile)",
                  f"a column per token, a row per {what}, 0 at the top" + _pooled_note(panels, batch.shape[2]))


def pattern_view(pattern, tokens=None, head: int | None = None, title: str = "",
                 colormap: str = DEFAULT_COLORMAP) -> Figure:
    """Attention weights as the app's Attention tab draws a head: a row per query token, a column per key token, on
    levels 0..1, the later keys (which a causal query never sees) blank. ``pattern``: [head, q, k], [q, k] or
    [1, head, q, k] (``cache["pattern", L]``); a panel per head, or ``head``'s alone. The queries are the last q of
    the k positions; ``tokens`` (the k keys' texts) shorter than k cut the padding off."""
    data = _array(pattern)
    if data.ndim == 4:
        if len(data) != 1:
            raise ValueError(f"a pattern of {len(data)} prompts {tuple(data.shape)}: pass one of them, e.g. pattern[0]")
        data = data[0]
    if data.ndim not in (2, 3):
        raise ValueError(f"a pattern of shape {tuple(data.shape)}: expected [q, k], [head, q, k] or [1, head, q, k]")
    names = [f"head {h}" for h in range(len(data))] if data.ndim == 3 else [""]
    data = data.reshape(-1, *data.shape[-2:])
    if head is not None:
        if not -len(data) <= head < len(data):
            raise ValueError(f"head {head} of a pattern of {len(data)} heads")
        names, data = [names[head]], data[head:head + 1]
    offset = data.shape[2] - data.shape[1]  # keys before the first query
    if offset < 0:
        raise ValueError(f"a pattern of {data.shape[1]} queries over {data.shape[2]} keys: more queries than keys")
    texts = _prompt_tokens(tokens, 1, data.shape[2])[0]
    if texts is not None:
        if len(texts) <= offset:
            raise ValueError(f"{len(texts)} tokens leave none of the {data.shape[1]} queries")
        data = data[:, :len(texts) - offset, :len(texts)]
    _, queries, keys = data.shape
    row_bin, column_bin = _bin(queries, PATTERN_BINS), _bin(keys, PATTERN_BINS)
    last_query = offset + np.minimum(row_bin * np.arange(1, -(-queries // row_bin) + 1), queries) - 1
    blank = last_query[:, None] < column_bin * np.arange(-(-keys // column_bin))[None, :]
    side = _cell(max(blank.shape), PATTERN_PX[0] if len(data) == 1 else PATTERN_PX[1])
    lut = lookup_table(colormap)
    labels = _position_labels(range(keys), texts)
    panels = []
    for name, weights in zip(names, data):
        image = np.where(blank, np.nan, pool_maxabs(weights, row_bin, column_bin))
        rgb = lut[colour_indices(image, 0.0, 1.0, span=256)]
        rgb[blank] = BLANK
        panels.append(Panel(name, image, rgb, (side, side), labels[::column_bin], labels[offset::row_bin][:len(image)]))
    pooled = "" if row_bin == column_bin == 1 else f"; pooled {row_bin}×{column_bin} tokens a cell, by their maximum"
    return Figure(title, panels, colormap, (0.0, 1.0), "attention weight",
                  f"a row per token (the query), a column per token it attends to (the key); later keys blank{pooled}")


def lens_view(top_tokens, probabilities, tokens=None, layer_labels=None, title: str = "logit lens",
              colormap: str = DEFAULT_COLORMAP) -> LensView:
    """The logit lens as the app's Lens tab draws it: a row per layer (the first at the top), a column per position,
    each cell naming the top token predicted next there (``top_tokens`` [layers, pos] of texts), coloured by its
    probability (``probabilities`` [layers, pos] in 0..1; NaN: an empty cell). ``tokens``: the input's texts."""
    p = _array(probabilities)
    if p.ndim != 2:
        raise ValueError(f"probabilities of shape {tuple(p.shape)}: expected [layers, pos]")
    try:
        texts = np.asarray(top_tokens, dtype=object)
    except ValueError as exc:
        raise ValueError(f"top_tokens must be [layers, pos] texts, the shape of probabilities {p.shape}") from exc
    if texts.shape != p.shape:
        raise ValueError(f"top_tokens of shape {texts.shape} and probabilities of shape {p.shape}: they must match")
    layers, positions = p.shape
    labels = [str(label) for label in layer_labels] if layer_labels is not None else [f"L{i}" for i in range(layers)]
    if len(labels) != layers:
        raise ValueError(f"{len(labels)} layer labels for {layers} layers")
    inputs = _prompt_tokens(tokens, 1, positions)[0]
    if inputs is not None and len(inputs) != positions:
        raise ValueError(f"{len(inputs)} tokens for {positions} positions")
    shown = np.array([[display_token(str(t)) for t in row] for row in texts], dtype=object).reshape(p.shape)
    rgb = lookup_table(colormap)[colour_indices(p, 0.0, 1.0)]
    rgb[~np.isfinite(p)] = EMPTY
    cell = (_cell(positions, HEATMAP_PX[0]), _cell(layers, HEATMAP_PX[1]))
    panel = Panel("", p, rgb, cell, _position_labels(range(positions), inputs), list(enumerate(labels)))
    return LensView(shown, title=title, panels=[panel], colormap=colormap, levels=(0.0, 1.0),
                    scale="probability of the top token",
                    note="cell: the most likely next token at that point · colour: its probability")


def compare_view(a, b, tokens=None, title: str = "", heads: bool = False) -> CompareView:
    """Twins compared as the app's Compare tab draws a hook: b − a per position (columns) and feature (rows), on its
    diverging map with symmetric robust levels (0 in the middle), and under it per position the relative L2 change
    ‖b − a‖ / ‖a‖. ``a``, ``b``: one prompt's [pos, d] (or [1, pos, d]; with ``heads`` [pos, head, d_head]),
    compared at the positions both have."""
    x, y = (_prompts(v, heads) for v in (a, b))
    if len(x) != 1 or len(y) != 1:
        raise ValueError(f"a batch of {max(len(x), len(y))} prompts: compare one prompt at a time, e.g. a[0], b[0]")
    if x.shape[2] != y.shape[2]:
        raise ValueError(f"a has {x.shape[2]} features a position, b {y.shape[2]}")
    n = min(x.shape[1], y.shape[1])
    texts = _prompt_tokens(tokens, 1, n)[0]
    n = len(texts) if texts is not None else n
    difference = y[0, :n] - x[0, :n]
    norm = np.linalg.norm(x[0, :n], axis=1)
    change = np.divide(np.linalg.norm(difference, axis=1), norm, out=np.full(n, np.nan, np.float32), where=norm > 0)
    panels, levels = _heatmap_panels([("b − a", difference, _position_labels(range(n), texts))], DIFF_COLORMAP,
                                     symmetric=True)
    panels[0].bars = pool_maxabs(np.nan_to_num(change)[:, None], _bin(n, MAX_BINS[0]), 1)[:, 0]
    note = ("a column per token, a row per feature; diverging colours, 0 in the middle. Bars: the relative L2 change "
            "‖b − a‖ / ‖a‖ of each position")
    if np.isfinite(change).any():
        top = int(np.nanargmax(change))
        note += f", largest {change[top]:.3g} at position {top}" + (f" {display_token(texts[top])!r}" if texts else "")
    if x.shape[1] != y.shape[1]:
        note += f"; compared at the first {n} positions (a has {x.shape[1]}, b {y.shape[1]})"
    return CompareView(difference, change, title=title, panels=panels, colormap=DIFF_COLORMAP, levels=levels,
                       scale="b − a", note=note + _pooled_note(panels, difference.shape[1]))


def run_view(run: Run, hook: str | None = None, colormap: str = DEFAULT_COLORMAP) -> Figure:
    """A run's requests, a panel each, drawn as the app draws ``hook``'s rows for one (by name or alias; by default
    the hook point the app shows first: the first resid_post in model order, else the first captured). Rows kept
    at some positions only (a capture window) stand side by side."""
    captured = {name for req in run.requests.values() for name, rows in req.hooks.items() if len(rows)}
    if not captured:
        raise ValueError("the run holds no captured rows")
    points = {name: run.hooks.get(name) or HookPoint(name, name, "", "unknown", 0) for name in captured}
    name = default_hook(points.values()).name if hook is None else installed_name(hook, {**run.hooks, **points})
    if name not in captured:
        raise ValueError(f"no request of this run has rows at {name!r}; captured: {', '.join(sorted(captured))}")
    blocks, missing = [], []
    for rid, req in run.requests.items():
        rows = req.hooks.get(name)
        if rows is None or not len(rows):
            missing.append(rid)
            continue
        prompt = (req.prompt or "").replace("\n", "↵")
        blocks.append((f"{rid} · {prompt[:40]}{'…' if len(prompt) > 40 else ''}", as_float32(rows.values),
                       _position_labels(np.asarray(rows.positions, np.int64).tolist(), req.token_texts)))
    panels, levels = _heatmap_panels(blocks, colormap, symmetric=False)
    info = points[name]
    note = "a column per token with a row, a row per feature, 0 at the top" + _pooled_note(panels, blocks[0][1].shape[1])
    if missing:
        note += f"; no rows at this hook point for {', '.join(missing)}"
    return Figure(f"{short_hook_label(info)} · {info.alias or name}", panels, colormap, levels,
                  "value (robust levels: 0.5th–99.5th percentile)", note)


def encode_png(rgb: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` [height, width, 3] uint8: numpy, zlib and struct, no imaging library."""
    height, width, _ = rgb.shape
    scanlines = np.zeros((height, 1 + 3 * width), np.uint8)  # each led by its filter type, 0: none
    scanlines[:, 1:] = rgb.reshape(height, -1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 6)) + chunk(b"IEND", b""))


def _array(values) -> np.ndarray:
    """float32 numpy of a torch tensor (any device or dtype, bfloat16 too) or of anything array-like."""
    if hasattr(values, "detach"):  # a torch tensor, taken without importing torch
        values = values.detach().float().cpu().numpy()
    return as_float32(values)


def _prompts(values, heads: bool) -> np.ndarray:
    """[batch, pos, features] of a cache entry with or without its batch dimension, heads flattened."""
    data = _array(values)
    base = 3 if heads else 2
    if data.ndim not in (base, base + 1) or 0 in data.shape:
        expected = "[pos, head, d_head] or [batch, pos, head, d_head]" if heads else "[pos, d] or [batch, pos, d]"
        raise ValueError(f"a cache entry of shape {tuple(data.shape)}: expected {expected}"
                         + ("" if heads or data.ndim != 4 else " (queries, keys or z: pass heads=True)"))
    if heads:
        data = data.reshape(*data.shape[:-2], -1)
    return data if data.ndim == 3 else data[None]


def _prompt_tokens(tokens, batch: int, positions: int) -> list[list[str] | None]:
    """Token texts per prompt (None: not given), from one list for all or a list per prompt."""
    if tokens is None:
        return [None] * batch
    tokens = list(tokens)
    per_prompt = [list(t) for t in tokens] if tokens and not isinstance(tokens[0], str) else [tokens] * batch
    if len(per_prompt) != batch or not all(isinstance(t, str) for texts in per_prompt for t in texts):
        raise ValueError(f"tokens must be a list of texts, or one such list for each of the {batch} prompts")
    if any(not 0 < len(texts) <= positions for texts in per_prompt):
        raise ValueError(f"{min(map(len, per_prompt))} to {max(map(len, per_prompt))} tokens a prompt for "
                         f"{positions} positions: from 1 to {positions} expected")
    return per_prompt


def _position_labels(positions, texts: list[str] | None) -> list[tuple[int, str | None]]:
    """(position, its token made visible; None where no texts are given) per position."""
    return [(p, display_token(texts[p]) if texts is not None and p < len(texts) else None) for p in positions]


def _heatmap_panels(blocks, colormap: str, symmetric: bool) -> tuple[list[Panel], tuple[float, float]]:
    """Panels of (title, values [positions, features], position labels) blocks drawn as the app's heatmap draws a hook:
    a column per position, a row per feature, bins pooled max-abs past ``MAX_BINS``, robust levels over them all
    (computed as the app does, on its [positions, features] layout)."""
    pooled = []
    for _, values, _ in blocks:
        column_bin, row_bin = _bin(len(values), MAX_BINS[0]), _bin(values.shape[1], MAX_BINS[1])
        pooled.append((pool_maxabs(values, column_bin, row_bin), column_bin, row_bin))
    levels = robust_levels(np.concatenate([image.ravel() for image, _, _ in pooled]), symmetric)
    lut = lookup_table(colormap)
    cell = tuple(_cell(max(image.shape[axis] for image, _, _ in pooled), room) for axis, room in enumerate(HEATMAP_PX))
    panels = []  # one cell size for all: their positions line up
    for (title, _, labels), (image, column_bin, row_bin) in zip(blocks, pooled):
        image = image.T
        panels.append(Panel(title, image, lut[colour_indices(image, *levels)], cell, labels[::column_bin],
                            [(f * row_bin, None) for f in range(len(image))]))
    return panels, levels


def _pooled_note(panels: list[Panel], features: int) -> str:
    rows = max(len(panel.values) for panel in panels)
    return "" if rows == features else f"; {-(-features // rows)} features a row (pooled max-abs)"


def _bin(n: int, limit: int) -> int:
    """Items a bin holds for at most ``limit`` bins: a power of two, as the app's pooling takes."""
    return 1 if n <= limit else 1 << math.ceil(math.log2(n / limit))


def _cell(n: int, room: int) -> int:
    return max(1, min(CELL_PX, room // max(n, 1)))


def _compose(pictures: list[np.ndarray]) -> np.ndarray:
    """Pictures side by side on white, wrapped into lines ``WRAP_PX`` wide."""
    lines, line, width = [], [], 0
    for picture in pictures:
        if line and width + GAP_PX + picture.shape[1] > WRAP_PX:
            lines.append(line)
            line, width = [], 0
        width += (GAP_PX if line else 0) + picture.shape[1]
        line.append(picture)
    lines.append(line)
    heights = [max(p.shape[0] for p in line) for line in lines]
    width = max(sum(p.shape[1] for p in line) + GAP_PX * (len(line) - 1) for line in lines)
    out = np.full((sum(heights) + GAP_PX * (len(lines) - 1), width, 3), 255, np.uint8)
    y = 0
    for line, height in zip(lines, heights):
        x = 0
        for p in line:
            out[y:y + p.shape[0], x:x + p.shape[1]] = p
            x += p.shape[1] + GAP_PX
        y += height + GAP_PX
    return out


def _img(rgb: np.ndarray, alt: str) -> str:
    data = base64.b64encode(encode_png(rgb)).decode("ascii")
    return (f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}" width="{rgb.shape[1]}" '
            f'height="{rgb.shape[0]}" style="display:block;max-width:none;image-rendering:pixelated;margin:0">')


def _strided(labels: list[tuple[int, str | None]], px: int) -> list[tuple[int, str, int]]:
    """(index, text, pixels) of the labels along cells ``px`` wide: each cell's text where each has room, else every
    k-th one's number; nothing in too short a rest."""
    step = -(-LABEL_PX // px)
    spans = [(i, min(step, len(labels) - i) * px) for i in range(0, len(labels), step)]
    return [(i, "" if room < LABEL_PX else _cut(labels[i][1]) if step == 1 and labels[i][1] is not None
             else str(labels[i][0]), room) for i, room in spans]


def _cut(text: str) -> str:
    return text if len(text) <= LABEL_CHARS else text[:LABEL_CHARS - 1] + "…"


def _panel_html(panel: Panel) -> str:
    """The panel's picture with its row labels on the left and its column labels under it, read top down."""
    width, height = panel.cell
    rows, columns = _strided(panel.rows, height), _strided(panel.columns, width)
    left = min(96, 8 + 6 * max(len(text) for _, text, _ in rows)) if rows else 0
    side = "".join(f'<div style="height:{px}px;line-height:{px}px;overflow:hidden;white-space:pre">'
                   f'{html.escape(text)}</div>' for _, text, px in rows)
    side = (f'<div style="flex:none;width:{left}px;padding-right:3px;box-sizing:border-box;text-align:right">'
            f'{side}</div>') if rows else ""
    tall = 6 + 7 * max((len(text) for _, text, _ in columns), default=0)
    below = "".join(
        f'<div title="{html.escape(_tip(*panel.columns[i]))}" style="flex:none;width:{px}px;height:{tall}px;'
        f'line-height:{px}px;writing-mode:vertical-rl;overflow:hidden;white-space:pre">{html.escape(text)}</div>'
        for i, text, px in columns)
    return (f'<div style="flex:none;{FONT}">'
            f'<div style="font-family:sans-serif;font-size:12px;font-weight:600;margin-left:{left}px">'
            f'{html.escape(panel.title)}</div>'
            f'<div style="display:flex;align-items:flex-start">{side}{_img(panel.picture(), panel.title)}</div>'
            f'<div style="display:flex;margin-left:{left}px">{below}</div></div>')


def _tip(position: int, text: str | None) -> str:
    return f"position {position}" + ("" if text is None else f": {text}")
