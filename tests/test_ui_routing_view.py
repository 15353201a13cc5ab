"""The Experts tab in the real window: an expert per row and a token per column; in weight mode each
token's top-k experts filled with the weights ``capture.routing.route`` gives its router logits, in
logit mode every logit; the layer selector switches layers, hover reads a cell out, a click selects
its token, a reopened capture shows its routing, and where there is nothing to show, or the choice
cannot be recomputed, the tab says why."""

import numpy as np
from PySide6.QtCore import Qt

from inspector.core.routing import Routing, route
from inspector.io import write_run
from inspector.viewer.lens import percent
from inspector.viewer.routing import LOGIT, WEIGHT
from inspector.viewer.run_view import RunSource, RunView
from moe_runs import moe_run, router_logits
from ui_fixtures import fail_on_qt_warnings, make_run, make_window, ui_settings, wait_state  # noqa: F401

TOP2 = Routing(experts=4, top_k=2, renormalize=True)


def show_run(qtbot, run):
    """A window without an engine showing ``run`` as a reopened capture, on the Experts tab."""
    w = make_window(qtbot, boot=False)
    w.controller.runs.show(RunView(run, RunSource.FILE, "moe.h5"))
    return show_tab(w)


def show_tab(w):
    w.tabs.setCurrentWidget(w.experts_view)
    w.refresh()
    return w


def cell_texts(view) -> list[list[str]]:
    grid, cells = view.cells.grid, view.cells
    return [[grid.cell_text(cells.mode, r, c) for c in range(grid.shape[1])] for r in range(grid.shape[0])]


def test_weight_mode_fills_each_tokens_chosen_experts_with_their_weights(qtbot, ui_settings):
    run = moe_run({1: TOP2, 3: TOP2})
    w = show_run(qtbot, run)
    view = w.experts_view
    positions, logits, _ = router_logits(run, 1)
    ids, weights = route(logits, TOP2)
    assert [view.layer_box.itemText(i) for i in range(view.layer_box.count())] == ["L1", "L3"]
    assert view.layer() == 1 and view.mode() == WEIGHT and view.cells.mode == WEIGHT
    grid = view.cells.grid
    assert grid.shape == (4, len(positions)) and not view.cells.message and view.note.isHidden()
    texts = cell_texts(view)
    colours = grid.colour_values(WEIGHT)
    for c in range(len(positions)):
        filled = [r for r in range(4) if texts[r][c]]
        assert sorted(filled) == sorted(ids[c]) == sorted(np.flatnonzero(np.isfinite(colours[:, c])))
        for expert, weight in zip(ids[c], weights[c]):
            assert grid.dense[expert, c] == weight and texts[expert][c] == percent(float(weight))
    assert view.scale.numbers() == ("0%", percent(float(weights.max()) / 2), percent(float(weights.max())))
    assert view.cells.viewport().grab().width() > 0  # paints


def test_the_layer_selector_shows_the_other_layer(qtbot, ui_settings):
    run = moe_run({1: TOP2, 3: TOP2})
    w = show_run(qtbot, run)
    view = w.experts_view
    view.layer_box.setCurrentText("L3")
    w.refresh()
    _, logits, hook = router_logits(run, 3)
    assert view.layer() == 3 and view.shown.layer == 3 and view.cells.grid.hook == hook
    np.testing.assert_array_equal(view.cells.grid.logits, logits.T)
    ids, _ = route(logits, TOP2)
    texts = cell_texts(view)
    assert all(sorted(r for r in range(4) if texts[r][c]) == sorted(ids[c]) for c in range(len(logits)))


def test_logit_mode_shows_every_cell(qtbot, ui_settings):
    run = moe_run({1: TOP2, 3: TOP2})
    w = show_run(qtbot, run)
    view = w.experts_view
    view.mode_box.setCurrentText(LOGIT)
    _, logits, _ = router_logits(run, 1)
    assert view.cells.mode == LOGIT and "router logit" in view.legend.text()
    assert cell_texts(view) == [[f"{x:.2f}" for x in row] for row in logits.T]
    assert np.isfinite(view.cells.grid.colour_values(LOGIT)).all()
    assert view.scale.numbers() == (f"{logits.min():.2f}", f"{(logits.min() + logits.max()) / 2:.2f}", f"{logits.max():.2f}")
    view.layer_box.setCurrentText("L3")  # the mode is kept across layers
    w.refresh()
    assert view.cells.mode == LOGIT and view.cells.grid.hook.layer == 3


def test_hover_reads_a_cell_out_and_a_click_selects_its_token(qtbot, ui_settings):
    w = show_run(qtbot, moe_run({1: TOP2}))
    cells = w.experts_view.cells
    cells.horizontalScrollBar().setValue(0)
    qtbot.mouseMove(cells.viewport(), cells.cell_rect(2, 3).center())
    qtbot.waitUntil(lambda: w.experts_view.last_readout == cells.grid.describe(2, 3), timeout=2000)
    assert w.experts_view.readout.text().startswith("' on' (position 3) → expert 2: ")
    with qtbot.waitSignal(w.experts_view.positionClicked) as clicked:
        qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=cells.cell_rect(1, 5).center())
    assert clicked.args == [5] and w.shown.selection.position == 5 and w.strip.selected_positions() == (5,)


def test_a_rule_that_cannot_be_recomputed_shows_the_logits_with_a_note(qtbot, ui_settings):
    odd = Routing(experts=4, top_k=2, unsupported="a custom routing function")
    w = show_run(qtbot, moe_run({1: TOP2, 3: odd}))
    view = w.experts_view
    view.layer_box.setCurrentText("L3")
    w.refresh()
    assert not view.note.isHidden() and "a custom routing function" in view.note.text()
    assert "only the router logits are shown" in view.note.text()
    assert view.mode() == LOGIT and view.cells.mode == LOGIT and not view.mode_box.isEnabled()
    assert all(all(row) for row in cell_texts(view))
    view.layer_box.setCurrentText("L1")  # a layer whose choice is known: the user's mode is back
    w.refresh()
    assert view.note.isHidden() and view.mode_box.isEnabled() and view.cells.mode == WEIGHT


def test_a_capture_without_router_logits_says_so(qtbot, ui_settings):
    w = show_run(qtbot, make_run(n_tokens=(5,), kinds=("resid_post",)))
    view = w.experts_view
    assert view.cells.grid is None and view.layer_box.count() == 0
    assert view.cells.message.startswith("This capture holds no router logits (blocks.N.mlp.hook_router)")


def test_a_model_without_experts_says_so(qtbot, ui_settings):
    w = make_window(qtbot, hooks=["blocks.*.hook_resid_post"])
    w.prompt.prompts.setPlainText("the cat")
    w.prompt.max_tokens.setValue(3)
    assert w.generate()
    wait_state(qtbot, w, "ready")
    show_tab(w)
    assert "This model has no mixture-of-experts layers" in w.experts_view.cells.message


def test_a_reopened_capture_shows_its_routing(qtbot, ui_settings, tmp_path):
    run = moe_run({1: TOP2, 3: TOP2})
    write_run(run, tmp_path / "moe.h5")
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(tmp_path / "moe.h5"))
    view = show_tab(w).experts_view
    view.layer_box.setCurrentText("L3")
    w.refresh()
    _, logits, hook = router_logits(run, 3)
    assert view.cells.grid.hook.routing == TOP2 and view.cells.grid.hook.name == hook.name
    ids, weights = route(logits, TOP2)
    np.testing.assert_array_equal(view.cells.grid.ids, ids)
    np.testing.assert_array_equal(view.cells.grid.weights, weights)
