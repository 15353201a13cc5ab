"""What reading the blocks and the boot probe add to a boot: vanilla vLLM against the same engine with
the plugin (compiled, every resid_post hooked), booted in turn, on the demo model and on the largest
tiny model of the test suite. Prints each boot's wall time, the reader's and probe's own seconds (the
plugin measures them), and their share of a vanilla boot.

    packaging/dev bench boot_bench [--reps 3] [--models demo gpt_oss]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))


def model_dir(name: str) -> str:
    from inspector.core.models import resolve_model
    from inspector.testing.tinymodels import tiny_model

    return str(resolve_model("demo")) if name == "demo" else str(tiny_model(name))


def boot(path: str, hooked: bool) -> tuple[float, float]:
    """(wall seconds of the boot, the reader's and probe's seconds or 0)."""
    from inspector.engine.boot import boot_llm, shutdown_llm

    started = time.perf_counter()
    llm = (boot_llm(path, hook_patterns=("blocks.*.hook_resid_post",), max_num_batched_tokens=256, max_model_len=512)
           if hooked else _vanilla(path))
    wall = time.perf_counter() - started
    probe = llm.collective_rpc("inspector_describe")[0]["probe_seconds"] if hooked else 0.0
    shutdown_llm(llm)
    return wall, probe


def _vanilla(path: str):
    from vllm import LLM

    return LLM(path, dtype="float32", max_num_batched_tokens=256, max_model_len=512, enable_prefix_caching=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["demo", "gpt_oss"])
    args = parser.parse_args()
    for name in args.models:
        path = model_dir(name)
        walls = {False: [], True: []}
        probes = []
        for _ in range(args.reps):
            for hooked in (False, True):  # in turn, so drift hits both alike
                wall, probe = boot(path, hooked)
                walls[hooked].append(wall)
                if hooked:
                    probes.append(probe)
        vanilla, hooked = statistics.median(walls[False]), statistics.median(walls[True])
        probe = statistics.median(probes)
        print(f"{name}: vanilla boot {vanilla:.1f} s, with the plugin {hooked:.1f} s ({hooked / vanilla:.2f}x); "
              f"reader + probe {probe:.2f} s = {100 * probe / vanilla:.1f}% of a vanilla boot "
              f"(medians of {args.reps}; boots {', '.join(f'{w:.1f}' for w in walls[False])} vanilla, "
              f"{', '.join(f'{w:.1f}' for w in walls[True])} hooked)", flush=True)


if __name__ == "__main__":
    main()
