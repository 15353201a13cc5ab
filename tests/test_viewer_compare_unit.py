"""The Compare tab without Qt: a pair's measures grown step by step equal the measures of the whole
twins, the pair shown follows the selected request, the tab's words when there is nothing to compare;
and the controller's compare path: twins marked in the live run, interventions scoped to the
intervened twins while the comparison generates (an edit made before its job set them included) and
for every request again after it. On the fake session, jobs run inline."""

from dataclasses import replace

import numpy as np
import pytest

from fake_session import FakeSession
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionOptions
from inspector.core.run import HookRows
from inspector.experiments.compare import (Twins, compare, difference, logprob_change, mark_twins,
                                           scoped_to_intervened, token_kl)
from inspector.viewer import jobs
from inspector.viewer.compare import NO_TWINS, Comparisons, PairMeasures
from inspector.viewer.controller import Controller
from inspector.viewer.labels import display_token
from inspector.viewer.run_view import RunSource, RunView
from test_viewer_unit import InlineRunner, RecordingView
from ui_fixtures import make_run

HOOK = "model.layers.0.resid_post"
STEER = Intervention(HOOK, scale=0.5, bias=0.3)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)
    return FakeSession(SessionOptions(hooks=("blocks.*.hook_resid_post",)), hidden=16)


def live_comparison(fake, prompts, on_step=lambda event: None, max_tokens=6):
    """A comparison folded into a live RunView as the app folds it, shown after every step."""
    view, comparisons, shown = RunView.live({}, {}), Comparisons(), []
    twins, events = compare(fake, prompts, [], Sampling(max_tokens=max_tokens))
    for event in events:
        view.apply(event)
        mark_twins(view.run, twins)
        shown.append(comparisons.show(view, HOOK))
        on_step(event)
    return view, twins, shown


def test_measures_grown_step_by_step_equal_those_of_the_whole_twins(fake):
    def steer_at_step_2(event):
        if event.step == 2:
            fake.set_interventions(scoped_to_intervened([STEER], twins))

    twins = [Twins("req0", "req1"), Twins("req2", "req3")]
    view, made, shown = live_comparison(fake, ["the cat sat", "hello"], steer_at_step_2)
    assert made == twins and len({len(s.kl) for s in shown}) > 3  # it grew step by step
    last = shown[-1]
    clean, steered = view.request("req0"), view.request("req1")
    np.testing.assert_array_equal(last.kl, token_kl(clean, steered))
    np.testing.assert_array_equal(last.logprob_change, logprob_change(clean, steered))
    positions, diff = difference(clean.hooks[HOOK], steered.hooks[HOOK])
    np.testing.assert_array_equal(last.diff_positions, positions)
    np.testing.assert_array_equal(last.diff_values, diff)
    start, n = steered.intervention_log[-1][0], len(clean.prompt_token_ids)  # steered from this position on
    assert start == n + 2 and not diff[:start].any() and diff[start:].any(axis=1).all()
    # the token the first steered row predicts is the first to differ
    assert last.divergence == 3 and "part at generated token 3" in last.note
    assert not np.isnan(last.kl).any() and not last.kl[:3].any() and last.kl[3:].min() > 0
    assert list(last.marks) == [0] * start + [2] * (len(last.marks) - start)


def test_a_difference_aligns_positions_and_skips_those_one_twin_lacks():
    rng = np.random.default_rng(0)
    clean, steered = HookRows(4), HookRows(4)
    measures = PairMeasures()
    for a in range(0, 12, 3):  # rows arrive in chunks; the intervened twin lacks positions 4 and 5
        kept = [p for p in range(a, a + 3) if p not in (4, 5)]
        clean.append(np.arange(a, a + 3), np.zeros(3), rng.normal(size=(3, 4)))
        steered.append(kept, np.zeros(len(kept)), rng.normal(size=(len(kept), 4)))
        positions, values = measures.difference("h", clean, steered)
    expected = difference(clean, steered)
    assert list(positions) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    np.testing.assert_array_equal(positions, expected[0])
    np.testing.assert_allclose(values, expected[1])


def test_the_pair_shown_is_the_selected_requests_else_the_first(fake):
    view, twins, _ = live_comparison(fake, ["the cat sat", "hello"])
    comparisons = Comparisons()
    assert comparisons.show(view, HOOK).twins == twins[0]
    view.select(request="req3")
    shown = comparisons.show(view, HOOK)
    assert shown.twins == twins[1] and shown.pairs == tuple(twins)
    assert shown.labels == ("req0 ↔ req1 · the cat sat", "req2 ↔ req3 · hello")
    view.select(request="req2")
    assert comparisons.show(view, HOOK).twins == twins[1]


def test_twins_that_agree_say_why_and_a_run_without_twins_says_how_to_get_some(fake):
    view, _, shown = live_comparison(fake, ["the cat sat"])
    assert shown[-1].divergence is None and "No intervention reached the intervened twin" in shown[-1].note
    assert not shown[-1].kl.any() and not shown[-1].logprob_change.any()
    assert Comparisons().show(RunView.live({}, {}), HOOK).message == NO_TWINS
    assert Comparisons().show(RunView(make_run(), RunSource.FILE, "plain.h5"), None).message == NO_TWINS


def test_the_read_out_names_both_tokens_and_says_n_a_where_a_measure_is_unknown(fake):
    view, _, shown = live_comparison(fake, ["the cat sat"], lambda e: e.step == 0 and fake.set_interventions(
        [Intervention(HOOK, bias=1.0, request_id="req1")]))
    last = shown[-1]
    n = last.prompt_length
    clean, steered = (display_token(view.token_texts(rid)[n + 3]) for rid in ("req0", "req1"))
    assert last.describe(3) == (f"token 3 (position {n + 3}): {clean!r} clean, {steered!r} intervened"
                                f" · KL ≥ {last.kl[3]:.4g} · Δ logprob {last.logprob_change[3]:+.4g}")
    unknown = replace(last, kl=np.full(len(last.kl), np.nan), logprob_change=np.full(len(last.kl), np.nan))
    assert unknown.describe(0).endswith("KL ≥ n/a · Δ logprob n/a") and last.describe(99) == ""


# ------------------------------------------------------------------------------------------ the controller

class QueuedRunner(InlineRunner):
    """Holds each job until ``run_queued``: the engine thread is busy when the user clicks."""

    def __init__(self):
        self.queued = []

    def start(self, job, *args, **callbacks):
        self.queued.append((job, args, callbacks))

    def run_queued(self):
        while self.queued:
            job, args, callbacks = self.queued.pop(0)
            InlineRunner.start(self, job, *args, **callbacks)


@pytest.fixture
def controller(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)
    runner, view = QueuedRunner(), RecordingView()
    c = Controller(FakeSession.open, runner, runner, view)
    c.engine.open_model("demo", "compiled")
    runner.run_queued()
    return c, view, runner


def test_a_comparison_marks_its_twins_and_scopes_interventions_while_it_generates(controller):
    c, view, runner = controller
    c.generating.set_interventions([STEER])
    sent = []
    c.generating.generate(["hello"], Sampling(max_tokens=4), compare=True)
    assert c.generating.compared == [Twins("req0", "req1")] and c.generating.progress.total == 8
    original = c.generating._event

    def event(live, news):
        original(live, news)
        sent.append(c.engine.session.interventions)

    c.generating._event = event
    runner.run_queued()
    assert sent[0] == scoped_to_intervened([STEER], [Twins("req0", "req1")])
    assert c.generating.compared is None and c.engine.session.interventions == [STEER]  # for every request again
    roles = {rid: (req.twin_role, req.twin_of) for rid, req in c.runs.live.run.requests.items()}
    assert roles == {"req0": ("clean", "req1"), "req1": ("intervened", "req0")}
    assert any("each run clean and with the interventions" in args[0] for name, args in view.calls if name == "status")


def test_an_edit_made_before_the_comparisons_job_starts_wins(controller):
    c, view, runner = controller
    c.generating.set_interventions([STEER])
    c.generating.generate(["hello"], Sampling(max_tokens=6), compare=True)
    changed = Intervention(HOOK, scale=0.0)
    c.generating.set_interventions([changed])  # the job has not set its own yet: it will, with the set it was given
    assert c.engine.session.interventions == [Intervention(HOOK, scale=0.0, request_id="req1")]
    runner.run_queued()
    steered = c.runs.live.request("req1")
    assert [d["scale"] for d in steered.intervention_log[-1][1]] == [0.0]
    assert c.runs.live.request("req0").intervention_log == [(0, [])] and c.engine.session.interventions == [changed]


def test_compare_with_no_intervention_still_runs_and_says_the_twins_will_agree(controller):
    c, view, runner = controller
    c.generating.generate(["hello"], Sampling(max_tokens=3), compare=True)
    runner.run_queued()
    assert len(c.runs.live.request_ids()) == 2 and c.generating.last_result.tokens == 6
    statuses = [args[0] for name, args in view.calls if name == "status"]
    assert any("no intervention is set: the twins will agree" in s for s in statuses)


def test_the_compare_job_streams_events_like_generate(fake):
    news = []
    result = jobs.compare(fake, ["hi"], [STEER], Sampling(max_tokens=3), jobs.LensBox(), jobs.TaskState(news.append))
    assert result.tokens == 6 and len(news) == result.steps and fake.run.requests["req1"].twin_role == "intervened"
