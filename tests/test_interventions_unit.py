"""Interventions as values, and the plugin's slot planner, without an engine (pure numpy)."""

import numpy as np
import pytest

from inspector.capture.interventions import Intervention, validate
from inspector.plugin.slots import SlotPlanner, compose


def iv(**kw):
    return Intervention.from_dict({"hook": "h", **kw})


def test_rows_get_slots_by_scope():
    planner = SlotPlanner(max_slots=8)
    planner.set([iv(scale=2.0), iv(bias=1.0, request_id="b"), iv(scale=0.0, positions=[1])])
    qsl = np.array([0, 3, 5])
    applies = planner.applies(["a", "b"], qsl, np.array([0, 1, 2, 7, 8]))
    assert applies.astype(int).tolist() == [[1, 0, 0], [1, 0, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]]
    slots, new = planner.assign(applies)
    assert slots[0] == slots[2] and slots[3] == slots[4] and len({slots[0], slots[1], slots[3]}) == 3
    assert sorted(s for s, _ in new) == [1, 2, 3] and 0 not in slots
    assert {s: len(ivs) for s, ivs in new} == {slots[0]: 1, slots[1]: 2, slots[3]: 2}
    again, new_again = planner.assign(applies)  # slots persist; nothing to rewrite
    assert again.tolist() == slots.tolist() and new_again == []


def test_unaffected_rows_use_identity_slot_zero():
    planner = SlotPlanner(max_slots=4)
    planner.set([iv(scale=2.0, request_id="x")])
    slots, new = planner.assign(planner.applies(["a"], np.array([0, 2]), np.array([0, 1])))
    assert slots.tolist() == [0, 0] and new == []


def test_requests_steered_alike_share_a_slot_however_many_there_are():
    """A server scopes one client's "all requests" to each of its requests: 500 interventions, 1 slot."""
    planner = SlotPlanner(max_slots=4)
    ids = [f"r{i}" for i in range(500)]
    planner.set([iv(scale=3.0, request_id=rid) for rid in ids] + [iv(bias=1.0, request_id="r7", positions=[0])])
    qsl = np.arange(501)
    slots, new = planner.assign(planner.applies(ids, qsl, np.zeros(500, dtype=np.int64)))
    assert len(set(slots.tolist())) == 2 and slots[7] != slots[8] and len(new) == 2
    assert sorted(len(ivs) for _, ivs in new) == [1, 2]


def test_too_many_combinations_is_a_clear_error():
    planner = SlotPlanner(max_slots=2)
    planner.set([iv(scale=2.0, request_id="a"), iv(scale=3.0, request_id="b")])
    with pytest.raises(RuntimeError, match="max_slots"):
        planner.assign(planner.applies(["a", "b"], np.array([0, 1, 2]), np.array([0, 0])))


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
])
def test_validate(kw, message):
    with pytest.raises(ValueError, match=message):
        validate(iv(**kw), {"h": 2}, max_position=16, allow_positions=False)


def test_from_dict_reads_numpy_vectors():
    got = Intervention.from_dict({"hook": "h", "bias": np.arange(3, dtype=np.float32), "positions": np.array([4])})
    assert got.bias == (0.0, 1.0, 2.0) and got.positions == (4,)


def test_as_dict_round_trips_and_scopes():
    one = Intervention("h", scale=(1.0, 2.0), bias=0.5, request_id="req3", positions=(1, 2))
    assert Intervention.from_dict(one.as_dict()) == one
    assert one.applies_to("req3") and not one.applies_to("req4") and Intervention("h").applies_to("req4")
    with pytest.raises(ValueError, match="unknown intervention fields"):
        Intervention.from_dict({"hook": "h", "colour": "red"})
