"""Interventions as values, and the plugin's slot planner, without an engine (pure numpy)."""

import numpy as np
import pytest

from inspector.core.interventions import Intervention, check_clamp_capacity, validate
from inspector.plugin.slots import SlotPlanner, compose


def iv(**kw):
    return Intervention.from_dict({"hook": "h", **kw})


def test_rows_get_slots_by_scope():
    planner = SlotPlanner(max_slots=8)
    planner.set([iv(scale=2.0), iv(bias=1.0, request_id="b"), iv(scale=0.0, positions=[1]),
                 Intervention("other", 3.0, request_id="b")])
    qsl = np.array([0, 3, 5])
    slots, writes = planner.plan(["a", "b"], qsl, np.array([0, 1, 2, 7, 8]))
    h = slots["h"]
    assert h[0] == h[2] and h[3] == h[4] and len({h[0], h[1], h[3]}) == 3 and 0 not in h
    assert slots["other"].tolist() == [0, 0, 0, 1, 1]  # slots are numbered per hook
    assert {(hook, slot): len(ivs) for hook, slot, ivs in writes} == {
        ("h", h[0]): 1, ("h", h[1]): 2, ("h", h[3]): 2, ("other", 1): 1}
    again, writes_again = planner.plan(["a", "b"], qsl, np.array([0, 1, 2, 7, 8]))  # slots persist
    assert again["h"].tolist() == h.tolist() and writes_again == []


def test_unaffected_rows_use_identity_slot_zero():
    planner = SlotPlanner(max_slots=4)
    planner.set([iv(scale=2.0, request_id="x")])
    slots, writes = planner.plan(["a"], np.array([0, 2]), np.array([0, 1]))
    assert slots == {} and writes == []


def test_requests_steered_alike_share_a_slot_however_many_there_are():
    """A server scopes one client's "all requests" to each of its requests: 500 interventions, 1 slot."""
    planner = SlotPlanner(max_slots=4)
    ids = [f"r{i}" for i in range(500)]
    planner.set([iv(scale=3.0, request_id=rid) for rid in ids] + [iv(bias=1.0, request_id="r7", positions=[0])])
    slots, writes = planner.plan(ids, np.arange(501), np.zeros(500, dtype=np.int64))
    assert len(set(slots["h"].tolist())) == 2 and slots["h"][7] != slots["h"][8] and len(writes) == 2
    assert sorted(len(ivs) for _, _, ivs in writes) == [1, 2]


def test_a_patching_grid_needs_slots_per_hook_and_forward_only():
    """Each cell patches its own vector at one (hook, position): slots are per hook, and a slot is
    reused by a later forward once no row of the current one needs it."""
    planner = SlotPlanner(max_slots=3)
    cells = [(f"c{h}{p}", f"h{h}", p) for h in range(4) for p in range(4)]
    planner.set([Intervention(hook, 0.0, (float(p), 1.0), rid, (p,)) for rid, hook, p in cells])
    for batch in (cells[0::2], cells[1::2]):  # 8 cells in each forward, two per hook
        ids = [rid for rid, _, _ in batch]
        slots, writes = planner.plan(ids, np.arange(0, 4 * len(ids) + 1, 4), np.tile(np.arange(4), len(ids)))
        assert set(slots) == {f"h{h}" for h in range(4)} and len(writes) == 8
        for i, (rid, hook, p) in enumerate(batch):
            row = slots[hook][4 * i:4 * i + 4]
            assert row[p] > 0 and np.delete(row, p).tolist() == [0, 0, 0]
            assert [ivs[0].request_id for h, s, ivs in writes if h == hook and s == row[p]] == [rid]


@pytest.mark.parametrize("seed", range(20))
def test_every_row_gets_exactly_the_interventions_that_apply_to_it_in_their_order(seed):
    """Random forwards (prefills and decodes, a request with no rows, positions out of order), random
    scopes (global, per request, per position): each row's slot holds exactly the interventions whose
    request and positions take that row, in the order given, checked row by row."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i}" for i in range(int(rng.integers(1, 12)))]
    ivs = []
    for k in range(int(rng.integers(1, 14))):
        positions = None if rng.random() < 0.5 else sorted(rng.choice(40, int(rng.integers(0, 6)), replace=False).tolist())
        ivs.append(Intervention(f"h{rng.integers(2)}", float(k + 2), request_id=None if rng.random() < 0.2 else
                                str(rng.choice(ids + ["gone"])), positions=positions))
    planner = SlotPlanner(max_slots=64)
    planner.set(ivs)
    counts = rng.integers(0, 6, len(ids))
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate([rng.permutation(np.arange(p, p + c)) if rng.random() < 0.3 else np.arange(p, p + c)
                                for p, c in zip(rng.integers(0, 30, len(ids)), counts)]).astype(np.int64)
    slots, writes = planner.plan(ids, qsl, positions)
    held = {(hook, slot): [iv.scale for iv in got] for hook, slot, got in writes}
    for hook in ("h0", "h1"):
        for i, rid in enumerate(ids):
            for row in range(qsl[i], qsl[i + 1]):
                expected = [iv.scale for iv in ivs if iv.hook == hook and iv.request_id in (None, rid)
                            and (iv.positions is None or positions[row] in iv.positions)]
                slot = int(slots[hook][row]) if hook in slots else 0
                assert held.get((hook, slot), []) == expected, (hook, rid, row)


def test_slots_outlive_a_change_of_the_set_for_the_effects_that_stay():
    """Requests come and go on a busy server, changing the set nearly every step: a vector still in it
    keeps its slot unwritten, a new one is written, a number gone is never given to another effect,
    and a forgotten hook's slots are written again."""
    planner = SlotPlanner(max_slots=4)
    a, b, c = (iv(bias=float(k), request_id=rid) for k, rid in ((1, "a"), (2, "b"), (3, "c")))
    planner.set([a])
    slots, writes = planner.plan(["a"], np.array([0, 1]), np.array([5]))
    assert [ivs for _, _, ivs in writes] == [[a]]
    planner.set([a, b])
    again, writes = planner.plan(["a", "b"], np.array([0, 1, 2]), np.array([6, 3]))
    assert again["h"][0] == slots["h"][0] and [ivs for _, _, ivs in writes] == [[b]]
    planner.set([b, c])
    planner.set([b, c, iv(bias=1.0, request_id="a2")])  # a's effect left the set and came back: written anew
    _, writes = planner.plan(["b", "c", "a2"], np.arange(4), np.array([4, 1, 2]))
    assert sorted(ivs[0].request_id for _, _, ivs in writes) == ["a2", "c"]
    planner.forget(["h"])
    _, writes = planner.plan(["b", "c", "a2"], np.arange(4), np.array([5, 2, 3]))
    assert sorted(ivs[0].request_id for _, _, ivs in writes) == ["a2", "b", "c"]


def test_too_many_combinations_is_a_clear_error():
    planner = SlotPlanner(max_slots=2)
    planner.set([iv(scale=2.0, request_id="a"), iv(scale=3.0, request_id="b")])
    with pytest.raises(RuntimeError, match="max_slots"):
        planner.plan(["a", "b"], np.array([0, 1, 2]), np.array([0, 0]))


def test_compose_applies_in_order():
    ivs = [iv(scale=2.0, bias=1.0), Intervention("other", 5.0), iv(scale=[1.0, 3.0], bias=[0.0, -1.0])]
    scale, bias = compose(ivs, "h", 2)
    x = np.array([0.5, -2.0])
    np.testing.assert_allclose(x * scale + bias, ((x * 2 + 1) * [1.0, 3.0]) + [0.0, -1.0])
    assert compose(ivs, "missing", 2) is None


@pytest.mark.parametrize("kw, message", [
    (dict(scale=[1.0, 2.0, 3.0]), "has 3 values but the hook point is 2 wide"),
    (dict(bias=float("nan")), "NaN/Inf"),
    (dict(positions=[2]), "enable_position_interventions"),
    (dict(bias=1e39), "beyond float32's range"),
])
def test_validate(kw, message):
    with pytest.raises(ValueError, match=message):
        validate(iv(**kw), {"h": 2}, max_position=16, allow_positions=False)


def test_values_a_half_precision_engine_would_hold_as_inf_are_refused():
    validate(iv(bias=1e5), {"h": 2}, max_position=16, allow_positions=False, dtype="bfloat16")
    with pytest.raises(ValueError, match="beyond ±65504, which a float16 engine would hold as Inf"):
        validate(iv(bias=1e5), {"h": 2}, max_position=16, allow_positions=False, dtype="float16")
    with pytest.raises(ValueError, match="bfloat16 engine"):
        validate(iv(scale=3.4e38), {"h": 2}, max_position=16, allow_positions=False, dtype="bfloat16")


def test_from_dict_reads_numpy_vectors():
    got = Intervention.from_dict({"hook": "h", "bias": np.arange(3, dtype=np.float32), "positions": np.array([4])})
    np.testing.assert_array_equal(got.bias, [0.0, 1.0, 2.0])
    assert got.positions == (4,) and not got.bias.flags.writeable


def test_vectors_are_shared_arrays_compared_by_value():
    given = np.arange(4.0)
    one = Intervention("h", bias=given)
    given[0] = 9.0  # the caller's array is copied once, then kept read-only
    assert one.bias[0] == 0.0 and Intervention.from_dict(one.as_dict(arrays=True)).bias is one.bias
    assert one == Intervention("h", bias=(0.0, 1.0, 2.0, 3.0)) and one != Intervention("h", bias=(0.0, 1.0, 2.0, 4.0))
    assert hash(one) == hash(Intervention("h", bias=[0.0, 1.0, 2.0, 3.0])) and one != Intervention("h", bias=1.0)
    assert one.as_dict()["bias"] == [0.0, 1.0, 2.0, 3.0]  # JSON-able for logs and files


def test_as_dict_round_trips_and_scopes():
    one = Intervention("h", scale=(1.0, 2.0), bias=0.5, request_id="req3", positions=(1, 2))
    assert Intervention.from_dict(one.as_dict()) == one
    assert one.applies_to("req3") and not one.applies_to("req4") and Intervention("h").applies_to("req4")
    with pytest.raises(ValueError, match="unknown intervention fields"):
        Intervention.from_dict({"hook": "h", "colour": "red"})


def clamp(value=2.0, scale=1.0, width=4):
    return {"encoder": np.arange(width) * scale, "offset": 0.5, "floor": 0.0, "decoder": np.ones(width),
            "value": value, "label": "sae/3"}


def test_a_feature_clamp_round_trips_and_is_its_own_effect():
    a = iv(clamp=clamp())
    for d in (a.as_dict(), a.as_dict(arrays=True)):
        back = Intervention.from_dict(d)
        assert back == a and hash(back) == hash(a) and back.clamp.label == "sae/3"
    assert iv(clamp=clamp(3.0)) != a and iv() != a  # another value, no clamp: other effects
    assert iv(clamp=clamp(3.0)).clamp.direction == a.clamp.direction
    planner = SlotPlanner(max_slots=4)
    planner.set([a, iv(clamp=clamp(3.0), request_id="b")])
    slots, writes = planner.plan(["a", "b"], np.array([0, 1, 2]), np.array([0, 0]))
    assert slots["h"][0] != slots["h"][1] and len(writes) == 2


@pytest.mark.parametrize("kw, message", [
    ({"clamp": clamp(), "scale": 2.0}, "a feature clamp on 'h' stands alone"),
    ({"clamp": clamp(width=3)}, "encoder of the feature clamp on 'h' has 3 values but the hook point is 4 wide"),
    ({"clamp": {**clamp(), "value": float("nan")}}, "the value of a feature clamp must be finite"),
    ({"clamp": {**clamp(), "decoder": 1.0}}, "the decoder of a feature clamp must be a vector"),
    ({"clamp": {"encoder": [1.0]}}, "missing \\['decoder', 'floor', 'offset', 'value'\\]"),
])
def test_a_bad_feature_clamp_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        validate(iv(**kw), {"h": 4}, 16, True)


def test_an_engine_clamps_as_many_features_per_hook_as_it_was_booted_for():
    same_feature = [iv(clamp=clamp(v)) for v in (1.0, 2.0, 3.0)]
    check_clamp_capacity(same_feature, 1)  # one feature, three values
    with pytest.raises(ValueError, match="2 features clamped at 'h', more than the engine's 1: boot it with room"):
        check_clamp_capacity([iv(clamp=clamp()), iv(clamp=clamp(scale=2.0))], 1)
    with pytest.raises(ValueError, match="booted without room for feature clamps \\(SessionOptions.feature_clamps"):
        check_clamp_capacity(same_feature, 0)
