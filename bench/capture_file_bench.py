"""A capture file's writer alone, fed a session's steps, against the disk: is the file path bound by the
writer or by the engine beside it?

    python3 bench/capture_file_bench.py [--batch 32 --prompt-tokens 128 --new-tokens 128 --hooks 32
                                         --width 4096 --dtype bfloat16 --reps 2 --dir DIR --disk-gib 2]

No engine, no GPU: steps shaped as ``Session.generate`` makes them (one prefill block of every request,
then a block a decode step, every hook in each) go to a capture file as ``inspector capture`` writes it,
through the writer's process (``BackgroundWriter``, started before the clock starts, as ``inspector
capture`` starts it while its engine boots) and, for comparison, a ``CaptureWriter`` in this process;
each timed until the file is closed and synced. The disk's speed is measured as ``session_bench``
measures it (``disk_seconds``: 64 MiB writes, synced, the better of through the page cache and past it). Prints MB/s, the tokens/s
each allows for these rows, and the share of the disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inspector.core import writeback  # noqa: E402
from inspector.core.blocks import RowBlocks  # noqa: E402
from inspector.core.dtypes import ROW_DTYPES  # noqa: E402
from inspector.core.hooks import HookPoint  # noqa: E402
from inspector.core.reused_memory import mapped_empty  # noqa: E402
from inspector.core.run import RequestCapture  # noqa: E402
from inspector.io import CaptureWriter  # noqa: E402
from inspector.io.background import BackgroundWriter, prepare  # noqa: E402


def disk_seconds(path: Path, size: int) -> float:
    """Seconds to write ``size`` bytes to one file in 64 MiB pieces and fsync it, the better of two ways:
    through the page cache with the kernel asked to write each piece out at once (``core.writeback``:
    without the asks the pieces sat in memory until the ``fsync``, and an H100 host's disk read 1,538
    MB/s where it takes 2,569, docs/gpu-run-2026-12-07d-shards.md), and past it (``O_DIRECT``, where the
    file system has it), as the capture file and the shards write their page-aligned rows: the disk's
    own rate."""
    block = mapped_empty((64 << 20,), np.uint8)
    block[:] = np.random.default_rng(0).integers(0, 255, len(block), dtype=np.uint8)
    best = None
    for direct in (False, True):
        os.sync()
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        through = writeback.open_direct(path) if direct else None
        try:
            if direct and through is None:
                continue
            for at in range(0, size, len(block)):
                if writeback.write_range(fd, memoryview(block[:min(size - at, len(block))]), at, through):
                    writeback.start_writeback(fd)
            os.fsync(fd)
        finally:
            for descriptor in (fd, through):
                if descriptor is not None:
                    os.close(descriptor)
        seconds = time.perf_counter() - started
        best = seconds if best is None else min(best, seconds)
    path.unlink()
    return best


def disk_mb_s(directory: Path, gib: float) -> float:
    """What the disk takes, in MB/s (``disk_seconds`` of ``gib``)."""
    size = int(gib * 2**30)
    return size / disk_seconds(directory / "disk-speed.bin", size) / 1e6


def session_steps(batch: int, prompt: int, new: int, hooks: dict, pool: np.ndarray):
    """(request ids, the steps' RowBlocks): a prefill of every prompt, then a row a request a step."""
    ids = [f"req{i}" for i in range(batch)]
    positions = np.tile(np.arange(prompt, dtype=np.int64), batch)
    steps = [RowBlocks(ids, np.arange(batch + 1) * prompt, positions, positions % 50_000,
                       {h: pool[k % len(pool), :batch * prompt] for k, h in enumerate(hooks)})]
    for step in range(new):
        at = np.full(batch, prompt + step, dtype=np.int64)
        rows = slice(step * batch % (len(pool[0]) - batch), step * batch % (len(pool[0]) - batch) + batch)
        steps.append(RowBlocks(ids, np.arange(batch + 1), at, at % 50_000,
                               {h: pool[k % len(pool), rows] for k, h in enumerate(hooks)}))
    return ids, steps


def write(kind: str, path: Path, ids, steps, hooks, prompt: int) -> float:
    if kind == "writer process":
        prepare(wait=True)  # started, its ring's pages made, as ``inspector capture`` has it after its boot
    t0 = time.perf_counter()
    if kind == "writer process":
        with BackgroundWriter(path, {}, hooks) as file:
            for rid in ids:
                file.call("add_request", RequestCapture(rid, "p", list(range(prompt)), {}))
            for blocks in steps:
                file.call("append_blocks", blocks)
    else:
        with CaptureWriter(path, {}, hooks) as file:
            for rid in ids:
                file.add_request(RequestCapture(rid, "p", list(range(prompt)), {}))
            for blocks in steps:
                file.append_blocks(blocks)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hooks", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--dtype", choices=sorted(ROW_DTYPES), default="bfloat16")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the files go (default: a temporary folder)")
    p.add_argument("--disk-gib", type=float, default=2.0)
    args = p.parse_args(argv)

    dtype = ROW_DTYPES[args.dtype]
    hooks = {f"blocks.{k}.hook_resid_post": HookPoint(f"blocks.{k}.hook_resid_post", f"blocks.{k}.hook_resid_post",
                                                      f"model.layers.{k}", "resid", args.width, k, args.dtype)
             for k in range(args.hooks)}
    rows = max(args.batch * args.prompt_tokens, 2 * args.batch)
    pool = np.random.default_rng(0).standard_normal((4, rows, args.width), dtype=np.float32).astype(dtype)
    ids, steps = session_steps(args.batch, args.prompt_tokens, args.new_tokens, hooks, pool)
    total = sum(blocks.nbytes for blocks in steps)
    token_bytes = args.hooks * args.width * dtype.itemsize
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="capture-file-bench-") as tmp:
        folder = Path(tmp)
        disk = disk_mb_s(folder, args.disk_gib)
        print(f"{args.batch} requests x ({args.prompt_tokens} + {args.new_tokens}) tokens x {args.hooks} hooks x "
              f"{args.width} {args.dtype}: {total / 1e9:.2f} GB a run; disk {disk:,.0f} MB/s "
              f"({disk * 1e6 / token_bytes:,.0f} tok/s of rows)", flush=True)
        seconds = {"writer process": [], "in process": []}
        for rep in range(args.reps):
            for kind in list(seconds)[::1 if rep % 2 == 0 else -1]:
                path = folder / "bench.h5"
                seconds[kind].append(write(kind, path, ids, steps, hooks, args.prompt_tokens))
                path.unlink()
                print(f"  rep {rep + 1} {kind:15s} {total / 1e6 / seconds[kind][-1]:8,.0f} MB/s", flush=True)
    for kind, times in seconds.items():
        mb_s = total / 1e6 / statistics.median(times)
        print(f"{kind:15s} {mb_s:8,.0f} MB/s  {mb_s * 1e6 / token_bytes:8,.0f} tok/s  {mb_s / disk:6.3f} of the disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
