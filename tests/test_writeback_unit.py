"""Page-aligned writes go to the disk past the page cache (``O_DIRECT``), the rest through it, and the
file is what the writes say either way: a capture file written through the writer's ring, and a
harvest shard, send their rows' whole pages that way."""

import errno
import os

import numpy as np
import pytest

from inspector.core import writeback
from inspector.core.blocks import RowBlocks
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.reused_memory import mapped_empty
from inspector.core.run import RequestCapture
from inspector.io import latching_file
from inspector.io.background import BackgroundWriter
from inspector.io.reader import read_run


@pytest.fixture
def direct_file(tmp_path):
    """(path, descriptor, direct descriptor); skipped where the file system takes no direct writes."""
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    direct = writeback.open_direct(path)
    if direct is None:
        os.close(fd)
        pytest.skip("this file system takes no O_DIRECT writes")
    yield path, fd, direct
    os.close(direct)
    os.close(fd)


def pages(n: int, fill: int) -> np.ndarray:
    block = mapped_empty((n * writeback.ALIGN,), np.uint8)
    block[:] = (np.arange(len(block)) * 7 + fill) % 251
    return block


def test_aligned_pieces_go_direct_and_others_through_the_cache(direct_file):
    path, fd, direct = direct_file
    a, b = pages(2, 1), pages(3, 2)
    assert writeback.write_pieces(fd, [memoryview(a), memoryview(b)], 0, direct) == 0  # none through the cache
    odd = np.arange(100, dtype=np.uint8)
    assert writeback.write_pieces(fd, [memoryview(odd)], 5 * writeback.ALIGN, direct) == 100
    unaligned_memory = memoryview(pages(2, 3))[1:1 + writeback.ALIGN]
    assert writeback.write_pieces(fd, [unaligned_memory], 6 * writeback.ALIGN, direct) == writeback.ALIGN
    data = path.read_bytes()
    assert data == a.tobytes() + b.tobytes() + odd.tobytes() + bytes(writeback.ALIGN - 100) + bytes(unaligned_memory)


def test_a_range_sends_its_whole_pages_direct_and_its_ends_through_the_cache(direct_file):
    path, fd, direct = direct_file
    block = pages(6, 4)
    start = 100  # the file and the memory agree where pages start: 100 bytes in on both
    piece = memoryview(block)[start:start + 4 * writeback.ALIGN + 300]
    cached = writeback.write_range(fd, piece, start, direct)
    assert cached == (writeback.ALIGN - start) + (start + 300)  # the head to the first page, and the tail
    os.pwrite(fd, b"h" * start, 0)
    assert path.read_bytes() == b"h" * start + bytes(piece)
    # where they disagree, all of it through the cache
    assert writeback.write_range(fd, piece, 8 * writeback.ALIGN + 1, direct) == len(piece)
    assert path.read_bytes()[8 * writeback.ALIGN + 1:] == bytes(piece)


def test_a_file_system_that_refuses_a_direct_write_gets_it_through_the_cache(direct_file, monkeypatch):
    path, fd, direct = direct_file
    pwritev = os.pwritev

    def refused(descriptor, pieces, pos):
        if descriptor == direct:
            raise OSError(errno.EINVAL, "Invalid argument")
        return pwritev(descriptor, pieces, pos)

    monkeypatch.setattr(os, "pwritev", refused)
    a = pages(2, 5)
    assert writeback.write_pieces(fd, [memoryview(a), memoryview(a)], 0, direct) == 2 * len(a)
    assert path.read_bytes() == a.tobytes() * 2


def test_a_capture_files_chunks_leave_the_ring_past_the_page_cache(tmp_path, monkeypatch, direct_file,
                                                                    writer_in_a_thread):
    """Through the writer's ring (here in a thread, to count its writes): whole chunks of rows whose width
    makes them whole pages go direct, from the ring (a prompt's) and from the chunk buffers (decode
    steps'), and the file reads back bit for bit."""
    counted = {"direct": 0, "cached": 0}
    write = latching_file.write_pieces

    def counting(fd, pieces, pos, direct=None):
        cached = write(fd, pieces, pos, direct)
        counted["cached"] += cached
        counted["direct"] += sum(len(p) for p in pieces) - cached
        return cached

    monkeypatch.setattr(latching_file, "write_pieces", counting)
    width, prompt, new = 2048, 64, 64
    hooks = {f"h{k}": HookPoint(f"h{k}", f"h{k}", "", "resid", width) for k in range(2)}
    rng = np.random.default_rng(0)
    rows = {h: rng.standard_normal((2, prompt + new, width), dtype=np.float32).astype(BFLOAT16) for h in hooks}
    with BackgroundWriter(tmp_path / "c.h5", {}, hooks) as file:
        for rid in ("a", "b"):
            file.call("add_request", RequestCapture(rid, "p", list(range(prompt)), {}))
        positions = np.tile(np.arange(prompt), 2)
        file.call("append_blocks", RowBlocks(["a", "b"], [0, prompt, 2 * prompt], positions, positions,
                                             {h: r[:, :prompt].reshape(-1, width) for h, r in rows.items()}))
        for step in range(new):
            at = np.full(2, prompt + step)
            step_rows = {h: np.ascontiguousarray(r[:, prompt + step]) for h, r in rows.items()}
            file.call("append_blocks", RowBlocks(["a", "b"], [0, 1, 2], at, at, step_rows))
    run = read_run(tmp_path / "c.h5")
    for k, rid in enumerate(("a", "b")):
        for h, r in rows.items():
            assert np.array_equal(run.requests[rid].hooks[h].values.view(np.uint16), r[k].view(np.uint16))
    rows_bytes = sum(r.nbytes for r in rows.values())
    assert counted["direct"] >= 0.9 * rows_bytes, counted


def test_a_shards_rows_go_past_the_page_cache_and_read_back_through_safetensors(tmp_path, monkeypatch, direct_file):
    import torch
    from safetensors import safe_open

    from inspector.harvesting import shards

    went = []
    write = writeback.write_pieces
    monkeypatch.setattr(writeback, "write_pieces",
                        lambda fd, pieces, pos, direct=None: went.append(direct is not None and writeback.page_aligned(
                            pieces, pos)) or write(fd, pieces, pos, direct))
    rows, width = 300, 2048
    acts = mapped_empty((rows, width), BFLOAT16)
    acts.view(np.uint16)[:] = np.random.default_rng(1).integers(0, 1 << 15, (rows, width), dtype=np.uint16)
    arrays = {"token_ids": np.arange(rows, dtype=np.int64), "position": np.arange(rows, dtype=np.int64) % 7,
              "blocks.1.hook_resid_post": acts}
    shards.write_safetensors(tmp_path / "s.safetensors", arrays, {"format": "f"})
    assert went and all(went)  # the rows' pages, in one direct write
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("blocks.1.hook_resid_post").view(torch.int16),
                           torch.from_numpy(acts.view(np.int16)))
        assert f.get_tensor("position").tolist() == (np.arange(rows) % 7).tolist()
        assert f.get_tensor("token_ids").tolist() == list(range(rows))


def test_a_direct_write_that_finds_the_disk_full_fails_the_capture_and_leaves_no_file(tmp_path, monkeypatch,
                                                                                    direct_file):
    from inspector.io import CaptureFileError, CaptureWriter

    pwritev = os.pwritev

    def full(descriptor, pieces, pos):
        if writeback.page_aligned(pieces, pos) and len(pieces[0]) >= 64 << 10:  # a chunk's direct write
            raise OSError(errno.ENOSPC, "No space left on device")
        return pwritev(descriptor, pieces, pos)

    monkeypatch.setattr(os, "pwritev", full)
    width, prompt = 2048, 64
    rows = mapped_empty((prompt, width), BFLOAT16)  # page-aligned, as the writer's ring is
    rows.view(np.uint16)[:] = 1
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CaptureFileError, match=r"(?i)no space left on device while writing .*c\.h5.*nothing was saved"):
        with CaptureWriter(out / "c.h5", {}, {"h": HookPoint("h", "h", "", "resid", width)}) as file:
            file.add_request(RequestCapture("a", "p", list(range(prompt)), {}))
            file.append_blocks(RowBlocks(["a"], [0, prompt], np.arange(prompt), np.arange(prompt), {"h": rows}))
    assert os.listdir(out) == []
