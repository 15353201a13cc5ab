"""The Lens tab on the fake engine (real threads, real widgets): the grid's rows and columns are the
captured layers and positions, its cells the session's own lens of the same rows, the toggle reads the
rank and probability of the token that came next, a click lists a cell's top tokens, the grid grows
while tokens arrive, and a reopened capture shows its stored lens without an engine (or says why not)."""

import numpy as np
from PySide6.QtCore import Qt

from fake_session import FakeSession
from inspector.core.run import LensRows
from inspector.io import write_run
from inspector.viewer.labels import display_token
from inspector.viewer.lens import ALL_RESIDUAL, NEXT_PROB, NEXT_RANK, TOP, percent
from ui_fixtures import fail_on_qt_warnings, make_run, make_window, ui_settings, wait_state  # noqa: F401

RESID = ["blocks.*.hook_resid_post"]


def generate(qtbot, w, prompt="the cat sat", max_tokens=6):
    w.prompt.prompts.setPlainText(prompt)
    w.prompt.max_tokens.setValue(max_tokens)
    assert w.generate()
    wait_state(qtbot, w, "ready")


def show_lens(qtbot, w):
    """The Lens tab, once everything captured for the shown request is lensed."""
    w.tabs.setCurrentWidget(w.lens_view)

    def filled():
        w.refresh()
        grid = w.lens_view.cells.grid
        return grid is not None and grid.shape[1] and (grid.top_ids[:, :, 0] >= 0).all()

    qtbot.waitUntil(filled, timeout=5000)
    return w.lens_view.cells.grid


def expected_lens(w, hook):
    """What the session itself says of the rows the window shows, with the tokens that came next."""
    session, rid = w.controller.engine.session, w.shown.selection.request
    req = session.run.requests[rid]
    values = req.hooks[hook].values
    return session.lens(values, k=5, chosen=np.array(req.token_ids[1:len(values) + 1])), req


def test_the_grid_is_the_sessions_lens_of_the_captured_layers_and_positions(qtbot, ui_settings):
    w = make_window(qtbot, hooks=RESID)
    generate(qtbot, w)
    grid = show_lens(qtbot, w)
    hooks = [h.name for h in w.controller.engine.info.catalogue if h.kind == "resid_post"]
    assert grid.labels == ["L0 resid_post", "L1 resid_post"] and w.lens_view.kind_box.currentText() == "resid_post"
    session = w.controller.engine.session
    for r, hook in enumerate(hooks):
        lens, req = expected_lens(w, hook)
        assert grid.shape == (2, len(req.hooks[hook])) and grid.tokens == req.token_texts
        np.testing.assert_array_equal(grid.top_ids[r], lens.top_ids)
        tops = session.token_texts(lens.top_ids[:, 0])
        assert [w.lens_view.cells.grid.cell_text(TOP, r, c) for c in range(grid.shape[1])] == \
               [display_token(t) for t in tops]
    assert w.lens_view.cells.viewport().grab().width() > 0  # paints


def test_the_toggle_shows_the_rank_and_probability_of_the_token_that_came_next(qtbot, ui_settings):
    w = make_window(qtbot, hooks=RESID)
    generate(qtbot, w)
    show_lens(qtbot, w)
    view = w.lens_view
    lens, _ = expected_lens(w, "model.layers.1.resid_post")
    view.mode_box.setCurrentText(NEXT_RANK)
    w.refresh()
    cells = view.cells
    assert cells.mode == NEXT_RANK
    assert [cells.grid.cell_text(cells.mode, 1, c) for c in range(cells.grid.shape[1])] == \
           [f"#{rank + 1}" for rank in lens.chosen_ranks]
    view.mode_box.setCurrentText(NEXT_PROB)
    w.refresh()
    assert [cells.grid.cell_text(cells.mode, 1, c) for c in range(cells.grid.shape[1])] == \
           [percent(float(np.exp(lp))) for lp in lens.chosen_logprobs]
    np.testing.assert_allclose(cells.grid.chosen_logprobs[1], lens.chosen_logprobs, rtol=1e-6)


def test_clicking_a_cell_lists_its_top_tokens_and_selects_its_position(qtbot, ui_settings):
    w = make_window(qtbot, hooks=RESID)
    generate(qtbot, w)
    grid = show_lens(qtbot, w)
    cells = w.lens_view.cells
    cells.horizontalScrollBar().setValue(0)  # it follows the newest tokens
    with qtbot.waitSignal(w.lens_view.positionClicked) as clicked:
        qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=cells.cell_rect(0, 3).center())
    assert clicked.args == [3] and w.strip.selected_positions() == (3,)
    details = w.lens_view.details_text()
    lens, req = expected_lens(w, "model.layers.0.resid_post")
    for token_id, logprob in zip(lens.top_ids[3], lens.top_logprobs[3]):
        assert f"{percent(float(np.exp(logprob))):>4}  {grid.token(int(token_id))!r}" in details
    assert f"rank #{lens.chosen_ranks[3] + 1}" in details and repr(display_token(req.token_texts[4])) in details
    describe = grid.describe(0, 3)
    assert describe.startswith("L0 resid_post · position 3") and "top" in describe and "rank #" in describe
    qtbot.mouseMove(cells.viewport(), cells.cell_rect(1, 2).center())  # hovering reads a cell out
    qtbot.waitUntil(lambda: w.lens_view.last_readout == grid.describe(1, 2), timeout=2000)


def test_the_grid_grows_while_tokens_arrive(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.03)
    w = make_window(qtbot, hooks=RESID)
    w.tabs.setCurrentWidget(w.lens_view)
    w.prompt.prompts.setPlainText("the cat")
    w.prompt.max_tokens.setValue(40)
    assert w.generate()
    lensed_while_generating = set()
    while w.state.value == "generating":
        qtbot.wait(20)
        grid = w.lens_view.cells.grid
        if grid is not None and w.state.value == "generating":
            lensed_while_generating.add(int((grid.top_ids[0, :, 0] >= 0).sum()))
    assert len(lensed_while_generating - {0}) >= 3, lensed_while_generating  # it filled in steps, live
    total = show_lens(qtbot, w).shape[1]
    assert max(lensed_while_generating) < total


def test_the_lens_costs_nothing_while_its_tab_is_hidden(qtbot, ui_settings):
    w = make_window(qtbot, hooks=RESID)
    generate(qtbot, w)
    w.refresh()
    assert w.tabs.currentWidget() is w.heatmap and not w.shown.lens.rows


def test_with_several_residual_kinds_the_user_picks_the_rows(qtbot, ui_settings):
    w = make_window(qtbot, hooks=["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"])
    generate(qtbot, w)
    show_lens(qtbot, w)
    box = w.lens_view.kind_box
    assert [box.itemText(i) for i in range(box.count())] == ["resid_post", "resid_pre", ALL_RESIDUAL]
    box.setCurrentText(ALL_RESIDUAL)
    grid = show_lens(qtbot, w)
    assert grid.labels == ["L0 resid_pre", "L0 resid_post", "L1 resid_pre", "L1 resid_post"]


def test_without_a_residual_hook_point_the_tab_says_what_to_select(qtbot, ui_settings):
    w = make_window(qtbot, hooks=["blocks.*.hook_mlp_out"])
    generate(qtbot, w)
    w.tabs.setCurrentWidget(w.lens_view)
    w.refresh()
    assert "select a resid_post hook point" in w.lens_view.cells.message


def stored_lens_file(tmp_path, with_lens: bool):
    """A capture file as ``inspector capture --lens 3`` writes it (fake lens values), and its run."""
    run = make_run(n_tokens=(7,), kinds=("resid_post",), width=16)
    req = run.requests["req0"]
    if with_lens:
        rng = np.random.default_rng(0)
        for hook, rows in req.hooks.items():
            top = rng.integers(2000, 2010, (len(rows), 3))
            lens = req.lens[hook] = LensRows(3)
            lens.append(rows.positions, top, np.log(np.full((len(rows), 3), [0.6, 0.3, 0.1], np.float32)),
                        req.token_ids[1:len(rows) + 1], np.full(len(rows), -2.0, np.float32), np.full(len(rows), 4))
        run.vocabulary = {i: f" word{i}" for i in range(2000, 2010)}
    path = tmp_path / "run.h5"
    write_run(run, path)
    return path, run


def test_a_reopened_capture_shows_its_stored_lens_without_an_engine(qtbot, ui_settings, tmp_path):
    path, run = stored_lens_file(tmp_path, with_lens=True)
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(path))
    grid = show_lens(qtbot, w)
    req = run.requests["req0"]
    assert grid.shape == (2, 6) and w.controller.engine.session is None
    for r, (hook, lens) in enumerate(req.lens.items()):
        assert [grid.cell_text(TOP, r, c) for c in range(6)] == [f" word{i}" for i in lens.column("top_ids")[:, 0]]
    w.lens_view.mode_box.setCurrentText(NEXT_RANK)
    w.refresh()
    assert w.lens_view.cells.grid.cell_text(NEXT_RANK, 0, 2) == "#5"


def test_a_reopened_capture_without_a_lens_says_why_the_tab_is_empty(qtbot, ui_settings, tmp_path):
    path, _ = stored_lens_file(tmp_path, with_lens=False)
    w = make_window(qtbot, boot=False)
    assert w.open_capture(str(path))
    w.tabs.setCurrentWidget(w.lens_view)
    w.refresh()
    assert "No lens stored in this file" in w.lens_view.cells.message and "--lens K" in w.lens_view.cells.message


def test_a_failing_lens_is_a_dialog_and_the_tab_says_why(qtbot, ui_settings, monkeypatch):
    w = make_window(qtbot, hooks=RESID)
    generate(qtbot, w)

    def broken(self, values, k=5, chosen=None):
        raise ValueError("no final norm found, so no logit lens")

    monkeypatch.setattr(FakeSession, "lens", broken)
    w.tabs.setCurrentWidget(w.lens_view)
    qtbot.waitUntil(lambda: w.refresh() or w.last_dialog is not None, timeout=5000)
    assert "The logit lens failed" in w.last_dialog.text()
    w.refresh()
    assert "no final norm" in w.lens_view.cells.message
    w.last_dialog.close()
    generate(qtbot, w)  # the app goes on
    assert w.state.value == "ready"

