"""vLLM plugin: hooks that capture activations and apply interventions inside vLLM's workers.

The seed API: ``register()`` (vLLM calls it once per process through the ``vllm.general_plugins``
entry point), ``configure(...)`` before ``LLM(...)`` and ``clear_config()`` after it. Only torch and
vLLM here: this package runs inside the worker processes.
"""

from __future__ import annotations

import os

import torch

from inspector.core.interventions import DEFAULT_MAX_SLOTS

from .config import ENV_VAR, PluginConfig, validate

WORKER_EXTENSION = "inspector.plugin.worker_extension.InspectorWorkerExtension"


def register() -> None:
    """Idempotent: patch ``Worker.load_model``, the weight loader (for an engine of fewer blocks than
    its checkpoint) and key vLLM's compile cache by the hook config (these do nothing while no config
    is set), keep the Transformers backend's edits of transformers' classes to the engine's model, and
    mend the Inductor fault that compiled hooks bring out (``inductor_compat``)."""
    from . import inductor_compat, vllm_compat, vllm_process
    from .worker_extension import install_runtime

    vllm_compat.patch_load_model(install_runtime)
    vllm_compat.skip_weights_of_cut_layers(lambda: getattr(PluginConfig.from_env(), "kept_layers", 0))
    vllm_compat.key_compile_cache(_compile_key)
    vllm_process.keep_transformers_classes_unedited()
    inductor_compat.keep_reads_after_the_writes_they_follow()


def _compile_key() -> str | None:
    """What a compiled graph depends on beyond vLLM's config: the hooks, and the Inductor mends."""
    from .inductor_compat import COMPILE_KEY

    config = os.environ.get(ENV_VAR)
    return None if config is None else f"{config}|{COMPILE_KEY}"


def configure(capture_specs: dict[str, tuple[str, int]], max_num_batched_tokens: int, dtype: torch.dtype,
              enable_batching: bool = False, enable_position_interventions: bool = False,
              hook_patterns: tuple[str, ...] = (), max_slots: int = DEFAULT_MAX_SLOTS, feature_clamps: int = 0,
              kept_layers: int = 0) -> None:
    """Set the hook specs (name → (module dot-path, width)) for the next engine boot in this process
    and its children. ``enable_batching`` selects the eager flavour (boot with ``enforce_eager=True``).
    ``hook_patterns`` (our extension) adds hook points by name, alias or glob, resolved in the worker
    against the model's catalogue, so a caller need not know module paths before boot. ``kept_layers``:
    the engine is booted with only that many decoder blocks (``num_hidden_layers`` overridden), and the
    checkpoint's weights of the others are skipped."""
    dtype_name = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else str(dtype)
    config = PluginConfig({name: (str(path), int(width)) for name, (path, width) in capture_specs.items()},
                          int(max_num_batched_tokens), dtype_name, bool(enable_batching),
                          bool(enable_position_interventions), tuple(hook_patterns), int(max_slots), int(feature_clamps),
                          int(kept_layers))
    validate(config)
    os.environ[ENV_VAR] = config.to_env()


def clear_config() -> None:
    """Unset the spec channel: a later ``LLM(...)`` in this process boots without hooks."""
    os.environ.pop(ENV_VAR, None)
