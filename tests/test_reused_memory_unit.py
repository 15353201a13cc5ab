"""Host memory reused once the arrays of a block are gone (what a client's rows land in), and never
while any view of it lives."""

import gc

import numpy as np
import torch

from inspector.core.reused_memory import SMALLEST, ReusedMemory, size_class


def test_a_block_comes_back_only_once_its_last_view_is_gone():
    memory = ReusedMemory(keep_bytes=1 << 30)
    block = memory.empty(3 << 20)
    block[:] = 7
    rows = block[64:64 + 4096 * 8].view(np.float32).reshape(8, -1)  # a view of a view, reshaped
    tensor = torch.from_numpy(rows[2:4])  # what a consumer makes of a row
    del block, rows
    gc.collect()
    assert memory.free_bytes == 0  # the tensor still holds it
    other = memory.empty(3 << 20)
    assert memory.made == 2 and not np.shares_memory(other, tensor.numpy())
    assert tensor.numpy().view(np.uint8).min() == 7
    del tensor
    assert memory.free_bytes == size_class(3 << 20)
    again = memory.empty(3 << 20)
    assert (memory.made, memory.reused, memory.free_bytes) == (2, 1, 0)
    again[:] = 1  # its pages written over like fresh ones
    assert int(again.sum()) == 3 << 20


def test_sizes_of_one_class_share_blocks_and_small_ones_are_not_kept():
    assert size_class(1) == SMALLEST and size_class(SMALLEST + 1) == 2 * SMALLEST
    assert size_class(100 << 20) - (100 << 20) <= (100 << 20) // 8
    memory = ReusedMemory(keep_bytes=1 << 30)
    memory.empty(60 << 20)  # let go of at once
    block = memory.empty(59 << 20)  # the same class: the same memory
    assert (memory.made, memory.reused) == (1, 1) and len(block) == 59 << 20
    del block
    small = memory.empty(SMALLEST - 1)
    del small
    assert memory.made == 1 and memory.free_bytes == size_class(60 << 20)


def test_the_least_recently_let_go_are_dropped_beyond_what_is_kept():
    memory = ReusedMemory(keep_bytes=20 << 20)
    eight, sixteen, four = memory.empty(8 << 20), memory.empty(16 << 20), memory.empty(4 << 20)
    del eight, sixteen  # 24 MiB > 20: the 8 dropped
    del four
    assert memory.free_bytes == (16 + 4) << 20
    kept = [memory.empty(8 << 20), memory.empty(16 << 20)]
    assert (memory.made, memory.reused, len(kept)) == (4, 1, 2)
    memory.close()
    assert memory.free_bytes == 0
    kept.clear()  # given back after the close: let go of
    assert memory.free_bytes == 0
