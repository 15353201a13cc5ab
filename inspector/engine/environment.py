"""Process environment vLLM needs before it is imported, with defaults that suit this app."""

from __future__ import annotations

import os


def prepare_environment(kv_cache_gib: int = 1) -> None:
    """Set what an in-process engine needs; values the user set explicitly win.

    - the engine core and worker live in this process, so the driver can reach the model;
    - CPU decode runs 20-40x slower without OMP_NUM_THREADS set to the core count.
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
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
