"""Boot and shut down a vLLM engine with the inspector plugin configured."""

from __future__ import annotations

from inspector.capture.interventions import DEFAULT_MAX_SLOTS
from inspector.capture.protocol import MODES

from .environment import engine_precision, prepare_environment, worker_environment


INSPECTOR_ENGINE_ARGS = {"enforce_eager", "enable_prefix_caching", "worker_extension_cls"}


def boot_llm(model: str, capture_specs: dict[str, tuple[str, int]] | None = None, mode: str = "compiled",
             dtype: str = "float32", max_num_batched_tokens: int = 512, max_model_len: int = 1024,
             enable_position_interventions: bool = False, hook_patterns: tuple[str, ...] = (),
             max_slots: int = DEFAULT_MAX_SLOTS, feature_clamps: int = 0, **engine_args):
    """An ``LLM`` whose worker has the hooks in ``capture_specs`` and ``hook_patterns`` installed.

    Prefix caching is off: it skips prompt rows and would let K/V computed under an intervention
    leak into later clean runs.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ours = sorted(set(engine_args) & INSPECTOR_ENGINE_ARGS)
    if ours:
        raise ValueError(f"engine argument(s) {', '.join(ours)} are set by the inspector and cannot be "
                         "given: prefix caching would skip prompt rows and leak intervened K/V into clean "
                         "runs, enforce_eager follows the mode, the worker extension is the plugin's")
    if int(engine_args.get("pipeline_parallel_size", 1)) > 1:
        raise ValueError(f"pipeline_parallel_size={engine_args['pipeline_parallel_size']}: the inspector cannot capture "
                         "under pipeline parallelism (each stage holds only some layers); use tensor_parallel_size")
    prepare_environment()
    engine_precision(dtype)
    import torch
    from vllm import LLM

    from inspector import plugin

    plugin.register()
    if engine_args.get("distributed_executor_backend") == "ray":
        _start_ray()
    plugin.configure(capture_specs or {}, max_num_batched_tokens, getattr(torch, dtype),
                     enable_batching=mode == "eager", enable_position_interventions=enable_position_interventions,
                     hook_patterns=hook_patterns, max_slots=max_slots, feature_clamps=feature_clamps)
    try:
        with worker_environment(int(engine_args.get("tensor_parallel_size", 1))):
            return LLM(model=model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                       max_model_len=max_model_len, enforce_eager=mode == "eager", enable_prefix_caching=False,
                       worker_extension_cls=plugin.WORKER_EXTENSION, **engine_args)
    finally:
        plugin.clear_config()


def _start_ray() -> None:
    """Start Ray before ``configure`` puts this boot's hook config into the environment (or join the
    cluster that ``RAY_ADDRESS`` names or ``ray start`` began on this node, which never had it). Left to
    vLLM, Ray would start inside the first boot and its processes would hand that boot's config down to
    every later engine's workers: vLLM's Ray executor copies the driver's environment into a worker only
    where a variable is missing. ``ray.init()`` is the call vLLM itself makes on CUDA."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError('distributed_executor_backend="ray" needs Ray on every node: pip install ray') from e
    if not ray.is_initialized():
        ray.init()


def shutdown_llm(llm) -> None:
    """Free the engine (memory included) so another can boot in this process."""
    from inspector.plugin import vllm_compat

    vllm_compat.shutdown_engine(llm)
