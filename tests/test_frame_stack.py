"""The forward's fresh frame-stack chunk: whatever the caller's depth, a loop of small calls under it
never lands across a chunk's end (where CPython before gh-142183's fix maps and unmaps memory on
every call). Counted in minor page faults of this thread, which a crossing call takes one of each."""

import resource
import sys

import pytest

from inspector.core.frame_stack import call_in_fresh_stack_chunk, with_reserved_slots

CALLS = 2_000
CHUNK_SLOTS = 16 * 1024 // 8  # a standard chunk's slots


def leaf():
    return None


def loop(calls: int) -> None:
    for _ in range(calls):
        leaf()


def call(fn, *args):
    return fn(*args)


def most_faults(run, depths=range(0, CHUNK_SLOTS + 64, 2)) -> int:
    """The most minor page faults ``run(caller)`` took, over callers of these depths (by default every
    depth a chunk spans)."""
    worst = 0
    for slots in depths:
        caller = with_reserved_slots(call, slots)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        run(caller)
        worst = max(worst, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return worst


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="CPython 3.13 and 3.14 releases keep a freed chunk (gh-142183)")
def test_without_it_some_caller_depth_makes_every_call_map_memory():
    assert most_faults(lambda caller: caller(loop, CALLS)) >= CALLS


def test_under_it_no_caller_depth_does():
    assert most_faults(lambda caller: caller(call_in_fresh_stack_chunk, loop, CALLS)) < CALLS // 20


def test_its_callee_has_room_for_a_forward_of_a_hundred_and_fifty_layers():
    """vLLM's forward of 32 layers with 32 hooks took about 1,540 slots, some 40 more a layer."""
    assert most_faults(lambda caller: call_in_fresh_stack_chunk(caller, loop, CALLS), range(0, 8_000, 2)) < CALLS // 20


def test_it_passes_arguments_and_the_result_through():
    assert call_in_fresh_stack_chunk(lambda a, fn=None: (a, fn), 1, fn=2) == (1, 2)
