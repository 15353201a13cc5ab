"""An engine session: one model booted with the plugin, generation as a stream of step events.

The session drives vLLM step by step (``add_request``/``step``), drains the worker's captures after
every step and yields them as plain dataclasses and numpy arrays, keeping everything in ``run``.
Draining every step, without waiting for copies still in flight, spreads the host's work evenly:
on the H200 a drain of one batch-32 step hides behind the next forward, while a drain of four
forwards (every 20 ms) did not and halved decode throughput.
``stop()`` and ``set_interventions()`` may be called from another thread (the UI's): they take effect
between steps, before the next forward.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from inspector import __version__
from inspector.capture.run import HookInfo, HookRows, RequestCapture, Run
from inspector.plugin.interventions import Intervention, validate

from .boot import MODES, boot_llm, shutdown_llm
from .models import model_config, resolve_model
from .tokens import token_text


class SessionError(RuntimeError):
    """The engine could not boot, or failed while running; the message says why."""


@dataclass(frozen=True)
class BootProgress:
    stage: str  # resolving | loading | compiling | ready
    message: str


@dataclass(frozen=True)
class SessionOptions:
    model: str = "demo"
    mode: str = "compiled"
    hooks: tuple[str, ...] = ("blocks.*.hook_resid_post",)  # names, aliases or glob patterns
    dtype: str = "float32"
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    enable_position_interventions: bool = True
    retain_rows: bool = True  # False: rows only reach the step events (a streaming writer keeps them)
    engine_args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int = 5
    ignore_eos: bool = False

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class RequestStep:
    request_id: str
    new_token_ids: tuple[int, ...]
    new_texts: tuple[str, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    rows: dict  # hook name -> (positions [n], token_ids [n], values [n, width] float32)
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class StepEvent:
    step: int
    requests: tuple[RequestStep, ...]


class Session:
    """Use ``Session.open(options, progress)``; close it to free the engine for another."""

    # Class-wide, so request ids stay unique across the sessions of one process: the app keeps
    # showing a run while it reopens the engine, and a new "req0" would land in the old one.
    _next_id = 0

    def __init__(self, options: SessionOptions, llm, model_path, catalogue: list[HookInfo],
                 installed: dict[str, HookInfo]):
        self.options = options
        self.model_path = model_path
        self.catalogue = catalogue
        self.installed = installed
        self.alive = True
        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pending: list[Intervention] | None = None
        self._interventions: list[Intervention] = []
        self._fed: dict[str, int] = {}  # request id -> positions computed so far
        self.new_run()

    # --- opening and closing ---

    @classmethod
    def open(cls, options: SessionOptions, progress: Callable[[BootProgress], None] | None = None) -> "Session":
        report = progress or (lambda p: None)
        if options.mode not in MODES:
            raise SessionError(f"engine mode must be one of {MODES}, got {options.mode!r}")
        report(BootProgress("resolving", f"resolving model {options.model}"))
        try:
            path = resolve_model(options.model)
        except ValueError as e:
            raise SessionError(str(e)) from None
        llm = _boot(options, path, report)
        try:
            catalogue, installed = _describe(llm)
        except Exception:
            shutdown_llm(llm)
            raise
        report(BootProgress("ready", f"{path.name} ready ({options.mode}, {len(installed)} hooks)"))
        return cls(options, llm, path, catalogue, installed)

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            self.alive = False
            shutdown_llm(llm)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def new_run(self) -> None:
        self.run = Run(metadata=self._metadata(), hooks=dict(self.installed))

    # --- generation ---

    def generate(self, prompts: list[str], sampling: Sampling = Sampling()) -> Iterator[StepEvent]:
        """Submit ``prompts`` as one batch and yield an event per engine step until all finish or
        ``stop()`` is called (then the unfinished ones end with finish reason "stopped")."""
        self._require_alive()
        if not prompts:
            raise ValueError("nothing to generate: no prompts")
        engine = self._llm.llm_engine
        params = _sampling_params(sampling)
        self._stop.clear()
        ids = self.upcoming_request_ids(len(prompts))
        type(self)._next_id += len(ids)
        for rid, prompt in zip(ids, prompts):
            self.run.requests[rid] = RequestCapture(rid, prompt, [], sampling.as_dict())
            self._fed[rid] = 0
            try:
                engine.add_request(rid, prompt, params)
            except Exception as e:
                self._abort(ids)
                raise ValueError(f"request refused: {e}") from None
        self._apply_interventions(ids, force=True)
        open_ids = set(ids)
        for step in itertools.count():
            if not open_ids:
                return
            if self._stop.is_set():
                leftover = self._abort(sorted(open_ids))
                yield StepEvent(step, tuple(self._finish(rid, "stopped", leftover.get(rid, {}))
                                            for rid in sorted(open_ids)))
                return
            self._apply_interventions(sorted(open_ids))
            try:
                outputs = engine.step()
                # Rows still copying arrive with a later step, except a finishing request's: wait for those.
                finishing = any(out.finished for out in outputs if out.request_id in open_ids)
                captures = self._drain(wait=finishing)
            except Exception as e:
                self.alive = False
                with contextlib.suppress(Exception):  # keep the finished forwards' rows, if the worker can
                    self._record_drained(open_ids)
                raise SessionError(f"the engine failed while generating: {type(e).__name__}: {e}. "
                                   "Everything captured so far is kept; open a new session to go on.") from e
            events = {rid: self._record_rows(rid, rows) for rid, rows in captures.items() if rid in open_ids}
            for out in outputs:
                if out.request_id in open_ids:
                    events[out.request_id] = self._record_output(out, events.get(out.request_id, {}))
                    if out.finished:
                        open_ids.discard(out.request_id)
            yield StepEvent(step, tuple(ev if isinstance(ev, RequestStep) else self._rows_only(rid, ev)
                                        for rid, ev in events.items()))

    def upcoming_request_ids(self, n: int) -> list[str]:
        """The ids the next ``generate`` of ``n`` prompts will give its requests (for scoping)."""
        return [f"req{self._next_id + i}" for i in range(n)]

    def stop(self) -> None:
        """Thread-safe: generation ends before the next step; what was captured stays."""
        self._stop.set()

    # --- interventions and hooks ---

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """Thread-safe. Validated at once (ValueError); applied before the next forward."""
        resolved = []
        widths = {name: info.width for name, info in self.installed.items()}
        for iv in interventions:
            iv = replace(iv, hook=self.hook_name(iv.hook))
            validate(iv, widths, self.options.max_model_len, self.options.enable_position_interventions)
            resolved.append(iv)
        with self._lock:
            self._pending = resolved

    @property
    def interventions(self) -> list[Intervention]:
        with self._lock:
            return list(self._pending if self._pending is not None else self._interventions)

    def catalogue_tree(self) -> dict:
        """The catalogue grouped like the module tree: nested dicts by module path component; the
        hook points of a module sit under the key ``"hooks"``."""
        tree: dict = {}
        for info in self.catalogue:
            node = tree
            for part in info.module_path.split("."):
                node = node.setdefault(part, {})
            node.setdefault("hooks", []).append(info)
        return tree

    def hook_name(self, name_or_alias: str) -> str:
        """The installed hook a name or alias refers to (ValueError if none)."""
        if name_or_alias in self.installed:
            return name_or_alias
        for name, info in self.installed.items():
            if info.alias == name_or_alias:
                return name
        raise ValueError(f"{name_or_alias!r} is not an installed hook point")

    def set_hooks(self, patterns: list[str]) -> bool:
        """Change the hook set. Eager: live, returns False. Compiled: restarts the engine (the hooks
        are traced into the graph), returns True. The current run is kept either way."""
        self._require_alive()
        self._check_patterns(patterns)
        if self.options.mode == "eager":
            self._llm.collective_rpc("inspector_set_hook_patterns", args=(list(patterns),))
            _, self.installed = _describe(self._llm)
        else:
            run = self.run
            self.close()
            options = replace(self.options, hooks=tuple(patterns))
            self._llm = _boot(options, self.model_path, lambda p: None)
            self.options, self.alive = options, True
            self._tokenizer = self._llm.get_tokenizer()
            _, self.installed = _describe(self._llm)
            self.run = run
        self.run.hooks.update(self.installed)
        with self._lock:
            self._interventions = [iv for iv in self._interventions if iv.hook in self.installed]
            self._pending = list(self._interventions)
        return self.options.mode == "compiled"

    # --- internals ---

    def _check_patterns(self, patterns: list[str]) -> None:
        for pattern in patterns:
            if not any(h.matches(pattern) for h in self.catalogue):
                raise ValueError(f"hook pattern {pattern!r} matches no hook point of this model")

    def _require_alive(self) -> None:
        if not self.alive or self._llm is None:
            raise SessionError("this session is closed or its engine failed; open a new session")

    def _apply_interventions(self, open_ids: list[str], force: bool = False) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        queued = {}
        if pending is not None:
            self._llm.collective_rpc("inspector_set_interventions", args=([_as_dict(iv) for iv in pending],))
            self._interventions = pending
            # forwards already queued (async scheduling) or not yet drained run before the change
            queued = self._llm.collective_rpc("inspector_queued_positions", args=(open_ids,))[0]
        elif not force:
            return
        for rid in open_ids:
            active = [_as_dict(iv) for iv in self._interventions if iv.request_id in (None, rid)]
            log = self.run.requests[rid].intervention_log
            if not log or log[-1][1] != active:
                log.append((max(self._fed[rid], queued.get(rid, 0)), active))

    def _drain(self, wait: bool = True) -> dict:
        """The worker's rows since the last drain; ``wait=False`` leaves those still copying."""
        return self._llm.collective_rpc("inspector_drain", kwargs={"wait": wait})[0]

    def _record_drained(self, keep) -> dict:
        """Drain the worker (waiting for copies in flight) and record the rows of the requests in
        ``keep``; returns them per request."""
        return {rid: self._record_rows(rid, rows) for rid, rows in self._drain().items() if rid in keep}

    def _record_rows(self, rid: str, captures: dict) -> dict:
        req = self.run.requests[rid]
        rows = {}
        for hook, c in captures.items():
            values = c["values"].astype(np.float32, copy=False)
            rows[hook] = (c["positions"], c["token_ids"], values)
            if self.options.retain_rows:
                req.hooks.setdefault(hook, HookRows(self.installed[hook].width)).append(*rows[hook])
            self._fed[rid] = max(self._fed[rid], int(c["positions"][-1]) + 1)
        return rows

    def _record_output(self, out, rows: dict) -> RequestStep:
        req = self.run.requests[out.request_id]
        if not req.prompt_token_ids:
            req.prompt_token_ids = list(out.prompt_token_ids)
            req.token_texts = [self._text(t) for t in req.prompt_token_ids]
        completion = out.outputs[0]
        new_ids = tuple(completion.token_ids)
        texts = tuple(self._text(t) for t in new_ids)
        chosen, tops = [], []
        for token, entry in zip(new_ids, completion.logprobs or []):
            chosen.append(float(entry[token].logprob) if token in entry else float("nan"))
            tops.append(tuple(sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()),
                                     key=lambda x: -x[1])))
        req.generated_token_ids += new_ids
        req.token_texts += texts
        req.logprobs += chosen
        req.top_logprobs += [list(t) for t in tops]
        reason = completion.finish_reason if out.finished else None
        if out.finished:
            req.finish_reason = str(reason)
        return RequestStep(out.request_id, new_ids, texts, tuple(chosen), tuple(tops), rows, out.finished, reason)

    def _rows_only(self, rid: str, rows: dict) -> RequestStep:
        return RequestStep(rid, (), (), (), (), rows, False, None)

    def _finish(self, rid: str, reason: str, rows: dict) -> RequestStep:
        self.run.requests[rid].finish_reason = reason
        return RequestStep(rid, (), (), (), (), rows, True, reason)

    def _abort(self, ids: list[str]) -> dict:
        """Abort requests; returns the rows still in the worker, per request (recorded in the run too)."""
        self._llm.llm_engine.abort_request(ids)
        return self._record_drained(self.run.requests)

    def _text(self, token_id: int) -> str:
        return token_text(self._tokenizer, token_id)

    def _metadata(self) -> dict:
        import torch
        import vllm

        return {
            "app_version": __version__,
            "vllm_version": vllm.__version__,
            "torch_version": torch.__version__,
            "model": self.options.model,
            "model_path": str(self.model_path),
            "model_config": model_config(self.model_path),
            "dtype": self.options.dtype,
            "engine_mode": self.options.mode,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }


def _boot(options: SessionOptions, path, report: Callable[[BootProgress], None]):
    from inspector.plugin import worker_extension

    def compiling():
        report(BootProgress("compiling", "weights loaded, hooks installed; "
                            + ("compiling the model (the first boot of a model takes longest)"
                               if options.mode == "compiled" else "warming up")))

    report(BootProgress("loading", f"loading {path.name} ({options.dtype}, {options.mode})"))
    worker_extension.on_hooks_installed.append(compiling)
    try:
        return boot_llm(str(path), mode=options.mode, dtype=options.dtype, hook_patterns=tuple(options.hooks),
                        max_num_batched_tokens=options.max_num_batched_tokens, max_model_len=options.max_model_len,
                        enable_position_interventions=options.enable_position_interventions,
                        **options.engine_args)
    except Exception as e:
        raise SessionError(f"could not start the engine on {path}: {_root_cause(e)}") from e
    finally:
        worker_extension.on_hooks_installed.remove(compiling)


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return f"{type(e).__name__}: {e}"


def _describe(llm) -> tuple[list[HookInfo], dict[str, HookInfo]]:
    info = llm.collective_rpc("inspector_describe")[0]
    catalogue = [HookInfo.from_point(p, info["dtype"]) for p in info["hook_points"]]
    by_name = {h.name: h for h in catalogue}
    installed = {name: replace(by_name[point], name=name) for name, point in info["installed"].items()}
    return catalogue, installed


def _sampling_params(s: Sampling):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if s.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {s.max_tokens}")
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                          top_k=s.top_k if s.top_k > 0 else -1, seed=s.seed, logprobs=s.logprobs or None,
                          ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.DELTA)


def _as_dict(iv: Intervention) -> dict:
    return {"hook": iv.hook, "scale": iv.scale, "bias": iv.bias, "request_id": iv.request_id,
            "positions": None if iv.positions is None else list(iv.positions)}
