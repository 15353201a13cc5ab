"""Fixtures and fakes for the GUI tests (imported by tests/test_ui_*.py).

- ``QT_QPA_PLATFORM=offscreen`` before any QApplication exists.
- ``fail_on_qt_warnings``: a qInstallMessageHandler that records Qt warnings/criticals and fails the
  test that produced them (like pyqtgraph's own test suite).
- ``ui_settings``: QSettings kept in a temporary directory.
- Synthetic data: a Llama-like hook catalogue, Runs, StepEvents, and ``FakeSession``, which
  implements the engine's Session API (boot stages, batched generate, stop, interventions with an
  intervention_log, set_hooks, failures) so the window can be driven on a real QThread without vLLM.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from inspector.capture.run import HookInfo, HookRows, RequestCapture, Run  # noqa: E402
from inspector.engine.session import (BootProgress, RequestStep, Sampling, SessionError, SessionOptions,  # noqa: E402
                                      StepEvent)
from inspector.plugin.interventions import validate  # noqa: E402

__all__ = ["fail_on_qt_warnings", "ui_settings", "make_catalogue", "make_run", "FakeSession", "fake_types",
           "FakeSessionOptions", "FakeSampling", "FakeStepEvent", "FakeRequestStep", "FakeBootProgress",
           "SessionError", "fake_value", "make_window", "wait_state", "keep"]

IGNORED_QT_MESSAGES = (
    "This plugin does not support propagateSizeHints",  # offscreen platform noise
    "propagateSizeHints",
    "QFont::setPointSize: Point size <= 0",  # pyqtgraph axis label fonts on offscreen
)


@pytest.fixture(autouse=False)
def fail_on_qt_warnings():
    from PySide6.QtCore import QtMsgType, qInstallMessageHandler

    recorded: list[str] = []

    def handler(mode, context, message):
        if mode in (QtMsgType.QtWarningMsg, QtMsgType.QtCriticalMsg, QtMsgType.QtFatalMsg):
            if not any(s in message for s in IGNORED_QT_MESSAGES):
                recorded.append(f"{mode.name}: {message}")
        if previous is not None:
            previous(mode, context, message)

    previous = qInstallMessageHandler(handler)
    yield recorded
    qInstallMessageHandler(previous)
    if recorded:
        pytest.fail("Qt warnings during the test:\n" + "\n".join(recorded), pytrace=False)


@pytest.fixture
def ui_settings(tmp_path, monkeypatch, fail_on_qt_warnings):
    """Settings under tmp_path (never the user's); also arms the Qt-warning check."""
    from inspector.ui.settings import Settings, configure_storage

    d = tmp_path / "settings"
    monkeypatch.setenv("INSPECTOR_SETTINGS_DIR", str(d))
    configure_storage(d)
    import pyqtgraph as pg

    pg.setConfigOptions(antialias=False, imageAxisOrder="col-major")
    s = Settings()
    assert str(d) in s.file_name
    return s


# ------------------------------------------------------------------------------------------ data

def make_catalogue(layers: int = 2, hidden: int = 16, intermediate: int = 32) -> list[HookInfo]:
    cat = [HookInfo("model.embed_tokens.embed", "hook_embed", "model.embed_tokens", "embed", hidden)]
    for i in range(layers):
        b, blk = f"model.layers.{i}", f"blocks.{i}"
        cat += [
            HookInfo(f"{b}.resid_pre", f"{blk}.hook_resid_pre", b, "resid_pre", hidden, i),
            HookInfo(f"{b}.self_attn.attn_out", f"{blk}.hook_attn_out", f"{b}.self_attn", "attn_out", hidden, i),
            HookInfo(f"{b}.post_attention_layernorm.resid_mid", f"{blk}.hook_resid_mid",
                     f"{b}.post_attention_layernorm", "resid_mid", hidden, i),
            HookInfo(f"{b}.mlp.act_fn.mlp_post", f"{blk}.mlp.hook_post", f"{b}.mlp.act_fn", "mlp_post",
                     intermediate, i),
            HookInfo(f"{b}.mlp.mlp_out", f"{blk}.hook_mlp_out", f"{b}.mlp", "mlp_out", hidden, i),
            HookInfo(f"{b}.resid_post", f"{blk}.hook_resid_post", b, "resid_post", hidden, i),
        ]
    cat.append(HookInfo("model.norm.normalized", "ln_final.hook_normalized", "model.norm", "normalized", hidden))
    return cat


def fake_value(hook_index: int, positions: np.ndarray, width: int) -> np.ndarray:
    """Deterministic activations: distinct per hook, position and feature."""
    p = np.asarray(positions, dtype=np.float32)[:, None]
    f = np.arange(width, dtype=np.float32)[None, :]
    return (np.sin(0.37 * p + 0.11 * f + hook_index) * (1 + 0.05 * f) + 0.01 * p).astype(np.float32)


def make_run(n_tokens=(12, 7), hooks=None, prompt_len: int = 4, width: int = 16) -> Run:
    """A finished Run with requests of the given token counts (rows = tokens - 1 per hook)."""
    cat = make_catalogue(hidden=width, intermediate=2 * width)
    hooks = hooks or [h.name for h in cat if h.kind in ("resid_post", "mlp_out")]
    infos = {h.name: h for h in cat if h.name in hooks}
    run = Run(metadata={"model": "synthetic", "mode": "compiled", "dtype": "float32"}, hooks=infos)
    for r, n in enumerate(n_tokens):
        rid = str(r)
        texts = [f"t{r}_{i}" if i % 3 else f" w{i}" for i in range(n)]
        req = RequestCapture(rid, f"prompt {r}", list(range(prompt_len)), {"max_tokens": n - prompt_len},
                             generated_token_ids=list(range(100, 100 + n - prompt_len)), token_texts=texts,
                             logprobs=[-0.5] * (n - prompt_len), finish_reason="length")
        for k, (name, info) in enumerate(infos.items()):
            rows = HookRows(info.width)
            pos = np.arange(n - 1)
            rows.append(pos, np.arange(n - 1) + 1000, fake_value(k + 10 * r, pos, info.width))
            req.hooks[name] = rows
        run.requests[rid] = req
    return run


# ------------------------------------------------------------------------------------------ fake engine API

# The fake speaks the real Session's data types (plain dataclasses, no vLLM behind them).
FakeSessionOptions, FakeSampling, FakeBootProgress = SessionOptions, Sampling, BootProgress
FakeRequestStep, FakeStepEvent = RequestStep, StepEvent


def fake_types():
    return FakeSessionOptions, FakeSampling


VOCAB = [" the", " cat", " sat", " on", " a", " mat", ".", "\n", " and", " then", " it", " ran"]


class FakeSession:
    """The Session API over synthetic activations (value = fake_value(...) * scale + bias)."""

    boot_delay = 0.0
    step_delay = 0.0
    fail_open: str | None = None
    fail_at_step: int | None = None  # raise during generate at this step (engine crash)
    opened: list["FakeSession"] = []
    next_id = 0  # class-wide, like the real session's: ids stay unique when the engine is reopened

    def __init__(self, options, progress=None, layers=2, hidden=16, intermediate=32):
        self.options = options
        self.catalogue = make_catalogue(layers, hidden, intermediate)
        self._index = {h.name: i for i, h in enumerate(self.catalogue)}
        self.installed = self._resolve(options.hooks)
        self.run = Run(metadata={"model": options.model, "mode": options.mode, "dtype": options.dtype})
        self.run.hooks.update(self.installed)
        self.alive = True
        self.threads: set[int] = {threading.get_ident()}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._interventions: list = []
        self._iv_version = 0
        FakeSession.opened.append(self)

    @classmethod
    def open(cls, options, progress=None):
        for stage in ("resolving", "loading", "compiling"):
            if progress:
                progress(FakeBootProgress(stage, f"{stage} {options.model}"))
            time.sleep(cls.boot_delay / 3)
            if cls.fail_open and stage == "loading":
                raise SessionError(cls.fail_open)
        session = cls(options, progress)
        if progress:
            progress(FakeBootProgress("ready", "ready"))
        return session

    def _resolve(self, patterns) -> dict:
        out = {}
        for pat in patterns:
            hits = [h for h in self.catalogue if h.matches(pat)]
            if not hits:
                raise ValueError(f"no hook point matches {pat!r}")
            out.update({h.name: h for h in hits})
        return out

    def new_run(self):
        self.threads.add(threading.get_ident())
        self.run = Run(metadata=dict(self.run.metadata), hooks=dict(self.installed))

    def stop(self):
        self._stop.set()

    def set_interventions(self, interventions):
        widths = {n: h.width for n, h in self.installed.items()}
        for iv in interventions:  # the real session's validation
            validate(iv, widths, self.options.max_model_len, self.options.enable_position_interventions)
        with self._lock:
            self._interventions = list(interventions)
            self._iv_version += 1

    def set_hooks(self, hooks):
        self.threads.add(threading.get_ident())
        self.installed = self._resolve(hooks)
        self.run.hooks.update(self.installed)
        if self.options.mode == "compiled":
            time.sleep(self.boot_delay)
            return True
        return False

    def close(self):
        self.threads.add(threading.get_ident())
        self.alive = False

    # ---- generation ----
    def _apply(self, hook, rid, positions, values, ivs):
        for iv in ivs:
            if iv.hook != hook or iv.request_id not in (None, rid):
                continue
            mask = np.ones(len(positions), bool) if iv.positions is None else np.isin(positions, iv.positions)
            scale = np.asarray(iv.scale, dtype=np.float32)
            bias = np.asarray(iv.bias, dtype=np.float32)
            values[mask] = values[mask] * scale + bias
        return values

    def generate(self, prompts, sampling):
        self.threads.add(threading.get_ident())
        self._stop.clear()
        reqs = []
        for prompt in prompts:
            rid = str(FakeSession.next_id)
            FakeSession.next_id += 1
            toks = [prompt[i:i + 3] for i in range(0, len(prompt), 3)] or [" "]
            ids = [sum(map(ord, t)) % 1000 for t in toks]
            rc = RequestCapture(rid, prompt, ids, asdict(sampling), token_texts=list(toks))
            self.run.requests[rid] = rc
            reqs.append({"rid": rid, "next_pos": 0, "pending": list(range(len(ids))), "done": False,
                         "iv_version": -1})
        step = 0
        while any(not r["done"] for r in reqs):
            if self._stop.is_set():
                return
            if self.fail_at_step is not None and step == self.fail_at_step:
                self.alive = False
                raise RuntimeError("engine core died (simulated crash)")
            time.sleep(self.step_delay)
            with self._lock:
                ivs, version = list(self._interventions), self._iv_version
            out = []
            for r in reqs:
                if r["done"]:
                    continue
                rid, rc = r["rid"], self.run.requests[r["rid"]]
                positions = np.array(r["pending"], dtype=np.int64)
                token_ids = np.array([rc.token_ids[p] for p in positions], dtype=np.int64)
                if r["iv_version"] != version:
                    r["iv_version"] = version
                    mine = [iv for iv in ivs if iv.request_id in (None, rid)]
                    if mine or rc.intervention_log:
                        rc.intervention_log.append((int(positions[0]), [asdict(iv) for iv in mine]))
                rows = {}
                for name, info in self.installed.items():
                    vals = fake_value(self._index[name], positions, info.width)
                    vals = self._apply(name, rid, positions, vals, ivs)
                    rows[name] = (positions, token_ids, vals)
                    if name not in rc.hooks:
                        rc.hooks[name] = HookRows(info.width)
                    rc.hooks[name].append(positions, token_ids, vals)
                n_gen = len(rc.generated_token_ids)
                tok = VOCAB[(n_gen + len(rid)) % len(VOCAB)]
                tid = 500 + VOCAB.index(tok)
                rc.generated_token_ids.append(tid)
                rc.token_texts.append(tok)
                lp = -0.1 - 0.05 * n_gen
                rc.logprobs.append(lp)
                rc.top_logprobs.append([(tid, lp), (tid + 1, lp - 1.0)])
                finished = len(rc.generated_token_ids) >= sampling.max_tokens
                if finished:
                    rc.finish_reason = "length"
                    r["done"] = True
                r["pending"] = [len(rc.token_ids) - 1]
                out.append(FakeRequestStep(rid, (tid,), (tok,), (lp,), (((tid, lp), (tid + 1, lp - 1.0)),), rows,
                                           finished, "length" if finished else None))
            yield FakeStepEvent(step, tuple(out))
            step += 1


def make_window(qtbot, session_cls=FakeSession, boot=True, model="demo", mode="compiled", hooks=None):
    """A MainWindow on the fake engine, booted and ready."""
    from inspector.ui.main_window import MainWindow

    FakeSession.next_id = 0  # as in a fresh app process
    window = keep(qtbot, MainWindow(session_factory=lambda o, p: session_cls.open(o, p), types=fake_types))
    window.show()
    if boot:
        window.open_model(model, mode=mode, hooks=hooks)
        wait_state(qtbot, window, "ready")
    return window


def keep(qtbot, widget):
    """qtbot.addWidget, plus a strong reference until the test's teardown has closed the widget.

    pytest-qt keeps only a weak reference: a shown widget whose Python wrapper is garbage-collected
    before teardown is never closed (a MainWindow's engine thread keeps running) and may be painted
    after pyqtgraph's Python side of it is gone (a crash)."""
    qtbot.addWidget(widget)
    qtbot.__dict__.setdefault("_kept_widgets", []).append(widget)
    return widget


def wait_state(qtbot, window, state, timeout=10000):
    qtbot.waitUntil(lambda: window.state == state, timeout=timeout)
    window._tick()
