"""The pinned slabs rows land in (plugin/host_slabs.py): carved per forward, pinned ahead by a helper
thread, carved again only once nothing made from them is left. The driver's pinning is replaced by a
recorder here (this CPU has none); on a GPU it is ``cudaHostRegister``."""

import gc
import time

import numpy as np
import pytest
import torch

from inspector.core.dtypes import BFLOAT16
from inspector.plugin.host_slabs import HostSlabs

MIB = 1 << 20


class Pins:
    """Records what would be pinned; refuses once told to."""

    def __init__(self):
        self.sizes: list[int] = []
        self.refuse = False

    def __call__(self, address: int, nbytes: int) -> bool:
        self.sizes.append(nbytes)
        return not self.refuse


def settled(made: HostSlabs, pins: Pins, count: int) -> None:
    """Wait until ``count`` slabs were asked to be pinned and the helper thread's last one stands ready
    (or was refused)."""
    deadline = time.monotonic() + 10
    while (len(pins.sizes) < count or not (made._ready or pins.refuse)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pins.sizes) == count


@pytest.fixture
def slabs():
    pins = Pins()
    made = HostSlabs(pins, slab_bytes=4 * MIB, ahead=1)
    yield made, pins
    made.close()


def test_blocks_are_carved_from_a_slab_pinned_ahead(slabs):
    made, pins = slabs
    settled(made, pins, 1)  # one slab stands ready before any copy asks
    a = made.tensor((16, 1024), torch.bfloat16)
    b = made.tensor((2, 256), torch.float32)
    assert a.shape == (16, 1024) and a.dtype == torch.bfloat16 and b.shape == (2, 256)
    a.fill_(1.5)
    b.fill_(-2)
    assert float(a.float().sum()) == 1.5 * 16 * 1024 and float(b.sum()) == -2 * 512  # separate memory
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    settled(made, pins, 2)  # the first slab was taken: the helper pins the next
    assert pins.sizes == [4 * MIB, 4 * MIB]


def test_a_slab_is_carved_again_only_once_nothing_made_from_it_is_left(slabs):
    made, pins = slabs
    first = made.tensor((1024, 1024), torch.bfloat16)  # 2 MiB at the start of a 4 MiB slab
    address = first.data_ptr()
    kept = first.view(torch.int16).numpy().view(BFLOAT16)[5:9]  # rows a run keeps, as the drain hands them out
    del first
    made.tensor((1024, 1024), torch.bfloat16)  # fills the first slab
    held = made.tensor((1024, 1024), torch.bfloat16)  # a second slab, kept in use
    made.tensor((1024, 1024), torch.bfloat16)
    third = made.tensor((1024, 1024), torch.bfloat16)  # the first slab is still held by the rows kept
    assert address not in (held.data_ptr(), third.data_ptr())
    assert np.asarray(kept).shape == (4, 1024)
    del kept
    gc.collect()
    made.tensor((1024, 1024), torch.bfloat16)  # fills the third slab
    assert made.tensor((1024, 1024), torch.bfloat16).data_ptr() == address  # let go of: carved again
    assert len(pins.sizes) <= 4  # three slabs in use, one pinned ahead


def test_a_block_larger_than_a_slab_gets_a_slab_its_size_and_later_slabs_follow(slabs):
    made, pins = slabs
    settled(made, pins, 1)
    big = made.tensor((6, MIB), torch.uint8)  # 6 MiB, more than a slab
    assert big.shape == (6, MIB)
    settled(made, pins, 3)  # pinned now, and the next one ahead at the new size
    assert pins.sizes == [4 * MIB, 6 * MIB, 6 * MIB]


def test_where_the_driver_refuses_rows_use_torchs_pinned_memory(monkeypatch, caplog):
    pins = Pins()
    pins.refuse = True
    made = HostSlabs(pins, slab_bytes=4 * MIB, ahead=1)
    asked = []
    real_empty = torch.empty

    def empty(*shape, **kwargs):
        asked.append(kwargs.get("pin_memory"))
        return real_empty(*shape, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    settled(made, pins, 1)
    monkeypatch.setattr(torch, "empty", empty)
    t = made.tensor((3, 4), torch.float32)
    made.close()
    assert t.shape == (3, 4) and asked == [True]
    assert "did not pin" in caplog.text
