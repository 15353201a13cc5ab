"""What the views show, without Qt: the current Run, what is selected, and incremental buffers.

The GUI never reads the engine's own ``Session.run`` while the worker thread may be writing it.
Instead the worker sends ``StepUpdate`` envelopes (numpy + frozen dataclasses) and this model keeps
a mirror ``Run`` owned by the GUI thread. Its hook rows live in capacity-doubling buffers
(``GrowingRows``), so a view of the first n rows costs nothing and nothing is re-concatenated per frame.

A reopened capture is also just a ``Run`` (its values may be lazy h5py-backed arrays); the model
loads one (request, hook) into memory only when a view asks for it.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inspector.capture.run import HookInfo, HookRows, RequestCapture, Run

RESIDUAL_KINDS = ("resid_pre", "resid_mid", "resid_post")
_KIND_ORDER = {"embed": 0, "pos_embed": 1, "resid_pre": 2, "attn_out": 3, "resid_mid": 4, "mlp_post": 5,
               "mlp_out": 6, "resid_post": 7, "normalized": 8}


# --- envelopes the engine worker sends to the GUI thread ----------------------------------------

@dataclass(frozen=True)
class RequestInfo:
    """A request as it starts: what the token strip needs before the first generated token."""

    request_id: str
    prompt: str
    prompt_token_ids: tuple[int, ...]
    prompt_texts: tuple[str, ...]
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepUpdate:
    """One engine step plus what the GUI cannot read from the StepEvent alone.

    ``intervention_log``: per request, the log entries (first position, interventions as dicts) that
    appeared in ``Session.run`` since the previous update. ``thread_id``: the thread that ran the step.
    """

    event: Any  # inspector.engine.session.StepEvent
    new_requests: tuple[RequestInfo, ...] = ()
    intervention_log: dict = field(default_factory=dict)
    thread_id: int = 0


@dataclass(frozen=True)
class SessionInfo:
    """A snapshot of a ready session, taken on the worker thread."""

    options: Any  # SessionOptions
    catalogue: tuple[HookInfo, ...]
    installed: dict  # name -> HookInfo
    metadata: dict
    thread_id: int = 0


# --- buffers ------------------------------------------------------------------------------------

class GrowingRows(HookRows):
    """HookRows kept in capacity-doubling arrays: appends are amortised O(rows), views are free.

    A view ``values[:n]`` taken earlier stays valid and unchanged: later appends write past n, and a
    reallocation copies into a new array.
    """

    def __init__(self, width: int, capacity: int = 8):
        super().__init__(width)
        self._n = 0
        self._pos = np.empty(capacity, dtype=np.int64)
        self._tok = np.empty(capacity, dtype=np.int64)
        self._val = np.empty((capacity, width), dtype=np.float32)

    def append(self, positions, token_ids, values) -> None:
        values = np.asarray(values)
        if values.ndim != 2 or values.shape[1] != self.width or len(values) != len(positions):
            raise ValueError(f"rows of shape {values.shape} do not fit a hook of width {self.width}")
        k = len(values)
        if k == 0:
            return
        need = self._n + k
        if need > len(self._pos):
            cap = max(need, len(self._pos) + len(self._pos) // 2)  # x1.5: at most 50% slack in memory
            for name in ("_pos", "_tok", "_val"):
                old = getattr(self, name)
                new = np.empty((cap, *old.shape[1:]), dtype=old.dtype)
                new[: self._n] = old[: self._n]
                setattr(self, name, new)
        self._pos[self._n:need] = positions
        self._tok[self._n:need] = token_ids
        self._val[self._n:need] = values
        self._n = need

    def _arrays(self):
        n = self._n
        return self._pos[:n], self._tok[:n], self._val[:n]

    def __len__(self) -> int:
        return self._n


class GrowingVector:
    """A capacity-doubling 1-D float array (per-token norms for the summary view)."""

    def __init__(self, capacity: int = 64):
        self._n = 0
        self._a = np.empty(capacity, dtype=np.float32)

    def extend(self, values: np.ndarray) -> None:
        k = len(values)
        if self._n + k > len(self._a):
            new = np.empty(max(self._n + k, 2 * len(self._a)), dtype=np.float32)
            new[: self._n] = self._a[: self._n]
            self._a = new
        self._a[self._n:self._n + k] = values
        self._n += k

    def view(self) -> np.ndarray:
        return self._a[: self._n]

    def __len__(self) -> int:
        return self._n


# --- helpers ------------------------------------------------------------------------------------

def hook_sort_key(info: HookInfo) -> tuple:
    return (info.layer if info.layer >= 0 else (-1 if info.kind in ("embed", "pos_embed") else 10 ** 6),
            _KIND_ORDER.get(info.kind, 99), info.name)


def short_hook_label(info: HookInfo) -> str:
    """``blocks.3.hook_resid_post`` -> ``L3 resid_post``; keeps other aliases as they are."""
    if info.layer >= 0:
        return f"L{info.layer} {info.kind}"
    return info.alias or info.name


def display_token(text: str) -> str:
    """A token's text made visible: newlines, tabs and bare spaces get glyphs."""
    if text == "":
        return "∅"
    out = text.replace("\r", "␍").replace("\n", "↵").replace("\t", "⇥")
    if out.strip(" ") == "":
        out = "␣" * len(out)
    return out


def parse_positions(text: str) -> tuple[int, ...]:
    """``"3-7, 10, 12"`` -> (3, 4, 5, 6, 7, 10, 12). Raises ValueError with the reason."""
    out: list[int] = []
    for part in re.split(r"[,\s]+", text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:\s*(?:-|\.\.|:)\s*(\d+))?", part)
        if not m:
            raise ValueError(f"{part!r} is not a position or range (write e.g. 3-7, 10)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise ValueError(f"range {part!r} runs backwards")
        if b - a > 1_000_000:
            raise ValueError(f"range {part!r} is too long")
        out.extend(range(a, b + 1))
    if not out:
        raise ValueError("no positions given")
    return tuple(sorted(set(out)))


def format_positions(positions) -> str:
    """The inverse of parse_positions, with ranges collapsed."""
    if not positions:
        return ""
    ps = sorted(set(int(p) for p in positions))
    parts, start, prev = [], ps[0], ps[0]
    for p in ps[1:] + [None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if p is not None:
            start = prev = p
    return ", ".join(parts)


def glob_match(info: HookInfo, pattern: str) -> bool:
    pattern = pattern.strip()
    return bool(pattern) and info.matches(pattern)


# --- the model ----------------------------------------------------------------------------------

class CaptureViewModel:
    """The run being shown (live mirror or reopened file) and the current selection."""

    LOADED_CACHE = 6  # (request, hook) arrays of a reopened capture kept in memory

    def __init__(self):
        self.run: Run | None = None
        self.source: str = "none"  # "live" | "file" | "none"
        self.path: str | None = None
        self.revision = 0
        self.selected_request: str | None = None
        self.selected_hook: str | None = None
        self.selected_position: int | None = None
        self.catalogue: dict[str, HookInfo] = {}
        self._norms: dict[tuple[str, str], GrowingVector] = {}
        self._request_revision: dict[str, int] = {}
        self._loaded: OrderedDict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._lazy_norms: dict[tuple[str, str], np.ndarray] = {}

    # ---- sources ----
    def start_live(self, metadata: dict, hooks: dict[str, HookInfo], catalogue=()) -> None:
        self.run = Run(metadata=copy.deepcopy(metadata), hooks=dict(hooks), requests={})
        self.source, self.path = "live", None
        self.catalogue = {h.name: h for h in catalogue} or dict(hooks)
        self._reset_caches()

    def ensure_live(self, metadata: dict, hooks: dict[str, HookInfo], catalogue=()) -> None:
        """Keep the live mirror (nothing captured is dropped) and learn about new hooks."""
        if self.run is None or self.source != "live":
            self.start_live(metadata, hooks, catalogue)
            return
        self.run.hooks.update(hooks)
        if catalogue:
            self.catalogue = {h.name: h for h in catalogue}
        self.run.metadata.update(copy.deepcopy(metadata))

    def load_run(self, run: Run, path: str) -> None:
        self.run, self.source, self.path = run, "file", str(path)
        self.catalogue = dict(run.hooks)
        self._reset_caches()
        self.selected_request = next(iter(run.requests), None)
        hooks = self.hooks_for(self.selected_request)
        self.selected_hook = hooks[0].name if hooks else None
        self.selected_position = None

    def clear(self) -> None:
        self.run, self.source, self.path = None, "none", None
        self._reset_caches()
        self.selected_request = self.selected_hook = self.selected_position = None

    def _reset_caches(self) -> None:
        self._norms.clear()
        self._loaded.clear()
        self._lazy_norms.clear()
        self._request_revision.clear()
        self.revision += 1

    # ---- live updates ----
    def apply_update(self, update: StepUpdate) -> set[str]:
        """Fold one step into the mirror; returns the request ids that changed."""
        if self.run is None or self.source != "live":
            raise RuntimeError("no live run to apply a step to")
        run = self.run
        for info in update.new_requests:
            req = run.requests.get(info.request_id)
            if req is None:
                run.requests[info.request_id] = RequestCapture(
                    request_id=info.request_id, prompt=info.prompt,
                    prompt_token_ids=list(info.prompt_token_ids), sampling=dict(info.sampling),
                    token_texts=list(info.prompt_texts))
            elif not req.prompt_token_ids and info.prompt_token_ids:  # known only after chunked prefill
                req.prompt_token_ids = list(info.prompt_token_ids)
                req.token_texts[:0] = list(info.prompt_texts)
        changed = set()
        for rs in update.event.requests:
            req = run.requests.get(rs.request_id)
            if req is None:  # the worker sends RequestInfo first; be lenient anyway
                req = run.requests[rs.request_id] = RequestCapture(rs.request_id, "", [], {})
            req.generated_token_ids.extend(int(t) for t in rs.new_token_ids)
            req.token_texts.extend(rs.new_texts)
            req.logprobs.extend(float(x) for x in rs.logprobs)
            req.top_logprobs.extend([list(map(tuple, t)) for t in rs.top_logprobs])
            for hook, (pos, tok, val) in rs.rows.items():
                rows = req.hooks.get(hook)
                if rows is None:
                    width = val.shape[1] if np.ndim(val) == 2 else self._width(hook)
                    rows = req.hooks[hook] = GrowingRows(width)
                    if hook not in run.hooks:
                        info = self.catalogue.get(hook) or HookInfo(hook, hook, "", "unknown", width)
                        run.hooks[hook] = info
                rows.append(pos, tok, val)
                info = run.hooks.get(hook)
                if info is not None and info.kind in RESIDUAL_KINDS and len(val):
                    vec = self._norms.setdefault((rs.request_id, hook), GrowingVector())
                    vec.extend(np.linalg.norm(np.asarray(val, dtype=np.float32), axis=1))
            if rs.finished:
                req.finish_reason = rs.finish_reason
            changed.add(rs.request_id)
        for rid, entries in update.intervention_log.items():
            req = run.requests.get(rid)
            if req is not None:
                req.intervention_log.extend((int(p), [dict(d) for d in ivs]) for p, ivs in entries)
                changed.add(rid)
        for rid in changed:
            self._request_revision[rid] = self._request_revision.get(rid, 0) + 1
        if changed:
            self.revision += 1
            if self.selected_request is None or self.selected_request not in run.requests:
                self.selected_request = next(iter(sorted(changed, key=list(run.requests).index)))
            if self.selected_hook is None:
                hooks = self.hooks_for(self.selected_request)
                if hooks:
                    self.selected_hook = hooks[-1].name if hooks[-1].kind == "resid_post" else hooks[0].name
        return changed

    def _width(self, hook: str) -> int:
        info = self.catalogue.get(hook) or (self.run.hooks.get(hook) if self.run else None)
        if info is None:
            raise ValueError(f"rows for unknown hook {hook!r} carry no width")
        return info.width

    def request_revision(self, rid: str | None) -> int:
        return self._request_revision.get(rid, 0) if rid else 0

    # ---- queries ----
    def request_ids(self) -> list[str]:
        return list(self.run.requests) if self.run else []

    def request(self, rid: str | None) -> RequestCapture | None:
        if self.run is None or rid is None:
            return None
        return self.run.requests.get(rid)

    def hook_info(self, hook: str | None) -> HookInfo | None:
        if hook is None:
            return None
        if self.run is not None and hook in self.run.hooks:
            return self.run.hooks[hook]
        return self.catalogue.get(hook)

    def hooks_for(self, rid: str | None) -> list[HookInfo]:
        """Hooks with rows for this request (all run hooks if rid is None), in model order."""
        if self.run is None:
            return []
        req = self.request(rid)
        names = set(req.hooks) if req is not None else set(self.run.hooks)
        infos = [self.hook_info(n) or HookInfo(n, n, "", "unknown", 0) for n in names]
        return sorted(infos, key=hook_sort_key)

    def residual_hooks(self, rid: str | None) -> list[HookInfo]:
        return [h for h in self.hooks_for(rid) if h.kind in RESIDUAL_KINDS]

    def token_texts(self, rid: str | None) -> list[str]:
        req = self.request(rid)
        return list(req.token_texts) if req is not None else []

    def rows(self, rid: str | None, hook: str | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions [n], values [n, width]) in memory, or None if nothing was captured there."""
        req = self.request(rid)
        if req is None or hook is None or hook not in req.hooks:
            return None
        hr = req.hooks[hook]
        if isinstance(hr, GrowingRows) or self.source in ("live", "memory"):
            return hr.positions, hr.values
        key = (rid, hook)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        pair = (np.asarray(hr.positions, dtype=np.int64), np.asarray(hr.values, dtype=np.float32))
        self._loaded[key] = pair
        while len(self._loaded) > self.LOADED_CACHE:
            self._loaded.popitem(last=False)
        return pair

    def norms(self, rid: str | None, hook: str) -> np.ndarray:
        """Per-row L2 norm of a hook's rows (incremental when live; chunked for lazy files)."""
        key = (rid, hook)
        if key in self._norms:
            return self._norms[key].view()
        if key in self._lazy_norms:
            return self._lazy_norms[key]
        req = self.request(rid)
        if req is None or hook not in req.hooks:
            return np.zeros(0, dtype=np.float32)
        values = req.hooks[hook].values
        n = len(values)
        out = np.empty(n, dtype=np.float32)
        for a in range(0, n, 1024):  # chunks: a lazy dataset is never loaded whole for this
            out[a:a + 1024] = np.linalg.norm(np.asarray(values[a:a + 1024], dtype=np.float32), axis=1)
        if self.source == "file":
            self._lazy_norms[key] = out
        return out

    def summary_rows(self, rid: str | None, kinds=("resid_post",), measure: str = "L2 norm",
                     feature: int = 0) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(label, positions, per-row value) for each captured hook of ``kinds``, in model order."""
        req = self.request(rid)
        if req is None:
            return []
        out = []
        for info in self.hooks_for(rid):
            if info.kind not in kinds:
                continue
            positions = np.asarray(req.hooks[info.name].positions, dtype=np.int64)
            if measure == "L2 norm":
                vals = self.norms(rid, info.name)
            else:
                vals = self.feature_column(rid, info.name, feature)
            out.append((short_hook_label(info), positions, vals))
        return out

    def feature_column(self, rid: str | None, hook: str, feature: int) -> np.ndarray:
        req = self.request(rid)
        if req is None or hook not in req.hooks:
            return np.zeros(0, dtype=np.float32)
        values = req.hooks[hook].values
        if not 0 <= feature < values.shape[1]:
            return np.full(len(values), np.nan, dtype=np.float32)
        return np.asarray(values[:, feature], dtype=np.float32)

    def position_of_row(self, rid, hook, row: int) -> int | None:
        r = self.rows(rid, hook)
        if r is None or not 0 <= row < len(r[0]):
            return None
        return int(r[0][row])

    def row_of_position(self, rid, hook, position: int) -> int | None:
        r = self.rows(rid, hook)
        if r is None or not len(r[0]):
            return None
        pos = r[0]
        i = int(np.searchsorted(pos, position))
        if i < len(pos) and pos[i] == position:
            return i
        return None

    # ---- interventions ----
    def intervention_marks(self, rid: str | None, hook: str | None, n_positions: int) -> np.ndarray:
        """Per position 0..n-1: 0 nothing active, 1 an intervention on another hook, 2 one on ``hook``."""
        marks = np.zeros(max(n_positions, 0), dtype=np.int8)
        req = self.request(rid)
        if req is None or not req.intervention_log or n_positions <= 0:
            return marks
        log = sorted(req.intervention_log, key=lambda e: e[0])
        for i, (first, ivs) in enumerate(log):
            end = log[i + 1][0] if i + 1 < len(log) else n_positions
            a, b = max(0, int(first)), min(n_positions, int(end))
            if a >= b:
                continue
            for d in ivs:
                if d.get("request_id") not in (None, rid):
                    continue
                code = 2 if d.get("hook") == hook else 1
                span = np.zeros(b - a, dtype=bool)
                if d.get("positions") is None:
                    span[:] = True
                else:
                    ps = np.asarray(list(d["positions"]), dtype=np.int64)
                    ps = ps[(ps >= a) & (ps < b)] - a
                    span[ps] = True
                seg = marks[a:b]
                seg[span] = np.maximum(seg[span], code)
        return marks

    def steering_vector(self, hook: str, plus: list[tuple[str, tuple[int, ...]]],
                        minus: list[tuple[str, tuple[int, ...]]]) -> tuple[np.ndarray, int, int]:
        """mean(rows of ``plus``) - mean(rows of ``minus``) at ``hook``; also the row counts used.

        Each selection is a list of (request id, positions). Raises ValueError with the reason."""
        def gather(selection, label):
            parts = []
            for rid, positions in selection:
                r = self.rows(rid, hook)
                if r is None:
                    raise ValueError(f"selection {label}: request {rid!r} has no rows captured at {hook!r}")
                pos, values = r
                mask = np.isin(pos, np.asarray(positions, dtype=np.int64))
                if mask.any():
                    parts.append(np.asarray(values[mask], dtype=np.float64))
            if not parts:
                raise ValueError(f"selection {label} holds no captured rows at {hook!r} "
                                 "(the last generated token has no row: it was never fed back)")
            return np.concatenate(parts)

        a, b = gather(plus, "A"), gather(minus, "B")
        vec = a.mean(axis=0) - b.mean(axis=0)
        if not np.all(np.isfinite(vec)):
            raise ValueError("the steering vector holds NaN or Inf (non-finite captures)")
        return vec.astype(np.float32), len(a), len(b)

    # ---- export ----
    def snapshot(self) -> Run:
        """A consistent copy for another thread (export): lists copied, arrays shared (never mutated)."""
        if self.run is None:
            raise RuntimeError("nothing to export")
        run = self.run
        requests = {}
        for rid, req in run.requests.items():
            hooks = {}
            for h, hr in req.hooks.items():
                if isinstance(hr, GrowingRows):
                    frozen = HookRows(hr.width)
                    if len(hr):
                        frozen.append(hr.positions, hr.token_ids, hr.values)
                    hooks[h] = frozen
                else:
                    hooks[h] = hr
            requests[rid] = RequestCapture(
                request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
                sampling=dict(req.sampling), generated_token_ids=list(req.generated_token_ids),
                token_texts=list(req.token_texts), logprobs=list(req.logprobs),
                top_logprobs=[list(t) for t in req.top_logprobs],
                intervention_log=[(p, [dict(d) for d in ivs]) for p, ivs in req.intervention_log],
                hooks=hooks, finish_reason=req.finish_reason)
        used = {h for r in requests.values() for h in r.hooks}
        hooks = {n: info for n, info in run.hooks.items() if n in used or n in run.hooks}
        return Run(metadata=copy.deepcopy(run.metadata), hooks=hooks, requests=requests)

    def total_rows(self) -> int:
        if self.run is None:
            return 0
        return sum(len(hr) for r in self.run.requests.values() for hr in r.hooks.values())
