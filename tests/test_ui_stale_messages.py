"""Hover read-outs and red messages are about the request, run or engine session they were made with:
on the fake engine (real widgets), each goes when the request shown, the run on show or the session
changes, and a message about the new one stays."""

import pytest

from fake_session import FakeSession
from inspector.io import write_run
from ui_fixtures import fail_on_qt_warnings, make_run, make_window, ui_settings, wait_state  # noqa: F401

HOOKS = ["blocks.*.hook_resid_post", "blocks.*.attn.hook_q", "blocks.*.attn.hook_k"]


@pytest.fixture(autouse=True)
def fresh_fake(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)


def two_requests(qtbot):
    w = make_window(qtbot, hooks=HOOKS)
    w.prompt.prompts.setPlainText("the cat sat\nthe dog sat")
    w.prompt.max_tokens.setValue(6)
    assert w.generate()
    wait_state(qtbot, w, "ready")
    return w


def hover_heatmap_and_attention(w) -> None:
    w.tabs.setCurrentWidget(w.heatmap)
    w.refresh()
    assert w.heatmap.hover_view_point(2, 3)
    w.tabs.setCurrentWidget(w.attention_view)
    w.refresh()
    assert w.attention_view.hover(w.attention_view.pattern_plot, 1, 3)


def readouts(w) -> dict[str, str]:
    tabs = [w.tabs.widget(i) for i in range(w.tabs.count())]
    return {type(tab).__name__: tab.readout.text().strip() + tab.last_readout for tab in tabs
            if hasattr(tab, "last_readout") and tab is not w.dashboard_view}


def test_hover_read_outs_go_when_the_request_or_the_run_on_show_changes(qtbot, ui_settings, tmp_path):
    w = two_requests(qtbot)
    hover_heatmap_and_attention(w)
    assert w.shown.selection.request == "req0" and any(readouts(w).values())
    w.request_box.setCurrentIndex(w.request_box.findData("req1"))
    w.refresh()
    assert not any(readouts(w).values()), readouts(w)
    hover_heatmap_and_attention(w)
    write_run(make_run(), tmp_path / "other.h5")
    assert w.open_capture(str(tmp_path / "other.h5"))
    w.refresh()
    assert not any(readouts(w).values()), readouts(w)


def test_red_messages_go_with_the_request_and_the_session_they_were_about(qtbot, ui_settings):
    w = two_requests(qtbot)
    panel, patching = w.interventions, w.patching_view
    assert w.steer_with_feature("absent", 0, "add", 1.0) == -1 and panel.message.isVisible()
    w.request_box.setCurrentIndex(w.request_box.findData("req1"))
    w.refresh()
    assert not panel.message.isVisible()

    assert w.steer_with_feature("absent", 0, "add", 1.0) == -1
    patching.kind_box.setCurrentText("resid_post")
    patching.answer_edit.setText(" cat")  # two tokens: the session refuses the sweep
    patching.run_button.click()
    wait_state(qtbot, w, "ready")
    patching.repaint_sweep()
    assert panel.message.isVisible() and not patching.problem.isHidden()
    w.restart_engine()
    wait_state(qtbot, w, "ready")
    patching.repaint_sweep()
    assert not panel.message.isVisible() and patching.problem.isHidden()

    assert w.steer_with_feature("absent", 0, "add", 1.0) == -1  # about the new session: it stays
    w.refresh()
    assert panel.message.isVisible()
