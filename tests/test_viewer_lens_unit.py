"""The Lens tab without Qt: which rows still need a lens and in what batches, the grid built from the
results, what the controller asks of the engine (once, batched, between steps while generating), and
what the tab says when it has nothing to show. On the fake session, jobs run inline."""

import numpy as np
import pytest

from fake_session import FakeSession
from inspector.core.protocol import Sampling, SessionOptions
from inspector.core.run import LensRows
from inspector.viewer import jobs, lens as lens_module
from inspector.viewer.app_state import AppState
from inspector.viewer.controller import Controller
from inspector.viewer.lens import (ALL_RESIDUAL, NEXT_PROB, NEXT_RANK, TOP, LensResult, RunLens, lens_hooks,
                                   lens_kinds)
from inspector.viewer.run_view import RunSource, RunView
from test_viewer_unit import InlineRunner, RecordingView
from ui_fixtures import make_run


@pytest.fixture
def fake():
    return FakeSession(SessionOptions(hooks=("blocks.*.hook_resid_post",)), hidden=16)


def resid_post(view, rid="req0"):
    return lens_hooks(view.hooks_for(rid), "resid_post")


def test_rows_are_the_residual_kinds_resid_post_first():
    view = RunView(make_run(kinds=("resid_pre", "mlp_out", "resid_post")), RunSource.FILE, "x.h5")
    hooks = view.hooks_for("req0")
    assert lens_kinds(hooks) == ["resid_post", "resid_pre", ALL_RESIDUAL]
    assert [h.alias for h in lens_hooks(hooks, ALL_RESIDUAL)] == [
        "blocks.0.hook_resid_pre", "blocks.0.hook_resid_post", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"]
    assert lens_kinds(view.hooks_for(None)[:0]) == [] and lens_kinds([h for h in hooks if h.kind == "mlp_out"]) == []


def test_a_batch_holds_every_new_row_of_every_hook_with_the_token_that_came_next(fake):
    run = make_run(n_tokens=(9,), width=16)
    view = RunView(run, RunSource.LIVE)
    hooks = resid_post(view)
    batch = view.lens.pending(run, "req0", hooks)
    tokens = run.requests["req0"].token_ids
    assert [(rid, hook) for rid, hook, *_ in batch.pieces] == [("req0", h.name) for h in hooks]
    for rid, hook, positions, next_ids in batch.pieces:
        assert positions.tolist() == list(range(8)) and next_ids.tolist() == tokens[1:9]
    rows = [run.requests["req0"].hooks[h.name].values for h in hooks]
    np.testing.assert_array_equal(batch.values, np.concatenate(rows))
    view.lens.add(jobs.lens(fake, batch, jobs.TaskState()))
    assert view.lens.pending(run, "req0", hooks) is None  # all lensed
    run.requests["req0"].hooks[hooks[0].name].append([8], [0], np.ones((1, 16), np.float32))  # the last token fed
    (rid, hook, positions, next_ids), = view.lens.pending(run, "req0", hooks).pieces
    assert hook == hooks[0].name and positions.tolist() == [8] and next_ids.tolist() == [-1]  # not known yet


def test_a_long_prompt_goes_in_batches_that_fill_every_layer_from_the_left(monkeypatch):
    run = make_run(n_tokens=(40,), width=16)
    view = RunView(run, RunSource.LIVE)
    hooks = resid_post(view)
    monkeypatch.setattr(lens_module, "MAX_BATCH_BYTES", 10 * 2 * 16 * 4)  # ten rows of each of the two hooks
    batch = view.lens.pending(run, "req0", hooks)
    assert [p.tolist() for _, _, p, _ in batch.pieces] == [list(range(10))] * 2


def test_the_grid_is_the_lens_of_each_row_and_the_modes_read_it(fake):
    run = make_run(n_tokens=(9,), width=16)
    view = RunView(run, RunSource.LIVE)
    hooks = resid_post(view)
    result = jobs.lens(fake, view.lens.pending(run, "req0", hooks), jobs.TaskState())
    assert result.error is None and set(result.texts) == set(np.unique(result.lens.top_ids).tolist()) - set(
        run.requests["req0"].token_ids)  # only texts the run does not know yet
    view.lens.add(result)
    grid = view.lens.grid(run, "req0", hooks)
    req = run.requests["req0"]
    assert grid.shape == (2, 8) and grid.labels == ["L0 resid_post", "L1 resid_post"] and grid.tokens == req.token_texts
    for r, h in enumerate(hooks):
        expected = fake.lens(req.hooks[h.name].values, k=5, chosen=np.array(req.token_ids[1:9]))
        np.testing.assert_array_equal(grid.top_ids[r], expected.top_ids)
        np.testing.assert_array_equal(grid.chosen_ranks[r], expected.chosen_ranks)
        np.testing.assert_allclose(grid.colour_values(TOP)[r], np.exp(expected.top_logprobs[:, 0]), rtol=1e-6)
        np.testing.assert_allclose(grid.colour_values(NEXT_PROB)[r], np.exp(expected.chosen_logprobs), rtol=1e-6)
        np.testing.assert_allclose(grid.colour_values(NEXT_RANK)[r], 1 / (1 + expected.chosen_ranks), rtol=1e-6)
        top = int(expected.top_ids[3, 0])
        assert grid.cell_text(TOP, r, 3) == grid.token(top) and grid.token(top) in ([fake.token_texts([top])[0]] +
                                                                                     req.token_texts)
        assert grid.cell_text(NEXT_RANK, r, 3) == f"#{expected.chosen_ranks[3] + 1}"
        assert [t for t, _ in grid.top_k(r, 3)] == [grid.token(int(t)) for t in expected.top_ids[3]]
    assert grid.describe(1, 2).startswith("L1 resid_post · position 2") and "rank #" in grid.describe(1, 2)


def test_a_files_stored_lens_is_shown_and_never_recomputed():
    run = make_run(n_tokens=(6,), width=16)
    hook = resid_post(RunView(run, RunSource.FILE, "x.h5"))[0].name
    stored = run.requests["req0"].lens[hook] = LensRows(2)
    stored.append(np.arange(5), np.full((5, 2), 1234), np.full((5, 2), -0.5, np.float32), np.full(5, 1234),
                  np.full(5, -0.5, np.float32), np.zeros(5, np.int64))
    run.vocabulary = {1234: " stored"}
    view = RunView(run, RunSource.FILE, "x.h5")
    hooks = resid_post(view)
    grid = view.lens.grid(run, "req0", hooks)
    assert grid.cell_text(TOP, 0, 4) == " stored" and grid.cell_text(TOP, 1, 4) == ""  # the other hook: no lens
    (_, hook, positions, _), = view.lens.pending(run, "req0", hooks).pieces  # with an engine: the other hook only
    assert hook == hooks[1].name and positions.tolist() == list(range(5))
    exported = view.snapshot()  # exporting a reopened file keeps its lens
    assert exported.requests["req0"].lens == run.requests["req0"].lens and exported.vocabulary == run.vocabulary


# ------------------------------------------------------------------------------------------ the controller

@pytest.fixture
def controller(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)
    runner, view = InlineRunner(), RecordingView()
    c = Controller(FakeSession.open, runner, runner, view)
    c.engine.open_model("demo", "compiled")
    return c, view


def test_the_controller_lenses_what_is_new_in_one_engine_call(controller, monkeypatch):
    c, view = controller
    c.generating.generate(["hello there"], Sampling(max_tokens=4))
    calls = []
    monkeypatch.setattr(FakeSession, "lens", lambda self, values, k=5, chosen=None, original=FakeSession.lens:
                        calls.append(len(values)) or original(self, values, k, chosen))
    hooks = resid_post(c.runs.live)
    c.experiments.follow_lens(c.runs.live, "req0", hooks)
    rows = len(c.runs.live.request("req0").hooks[hooks[0].name])
    assert calls == [2 * rows] and c.runs.live.lens.revision == 1
    c.experiments.follow_lens(c.runs.live, "req0", hooks)
    assert calls == [2 * rows]  # nothing new: no call


def test_while_generating_the_lens_is_computed_between_steps(controller):
    c, view = controller
    run = make_run(n_tokens=(5,), width=128)
    target = RunView(run, RunSource.LIVE)
    box = jobs.LensBox()
    box.put(target.lens.pending(run, "req0", resid_post(target)))
    news = []
    state = jobs.TaskState(news.append)
    jobs.generate(c.engine.session, ["hi"], Sampling(max_tokens=3), box, state)
    assert [type(n).__name__ for n in news][:2] == ["StepEvent", "LensResult"] and box.take() is None
    assert news[1].error is None and news[1].batch.target is target.lens


def test_a_batch_the_generation_did_not_take_is_asked_for_again(controller):
    c, view = controller
    c.generating.generate(["hello"], Sampling(max_tokens=2))
    c.engine.state = AppState.GENERATING  # as if the generation were still running: the batch goes to the box
    c.experiments.follow_lens(c.runs.live, "req0", resid_post(c.runs.live))
    assert c.experiments._lens_out
    c.generating._generated(jobs.GenerationResult(1, 1, False, 0.0))  # it ended without taking it
    assert not c.experiments._lens_out and c.runs.live.lens.revision == 0
    c.experiments.follow_lens(c.runs.live, "req0", resid_post(c.runs.live))  # now ready: computed at once
    assert c.runs.live.lens.revision == 1


def test_a_failing_lens_is_an_error_and_stops_asking(controller, monkeypatch):
    c, view = controller
    c.generating.generate(["hello"], Sampling(max_tokens=2))

    def broken(self, values, k=5, chosen=None):
        raise ValueError("no final norm found, so no logit lens")

    monkeypatch.setattr(FakeSession, "lens", broken)
    hooks = resid_post(c.runs.live)
    c.experiments.follow_lens(c.runs.live, "req0", hooks)
    assert "The logit lens failed" in view.errors[-1] and "no final norm" in view.errors[-1]
    assert "no final norm" in c.experiments.lens_message(c.runs.live, "req0", hooks) and not c.experiments.can_lens(c.runs.live)
    c.experiments.follow_lens(c.runs.live, "req0", hooks)
    assert len(view.errors) == 1
    c.engine.reopen()  # a new engine tries again
    assert c.experiments.lens_problem is None


def test_what_the_lens_tab_says_when_it_has_nothing_to_show(controller):
    c, view = controller
    c.generating.generate(["hello"], Sampling(max_tokens=2))
    assert c.experiments.lens_message(c.runs.live, "req0", resid_post(c.runs.live)) is None  # the engine will lens it
    assert "select a resid_post hook point" in c.experiments.lens_message(c.runs.live, "req0", [])
    file_view = RunView(make_run(), RunSource.FILE, "x.h5")  # another model's capture, no lens stored
    assert "No lens stored in this file" in c.experiments.lens_message(file_view, "req0", resid_post(file_view))
    earlier = RunView(make_run(), RunSource.EARLIER, "old")
    assert "needs the model this run was captured with" in c.experiments.lens_message(earlier, "req0", resid_post(earlier))
    c.experiments.follow_lens(file_view, "req0", resid_post(file_view))
    assert file_view.lens.revision == 0  # another model's rows are never sent to this engine
    same_model = RunView(make_run(width=128), RunSource.FILE, "x.h5")
    same_model.run.metadata["model_path"] = c.engine.info.metadata["model_path"]
    c.experiments.follow_lens(same_model, "req0", resid_post(same_model))
    assert same_model.lens.revision == 1  # its own model's engine lenses a reopened file
