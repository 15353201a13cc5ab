"""Boot and shut down a vLLM engine with the inspector plugin configured."""

from __future__ import annotations

from pathlib import Path

from inspector.core.interventions import DEFAULT_MAX_SLOTS
from inspector.core.models import model_config
from inspector.core.protocol import MODES

from .environment import engine_precision, parallel_ranks, prepare_environment, worker_environment


INSPECTOR_ENGINE_ARGS = {"enforce_eager", "worker_extension_cls"}
# vLLM arguments a session sets from options of its own (SessionOptions, the commands' flags)
SESSION_ENGINE_ARGS = {"model", "dtype", "max_model_len", "max_num_batched_tokens"}


def own_options_among(engine_args: dict) -> str | None:
    """Why these engine arguments are refused where they name the session's own options (None: they do
    not): given twice, one would win unseen, or boot_llm's call would fail on a repeated keyword."""
    own = sorted(set(engine_args) & SESSION_ENGINE_ARGS)
    if not own:
        return None
    return (f"engine argument(s) {', '.join(own)} are the session's own options: give them as options "
            "(SessionOptions fields; the commands' --max-model-len, --max-num-batched-tokens, --dtype, --model), "
            "not among the engine arguments")


def boot_llm(model: str, capture_specs: dict[str, tuple[str, int]] | None = None, mode: str = "compiled",
             dtype: str = "float32", max_num_batched_tokens: int = 512, max_model_len: int = 1024,
             enable_position_interventions: bool = False, hook_patterns: tuple[str, ...] = (),
             max_slots: int = DEFAULT_MAX_SLOTS, feature_clamps: int = 0, kept_layers: int = 0, **engine_args):
    """An ``LLM`` whose worker has the hooks in ``capture_specs`` and ``hook_patterns`` installed;
    ``kept_layers`` > 0: with only the model's first decoder blocks (``layer_overrides``).

    Prefix caching is off unless ``enable_prefix_caching=True`` is given: a session then keys cached
    blocks by the edits they were computed under and makes capturing requests compute every row
    (``Session``).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    ours = sorted(set(engine_args) & INSPECTOR_ENGINE_ARGS)
    if ours:
        raise ValueError(f"engine argument(s) {', '.join(ours)} are set by the inspector and cannot be "
                         "given: enforce_eager follows the mode, the worker extension is the plugin's")
    overrides = layer_overrides(Path(model), kept_layers) if kept_layers else {}
    if overrides:
        engine_args["hf_overrides"] = {**engine_args.get("hf_overrides", {}), **overrides}
    prepare_environment()
    engine_precision(dtype)
    import torch
    from vllm import LLM

    from inspector import plugin
    from inspector.plugin import vllm_process

    plugin.register()
    if engine_args.get("distributed_executor_backend") == "ray":
        _start_ray()
    plugin.configure(capture_specs or {}, max_num_batched_tokens, getattr(torch, dtype),
                     enable_batching=mode == "eager", enable_position_interventions=enable_position_interventions,
                     hook_patterns=hook_patterns, max_slots=max_slots, feature_clamps=feature_clamps,
                     kept_layers=kept_layers if overrides else 0)
    try:
        with worker_environment(parallel_ranks(engine_args)):
            llm = LLM(model=model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                      max_model_len=max_model_len, enforce_eager=mode == "eager",
                      enable_prefix_caching=bool(engine_args.pop("enable_prefix_caching", False)),
                      worker_extension_cls=plugin.WORKER_EXTENSION, **engine_args)
    except BaseException:
        vllm_process.boot_failed()  # so that the next boot in this process starts clean
        raise
    finally:
        plugin.clear_config()
    vllm_process.booted(llm)
    return llm


LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def layer_overrides(model: Path, kept: int) -> dict:
    """vLLM ``hf_overrides`` that make the model in directory ``model`` its first ``kept`` decoder
    blocks: the layer count, and every per-layer list of its config (layer types, sliding windows...)
    cut to match; for a model whose text config is nested (``text_config``), there. ``{}`` when the
    model has no more blocks than that. ValueError where the config names no layer count."""
    config = model_config(model)
    nested = isinstance(config.get("text_config"), dict) and any(k in config["text_config"] for k in LAYER_COUNT_KEYS)
    text = config["text_config"] if nested else config
    key = next((k for k in LAYER_COUNT_KEYS if isinstance(text.get(k), int)), None)
    if key is None:
        raise ValueError(f"{model}: its config names no layer count ({', '.join(LAYER_COUNT_KEYS)}), so the "
                         "engine cannot be cut after the deepest hooked block; harvest at full depth")
    layers = text[key]
    if kept >= layers:
        return {}
    cut = {key: kept, **{k: v[:kept] for k, v in text.items() if isinstance(v, list) and len(v) == layers}}
    return {"text_config": cut} if nested else cut


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
    from inspector.plugin import vllm_process

    vllm_process.shutdown_engine(llm)
