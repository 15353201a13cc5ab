"""Widget tests of ``inspector.ui.app.main`` (the entry point the ``inspector`` command calls)."""

import numpy as np
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from inspector.ui.app import build_parser, main
from ui_fixtures import fail_on_qt_warnings, make_run, ui_settings  # noqa: F401


def run_main(argv, inspect):
    """Run main(argv); once its window is up, call inspect(window), then close the window."""
    seen = {}

    def poke():
        from inspector.ui.main_window import MainWindow

        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows:
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
    assert main(argv) == 0
    return seen["window"]


def test_parser():
    a = build_parser().parse_args(["model-dir", "--mode", "eager", "--hooks", "a,b"])
    assert (a.path, a.mode, a.hooks) == ("model-dir", "eager", "a,b")


def test_main_reopens_a_capture_without_a_model(qtbot, ui_settings, tmp_path):
    from inspector.io.hdf5 import write_run

    run = make_run(n_tokens=(8,), width=8)
    write_run(run, tmp_path / "c.h5")
    state = {}

    def inspect(w):
        w._tick()
        state["state"] = w.state
        state["requests"] = w.vm.request_ids()
        state["values"] = w.heatmap.displayed_data().copy()
        state["hook"] = w.vm.selected_hook

    w = run_main([str(tmp_path / "c.h5")], inspect)
    assert state["state"] == "no-model" and state["requests"] == ["0"]
    np.testing.assert_array_equal(state["values"], run.requests["0"].hooks[state["hook"]].values)
    assert w.controller.worker.session is None


def test_main_with_a_bad_model_path_shows_a_dialog(qtbot, ui_settings, tmp_path):
    state = {}

    def inspect(w):
        state["text"] = w.last_dialog.text() if w.last_dialog else ""
        state["state"] = w.state

    run_main([str(tmp_path / "no-such-model")], inspect)
    assert "does not exist" in state["text"] and state["state"] == "no-model"
