"""The Patching tab without Qt: the rows of each hook kind, the typed answer and foil checked as single
tokens, the sweep's state as its news arrive (the result before a refused sweep stays), the grid's
colours and texts, and what the controller does with sweeps and patched runs (on the fake session,
jobs run inline)."""

import numpy as np
import pytest

from fake_session import llama_catalogue
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling
from inspector.experiments.patching import Metric, PatchSpec, SweepResult, single_token
from inspector.viewer import jobs
from inspector.viewer.app_state import Action, AppState
from inspector.viewer.patching import (EFFECT, METRIC, PatchingSweep, SweepNews, SweepRequest, kind_rows,
                                       patch_kinds, rows_note, uncaptured)
from test_viewer_unit import controller  # noqa: F401

CATALOGUE = llama_catalogue(layers=3)
WORDS = {" alpha": [7], " alphabet": [7, 8], "": []}
TEXTS = {7: " alpha", 8: "bet"}


def tokenize(text):
    return WORDS.get(text, [9])


def token_texts(ids):
    return [TEXTS[i] for i in ids]


def result(raw, clean=2.0, corrupted=-2.0, direction="denoise"):
    raw = np.asarray(raw, dtype=np.float64)
    hooks, positions = raw.shape
    spec = PatchSpec("clean text", "corrupted text", tuple(f"h{i}" for i in range(hooks)), Metric(7, 9), direction)
    texts = {"clean": [f"c{i}" for i in range(positions)], "corrupted": [f"x{i}" for i in range(positions)]}
    return SweepResult(spec, list(spec.hooks), np.arange(positions), {k: list(range(positions)) for k in texts}, texts,
                       np.zeros((hooks, positions, 4), np.float32), clean, corrupted, raw, engine_calls=1)


def test_the_rows_of_a_kind_are_its_hook_points_by_layer_and_the_missing_ones_are_named():
    assert patch_kinds(CATALOGUE) == ["resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post"]
    installed = {h.name: h for h in reversed(CATALOGUE) if h.kind == "resid_pre" and h.layer != 1}
    rows = kind_rows(installed.values(), "resid_pre")
    assert [h.layer for h in rows] == [0, 2]
    missing = uncaptured(CATALOGUE, installed, "resid_pre")
    assert [h.layer for h in missing] == [1]
    assert rows_note(rows, missing, "resid_pre") == "Rows: resid_pre of 2 of 3 layers (the others are not captured)."
    assert rows_note([], uncaptured(CATALOGUE, installed, "mlp_out"), "mlp_out").startswith("No mlp_out hook point")


def test_the_answer_and_the_foil_must_each_be_one_token():
    assert single_token("answer", " alpha", tokenize, token_texts) == 7
    with pytest.raises(ValueError, match=r"The answer ' alphabet' is 2 tokens, not one: ' alpha' \+ 'bet'\."):
        single_token("answer", " alphabet", tokenize, token_texts)
    request = SweepRequest("a", "b", " alpha", " alphabet", ("h0",))
    with pytest.raises(ValueError, match="The foil ' alphabet' is 2 tokens"):
        request.spec(tokenize, token_texts)
    with pytest.raises(ValueError, match="same token"):
        SweepRequest("a", "b", " alpha", " alpha", ("h0",)).spec(tokenize, token_texts)
    spec = SweepRequest("a", "b", " alpha", "", ("h0",), "noise").spec(tokenize, token_texts)
    assert spec == PatchSpec("a", "b", ("h0",), Metric(7, None), "noise")


def test_a_request_missing_a_field_says_which():
    full = SweepRequest("a", "b", " alpha", "", ("h0",))
    assert full.problem() is None
    assert "both prompts" in SweepRequest(" ", "b", " alpha", "", ("h0",)).problem()
    assert "answer" in SweepRequest("a", "b", "", "", ("h0",)).problem()
    assert "No hook point" in SweepRequest("a", "b", " alpha", "", ()).problem()


def test_news_are_copies_and_the_result_before_a_refused_sweep_stays():
    sweep, points = PatchingSweep(), {h.name: h for h in CATALOGUE}
    live = result([[np.nan, np.nan]])
    news = SweepNews.of(live, "engine call 1 of 1: 0 of 2 cells")
    live.raw[0, 0] = 1.0  # the engine thread goes on writing its own
    assert np.isnan(news.result.raw).all()
    first = SweepRequest("clean text", "corrupted text", " alpha", "", ("model.layers.0.resid_pre",))
    sweep.start(first, points, {"model": "m"})
    assert sweep.running and sweep.result is None and sweep.request is None  # nothing of it yet
    sweep.news(news)
    assert sweep.progress == (0, 2)
    assert sweep.request is first and sweep.labels["model.layers.0.resid_pre"] == "L0 resid_pre"
    sweep.finish(result([[2.0, 0.0]]))
    assert not sweep.running and sweep.message.startswith("Done: 2 cells in 1 engine call(s)")
    shown, revision = sweep.result, sweep.revision
    sweep.start(SweepRequest("x", "y", " z", "", ("h0",)), {}, {})
    assert sweep.progress == (0, 0)  # the result on show is the sweep before's
    sweep.fail("The answer ' z' is 2 tokens, not one")
    assert sweep.result is shown and sweep.request is first and sweep.metadata == {"model": "m"}
    assert sweep.problem.startswith("The answer") and sweep.revision > revision


def test_the_outcome_says_stopped_incomplete_or_undefined():
    sweep = PatchingSweep()
    stopped = result([[1.0, np.nan]])
    stopped.stopped = True
    sweep.finish(stopped)
    assert sweep.message.startswith("Stopped: 1 of 2 cells ran (the others are blank)")
    sweep.fail("engine died")
    assert sweep.message.startswith("Stopped: 1 of 2") and sweep.problem == "engine died"
    sweep.finish(result([[1.0, 1.0]], clean=1.0, corrupted=1.0))
    assert "give the same metric" in sweep.message


def test_the_grid_colours_the_effect_on_a_diverging_scale_and_blanks_cells_not_run():
    sweep = PatchingSweep()
    sweep.finish(result([[2.0, -2.0, 0.0], [-6.0, 6.0, np.nan]]))  # clean 2, corrupted -2
    grid = sweep.grid()
    assert grid.shape == (2, 3) and grid.tokens == ["x0", "x1", "x2"]  # denoising: the corrupted prompt's tokens
    np.testing.assert_allclose(grid.colour_values(EFFECT), [[1.0, 0.5, 0.75], [0.0, 1.0, np.nan]])
    assert [grid.cell_text(EFFECT, 0, c) for c in range(3)] == ["1.00", "0.00", "0.50"]
    assert grid.cell_text(METRIC, 1, 0) == "-6.00" and grid.cell_text(EFFECT, 1, 2) == ""
    assert grid.describe(1, 2) == "h1 · position 2 'x2' · not run"
    assert grid.describe(0, 2) == "h0 · position 2 'x2' · effect 0.500 (0 = corrupted, 1 = clean) · metric 0"
    sweep.finish(result([[0.0]], direction="noise"))
    assert sweep.grid().tokens == ["c0"] and sweep.target_prompt() == "clean text"


# ------------------------------------------------------------------------------------------ the controller

def sweep_request(c, **fields):
    hooks = tuple(h.name for h in kind_rows(c.engine.info.installed.values(), "resid_post"))
    typed = {"clean": "the cat sat", "corrupted": "the dog sat", "answer": " ca", "foil": " do", "hooks": hooks,
             **fields}
    return SweepRequest(**typed)


def test_a_sweep_runs_on_the_engine_and_leaves_the_users_interventions(controller):
    c, view = controller
    c.engine.open_model("demo", "compiled")
    mine = Intervention("blocks.0.hook_resid_post", scale=2.0)
    c.generating.set_interventions([mine])
    assert c.engine.enabled(Action.PATCH) and c.experiments.start_sweep(sweep_request(c))
    assert view.states[-2:] == [AppState.PATCHING, AppState.READY]
    assert c.experiments.sweep.result.complete and c.experiments.sweep.result.raw.shape == (2, 4)
    assert [iv.hook for iv in c.engine.session.interventions] == ["model.layers.0.resid_post"]
    first = c.experiments.sweep.result
    c.experiments.start_sweep(sweep_request(c, answer=" cat"))  # refused on the engine thread: tokenizing is the session's
    assert "2 tokens" in c.experiments.sweep.problem and c.experiments.sweep.result is first
    assert not view.errors and c.engine.state is AppState.READY


def test_a_cell_opens_a_run_with_that_cell_alone_then_the_users_interventions_return(controller):
    c, view = controller
    c.engine.open_model("demo", "compiled")
    mine = Intervention("blocks.0.hook_resid_post", scale=2.0)
    c.generating.set_interventions([mine])
    c.experiments.start_sweep(sweep_request(c))
    rid = c.engine.session.upcoming_request_ids(1)[0]
    assert c.experiments.open_patched_cell(1, 3, Sampling(max_tokens=2))
    req = c.runs.live.request(rid)
    (_, (patched,)), = req.intervention_log
    assert req.prompt == "the dog sat" and patched["request_id"] == rid and patched["positions"] == [3]
    assert c.generating.patched_cell is None and [iv.hook for iv in c.engine.session.interventions] == ["model.layers.0.resid_post"]


def test_a_cell_of_hooks_no_longer_captured_is_refused(controller):
    c, view = controller
    c.engine.open_model("demo", "eager")
    c.experiments.start_sweep(sweep_request(c))
    c.engine.apply_hooks(["blocks.*.hook_mlp_out"])
    assert not c.experiments.open_patched_cell(0, 0, Sampling(max_tokens=2)) and "no longer captures" in view.errors[-1]


def test_a_sweep_cancelled_before_its_cells_keeps_its_baselines_only(controller):
    c, _ = controller
    c.engine.open_model("demo", "compiled")
    news = []
    state = jobs.TaskState(news.append)
    state.cancel()
    swept = jobs.sweep(c.engine.session, sweep_request(c), state)
    assert swept.stopped and swept.done == 0 and np.isfinite(swept.clean_metric)
    assert [n.message.split(":")[0] for n in news] == ["baselines"]
