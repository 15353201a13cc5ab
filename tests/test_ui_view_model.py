"""Qt-free GUI state: growing buffers, incremental pooling, the live mirror, marks, steering vectors."""

import numpy as np
import pytest

from inspector.ui.capture_view_model import (CaptureViewModel, GrowingRows, RequestInfo, StepUpdate,
                                             format_positions, parse_positions)
from inspector.ui.image_pool import PooledImage, choose_key, pool_maxabs, pow2_at_least, robust_levels
from inspector.ui.intervention_rows import InterventionRow, check_vector, load_vector_file, parse_scalar
from ui_fixtures import FakeRequestStep, FakeStepEvent, make_catalogue, make_run


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
    rows = GrowingRows(64)
    pool = PooledImage()
    key = choose_key(300, 64, (0, 300), (0, 64), 100, 20)
    assert key.tbin == 4 and key.fbin == 4
    for a in range(0, 300, 7):  # rows arrive in uneven chunks; the view grows
        rows.append(np.arange(a, min(a + 7, 300)), np.zeros(min(7, 300 - a)), full[a:a + 7])
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


def test_growing_rows_views_stay_valid():
    rows = GrowingRows(3, capacity=2)
    rows.append([0, 1], [5, 6], np.ones((2, 3)))
    early = rows.values
    rows.append([2, 3, 4], [7, 8, 9], np.full((3, 3), 2.0))
    assert early.shape == (2, 3) and (early == 1).all()
    assert rows.values.shape == (5, 3) and list(rows.positions) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        rows.append([0], [0], np.ones((1, 4)))


def test_levels():
    img = np.linspace(-3, 1, 1000, dtype=np.float32).reshape(100, 10)
    lo, hi = robust_levels(img, symmetric=False)
    assert -3 < lo < -2.9 and 0.9 < hi < 1
    lo, hi = robust_levels(img, symmetric=True)
    assert lo == -hi and 2.9 < hi <= 3


def test_positions_text_round_trip():
    assert parse_positions("3-5, 9 ,11..12") == (3, 4, 5, 9, 11, 12)
    assert format_positions((3, 4, 5, 9, 11, 12)) == "3-5, 9, 11-12"
    for bad in ("", "a", "5-3", "1-2-3"):
        with pytest.raises(ValueError):
            parse_positions(bad)


def _step(rid, positions, hook_values, token="x", finished=False):
    rows = {h: (np.asarray(positions), np.asarray(positions) + 100, v) for h, v in hook_values.items()}
    return FakeRequestStep(rid, (7,), (token,), (-0.1,), (((7, -0.1),),), rows, finished,
                           "length" if finished else None)


def test_live_mirror_applies_steps_and_logs():
    cat = make_catalogue(hidden=4)
    installed = {h.name: h for h in cat if h.kind == "resid_post"}
    vm = CaptureViewModel()
    vm.start_live({"model": "m"}, installed, cat)
    h0 = "model.layers.0.resid_post"
    info = RequestInfo("r", "ab", (1, 2), ("a", "b"), {})
    vals = np.arange(8, dtype=np.float32).reshape(2, 4)
    vm.apply_update(StepUpdate(FakeStepEvent(0, (_step("r", [0, 1], {h0: vals}),)), (info,),
                               {"r": ((0, ()),)}))
    vm.apply_update(StepUpdate(FakeStepEvent(1, (_step("r", [2], {h0: vals[:1] + 10}, "y", True),)), (),
                               {"r": ((2, ({"hook": h0, "scale": 2.0, "bias": 0.0, "request_id": None,
                                            "positions": None},)),)}))
    req = vm.request("r")
    assert req.token_texts == ["a", "b", "x", "y"] and req.finish_reason == "length"
    pos, values = vm.rows("r", h0)
    assert list(pos) == [0, 1, 2]
    np.testing.assert_array_equal(values, np.vstack([vals, vals[:1] + 10]))
    np.testing.assert_allclose(vm.norms("r", h0), np.linalg.norm(values, axis=1), rtol=1e-6)
    assert list(vm.intervention_marks("r", h0, 4)) == [0, 0, 2, 2]
    assert list(vm.intervention_marks("r", "model.layers.1.resid_post", 4)) == [0, 0, 1, 1]
    snap = vm.snapshot()
    np.testing.assert_array_equal(snap.requests["r"].hooks[h0].values, values)
    assert vm.selected_request == "r" and vm.selected_hook == h0


def test_steering_vector_is_mean_difference():
    run = make_run(n_tokens=(12,))
    vm = CaptureViewModel()
    vm.load_run(run, "x.h5")
    hook = next(iter(run.hooks))
    values = run.requests["0"].hooks[hook].values
    vec, na, nb = vm.steering_vector(hook, [("0", (1, 2, 3))], [("0", (5, 6))])
    np.testing.assert_allclose(vec, values[1:4].mean(0) - values[5:7].mean(0), rtol=1e-5)
    assert (na, nb) == (3, 2)
    with pytest.raises(ValueError, match="no captured rows"):
        vm.steering_vector(hook, [("0", (11,))], [("0", (1,))])  # last token: never fed back


def test_intervention_row_validation(tmp_path):
    assert parse_scalar(" 2.5 ") == 2.5
    for bad in ("nan", "inf", "", "abc"):
        with pytest.raises(ValueError):
            parse_scalar(bad, "scale")
    with pytest.raises(ValueError, match="4 values but the hook point is 3 wide"):
        check_vector(np.ones(4), 3, "bias")
    with pytest.raises(ValueError, match="NaN"):
        check_vector(np.array([1.0, np.nan, 2.0]), 3, "bias")
    np.save(tmp_path / "v.npy", np.ones((1, 3)))
    assert load_vector_file(tmp_path / "v.npy", 3).shape == (3,)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(ValueError, match="cannot read junk.npy"):
        load_vector_file(tmp_path / "junk.npy", 3)
    row = InterventionRow(hook="h")
    with pytest.raises(ValueError):
        row.with_field("scale", "nan", 3)
    assert row.scale == 1.0  # unchanged
    iv = row.with_field("scope", "positions", 3).with_field("positions", "2-4", 3).to_intervention()
    assert iv.positions == (2, 3, 4) and iv.request_id is None
