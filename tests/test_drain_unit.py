"""Draining without waiting: steps whose host copies are still in flight stay, in order, for later.

The CUDA event is replaced by a stand-in whose completion the test controls; the GPU run
(tests/gpu/run_gpu_checks.py) covers the real streams through the session tests.
"""

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from inspector.core.blocks import RequestRowsView
from inspector.core.dtypes import BFLOAT16

from inspector.plugin import vllm_compat
from inspector.core.drained import DrainedRequest
from inspector.core.ranks import merge_ranks
from inspector.plugin.config import PluginConfig
from inspector.plugin.copyout import Transfer
from inspector.plugin.gather import QueuedForward, SaeStack, bulk_of, rows_by_request
from inspector.plugin.runtime import InspectorRuntime


class FlagEvent:
    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def _runtime() -> InspectorRuntime:
    config = PluginConfig({}, 64, "bfloat16", False, False, ())
    return InspectorRuntime(nn.Module(), [], config, torch.device("cpu"), 64, 128)


def _rows(runtime, wait=True) -> dict:
    """A drain's rows by request (each request's rows by hook)."""
    return {rid: drained.rows for rid, drained in runtime.drain(wait).items()}


def _queue(runtime, req_ids, counts, first_position, event, hooks=("a", "b")):
    """One forward: requests with ``counts`` rows each, hooks whose values encode the position."""
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate([np.arange(first_position, first_position + c) for c in counts])
    n = int(qsl[-1])
    values = torch.tensor(positions, dtype=torch.bfloat16).reshape(1, n, 1).expand(len(hooks), n, 4).clone()
    ids = torch.tensor(positions + 1000)
    transfer = Transfer([values, ids], event)
    runtime._in_flight._pending.append((QueuedForward(list(req_ids), qsl, positions, [list(hooks)], transfer.host), transfer))


def test_drain_without_wait_takes_only_landed_steps_in_order():
    runtime = _runtime()
    first, second, third = FlagEvent(), FlagEvent(), FlagEvent()
    _queue(runtime, ["r0", "r1"], [3, 2], 0, first)
    _queue(runtime, ["r0", "r1"], [1, 1], 3, second)
    _queue(runtime, ["r0"], [1], 4, third)
    first.done = third.done = True  # the second is still copying: the third must wait behind it

    early = _rows(runtime, wait=False)
    assert early["r0"]["a"]["positions"].tolist() == [0, 1, 2]
    assert early["r1"]["b"]["positions"].tolist() == [0, 1]
    assert runtime.drain(wait=False) == {}

    rest = _rows(runtime, wait=True)
    assert second.done
    assert rest["r0"]["a"]["positions"].tolist() == [3, 4]
    assert rest["r1"]["a"]["positions"].tolist() == [3]
    r0 = rest["r0"]["b"]
    assert r0["values"].dtype == BFLOAT16  # bfloat16 stays bfloat16 (no conversion on the host)
    assert r0["values"].astype(np.float32)[:, 0].tolist() == [3.0, 4.0]
    assert r0["token_ids"].tolist() == [1003, 1004]
    assert runtime.drain() == {}


def test_a_drain_for_finishing_requests_waits_for_their_forwards_not_the_one_computing_next():
    """Request ids: the forwards up to the last holding their rows are waited for; the next forward
    (already on the GPU while the engine schedules ahead) is taken only if it has landed."""
    runtime = _runtime()
    first, second, third = FlagEvent(), FlagEvent(), FlagEvent()
    _queue(runtime, ["done", "on"], [3, 2], 0, first)
    _queue(runtime, ["done", "on"], [1, 1], 3, second)
    _queue(runtime, ["on", "next"], [1, 4], 4, third)

    rows = _rows(runtime, wait=["done"])
    assert first.done and second.done and not third.done
    assert rows["done"]["a"]["positions"].tolist() == [0, 1, 2, 3]
    assert rows["on"]["a"]["positions"].tolist() == [0, 1, 3]
    assert "next" not in rows

    assert runtime.drain(wait=["someone else"]) == {}  # not waited for, not landed: it stays
    assert not third.done
    third.done = True
    later = _rows(runtime, wait=[])
    assert later["on"]["b"]["positions"].tolist() == [4]
    assert later["next"]["a"]["positions"].tolist() == [4, 5, 6, 7]


def test_forwards_drained_together_become_one_slice_a_request_and_hook():
    """The engine ran ahead of the drains: its forwards' rows are laid out request after request, so
    each request's rows of a hook are one view (no join per request and hook), and the requests' rows
    of a hook lie one after another (a server sends them as one frame without copying)."""
    runtime = _runtime()
    for first_position, counts in ((0, [3, 2]), (3, [1, 1]), (4, [1, 1])):
        _queue(runtime, ["r0", "r1"], counts, first_position, None)
    rows = _rows(runtime)
    assert all(len(r._spans) == 3 for r in rows.values())  # nothing copied until a request's rows are read
    assert rows["r0"]["a"]["positions"].tolist() == [0, 1, 2, 3, 4]
    assert all(len(r._spans) == 1 for r in rows.values())  # then every request's at once and rows["r1"]["b"]["positions"].tolist() == [0, 1, 3, 4]
    assert rows["r1"]["a"]["token_ids"].tolist() == [1000, 1001, 1003, 1004]
    assert rows["r1"]["b"]["values"].astype(np.float32)[:, 0].tolist() == [0.0, 1.0, 3.0, 4.0]
    a0, a1 = rows["r0"]["a"]["values"], rows["r1"]["a"]["values"]
    assert a0.base is a1.base and a1.__array_interface__["data"][0] == a0.__array_interface__["data"][0] + a0.nbytes
    _queue(runtime, ["r0"], [1], 5, None)
    _queue(runtime, ["r0"], [1], 6, None)
    unread = weakref.ref(runtime.drain()["r0"].rows)
    assert unread() is None  # a drain nobody reads is freed at once, its copies with it (no cycle)


def test_a_hook_added_between_drained_steps_covers_only_its_steps():
    runtime = _runtime()
    _queue(runtime, ["r0"], [2], 0, None, hooks=("a",))
    _queue(runtime, ["r0"], [1], 2, None, hooks=("a", "b"))  # eager mode: "b" installed after step one
    _queue(runtime, ["r0"], [1], 3, None, hooks=(None, "b"))  # and "a" removed
    rows = runtime.drain()["r0"].rows
    assert rows["a"]["positions"].tolist() == [0, 1, 2]
    assert rows["b"]["positions"].tolist() == [2, 3]
    assert rows["b"]["token_ids"].tolist() == [1002, 1003]
    assert rows["b"]["values"][:, 0].tolist() == [2.0, 3.0]


def test_queued_positions_count_forwards_not_yet_drained():
    runtime = _runtime()
    _queue(runtime, ["r0", "r1"], [3, 2], 0, None)
    _queue(runtime, ["r0"], [1], 3, None)  # r1 skipped this forward
    assert runtime.queued_positions(["r0", "r1", "r2"]) == {"r0": 4, "r1": 2}
    runtime.drain()
    assert runtime.queued_positions(["r0", "r1"]) == {}  # drained: the session knows them from the rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_drained_rows_are_each_requests_rows_in_order(dtype):
    """Forwards with requests joining, leaving and spanning chunks (some land evenly spaced, some
    not), against a plain per-request reference."""
    rng = np.random.default_rng(0)
    batches = [(["r0", "r1", "r2"], [4, 1, 2]), (["r0", "r1", "r2"], [1, 1, 1]), (["r1", "r3"], [1, 5]),
               (["r0", "r1", "r3"], [1, 1, 1]), (["r3", "r0"], [2, 1])]
    forwards, expected, next_position = [], {}, {}
    for req_ids, counts in batches:
        qsl = np.concatenate([[0], np.cumsum(counts)])
        positions = np.concatenate([np.arange(next_position.get(r, 0), next_position.get(r, 0) + c)
                                    for r, c in zip(req_ids, counts)])
        values = torch.tensor(rng.standard_normal((3, int(qsl[-1]), 8)), dtype=dtype)
        ids = torch.tensor(rng.integers(0, 100, int(qsl[-1])), dtype=torch.int32)
        forwards.append(QueuedForward(req_ids, qsl, positions, [["a", None, "b"]], [values, ids]))
        for i, (r, c) in enumerate(zip(req_ids, counts)):
            next_position[r] = next_position.get(r, 0) + c
            for hook, k in (("a", 0), ("b", 2)):
                rows = expected.setdefault(r, {}).setdefault(hook, [])
                rows += [(int(positions[j]), int(ids[j]), values[k, j].float().numpy())
                         for j in range(qsl[i], qsl[i + 1])]
    got = rows_by_request(forwards)
    assert got.keys() == expected.keys()
    for rid, hooks in expected.items():
        assert got[rid].keys() == hooks.keys()
        for hook, rows in hooks.items():
            assert got[rid][hook]["positions"].tolist() == [p for p, _, _ in rows] == list(range(len(rows)))
            assert got[rid][hook]["token_ids"].tolist() == [t for _, t, _ in rows]
            assert got[rid][hook]["values"].dtype == (BFLOAT16 if dtype == torch.bfloat16 else np.float32)
            np.testing.assert_array_equal(got[rid][hook]["values"].astype(np.float32),
                                          np.stack([v for _, _, v in rows]))


def test_a_requests_rows_are_read_set_and_deleted_like_a_dict_and_pickle_with_their_stacks_once():
    """What the session (rows read), tensor-parallel merging (another rank's rows set) and vLLM's worker
    processes (pickling) do with a drained request's rows."""
    import pickle

    values = torch.arange(2 * 6 * 512, dtype=torch.float32).reshape(2, 6, 512)
    forward = QueuedForward(["r0", "r1"], np.array([0, 2, 6]), np.array([3, 4, 0, 1, 2, 3]), [["a", "b"]],
                            [values, torch.arange(6)])
    got = rows_by_request([forward])
    r1 = got["r1"]
    assert list(r1) == ["a", "b"] and len(r1) == 2 and "a" in r1 and "z" not in r1 and r1.get("z") is None
    np.testing.assert_array_equal(r1["b"]["values"], values[1, 2:].numpy())
    assert r1["a"]["positions"].tolist() == [0, 1, 2, 3] and r1["a"]["token_ids"].tolist() == [2, 3, 4, 5]
    r1["c"] = {"positions": np.array([3])}
    r1["a"] = {**r1["a"], "values": np.zeros((4, 512))}
    assert [hook for hook, _ in r1.items()] == list(r1) == ["a", "b", "c"] and len(r1) == 3
    assert not r1["a"]["values"].any() and dict(r1.items())["a"] is r1["a"]
    del r1["b"]
    assert list(r1) == ["a", "c"] and "b" not in r1 and not r1["a"]["values"].any()
    assert list(got["r0"]) == ["a", "b"]  # the stacks' index is shared: deleting from one request leaves the others
    wire = pickle.dumps(got)
    assert len(wire) < values.numpy().nbytes + np.zeros((4, 512)).nbytes + 2048  # the stack once, not per request
    back = pickle.loads(wire)
    np.testing.assert_array_equal(back["r0"]["b"]["values"], values[1, :2].numpy())
    assert back["r1"]["c"]["positions"].tolist() == [3]


def test_a_drain_in_request_order_is_one_block_a_forward_of_views_and_others_are_not_bulk():
    """``bulk_of``: each forward drained whose requests' rows lie one after another is one array per
    hook, views of its landed copy (several forwards are not joined); scores and features stay beside
    them; a request whose rows are not in them (a capture window's, ranks merged by hook) makes the
    drain per request."""
    values = torch.arange(2 * 6 * 8, dtype=torch.float32).reshape(2, 6, 8)
    forward = QueuedForward(["r0", "r1"], np.array([0, 2, 6]), np.array([3, 4, 0, 1, 2, 3]), [["a", "b"]],
                            [values, torch.arange(6)])
    got = rows_by_request([forward])
    drained = {rid: DrainedRequest(rows, {}, None) for rid, rows in got.items()}
    drained["r1"] = drained["r1"]._replace(scores=(np.array([3]), np.ones((1, 2))))
    (blocks,) = bulk_of(drained)
    assert blocks.request_ids == ("r0", "r1") and blocks.bounds.tolist() == [0, 2, 6]
    assert blocks.positions.tolist() == [3, 4, 0, 1, 2, 3] and blocks.token_ids.tolist() == list(range(6))
    assert list(blocks.values) == ["a", "b"] and np.shares_memory(blocks.values["b"], values.numpy())
    for rid in ("r0", "r1"):
        for hook in ("a", "b"):
            view = RequestRowsView((blocks,), rid)[hook]
            for k, key in enumerate(("positions", "token_ids", "values")):
                np.testing.assert_array_equal(view[k], got[rid][hook][key])
    later = forward._replace(positions=np.array([5, 6, 4, 5, 6, 7]), host=[values + 1000, torch.arange(6)])
    # several forwards: a block each, not joined
    first, second = bulk_of({rid: DrainedRequest(rows, {}, None)
                             for rid, rows in rows_by_request([forward, later]).items()})
    assert first.positions.tolist() == [3, 4, 0, 1, 2, 3] and second.positions.tolist() == [5, 6, 4, 5, 6, 7]
    assert np.shares_memory(second.values["a"], later.host[0].numpy())
    drained["r2"] = DrainedRequest({"a": {"positions": np.array([0]), "token_ids": np.array([1]),
                                          "values": np.zeros((1, 8))}}, {}, None)
    assert bulk_of(drained) is None
    got["r1"]["a"] = drained.pop("r2").rows["a"]  # another rank's rows set by hook
    assert bulk_of(drained) is None


def test_a_drain_gives_each_request_its_rows_features_and_scores_apart():
    """An SAE's features ride in a forward's copy as a stack of their own and leave the drain beside the
    rows, across forwards; a request that wants no rows keeps its features and scores; a scored request
    with nothing else drained still comes."""
    runtime = _runtime()
    runtime.set_request_options({"r1": {"capture": False}}, [])
    for qsl, positions in ((np.array([0, 2, 3]), np.array([0, 1, 0])), (np.array([0, 1, 2]), np.array([2, 1]))):
        n = len(positions)
        rows = torch.tensor(positions, dtype=torch.float32).reshape(1, n, 1).expand(1, n, 4).clone()
        features = torch.stack([torch.tensor(positions, dtype=torch.float32)[:, None] + torch.zeros(n, 2),
                                torch.tensor(positions + 10, dtype=torch.float32)[:, None] + torch.zeros(n, 2)])
        transfer = Transfer([rows, features, torch.tensor(positions + 1000)], None)
        runtime._in_flight._pending.append((QueuedForward(["r0", "r1"], qsl, positions, [["a"], SaeStack("sae")],
                                                          transfer.host), transfer))
    runtime._scores._found = {"r1": [(2, np.ones(3))], "r2": [(7, np.zeros(3)), (8, np.ones(3))]}
    drained = runtime.drain()
    assert list(drained) == ["r0", "r1", "r2"]
    r0, r1, r2 = drained.values()
    assert list(r0.rows) == ["a"] and r0.rows["a"]["positions"].tolist() == [0, 1, 2] and r0.scores is None
    positions, ids, activations = r0.features["sae"]
    assert positions.tolist() == [0, 1, 2] and ids.dtype == np.int32 and ids[:, 0].tolist() == [10, 11, 12]
    assert activations[:, 1].tolist() == [0.0, 1.0, 2.0] and activations.dtype == np.float32
    assert not r1.rows and r1.features["sae"][0].tolist() == [0, 1] and r1.scores[0].tolist() == [2]
    assert not r2.rows and not r2.features and r2.scores[0].tolist() == [7, 8] and r2.scores[1].shape == (2, 3)


def test_ranks_merge_into_one_drained_request():
    """A sharded hook's columns side by side; each other hook, SAE and score from the one rank that sends
    it; the same one from two ranks is an error."""
    def rows(first, width, value):
        return {"positions": np.arange(first, first + 2), "token_ids": np.zeros(2),
                "values": np.full((2, width), value)}

    features = (np.arange(2), np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32))
    scores = (np.arange(2), np.zeros((2, 3)))
    first = {"r0": DrainedRequest({"mlp": rows(0, 2, 1.0), "b0": rows(0, 4, 5.0)}, {"sae": features}, None)}
    second = {"r0": DrainedRequest({"mlp": rows(0, 3, 2.0), "b1": rows(0, 4, 6.0)}, {}, scores),
              "r1": DrainedRequest({}, {}, scores)}
    merged = merge_ranks([first, second], {"mlp"})
    r0 = merged["r0"]
    assert r0.rows["mlp"]["values"].tolist() == [[1.0, 1.0, 2.0, 2.0, 2.0]] * 2 and list(r0.rows) == ["mlp", "b0", "b1"]
    assert r0.features == {"sae": features} and r0.scores is scores and merged["r1"].scores is scores
    with pytest.raises(RuntimeError, match="scores"):
        merge_ranks([{"r0": DrainedRequest({}, {}, scores)}, {"r0": DrainedRequest({}, {}, scores)}], set())
    with pytest.raises(RuntimeError, match="SAE sae"):
        merge_ranks([{"r0": DrainedRequest({}, {"sae": features}, None)},
                     {"r0": DrainedRequest({}, {"sae": features}, None)}], set())
    with pytest.raises(RuntimeError, match="different rows"):
        merge_ranks([{"r0": DrainedRequest({"b0": rows(0, 4, 5.0)}, {}, None)},
                     {"r0": DrainedRequest({"b0": rows(0, 4, 5.0)}, {}, None)}], set())


@pytest.mark.parametrize("windows", [
    {"r0": {"a": "generated", "c": "every:2"}, "r1": {"a": "last:2", "b": "last:2"}},
    {"r0": dict.fromkeys("abc", "generated"), "r1": dict.fromkeys("abc", "every:2")},
], ids=["hook by hook", "one window a request"])
def test_windowed_steps_keep_each_hooks_promised_rows_in_order(windows):
    """Hooks of two widths, requests with and without windows, and steps whose hooks group differently
    (so the sub-forwards of one drain alternate), or where each request has one window for all hooks
    (kept rows in one range, sent as a slice, or scattered, gathered): every hook gets exactly the rows
    its window keeps."""
    from inspector.core.windows import CaptureWindow
    from inspector.plugin.runtime import RowStack
    from inspector.plugin.vllm_compat import StepInfo

    runtime = _runtime()
    runtime._stacks = [RowStack(torch.zeros(2, 64, 3), ["a", "b"]), RowStack(torch.zeros(1, 64, 5), ["c"])]
    runtime._index_slots()
    prompts = {"r0": 5, "r1": 3, "r2": 4}
    runtime.set_request_options({rid: {"windows": w, "prompt_tokens": prompts[rid]} for rid, w in windows.items()}
                                | {"r3": {"capture": False}}, [])
    done = dict.fromkeys(prompts, 0) | {"r3": 0}
    for counts in ({"r0": 3, "r1": 3, "r2": 2, "r3": 1}, {"r0": 2, "r2": 2, "r3": 1}, {"r0": 1, "r1": 1, "r2": 1},
                   {"r0": 1, "r1": 1, "r2": 1, "r3": 1}):
        positions = np.concatenate([np.arange(done[rid], done[rid] + c) for rid, c in counts.items()])
        for rid, c in counts.items():
            done[rid] += c
        n = len(positions)
        owner = np.concatenate([[int(rid[1])] * c for rid, c in counts.items()])
        for stack in runtime._stacks:  # a row's value: its hook, request and position
            for h in range(stack.tensor.shape[0]):
                stack.tensor[h, :n] = torch.tensor(h * 1000 + owner * 100 + positions, dtype=torch.float32)[:, None]
        step = StepInfo(list(counts), np.concatenate([[0], np.cumsum(list(counts.values()))]), positions)
        runtime.after_forward(step, torch.tensor(positions + 7))
    rows = _rows(runtime)
    assert "r3" not in rows
    for rid in ("r0", "r1", "r2"):
        for h, hook in enumerate("abc"):
            window = CaptureWindow.parse(windows.get(rid, {}).get(hook, "all"))
            everything = np.arange(done[rid])
            expected = everything[window.keeps(everything, prompts[rid])]
            got = rows[rid][hook]
            assert got["positions"].tolist() == expected.tolist(), (rid, hook)
            assert got["token_ids"].tolist() == (expected + 7).tolist()
            number = (h if hook != "c" else 0) * 1000 + int(rid[1]) * 100
            np.testing.assert_array_equal(got["values"], np.repeat(number + expected[:, None], got["values"].shape[1], 1))


class V2Runner:
    """vLLM's V2 model runner's call surface, logging the order of what happens in a step."""

    def __init__(self, log: list):
        self.log = log

    def prepare_inputs(self, rows: int):
        self.log.append("prepare")
        return SimpleNamespace(req_ids=["r0-abcdefgh"], num_reqs=1, query_start_loc_np=np.array([0, rows]),
                               num_computed_tokens_np=np.array([0]), input_ids=torch.arange(rows))

    def execute_model(self, output):
        self.log.append("forward")
        return output

    def sample_tokens(self):
        self.log.append("sample")
        return "sampled"


def test_v2_runner_queues_the_rows_copy_after_the_sampled_tokens_copy():
    log = []
    runner = V2Runner(log)
    vllm_compat.wrap_model_forward(SimpleNamespace(model_runner=runner), lambda step: log.append("before"),
                                   lambda step, ids: log.append(("after", step.req_ids, len(ids))))
    runner.prepare_inputs(5)
    assert runner.execute_model(None) is None  # sampling follows: the rows wait for it
    assert runner.sample_tokens() == "sampled"
    assert log == ["prepare", "before", "forward", "sample", ("after", ["r0"], 5)]

    log.clear()
    runner.prepare_inputs(1)
    assert runner.execute_model("output") == "output"  # an output now: no sampling step follows
    assert log == ["prepare", "before", "forward", ("after", ["r0"], 1)]

    log.clear()
    runner.prepare_inputs(2)
    runner.execute_model(None)  # its sampling never comes (it failed): the next step sends the rows first
    runner.prepare_inputs(3)
    assert log == ["prepare", "before", "forward", ("after", ["r0"], 2), "prepare", "before"]


def test_two_pipeline_stages_describe_one_model():
    """Each stage's points in the model's order, once (tensor-parallel ranks of a stage repeat them);
    a kind is refused only where no stage offers it; each stage's modules (its placeholders left out by
    the stage), in the model's order."""
    from inspector.core.ranks import merge_descriptions

    def stage(points, installed, refused, modules, seconds):
        return {"mode": "compiled", "hook_points": [{"name": n, "kind": k} for n, k in points], "installed": installed,
                "refused": refused, "modules": modules, "probe_seconds": seconds}

    first = stage([("embed", "embed"), ("b0.resid_post", "resid_post")], {"b0.resid_post": "b0.resid_post"},
                  {"normalized": "the final norm is another stage's", "router": "no experts"},
                  [("layers.0", "Block")], 1.5)
    last = stage([("b1.resid_post", "resid_post"), ("norm.normalized", "normalized")],
                 {"b1.resid_post": "b1.resid_post"}, {"router": "no experts"},
                 [("layers.1", "Block"), ("norm", "RMSNorm")], 2.0)
    merged = merge_descriptions([first, first, last, last])  # TP=2 × PP=2
    assert [p["name"] for p in merged["hook_points"]] == ["embed", "b0.resid_post", "b1.resid_post", "norm.normalized"]
    assert list(merged["installed"]) == ["b0.resid_post", "b1.resid_post"]
    assert merged["refused"] == {"router": "no experts"} and merged["probe_seconds"] == 2.0
    assert merged["modules"] == [("layers.0", "Block"), ("layers.1", "Block"), ("norm", "RMSNorm")]
