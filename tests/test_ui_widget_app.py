"""Widget tests of ``inspector.ui.app.main`` (what the ``inspector`` command runs for the app), on the
fake session factory."""

import numpy as np
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from fake_session import FakeSession
from inspector.ui.app import main
from ui_fixtures import fail_on_qt_warnings, make_run, ui_settings  # noqa: F401


def run_main(argv, inspect, ready=lambda w: True):
    """Run main(argv); once its window is up and ``ready(window)``, call inspect(window), then close it."""
    seen = {}

    def poke():
        from inspector.ui.main_window import MainWindow

        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows or not ready(windows[0]):
            QTimer.singleShot(20, poke)
            return
        seen["window"] = windows[0]
        try:
            inspect(windows[0])
        finally:
            if windows[0].last_dialog is not None:
                windows[0].last_dialog.close()
            windows[0].close()

    QTimer.singleShot(0, poke)
    assert main(argv, FakeSession.open) == 0
    return seen["window"]


def test_main_boots_the_model_mode_and_hooks_it_is_given(qtbot, ui_settings, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    state = {}

    def inspect(w):
        state["options"] = w.controller.engine.session.options
        state["installed"] = sorted(w.controller.engine.session.installed)
        state["title"] = w.windowTitle()

    run_main([str(tmp_path), "--mode", "eager", "--hooks", "blocks.0.hook_mlp_out, hook_embed"], inspect,
             ready=lambda w: w.state.value == "ready")
    assert state["options"].model == str(tmp_path.resolve()) and state["options"].mode == "eager"
    assert state["installed"] == ["model.embed_tokens.embed", "model.layers.0.mlp.mlp_out"]
    assert state["title"] == f"{tmp_path.name} (eager)"


def test_main_reopens_a_capture_without_a_model(qtbot, ui_settings, tmp_path):
    from inspector.io import write_run

    run = make_run(n_tokens=(8,), width=8)
    write_run(run, tmp_path / "c.h5")
    state = {}

    def inspect(w):
        w.refresh()
        state["state"] = w.state.value
        state["requests"] = w.shown.request_ids()
        state["values"] = w.heatmap.displayed_data().copy()
        state["hook"] = w.shown.selection.hook

    w = run_main([str(tmp_path / "c.h5")], inspect)
    assert state["state"] == "no model" and state["requests"] == ["req0"]
    np.testing.assert_array_equal(state["values"], run.requests["req0"].hooks[state["hook"]].values)
    assert w.controller.engine.session is None


def test_main_with_a_bad_model_path_shows_a_dialog(qtbot, ui_settings, tmp_path):
    state = {}

    def inspect(w):
        state["text"] = w.last_dialog.text() if w.last_dialog else ""
        state["state"] = w.state.value

    run_main([str(tmp_path / "no-such-model")], inspect)
    assert "no model directory" in state["text"] and state["state"] == "no model"
