"""A run on show, without Qt: the live run, an earlier one, or a reopened capture, with its selection.

The live run is rebuilt on the GUI thread from the session's step events (``fold_event``), so the GUI
never reads a run another thread writes. Its hook rows grow in place (``HookRows``), so a view of
the first n rows costs nothing and nothing is re-concatenated per frame. A long live run writes its
rows through to a scratch capture file instead (``write_through``: only positions and token ids stay
in memory) and views read back what they show. A reopened capture is a ``Run`` whose values are lazy
h5py-backed arrays; one (request, hook) is loaded into memory only when a view asks for it.
"""

from __future__ import annotations

import copy
import enum
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from inspector.core.arrays import GrowableArray
from inspector.core.dtypes import as_float32
from inspector.core.hooks import RESIDUAL_KINDS, HookPoint
from inspector.core.labels import default_hook
from inspector.core.protocol import StepEvent, fold_event
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.core.sae import AttachedSae
from inspector.io.spool import RowSpool

from .labels import hook_sort_key, short_hook_label
from .lens import RunLens


class RunSource(enum.Enum):
    LIVE = "live"  # growing as the engine generates
    EARLIER = "earlier"  # the live run of a model opened before the current one, kept in memory
    FILE = "file"  # a reopened capture file
    SERVED = "served"  # the captures of an OpenAI server, read as they arrive (served.py)


@dataclass
class Selection:
    request: str | None = None
    hook: str | None = None
    position: int | None = None


class RunView:
    """One run and what is selected in it."""

    LOADED_CACHE = 6  # (request, hook) arrays of a reopened capture kept in memory
    LOADED_BYTES = 256 << 20  # larger ones are read as they are shown

    def __init__(self, run: Run, source: RunSource, label: str = "", catalogue: list[HookPoint] = ()):
        self.run, self.source, self.label = run, source, label
        self.catalogue = {h.name: h for h in catalogue} or dict(run.hooks)
        self.selection = Selection()
        self.revision = 0  # bumped on every change a view must repaint for
        self.lens = RunLens(run)  # the logit lens of its residual-stream rows, as far as it is known
        self._norms: dict[tuple[str, str], GrowableArray] = {}  # live: per-row L2 norms, grown with the rows
        self._file_norms: dict[tuple[str, str], np.ndarray] = {}
        self._loaded: OrderedDict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.spool: RowSpool | None = None  # where new rows go, if they are written through
        self.patched: dict[str, str] = {}  # request id -> the patching cell its run patched, in words
        if source is RunSource.FILE:
            self.selection.request = next(iter(run.requests), None)
            hooks = self.hooks_for(self.selection.request)
            self.selection.hook = hooks[0].name if hooks else None

    @classmethod
    def live(cls, metadata: dict, hooks: dict[str, HookPoint], catalogue: list[HookPoint] = ()) -> "RunView":
        return cls(Run(metadata=copy.deepcopy(metadata), hooks=dict(hooks)), RunSource.LIVE, "", catalogue)

    # ---- live updates ----
    def learn_hooks(self, metadata: dict, hooks: dict[str, HookPoint], catalogue: list[HookPoint]) -> None:
        """The engine's hook set changed (or it was reopened): keep every row, learn the new points."""
        self.run.hooks.update(hooks)
        self.run.metadata.update(copy.deepcopy(metadata))
        self.catalogue = {h.name: h for h in catalogue} or self.catalogue

    def note_sae(self, sae: AttachedSae) -> None:
        """An SAE was attached: the metadata lists it (an export then says what its features come from),
        and keeps listing it once detached, as the features it produced stay."""
        listed = self.run.metadata.setdefault("saes", [])
        if sae.as_dict() not in listed:
            listed.append(sae.as_dict())

    def write_through(self, directory) -> None:
        """From now on, new rows (a request's first at a hook) go to a scratch capture file in
        ``directory``, removed by ``close``; rows already kept stay in memory."""
        if self.spool is None:
            self.spool = RowSpool(directory, self.run.metadata)

    def close(self) -> None:
        """The run is dropped: remove its scratch file, if it has one."""
        if self.spool is not None:
            self.spool.close()

    def apply(self, event: StepEvent) -> set[str]:
        """Fold one step event into the run; returns the request ids it changed."""
        for step in event.requests:
            for hook, (_, _, values) in step.rows.items():
                if hook not in self.run.hooks:
                    self.run.hooks[hook] = self.catalogue.get(hook) or HookPoint(hook, hook, "", "unknown",
                                                                                   values.shape[1])
        changed = fold_event(self.run, event, new_rows=self.spool.rows if self.spool else None)
        for step in event.requests:
            for hook, (_, _, values) in step.rows.items():
                if self.run.hooks[hook].kind in RESIDUAL_KINDS and len(values):
                    norms = self._norms.setdefault((step.request_id, hook), GrowableArray(np.float32))
                    norms.append(np.linalg.norm(as_float32(values), axis=1))
        if changed:
            self.revision += 1
            if self.selection.request not in self.run.requests:
                self.selection.request = next(rid for rid in self.run.requests if rid in changed)
            if self.selection.hook is None:
                self._settle_hook()
        return changed

    # ---- selection ----
    def select(self, request: str | None = None, hook: str | None = None, position: int | None = None) -> None:
        """Change what is selected; a new request clears the position."""
        sel = self.selection
        if request is not None and request != sel.request:
            sel.request, sel.position = request, None
        if hook is not None:
            sel.hook = hook
        if position is not None:
            sel.position = position
        self.revision += 1

    def settle_selection(self) -> None:
        """Make the selection one the run has: a request of it (the first, if the one selected is gone)
        and a hook point captured for that request (``_settle_hook``)."""
        if self.run.requests and self.selection.request not in self.run.requests:
            self.selection.request = next(iter(self.run.requests))
        self._settle_hook()

    def _settle_hook(self) -> None:
        """The one rule for the hook point shown: the one selected while the selected request has it,
        else the default one (``default_hook``)."""
        hooks = self.hooks_for(self.selection.request)
        if hooks and self.selection.hook not in {h.name for h in hooks}:
            self.selection.hook = default_hook(hooks).name

    # ---- queries ----
    def request_ids(self) -> list[str]:
        return list(self.run.requests)

    def request(self, rid: str | None) -> RequestCapture | None:
        return None if rid is None else self.run.requests.get(rid)

    def request_choice(self, rid: str) -> tuple[str, str]:
        """(label, tooltip) of a request in the request list: its prompt's start, and what kind of run it
        is where it is one of a comparison's twins or a patched run."""
        req = self.run.requests[rid]
        prompt = (req.prompt or "").replace("\n", "↵")
        label = f"{rid} · {prompt[:40]}{'…' if len(prompt) > 40 else ''}"
        if req.twin_role in ("clean", "intervened"):
            clean = req.twin_role == "clean"
            return (f"{label}  [{req.twin_role} twin]",
                    f"{'Clean' if clean else 'Intervened'} twin of {req.twin_of}: the same prompt run "
                    f"{'without' if clean else 'with'} the interventions (Compare tab)")
        if rid in self.patched:
            return f"{label}  [patched]", f"Patched run: {self.patched[rid]} (Patching tab)"
        return label, req.prompt or ""

    def hook_info(self, hook: str | None) -> HookPoint | None:
        if hook is None:
            return None
        return self.run.hooks.get(hook) or self.catalogue.get(hook)

    def hooks_for(self, rid: str | None) -> list[HookPoint]:
        """Hooks with rows for this request (all the run's hooks if rid is None), in model order."""
        req = self.request(rid)
        names = set(req.hooks) if req is not None else set(self.run.hooks)
        return sorted((self.hook_info(n) or HookPoint(n, n, "", "unknown", 0) for n in names), key=hook_sort_key)

    def token_texts(self, rid: str | None) -> list[str]:
        req = self.request(rid)
        return list(req.token_texts) if req is not None else []

    def rows(self, rid: str | None, hook: str | None) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions [n], values [n, width]), or None if nothing was captured there. Values are kept in
        their stored dtype; those of a write-through run or a long reopened capture are read as sliced."""
        req = self.request(rid)
        if req is None or hook not in req.hooks:
            return None
        rows = req.hooks[hook]
        if self.source is not RunSource.FILE:
            return rows.positions, rows.values
        if rows.values.nbytes > self.LOADED_BYTES:  # a long one stays on disk: views read what they show
            return np.asarray(rows.positions, dtype=np.int64), rows.values
        key = (rid, hook)
        if key not in self._loaded:
            self._loaded[key] = (np.asarray(rows.positions, dtype=np.int64), np.asarray(rows.values, dtype=np.float32))
            while len(self._loaded) > self.LOADED_CACHE:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(key)
        return self._loaded[key]

    def norms(self, rid: str | None, hook: str) -> np.ndarray:
        """Per-row L2 norm of a hook's rows (kept up to date when live; read in chunks from files)."""
        key = (rid, hook)
        if key in self._norms:
            return self._norms[key].view()
        if key in self._file_norms:
            return self._file_norms[key]
        req = self.request(rid)
        if req is None or hook not in req.hooks:
            return np.zeros(0, dtype=np.float32)
        values = req.hooks[hook].values
        out = np.empty(len(values), dtype=np.float32)
        for a in range(0, len(values), 1024):  # chunks: a lazy dataset is never loaded whole for this
            out[a:a + 1024] = np.linalg.norm(np.asarray(values[a:a + 1024], dtype=np.float32), axis=1)
        if self.source is RunSource.FILE:
            self._file_norms[key] = out
        return out

    def summary_rows(self, rid: str | None, kinds=("resid_post",), measure: str = "L2 norm",
                     feature: int = 0) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(label, positions, per-row value) for each captured hook of ``kinds``, in model order."""
        req = self.request(rid)
        if req is None:
            return []
        return [(short_hook_label(info), np.asarray(req.hooks[info.name].positions, dtype=np.int64),
                 self.norms(rid, info.name) if measure == "L2 norm" else self.feature_column(rid, info.name, feature))
                for info in self.hooks_for(rid) if info.kind in kinds]

    def feature_column(self, rid: str | None, hook: str, feature: int) -> np.ndarray:
        req = self.request(rid)
        if req is None or hook not in req.hooks:
            return np.zeros(0, dtype=np.float32)
        values = req.hooks[hook].values
        if not 0 <= feature < values.shape[1]:
            return np.full(len(values), np.nan, dtype=np.float32)
        return np.asarray(values[:, feature], dtype=np.float32)

    def row_of_position(self, rid, hook, position: int) -> int | None:
        r = self.rows(rid, hook)
        if r is None:
            return None
        i = int(np.searchsorted(r[0], position))
        return i if i < len(r[0]) and r[0][i] == position else None

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
                span = np.zeros(b - a, dtype=bool)
                if d.get("positions") is None:
                    span[:] = True
                else:
                    ps = np.asarray(list(d["positions"]), dtype=np.int64)
                    span[ps[(ps >= a) & (ps < b)] - a] = True
                seg = marks[a:b]
                seg[span] = np.maximum(seg[span], 2 if d.get("hook") == hook else 1)
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
                mask = np.isin(r[0], np.asarray(positions, dtype=np.int64))
                if mask.any():
                    parts.append(np.asarray(r[1][mask], dtype=np.float64))
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
        """A consistent copy for another thread (export): lists copied, rows shared but frozen."""
        run = self.run
        requests = {}
        for rid, req in run.requests.items():
            requests[rid] = RequestCapture(
                request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
                sampling=dict(req.sampling), generated_token_ids=list(req.generated_token_ids),
                token_texts=list(req.token_texts), logprobs=list(req.logprobs),
                top_logprobs=[list(t) for t in req.top_logprobs],
                intervention_log=[(p, [dict(d) for d in ivs]) for p, ivs in req.intervention_log],
                hooks={h: rows.snapshot() for h, rows in req.hooks.items()},
                lens=dict(req.lens),  # a reopened file's lens: read, never grown
                twin_role=req.twin_role, twin_of=req.twin_of, finish_reason=req.finish_reason)
        return Run(metadata=copy.deepcopy(run.metadata), hooks=dict(run.hooks), requests=requests,
                   vocabulary=dict(run.vocabulary))

    def bytes_kept(self) -> int:
        """Bytes of row values held in memory."""
        return sum(len(rows) * rows.width * rows.dtype.itemsize for req in self.run.requests.values()
                   for rows in req.hooks.values() if type(rows) is HookRows)

    def total_rows(self) -> int:
        return sum(len(rows) for req in self.run.requests.values() for rows in req.hooks.values())
