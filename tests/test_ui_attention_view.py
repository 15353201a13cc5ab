"""The Attention tab on the fake engine (real threads, real widgets): the selected token's row of every
head and the T x T image of the chosen head are ``attention_weights`` of the run's own q and k rows,
the pattern grows while tokens arrive, a long one is drawn a bin per pixel, hover names the token
pair and its weight, clicks select a token or a head, a reopened capture shows patterns without an
engine, and where no faithful pattern exists (an unsupported layer, keys not captured, q/k not
captured) the tab says why in words, and offers to capture what is missing."""

from dataclasses import replace

import numpy as np
import pytest
from PySide6.QtCore import QPointF, Qt
from PySide6.QtWidgets import QMessageBox

import fake_session
from fake_session import FakeSession
from inspector.core.attention import attention_weights
from inspector.core.run import HookRows
from inspector.io import write_run
from inspector.viewer.image_pool import pool_maxabs
from inspector.viewer.attention import AttentionShown
from ui_fixtures import fail_on_qt_warnings, keep, make_run, make_window, ui_settings, wait_state  # noqa: F401

QK = ["blocks.*.attn.hook_q", "blocks.*.attn.hook_k"]


def generate(qtbot, w, prompt="the cat sat on the mat", max_tokens=8):
    w.prompt.prompts.setPlainText(prompt)
    w.prompt.max_tokens.setValue(max_tokens)
    assert w.generate()
    wait_state(qtbot, w, "ready")


def show_tab(w):
    w.tabs.setCurrentWidget(w.attention_view)
    w.refresh()
    return w.attention_view.shown


def choose(w, layer=None, head=None):
    view = w.attention_view
    if layer is not None:
        view.layer_box.setCurrentIndex(view.layer_box.findData(layer))
    if head is not None:
        view.select_head(head)
    w.refresh()
    return view.shown


def qk_rows(run, rid, layer):
    """(q positions, q, k positions, k, geometry) of a layer, as the run holds them."""
    req = run.requests[rid]
    (q, qh), (k, kh) = [(req.hooks[h.name], h) for kind in ("q", "k") for h in run.hooks.values()
                        if h.layer == layer and h.kind == kind]
    return (np.asarray(q.positions), np.asarray(q.values), np.asarray(k.positions), np.asarray(k.values),
            qh.attention)


def drawn_pattern(view) -> np.ndarray:
    """The T x T image as drawn ([queries, keys]); later tokens are blank (NaN)."""
    return view.pattern_img.image


def test_the_selected_tokens_row_of_every_head_is_its_attention_weights(qtbot, ui_settings):
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    w.select_position(5)
    shown = show_tab(w)
    qp, q, kp, k, geometry = qk_rows(w.controller.engine.session.run, "req0", 0)
    expected = attention_weights(q[5:6], qp[5:6], k[:6], kp[:6], geometry)[:, 0]
    assert shown.layer == 0 and shown.heads == geometry.heads == 2 and shown.query == 5
    np.testing.assert_array_equal(shown.query_weights, expected)
    np.testing.assert_array_equal(w.attention_view.heads_img.image, expected)  # a row per head, keys 0..5
    assert "token 5" in w.attention_view.query_label.text()
    w.select_position(len(w.shown.token_texts("req0")) - 1)  # the last token: never fed back, no row
    assert "has no row" in show_tab(w).query_note


def test_the_heads_pattern_is_drawn_as_computed(qtbot, ui_settings):
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    show_tab(w)
    shown = choose(w, layer=1, head=1)
    qp, q, kp, k, geometry = qk_rows(w.controller.engine.session.run, "req0", 1)
    expected = attention_weights(q, qp, k, kp, geometry, heads=[1])[0]
    assert (shown.layer, shown.head) == (1, 1) and w.attention_view.head_box.currentIndex() == 1
    np.testing.assert_array_equal(shown.pattern, expected)
    image = drawn_pattern(w.attention_view)
    later = kp[None, :] > qp[:, None]
    assert image.shape == expected.shape and np.isnan(image[later]).all()
    np.testing.assert_array_equal(image[~later], expected[~later])
    assert w.attention_view.pattern_plot.getAxis("left").tickStrings([3], 1, 1) == [w.shown.token_texts("req0")[3]]


def test_the_pattern_grows_while_tokens_arrive(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.03)
    w = make_window(qtbot, hooks=QK)
    w.tabs.setCurrentWidget(w.attention_view)
    w.prompt.prompts.setPlainText("the cat")
    w.prompt.max_tokens.setValue(40)
    assert w.generate()
    sizes = set()
    while w.state.value == "generating":
        qtbot.wait(20)
        if w.state.value == "generating" and w.attention_view.stack.currentIndex() == 1:
            sizes.add(len(w.attention_view.shown.pattern))
    assert len(sizes) >= 3, sizes  # it grew in steps, live
    shown = show_tab(w)
    assert max(sizes) < len(shown.pattern)
    qp, q, kp, k, geometry = qk_rows(w.controller.engine.session.run, "req0", 0)
    expected = attention_weights(q, qp, k, kp, geometry, heads=[0])[0]
    np.testing.assert_allclose(shown.pattern, expected, atol=1e-5)  # computed in pieces: rounding differs
    assert shown.query == qp[-1]  # no token selected: the newest


def test_hover_names_the_token_pair_and_its_weight(qtbot, ui_settings):
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    w.select_position(6)
    shown = show_tab(w)
    view, texts = w.attention_view, w.shown.token_texts("req0")
    readout = view.hover(view.pattern_plot, 2, 6)
    assert readout == f"head 0 · token 6 {texts[6]!r} → 2 {texts[2]!r}: weight {shown.pattern[6, 2]:.4f}"
    assert view.readout.text() == readout
    assert view.hover(view.pattern_plot, 5, 2).endswith("a later token, never attended to")
    readout = view.hover(view.heads_plot, 3, 1)
    assert readout.startswith("head 1 · token 6") and f"{shown.query_weights[1, 3]:.4f}" in readout


def click(qtbot, view, plot, x, y):
    scene = plot.getViewBox().mapViewToScene(QPointF(x, y))
    qtbot.mouseClick(view.glw.viewport(), Qt.MouseButton.LeftButton, pos=view.glw.mapFromScene(scene))


def test_clicks_select_a_token_and_a_head(qtbot, ui_settings):
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    show_tab(w)
    view = w.attention_view
    click(qtbot, view, view.pattern_plot, 1, 4)
    assert w.shown.selection.position == 4 and w.strip.selected_positions() == (4,)
    assert show_tab(w).query == 4
    click(qtbot, view, view.heads_plot, 2, 1)
    assert view.head_box.currentIndex() == 1
    assert show_tab(w).head == 1


def test_a_long_pattern_is_drawn_a_bin_per_pixel_keeping_its_peaks_and_zooms_to_every_weight(qtbot, ui_settings):
    from inspector.ui.attention_view import AttentionView

    n = 1500
    rng = np.random.default_rng(0)
    pattern = np.tril(rng.random((n, n), np.float32))
    positions = np.arange(n)
    view = keep(qtbot, AttentionView())
    view.resize(800, 700)
    view.show()
    qtbot.waitExposed(view)
    view.show_attention(AttentionShown("", (), 0, 2, 1, [f"t{i}" for i in range(n + 1)], pattern, positions,
                                       positions, n - 1, pattern[-2:]))
    image, rect = view.pattern_img.image, view.pattern_img.mapRectToParent(view.pattern_img.boundingRect())
    bins = int(rect.width()) // image.shape[1]
    assert bins > 1 and image.shape[1] * bins >= n and rect.left() == rect.top() == -0.5
    expected = pool_maxabs(pattern, bins, bins)
    later = np.arange(image.shape[0])[:, None] < np.arange(image.shape[1])[None, :]  # bins wholly past the diagonal
    assert np.isnan(image[later]).all()
    np.testing.assert_array_equal(image[~later], expected[~later])
    view.pattern_plot.setRange(xRange=(99.5, 139.5), yRange=(199.5, 239.5), padding=0)
    view.render()
    np.testing.assert_array_equal(view.pattern_img.image, pattern[200:240, 100:140])


def test_without_q_and_k_the_tab_says_what_to_tick_and_captures_them(qtbot, ui_settings):
    w = make_window(qtbot, hooks=["blocks.*.hook_resid_post"])
    generate(qtbot, w)
    shown = show_tab(w)
    view = w.attention_view
    assert view.stack.currentIndex() == 0 and not view.capture_button.isHidden()
    assert "tick blocks.N.attn.hook_q and blocks.N.attn.hook_k" in view.message.text()
    view.capture_button.click()  # compiled mode: the engine restarts, after asking
    assert "Restart the engine" in w.last_dialog.windowTitle()
    w.last_dialog.button(QMessageBox.StandardButton.Yes).click()
    expected = {h.name for h in shown.to_capture} | set(w.controller.engine.session.installed)
    qtbot.waitUntil(lambda: set(w.controller.engine.session.installed) == expected, timeout=5000)
    wait_state(qtbot, w, "ready")
    assert "captured from now on: generate again" in view.message.text() and view.capture_button.isHidden()
    generate(qtbot, w)
    rows = len(w.shown.token_texts(w.shown.selection.request)) - 1
    assert show_tab(w).pattern.shape == (rows, rows) and view.stack.currentIndex() == 1


def test_in_eager_mode_the_button_captures_q_and_k_without_a_restart(qtbot, ui_settings):
    w = make_window(qtbot, mode="eager", hooks=["blocks.*.hook_resid_post"])
    generate(qtbot, w)
    show_tab(w)
    w.attention_view.capture_button.click()
    # the engine thread installs them first; the window hears of it a moment later (its status line)
    qtbot.waitUntil(lambda: len(w.controller.engine.session.installed) == 6
                    and "applied live" in w.statusBar().currentMessage(), timeout=5000)
    assert w.last_dialog is None and "applied live" in w.statusBar().currentMessage()
    generate(qtbot, w)
    assert show_tab(w).layer == 0 and w.attention_view.stack.currentIndex() == 1


def test_a_layer_with_queries_only_says_which_hook_to_tick(qtbot, ui_settings):
    w = make_window(qtbot, hooks=["blocks.0.attn.hook_q", "blocks.*.attn.hook_k"])
    generate(qtbot, w)
    show_tab(w)
    assert [w.attention_view.layer_box.itemData(i) for i in range(2)] == [0, 1]
    choose(w, layer=1)
    assert "Layer 1 has its keys captured but not its queries: tick blocks.1.attn.hook_q" in \
           w.attention_view.message.text()
    assert w.attention_view.capture_button.text() == "Capture blocks.1.attn.hook_q"


def test_an_unsupported_layer_is_explained_not_drawn(qtbot, ui_settings, monkeypatch):
    def alibi_catalogue(*args, **kwargs):
        return [replace(h, attention=replace(h.attention, unsupported="ALiBi position biases"))
                if h.attention else h for h in original(*args, **kwargs)]

    original = fake_session.llama_catalogue
    monkeypatch.setattr(fake_session, "llama_catalogue", alibi_catalogue)
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    shown = show_tab(w)
    assert w.attention_view.stack.currentIndex() == 0 and not len(shown.pattern)
    assert "cannot be recomputed: ALiBi position biases" in w.attention_view.message.text()


def capture_file(tmp_path, first_key=0):
    """A capture of q and k (one request of 9 tokens); keys from ``first_key`` on."""
    run = make_run(n_tokens=(9,), kinds=("q", "k"), width=128)
    req = run.requests["req0"]
    for name, rows in list(req.hooks.items()):
        if run.hooks[name].kind == "k" and first_key:
            kept = HookRows(rows.width)
            kept.append(rows.positions[first_key:], rows.token_ids[first_key:], rows.values[first_key:])
            req.hooks[name] = kept
    path = tmp_path / "qk.h5"
    write_run(run, path)
    return path, run


def test_a_reopened_capture_shows_patterns_without_an_engine(qtbot, ui_settings, tmp_path):
    path, run = capture_file(tmp_path)
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(path))
    show_tab(w)
    shown = choose(w, layer=1, head=1)
    qp, q, kp, k, geometry = qk_rows(run, "req0", 1)
    assert w.controller.engine.session is None and (shown.layer, shown.head) == (1, 1)
    np.testing.assert_array_equal(shown.pattern, attention_weights(q, qp, k, kp, geometry, heads=[1])[0])
    np.testing.assert_array_equal(shown.query_weights, attention_weights(q[-1:], qp[-1:], k, kp, geometry)[:, 0])


def test_an_exported_live_run_reopens_with_its_patterns(qtbot, ui_settings, tmp_path):
    w = make_window(qtbot, hooks=QK)
    generate(qtbot, w)
    live = show_tab(w)
    path = tmp_path / "exported.h5"
    assert w.export(str(path))
    qtbot.waitUntil(lambda: not w.controller.runs.exporting, timeout=10000)
    other = make_window(qtbot, boot=False)
    assert other.open_capture(str(path))
    reopened = show_tab(other)
    np.testing.assert_array_equal(reopened.pattern, live.pattern)
    np.testing.assert_array_equal(reopened.query_weights, live.query_weights)


def test_keys_not_captured_are_named_not_guessed(qtbot, ui_settings, tmp_path):
    path, _ = capture_file(tmp_path, first_key=3)
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(path))
    show_tab(w)
    assert w.attention_view.stack.currentIndex() == 0
    assert "the keys of positions 0-2 were not captured" in w.attention_view.message.text()
    assert w.attention_view.capture_button.isHidden()


def test_a_capture_without_q_and_k_says_so(qtbot, ui_settings, tmp_path):
    run = make_run(n_tokens=(5,), kinds=("resid_post",))
    write_run(run, tmp_path / "resid.h5")
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(tmp_path / "resid.h5"))
    show_tab(w)
    assert "This capture holds no attention queries and keys" in w.attention_view.message.text()


def test_a_capture_whose_first_request_lacks_q_and_k_names_and_offers_the_requests_that_hold_them(
        qtbot, ui_settings, tmp_path):
    run = make_run(n_tokens=(6, 9, 7), kinds=("q", "k", "resid_post"), width=128)
    first = run.requests["req0"]  # it ran before q and k were captured
    for name in [n for n in first.hooks if run.hooks[n].kind in ("q", "k")]:
        del first.hooks[name]
    write_run(run, tmp_path / "mixed.h5")
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(tmp_path / "mixed.h5"))
    show_tab(w)
    view = w.attention_view
    assert w.shown.selection.request == "req0" and view.stack.currentIndex() == 0
    assert "Request req0 holds no attention queries and keys; req1 and req2 do" in view.message.text()
    assert view.capture_button.isHidden()  # nothing to capture in a file
    assert not view.request_button.isHidden() and view.request_button.text() == "Show req1"
    view.request_button.click()
    assert w.shown.selection.request == "req1" and w.request_box.currentData() == "req1"
    shown = show_tab(w)
    assert view.stack.currentIndex() == 1 and shown.layer == 0 and len(shown.pattern) == 8


def test_a_request_that_ran_before_q_and_k_were_ticked_points_to_one_after(qtbot, ui_settings):
    w = make_window(qtbot, mode="eager", hooks=["blocks.*.hook_resid_post"])
    generate(qtbot, w)
    show_tab(w)
    w.attention_view.capture_button.click()  # eager: ticked and applied live
    qtbot.waitUntil(lambda: len(w.controller.engine.session.installed) == 6, timeout=5000)
    wait_state(qtbot, w, "ready")
    generate(qtbot, w)
    w.select_request("req0")
    show_tab(w)
    view = w.attention_view
    assert "Request req0 holds no attention queries and keys; req1 does" in view.message.text()
    assert view.request_button.text() == "Show req1" and view.capture_button.isHidden()  # captured already


@pytest.fixture(autouse=True)
def fresh_fake(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)
