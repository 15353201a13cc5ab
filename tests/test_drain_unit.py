"""Draining without waiting: steps whose host copies are still in flight stay, in order, for later.

The CUDA events are replaced by stand-ins whose completion the test controls, converted by the real
converter thread; the GPU run (tests/gpu/run_gpu_checks.py) covers the real streams through the
plugin and session tests.
"""

import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from inspector.plugin.config import PluginConfig
from inspector.plugin.copyout import Converter, Transfer
from inspector.plugin.runtime import InspectorRuntime, StepInfo


class FlagEvent:
    """Stands in for a CUDA event: the copies "land" when the test says so."""

    def __init__(self):
        self.landed = threading.Event()

    def synchronize(self) -> None:
        self.landed.wait()


def _runtime() -> InspectorRuntime:
    config = PluginConfig({}, 64, "bfloat16", False, False, ())
    return InspectorRuntime(nn.Module(), [], config, torch.device("cpu"), 64, 128)


def _queue(runtime, converter, req_ids, counts, first_position, event):
    """One forward: requests with ``counts`` rows each, two hooks whose values encode the position."""
    qsl = np.concatenate([[0], np.cumsum(counts)])
    positions = np.concatenate([np.arange(first_position, first_position + c) for c in counts])
    n = int(qsl[-1])
    values = torch.tensor(positions, dtype=torch.bfloat16).reshape(1, n, 1).expand(2, n, 4).clone()
    ids = torch.tensor(positions + 1000)
    step = StepInfo(list(req_ids), qsl, positions)
    transfer = Transfer([values, ids], event)
    runtime._pending.append((step, [["a", "b"]], transfer))
    converter.submit(transfer)
    return transfer


def test_drain_without_wait_takes_only_converted_steps_in_order():
    runtime, converter = _runtime(), Converter()
    first, second, third = FlagEvent(), FlagEvent(), FlagEvent()
    queued = [_queue(runtime, converter, ["r0", "r1"], [3, 2], 0, first),
              _queue(runtime, converter, ["r0", "r1"], [1, 1], 3, second),
              _queue(runtime, converter, ["r0"], [1], 4, third)]
    first.landed.set()
    third.landed.set()  # the second is still copying: the third waits behind it
    deadline = time.monotonic() + 10
    while not queued[0].ready() and time.monotonic() < deadline:
        time.sleep(0.01)

    early = runtime.drain(wait=False)
    assert early["r0"]["a"]["positions"].tolist() == [0, 1, 2]
    assert early["r1"]["b"]["positions"].tolist() == [0, 1]
    assert not queued[2].ready()
    assert runtime.drain(wait=False) == {}

    second.landed.set()
    rest = runtime.drain(wait=True)
    assert rest["r0"]["a"]["positions"].tolist() == [3, 4]
    assert rest["r1"]["a"]["positions"].tolist() == [3]
    r0 = rest["r0"]["b"]
    assert r0["values"].dtype == np.float32  # bfloat16 arrives as float32
    assert r0["values"][:, 0].tolist() == [3.0, 4.0]
    assert r0["token_ids"].tolist() == [1003, 1004]
    assert runtime.drain() == {}


def test_a_failed_copy_is_reported_when_its_rows_are_drained():
    class FailingEvent:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    runtime, converter = _runtime(), Converter()
    _queue(runtime, converter, ["r0"], [2], 0, FailingEvent())
    with pytest.raises(RuntimeError, match="copying captured rows to the host failed: CUDA error"):
        runtime.drain(wait=True)
