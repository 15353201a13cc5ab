"""Time to recompute attention patterns from captured queries and keys (not a test).

    nice .venv/bin/python bench/attention_bench.py [--tokens 2048 --reps 20]

On a Llama-3-8B-shaped layer (32 query heads, 8 key heads, head size 128, float32 rows as captured):
  full head   the T x T pattern of one head (the Attention view's heatmap; target < 50 ms at T = 2,048)
  token row   one token's weights over the earlier tokens, every head (the view's per-head rows)
  windowed    the full pattern of one head with a 512-token sliding window and a soft cap (Gemma 2's)
against numpy's bare q @ k.T of the same head as the floor: matmul alone, no scale, mask or softmax.
Medians of ``--reps`` runs after one warm-up; the machine is shared, so ratios mean more than times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from inspector.core.attention import AttentionGeometry, attention_weights


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    t = args.tokens
    geometry = AttentionGeometry(heads=32, kv_heads=8, head_size=128, scale=128 ** -0.5)
    windowed = AttentionGeometry(32, 8, 128, 128 ** -0.5, sliding_window=512, soft_cap=50.0)
    rng = np.random.default_rng(0)
    q = rng.normal(size=(t, geometry.q_width)).astype(np.float32)
    k = rng.normal(size=(t, geometry.k_width)).astype(np.float32)
    positions = np.arange(t)
    head_q, head_k = q[:, :128], k[:, :128]
    cases = {
        "matmul floor": lambda: head_q @ head_k.T,
        "full head": lambda: attention_weights(q, positions, k, positions, geometry, heads=[0]),
        "token row": lambda: attention_weights(q[-1:], positions[-1:], k, positions, geometry),
        "windowed": lambda: attention_weights(q, positions, k, positions, windowed, heads=[0]),
    }
    floor = None
    print(f"T = {t}, 32 heads / 8 kv heads x 128, float32; median of {args.reps}")
    for name, fn in cases.items():
        ms = timed(fn, args.reps)
        floor = floor or ms
        print(f"{name:>13}: {ms:8.2f} ms  ({ms / floor:5.1f}x the matmul)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
