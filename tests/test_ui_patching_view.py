"""The Patching tab on the fake engine (real threads, real widgets): a sweep fills the grid and the
progress as its engine calls finish and equals ``patch`` run directly; a multi-token answer and
prompts of unequal length are refused with the reason; Stop keeps the cells that ran; a click on a
cell generates its patched run with that cell's intervention alone; a saved sweep reads back; a kind
not captured is offered for capture; and a sweep and a generation never run at once."""

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMessageBox

from fake_session import FakeSession
from inspector.core.interventions import Intervention
from inspector.experiments.patching import Metric, PatchSpec, patch
from inspector.io.sweep import read_sweep
from inspector.viewer.patching import METRIC
from ui_fixtures import fail_on_qt_warnings, make_window, ui_settings, wait_state  # noqa: F401

PRE = ["blocks.*.hook_resid_pre"]
CLEAN, CORRUPTED = "the cat sat on the mat", "the dog sat on the rug"  # 8 tokens each on the fake
ANSWER, FOIL = " ca", " do"  # one token each on the fake (it splits text every 3 characters)


def patching_window(qtbot, max_slots=64, hooks=PRE):
    """A window on the fake engine with the Patching tab on show; ``max_slots`` 3: two cells per hook
    point and engine call, so a sweep of two layers takes an engine call per two positions."""
    w = make_window(qtbot, boot=False)
    w.open_model("demo", mode="compiled", hooks=hooks, retain_rows=True, max_slots=max_slots)
    wait_state(qtbot, w, "ready")
    w.tabs.setCurrentWidget(w.patching_view)
    return w


def type_sweep(view, clean=CLEAN, corrupted=CORRUPTED, answer=ANSWER, foil=FOIL, kind="resid_pre"):
    view.clean_edit.setPlainText(clean)
    view.corrupted_edit.setPlainText(corrupted)
    view.answer_edit.setText(answer)
    view.foil_edit.setText(foil)
    view.kind_box.setCurrentText(kind)


def run_sweep(qtbot, w, **typed):
    type_sweep(w.patching_view, **typed)
    w.patching_view.run_button.click()
    wait_state(qtbot, w, "ready")
    w.patching_view.repaint_sweep()
    return w.controller.experiments.sweep


def test_a_sweep_fills_the_grid_and_the_progress_as_its_engine_calls_finish(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.05)
    w = patching_window(qtbot, max_slots=3)
    view = w.patching_view
    type_sweep(view)
    view.run_button.click()
    assert w.state.value == "patching" and not w.prompt.generate_button.isEnabled()
    seen = set()
    while w.state.value == "patching":
        qtbot.wait(10)
        if view.progress.isVisible():
            seen.add((view.progress.value(), view.progress.maximum(), view.message.text()))
    view.repaint_sweep()
    done = sorted({value for value, maximum, _ in seen if maximum})
    assert len([d for d in done if 0 < d < 16]) >= 2, seen  # it filled in steps: 2 layers × 8 positions, 4 calls
    assert any(message.startswith("engine call 2 of 4") for *_, message in seen), seen
    result = w.controller.experiments.sweep.result
    assert result.complete and result.engine_calls == 4 and view.message.text().startswith("Done: 16 cells")
    grid = view.cells.grid
    assert grid.shape == (2, 8) and grid.labels == ["L0 resid_pre", "L1 resid_pre"]
    assert grid.tokens == result.token_texts["corrupted"] == ["the", " do", "g s", "at ", "on ", "the", " ru", "g"]
    session = w.controller.engine.session
    direct = patch(session, PatchSpec(CLEAN, CORRUPTED, tuple(result.hooks), Metric(*session.tokenize(ANSWER + FOIL))))
    np.testing.assert_array_equal(result.raw, direct.raw)
    assert grid.cell_text(view.mode_box.currentText(), 1, 2) == f"{direct.normalized[1, 2]:.2f}"
    view.mode_box.setCurrentText(METRIC)
    assert view.cells.grid.cell_text(view.cells.mode, 1, 2) == f"{direct.raw[1, 2]:.2f}"
    assert "clean run" in view.details.text() and "logit difference ' ca' − ' do'" in view.details.text()
    assert view.cells.viewport().grab().width() > 0  # paints
    assert not session.run.requests and w.controller.runs.live.request_ids() == []  # the sweep leaves no run behind


def test_an_answer_of_two_tokens_is_refused_with_how_it_splits(qtbot, ui_settings):
    w = patching_window(qtbot)
    sweep = run_sweep(qtbot, w, answer=" cat")
    pieces = w.controller.engine.session.token_texts(w.controller.engine.session.tokenize(" cat"))
    assert "The answer ' cat' is 2 tokens, not one: " + " + ".join(map(repr, pieces)) in sweep.problem
    assert w.patching_view.problem.isVisible() and sweep.problem in w.patching_view.problem.text()
    assert sweep.result is None and w.last_dialog is None and w.patching_view.run_button.isEnabled()


def test_prompts_of_unequal_length_are_refused_with_the_sessions_message(qtbot, ui_settings):
    w = patching_window(qtbot)
    first = run_sweep(qtbot, w).result
    sweep = run_sweep(qtbot, w, corrupted="the dog sat")
    assert sweep.problem.startswith("the clean and corrupted prompts must be as many tokens long: 8 vs 4")
    assert sweep.result is first and w.patching_view.cells.grid.shape == (2, 8)  # the sweep before stays
    assert w.last_dialog is None and w.state.value == "ready"


def test_a_refused_sweep_ends_its_status_line_and_its_reason_goes_once_the_input_changes(qtbot, ui_settings):
    w = patching_window(qtbot)
    view = w.patching_view
    run_sweep(qtbot, w, answer=" cat")
    assert not w.statusBar().currentMessage().startswith("Patching sweep over")
    assert "refused" in w.statusBar().currentMessage() and view.problem.isVisible()
    view.answer_edit.setText(ANSWER)  # the input the reason was about is fixed
    view.repaint_sweep()
    assert not view.problem.isVisible() and not w.controller.experiments.sweep.problem
    run_sweep(qtbot, w, corrupted="the dog sat")  # refused too; then another prompt, not yet run
    assert view.problem.isVisible()
    view.corrupted_edit.setPlainText(CORRUPTED)
    view.repaint_sweep()
    assert not view.problem.isVisible()


def test_stop_keeps_the_cells_that_ran_and_marks_the_sweep_incomplete(qtbot, ui_settings, monkeypatch, tmp_path):
    monkeypatch.setattr(FakeSession, "step_delay", 0.05)
    w = patching_window(qtbot, max_slots=3)
    view = w.patching_view
    type_sweep(view)
    view.run_button.click()
    qtbot.waitUntil(lambda: w.controller.experiments.sweep.result is not None and w.controller.experiments.sweep.result.done > 0, timeout=5000)
    assert view.stop_button.isEnabled()
    view.stop_button.click()
    wait_state(qtbot, w, "ready")
    view.repaint_sweep()
    result = w.controller.experiments.sweep.result
    assert result.stopped and 0 < result.done < 16 and not view.stop_button.isEnabled()
    assert view.message.text().startswith(f"Stopped: {result.done} of 16 cells ran")
    texts = [view.cells.grid.cell_text(view.cells.mode, r, c) for r in range(2) for c in range(8)]
    assert sum(bool(t) for t in texts) == result.done  # the cells not run are blank
    view.saveRequested.emit(str(tmp_path / "stopped.h5"))
    qtbot.waitUntil(lambda: (tmp_path / "stopped.h5").exists(), timeout=5000)
    back, _ = read_sweep(tmp_path / "stopped.h5")
    assert not back.complete and back.stopped and back.done == result.done


def test_clicking_a_cell_generates_its_patched_run_without_the_users_interventions(qtbot, ui_settings):
    w = patching_window(qtbot)
    mine = Intervention("blocks.0.hook_resid_pre", scale=2.0)
    w.controller.generating.set_interventions([mine])
    result = run_sweep(qtbot, w).result
    cells = w.patching_view.cells
    rid = w.controller.engine.session.upcoming_request_ids(1)[0]
    qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=cells.cell_rect(1, 2).center())
    assert w.state.value == "generating" and "not applied" in w.statusBar().currentMessage()
    w.controller.generating.set_interventions([mine])  # an edit while it runs waits for it to end
    assert "after the patched run" in w.statusBar().currentMessage()
    wait_state(qtbot, w, "ready")
    req = w.controller.runs.live.request(rid)
    assert req.prompt == CORRUPTED and w.shown.selection.request == rid  # denoising: the corrupted prompt
    cell = result.cell_intervention(1, 2)
    (position, interventions), = req.intervention_log
    assert position == 0 and len(interventions) == 1
    assert interventions[0]["hook"] == result.hooks[1] and interventions[0]["request_id"] == rid
    assert interventions[0]["positions"] == [2] and interventions[0]["scale"] == 0.0
    np.testing.assert_allclose(interventions[0]["bias"], cell.bias)
    assert [iv.hook for iv in w.controller.engine.session.interventions] == ["model.layers.0.resid_pre"]  # mine again
    assert len(req.generated_token_ids) == w.prompt.max_tokens.value()


def test_a_saved_sweep_reads_back_with_the_runs_metadata(qtbot, ui_settings, tmp_path):
    w = patching_window(qtbot)
    result = run_sweep(qtbot, w, foil="").result
    assert w.patching_view.save_button.isEnabled()
    path = tmp_path / "sweep.h5"
    w.patching_view.saveRequested.emit(str(path))
    qtbot.waitUntil(lambda: "Saved the sweep" in w.statusBar().currentMessage(), timeout=5000)
    back, metadata = read_sweep(path)
    assert metadata == w.controller.engine.info.metadata and back.complete and back.spec == result.spec
    assert back.spec.metric.foil is None and back.hooks == result.hooks
    np.testing.assert_array_equal(back.raw, result.raw)
    np.testing.assert_array_equal(back.source, result.source)


def test_a_kind_not_captured_is_said_and_offered_for_capture(qtbot, ui_settings):
    w = patching_window(qtbot)
    view = w.patching_view
    assert [view.kind_box.itemText(i) for i in range(view.kind_box.count())] == \
           ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"]
    view.kind_box.setCurrentText("resid_mid")
    assert "No resid_mid hook point is captured" in view.rows_label.text() and not view.run_button.isEnabled()
    view.capture_button.click()  # compiled mode: the engine restarts, after asking
    assert "Restart the engine" in w.last_dialog.windowTitle()
    w.last_dialog.button(QMessageBox.StandardButton.Yes).click()
    mid = [h.name for h in w.controller.engine.info.catalogue if h.kind == "resid_mid"]
    qtbot.waitUntil(lambda: set(mid) <= set(w.controller.engine.session.installed), timeout=5000)
    wait_state(qtbot, w, "ready")
    assert view.rows_label.text() == "Rows: resid_mid of all 2 layers." and view.capture_button.isHidden()
    assert run_sweep(qtbot, w, kind="resid_mid").result.hooks == mid


def test_a_sweep_and_a_generation_never_run_at_once(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.03)
    w = patching_window(qtbot, max_slots=3)
    type_sweep(w.patching_view)
    w.prompt.max_tokens.setValue(20)
    assert w.generate()
    assert not w.patching_view.run_button.isEnabled() and not w.controller.experiments.start_sweep(w.patching_view.request())
    wait_state(qtbot, w, "ready")
    w.patching_view.run_button.click()
    assert not w.generate() and "patching sweep is running" in w.statusBar().currentMessage()
    wait_state(qtbot, w, "ready")
    assert w.controller.experiments.sweep.result.complete


def test_the_prompts_can_come_from_the_requests_of_the_run(qtbot, ui_settings):
    w = patching_window(qtbot)
    w.prompt.prompts.setPlainText("the cat sat\nthe dog sat")
    w.prompt.max_tokens.setValue(2)
    assert w.generate()
    wait_state(qtbot, w, "ready")
    menu = w.patching_view.corrupted_from.menu()
    menu.aboutToShow.emit()
    actions = menu.actions()
    assert [a.data() for a in actions] == ["the cat sat", "the dog sat"]
    actions[1].trigger()
    assert w.patching_view.corrupted_edit.toPlainText() == "the dog sat"
