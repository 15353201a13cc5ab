"""The app without Qt: the runs on show, the controller's states and actions (on the fake session, with
jobs run inline), the interventions table's rows, and the heatmap's pooling arithmetic."""

import numpy as np
import pytest

from fake_session import FakeSession, llama_catalogue
from inspector.core.protocol import RequestStart, RequestStep, Sampling, StepEvent
from inspector.core.run import HookRows, TopToken
from inspector.viewer import jobs
from inspector.viewer.app_state import ENABLED, Action, AppState
from inspector.viewer.controller import Controller
from inspector.viewer.image_pool import PooledImage, choose_key, pool_maxabs, pow2_at_least, robust_levels
from inspector.viewer.intervention_rows import InterventionRow, parse_scalar
from inspector.viewer.run_view import RunSource, RunView
from ui_fixtures import make_run


def naive_maxabs(block, tb, fb):
    nt, nf = block.shape
    out = np.zeros((-(-nt // tb), -(-nf // fb)), np.float32)
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            cell = block[i * tb:(i + 1) * tb, j * fb:(j + 1) * fb]
            out[i, j] = cell.reshape(-1)[np.argmax(np.abs(cell))]
    return out


@pytest.mark.parametrize("shape,tb,fb", [((10, 7), 1, 1), ((10, 7), 2, 4), ((9, 33), 4, 8), ((1, 5), 2, 2)])
def test_pool_maxabs_matches_naive(shape, tb, fb):
    rng = np.random.default_rng(0)
    block = rng.normal(size=shape).astype(np.float32)
    np.testing.assert_array_equal(pool_maxabs(block, tb, fb), naive_maxabs(block, tb, fb))


def test_pow2():
    assert [pow2_at_least(x) for x in (0.3, 1, 1.01, 2, 3, 4, 4.5, 1000)] == [1, 1, 2, 2, 4, 4, 8, 1024]


def test_incremental_pooling_equals_full_recompute():
    rng = np.random.default_rng(1)
    full = rng.normal(size=(300, 64)).astype(np.float32)
    rows = HookRows(64)
    pool = PooledImage()
    key = choose_key(300, 64, (0, 300), (0, 64), 100, 20)
    assert key.tbin == 4 and key.fbin == 4
    for a in range(0, 300, 7):  # rows arrive in uneven chunks; the view grows
        n = min(7, 300 - a)
        rows.append(np.arange(a, a + n), np.zeros(n), full[a:a + n])
        frame = pool.update(rows.values, key, "src")
    np.testing.assert_array_equal(frame.image, pool_maxabs(full, 4, 4))
    assert (frame.x0, frame.width, frame.y0, frame.height) == (0, 300, 0, 64)


def test_wide_layer_pools_to_pixels_and_keeps_a_spike():
    values = np.zeros((2000, 4096), np.float32)
    values[1234, 3000] = -50.0
    key = choose_key(2000, 4096, (0, 2000), (0, 4096), 1000, 600)
    frame = PooledImage().update(values, key, 1)
    assert frame.image.shape[0] <= 1000 and frame.image.shape[1] <= 600
    assert frame.image.min() == -50.0  # max-abs keeps the sign and the magnitude


def test_levels():
    img = np.linspace(-3, 1, 1000, dtype=np.float32).reshape(100, 10)
    lo, hi = robust_levels(img, symmetric=False)
    assert -3 < lo < -2.9 and 0.9 < hi < 1
    lo, hi = robust_levels(img, symmetric=True)
    assert lo == -hi and 2.9 < hi <= 3


# ------------------------------------------------------------------------------------------ runs on show

H0 = "model.layers.0.resid_post"


def _step(rid, positions, values, token="x", finished=False, log=()):
    rows = {H0: (np.asarray(positions), np.asarray(positions) + 100, values)}
    return RequestStep(rid, (7,), (token,), (-0.1,), ((TopToken(7, -0.1, token),),), rows, log, finished,
                       "length" if finished else None)


def test_live_run_grows_from_events_with_norms_marks_and_a_frozen_snapshot():
    catalogue = llama_catalogue(hidden=4, intermediate=8)
    view = RunView.live({"model": "m"}, {h.name: h for h in catalogue if h.kind == "resid_post"}, catalogue)
    vals = np.arange(8, dtype=np.float32).reshape(2, 4)
    start = RequestStart("req0", "ab", (1, 2), ("a", "b"), {})
    view.apply(StepEvent(0, (_step("req0", [0, 1], vals, log=((0, ()),)),), (start,)))
    snapshot = view.snapshot()
    scaled = {"hook": H0, "scale": 2.0, "bias": 0.0, "request_id": None, "positions": None}
    view.apply(StepEvent(1, (_step("req0", [2], vals[:1] + 10, "y", True, ((2, (scaled,)),)),)))
    req = view.request("req0")
    assert req.token_texts == ["a", "b", "x", "y"] and req.finish_reason == "length"
    pos, values = view.rows("req0", H0)
    assert list(pos) == [0, 1, 2]
    np.testing.assert_array_equal(values, np.vstack([vals, vals[:1] + 10]))
    np.testing.assert_allclose(view.norms("req0", H0), np.linalg.norm(values, axis=1), rtol=1e-6)
    assert list(view.intervention_marks("req0", H0, 4)) == [0, 0, 2, 2]
    assert list(view.intervention_marks("req0", "model.layers.1.resid_post", 4)) == [0, 0, 1, 1]
    assert view.selection.request == "req0" and view.selection.hook == H0
    np.testing.assert_array_equal(snapshot.requests["req0"].hooks[H0].values, vals)  # later rows not in it
    assert view.row_of_position("req0", H0, 2) == 2 and view.row_of_position("req0", H0, 3) is None


def test_selecting_another_request_clears_the_position():
    view = RunView(make_run(), RunSource.FILE, "x.h5")
    assert view.selection.request == "req0" and view.selection.hook is not None
    view.select(position=3)
    before = view.revision
    view.select(request="req1")
    assert view.selection.position is None and view.revision > before


def test_steering_vector_is_mean_difference():
    run = make_run(n_tokens=(12,))
    view = RunView(run, RunSource.FILE, "x.h5")
    hook = next(iter(run.hooks))
    values = run.requests["req0"].hooks[hook].values
    vec, na, nb = view.steering_vector(hook, [("req0", (1, 2, 3))], [("req0", (5, 6))])
    np.testing.assert_allclose(vec, values[1:4].mean(0) - values[5:7].mean(0), rtol=1e-5)
    assert (na, nb) == (3, 2)
    with pytest.raises(ValueError, match="no captured rows"):
        view.steering_vector(hook, [("req0", (11,))], [("req0", (1,))])  # last token: never fed back


def test_intervention_row_validation():
    assert parse_scalar(" 2.5 ") == 2.5
    for bad in ("nan", "inf", "", "abc"):
        with pytest.raises(ValueError):
            parse_scalar(bad, "scale")
    row = InterventionRow(hook="h")
    with pytest.raises(ValueError, match="finite"):
        row.with_field("scale", "nan", 3)
    with pytest.raises(ValueError, match="4 values but the hook point is 3 wide"):
        row.with_field("bias", np.ones(4), 3)
    assert row.scale == 1.0  # unchanged
    iv = row.with_field("scope", "positions", 3).with_field("positions", "2-4", 3).to_intervention()
    assert iv.positions == (2, 3, 4) and iv.request_id is None


# ------------------------------------------------------------------------------------------ the controller

class InlineRunner:
    """Runs each job at once, on the calling thread."""

    def start(self, job, *args, on_done=None, on_partial=None, on_progress=None, on_exception=None):
        state = jobs.TaskState(on_partial or (lambda v: None), on_progress or (lambda f: None))
        try:
            result = job(*args, state)
        except Exception as exc:  # noqa: BLE001
            if on_exception is None:
                raise
            on_exception(exc)
        else:
            if on_done:
                on_done(result)
        return state


class RecordingView:
    """A ControllerView that notes what it was told."""

    def __init__(self):
        self.calls, self.errors, self.states = [], [], []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args))

    def state_changed(self, state):
        self.states.append(state)

    def error(self, text, details="", title="Error"):
        self.errors.append(text)

    def ask(self, title, text, on_yes, details=""):
        on_yes()


@pytest.fixture
def controller(monkeypatch):
    monkeypatch.setattr(FakeSession, "_next_id", 0)
    runner, view = InlineRunner(), RecordingView()
    return Controller(FakeSession.open, runner, runner, view), view


def test_every_action_is_enabled_in_the_states_its_table_says(controller):
    c, view = controller
    assert set(ENABLED) == set(Action)
    assert not c.engine.enabled(Action.RESTART)  # nothing opened yet
    for state in AppState:
        c.engine.state = state
        assert {a for a in Action if a is not Action.RESTART and c.engine.enabled(a)} == \
               {a for a, states in ENABLED.items() if a is not Action.RESTART and state in states}
    c.engine.state = AppState.BOOTING
    assert not c.engine.open_model("demo", "compiled") and "wait until it is ready" in view.errors[-1]


def test_open_generate_stop_and_fail(controller, tmp_path, monkeypatch):
    c, view = controller
    assert not c.engine.open_model(str(tmp_path / "missing"), "compiled") and "no model directory" in view.errors[-1]
    assert c.engine.state is AppState.NO_MODEL
    assert c.engine.open_model("demo", "eager")
    assert view.states[:2] == [AppState.BOOTING, AppState.READY] and c.engine.info.options.mode == "eager"
    assert c.generating.generate(["hello"], Sampling(max_tokens=3))
    assert c.engine.state is AppState.READY and c.generating.last_result.tokens == 3 and not c.generating.last_result.stopped
    assert c.runs.live.request_ids() == ["req0"] and c.runs.live.selection.request == "req0"
    monkeypatch.setattr(FakeSession, "fail_at_step", 1)
    c.generating.generate(["again"], Sampling(max_tokens=5))
    assert c.engine.state is AppState.DEAD and "Generation failed" in view.errors[-1] and "kept" in view.errors[-1]
    assert len(c.runs.live.request("req1").generated_token_ids) == 1  # what came before the failure stays
    assert not c.generating.generate(["x"], Sampling()) and c.engine.enabled(Action.RESTART)


def test_another_model_keeps_the_earlier_run(controller, tmp_path):
    c, view = controller
    c.engine.open_model("demo", "compiled")
    c.generating.generate(["hello"], Sampling(max_tokens=2))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    c.engine.open_model(str(other), "compiled")
    assert [v.source for v in c.runs.earlier] == [RunSource.EARLIER] and c.runs.earlier[0].request_ids() == ["req0"]
    assert c.runs.live.request_ids() == [] and c.runs.shown is c.runs.live
