"""The Features tab in the real window on the fake engine (real threads, real widgets): an SAE attached
through Engine ▸ Attach SAE (on the engine's thread), the grid's rows the request's strongest features
and its cells the activations the step events carried, which are the reference encoding of the
captured rows; hover reads a cell out and lists the token's features, a click on a cell, a row's label
or a listed feature selects that feature and plots it across the tokens, Steer adds a row to the
interventions table that steers the next generation with it (by strength, or clamped), Detach stops the encoding;
an SAE that does not fit is an error dialog with the reason, a reopened capture shows its features,
and where there is nothing to show the tab says why."""

import threading

import numpy as np
import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QFileDialog

from inspector.core.sae import encode, feature_clamp, load_weights, read_sae, strongest
from inspector.io import write_run
from inspector.viewer.app_state import EMPTY_TEXT, AppState
from inspector.viewer.features import ACTIVATION, NO_SAE
from inspector.viewer.run_view import RunSource, RunView
from inspector.ui.cell_grid import LABEL_W
from sae_files import write_sae
from ui_fixtures import fail_on_qt_warnings, make_run, make_window, ui_settings, wait_state  # noqa: F401

HOOK = "blocks.1.hook_resid_post"  # installed by make_window (every resid_post), 128 wide


@pytest.fixture
def sae_dir(tmp_path):
    return write_sae(tmp_path / "resid_sae", "topk", 128, 512, HOOK, k=8)


def attach(qtbot, w, path):
    assert w.attach_sae(str(path))
    qtbot.waitUntil(lambda: path.name in w.controller.engine.info.saes, timeout=5000)


def generate(qtbot, w, prompt="the cat sat on the mat", max_tokens=6):
    w.prompt.prompts.setPlainText(prompt)
    w.prompt.max_tokens.setValue(max_tokens)
    assert w.generate()
    wait_state(qtbot, w, "ready")


def show_tab(w):
    w.tabs.setCurrentWidget(w.features_view)
    w.refresh()
    return w.features_view


def attached_and_generated(qtbot, sae_dir):
    w = make_window(qtbot)
    attach(qtbot, w, sae_dir)
    generate(qtbot, w)
    view = show_tab(w)
    view.cells.horizontalScrollBar().setValue(0)
    return w, view


def test_the_grid_is_the_requests_strongest_features_as_the_engine_sent_them(qtbot, ui_settings, sae_dir,
                                                                             monkeypatch):
    w = make_window(qtbot)
    session, gui = w.controller.engine.session, threading.get_ident()
    callers, original = [], session.attach_sae

    def recorded(*args, **kwargs):
        callers.append(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(session, "attach_sae", recorded)
    attach(qtbot, w, sae_dir)
    assert len(callers) == 1 and callers[0] != gui  # on the engine's thread: the window never waits for it
    generate(qtbot, w)
    view = show_tab(w)
    rid = w.shown.selection.request
    sae = w.controller.engine.info.saes["resid_sae"]
    assert sae.hook == "model.layers.1.resid_post" and sae.k == 32
    features = w.shown.run.requests[rid].features["resid_sae"]
    # the fake's features are the reference encoding of the rows it captured
    rows = session.run.requests[rid].hooks[sae.hook]
    ids, acts = strongest(encode(read_sae(sae_dir), load_weights(read_sae(sae_dir)), rows.values), 32)
    np.testing.assert_array_equal(features.positions, rows.positions)
    np.testing.assert_array_equal(features.ids, ids)
    np.testing.assert_allclose(features.activations, acts, rtol=1e-6)  # encoded step by step, here all at once

    grid = view.cells.grid
    assert view.sae_box.currentText() == "resid_sae" and not view.cells.message and grid is view.shown.grid
    assert view.about.text() == f"{HOOK} · 512 features · top 32 per token" and view.detach_button.isEnabled()
    distinct = np.unique(features.ids[features.ids >= 0])
    assert grid.shape == (min(40, len(distinct)), len(features)) and grid.labels == [f"f{f}" for f in grid.features]
    for r, feature in enumerate(grid.features):
        for c in range(grid.shape[1]):
            hits = np.flatnonzero(features.ids[c] == feature)
            want = features.activations[c, hits[0]] if len(hits) else 0.0
            assert grid.dense[r, c] == want
            assert grid.cell_text(ACTIVATION, r, c) == (f"{want:.2f}" if len(hits) else "")
    peaks = [features.activations[features.ids == f].max() for f in grid.features]
    assert peaks == sorted(peaks, reverse=True)
    assert view.scale.numbers() == ("0", f"{max(peaks) / 2:.2f}", f"{max(peaks):.2f}")
    assert view.cells.viewport().grab().width() > 0  # paints


def test_hover_reads_a_cell_out_and_lists_that_tokens_strongest_features(qtbot, ui_settings, sae_dir):
    w, view = attached_and_generated(qtbot, sae_dir)
    cells, grid = view.cells, view.cells.grid
    c = int(np.flatnonzero(grid.ranks[0] >= 0)[0])
    qtbot.mouseMove(cells.viewport(), cells.cell_rect(0, c).center())
    qtbot.waitUntil(lambda: view.last_readout == grid.describe(0, c), timeout=2000)
    p = int(grid.positions[c])
    assert view.readout.text() == (f"{grid.input(c)!r} (position {p}): feature {grid.labels[0]} = "
                                   f"{grid.dense[0, c]:.3f}, #{grid.ranks[0, c] + 1} of this token's strongest")
    assert view.listed_features() == [f for f, _ in grid.token_features(c)]
    assert view.token_title.text() == f"{grid.input(c)!r} (position {p}): its {len(grid.token_features(c))} " \
                                      "strongest features"


def test_a_click_on_a_cell_a_label_or_a_listed_feature_selects_that_feature(qtbot, ui_settings, sae_dir):
    w, view = attached_and_generated(qtbot, sae_dir)
    cells, grid = view.cells, view.cells.grid
    assert view.selected_feature is None and len(view.trace_data()[0]) == 0
    with qtbot.waitSignal(view.positionClicked) as clicked:
        qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=cells.cell_rect(1, 3).center())
    p = int(grid.positions[3])
    assert clicked.args == [p] and w.shown.selection.position == p and w.strip.selected_positions() == (p,)
    assert view.selected_feature == grid.features[1] and cells.highlighted_row == 1
    x, y = view.trace_data()
    np.testing.assert_array_equal(x, grid.positions)
    np.testing.assert_array_equal(y, grid.trace(int(grid.features[1])))
    assert view.trace_title.text().startswith(f"{grid.labels[1]} across the tokens: largest {y.max():.3f}")
    assert view.listed_features() == [f for f, _ in grid.token_features(3)]  # the clicked token's

    label = QPoint(LABEL_W // 2, cells.cell_rect(2, 0).center().y())
    qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=label)
    assert view.selected_feature == grid.features[2] and cells.highlighted_row == 2

    item = view.token_list.item(view.token_list.count() - 1)
    rect = view.token_list.visualItemRect(item)
    qtbot.mouseClick(view.token_list.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    feature = item.data(Qt.ItemDataRole.UserRole)
    assert view.selected_feature == feature and cells.highlighted_row == grid.row_of(feature)
    np.testing.assert_array_equal(view.trace_data()[1], grid.trace(feature))
    w.refresh()  # a repaint keeps the selection
    assert view.selected_feature == feature


@pytest.mark.parametrize("how", ["add", "clamp"])
def test_steer_adds_a_row_that_steers_the_next_generation_with_the_selected_feature(qtbot, ui_settings, tmp_path,
                                                                                      how):
    path = write_sae(tmp_path / "relu_sae", "standard", 128, 512, HOOK)  # a top-k feature cannot be clamped
    w = make_window(qtbot, boot=False)
    w.settings.feature_clamps = 2  # Engine ▸ Room for Feature Clamps…, before the model is opened
    w.open_model("demo", mode="compiled", retain_rows=True)
    wait_state(qtbot, w, "ready")
    assert w.controller.engine.session.options.feature_clamps == 2
    attach(qtbot, w, path)
    generate(qtbot, w)
    view = show_tab(w)
    view.cells.horizontalScrollBar().setValue(0)
    assert not view.steer_button.isEnabled()  # no feature selected yet
    qtbot.mouseClick(view.cells.viewport(), Qt.MouseButton.LeftButton, pos=view.cells.cell_rect(0, 2).center())
    feature = view.selected_feature
    view.steer_how.setCurrentIndex(view.steer_how.findData(how))
    view.steer_value.setValue(2.5)
    assert view.steer_button.isEnabled()
    qtbot.mouseClick(view.steer_button, Qt.MouseButton.LeftButton)
    (row,) = w.interventions.model.rows
    (iv,) = w.controller.engine.session.interventions
    config, weights = read_sae(path), load_weights(read_sae(path))
    if how == "add":
        assert row.source == f"2.5 × feature relu_sae/{feature}" and iv.clamp is None
        np.testing.assert_allclose(iv.bias, 2.5 * weights["W_dec"][feature], rtol=1e-6)
    else:
        assert row.source == f"clamp relu_sae/{feature} to 2.5"
        assert iv.clamp.direction == feature_clamp(config, feature, 2.5).direction and iv.clamp.value == 2.5
        assert w.interventions.model.data(w.interventions.model.index(0, 6)) == "clamp 2.5"
        assert w.interventions.edit(0, "Bias", "0")  # the Bias cell edits the clamp's value: 0 ablates it
        assert w.controller.engine.session.interventions[0].clamp.value == 0.0
        assert not w.interventions.edit(0, "Scale", "2")
        assert "a clamp row has no scale" in w.interventions.last_message
    hook = w.controller.engine.info.saes["relu_sae"].hook
    before = w.shown.run.requests[w.shown.selection.request].hooks[hook].values
    generate(qtbot, w)  # the same prompt, steered
    after = w.shown.run.requests[w.shown.selection.request].hooks[hook].values
    assert not np.allclose(before, after)


def test_a_clamp_on_an_engine_without_room_for_it_says_how_to_make_room(qtbot, ui_settings, tmp_path):
    path = write_sae(tmp_path / "relu_sae", "standard", 128, 512, HOOK)
    w, view = attached_and_generated(qtbot, path)  # the default: no room for clamps
    qtbot.mouseClick(view.cells.viewport(), Qt.MouseButton.LeftButton, pos=view.cells.cell_rect(0, 2).center())
    view.steer_how.setCurrentIndex(view.steer_how.findData("clamp"))
    qtbot.mouseClick(view.steer_button, Qt.MouseButton.LeftButton)
    assert not w.interventions.model.rows and not w.controller.engine.session.interventions
    assert "booted without room for feature clamps" in w.interventions.last_message
    assert "Engine ▸ Room for Feature Clamps…" in w.interventions.last_message


def test_detach_stops_the_encoding_and_keeps_what_was_captured(qtbot, ui_settings, sae_dir):
    w, view = attached_and_generated(qtbot, sae_dir)
    first = w.shown.selection.request
    view.detach_button.click()
    qtbot.waitUntil(lambda: not w.controller.engine.info.saes, timeout=5000)
    assert not w.controller.engine.session.saes
    w.refresh()
    assert view.cells.grid is not None and not view.detach_button.isEnabled()  # the request's features stay
    assert [s["config"]["path"] for s in w.shown.run.metadata["saes"]] == [str(sae_dir)]  # what they come from
    assert view.about.text() == f"{HOOK} · 512 features · top 32 per token"
    generate(qtbot, w, "a new prompt")
    w.refresh()
    rid = w.shown.selection.request
    assert rid != first and not w.shown.run.requests[rid].features
    assert view.cells.grid is None and view.cells.message == NO_SAE
    w.select_request(first)
    assert view.cells.grid is not None and view.sae_box.currentText() == "resid_sae"


@pytest.mark.parametrize("make, reason", [
    (lambda d: write_sae(d / "narrow", "standard", 64, 512, HOOK),
     "SAE narrow reads 64-wide rows, but blocks.1.hook_resid_post is 128 wide"),
    (lambda d: write_sae(d / "elsewhere", "standard", 128, 512, "blocks.0.hook_mlp_out"),
     "'blocks.0.hook_mlp_out' is not an installed hook point"),
    (lambda d: d, "no cfg.json"),
])
def test_an_sae_that_does_not_fit_is_an_error_dialog_with_the_reason(qtbot, ui_settings, tmp_path, make, reason):
    w = make_window(qtbot)
    assert w.attach_sae(str(make(tmp_path)))
    qtbot.waitUntil(lambda: w.last_dialog is not None and w.last_dialog.isVisible(), timeout=5000)
    assert w.last_dialog.windowTitle() == "SAE" and reason in w.last_dialog.text()
    assert w.last_dialog.text().startswith("Could not attach the SAE.")
    assert not w.controller.engine.info.saes and not w.controller.engine.session.saes and w.state is AppState.READY
    assert show_tab(w).cells.message == NO_SAE


def test_where_there_is_nothing_to_show_the_tab_says_why(qtbot, ui_settings, sae_dir, monkeypatch):
    w = make_window(qtbot, boot=False)
    view = show_tab(w)
    assert view.cells.message == EMPTY_TEXT[AppState.NO_MODEL] and not w.menus.act_attach_sae.isEnabled()
    w.controller.runs.show(RunView(make_run(n_tokens=(5,)), RunSource.FILE, "old.h5"))
    w.refresh()
    assert view.cells.message.startswith("This capture holds no SAE features") and view.sae_box.count() == 0

    w = make_window(qtbot)
    view = show_tab(w)
    assert view.cells.message == NO_SAE and not view.detach_button.isEnabled() and w.menus.act_attach_sae.isEnabled()
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **kw: str(sae_dir))
    w.menus.act_attach_sae.trigger()  # Engine ▸ Attach SAE…
    qtbot.waitUntil(lambda: "resid_sae" in w.controller.engine.info.saes, timeout=5000)
    w.refresh()
    assert view.cells.message == "SAE resid_sae is attached: generate to see its features"
    assert view.sae_box.currentText() == "resid_sae" and view.detach_button.isEnabled()


def test_the_sae_box_switches_between_attached_saes(qtbot, ui_settings, sae_dir, tmp_path):
    w = make_window(qtbot)
    attach(qtbot, w, sae_dir)
    early = write_sae(tmp_path / "early_sae", "jumprelu", 128, 256, "blocks.0.hook_resid_post", seed=3)
    attach(qtbot, w, early)
    view = show_tab(w)
    assert view.sae_box.currentText() == "early_sae"  # the one just attached
    generate(qtbot, w)
    assert view.shown.grid.sae == "early_sae" and view.about.text().startswith("blocks.0.hook_resid_post · 256")
    view.sae_box.setCurrentText("resid_sae")
    w.refresh()
    req = w.shown.run.requests[w.shown.selection.request]
    assert view.shown.grid.sae == "resid_sae"
    np.testing.assert_array_equal(view.shown.grid.ids, req.features["resid_sae"].ids)
    w.heatmap.set_colormap("viridis")  # the window's colour map reaches the tab
    assert np.array_equal(view.cells.lookup(), w.lens_view.cells.lookup())


def test_a_reopened_capture_shows_its_features(qtbot, ui_settings, sae_dir, tmp_path):
    w, _ = attached_and_generated(qtbot, sae_dir)
    live = w.shown.run.requests[w.shown.selection.request].features["resid_sae"]
    write_run(w.shown.run, tmp_path / "with_features.h5")
    assert w.open_capture(str(tmp_path / "with_features.h5"))
    view = show_tab(w)
    assert w.shown.source is RunSource.FILE and view.sae_box.currentText() == "resid_sae"
    np.testing.assert_array_equal(view.shown.grid.ids, live.ids)
    np.testing.assert_array_equal(view.shown.grid.activations, live.activations)
    assert view.about.text() == f"{HOOK} · 512 features · top 32 per token"  # from the file's metadata
    assert not view.detach_button.isEnabled()  # a file's SAE is not the engine's
