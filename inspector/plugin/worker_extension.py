"""Worker-side RPC methods, mixed into vLLM's Worker through ``worker_extension_cls``.

Called as ``llm.collective_rpc("inspector_…", args=…)``. Arguments and results are plain Python and
numpy, so no insecure serialization is needed across processes.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
from dataclasses import replace

from inspector.core.drained import ROW_KEYS
from inspector.core.frame_stack import run_methods_in_fresh_stack_chunks
from inspector.core.interventions import Intervention
from inspector.core.portable import to_portable
from inspector.core.request_edits import CAPTURE_KEY, CLIENT_PREFIX, EDIT_KEY, decode_edit
from inspector.core.sae import AttachedSae, SaeConfig

from . import hookpoints, lens, probe, reader, vllm_compat
from .config import PLUGIN_MISSING, PluginConfig, served_config
from .runtime import InspectorRuntime

_ATTR = "_inspector_runtime"
PROBE_TOKENS = 8  # the boot probe's forward (probe.py)
logger = logging.getLogger(__name__)

# Called (in-process engines only) once weights are loaded, before the hook points are probed, and once
# hooks are installed, just before vLLM compiles: the driver reports the "probing" and "compiling" stages.
on_weights_loaded: list = []
on_hooks_installed: list = []


def install_runtime(worker) -> None:
    """Called by the patched ``load_model``: build the runtime and install the configured hooks."""
    config = PluginConfig.from_env()
    section = vllm_compat.served_section(worker) if config is None else None
    if section is not None:
        _, _, max_tokens = vllm_compat.model_sizes(worker)
        config = served_config(section, vllm_compat.model_dtype(worker), max_tokens, vllm_compat.is_eager(worker))
    if config is None:
        return
    for listener in on_weights_loaded:
        listener()
    if config.eager != vllm_compat.is_eager(worker):
        raise ValueError(f"this engine was asked for the {'eager' if config.eager else 'compiled'} flavour, "
                         f"but vLLM's enforce_eager is {vllm_compat.is_eager(worker)}: something other than the "
                         "inspector changed that setting (another vLLM plugin may have: VLLM_PLUGINS="
                         f"{os.environ.get('VLLM_PLUGINS', '(all installed)')})")
    unsupported = vllm_compat.unsupported_parallelism(worker)
    if unsupported:
        raise ValueError(f"the inspector cannot capture under {unsupported}; use tensor or pipeline "
                         "parallelism (tensor_parallel_size, pipeline_parallel_size)")
    model = vllm_compat.model_of(worker)
    if not vllm_compat.generates_tokens(model):
        raise RuntimeError(f"vLLM runs this model as {type(model).__name__}, a pooling or embedding model that "
                           "predicts no tokens: the inspector reads models that generate text (checkpoints whose "
                           "architecture is a ...ForCausalLM or ...ForConditionalGeneration)")
    vllm_compat.run_hooks_on_forward_calls(model)
    hidden, max_model_len, max_tokens = vllm_compat.model_sizes(worker)
    started = time.perf_counter()

    def read(blocks_path, blocks, first, embeds, final_norm):
        return reader.read(model, blocks_path, blocks, final_norm, embeds, hidden, config.dtype,
                           lambda on_attention: vllm_compat.probe_forward(worker, PROBE_TOKENS, on_attention), first)

    family, points, refused = hookpoints.catalogue(model, hidden, config.dtype, read, vllm_compat.tensor_parallel(worker))
    verdict = probe.verify(model, points, config.dtype,
                           lambda: vllm_compat.probe_forward(worker, PROBE_TOKENS))
    probe_seconds = time.perf_counter() - started
    logger.info("block reader and boot probe (%s): %d hook points, %d withdrawn, %.2f s", family.name, len(points),
                len(verdict.withdrawn), probe_seconds)
    for name, why in verdict.withdrawn.items():
        logger.warning("hook point %s withdrawn: %s", name, why)
    for name, routing in verdict.unrouted.items():
        logger.warning("hook point %s: its chosen experts are not recomputed: %s", name, routing.unsupported)
    for name, why in verdict.unsteerable.items():
        logger.warning("hook point %s cannot be steered: %s", name, why)
    points = [(replace(p, withdrawn=verdict.withdrawn.get(p.name, ""), routing=verdict.unrouted.get(p.name, p.routing),
                       unsteerable=verdict.unsteerable.get(p.name, "")), site) for p, site in points]
    for kind, why in refused.items():
        logger.info("%s: %s not offered because %s", type(model).__name__, kind, why)
    runtime = InspectorRuntime(model, points, config, vllm_compat.device_of(worker),
                               max(max_tokens, config.max_num_batched_tokens), max_model_len, family.name,
                               {kind: f"{type(model).__name__}: {kind} not offered because {why}"
                                for kind, why in refused.items()},
                               tuple(path for path, m in model.named_modules() if vllm_compat.is_pipeline_placeholder(m)))
    runtime.probe_seconds = probe_seconds
    explicit = {runtime.resolve(name, *spec).name for name, spec in runtime.local(config.capture_specs).items()}
    matched = {name: spec for name, spec in runtime.match(config.hook_patterns).items() if name not in explicit}
    runtime.install({**config.capture_specs, **matched})
    vllm_compat.count_as_model_memory(worker, runtime.allocated_bytes())
    vllm_compat.wrap_model_forward(worker, runtime.before_forward, runtime.after_forward)
    if vllm_compat.tensor_parallel(worker).rank == 0:  # vLLM may gather the logits onto every rank: one reads them
        vllm_compat.watch_logits(worker, runtime.on_logits)
    vllm_compat.watch_scheduled_requests(worker, functools.partial(_read_requests, runtime))
    # Outermost: each step's forward and sampling start a fresh frame-stack chunk, so that neither the hooks'
    # locals (they deepen the compiled forward) nor the plugin's wrappers put a loop of calls across a chunk's end.
    run_methods_in_fresh_stack_chunks(worker, vllm_compat.WORKER_STEPS)
    setattr(worker, _ATTR, runtime)
    _offer_extension(worker)
    for listener in on_hooks_installed:
        listener()


def _read_requests(runtime: InspectorRuntime, new: dict[str, tuple[dict, int]], finished: set[str]) -> None:
    """What requests carry themselves (the OpenAI server writes it; request_edits.py): their edits and,
    on a server that keeps no rows by default, whether and where to keep theirs."""
    edits, options = {}, {}
    for rid, (extra, prompt_tokens) in new.items():
        unread = sorted(k for k in extra if k.startswith(CLIENT_PREFIX) and k not in (EDIT_KEY, CAPTURE_KEY))
        if unread:
            _report_unread_fields(rid, unread)
        if EDIT_KEY in extra:
            try:
                edits[rid] = decode_edit(extra[EDIT_KEY], rid)
            except (ValueError, KeyError, TypeError) as e:  # the server checked it: a request from elsewhere
                logger.error("request %s runs without its edit, which cannot be read: %s", rid, e)
        if not runtime.config.capture_rows:
            window = extra.get(CAPTURE_KEY)
            options[rid] = {"capture": isinstance(window, str)}
            if isinstance(window, str):
                options[rid].update(windows={name: window for name in runtime.active}, prompt_tokens=prompt_tokens)
    runtime.set_request_edits(edits, finished)
    if options or finished:
        runtime.set_request_options(options, list(finished))


_unread_reported = False


def _report_unread_fields(rid: str, fields: list[str]) -> None:
    """A request came with a client's steering or capture fields, which the server's middleware turns
    into what the workers read: the endpoint plugin is not in this server. The worker cannot refuse it
    (an exception in a step stops the engine for everyone), so the log says it, loudly, once."""
    global _unread_reported
    if _unread_reported:
        return
    _unread_reported = True
    logger.error("request %s carries %s, which only the inspector's endpoint plugin reads, and this server runs "
                 "without it: such requests run unsteered and keep no rows. Start the server with `inspector serve "
                 "--openai`, or let vLLM load both plugins (VLLM_PLUGINS must name activation_inspector if set)",
                 rid, ", ".join(fields))


def _offer_extension(worker) -> None:
    """Give the worker our RPC methods when vLLM was started without ``worker_extension_cls`` (``vllm
    serve``): ``collective_rpc("inspector_…")`` looks them up on the worker by name."""
    for name, method in vars(InspectorWorkerExtension).items():
        if name.startswith(("inspector_", "_inspector")) and not hasattr(worker, name):
            setattr(worker, name, types.MethodType(method, worker))


class InspectorWorkerExtension:
    def _inspector(self) -> InspectorRuntime:
        runtime = getattr(self, _ATTR, None)
        if runtime is None:
            raise RuntimeError(PLUGIN_MISSING)
        return runtime

    def inspector_describe(self) -> dict:
        return self._inspector().describe()

    def inspector_drain(self, wait: bool | list[str] = True, portable: bool = False) -> dict:
        """Captures since the last drain, a ``DrainedRequest`` by request; ``wait=False`` leaves steps
        still copying for later, a list of request ids waits only for those requests' rows.
        ``portable``: the rows alone, as plain dicts of ``capture.portable`` arrays
        (``drain_from_portable`` reads them), for vLLM's own RPC, which sends neither our types nor
        typed arrays (and fails the engine on what it cannot send)."""
        drained = self._inspector().drain(wait)
        if not portable:
            return drained
        return {rid: {hook: {key: to_portable(found[key]) for key in ROW_KEYS}
                      for hook, found in request.rows.items()} for rid, request in drained.items()}

    def inspector_queued_positions(self, request_ids: list[str]) -> dict[str, int]:
        return self._inspector().queued_positions(list(request_ids))

    def inspector_request_options(self, options: dict[str, dict], forget: list[str]) -> None:
        self._inspector().set_request_options(dict(options), list(forget))

    def inspector_set_interventions(self, interventions: list[dict]) -> None:
        self._inspector().set_interventions([Intervention.from_dict(d) for d in interventions])

    def inspector_clear_interventions(self) -> None:
        self._inspector().set_interventions([])

    def inspector_set_python_hooks(self, functions: dict) -> None:
        """Python functions on installed hooks' rows (``python_hooks``), replacing those set before: eager
        mode only, and only where the engine runs in the caller's process (the functions are the
        caller's objects, not copies)."""
        runtime = self._inspector()
        if functions and not runtime.config.eager:
            raise RuntimeError("Python hook functions run only in eager mode: the compiled graph cannot call them")
        unknown = sorted(set(functions) - runtime.active.keys())
        if unknown:
            raise ValueError(f"no installed hook named {unknown[0]!r}")
        runtime.python_hooks.set(functions)

    def inspector_set_row_sink(self, sink) -> None:
        """The caller's consumer of each forward's rows on the device, in place of the host copies (None:
        back to them); only where the engine runs in the caller's process."""
        self._inspector().row_sink = sink

    def inspector_python_hook_error(self):
        """The first exception a Python hook function raised since the last call (None if none)."""
        return self._inspector().python_hooks.take_error()

    def inspector_set_hook_patterns(self, patterns: list[str]) -> dict:
        """Make the installed hooks exactly those matching ``patterns``; returns name → point."""
        runtime = self._eager_runtime("changed")
        wanted = runtime.match(tuple(patterns))
        runtime.remove([name for name in runtime.active if name not in wanted])
        runtime.install({name: spec for name, spec in wanted.items() if name not in runtime.active})
        return runtime.describe()["installed"]

    def inspector_add_hooks(self, specs: dict[str, tuple[str, int]]) -> None:
        runtime = self._eager_runtime("added")
        runtime.install({name: (path, int(width)) for name, (path, width) in specs.items()})

    def inspector_remove_hooks(self, names: list[str]) -> None:
        self._eager_runtime("removed").remove(list(names))

    def inspector_attach_sae(self, config: dict, hook: str, k: int) -> None:
        self._inspector().attach_sae(AttachedSae(SaeConfig(**config), hook, int(k)))

    def inspector_detach_sae(self, name: str) -> None:
        self._inspector().detach_sae(name)

    def inspector_lens(self, values, k: int, chosen=None) -> dict:
        """The logit lens of residual-stream rows (checked by the caller): top ``k`` and ``chosen``;
        nothing from a rank without the model's head (another pipeline stage holds it)."""
        runtime = self._inspector()
        if runtime.head_elsewhere():
            return {}
        dtype = next(runtime.model.parameters()).dtype
        return lens.lens(runtime.model, lens.final_norm(runtime.model, runtime.catalogue), values, int(k), chosen,
                         runtime.device, dtype)

    def inspector_logits(self, values) -> dict:
        """The model's logits of final-norm output rows (checked by the caller), float32 [rows, vocab];
        nothing from a rank without the model's head."""
        runtime = self._inspector()
        if runtime.head_elsewhere():
            return {}
        dtype = next(runtime.model.parameters()).dtype
        return {"logits": lens.logits(runtime.model, values, runtime.device, dtype)}

    def inspector_attribution(self, values, residual, k: int, chosen=None) -> dict:
        """Direct logit attribution of component rows (checked by the caller): top ``k`` and ``chosen``;
        nothing from a rank without the model's head."""
        runtime = self._inspector()
        if runtime.head_elsewhere():
            return {}
        dtype = next(runtime.model.parameters()).dtype
        return lens.attribution(runtime.model, lens.final_norm(runtime.model, runtime.catalogue), values, residual,
                                int(k), chosen, runtime.device, dtype)

    def inspector_final_norm_kind(self) -> dict:
        """Whether the model's final norm centres (LayerNorm) and its epsilon; nothing from a rank without
        the model's head."""
        runtime = self._inspector()
        if runtime.head_elsewhere():
            return {}
        dtype = next(runtime.model.parameters()).dtype
        centred, eps = lens.norm_kind(lens.final_norm(runtime.model, runtime.catalogue), runtime.device, dtype)
        return {"centred": centred, "eps": eps}

    def inspector_compilation_count(self) -> int:
        return vllm_compat.compilation_count()

    def _eager_runtime(self, verb: str) -> InspectorRuntime:
        runtime = self._inspector()
        if not runtime.config.eager:
            raise RuntimeError(f"hooks cannot be {verb} in compiled mode: they are traced into the graph "
                               "at boot; restart the engine with the new hook set, or use eager mode")
        return runtime
