"""End to end: the window on the REAL engine (vLLM, compiled mode) with a tiny Llama, in a server of
the app's own (a child process), as the app runs by default.

One window boots once for the module (~40-60 s on a 2-core machine); the tests run in order on it.
They check what the widget tests check with a fake engine, against real captures: hook points checked
in the tree, heatmap columns and values equal to the session's captures, the token strip equal to
the generated text, an intervention added mid-generation changing only the following tokens,
export + reopen giving identical arrays, errors as dialogs, and no engine code on the GUI thread.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from PySide6.QtWidgets import QMessageBox

from inspector.viewer.labels import display_token
from ui_fixtures import fail_on_qt_warnings, ui_settings  # noqa: F401

pytestmark = pytest.mark.slow

H_RESID0 = "blocks.0.hook_resid_post"
H_MLP0 = "blocks.0.hook_mlp_out"
PROMPTS = ["def fibonacci(n):", "import os"]


def wait(app, predicate, timeout=300.0):
    t = time.perf_counter()
    while not predicate():
        if time.perf_counter() - t > timeout:
            raise TimeoutError("condition not reached in time")
        app.processEvents()
        time.sleep(0.002)


@pytest.fixture(scope="module")
def window(qapp, tmp_path_factory):
    import os

    from inspector.testing.tinymodels import tiny_model
    from inspector.ui.main_window import MainWindow
    from inspector.ui.settings import configure_storage

    settings_dir = tmp_path_factory.mktemp("settings")
    os.environ["INSPECTOR_SETTINGS_DIR"] = str(settings_dir)
    configure_storage(settings_dir)
    from inspector.client.local import start_local_server

    engine_threads = set()

    def factory(options, progress):  # the app's own factory (a server of its own), recording its thread
        engine_threads.add(threading.get_ident())
        return start_local_server(options, progress)

    w = MainWindow(factory)
    w.resize(1500, 950)
    w.show()
    w.factory_threads = engine_threads
    # retain_rows: the session keeps its own copy of every row, so the test can compare with it
    w.open_model(str(tiny_model("llama")), mode="compiled", hooks=["blocks.*.hook_resid_post"], retain_rows=True)
    wait(qapp, lambda: w.state.value in ("ready", "no model"))
    assert w.state.value == "ready", w.last_dialog.text() if w.last_dialog else w.state
    yield w
    w.close()
    os.environ.pop("INSPECTOR_SETTINGS_DIR", None)


def session(w):
    return w.controller.engine.session


def live(w):
    return w.controller.runs.live


def name_of(w, alias):
    return next(h.name for h in w.controller.engine.info.catalogue if h.alias == alias)


def generate(app, w, prompts, max_tokens, wait_done=True):
    w.prompt.prompts.setPlainText("\n".join(prompts))
    w.prompt.max_tokens.setValue(max_tokens)
    w.prompt.ignore_eos.setChecked(True)
    before = set(live(w).request_ids())
    assert w.generate()
    if wait_done:
        wait(app, lambda: w.state.value != "generating")
        w.refresh()
    return before


def test_check_two_hook_points_in_the_tree(qapp, window, fail_on_qt_warnings):
    w = window
    resid0, mlp0 = name_of(w, H_RESID0), name_of(w, H_MLP0)
    w.tree.apply_preset("None")
    w.tree.set_hook_checked(resid0, True)
    w.tree.set_hook_checked(mlp0, True)
    assert sorted(w.tree.checked()) == sorted([resid0, mlp0]) and w.tree.pending()
    w.tree.apply_button.click()
    box = w.last_dialog
    assert isinstance(box, QMessageBox) and "Restart" in box.windowTitle()
    box.button(QMessageBox.StandardButton.Yes).click()
    wait(qapp, lambda: w.state.value == "ready" and set(session(w).installed) == {resid0, mlp0})
    assert not w.tree.pending()


def test_generate_heatmap_equals_captures_and_strip_equals_text(qapp, window, fail_on_qt_warnings):
    w = window
    before = generate(qapp, w, PROMPTS, max_tokens=12)
    s = session(w)
    new = [rid for rid in live(w).request_ids() if rid not in before]
    assert len(new) == 2
    for rid in new:
        req = s.run.requests[rid]
        assert len(req.generated_token_ids) == 12
        w.select_request(rid)
        for hook in s.installed:
            w.select_hook(hook)
            rows = req.hooks[hook]
            assert w.heatmap.column_count() == len(rows) == len(req.token_ids) - 1  # one column per fed token
            np.testing.assert_array_equal(w.heatmap.displayed_data(), rows.values)
            np.testing.assert_array_equal(w.heatmap.image_array(), rows.values)  # 128 wide: not pooled
        assert w.strip.texts() == req.token_texts
        assert w.generated_text(rid) == "".join(req.token_texts[len(req.prompt_token_ids):])
    assert len(w.factory_threads) == 1 and threading.get_ident() not in w.factory_threads


def test_the_lens_tab_fills_with_the_engines_own_lens(qapp, window, fail_on_qt_warnings):
    w = window
    rid = live(w).request_ids()[-1]
    w.select_request(rid)
    w.tabs.setCurrentWidget(w.lens_view)
    cells = w.lens_view.cells
    wait(qapp, lambda: w.refresh() or (cells.grid is not None and cells.grid.shape[1] > 0
                                       and (cells.grid.top_ids[:, :, 0] >= 0).all()), timeout=60)
    rows = session(w).run.requests[rid].hooks[name_of(w, H_RESID0)].values
    top = session(w).lens(rows, k=1).top_ids[:, 0]
    assert cells.grid.labels == ["L0 resid_post"] and cells.grid.shape == (1, len(rows))
    assert [cells.grid.cell_text(cells.mode, 0, c) for c in range(len(rows))] == \
           [display_token(t) for t in session(w).token_texts(top)]
    w.tabs.setCurrentWidget(w.heatmap)


def test_intervention_mid_generation_changes_only_following_tokens(qapp, window, fail_on_qt_warnings):
    w = window
    hook = name_of(w, H_RESID0)
    prompt = ["class Foo:"]
    clean_ids = generate(qapp, w, prompt, max_tokens=200)
    clean_rid = [r for r in live(w).request_ids() if r not in clean_ids][0]
    clean = session(w).run.requests[clean_rid].hooks[hook].values.copy()

    before = generate(qapp, w, prompt, max_tokens=200, wait_done=False)
    wait(qapp, lambda: w.controller.generating.progress.tokens >= 3)
    row = w.interventions.add_row(hook)
    assert w.interventions.edit(row, "Bias", "100")  # applied before the next forward
    wait(qapp, lambda: w.state.value != "generating")
    w.refresh()
    rid = [r for r in live(w).request_ids() if r not in before][0]
    req = session(w).run.requests[rid]
    # the new row (scale 1, bias 0: no change) may reach the engine a step or more before its edit
    marked = [p for p, ivs in req.intervention_log if ivs]
    steered = [p for p, ivs in req.intervention_log if any(iv["bias"] == 100.0 for iv in ivs)]
    assert steered, req.intervention_log
    first = steered[0]
    assert 0 < marked[0] <= first < len(req.token_ids) - 1
    values = req.hooks[hook].values
    np.testing.assert_array_equal(values[:first], clean[:first])  # tokens before: untouched
    np.testing.assert_allclose(values[first], clean[first] + 100.0, rtol=1e-5, atol=1e-3)
    assert (np.abs(values[first:] - clean[first:len(values)]).max(axis=1) > 1.0).all()
    # the GUI's mirror has the same rows and marks exactly the intervened positions
    np.testing.assert_array_equal(live(w).rows(rid, hook)[1], values)
    w.select_request(rid)
    w.select_hook(hook)
    marks = w.heatmap.track_marks
    why = (req.intervention_log, live(w).request(rid).intervention_log, marks.tolist())
    assert (marks[:marked[0]] == 0).all() and (marks[marked[0]:] == 2).all(), why
    w.interventions.clear()
    assert w.controller.generating.interventions == []


def test_export_then_reopen_gives_identical_arrays(qapp, window, tmp_path, fail_on_qt_warnings):
    w = window
    path = str(tmp_path / "run.h5")
    run = live(w)
    expected = {(rid, h): run.rows(rid, h)[1].copy() for rid in run.request_ids() for h in run.request(rid).hooks}
    texts = {rid: run.token_texts(rid) for rid in run.request_ids()}
    logs = {rid: run.request(rid).intervention_log for rid in run.request_ids()}
    tops = {rid: run.request(rid).top_logprobs for rid in run.request_ids()}
    assert w.export(path)
    wait(qapp, lambda: not w.controller.runs.exporting, timeout=60)
    assert w.controller.runs.last_export == path
    assert w.open_capture(path)
    for (rid, h), values in expected.items():
        np.testing.assert_array_equal(w.shown.rows(rid, h)[1], values)
    for rid, t in texts.items():
        assert w.shown.token_texts(rid) == t and w.shown.request(rid).top_logprobs == tops[rid]
        assert [p for p, _ in w.shown.request(rid).intervention_log] == [p for p, _ in logs[rid]]
    w.show_live()


def test_bad_model_path_is_a_dialog_and_app_stays_usable(qapp, window, tmp_path, fail_on_qt_warnings):
    w = window
    assert not w.open_model(str(tmp_path / "does-not-exist"))
    assert "Cannot open the model" in w.last_dialog.text()
    w.last_dialog.close()
    assert w.state.value == "ready" and session(w).alive
    # a directory that looks like a model but is not one: the engine refuses it, the app stays alive
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "nosuch"}')
    n_requests = len(live(w).request_ids())
    assert w.open_model(str(tmp_path))
    wait(qapp, lambda: w.state.value != "booting")
    assert w.state.value == "no model"
    assert "Could not open the model" in w.last_dialog.text()
    w.last_dialog.close()
    assert len(live(w).request_ids()) == n_requests  # nothing captured was lost
    assert len(w.factory_threads) == 1 and threading.get_ident() not in w.factory_threads
