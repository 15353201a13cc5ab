"""Export throughput of capture files vs raw h5py, and time to open + read one hook (not a test).

    nice .venv/bin/python bench/export_bench.py [--requests 4 --hooks 16 --rows 4096 --width 1024 --reps 3]
                                               [--dtype float32|bfloat16|float16] [--include-sync]

Writes a synthetic run (default 4 requests x 16 hooks x 4096 rows x 1024 wide float32 = 1 GiB) with
  raw        h5py.create_dataset(data=...) per (request, hook), contiguous, no compression (the baseline;
             bfloat16 rows as their uint16 bits, the same bytes our files hold)
  write_run  our CaptureWriter, whole arrays (write_run)
  stream     our CaptureWriter, a 512-row prefill then one row per decode step per (request, hook)
alternating the order per repetition (os.sync() before each, untimed), medians and bests reported; our writers run with fsync=False like the raw
baseline (one extra line shows the default fsync=True cost). Then opens the write_run file with
open_run() and reads one hook's rows of one request, and one column over all rows.
A small compression table (64 MiB) shows why files are uncompressed by default.

Data: random normal float32, which does not compress; real activations compress a little more
(outlier channels, shared exponents), but not enough to change the picture measured here.
Memory: a pool of 8 distinct [rows, width] blocks is shared between hooks (writes do not care).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inspector.core.dtypes import BFLOAT16, ROW_DTYPES  # noqa: E402
from inspector.core.hooks import HookPoint  # noqa: E402
from inspector.core.run import RequestCapture, Run  # noqa: E402
from inspector.io import CaptureWriter, open_run, write_run  # noqa: E402


class Rows:
    """HookRows-like view on a shared block (HookRows would concatenate = copy)."""

    def __init__(self, values: np.ndarray):
        self.values, self.width = values, values.shape[1]
        self.positions = np.arange(len(values), dtype=np.int64)
        self.token_ids = np.arange(len(values), dtype=np.int64) % 50_000

    def __len__(self) -> int:
        return len(self.values)


def build(n_req: int, n_hooks: int, rows: int, width: int, dtype=np.float32) -> tuple[Run, int]:
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((rows, width), dtype=np.float32).astype(dtype) for _ in range(8)]
    hooks = {f"model.layers.{h}.resid_post": HookPoint(f"model.layers.{h}.resid_post", f"L{h}", f"model.layers.{h}",
                                                      "resid", width, h, "bfloat16") for h in range(n_hooks)}
    run = Run(metadata={"model_path": "synthetic", "engine_mode": "bench"}, hooks=hooks)
    for r in range(n_req):
        req = RequestCapture(f"r{r}", "prompt", list(range(16)), {"max_tokens": rows},
                             generated_token_ids=list(range(rows - 15)), finish_reason="length")
        req.hooks = {name: Rows(pool[(r * n_hooks + h) % len(pool)]) for h, name in enumerate(hooks)}
        run.requests[req.request_id] = req
    total = n_req * n_hooks * rows * width * np.dtype(dtype).itemsize
    return run, total


def raw_h5py(run: Run, path: Path) -> None:
    with h5py.File(path, "w") as f:
        for r, req in enumerate(run.requests.values()):
            for name, rows in req.hooks.items():
                g = f.create_group(f"requests/{r}/hooks/{name}")
                g.create_dataset("values", data=rows.values.view(np.uint16) if rows.values.dtype == BFLOAT16
                                 else rows.values)
                g.create_dataset("positions", data=rows.positions)
                g.create_dataset("token_ids", data=rows.token_ids)


def ours_write_run(run: Run, path: Path, fsync: bool = False) -> None:
    write_run(run, path, fsync=fsync)


def ours_stream(run: Run, path: Path, prefill: int = 512) -> int:
    calls = 0
    with CaptureWriter(path, run.metadata, run.hooks, fsync=False) as w:
        reqs = list(run.requests.values())
        for req in reqs:
            w.add_request(req)
        n = len(next(iter(reqs[0].hooks.values())))
        steps = [(0, prefill)] + [(i, i + 1) for i in range(prefill, n)]
        for a, b in steps:
            for req in reqs:
                for name, rows in req.hooks.items():
                    w.append_rows(req.request_id, name, rows.positions[a:b], rows.token_ids[a:b], rows.values[a:b])
                    calls += 1
        for req in reqs:
            w.update_request(req)
    return calls


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--hooks", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", choices=sorted(ROW_DTYPES), default="float32")
    ap.add_argument("--include-sync", action="store_true", help="time each write until os.sync() returns")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir; files are deleted)")
    args = ap.parse_args()

    run, total = build(args.requests, args.hooks, args.rows, args.width, ROW_DTYPES[args.dtype])
    mb = total / 1e6
    print(f"synthetic run: {args.requests} requests x {args.hooks} hooks x {args.rows} rows x {args.width} "
          f"{args.dtype} = {mb:,.0f} MB of values (random normal)")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="export-bench-") as tmp:
        d = Path(tmp)
        times: dict[str, list[float]] = {"raw h5py": [], "write_run": [], "stream (1 row/step)": []}
        stream_calls = 0
        for rep in range(args.reps):
            order = list(times) if rep % 2 == 0 else list(reversed(times))  # alternate the order
            for name in order:
                path = d / f"{name.split()[0]}.h5"
                os.sync()  # start each run with no dirty pages of the previous one (untimed)
                if name == "raw h5py":
                    dt = timed(raw_h5py, run, path)
                elif name == "write_run":
                    dt = timed(ours_write_run, run, path)
                else:
                    t0 = time.perf_counter()
                    stream_calls = ours_stream(run, path)
                    dt = time.perf_counter() - t0
                if args.include_sync:  # until the bytes are on disk: page-cache writes alone vary 10x here
                    t0 = time.perf_counter()
                    os.sync()
                    dt += time.perf_counter() - t0
                times[name].append(dt)
                size = path.stat().st_size
                if not (rep == args.reps - 1 and name == "write_run"):
                    path.unlink()
                print(f"  rep {rep} {name:<20} {dt:6.2f} s  {mb / dt:7.0f} MB/s  file {size / 1e6:,.0f} MB",
                      flush=True)
        raw, raw_best = statistics.median(times["raw h5py"]), min(times["raw h5py"])
        # times are bimodal here (page cache and writeback): best against best compares the writers alone
        print(f"\n{'writer':<22}{'median s':>10}{'MB/s':>9}{'vs raw':>8}{'best s':>8}{'best vs raw best':>18}")
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{name:<22}{m:>10.2f}{mb / m:>9.0f}{raw / m:>8.2f}x{min(ts):>8.3f}{raw_best / min(ts):>17.2f}x")
        print(f"(stream: {stream_calls:,} append_rows calls, "
              f"{statistics.median(times['stream (1 row/step)']) / stream_calls * 1e6:.1f} us per call incl. I/O)")

        fs = d / "fsync.h5"
        os.sync()
        dt = timed(ours_write_run, run, fs, True)
        fs.unlink()
        print(f"{'write_run fsync=True':<22}{dt:>10.2f}{mb / dt:>9.0f}{raw / dt:>8.2f}x  (one run; raw has no fsync)")

        path = d / "write_run.h5"
        t0 = time.perf_counter()
        rf = open_run(path)
        t_open = time.perf_counter() - t0
        rid = list(run.requests)[len(run.requests) // 2]
        hook = list(run.hooks)[len(run.hooks) // 2]
        rows = rf.run.requests[rid].hooks[hook]
        t0 = time.perf_counter()
        block = rows.values[:]
        t_hook = time.perf_counter() - t0
        t0 = time.perf_counter()
        column = rows.values[:, 100]
        t_col = time.perf_counter() - t0
        expect = run.requests[rid].hooks[hook].values
        assert np.array_equal(block.view(np.uint8), expect.view(np.uint8))
        assert np.array_equal(column.view(np.uint8), np.ascontiguousarray(expect[:, 100]).view(np.uint8))
        rf.close()
        print(f"\nopen_run({path.stat().st_size / 1e9:.2f} GB file): {t_open * 1e3:.1f} ms; "
              f"read one hook of one request [{args.rows}, {args.width}]: {t_hook * 1e3:.1f} ms; "
              f"one column over {args.rows} rows: {t_col * 1e3:.1f} ms; open + hook: {(t_open + t_hook) * 1e3:.0f} ms "
              "(page cache warm: the file was just written)")
        path.unlink()

        print("\ncompression (1 request x 4 hooks = 64 MiB, write_run):")
        small, small_total = build(1, 4, args.rows, args.width, ROW_DTYPES[args.dtype])
        for comp in (None, "lzf", "gzip"):
            p = d / "c.h5"
            dt = timed(lambda: write_run(small, p, compression=comp, fsync=False))
            print(f"  {str(comp):<6} {small_total / 1e6 / dt:6.0f} MB/s  size {p.stat().st_size / small_total:.3f} of raw")
            p.unlink()


if __name__ == "__main__":
    main()
