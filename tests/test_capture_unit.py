"""The shared value vocabulary (``inspector.core``): positions, vectors, model names, growing arrays,
and folding step events into a run."""

import threading

import numpy as np
import pytest

from inspector.core.arrays import GrowableArray
from inspector.core.blocks import RequestRowsView, RowBlocks
from inspector.core.models import ModelNotFound, model_path_problem, resolve_model
from inspector.core.positions import format_positions, parse_positions
from inspector.core.protocol import RequestStart, RequestStep, StepEvent, fold_event
from inspector.core.resources import demo_model_path
from inspector.core.run import HookRows, Run, TopToken
from inspector.core.vectors import check_vector, load_vector


@pytest.mark.parametrize("text, positions", [
    ("3-7, 10", (3, 4, 5, 6, 7, 10)),  # the app's way
    ("3-5;8", (3, 4, 5, 8)),  # the command line's way (commas separate --intervene keys)
    ("12 3..4 0:1", (0, 1, 3, 4, 12)),
    ("5,5,5", (5,)),
])
def test_one_position_syntax_for_app_and_cli(text, positions):
    assert parse_positions(text) == positions
    assert parse_positions(format_positions(positions)) == positions


def test_positions_format_collapses_runs():
    assert format_positions([10, 3, 4, 5, 7]) == "3-5, 7, 10"


@pytest.mark.parametrize("text, message", [
    ("", "no positions"), ("3-x", "not a position"), ("7-3", "runs backwards"), ("-1", "not a position"),
    ("0-2000000", "too long"),
])
def test_bad_positions_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_positions(text)


def test_vectors_are_checked_the_same_everywhere(tmp_path):
    np.save(tmp_path / "v.npy", np.arange(4, dtype=np.float32).reshape(1, 4))
    assert load_vector(tmp_path / "v.npy", width=4).tolist() == [0.0, 1.0, 2.0, 3.0]
    np.savez(tmp_path / "one.npz", v=np.ones(4))
    assert load_vector(tmp_path / "one.npz", width=4).tolist() == [1.0] * 4
    np.savez(tmp_path / "two.npz", a=np.ones(4), b=np.ones(4))
    np.save(tmp_path / "m.npy", np.zeros((2, 3)))
    np.save(tmp_path / "n.npy", np.array([1.0, np.nan]))
    (tmp_path / "t.npy").write_text("not numpy")
    for name, width, message in (("v.npy", 8, "has 4 values but the hook point is 8 wide"),
                                 ("two.npz", None, "holds 2 arrays"), ("m.npy", None, "1-D vector"),
                                 ("n.npy", None, r"1 NaN/Inf value\(s\) \(first at index 1\)"),
                                 ("t.npy", None, "cannot read a vector")):
        with pytest.raises(ValueError, match=message):
            load_vector(tmp_path / name, width=width)
    with pytest.raises(ValueError, match="must hold numbers"):
        check_vector(np.array(["a", "b"]), None)


def test_model_names(tmp_path):
    assert model_path_problem("demo") is None and resolve_model("demo") == demo_model_path()
    assert model_path_problem("org/name") is None  # maybe in the hub cache: resolve_model says
    assert "no model directory" in model_path_problem(str(tmp_path / "missing"))
    (tmp_path / "f.txt").write_text("x")
    assert "is a file" in model_path_problem(str(tmp_path / "f.txt"))
    assert "no config.json" in model_path_problem(str(tmp_path))
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_growable_array_views_stay_valid_and_snapshots_stay_frozen():
    a = GrowableArray(np.float32, (2,), capacity=2)
    a.append(np.ones((2, 2)))
    early, frozen = a.view(), a.snapshot()
    for k in range(50):
        a.append(np.full((1, 2), k))
    assert len(a) == 52 and early.tolist() == [[1, 1], [1, 1]] and len(frozen) == 2
    frozen.append(np.zeros((1, 2)))  # a snapshot grows on its own, never into the original
    assert a.view()[2].tolist() == [0, 0] and a.view()[3].tolist() == [1, 1]
    capped = GrowableArray(np.int64, max_capacity=4)
    capped.append(np.arange(3))
    capped.append(np.arange(1))
    assert capped.view().tolist() == [0, 1, 2, 0]


def test_fold_event_rebuilds_a_run_from_events_alone():
    run = Run(metadata={})
    start = RequestStart("req0", "ab", (1, 2), ("a", "b"), {"max_tokens": 2})
    rows = (np.array([0, 1]), np.array([1, 2]), np.ones((2, 3), np.float32))
    top = (TopToken(7, -0.1, "c"), TopToken(8, -2.0, "d"))
    first = StepEvent(0, (RequestStep("req0", (7,), ("c",), (-0.1,), (top,), {"h": rows},
                                      ((0, ()),)),), (start,))
    last = StepEvent(1, (RequestStep("req0", (9,), ("e",), (-0.5,), (top,), {"h": (np.array([2]), np.array([7]),
                                                                                     np.zeros((1, 3), np.float32))},
                                      ((2, ({"hook": "h"},)),), True, "length"),))
    assert fold_event(run, first) == {"req0"} and fold_event(run, last) == {"req0"}
    req = run.requests["req0"]
    assert req.token_ids == [1, 2, 7, 9] and req.token_texts == ["a", "b", "c", "e"]
    assert req.intervention_log == [(0, []), (2, [{"hook": "h"}])] and req.finish_reason == "length"
    assert req.top_logprobs[0][0].text == "c" and req.hooks["h"].positions.tolist() == [0, 1, 2]
    bare = Run(metadata={})
    fold_event(bare, first, keep_rows=False)
    assert bare.requests["req0"].hooks == {}


def test_rows_an_event_owns_are_kept_as_they_came_and_joined_in_order_when_read():
    """A step of many requests and hooks adds its rows without copying them (``StepEvent.owns_rows``);
    reads see every row in order, whichever way each piece was added."""
    run, width = Run(metadata={}), 4
    start = RequestStart("r", "p", (1, 2), ("a", "b"), {"max_tokens": 8})
    stack = np.arange(3 * width, dtype=np.float32).reshape(3, width)  # a forward's rows, shared by requests
    prompt = (np.arange(2), np.array([1, 2]), stack[:2])
    fold_event(run, StepEvent(0, (RequestStep("r", rows={"h": prompt}),), (start,), owns_rows=True))
    rows = run.requests["r"].hooks["h"]
    assert len(rows) == 2 and np.shares_memory(rows._kept[0][2], stack)  # not copied yet
    fold_event(run, StepEvent(1, (RequestStep("r", rows={"h": (np.array([2]), np.array([5]), stack[2:])}),),
                              owns_rows=True))
    assert len(rows) == 3 and rows.values.tolist() == stack.tolist() and not rows._kept  # joined on reading
    mine = np.full((1, width), -1.0, np.float32)
    rows.keep(np.array([3]), np.array([6]), np.full((1, width), 9.0, np.float32))
    rows.append(np.array([4]), np.array([7]), mine)  # copied, after the kept row
    mine[:] = 0  # the caller writes its array again: the copy is unchanged
    frozen = rows.snapshot()
    rows.keep(np.array([5]), np.array([8]), np.full((1, width), 10.0, np.float32))
    assert rows.positions.tolist() == list(range(6)) and rows.token_ids.tolist() == [1, 2, 5, 6, 7, 8]
    assert rows.values[3:, 0].tolist() == [9.0, -1.0, 10.0] and len(frozen) == 5 and frozen.values[-1, 0] == -1.0
    with pytest.raises(ValueError, match="do not fit a hook of width 4"):
        rows.keep(np.arange(2), np.arange(2), np.ones((2, 3)))


def _bulk_step(step: int, lengths: dict[str, int], hooks: list[str], width: int = 3) -> RowBlocks:
    """A step's rows in bulk whose every value says (hook, request, row): hook * 1000 + request * 100 + row."""
    bounds = np.concatenate([[0], np.cumsum(list(lengths.values()))])
    owner = np.repeat([int(rid[1:]) for rid in lengths], list(lengths.values()))
    row = np.concatenate([np.arange(n) + step * 10 for n in lengths.values()])
    values = {h: np.repeat((k * 1000 + owner * 100 + row).astype(np.float32)[:, None], width, axis=1)
              for k, h in enumerate(hooks)}
    return RowBlocks(list(lengths), bounds, row.astype(np.int64), owner.astype(np.int64), values)


def test_a_step_in_bulk_is_kept_as_it_came_and_each_request_reads_its_own_rows_in_order():
    """``StepEvent.blocks``: a run keeps a bulk step whole (no per-(request, hook) work), each request's
    ``HookRows`` takes its rows out when read, in order with rows added one request at a time, and the
    run lets a step go once every (request, hook) has taken its rows."""
    run, hooks = Run(metadata={}), ["a", "b"]
    starts = tuple(RequestStart(f"r{k}", "p", (1,), ("x",), {"max_tokens": 4}) for k in range(3))
    steps = [_bulk_step(0, {"r0": 2, "r1": 3}, hooks), _bulk_step(1, {"r0": 1, "r1": 1, "r2": 2}, hooks),
             _bulk_step(2, {"r1": 1, "r2": 1}, hooks)]
    for number, blocks in enumerate(steps):
        event = StepEvent(number, tuple(RequestStep(rid, rows=RequestRowsView((blocks,), rid))
                                        for rid in blocks.request_ids),
                          starts if number == 0 else (), owns_rows=True, blocks=(blocks,))
        fold_event(run, event)
    assert run.bulk.steps[0] is steps[0] and run.requests["r0"].hooks["a"]._kept == []  # nothing taken yet
    fold_event(run, StepEvent(3, (RequestStep("r2", rows={"a": (np.array([99]), np.array([2]),
                                                                 np.full((1, 3), -1.0, np.float32))}),),
                              owns_rows=True))  # one request's rows the old way, after the bulk steps
    expected = {"r0": [0, 1, 10], "r1": [0, 1, 2, 10, 20], "r2": [10, 11, 20]}
    for rid, rows in expected.items():
        for k, hook in enumerate(hooks):
            got = run.requests[rid].hooks[hook]
            tail = [99] if (rid, hook) == ("r2", "a") else []
            assert len(got) == len(rows) + len(tail) and got.positions.tolist() == rows + tail
            want = [k * 1000 + int(rid[1:]) * 100 + r for r in rows] + ([-1] if tail else [])
            assert got.values[:, 0].tolist() == want and got.token_ids[:len(rows)].tolist() == [int(rid[1:])] * len(rows)
    assert run.bulk.steps == [None, None, None]  # all taken: the run holds no step's arrays any more
    not_owned = Run(metadata={})
    blocks = _bulk_step(0, {"r0": 2}, hooks)
    fold_event(not_owned, StepEvent(0, (RequestStep("r0", rows=RequestRowsView((blocks,), "r0")),), starts[:1],
                                    blocks=(blocks,)))
    blocks.values["a"][:] = 7  # the engine writes its arrays again: what the run kept is a copy
    assert not_owned.requests["r0"].hooks["a"].values[:, 0].tolist() == [0, 1]


def test_bulk_blocks_select_requests_and_hooks_under_new_names_and_refuse_bad_shapes():
    blocks = _bulk_step(0, {"r0": 2, "r1": 1, "r2": 3}, ["a", "b"])
    side_by_side = blocks.selected({"r1": "x", "r2": "y"}, {"b"})
    assert side_by_side.request_ids == ("x", "y") and list(side_by_side.values) == ["b"]
    assert np.shares_memory(side_by_side.values["b"], blocks.values["b"]) and side_by_side.bounds.tolist() == [0, 1, 4]
    apart = blocks.selected({"r2": "z", "r0": "w"})  # in the step's order, gathered
    assert apart.request_ids == ("w", "z") and apart.values["a"][:, 0].tolist() == [0, 1, 200, 201, 202]
    assert blocks.selected({"r9": "q"}) is None and RequestRowsView((blocks,), "r1")["b"][2][:, 0].tolist() == [1100]
    later = _bulk_step(1, {"r1": 2}, ["b"])  # a step that drained two forwards: a request's rows are joined
    both = RequestRowsView((blocks, later), "r1")
    assert list(both) == ["a", "b"] and both["b"][0].tolist() == [0, 10, 11] and both["a"][0].tolist() == [0]
    empty_between = RowBlocks(["r0", "r1", "r2"], [0, 2, 2, 3], np.array([4, 5, 9]), np.arange(3), {})
    assert empty_between.positions_reached() == {"r0": 6, "r2": 10}  # a request without rows reaches nothing
    assert empty_between.holds("r1") and not empty_between.holds("r9")
    with pytest.raises(ValueError, match="ascending bounds"):
        RowBlocks(["r0"], [0, 2, 3], np.arange(3), np.arange(3), {})
    with pytest.raises(ValueError, match="3 rows need"):
        RowBlocks(["r0"], [0, 3], np.arange(3), np.arange(3), {"a": np.zeros((2, 4))})


def test_a_step_in_pieces_ends_each_piece_where_a_request_ends_if_one_does_within_it():
    """What crosses to a capture file's writer in pieces: a request's rows are split only where they
    cannot fit in one piece, so that its whole chunks are written from where they lie."""
    blocks = _bulk_step(0, {"r0": 3, "r1": 2, "r2": 10, "r3": 1}, ["h"])
    pieces = blocks.pieces(6)
    assert [(p.request_ids, p.bounds.tolist()) for p in pieces] == [
        (("r0", "r1"), [0, 3, 5]), (("r2",), [0, 6]), (("r2", "r3"), [0, 4, 5])]
    for column in ("positions", "token_ids"):
        assert np.concatenate([getattr(p, column) for p in pieces]).tolist() == getattr(blocks, column).tolist()
    assert np.array_equal(np.concatenate([p.values["h"] for p in pieces]), blocks.values["h"])
    assert blocks.pieces(16) == [blocks] and all(np.shares_memory(p.values["h"], blocks.values["h"]) for p in pieces)


def test_kept_rows_read_from_another_thread_while_rows_are_added_arrive_whole_and_in_order():
    rows, width, n = HookRows(2, expected_rows=8), 2, 20000
    seen, wrong, done = [], [], threading.Event()

    def read():
        while not done.is_set():
            got = rows.positions[:len(rows.values)]
            seen.append(len(got))
            if got.tolist() != list(range(len(got))):
                wrong.append(got)

    reader = threading.Thread(target=read)
    reader.start()
    for k in range(n):
        rows.keep(np.array([k]), np.array([k]), np.full((1, width), k, np.float32))
    done.set()
    reader.join()
    assert not wrong and len(set(seen)) > 1  # the reader saw the rows grow, always whole and in order
    assert rows.positions.tolist() == list(range(n)) and rows.values[:, 1].tolist() == list(range(n))


def test_hook_rows_refuse_rows_that_do_not_fit():
    rows = HookRows(3)
    with pytest.raises(ValueError, match="do not fit a hook of width 3"):
        rows.append(np.arange(2), np.arange(2), np.ones((2, 4)))


def test_a_requests_rows_are_copied_once_into_room_made_for_its_prompt_and_token_budget():
    """Regrowing per-request arrays copied every row again and again (batch 32 of an 8B model: 16 MiB
    a step); the room for the prompt and ``max_tokens`` is made when the first rows arrive."""
    run, width = Run(metadata={}), 8
    start = RequestStart("r", "p", (1, 2, 3), ("a", "b", "c"), {"max_tokens": 40})
    prompt_rows = (np.arange(3), np.array([1, 2, 3]), np.ones((3, width), np.float32))
    fold_event(run, StepEvent(0, (RequestStep("r", rows={"h": prompt_rows}),), (start,)))
    first_buffer = run.requests["r"].hooks["h"].values.base
    for position in range(3, 43):
        row = (np.array([position]), np.array([7]), np.full((1, width), position, np.float32))
        fold_event(run, StepEvent(position, (RequestStep("r", rows={"h": row}),)))
    rows = run.requests["r"].hooks["h"]
    assert rows.values.base is first_buffer and len(rows) == 43
    assert rows.values[-1].tolist() == [42.0] * width and rows.positions.tolist() == list(range(43))
