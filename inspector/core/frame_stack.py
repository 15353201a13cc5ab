"""Run a call at the start of a fresh, roomy chunk of CPython's frame stack.

CPython keeps Python frames in a stack of 16 KiB chunks and, before the fix of gh-142183 (merged for
3.13 and 3.14 in 2026; 3.11 and 3.12 keep the old way), frees a chunk as soon as the first frame in it
returns. A loop whose calls land just past a chunk's end then maps, faults in and unmaps memory on
every call (about 7 µs each) and loses the interpreter's specialised calls. Where that end falls
depends only on how deep the caller is: vLLM's forward, whose 32 CUDA-graph replays each make a few
small calls, launched 1.3–2× slower in an engine whose compiled forward the hooks' locals made a few
hundred slots deeper. Calling through a frame too large for what
any 16 KiB chunk has left always opens a new chunk, sized to hold that frame plus spare room, so the
callee's frames start at the same place, far from the end, however deep the caller is.
"""

from __future__ import annotations

import functools
import types
from typing import Callable, TypeVar

T = TypeVar("T")

# Slots (8 bytes each) this frame reserves and never touches: more than a 16 KiB chunk holds (2,048),
# so that it never fits in the space a chunk has left. CPython sizes the new chunk to the frame plus
# 1,000 slots, doubled up from 16 KiB: 128 KiB, which leaves the callee about 9,100 slots. vLLM's
# forward of a 32-layer model with 32 hooks took about 1,540 below it, growing some 40 a layer.
RESERVED_SLOTS = 7_200


def with_reserved_slots(fn: Callable, slots: int) -> Callable:
    """A copy of ``fn`` whose frame reserves ``slots`` more slots of the frame stack, never touched."""
    code = fn.__code__.replace(co_stacksize=fn.__code__.co_stacksize + slots)
    return functools.update_wrapper(types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                                                       fn.__closure__), fn)


def call_in_fresh_stack_chunk(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames at the start of a new frame-stack chunk. Costs one chunk's
    allocation a call (a few µs on CPython before the fix, none after): for once-a-step calls."""
    return fn(*args, **kwargs)


call_in_fresh_stack_chunk = with_reserved_slots(call_in_fresh_stack_chunk, RESERVED_SLOTS)


def run_methods_in_fresh_stack_chunks(owner, names: tuple[str, ...]) -> None:
    """Each of ``owner``'s methods ``names`` (those it has) called in a fresh chunk from now on."""
    for name in names:
        if hasattr(owner, name):
            setattr(owner, name, _in_fresh_stack_chunk(getattr(owner, name)))


def _in_fresh_stack_chunk(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        return call_in_fresh_stack_chunk(original, *args, **kwargs)

    return call
