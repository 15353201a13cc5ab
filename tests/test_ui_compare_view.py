"""The Compare switch and tab on the fake engine (real threads, real widgets): a comparison runs each
prompt as twins in one batch, the tab sets their texts side by side with the first diverging token
marked, a strip of per-token KL and logprob change and a heatmap of intervened − clean at the selected
hook grow while it generates; an intervention changed mid-run reaches the intervened twins only; an
exported comparison keeps its twins, and reopened shows them again without an engine."""

import numpy as np
from PySide6.QtCore import QPointF, Qt

from fake_session import FakeSession
from inspector.core.interventions import Intervention
from inspector.experiments.compare import Twins, first_divergence, scoped_to_intervened, token_kl, twins_of
from inspector.io import read_run
from inspector.ui.compare_view import TwinText
from inspector.viewer.compare import NO_TWINS
from inspector.viewer.labels import display_token
from ui_fixtures import fail_on_qt_warnings, keep, make_window, run_prompts, ui_settings, wait_state  # noqa: F401

HOOK = "model.layers.0.resid_post"
STEER = Intervention(HOOK, scale=0.5, bias=0.25)


def session(w):
    return w.controller.engine.session


def compare(qtbot, w, prompts="the cat sat\nhello", max_tokens=8, wait=True):
    run_prompts(qtbot, w, prompts, max_tokens, compare=True, wait=wait)


def steer(w):
    row = w.interventions.add_row(HOOK, scale="0.5")
    assert w.interventions.edit(row, "Bias", "0.25")
    assert session(w).interventions == [STEER]


def show_compare(w):
    w.tabs.setCurrentWidget(w.compare_view)
    w.refresh()
    return w.compare_view.shown


def test_a_comparison_shows_twins_side_by_side_with_their_split_strip_and_difference(qtbot, ui_settings):
    w = make_window(qtbot)
    steer(w)
    compare(qtbot, w)
    run = w.controller.runs.live.run
    twins = twins_of(run)
    assert twins == [Twins("req0", "req1"), Twins("req2", "req3")]
    assert [run.requests[r].twin_role for r in ("req0", "req1")] == ["clean", "intervened"]
    assert session(w).interventions == [STEER]  # for every request again once the comparison is over
    shown = show_compare(w)
    view = w.compare_view
    assert view.pages.currentWidget() is view.content and view.pair_box.count() == 2 and shown.twins == twins[0]
    clean, steered = run.requests["req0"], run.requests["req1"]
    assert clean.intervention_log == [(0, [])] and steered.intervention_log[0][1][0]["bias"] == 0.25
    # the fake moves each intervened choice one word on: the twins part at once
    k = first_divergence(clean, steered)
    assert k == shown.divergence == 0 and "part at generated token 0" in view.note.text()
    n = len(clean.prompt_token_ids)
    assert view.clean_text.toPlainText() == "".join(clean.token_texts)
    assert view.intervened_text.toPlainText() == "".join(steered.token_texts)
    assert view.intervened_text.split_text() == steered.token_texts[n + k] != view.clean_text.split_text()
    # the strip: both measures for every generated token, drawn as bars at the tokens' positions
    np.testing.assert_allclose(shown.kl, token_kl(clean, steered))
    assert len(shown.kl) == 8 and (shown.kl > 0).all() and np.allclose(shown.logprob_change, -1.0)
    assert list(view.kl_bars.opts["x"]) == list(range(n, n + 8)) and view.split_lines[0].value() == n - 0.5
    assert "lower bound" in view.strip.toolTip() and "lower bound" in view.kl_plot.getAxis("left").toolTip()
    # the difference heatmap of the selected hook: intervened − clean, position by position
    w.select_hook(HOOK)
    expected = np.asarray(steered.hooks[HOOK].values) - np.asarray(clean.hooks[HOOK].values)
    np.testing.assert_allclose(view.diff.displayed_data(), expected, atol=1e-6)
    assert np.abs(expected).max() > 0 and view.diff.levels()[0] == -view.diff.levels()[1]
    assert view.diff.colormap_name() == "CET-CBD1" and (view.diff.track_marks == 2).all()
    assert view.diff.image_array() is not None


def test_picking_a_pair_selects_it_and_the_strip_reads_out_and_selects_tokens(qtbot, ui_settings):
    w = make_window(qtbot)
    steer(w)
    compare(qtbot, w)
    view = w.compare_view
    show_compare(w)
    view.pair_box.setCurrentIndex(1)
    w.refresh()
    assert w.shown.selection.request == "req3" and view.shown.twins == Twins("req2", "req3")
    assert view.clean_text.toPlainText().startswith("hello")
    qtbot.waitUntil(lambda: bool(view.hover_token(2)), timeout=2000)  # once the strip has ranged over the new pair
    text = view.last_readout
    assert text == view.shown.describe(2) and text.startswith("token 2 (position")
    clean = w.shown.request("req2")
    assert repr(display_token(clean.token_texts[len(clean.prompt_token_ids) + 2])) in text and "KL ≥" in text
    n = len(clean.prompt_token_ids)
    point = view.kl_plot.getViewBox().mapViewToScene(QPointF(n + 2, view.shown.kl[2] / 2))
    with qtbot.waitSignal(view.positionClicked) as clicked:
        qtbot.mouseClick(view.strip.viewport(), Qt.MouseButton.LeftButton, pos=view.strip.mapFromScene(point))
    assert clicked.args == [n + 2] and w.shown.selection.position == n + 2


def test_the_tab_grows_while_the_twins_generate(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.03)
    w = make_window(qtbot)
    steer(w)
    w.tabs.setCurrentWidget(w.compare_view)
    compare(qtbot, w, "the cat", max_tokens=30, wait=False)
    seen = set()
    while w.state.value == "generating":
        qtbot.wait(20)
        if w.state.value == "generating":
            seen.add(len(w.compare_view.shown.kl))
            assert session(w).interventions == scoped_to_intervened([STEER], w.controller.generating.compared)
    assert len(seen - {0}) >= 3, seen  # it filled in steps, by the window's timer
    w.refresh()
    assert len(w.compare_view.shown.kl) == 30


def test_an_intervention_changed_mid_comparison_reaches_the_intervened_twin_only(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.02)
    w = make_window(qtbot)
    compare(qtbot, w, "import os", max_tokens=400, wait=False)
    assert "no intervention is set: the twins will agree" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: w.controller.generating.progress.tokens >= 8, timeout=5000)
    w.interventions.add_row(HOOK, scale="0")
    twins = w.controller.generating.compared
    assert twins == [Twins("req0", "req1")]
    assert session(w).interventions == [Intervention(HOOK, scale=0.0, request_id="req1")]
    assert "to the intervened twins" in w.statusBar().currentMessage()
    at = w.controller.generating.progress.tokens
    qtbot.waitUntil(lambda: w.controller.generating.progress.tokens >= at + 8, timeout=5000)
    w.controller.generating.stop()
    wait_state(qtbot, w, "ready")
    assert session(w).interventions == [Intervention(HOOK, scale=0.0)]  # the plain set again, for what comes next
    clean, steered = (w.shown.request(r) for r in ("req0", "req1"))
    assert clean.intervention_log == [(0, [])] and len(steered.intervention_log) == 2
    start = steered.intervention_log[-1][0]
    rows = steered.hooks[HOOK]
    assert not np.any(rows.values[rows.positions >= start]) and np.all(np.any(clean.hooks[HOOK].values, axis=1))
    shown = show_compare(w)
    assert shown.divergence == start - len(clean.prompt_token_ids) + 1  # its first token drawn under the change


def test_without_twins_the_tab_says_how_to_get_a_comparison(qtbot, ui_settings):
    w = make_window(qtbot)
    assert show_compare(w).message == NO_TWINS
    w.prompt.prompts.setPlainText("the cat")
    assert w.generate()
    wait_state(qtbot, w, "ready")
    view = w.compare_view
    assert show_compare(w).message == NO_TWINS and view.pages.currentWidget() is view.empty
    assert "Tick Compare next to Generate" in view.empty.text()
    compare(qtbot, w, "the cat", max_tokens=4)  # on with no intervention: the twins agree, and the tab says why
    shown = show_compare(w)
    assert shown.divergence is None and "No intervention reached the intervened twin" in view.note.text()
    assert not np.any(shown.kl) and not np.any(shown.logprob_change) and view.clean_text.split_text() == ""


def test_an_exported_comparison_keeps_its_twins_and_reopens_without_an_engine(qtbot, ui_settings, tmp_path):
    w = make_window(qtbot)
    steer(w)
    compare(qtbot, w)
    path = str(tmp_path / "compare.h5")
    assert w.export(path)
    qtbot.waitUntil(lambda: not w.controller.runs.exporting, timeout=10000)
    back = read_run(path)
    assert twins_of(back) == twins_of(w.controller.runs.live.run) == [Twins("req0", "req1"), Twins("req2", "req3")]
    assert back.requests["req0"].twin_role == "clean" and back.requests["req0"].twin_of == "req1"
    live = show_compare(w)
    reopened = make_window(qtbot, boot=False)
    assert reopened.open_capture(path)
    reopened.select_hook(HOOK)
    w.select_hook(HOOK)
    shown = show_compare(reopened)
    assert shown.twins == live.twins and shown.divergence == live.divergence
    np.testing.assert_allclose(shown.kl, live.kl)
    np.testing.assert_allclose(shown.diff_values, show_compare(w).diff_values)
    assert reopened.compare_view.intervened_text.toPlainText() == w.compare_view.intervened_text.toPlainText()


def test_a_blank_diverging_token_is_marked_by_a_visible_glyph_and_new_tokens_are_appended(qtbot, ui_settings):
    pane = keep(qtbot, TwinText())
    tokens = ["def", " f", ":", "\n", "    x"]
    pane.show_tokens("pair", tokens, 3, 0)
    assert pane.split_text() == "↵" and pane.toPlainText() == "def f:↵\n    x"
    pane.show_tokens("pair", tokens + [" = 1"], 3, 0)
    assert pane.toPlainText() == "def f:↵\n    x = 1"
    pane.show_tokens("pair", tokens, 3, None)  # the split moved (here: gone): drawn again
    assert pane.split_text() == "" and pane.toPlainText() == "def f:\n    x"
