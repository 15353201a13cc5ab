"""A long run in the app: resident memory over time, and the heatmap's frames while scrolling (not a test).

    packaging/dev bench long_run_bench [--tokens 100000 --hooks 32 --width 4096 --chunk 512 --out docs/]

Feeds the app's live run (``RunView``, as the controller keeps it for a long run: rows written through
to a scratch capture file) bf16 step events of ``--chunk`` tokens for every hook, as a long prefill
arrives, sampling the process's resident memory after each; then shows one hook's rows in the real
heatmap widget (offscreen), zoomed to 1,024 tokens, and times frames while scrolling through all of
them, then at full width. The rows are random normal (a pool of blocks shared between hooks: writes
do not care). Writes long-run-rss.csv and long-run-rss.png into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from inspector.core.dtypes import BFLOAT16  # noqa: E402
from inspector.core.hooks import HookPoint  # noqa: E402
from inspector.core.protocol import RequestStart, RequestStep, StepEvent  # noqa: E402
from inspector.viewer.run_view import RunView  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def scroll(app, heatmap, starts, window: int, rest_every: int = 30) -> list[float]:
    """As a user scrolls: the view moves every 16 ms, and rests for 150 ms now and then (the heatmap
    pools the rows anew once the view rests). Returns how long each event-loop turn took, in ms (the
    frame's work: moving the view, painting, pooling): the turns that did something."""
    turns = []

    def turn(move=None):
        t = time.perf_counter()
        if move is not None:
            heatmap.vb.setXRange(move, move + window, padding=0)
        app.processEvents()
        spent = (time.perf_counter() - t) * 1000
        if move is not None or spent > 1:
            turns.append(spent)
        time.sleep(max(0.0, 0.016 - spent / 1000))

    for i, x in enumerate(starts):
        turn(x)
        if i % rest_every == rest_every - 1:
            for _ in range(10):
                turn()
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--hooks", type=int, default=32)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--out", default="docs")
    ap.add_argument("--dir", default=None, help="where the scratch file goes (default: a temp dir)")
    args = ap.parse_args()

    from PySide6.QtWidgets import QApplication

    from inspector.ui.heatmap import HeatmapWidget

    app = QApplication.instance() or QApplication([])
    heatmap = HeatmapWidget()
    heatmap.resize(1400, 700)
    heatmap.show()
    app.processEvents()
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((args.chunk, args.width), dtype=np.float32).astype(BFLOAT16) for _ in range(4)]
    hooks = {f"blocks.{h}.hook_resid_post": HookPoint(f"blocks.{h}.hook_resid_post", f"blocks.{h}.hook_resid_post",
                                                       f"model.layers.{h}", "resid_post", args.width, h, "bfloat16")
             for h in range(args.hooks)}
    idle = rss_mib()
    samples = [(0.0, 0, idle)]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="long-run-") as tmp:
        view = RunView.live({"dtype": "bfloat16"}, hooks)
        view.write_through(tmp)
        start = RequestStart("r0", "a long document", tuple(range(args.tokens)), ("x",) * args.tokens,
                             {"max_tokens": 1})
        t0 = time.perf_counter()
        for step, a in enumerate(range(0, args.tokens, args.chunk)):
            b = min(args.tokens, a + args.chunk)
            positions, ids = np.arange(a, b), np.arange(a, b) % 50_000
            rows = {name: (positions, ids, pool[(step + h) % len(pool)][:b - a]) for h, name in enumerate(hooks)}
            view.apply(StepEvent(step, (RequestStep("r0", rows=rows),), (start,) if step == 0 else ()))
            samples.append((time.perf_counter() - t0, b, rss_mib()))
        feed_s = time.perf_counter() - t0
        gb = args.tokens * args.hooks * args.width * 2 / 1e9
        peak = max(m for _, _, m in samples)
        print(f"{args.tokens:,} tokens x {args.hooks} hooks x {args.width} bf16 = {gb:.1f} GB of rows, written "
              f"through in {feed_s:.0f} s ({gb / feed_s:.2f} GB/s); resident memory idle {idle:.0f} MiB, peak "
              f"{peak:.0f} MiB: {peak - idle:.0f} MiB above idle")

        positions, values = view.rows("r0", next(iter(hooks)))
        heatmap.set_data(positions, values, ["x"] * args.tokens, "long run", None, "blocks.0")
        heatmap._follow = False
        app.processEvents()
        window = 1024
        for label, starts in ((f"{window} tokens shown, 32 tokens a frame", range(0, args.tokens - window, 32)),
                              (f"{window} tokens shown, jumps of {args.tokens // 50:,}",
                               range(0, args.tokens - window, args.tokens // 50))):
            turns = scroll(app, heatmap, starts, window)
            print(f"heatmap, {label}: {len(turns)} frames, median {statistics.median(turns):.1f} ms, 95th "
                  f"percentile {np.percentile(turns, 95):.1f} ms, 99th {np.percentile(turns, 99):.1f} ms, "
                  f"max {max(turns):.1f} ms, {sum(t > 16 for t in turns)} over 16 ms")
        print(f"resident memory after scrolling: {rss_mib() - idle:.0f} MiB above idle")
        view.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "long-run-rss.csv", "w") as f:
        f.write("seconds,tokens,rss_mib_above_idle\n")
        f.writelines(f"{s:.3f},{n},{m - idle:.1f}\n" for s, n, m in samples)
    plot_rss(samples, idle, out / "long-run-rss.png", args)
    heatmap.close()
    print(f"wrote {out / 'long-run-rss.csv'} and {out / 'long-run-rss.png'}")


def plot_rss(samples, idle: float, path: Path, args) -> None:
    import pyqtgraph as pg

    plot = pg.PlotWidget(background="w")
    plot.resize(900, 420)
    plot.setTitle(f"App's live run, written through: {args.tokens:,} tokens × {args.hooks} hooks × {args.width} bf16",
                  color="k")
    plot.setLabel("bottom", "tokens captured", color="k")
    plot.setLabel("left", "resident memory above idle (MiB)", color="k")
    plot.plot([n for _, n, _ in samples], [m - idle for _, _, m in samples], pen=pg.mkPen("#1f77b4", width=2))
    plot.addLine(y=2048, pen=pg.mkPen("#d62728", style=pg.QtCore.Qt.PenStyle.DashLine))
    plot.setYRange(0, 2200)
    plot.grab().save(str(path))


if __name__ == "__main__":
    main()
