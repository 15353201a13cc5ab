"""vLLM's hold on the process an engine runs in: what its boot changes beyond the engine, kept to the
engine, and tearing an in-process engine down so that another can boot. Beside ``vllm_compat``, the
other module that touches vLLM's private internals (checked against the same versions); a leaf too."""

from __future__ import annotations

import functools
import gc
import weakref

import torch

_PATCHED_FLAG = "_inspector_patched"


def keep_transformers_classes_unedited() -> None:
    """vLLM's Transformers backend (the families vLLM has no code of its own for: GPT-NeoX, OLMo, Phi…)
    makes transformers' own model class compile itself by editing the class in place
    (``support_torch_compile``: a base class added, ``__init__`` and ``__call__`` replaced). In the process
    that booted the engine, transformers' model of that family then no longer loads (vLLM's ``__init__``
    asks for a vLLM config) or runs: a notebook comparing with transformers, or TransformerLens loading its
    weights, fails. Patched: once the backend has built its model, the edited classes' instances in it move
    to a private subclass holding the edits, and transformers' classes get back what they had."""
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:  # a vLLM without this backend module: nothing of it to keep in place
        return
    if getattr(Base.__init__, _PATCHED_FLAG, False) or not hasattr(Base, "_decorate_cls_for_torch_compile"):
        return
    decorate, build = Base._decorate_cls_for_torch_compile, Base.__init__
    edited: list[tuple[type, tuple, dict]] = []  # (class, its bases and attributes before the edit)

    @functools.wraps(decorate)
    def decorating(self, cls, *args, **kwargs):
        before = (cls.__bases__, dict(cls.__dict__))
        decorate(self, cls, *args, **kwargs)
        if cls.__bases__ != before[0]:  # edited now, not by an earlier engine
            edited.append((cls, *before))

    @functools.wraps(build)
    def building(self, *args, **kwargs):
        try:
            build(self, *args, **kwargs)
        finally:
            while edited:
                _move_edits_to_a_subclass(self, *edited.pop())

    setattr(building, _PATCHED_FLAG, True)
    Base._decorate_cls_for_torch_compile, Base.__init__ = decorating, building


def _move_edits_to_a_subclass(model: torch.nn.Module, cls: type, bases: tuple, attributes: dict) -> None:
    added = tuple(b for b in cls.__bases__ if b not in bases)
    edits = {k: v for k, v in cls.__dict__.items() if attributes.get(k, _MISSING) is not v}
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    private = type(cls.__name__, (cls, *added), {**edits, **names})
    for module in model.modules():
        if type(module) is cls:
            module.__class__ = private
    cls.__bases__ = bases
    for name in edits:
        if name in attributes:
            setattr(cls, name, attributes[name])
        else:
            delattr(cls, name)


_MISSING = object()


def _remove_own_placement_group(parallel_config) -> None:
    """Remove the Ray placement group vLLM created for an in-process engine: vLLM never does, and the
    next Ray engine in this process would wait forever for its devices. A group vLLM took over (the
    driver's own, from ``get_current_placement_group``) is the caller's and stays."""
    placement_group = parallel_config.placement_group
    if placement_group is None:  # not Ray, or the engine core ran in a process of its own
        return
    import ray

    if ray.is_initialized() and placement_group != ray.util.get_current_placement_group():
        ray.util.remove_placement_group(placement_group)


_engines_up: weakref.WeakSet = weakref.WeakSet()  # booted here (``booted``), not shut down nor collected


def booted(llm) -> None:
    _engines_up.add(llm)


def boot_failed() -> None:
    """A boot in this process failed: tear down what it left, unless an engine booted before it still
    runs on that state (vLLM's parallel groups are the process's, not an engine's)."""
    if not _engines_up:
        _forget_engine_state()


def shutdown_engine(llm) -> None:
    """Stop an in-process engine and, where no other engine of this process still runs, tear down
    vLLM's process-global state so that a new one can boot.

    The ``LLM`` object is unusable afterwards: its engine is dropped so that the model, the KV cache
    and any CUDA graphs are freed now, not when the caller lets go of the object."""
    engine, llm.llm_engine = llm.llm_engine, None
    engine.engine_core.shutdown()
    _remove_own_placement_group(engine.vllm_config.parallel_config)
    del engine
    _engines_up.discard(llm)  # an engine not booted by ``boot_llm`` (a bench's vanilla one) was never counted
    if _engines_up:
        gc.collect()
    else:
        _forget_engine_state()


def _forget_engine_state() -> None:
    """Tear down what in-process engines leave in the process: vLLM's parallel groups (a dense model's
    boot creates no expert-parallel group, and the next boot, finding groups made, would not make it),
    Dynamo's cache and the CUDA graph pool."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()
    torch._dynamo.reset()  # Dynamo's cache entries hold the compiled model (and its buffers) alive
    gc.collect()
    # vLLM captures every engine's CUDA graphs into one pool per process (a class attribute of the
    # platform). With its compile cache on, the old engine's graphs release that pool while a block
    # of it lives on, and the next engine's capture then fails an allocator assertion: start a new one.
    from vllm.platforms import current_platform

    type(current_platform)._global_graph_pool = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
