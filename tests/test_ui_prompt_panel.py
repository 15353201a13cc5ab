"""The prompt dock's rule for turning its text into prompts, on the fake engine (real widgets): one
prompt per line by default, the whole text as one prompt (a code snippet keeps its newlines), or
prompts between ``---`` lines; the rule is on show with the count it gives, and kept in the settings."""

import pytest

from fake_session import FakeSession
from inspector.viewer.prompts import LINES, SEPARATED, WHOLE, split_prompts
from ui_fixtures import fail_on_qt_warnings, make_window, ui_settings, wait_state  # noqa: F401

SNIPPET = "def fibonacci(n):\n    if n < 2:\n        return n\n"


@pytest.fixture(autouse=True)
def fresh_fake(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)


def choose_rule(panel, rule):
    panel.rule_box.setCurrentIndex(panel.rule_box.findData(rule))


def generated_prompts(qtbot, w, text):
    w.prompt.prompts.setPlainText(text)
    w.prompt.max_tokens.setValue(3)
    assert w.generate()
    wait_state(qtbot, w, "ready")
    return [w.shown.request(rid).prompt for rid in w.shown.request_ids()]


def test_split_prompts_by_rule():
    assert split_prompts("a\n\n b \n", LINES) == ["a", " b "]
    assert split_prompts(SNIPPET, WHOLE) == [SNIPPET]
    assert split_prompts(" \n\n", WHOLE) == []
    assert split_prompts("\nx = 1\ny = 2\n\n---\n\nprint(x)\n--- \n---\n", SEPARATED) == ["x = 1\ny = 2", "print(x)"]
    assert split_prompts("one\ntwo", SEPARATED) == ["one\ntwo"]


def test_a_code_snippet_runs_as_one_request_in_one_prompt_mode(qtbot, ui_settings):
    w = make_window(qtbot)
    panel = w.prompt
    assert panel.rule_box.currentData() == LINES and "One prompt per line" in panel.rule_box.currentText()
    panel.prompts.setPlainText(SNIPPET)
    assert panel.rule_label.text().startswith("3 prompts") and panel.rule_label.isVisible()
    choose_rule(panel, WHOLE)
    assert panel.rule_label.text().startswith("1 prompt") and "newlines kept" in panel.prompts.placeholderText()
    assert generated_prompts(qtbot, w, SNIPPET) == [SNIPPET]


def test_prompts_between_separator_lines_keep_their_own_newlines(qtbot, ui_settings):
    w = make_window(qtbot)
    choose_rule(w.prompt, SEPARATED)
    assert "---" in w.prompt.prompts.placeholderText()
    assert generated_prompts(qtbot, w, "def f(x):\n    return x\n---\ndef g(y):\n    return y") == [
        "def f(x):\n    return x", "def g(y):\n    return y"]


def test_the_rule_chosen_is_kept_in_the_settings(qtbot, ui_settings):
    w = make_window(qtbot, boot=False)
    choose_rule(w.prompt, WHOLE)
    w.close()
    again = make_window(qtbot, boot=False)
    assert again.prompt.rule_box.currentData() == WHOLE
