"""Widget tests of the whole window on a fake engine (``FakeSession``: the session protocol on synthetic
data). The engine thread, signals, timers, dialogs, export and reopen are all real; only vLLM is
replaced. The same flows run against the real engine in test_ui_end_to_end.py.
"""

import threading

import numpy as np
import pytest
from PySide6.QtWidgets import QMessageBox

from fake_session import FakeSession
from ui_fixtures import fail_on_qt_warnings, keep, make_run, make_window, ui_settings, wait_state  # noqa: F401


@pytest.fixture(autouse=True)
def fake_engine_defaults(monkeypatch):
    for name, value in (("boot_delay", 0.0), ("step_delay", 0.0), ("fail_open", None), ("fail_at_step", None)):
        monkeypatch.setattr(FakeSession, name, value)


def session(window):
    return window.controller.engine.session


def generate(qtbot, window, prompts="hello there world", max_tokens=8, wait=True):
    window.prompt.prompts.setPlainText(prompts)
    window.prompt.max_tokens.setValue(max_tokens)
    assert window.generate()
    if wait:
        wait_state(qtbot, window, "ready")


def test_boot_shows_stages_and_fills_tree(qtbot, ui_settings):
    stages = []
    from inspector.ui.main_window import MainWindow

    FakeSession.boot_delay = 0.3

    def record(report):  # runs on the engine thread, as the session reports each stage
        return lambda progress: (stages.append(progress.stage), report(progress))

    window = keep(qtbot, MainWindow(lambda options, report: FakeSession.open(options, record(report))))
    window.show()
    window.open_model("demo")
    assert window.state.value == "booting" and window.boot_bar.isVisible()
    assert not window.prompt.generate_button.isEnabled()
    qtbot.waitUntil(lambda: "compiling" in stages, timeout=5000)
    qtbot.wait(50)
    assert "Compiling" in window.stage_label.text()
    wait_state(qtbot, window, "ready")
    assert stages == ["resolving", "loading", "probing", "compiling", "ready"]
    assert sorted(window.tree.checked()) == ["model.layers.0.resid_post", "model.layers.1.resid_post"]
    assert window.prompt.generate_button.isEnabled() and window.windowTitle() == "demo (compiled)"
    assert threading.get_ident() not in session(window).threads


def test_generate_streams_into_heatmap_strip_and_text(qtbot, ui_settings):
    window = make_window(qtbot, hooks=["blocks.*.hook_resid_post", "blocks.0.hook_mlp_out"])
    generate(qtbot, window, "abcdefghi\nxyz", max_tokens=10)
    s = session(window)
    assert window.shown.request_ids() == ["req0", "req1"]
    for rid in ("req0", "req1"):
        window.select_request(rid)
        for hook in ("model.layers.1.resid_post", "model.layers.0.mlp.mlp_out"):
            window.select_hook(hook)
            expected = s.run.requests[rid].hooks[hook]
            assert window.heatmap.column_count() == len(expected) == len(s.run.requests[rid].token_ids) - 1
            np.testing.assert_array_equal(window.heatmap.displayed_data(), expected.values)
            np.testing.assert_array_equal(window.heatmap.image_array(), expected.values)
        assert window.strip.texts() == s.run.requests[rid].token_texts
        req = s.run.requests[rid]
        assert window.generated_text(rid) == "".join(req.token_texts[len(req.prompt_token_ids):])
        window.lower_tabs.setCurrentWidget(window.text_view)  # the hidden tab catches up when shown
        window.refresh()
        assert window.text_view.toPlainText().endswith(window.generated_text(rid))
        window.lower_tabs.setCurrentWidget(window.strip)
    # engine code never ran on the GUI thread, and always on the same thread
    assert len(s.threads) == 1 and threading.get_ident() not in s.threads
    assert "Generated 20 tokens" in window.statusBar().currentMessage()


def test_clicking_a_token_selects_its_heatmap_column(qtbot, ui_settings):
    window = make_window(qtbot)
    generate(qtbot, window, "abcdef", max_tokens=6)
    window.lower_tabs.setCurrentWidget(window.strip)
    rect = window.strip.position_rect(3)
    from PySide6.QtCore import Qt

    qtbot.mouseClick(window.strip.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    assert window.shown.selection.position == 3
    assert window.heatmap.selection.isVisible() and tuple(window.heatmap.selection.getRegion()) == (3, 4)


def test_stop_mid_generation_keeps_what_was_captured(qtbot, ui_settings):
    FakeSession.step_delay = 0.02
    window = make_window(qtbot)
    generate(qtbot, window, "abcdef", max_tokens=500, wait=False)
    qtbot.waitUntil(lambda: window.controller.generating.progress.tokens >= 5, timeout=5000)
    assert window.prompt.stop_button.isEnabled()
    window.prompt.stop_button.click()
    wait_state(qtbot, window, "ready")
    n = len(window.shown.request("req0").generated_token_ids)
    assert 5 <= n < 500
    assert "Stopped after" in window.statusBar().currentMessage()
    # stop before the first step also works (pressed right after Generate)
    generate(qtbot, window, "xyz", max_tokens=500, wait=False)
    window.controller.generating.stop()
    wait_state(qtbot, window, "ready")
    assert window.controller.generating.last_result.stopped and window.controller.generating.last_result.tokens < 500


def test_intervention_mid_generation_marks_and_changes_following_tokens(qtbot, ui_settings):
    FakeSession.step_delay = 0.01
    window = make_window(qtbot)
    hook = "model.layers.1.resid_post"
    generate(qtbot, window, "abcdef", max_tokens=1000, wait=False)
    qtbot.waitUntil(lambda: window.controller.generating.progress.tokens >= 6, timeout=5000)
    row = window.interventions.add_row(hook)
    assert window.interventions.edit(row, "Bias", "100")
    at = window.controller.generating.progress.tokens
    qtbot.waitUntil(lambda: window.controller.generating.progress.tokens >= at + 10, timeout=5000)
    window.controller.generating.stop()
    wait_state(qtbot, window, "ready")
    req = window.shown.request("req0")
    log = req.intervention_log
    assert log and log[-1][1][0]["hook"] == hook and log[-1][1][0]["bias"] == 100.0
    # the new row's identity may reach a step before the edit to 100 does: marked from the first, moved from the second
    marked = min(at for at, ivs in log if any(d["hook"] == hook for d in ivs))
    first = min(at for at, ivs in log if any(d["hook"] == hook and d["bias"] == 100.0 for d in ivs))
    window.select_hook(hook)
    values = window.heatmap.displayed_data()
    assert (values[:first] < 50).all() and (values[first:] > 50).all()
    marks = window.shown.intervention_marks("req0", hook, len(req.token_texts))
    assert (marks[:marked] == 0).all() and (marks[marked:len(values)] == 2).all()
    assert list(window.heatmap.track_marks) == list(marks[:len(values)])
    # NaN typed into the table is refused by the editor; the engine keeps the old set
    assert not window.interventions.edit(row, "Bias", "nan")
    assert session(window).interventions[0].bias == 100.0


def test_engine_refusal_of_interventions_is_shown(qtbot, ui_settings):
    window = make_window(qtbot)
    row = window.interventions.add_row("model.layers.0.resid_post", scale="2")
    assert session(window).interventions[0].scale == 2.0
    # the fake engine refuses interventions on hooks it does not capture
    window.interventions.model.hooks["model.layers.0.mlp.mlp_out"] = window.shown.catalogue["model.layers.0.mlp.mlp_out"]
    window.interventions.edit(row, "Hook", "model.layers.0.mlp.mlp_out")
    assert "engine refused" in window.interventions.last_message
    assert window.interventions.model.rows[row].hook == "model.layers.0.resid_post"


def test_export_then_reopen_shows_identical_arrays(qtbot, ui_settings, tmp_path):
    window = make_window(qtbot, hooks=["blocks.*.hook_resid_post", "blocks.*.hook_attn_out"])
    generate(qtbot, window, "abcdefg\nhij", max_tokens=7)
    shown = window.shown
    live = {(rid, h): shown.rows(rid, h)[1].copy() for rid in shown.request_ids() for h in shown.request(rid).hooks}
    texts = {rid: shown.token_texts(rid) for rid in shown.request_ids()}
    path = str(tmp_path / "run.h5")
    assert window.export(path)
    qtbot.waitUntil(lambda: not window.controller.runs.exporting, timeout=10000)
    assert window.controller.runs.last_export == path
    assert window.open_capture(path)
    assert window.shown is not window.controller.runs.live and window.live_button.isVisible()
    assert window.windowTitle() == "run.h5"
    from inspector.io import LazyHookRows

    assert all(isinstance(hr, LazyHookRows) for hr in window.shown.request("req0").hooks.values())  # lazily
    for (rid, hook), values in live.items():
        np.testing.assert_array_equal(window.shown.rows(rid, hook)[1], values)
    window.select_request("req1")
    window.select_hook("model.layers.0.self_attn.attn_out")
    np.testing.assert_array_equal(window.heatmap.displayed_data(), live[("req1", "model.layers.0.self_attn.attn_out")])
    assert window.strip.texts() == texts["req1"]
    window.tabs.setCurrentWidget(window.summary)
    window.refresh()
    assert window.summary.matrix().shape == (len(texts["req1"]) - 1, 2)
    # generating switches back to the live run
    generate(qtbot, window, "zz", max_tokens=2)
    assert window.shown is window.controller.runs.live and len(window.shown.request_ids()) == 3


def test_a_long_run_writes_its_rows_through_and_shows_and_exports_them_as_kept_in_memory(qtbot, ui_settings,
                                                                                        tmp_path, monkeypatch):
    """A run that could outgrow the app's limit keeps its rows in a scratch file: the heatmap, the
    summary and an export show what the engine sent (its session keeps its own copy in memory), and
    the scratch file goes with the run."""
    from inspector.io import read_run
    from inspector.io.spool import SpooledHookRows

    monkeypatch.setenv("INSPECTOR_CACHE", str(tmp_path / "cache"))
    window = make_window(qtbot, hooks=["blocks.*.hook_resid_post"])
    window.controller.generating.write_through_bytes = 1  # every run is a long one
    generate(qtbot, window, "abcdefg\nhij", max_tokens=7)
    live, engine = window.controller.runs.live, window.controller.engine.session.run
    assert live.spool is not None and live.spool.path.parent == tmp_path / "cache" / "spool"
    for rid, req in engine.requests.items():
        for hook, rows in req.hooks.items():
            assert isinstance(live.request(rid).hooks[hook], SpooledHookRows)
            np.testing.assert_array_equal(np.asarray(live.rows(rid, hook)[1]), rows.values)
    window.select_request("req1")
    window.select_hook(next(iter(engine.requests["req1"].hooks)))
    qtbot.waitUntil(lambda: window.heatmap.image_array() is not None and not window.heatmap._pooling)
    np.testing.assert_array_equal(window.heatmap.image_array(),
                                  next(iter(engine.requests["req1"].hooks.values())).values)
    path = tmp_path / "run.h5"
    assert window.export(str(path))
    qtbot.waitUntil(lambda: not window.controller.runs.exporting, timeout=10000)
    exported = read_run(path)
    for rid, req in engine.requests.items():
        for hook, rows in req.hooks.items():
            np.testing.assert_array_equal(exported.requests[rid].hooks[hook].values, rows.values)
    window.controller.runs._new_run()
    assert not list((tmp_path / "cache" / "spool").iterdir())


def test_export_cancel_and_failure_leave_nothing(qtbot, ui_settings, tmp_path):
    window = make_window(qtbot)
    generate(qtbot, window, "abc", max_tokens=3)
    gate = threading.Event()
    window.file_tasks.start(lambda state: gate.wait(10))  # holds the export until it is cancelled
    target = tmp_path / "x.h5"
    assert window.export(str(target))
    from PySide6.QtWidgets import QPushButton

    window._export_dialog.findChild(QPushButton).click()  # the progress dialog's Cancel button
    gate.set()
    qtbot.waitUntil(lambda: not window.controller.runs.exporting, timeout=10000)
    assert "Export cancelled" in window.statusBar().currentMessage() and window._export_dialog is None
    assert list(tmp_path.iterdir()) == [tmp_path / "settings"]  # no file, no temp file
    missing = tmp_path / "missing-dir" / "x.h5"
    window.export(str(missing))
    qtbot.waitUntil(lambda: not window.controller.runs.exporting, timeout=10000)
    assert window.last_dialog is not None and "Export failed" in window.last_dialog.text()
    assert "does not exist" in window.last_dialog.text() and not missing.parent.exists()
    window.last_dialog.close()


def test_open_capture_without_engine_and_unreadable_file(qtbot, ui_settings, tmp_path):
    from inspector.io import write_run

    window = make_window(qtbot, boot=False)
    assert window.state.value == "no model"
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"this is not hdf5")
    assert not window.open_capture(str(bad))
    assert "Cannot open the capture" in window.last_dialog.text()
    window.last_dialog.close()
    run = make_run(n_tokens=(10, 6), width=12)
    write_run(run, tmp_path / "ok.h5")
    assert window.open_capture(str(tmp_path / "ok.h5"))
    window.refresh()
    hook = window.shown.selection.hook
    np.testing.assert_array_equal(window.heatmap.displayed_data(), run.requests["req0"].hooks[hook].values)
    assert window.strip.texts() == run.requests["req0"].token_texts
    assert "alt100" in window.strip.tooltip_text(4)  # the most likely tokens, as text
    assert str(tmp_path / "ok.h5") in window.settings.recent_captures
    assert window.controller.engine.session is None  # no model, no engine


def test_bad_model_path_shows_dialog_and_keeps_engine(qtbot, ui_settings, tmp_path):
    window = make_window(qtbot)
    generate(qtbot, window, "abc", max_tokens=3)
    for bad in (tmp_path / "nope", tmp_path):
        assert not window.open_model(str(bad))
        assert "Cannot open the model" in window.last_dialog.text()
        window.last_dialog.close()
    assert window.state.value == "ready" and session(window).alive
    generate(qtbot, window, "def", max_tokens=2)
    assert len(window.shown.request_ids()) == 2


def test_engine_failure_on_open_is_a_dialog_and_app_recovers(qtbot, ui_settings, tmp_path):
    window = make_window(qtbot)
    generate(qtbot, window, "abc", max_tokens=3)
    FakeSession.fail_open = "no model directory at /x: broken weights"
    (tmp_path / "config.json").write_text("{}")
    window.open_model(str(tmp_path))
    wait_state(qtbot, window, "no model")
    assert "broken weights" in window.last_dialog.text()
    window.last_dialog.close()
    assert window.shown.request("req0") is not None  # captured data kept
    FakeSession.fail_open = None
    window.open_model("demo")
    wait_state(qtbot, window, "ready")


def test_engine_crash_mid_generation_keeps_captures(qtbot, ui_settings):
    window = make_window(qtbot)
    FakeSession.fail_at_step = 4
    generate(qtbot, window, "abcdef", max_tokens=20, wait=False)
    wait_state(qtbot, window, "dead")
    assert "engine core died" in window.last_dialog.text() and "kept" in window.last_dialog.text()
    window.last_dialog.close()
    assert len(window.shown.request("req0").generated_token_ids) == 4
    assert window.heatmap.column_count() > 0
    FakeSession.fail_at_step = None
    window.restart_engine()
    wait_state(qtbot, window, "ready")
    generate(qtbot, window, "x", max_tokens=2)
    assert window.shown.request_ids() == ["req0", "req1"]  # the reopened engine's request is a new one
    assert len(window.shown.request("req0").generated_token_ids) == 4
    assert len(window.shown.request("req1").generated_token_ids) == 2


def test_compiled_hook_change_asks_then_restarts(qtbot, ui_settings):
    window = make_window(qtbot)
    window.tree.apply_preset("All MLP out")
    window.tree.apply_button.click()
    box = window.last_dialog
    assert isinstance(box, QMessageBox) and "Restart the engine" in box.windowTitle()
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert window.state.value == "ready" and len(session(window).installed) == 2
    window.tree.apply_button.click()
    window.last_dialog.button(QMessageBox.StandardButton.Yes).click()
    qtbot.waitUntil(lambda: len(session(window).installed) == 4, timeout=5000)
    wait_state(qtbot, window, "ready")
    assert not window.tree.pending() and "restarted" in window.statusBar().currentMessage()
    generate(qtbot, window, "abc", max_tokens=3)
    assert "model.layers.1.mlp.mlp_out" in window.shown.request("req0").hooks


def test_eager_mode_switch_and_live_hooks(qtbot, ui_settings):
    window = make_window(qtbot)
    window.tree.mode_box.setCurrentIndex(window.tree.mode_box.findData("eager"))
    window.last_dialog.button(QMessageBox.StandardButton.Yes).click()
    wait_state(qtbot, window, "ready")
    assert session(window).options.mode == "eager" and window.tree.mode() == "eager"
    window.tree.set_hook_checked("model.layers.0.mlp.mlp_out", True)  # no dialog: applies by itself
    qtbot.waitUntil(lambda: "model.layers.0.mlp.mlp_out" in session(window).installed, timeout=5000)
    # the GUI thread says so once the engine thread's job has reported back
    qtbot.waitUntil(lambda: "applied live" in window.statusBar().currentMessage(), timeout=5000)
    assert window.settings.engine_mode == "eager"


def test_settings_persist(qtbot, ui_settings, tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    window = make_window(qtbot, model=str(model_dir))
    window.heatmap.set_colormap("viridis")
    window.interventions_dock.hide()
    window.close()
    assert not window.painter.timer.isActive() and not window._clock.isActive()  # nothing runs on a closed window
    from inspector.ui.settings import Settings

    s = Settings()
    assert s.colormap == "viridis" and s.recent_models[0] == str(model_dir.resolve())
    assert s.last_model == str(model_dir.resolve())
    assert s.window_geometry() is not None and s.window_state() is not None
    window2 = make_window(qtbot, boot=False)
    assert window2.heatmap.colormap_name() == "viridis"
    assert window2.interventions_dock.isHidden() and not window2.tree_dock.isHidden()
    assert [a.text() for a in window2.menus.recent_models_menu.actions()] == [str(model_dir.resolve())]


def test_opening_another_model_keeps_the_earlier_run(qtbot, ui_settings, tmp_path):
    window = make_window(qtbot)
    generate(qtbot, window, "abc", max_tokens=3)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    window.open_model(str(other))
    wait_state(qtbot, window, "ready")
    live = window.controller.runs.live
    assert live.request_ids() == [] and len(window.controller.runs.earlier) == 1
    earlier = window.controller.runs.earlier[0]
    assert earlier.request_ids() == ["req0"] and window.menus.earlier_menu.isEnabled()
    window.menus.earlier_menu.actions()[0].trigger()
    window.refresh()
    assert window.shown is earlier and window.heatmap.column_count() == len(earlier.request("req0").token_ids) - 1
    generate(qtbot, window, "xyz", max_tokens=2)  # back to the live run of the new model
    assert window.shown is live and len(live.request_ids()) == 1


def test_failure_messages():
    from inspector.core.protocol import SessionError
    from inspector.viewer.app_state import describe_exception

    assert describe_exception(MemoryError(), "generating").startswith("Out of memory while generating")
    msg = describe_exception(RuntimeError("CUDA error: out of memory"), "opening the model")
    assert "Out of memory while opening the model" in msg and "fewer hook points" in msg
    assert describe_exception(ValueError("bad"), "changing hook points") == "ValueError while changing hook points: bad"
    assert describe_exception(SessionError("the engine said so"), "generating") == "the engine said so"


def test_the_tensor_parallel_size_is_an_engine_option_kept_in_the_settings(qtbot, ui_settings):
    """Engine ▸ Tensor Parallel Size: the engine opened next, or restarted, is split over that many ranks
    (its other engine arguments kept); 1 asks for no tensor parallelism."""
    window = make_window(qtbot)
    assert session(window).options.engine_args == {}
    window.set_tensor_parallel_size(2)
    assert window.settings.tensor_parallel_size == 2 and "restarts" in window.statusBar().currentMessage()
    assert session(window).options.engine_args == {}  # the running engine is left as it is
    window.restart_engine()
    wait_state(qtbot, window, "ready")
    assert session(window).options.engine_args == {"tensor_parallel_size": 2}
    window.set_tensor_parallel_size(1)
    window.open_model("demo")
    wait_state(qtbot, window, "ready")
    assert session(window).options.engine_args == {}
    assert any(a.text() == "&Tensor Parallel Size…" for a in window.menuBar().actions()[1].menu().actions())


def test_a_capture_window_chosen_next_to_a_hooks_check_box_keeps_only_its_rows(qtbot, ui_settings):
    from PySide6.QtWidgets import QAbstractItemDelegate, QComboBox

    from inspector.core.windows import CaptureWindow
    from inspector.ui.model_tree import WINDOW_COLUMN

    window = make_window(qtbot, hooks=["blocks.*.hook_resid_post"])
    tree, hook, other = window.tree, "model.layers.0.resid_post", "model.layers.1.resid_post"
    assert tree.tree.header().visualIndex(WINDOW_COLUMN) == 1  # beside the check box
    index = tree.leaf_index(hook).siblingAtColumn(WINDOW_COLUMN)
    assert index.data() == "all"
    tree.tree.scrollTo(index)
    tree.tree.edit(index)  # the user double-clicks the cell: an editable combo box of windows
    editor = next(box for box in tree.tree.viewport().findChildren(QComboBox) if box.isVisible())
    assert [editor.itemText(i) for i in range(editor.count())] == ["all", "generated", "last:16", "every:4"]
    editor.setCurrentText("generated")
    with qtbot.waitSignal(tree.windowsChanged):
        tree.tree.commitData(editor)
    tree.tree.closeEditor(editor, QAbstractItemDelegate.EndEditHint.NoHint)
    assert index.data() == "generated" and window.controller.engine.windows == {hook: CaptureWindow("generated")}
    assert session(window).windows == {hook: CaptureWindow("generated")}

    generate(qtbot, window, "abcdefghi", max_tokens=5)
    req = session(window).run.requests["req0"]
    prompt_len = len(req.prompt_token_ids)
    assert req.windows == {hook: "generated"}
    assert req.hooks[hook].positions.tolist() == list(range(prompt_len - 1, len(req.token_ids) - 1))
    assert req.hooks[other].positions.tolist() == list(range(len(req.token_ids) - 1))
    window.select_hook(hook)
    window.refresh()
    assert window.heatmap.column_count() == len(req.hooks[hook])
    np.testing.assert_array_equal(window.heatmap.displayed_data(), req.hooks[hook].values)
    window.select_position(0)
    assert "outside this hook's capture window generated" in window.statusBar().currentMessage()

    tree.set_window(other, "every:0")  # typed wrong: refused, the cell shows the window in force
    assert tree._window_item(other).text() == "all" and "from 1 to" in tree.summary.text()
    tree.set_window(other, "every:2")
    tree.set_window(hook, "all")
    assert session(window).windows == {other: CaptureWindow("every", 2)}
    generate(qtbot, window, "abcdefghi", max_tokens=5)
    req = session(window).run.requests["req1"]
    assert req.windows == {other: "every:2"} and len(req.hooks[hook]) == len(req.token_ids) - 1
    assert req.hooks[other].positions.tolist() == list(range(0, len(req.token_ids) - 1, 2))
    window.select_request("req1")
    window.select_hook(other)
    window.refresh()
    assert window.heatmap.position_axis.x_of(4) == 2 and window.heatmap.position_axis.x_of(3) is None


def test_kinds_a_model_does_not_offer_are_named_with_why(qtbot, ui_settings, monkeypatch):
    from fake_session import FakeSession

    window = make_window(qtbot)
    assert window.stage_label.toolTip() == "Blocks: fused (LlamaDecoderLayer), read from its forward"
    assert "not offered" not in window.statusBar().currentMessage()
    why = "GPTJForCausalLM: resid_mid not offered because its attention and MLP branches both read resid_pre"
    monkeypatch.setattr(FakeSession, "block_family", "parallel (GPTJBlock), read from its forward")
    monkeypatch.setattr(FakeSession, "refused_kinds", {"resid_mid": why})
    window.open_model("demo", mode="compiled")
    wait_state(qtbot, window, "ready")
    assert window.statusBar().currentMessage() == ("Model ready in 0 s: demo; not offered: resid_mid (the ready "
                                                   "label's tooltip says why)")
    assert window.stage_label.toolTip() == f"Blocks: parallel (GPTJBlock), read from its forward\n{why}"
