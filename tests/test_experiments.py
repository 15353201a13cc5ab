"""Experiments on every kind of session (in-process, remote, fake): patching sweeps and compare twins.

The sessions are test_session.py's (one compiled tiny Llama in process, the same on a server); a
patching sweep's every cell equals transformers patching one cell at a time (test_families.py does
the same for every other block family); a comparison's clean twin is bit for bit a run without
interventions and its intervened twin a solo run with them."""

import numpy as np
import pytest

from engines import assert_sweep_matches_transformers, same_length_prompts
from session_kinds import GREEDY, KINDS, collect
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling
from inspector.core.windows import CaptureWindow
from inspector.experiments.compare import (compare, difference, first_divergence, logprob_change, scoped_to_intervened,
                                           token_kl, twins_of, upcoming_twins)
from inspector.experiments.patching import Metric, PatchSpec, patch
from inspector.io import read_run, write_run
from inspector.io.sweep import read_sweep, write_sweep

LAYERS = ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post")
NAMES = ("model.layers.0.resid_post", "model.layers.1.resid_post")  # as runs name them
STEER = Intervention("model.layers.0.resid_post", scale=0.5, bias=0.3)  # as sessions name it


@pytest.mark.parametrize("kind", KINDS)
def test_scores_name_tokens_logprobs_and_capture_off_keeps_no_rows(sessions, kind):
    session, _ = sessions[kind]
    events = collect(session, ["def fibonacci(n):"], Sampling(max_tokens=3, logprobs=5, capture=False,
                                                             score_token_ids=(10, 20)))
    assert all(not step.rows for event in events for step in event.requests)
    req, = session.run.requests.values()
    n = len(req.prompt_token_ids)
    assert sorted(req.scores) == [n - 1, n, n + 1]  # the prompt's last position, then each generated one
    for k, position in enumerate(sorted(req.scores)):
        assert req.scores[position].shape == (2,) and np.all(req.scores[position] < 0)
        if kind != "fake":  # the engine's own logprob of the token it chose, where it is one of the two
            top = {t.token_id: t.logprob for t in req.top_logprobs[k]}
            for token, score in zip((10, 20), req.scores[position]):
                if token in top:
                    assert abs(top[token] - score) < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_a_patching_sweep_is_one_engine_call_with_progress_and_leaves_the_session_as_it_was(
        sessions, kind, tiny_models):
    session, _ = sessions[kind]
    session.set_interventions([STEER])
    windows = {"model.layers.0.resid_post": CaptureWindow("generated")}  # set aside: the sweep reads every row
    session.set_windows(windows)
    session.new_run()
    clean, corrupted = same_length_prompts(session)
    reports = []
    try:
        result = session.patch(PatchSpec(clean, corrupted, LAYERS, Metric(10, 20)),
                               lambda r, message: reports.append((r.done, message)))
        assert session.interventions == [STEER] and session.windows == windows and not session.run.requests
    finally:
        session.set_interventions([])
        session.set_windows({})
    assert result.complete and result.engine_calls == 1 and not result.stopped
    done = [d for d, _ in reports]
    assert done == sorted(done) and done[-1] == result.raw.size and "engine call 1 of 1" in reports[-1][1]
    if kind == "real":
        points = session.installed
        assert_sweep_matches_transformers(result, points, tiny_models["llama"], "llama")
        test_a_patching_sweep_is_one_engine_call_with_progress_and_leaves_the_session_as_it_was.real = result
    if kind == "remote":  # the same engine, through the server: the same numbers
        real = test_a_patching_sweep_is_one_engine_call_with_progress_and_leaves_the_session_as_it_was.real
        np.testing.assert_allclose(result.raw, real.raw, atol=1e-6, rtol=0)


def test_a_grid_wider_than_the_slots_runs_in_as_few_calls_as_fit(sessions, tiny_models):
    """Over 127 positions, 127 cells per hook and call: two engine calls, slots reused across them."""
    session, _ = sessions["real"]
    words = " ".join(f"w{i}" for i in range(46))  # 132 tokens
    clean, corrupted = words + " alpha", words + " omega"
    assert len(session.tokenize(clean)) == len(session.tokenize(corrupted)) > 128
    result = patch(session, PatchSpec(clean, corrupted, LAYERS[:1], Metric(10, 20), "noise"))
    assert result.complete and result.engine_calls == 2 and result.cells_per_call == 127
    assert_sweep_matches_transformers(result, session.installed, tiny_models["llama"], "llama")


def test_sweep_files_round_trip_and_bad_specs_are_refused(sessions, tmp_path):
    session, _ = sessions["fake"]
    clean, corrupted = "the cat sat", "the dog sat"
    result = patch(session, PatchSpec(clean, corrupted, LAYERS, Metric(10), positions=(0, 2)))
    path = write_sweep(result, tmp_path / "sweep.h5", {"model": "fake"})
    back, metadata = read_sweep(path)
    assert metadata == {"model": "fake"} and back.spec == result.spec and back.hooks == result.hooks
    np.testing.assert_array_equal(back.raw, result.raw)
    np.testing.assert_array_equal(back.source, result.source)
    assert back.token_texts == result.token_texts and back.complete
    for spec, message in [(PatchSpec(clean, "a longer corrupted prompt", LAYERS, Metric(10)), "as many tokens"),
                          (PatchSpec(clean, corrupted, ("blocks.0.hook_mlp_out",), Metric(10)), "install it first"),
                          (PatchSpec(clean, corrupted, LAYERS, Metric(10), "sideways"), "direction"),
                          (PatchSpec(clean, corrupted, LAYERS, Metric(10 ** 9)), "vocabulary"),
                          (PatchSpec(clean, corrupted, LAYERS, Metric(10), positions=(99,)), "positions")]:
        with pytest.raises(ValueError, match=message):
            patch(session, spec)
    assert not session.run.requests


def test_a_fake_sweep_wider_than_its_slots_says_how_many_calls(tiny_models):
    from fake_session import FakeSession
    from inspector.core.protocol import SessionOptions

    session = FakeSession(SessionOptions(hooks=LAYERS, max_slots=3))
    messages = []
    result = patch(session, PatchSpec("the cat sat on the mat", "the dog sat on the rug", LAYERS, Metric(1, 2)),
                   lambda r, m: messages.append(m))
    assert result.complete and result.engine_calls == 4 and result.cells_per_call == 4  # 2 hooks × 2 positions
    assert "engine call 4 of 4" in messages[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_compare_runs_twins_whose_clean_one_is_a_run_without_interventions(sessions, kind, tmp_path):
    session, _ = sessions[kind]
    prompts = ["def fibonacci(n):", "import os"]
    session.new_run()
    twins, events = session.compare(prompts, [STEER], GREEDY)
    list(events)
    assert twins_of(session.run) == twins and session.interventions == scoped_to_intervened([STEER], twins)
    session.set_interventions([])
    compared = session.run
    for t in twins:
        clean, steered = compared.requests[t.clean], compared.requests[t.intervened]
        assert clean.prompt == steered.prompt and clean.sampling["seed"] == steered.sampling["seed"]
        assert clean.intervention_log == [(0, [])] and steered.intervention_log[0][1][0]["scale"] == 0.5
        positions, diff = difference(clean.hooks[NAMES[0]], steered.hooks[NAMES[0]])
        assert len(positions) and np.abs(diff).max() > 0
        assert len(token_kl(clean, steered)) == len(clean.generated_token_ids)
        assert len(logprob_change(clean, steered)) == len(clean.generated_token_ids)
        first_divergence(clean, steered)
    if kind == "fake":
        return
    # the clean twins: bit for bit the same prompts run (the same batch) without interventions
    collect(session, [p for p in prompts for _ in range(2)], GREEDY)
    plain = list(session.run.requests.values())[0::2]
    for t, again in zip(twins, plain):
        clean = compared.requests[t.clean]
        assert clean.generated_token_ids == again.generated_token_ids
        for hook in NAMES:
            assert np.array_equal(clean.hooks[hook].values, again.hooks[hook].values)
    # the intervened twin: a solo run with the same intervention
    rid = session.upcoming_request_ids(1)[0]
    session.set_interventions([Intervention(STEER.hook, STEER.scale, STEER.bias, rid)])
    try:
        collect(session, prompts[:1], GREEDY)
    finally:
        session.set_interventions([])
    solo, steered = session.run.requests[rid], compared.requests[twins[0].intervened]
    assert solo.generated_token_ids == steered.generated_token_ids
    for hook in NAMES:
        np.testing.assert_allclose(solo.hooks[hook].values, steered.hooks[hook].values, rtol=0, atol=1e-5)
    if kind == "real":
        back = read_run(write_run(compared, tmp_path / "compare.h5"))
        assert twins_of(back) == twins


@pytest.mark.parametrize("kind", KINDS)
def test_an_intervention_changed_mid_comparison_reaches_the_intervened_twin_only(sessions, kind):
    session, _ = sessions[kind]
    session.new_run()
    twins = upcoming_twins(session, 1)
    change = Intervention("blocks.0.hook_resid_post", scale=0.0)

    def steer(event):
        if event.step == 2:
            session.set_interventions(scoped_to_intervened([change], twins))

    _, events = compare(session, ["import os"], [], GREEDY)
    try:
        for event in events:
            steer(event)
    finally:
        session.set_interventions([])
    clean, steered = (session.run.requests[r] for r in (twins[0].clean, twins[0].intervened))
    assert clean.intervention_log == [(0, [])] and len(steered.intervention_log) == 2
    rows = steered.hooks["model.layers.0.resid_post"]
    start = steered.intervention_log[-1][0]
    assert not np.any(rows.values[rows.positions >= start]) and np.all(np.any(clean.hooks["model.layers.0.resid_post"].values, axis=1))
