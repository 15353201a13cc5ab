"""The session boundary: what a front end (the app, the CLI, a network client) may ask of whatever runs
the engine, and the plain values that cross it.

The in-process ``inspector.engine.session.Session`` implements ``SessionProtocol``; so does the test
fake. Step events carry everything a front end shows (the requests' prompts when they start, new
tokens, rows, intervention-log entries), so ``fold_event`` rebuilds the engine's ``Run`` from them
alone: a front end never reads another thread's (or process's) run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, NamedTuple, Protocol

import numpy as np

from .hooks import HookPoint, installed_name
from .interventions import DEFAULT_MAX_SLOTS, Intervention, check_clamp_capacity, validate
from .lens import Attribution, Lens
from .sae import AttachedSae
from .blocks import RowBlocks
from .drained import Features, Scores
from .run import FeatureRows, HookRows, RequestCapture, Run, TopToken
from .windows import CaptureWindow

MODES = ("compiled", "eager")
BOOT_STAGES = ("resolving", "loading", "probing", "compiling", "ready")


class SessionError(RuntimeError):
    """The engine could not boot, or failed while running; the message says why."""


@dataclass(frozen=True)
class BootProgress:
    stage: str  # one of BOOT_STAGES, or "starting": the app's own engine process, before its server listens
    message: str


class BootTimes:
    """How long each boot stage took, from the reports as they come: where a slow boot spends its time."""

    def __init__(self):
        self.started = self._since = time.monotonic()
        self.stage: str | None = None
        self.seconds: dict[str, float] = {}  # of the stages over

    NOTABLE_S = 0.1  # stages shorter than this go unsaid

    def lap(self, stage: str) -> str:
        """``stage`` begins now: what the one before it took (before the first report: "starting", the
        engine's process coming up), or "" if that was too short to say."""
        now = time.monotonic()
        over, self.stage, since, self._since = self.stage or "starting", stage, self._since, now
        self.seconds[over] = self.seconds.get(over, 0.0) + now - since
        return f"{over} took {now - since:.1f} s" if now - since >= self.NOTABLE_S else ""

    def summary(self) -> str:
        """"loading 27 s · probing 0.3 s · compiling 14 s": the stages over, in order."""
        return " · ".join(f"{stage} {seconds:.{0 if seconds >= 10 else 1}f} s"
                          for stage, seconds in self.seconds.items() if seconds >= self.NOTABLE_S)


@dataclass(frozen=True)
class SessionOptions:
    model: str = "demo"
    mode: str = "compiled"
    hooks: tuple[str, ...] = ("blocks.*.hook_resid_post",)  # names, aliases or glob patterns
    dtype: str = "float32"
    max_model_len: int = 1024
    max_num_batched_tokens: int = 512
    enable_position_interventions: bool = True
    retain_rows: bool = True  # False: rows only reach the step events (the consumer keeps them)
    max_slots: int = DEFAULT_MAX_SLOTS  # per hook: see inspector.core.interventions
    # per hook, the SAE features one intervention set may clamp; each hook's room for them costs every compiled
    # forward (on an H200, 9% of a batch-1 decode step with 32 hooks), so there is none unless asked for
    feature_clamps: int = 0
    # capture windows applied when the session opens: (glob pattern over installed hook names and aliases,
    # window text as in inspector.core.windows), a later pair overriding an earlier one; unnamed hooks: all
    windows: tuple[tuple[str, str], ...] = ()
    kept_layers: int = 0  # >0: boot only the model's first decoder blocks (nothing is computed past them)
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
    # False: no rows are captured for these requests (an experiment reads tokens and scores; a scan only the
    # features of attached SAEs, which still come)
    capture: bool = True
    # the logprob of each of these tokens wherever the model predicts (the prompt's last position, then every
    # generated one): RequestStep.scores
    score_token_ids: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def check_request(prompts: list[str], sampling: Sampling) -> None:
    """ValueError, saying what, for prompts and settings no request can run with: every session refuses
    them before anything starts (vLLM's own refusals came as engine failures)."""
    if not prompts:
        raise ValueError("nothing to generate: no prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {i} is a {type(prompt).__name__}, not text")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"prompt {i} is not valid Unicode text: {e.reason} at character {e.start}") from None
    check_sampling(sampling)


def check_sampling(s: Sampling) -> None:
    """ValueError, saying which, for settings no request can run with."""
    if s.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {s.max_tokens}")
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise ValueError(f"temperature must be 0 (greedy) or more, got {s.temperature}")
    if not (0 < s.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be 0 (no limit) or more, got {s.top_k}")
    if s.logprobs < 0:
        raise ValueError(f"logprobs must be 0 or more, got {s.logprobs}")
    if s.seed is not None and s.seed < 0:
        raise ValueError(f"seed must be 0 or more, got {s.seed}")


Rows = tuple[np.ndarray, np.ndarray, np.ndarray]  # positions [n], token ids [n], values [n, width] (dtypes.ROW_DTYPES)
NewRows = Callable[[RequestCapture, HookPoint, np.dtype], HookRows]  # a (request, hook)'s first rows: where they go


@dataclass(frozen=True)
class RequestStart:
    """A request as it is submitted: what a token strip needs before the first generated token."""

    request_id: str
    prompt: str
    prompt_token_ids: tuple[int, ...]
    prompt_texts: tuple[str, ...]
    sampling: dict
    windows: dict = field(default_factory=dict)  # hook -> capture window text; hooks not named: all


@dataclass(frozen=True)
class RequestStep:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_texts: tuple[str, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[tuple[TopToken, ...], ...] = ()
    rows: dict[str, Rows] = field(default_factory=dict)  # hook name -> rows
    # log entries new with this step: (first position computed under the set, the set as dicts)
    intervention_log: tuple[tuple[int, tuple[dict, ...]], ...] = ()
    finished: bool = False
    finish_reason: str | None = None
    # (positions [n], logprobs [n, len(score_token_ids)]): at each position predicted from in this step
    scores: Scores | None = None
    features: dict[str, Features] = field(default_factory=dict)  # attached SAE -> its strongest features
    windows: dict[str, str] | None = None  # capture windows changed: in force from this step's forward on


@dataclass(frozen=True)
class StepEvent:
    """One engine step. Every request appears in ``started`` of exactly one event, at or before its
    first ``RequestStep``; a generation's last event finishes every request it started."""

    step: int
    requests: tuple[RequestStep, ...]
    started: tuple[RequestStart, ...] = ()
    # the rows' arrays are this event's alone (nothing writes them again or frees their memory for
    # reuse): a run keeps them as they are instead of copying each (``HookRows.keep``)
    owns_rows: bool = False
    # the requests' rows in bulk (a block a forward drained), where the engine laid them out so; then
    # each request's ``rows`` are views of them (``RequestRowsView``), and keeping, writing or sending
    # the step goes hook by hook
    blocks: tuple[RowBlocks, ...] | None = None


class Prefilled(NamedTuple):
    """A context's rows from a session's ``prefill`` (in process or a server's): per drain that brought
    some (chunked prefill may split a context over steps), hook → positions, token_ids, values."""

    index: int  # the context's place among those given
    tokens: int
    parts: tuple


class SessionProtocol(Protocol):
    """One booted engine. ``stop`` and ``set_interventions`` may be called from any thread (they take
    effect between steps); everything else belongs to one thread at a time."""

    options: SessionOptions
    catalogue: list[HookPoint]  # every hook point the model offers
    installed: dict[str, HookPoint]  # the ones captured now, by name
    run: Run  # everything captured since the last new_run()
    alive: bool  # False once closed or failed (a remote one also once its server stops answering)
    interventions: list[Intervention]  # the set last given to set_interventions
    saes: dict[str, AttachedSae]  # by name: SAEs encoding installed hooks' rows in the engine
    windows: dict[str, CaptureWindow]  # installed hook -> its capture window (hooks not named: all)

    def generate(self, prompts: list[str], sampling: Sampling = Sampling()) -> Iterator[StepEvent]: ...

    def stop(self) -> None: ...

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """Validated at once (ValueError with the reason, nothing changed); applied before the next forward."""

    def set_windows(self, windows: dict[str, CaptureWindow]) -> None:
        """Capture windows by installed hook name or alias (hooks not named: all). Validated at once
        (ValueError, nothing changed); thread-safe; applies from the next forward on, to running requests
        and later ones."""

    def set_hooks(self, patterns: list[str]) -> bool:
        """Change the hook set; True if that restarted the engine (compiled mode). The run is kept."""

    def upcoming_request_ids(self, n: int) -> list[str]:
        """The ids the next ``generate`` of ``n`` prompts will give its requests (to scope interventions)."""

    def lens(self, values, k: int = 5, chosen=None) -> Lens:
        """The logit lens of residual-stream rows [rows, hidden] (see ``Lens``): the model's own final
        norm and unembedding, on the engine's device. ValueError for rows or ids that do not fit."""

    def attribution(self, values, final_residual, k: int = 5, chosen=None) -> Attribution:
        """Direct logit attribution of component rows [rows, hidden] (see ``Attribution``), the final
        norm's scale frozen at ``final_residual`` (the rows entering the final norm at the same
        positions). ValueError for rows or ids that do not fit."""

    def token_texts(self, ids) -> list[str]:
        """The text of each token id, as step events give tokens (the lens gives only ids).
        ValueError for an id outside the vocabulary."""

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The model's token ids for ``text``: as a continuation, or (``add_special_tokens``) as a prompt is
        tokenized (a BOS where the model's tokenizer adds one)."""

    def attach_sae(self, path, hook: str | None = None, k: int = 32) -> AttachedSae:
        """Encode ``hook``'s rows (installed; default: the hook the SAE's config names) with the SAE in
        directory ``path`` (on the engine's machine) after every forward; each row's ``k`` strongest
        features arrive in ``RequestStep.features`` and ``run``. SaeError or ValueError naming what does
        not fit, and nothing attached."""

    def detach_sae(self, name: str) -> None: ...

    def new_run(self) -> None:
        """A new, empty ``run`` (rows in memory again: see ``write_through``)."""

    def write_through(self, new_rows: NewRows) -> None:
        """From now on, ``run`` keeps rows of new (request, hook) pairs where ``new_rows`` puts them
        (``inspector.io.spool.RowSpool.rows``: written through to a file, read back on demand), not in
        memory; until ``new_run``."""

    def close(self) -> None: ...


SessionFactory = Callable[[SessionOptions, Callable[[BootProgress], None]], SessionProtocol]


def checked_interventions(interventions: list[Intervention], installed: dict[str, HookPoint],
                          options: SessionOptions) -> list[Intervention]:
    """``interventions`` with their hooks named as installed, each validated (ValueError with the
    reason): what every session does before accepting a set."""
    widths = {name: info.width for name, info in installed.items()}
    checked = []
    for iv in interventions:
        iv = replace(iv, hook=installed_name(iv.hook, installed))
        validate(iv, widths, options.max_model_len, options.enable_position_interventions)
        checked.append(iv)
    check_clamp_capacity(checked, options.feature_clamps)
    return checked


MAX_EXPECTED_ROWS = 4096  # room made at once per request and hook; a longer request grows as it goes


def fold_event(run: Run, event: StepEvent, keep_rows: bool = True, new_rows: NewRows | None = None) -> set[str]:
    """Add what ``event`` says to ``run``; returns the ids of the requests it changed. ``new_rows`` makes
    the rows a hook's first rows for a request go to (default: ``HookRows`` in memory; a write-through
    run's go to a file, ``inspector.io.spool``)."""
    for start in event.started:
        run.requests[start.request_id] = RequestCapture(
            start.request_id, start.prompt, list(start.prompt_token_ids), dict(start.sampling),
            token_texts=list(start.prompt_texts), windows=dict(start.windows))
    changed = {start.request_id for start in event.started}
    bulk = keep_rows and event.blocks is not None and new_rows is None
    for blocks in event.blocks if bulk else ():
        _keep_blocks(run, blocks if event.owns_rows else blocks.copied())
    for step in event.requests:
        req = run.requests[step.request_id]
        req.generated_token_ids += step.new_token_ids
        req.token_texts += step.new_texts
        req.logprobs += step.logprobs
        req.top_logprobs += [list(top) for top in step.top_logprobs]
        req.intervention_log += [(position, list(ivs)) for position, ivs in step.intervention_log]
        if step.windows is not None:
            req.windows = dict(step.windows)
        if step.scores is not None:
            req.scores.update(zip(step.scores[0].tolist(), step.scores[1]))
        for sae, (positions, ids, activations) in (step.features.items() if keep_rows else ()):
            req.features.setdefault(sae, FeatureRows(ids.shape[1])).append(positions, ids, activations)
        if keep_rows and not bulk:
            for hook, rows in step.rows.items():
                if hook not in req.hooks and new_rows is not None:
                    info = run.hooks.get(hook) or HookPoint(hook, hook, "", "unknown", rows[2].shape[1])
                    req.hooks[hook] = new_rows(req, info, rows[2].dtype)
                elif hook not in req.hooks:
                    expected = len(req.prompt_token_ids) + int(req.sampling.get("max_tokens") or 0)
                    req.hooks[hook] = HookRows(rows[2].shape[1], max(min(expected, MAX_EXPECTED_ROWS), len(rows[0])),
                                               rows[2].dtype)
                (req.hooks[hook].keep if event.owns_rows else req.hooks[hook].append)(*rows)
        if step.finished:
            req.finish_reason = step.finish_reason
        changed.add(step.request_id)
    return changed


def _keep_blocks(run: Run, blocks: RowBlocks) -> None:
    """A bulk step into ``run`` as it is: a call per hook, and per request only where it is new to
    these hooks (then its ``HookRows`` follow the run's bulk steps)."""
    hooks = tuple(blocks.values)
    for rid in blocks.request_ids:
        req = run.requests[rid]
        if req.bulk_hooks is hooks or req.bulk_hooks == hooks:
            continue
        for hook in hooks:
            rows = req.hooks.get(hook)
            if rows is None:
                expected = len(req.prompt_token_ids) + int(req.sampling.get("max_tokens") or 0)
                rows = req.hooks[hook] = HookRows(blocks.values[hook].shape[1], min(expected, MAX_EXPECTED_ROWS),
                                                  blocks.values[hook].dtype)
            if rows._source is None:
                rows.follow(run.bulk, rid, hook)
        req.bulk_hooks = hooks
    run.bulk.add(blocks)
