"""Fixtures for the GUI tests (imported by tests/test_ui_*.py).

- ``QT_QPA_PLATFORM=offscreen`` before any QApplication exists.
- ``fail_on_qt_warnings``: a qInstallMessageHandler that records Qt warnings/criticals and fails the
  test that produced them (like pyqtgraph's own test suite).
- ``ui_settings``: QSettings kept in a temporary directory.
- Synthetic runs, and windows on ``FakeSession`` (tests/fake_session.py), driven on real threads.
"""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from fake_session import FakeSession, fake_value, llama_catalogue  # noqa: E402
from inspector.core.run import HookRows, RequestCapture, Run, TopToken  # noqa: E402

__all__ = ["fail_on_qt_warnings", "ui_settings", "make_run", "make_window", "wait_state", "keep"]

IGNORED_QT_MESSAGES = (
    "propagateSizeHints",  # offscreen platform noise
    "QFont::setPointSize: Point size <= 0",  # pyqtgraph axis label fonts on offscreen
)


@pytest.fixture
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


def make_run(n_tokens=(12, 7), kinds=("resid_post", "mlp_out"), prompt_len: int = 4, width: int = 16) -> Run:
    """A finished Run with requests req0, req1, … of the given token counts (rows = tokens - 1 per hook)."""
    infos = {h.name: h for h in llama_catalogue(hidden=width, intermediate=2 * width) if h.kind in kinds}
    run = Run(metadata={"model": "synthetic", "engine_mode": "compiled", "dtype": "float32"}, hooks=infos)
    for r, n in enumerate(n_tokens):
        rid = f"req{r}"
        texts = [f"t{r}_{i}" if i % 3 else f" w{i}" for i in range(n)]
        generated = list(range(100, 100 + n - prompt_len))
        req = RequestCapture(rid, f"prompt {r}", list(range(prompt_len)), {"max_tokens": n - prompt_len},
                             generated_token_ids=generated, token_texts=texts,
                             logprobs=[-0.5] * len(generated), finish_reason="length",
                             top_logprobs=[[TopToken(t, -0.5, f"alt{t}")] for t in generated])
        for k, (name, info) in enumerate(infos.items()):
            rows = req.hooks[name] = HookRows(info.width)
            pos = np.arange(n - 1)
            rows.append(pos, pos + 1000, fake_value(k + 10 * r, pos, info.width))
        run.requests[rid] = req
    return run


def make_window(qtbot, boot=True, model="demo", mode="compiled", hooks=None):
    """A MainWindow on the fake engine, booted and ready. Its session keeps a copy of the rows too
    (``retain_rows``), for the tests to compare the window with."""
    from inspector.ui.main_window import MainWindow

    FakeSession._next_id = 0  # as in a fresh app process
    window = keep(qtbot, MainWindow(FakeSession.open))
    window.show()
    if boot:
        window.open_model(model, mode=mode, hooks=hooks, retain_rows=True)
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


def run_prompts(qtbot, w, prompts="the cat sat", max_tokens=6, compare=False, wait=True):
    """Generate ``prompts`` in the window as a user would (typed, Compare set), waiting for the end."""
    w.prompt.prompts.setPlainText(prompts)
    w.prompt.max_tokens.setValue(max_tokens)
    w.prompt.compare.setChecked(compare)
    assert w.generate()
    if wait:
        wait_state(qtbot, w, "ready")


def wait_state(qtbot, window, state: str, timeout=10000):
    """Wait until the window's controller is in ``state`` (an AppState's value, e.g. "ready")."""
    qtbot.waitUntil(lambda: window.state.value == state, timeout=timeout)
    window.refresh()
