"""The harvest's shuffled batches behind an engine-like producer (not a test; no engine).

    packaging/dev bench mixing_bench
    python3 bench/mixing_bench.py --hooks 4 --width 4096 --rates 30000 60000

A thread makes chunks of rows (fresh tensors, as the engine's drain hands them) at a steady rate and
queues them two deep, as ``inspector.harvest`` does; the consumer takes ``mixed_batches`` (batches of
4,096 rows, a buffer of 16 batches). Printed: rows/s delivered against the producer's rate. Where the
mixing keeps up, the ratio is about 1 (less the last buffer's wait); below, it held the producer up.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def delivered(rate: float, chunks: int, chunk_rows: int, hooks: int, width: int, batch: int) -> float:
    import torch

    from inspector.harvesting.mixing import mixed_batches

    template = {f"h{k}": torch.randn(chunk_rows, width).to(torch.bfloat16) for k in range(hooks)}
    handed: queue.Queue = queue.Queue(maxsize=2)

    def produce() -> None:
        started = time.perf_counter()
        for i in range(chunks):
            time.sleep(max(0.0, started + (i + 1) * chunk_rows / rate - time.perf_counter()))
            handed.put({hook: values.clone() for hook, values in template.items()})
        handed.put(None)

    def stream():
        while (chunk := handed.get()) is not None:
            yield chunk

    producer = threading.Thread(target=produce)
    started = time.perf_counter()
    producer.start()
    for _ in mixed_batches(stream(), batch, 16 * batch):
        pass
    producer.join()
    return chunks * chunk_rows / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hooks", type=int, default=4)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rates", type=float, nargs="+", default=[30000, 60000], help="the producer's rows/s")
    parser.add_argument("--chunks", type=int, default=48, help="chunks of 8,192 rows a measurement")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.hooks} hooks x {args.width} bf16, chunks of 8,192 rows, batches of 4,096, a buffer of 16")
    for rate in args.rates:
        got = [delivered(rate, args.chunks, 8192, args.hooks, args.width, 4096) for _ in range(args.reps)]
        print(f"producer {rate:10,.0f} rows/s: delivered {statistics.median(got):10,.0f} rows/s "
              f"({statistics.median(got) / rate:.2f}x; reps {', '.join(f'{g:,.0f}' for g in got)})", flush=True)


if __name__ == "__main__":
    main()
