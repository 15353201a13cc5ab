"""Decode throughput and memory: vanilla vLLM vs compiled capture vs eager capture.

Each configuration boots once in its own process and stays up; the runs then alternate
(A B C A B C …) so that machine noise hits all three alike. Prints medians and ratios.

    packaging/dev bench plugin_bench [--reps 5] [--batch 8] [--tokens 128]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time

CONFIGS = {
    "vanilla": dict(mode="compiled", hooks=False),
    "compiled": dict(mode="compiled", hooks=True),
    "eager": dict(mode="eager", hooks=True),
}
MODEL = dict(arch="llama", hidden=512, heads=8, kv_heads=8, layers=8, intermediate=1536, vocab=512)
MAX_BATCHED = 512


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def serve(name: str, conn, model_dir: str, batch: int, tokens: int) -> None:
    """One configuration, booted once; answers 'run' with (tokens/s, RSS MiB)."""
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from vllm import LLM, SamplingParams

    from inspector.engine.boot import boot_llm

    cfg = CONFIGS[name]
    t0 = time.perf_counter()
    if cfg["hooks"]:
        llm = boot_llm(model_dir, mode=cfg["mode"], hook_patterns=("blocks.*.hook_resid_post",),
                       max_num_batched_tokens=MAX_BATCHED, max_model_len=1024)
    else:
        llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=MAX_BATCHED, max_model_len=1024,
                  enable_prefix_caching=False)
    boot_s = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompts = [f"def function_{i}(x, y):\n    return" for i in range(batch)]
    conn.send(("ready", boot_s, _rss_mib()))
    run_no = 0
    while conn.recv() == "run":
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{run_no}-{i}", prompt, params)
        run_no += 1
        engine.step()  # prefill (not timed: the target is decode throughput)
        if cfg["hooks"]:
            llm.collective_rpc("inspector_drain")
        generated, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            generated += sum(1 for _ in engine.step())
            if cfg["hooks"]:
                llm.collective_rpc("inspector_drain")  # as the engine session does every step
        elapsed = time.perf_counter() - t0
        conn.send((batch * (tokens - 1) / elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from inspector.tinymodels import tiny_model

    model_dir = str(tiny_model(**MODEL))
    ctx = mp.get_context("spawn")
    workers = {}
    for name in CONFIGS:  # boot one at a time: boots compete for the same cores
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(name, child, model_dir, args.batch, args.tokens), daemon=True)
        proc.start()
        status, boot_s, rss = parent.recv()
        workers[name] = (proc, parent)
        print(f"booted {name:9s} in {boot_s:5.1f} s, RSS {rss:7.1f} MiB", flush=True)

    throughput = {name: [] for name in CONFIGS}
    peak = {}
    for rep in range(args.reps):
        for name, (_, conn) in workers.items():
            conn.send("run")
            tps, peak[name] = conn.recv()
            throughput[name].append(tps)
        print(f"rep {rep + 1}: " + "  ".join(f"{n} {t[-1]:8.1f} tok/s" for n, t in throughput.items()), flush=True)
    for proc, conn in workers.values():
        conn.send("stop")
        proc.join(timeout=60)

    med = {n: statistics.median(t) for n, t in throughput.items()}
    hidden, layers = MODEL["hidden"], MODEL["layers"]
    buffers_mib = layers * MAX_BATCHED * hidden * 4 / 2**20
    print(f"\nmodel: Llama hidden {hidden}, {layers} layers, float32; batch {args.batch} x {args.tokens} new tokens, "
          f"greedy, ignore_eos; capture = resid_post of every block ({layers} hooks); {args.reps} alternated reps")
    print(f"{'config':10s} {'median tok/s':>13s} {'peak RSS MiB':>13s}")
    for name in CONFIGS:
        print(f"{name:10s} {med[name]:13.1f} {peak[name]:13.1f}")
    print(f"\ncompiled / vanilla throughput: {med['compiled'] / med['vanilla']:.3f}  (target >= 0.95)")
    print(f"compiled / eager throughput:   {med['compiled'] / med['eager']:.3f}  (target >= 1.3)")
    extra = peak["compiled"] - peak["vanilla"]
    print(f"compiled peak RSS above vanilla: {extra:.1f} MiB; capture buffers {buffers_mib:.1f} MiB "
          f"(target: <= buffers + 10% of vanilla = {buffers_mib + 0.1 * peak['vanilla']:.1f} MiB)")


if __name__ == "__main__":
    main()
