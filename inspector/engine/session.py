"""The in-process engine session: one model booted with the plugin, generation as a stream of step events.

``Session`` implements ``inspector.core.protocol.SessionProtocol``. It drives vLLM step by step
(``submit``, ``step``, ``cancel``: requests join the running batch at any step, which is how a
server serves many clients at once; ``generate`` is that loop for one caller), drains the worker's
captures after every step without waiting for copies still in flight (so the host's work of one step
hides behind the next forward), and makes step events that it also folds into ``run``. ``stop()`` and
``set_interventions()`` may be called from another thread: they take effect between steps, before the
next forward. Booting and describing the engine is ``opening``'s, the model's head on rows a caller
hands in ``head``'s, and turning vLLM's values into the protocol's ``translation``'s.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import os
import threading
from dataclasses import replace
from typing import Callable, Iterable, Iterator, Sequence

from inspector import __version__
from inspector.core.blocks import RequestRowsView
from inspector.core.drained import DrainedRequest
from inspector.core.hooks import HookPoint, check_patterns
from inspector.core.interventions import Intervention
from inspector.core.lens import checked_token_ids
from inspector.core.models import model_config
from inspector.core.protocol import (BootProgress, Prefilled, RequestStart, RequestStep, Rows, Sampling,
                                        SessionError, SessionOptions, StepEvent, check_request)
from inspector.core.ranks import merge_ranks
from inspector.core.request_edits import encode_edit
from inspector.core.sae import AttachedSae, checked_attachment
from inspector.core.session_base import HeldInterventions, SessionBase
from inspector.core.windows import CaptureWindow, checked_windows, windows_from_patterns
from inspector.experiments.methods import Experiments
from inspector.plugin.gather import bulk_of

from .boot import shutdown_llm
from .head import ModelHead
from .opening import boot_engine, describe_engine, open_engine
from .tokens import token_text
from .translation import drained_rows, new_tokens, sampling_params


NOTHING_DRAINED = DrainedRequest({}, {}, None)  # a request with news other than captures


class Session(SessionBase, HeldInterventions, ModelHead, Experiments):
    """Use ``Session.open(options, progress)``; close it to free the engine for another."""

    def __init__(self, options: SessionOptions, llm, model_path, catalogue: list[HookPoint],
                 installed: dict[str, HookPoint], block_family: str, refused_kinds: dict[str, str] | None = None):
        self.options = options
        self.model_path = model_path
        self.block_family = block_family
        self.refused_kinds = dict(refused_kinds or {})  # kind -> why the model offers no point of it
        self.catalogue = catalogue
        self.installed = installed
        self.alive = True
        self._llm = llm
        self._tokenizer = llm.get_tokenizer()
        self._texts: dict[int, str] = {}  # token id -> display text
        self._hold_interventions()
        self._stop = threading.Event()
        # prefix caching (engine_args enable_prefix_caching): cached blocks are keyed by the edits they were
        # computed under and by how many times the edits changed, so a block computed while a live change
        # happened is read by no request admitted after it
        self._prefix_caching = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
        self._edit_generation = 0
        self._computed: dict[str, int] = {}  # request id -> positions whose rows have been drained
        self._unsent_log: dict[str, list[tuple[int, tuple[dict, ...]]]] = {}  # for the next event
        self._logged: dict[str, tuple[Intervention, ...]] = {}  # per open request, the set its log last noted
        self._open: list[str] = []  # submitted, not finished
        self._unstarted: list[RequestStart] = []  # submitted since the last event
        self._optioned: set[str] = set()  # open requests the worker holds per-request options for
        self._over: list[str] = []  # finished ones it may forget
        self._steps = 0
        self.saes: dict[str, AttachedSae] = {}  # by name: encoding an installed hook's rows in the engine
        self.windows: dict[str, CaptureWindow] = windows_from_patterns(options.windows, installed)
        self._window_changes: list[tuple[dict[str, CaptureWindow], list[str] | None]] = []  # for the next step
        self._prompt_tokens: dict[str, int] = {}  # open request -> its prompt's length (windows count from it)
        self._unsent_windows: dict[str, dict[str, str]] = {}  # request -> windows changed, for the next event
        self.new_run()

    # --- opening and closing ---

    @classmethod
    def open(cls, options: SessionOptions, progress: Callable[[BootProgress], None] | None = None) -> "Session":
        return cls(*open_engine(options, progress or (lambda p: None)))  # the options with the model's context

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            self.alive = False
            shutdown_llm(llm)

    # --- generation ---

    def generate(self, prompts: list[str], sampling: Sampling = Sampling()) -> Iterator[StepEvent]:
        """Submit ``prompts`` as one batch and yield an event per engine step until all finish or
        ``stop()`` is called (then the unfinished ones end with finish reason "stopped")."""
        mine = [s.request_id for s in self.submit(prompts, sampling)]
        self._stop.clear()
        for number in itertools.count():
            if self._stop.is_set():
                yield replace(self.cancel(mine), step=number)
                return
            yield replace(self.step(), step=number)
            mine = [rid for rid in mine if rid in self._open]
            if not mine:
                return

    # --- the engine loop: generate() drives it for one caller, a server for many ---

    def submit(self, prompts: list[str], sampling: Sampling, request_ids: list[str] | None = None,
               windows: dict[str, CaptureWindow] | None = None) -> list[RequestStart]:
        """Add requests to the running batch; they start with the next ``step()``. ``request_ids``:
        the caller's own (unique) ids, else the next ``req<N>``; ``windows``: their capture windows
        (checked, by installed name), else ``self.windows``. ValueError if vLLM refuses one (then none
        is added)."""
        self._require_alive()
        check_request(prompts, sampling)
        params = sampling_params(sampling, skip_cache=self._prefix_caching and sampling.capture)
        vocab = self._llm.llm_engine.model_config.get_vocab_size()
        checked_token_ids(sampling.score_token_ids, vocab)
        ids = list(request_ids) if request_ids is not None else self._take_request_ids(len(prompts))
        if len(ids) != len(prompts) or len(set(ids)) != len(ids) or set(ids) & set(self._open):
            raise ValueError(f"request ids must be new and one per prompt, got {ids}")
        windows = {name: str(w) for name, w in (self.windows if windows is None else windows).items()}
        starts = [self._start(rid, prompt, sampling, windows) for rid, prompt in zip(ids, prompts)]
        self._send_request_options(starts, sampling)
        self._apply_interventions(self._open)  # a pending set applies to these too: their cache salt says so
        engine = self._llm.llm_engine
        for k, start in enumerate(starts):
            try:
                engine.add_request(start.request_id, {"prompt_token_ids": list(start.prompt_token_ids),
                                                      "prompt": start.prompt, **self._cache_salt(start.request_id)},
                                   params)
            except Exception as e:
                engine.abort_request(ids[:k])
                raise ValueError(f"request refused: {e}") from None
        for start in starts:
            self._computed[start.request_id] = 0
            self._prompt_tokens[start.request_id] = len(start.prompt_token_ids)
        self._open += ids
        self._unstarted += starts
        self._apply_interventions(self._open, force=True)  # the new requests' log starts now
        return starts

    def prefill(self, contexts: Iterable[Sequence[int]], request_ids: Sequence[str] | None = None) -> Iterator[Prefilled]:
        """Each context of token ids run prefill-only (no token is generated, nothing is detokenised),
        kept in flight so that every engine step is full, its rows handed out as it finishes:
        ``Prefilled``, in finishing order. The rows are views of the engine's host copies (copy what you
        keep, off the engine's thread if you can). Not folded into ``run``, no step events; the session
        must have no other request open. The current interventions apply. ``request_ids``: the
        contexts' engine request ids, in order (what Python hook functions are told), else new ones."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._require_alive()
        if self._open:
            raise ValueError("prefill needs the engine to itself: requests are still open")
        engine = self._llm.llm_engine
        vocab, longest = engine.model_config.get_vocab_size(), engine.model_config.max_model_len - 1
        scheduler = self._llm.llm_engine.vllm_config.scheduler_config
        # two steps' worth queued: the scheduler fills the next step while this one runs
        budget, seats = 2 * scheduler.max_num_batched_tokens, scheduler.max_num_seqs
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                skip_reading_prefix_cache=self._prefix_caching)  # every row is computed
        self._apply_interventions([])
        waiting = iter(enumerate(contexts))
        flying: dict[str, tuple[int, int, list]] = {}  # request id -> context's index, length, drained rows
        queued = 0
        try:
            while True:
                while queued < budget and len(flying) < seats and (item := next(waiting, None)) is not None:
                    index, ids = item
                    ids = checked_token_ids(ids, vocab).tolist()
                    if not 0 < len(ids) <= longest:
                        raise ValueError(f"context {index} has {len(ids)} tokens; the engine takes 1 to {longest}")
                    rid = self._take_request_ids(1, "prefill")[0] if request_ids is None else request_ids[index]
                    engine.add_request(rid, {"prompt_token_ids": ids, **self._cache_salt(rid)}, params)
                    flying[rid], queued = (index, len(ids), []), queued + len(ids)
                if not flying:
                    return
                try:
                    finished = [out.request_id for out in engine.step() if out.finished and out.request_id in flying]
                    drained_now = self._drain(wait=finished)
                except Exception as e:
                    flying.clear()  # a failed engine aborts nothing
                    raise self._engine_failed("prefilling", e) from e
                for rid, drained in drained_now.items():
                    if rid in flying:
                        flying[rid][2].append(drained.rows)
                for rid in finished:
                    index, length, parts = flying.pop(rid)
                    queued -= length
                    yield Prefilled(index, length, tuple(parts))
        finally:
            if flying:  # stopped early: nothing of theirs stays in the engine
                engine.abort_request(list(flying))
                self._drain()

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The text's token ids; ``add_special_tokens``: as vLLM tokenizes a prompt (a BOS where the
        model's tokenizer adds one)."""
        self._require_alive()
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def token_texts(self, ids) -> list[str]:
        self._require_alive()
        ids = checked_token_ids(ids, self._llm.llm_engine.model_config.get_vocab_size())
        return [self._text(i) for i in ids.tolist()]

    @property
    def open_requests(self) -> list[str]:
        return list(self._open)

    def step(self) -> StepEvent:
        """One engine step over every open request. SessionError if the engine fails (then the session
        is dead; the rows of the forwards that finished are in ``run``)."""
        self._require_alive()
        self._apply_interventions(self._open)
        self._apply_windows()
        try:
            outputs = [out for out in self._llm.llm_engine.step() if out.request_id in self._computed]  # open ones
            # Rows still copying arrive with a later step, except a finishing request's: wait for those.
            captures = self._drain(wait=[out.request_id for out in outputs if out.finished])
        except Exception as e:
            failure = self._engine_failed("generating", e)
            with contextlib.suppress(Exception):  # keep the finished forwards' rows, if the worker can
                self._event(self._drain(), {})
            raise failure from e
        return self._event(captures, {out.request_id: out for out in outputs},
                           finish={out.request_id: str(out.outputs[0].finish_reason) for out in outputs
                                   if out.finished})

    def _engine_failed(self, doing: str, e: Exception) -> SessionError:
        """The engine raised in a step: it is gone, and this session with it."""
        self.alive = False
        return SessionError(f"the engine failed while {doing}: {type(e).__name__}: {e}. "
                            "Everything captured so far is kept; open a new session to go on.")

    def cancel(self, request_ids: list[str]) -> StepEvent:
        """End open requests now (finish reason "stopped"); the event carries their last rows, and any
        other request's rows that had not been drained yet."""
        self._require_alive()
        ids = [rid for rid in request_ids if rid in self._open]
        self._llm.llm_engine.abort_request(ids)
        return self._event(self._drain(), {}, finish={rid: "stopped" for rid in ids})

    def stop(self) -> None:
        """Thread-safe: generation ends before the next step; what was captured stays."""
        self._stop.set()

    # --- interventions and hooks ---

    def set_python_hooks(self, functions: dict[str, Callable]) -> None:
        """Python functions on installed hooks' rows at every forward (``plugin.python_hooks``), replacing
        those set before ({} removes them). Eager mode, with the engine in this process and no
        parallelism: the worker runs the very functions given."""
        self._require_alive()
        if functions and self.options.mode != "eager":
            raise ValueError("Python hook functions need the eager engine (mode='eager'): the compiled graph runs "
                             "scale, bias, patch and clamp edits only (steer=, scale=, patch= in the notebook's "
                             "hooks(), or Session.set_interventions), without recompiling")
        if functions and not self.in_process:
            raise ValueError("Python hook functions need the engine in this process without tensor or pipeline "
                             "parallelism: the worker calls the functions themselves")
        unknown = sorted(set(functions) - self.installed.keys())
        if unknown:
            raise ValueError(f"no installed hook named {unknown[0]!r}")
        self._llm.collective_rpc("inspector_set_python_hooks", args=(dict(functions),))

    @property
    def in_process(self) -> bool:
        """Whether the one worker runs in this process, so that it can call the caller's own functions."""
        parallel = self._llm.llm_engine.vllm_config.parallel_config
        return parallel.world_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def set_row_sink(self, sink: Callable | None) -> None:
        """``sink(req_ids, query_start_loc, positions, stacks)`` takes each forward's rows on the engine's
        device (``stacks``: (hook names, [hooks, rows, width]) views it must copy before returning), in
        place of the host copies that ``run`` and the drains are made of; None: back to those. Engine in
        this process only."""
        self._require_alive()
        if sink is not None and not self.in_process:
            raise ValueError("a row sink needs the engine in this process, without tensor or pipeline parallelism")
        self._llm.collective_rpc("inspector_set_row_sink", args=(sink,))

    def python_hook_error(self) -> BaseException | None:
        """The first exception a Python hook function raised since the last call (its forward went on
        without that function's edit), or None."""
        self._require_alive()
        return self._llm.collective_rpc("inspector_python_hook_error")[0]

    def set_windows(self, windows: dict[str, CaptureWindow], request_ids: list[str] | None = None) -> None:
        """Thread-safe. Capture windows by installed hook name or alias (hooks not named: all), checked at
        once (ValueError, nothing changed); from the next forward on they apply to the open requests and
        later ones, or (``request_ids``, a server's client) to those open requests only."""
        checked = checked_windows(windows, self.installed)
        with self._lock:
            if request_ids is None:
                self.windows = checked
            self._window_changes.append((checked, None if request_ids is None else list(request_ids)))

    def set_hooks(self, patterns: list[str]) -> bool:
        """Change the hook set. Eager: live, returns False. Compiled: restarts the engine (the hooks
        are traced into the graph), returns True. The current run is kept either way."""
        self._require_alive()
        check_patterns(patterns, self.catalogue)
        if self.options.mode == "eager":
            self._llm.collective_rpc("inspector_set_hook_patterns", args=(list(patterns),))
            _, self.installed, _, _ = describe_engine(self._llm)
        else:
            run = self.run
            self.close()
            options = replace(self.options, hooks=tuple(patterns))
            self._llm = boot_engine(options, self.model_path, lambda p: None)
            self.options, self.alive = options, True
            self._tokenizer = self._llm.get_tokenizer()
            _, self.installed, _, _ = describe_engine(self._llm)
            self.run = run
        self.run.hooks.update(self.installed)
        self.windows = {name: w for name, w in self.windows.items() if name in self.installed}
        self._keep_installed_interventions()
        attached, self.saes = self.saes, {}
        for sae in attached.values():  # on the hooks still installed (a restarted engine has none attached)
            if sae.hook in self.installed:
                if self.options.mode == "compiled":
                    self._llm.collective_rpc("inspector_attach_sae", args=(sae.config.as_dict(), sae.hook, sae.k))
                self.saes[sae.name] = sae
        return self.options.mode == "compiled"

    # --- sparse autoencoders ---

    def attach_sae(self, path, hook: str | None = None, k: int = 32) -> AttachedSae:
        """Encode ``hook``'s rows (an installed hook's name or alias; default: the one the SAE's config
        names) with the SAE in directory ``path`` on the engine's device after every forward: each row's
        ``k`` strongest features arrive in step events (``RequestStep.features``) and in ``run``. SaeError
        or ValueError, naming what does not fit, and nothing attached."""
        self._require_alive()
        sae = checked_attachment(path, hook, k, self.installed, self.saes)
        self._llm.collective_rpc("inspector_attach_sae", args=(sae.config.as_dict(), sae.hook, sae.k))
        self.saes[sae.name] = sae
        self._note_saes()
        return sae

    def detach_sae(self, name: str) -> None:
        self._require_alive()
        self._llm.collective_rpc("inspector_detach_sae", args=(name,))
        self.saes.pop(name, None)
        self._note_saes()

    # --- internals ---

    def _require_alive(self) -> None:
        if not self.alive or self._llm is None:
            raise SessionError("this session is closed or its engine failed; open a new session")

    def _start(self, rid: str, prompt: str, sampling: Sampling, windows: dict[str, str]) -> RequestStart:
        """Tokenized here, as vLLM would (``encode`` with special tokens), so the prompt's tokens are
        known before the first step."""
        ids = tuple(self._tokenizer.encode(prompt))
        return RequestStart(rid, prompt, ids, tuple(self._text(t) for t in ids), sampling.as_dict(), windows)

    def _send_request_options(self, starts: list[RequestStart], sampling: Sampling) -> None:
        """Tell the worker which of the new requests want no rows, scores or capture windows (before
        their first forward), and which earlier ones are over."""
        wanted = not sampling.capture or bool(sampling.score_token_ids) or bool(starts[0].windows)
        if not wanted and not self._over:
            return
        options = {s.request_id: {"capture": sampling.capture, "score_token_ids": list(sampling.score_token_ids),
                                  **({"windows": s.windows, "prompt_tokens": len(s.prompt_token_ids)}
                                     if s.windows else {})}
                   for s in starts} if wanted else {}
        self._send_options(options)

    def _send_options(self, options: dict[str, dict]) -> None:
        self._llm.collective_rpc("inspector_request_options", args=(options, self._over))
        self._over = []
        self._optioned.update(options)

    def _apply_windows(self) -> None:
        """Send the windows changed since the last step to the worker, for the open requests they name."""
        with self._lock:
            changes, self._window_changes = self._window_changes, []
        options = {}
        for windows, request_ids in changes:
            texts = {name: str(w) for name, w in windows.items()}
            for rid in self._open if request_ids is None else [r for r in request_ids if r in self._prompt_tokens]:
                options[rid] = {"windows": texts, "prompt_tokens": self._prompt_tokens[rid]}
                self._unsent_windows[rid] = texts
        if options:
            self._send_options(options)

    def _apply_interventions(self, open_ids: list[str], force: bool = False) -> None:
        """Push a pending intervention set to the worker and note, per request, from which position it
        applies; ``force`` notes the current set for new requests."""
        pending = self._take_pending()
        queued = {}
        if pending is not None:
            self._llm.collective_rpc("inspector_set_interventions", args=([iv.as_dict(arrays=True) for iv in pending],))
            self._edit_generation += pending != self._interventions
            self._interventions = pending
            # forwards already queued (async scheduling) or not yet drained run before the change
            queued = {}  # each pipeline stage queues the forwards of its own hooks
            for of_rank in self._llm.collective_rpc("inspector_queued_positions", args=(open_ids,)):
                queued.update({rid: max(position, queued.get(rid, 0)) for rid, position in of_rank.items()})
        elif not force:
            return
        everyone, scoped = [], {}  # each request's interventions, in order, without a pass over all per request
        for index, iv in enumerate(self._interventions):
            (everyone if iv.request_id is None else scoped.setdefault(iv.request_id, [])).append((index, iv))
        for rid in open_ids:
            active = tuple(iv for _, iv in sorted(everyone + scoped.get(rid, []), key=lambda e: e[0]))
            if self._logged.get(rid) != active:
                self._logged[rid] = active
                entry = (max(self._computed[rid], queued.get(rid, 0)), tuple(iv.as_dict(arrays=True) for iv in active))
                self._unsent_log.setdefault(rid, []).append(entry)

    def _cache_salt(self, rid: str) -> dict:
        """The prompt's ``cache_salt`` under prefix caching: none for an unedited request while the edits
        never changed (clean blocks are shared), else a digest of the edits that apply to it and of their
        generation (a set that changed while requests ran leaves their blocks to no later request)."""
        if not self._prefix_caching:
            return {}
        active = [iv for iv in self._interventions if iv.request_id in (None, rid)]
        if not active and not self._edit_generation:
            return {}
        digest = hashlib.sha256(f"{self._edit_generation}\n{encode_edit(active)}".encode()).hexdigest()
        return {"cache_salt": f"s-{digest}"}

    def _drain(self, wait: bool | list[str] = True) -> dict[str, DrainedRequest]:
        """The workers' rows since the last drain; ``wait=False`` leaves those still copying and request
        ids those not of these requests (``InspectorRuntime.drain``)."""
        sharded = {name for name, h in self.installed.items() if h.shards > 1}
        return merge_ranks(self._llm.collective_rpc("inspector_drain", kwargs={"wait": wait}), sharded)

    def _event(self, captures: dict[str, DrainedRequest], outputs: dict, finish: dict[str, str] | None = None
               ) -> StepEvent:
        """One event for every request with news (a start, rows, tokens, log entries or an end), folded
        into ``run`` as it is made."""
        finish = finish or {}
        blocks = bulk_of(captures)
        if blocks is not None and any(not self._computed.keys() >= set(b.request_ids) for b in blocks):
            mine = {rid: rid for rid in self._computed}  # not the engine's own (warm-up) requests
            blocks = tuple(b for b in (b.selected(mine) for b in blocks) if b is not None)
        started, self._unstarted = tuple(self._unstarted), []
        order = [s.request_id for s in started] + [*captures, *outputs, *self._unsent_log, *self._unsent_windows,
                                                   *finish]
        steps = []
        reached: dict[str, int] = {}  # the position after each request's last row in the blocks
        for b in blocks or ():
            for rid, after in b.positions_reached().items():
                reached[rid] = max(after, reached.get(rid, 0))
        for rid in dict.fromkeys(order):
            if rid not in self._computed:
                continue
            drained = captures.get(rid, NOTHING_DRAINED)
            if blocks is not None:
                rows = RequestRowsView(blocks, rid)
                if rid in reached:
                    self._computed[rid] = max(self._computed[rid], reached[rid])
            else:
                rows = drained_rows(drained.rows)
                self._note_computed(rid, rows)
            tokens = new_tokens(outputs[rid], self._text) if rid in outputs else {}
            log = tuple(self._unsent_log.pop(rid, ()))
            steps.append(RequestStep(rid, rows=rows, intervention_log=log, finished=rid in finish,
                                     finish_reason=finish.get(rid), windows=self._unsent_windows.pop(rid, None),
                                     features={sae: f for sae, f in drained.features.items() if sae in self.saes},
                                     scores=drained.scores, **tokens))
        self._open = [rid for rid in self._open if rid not in finish]
        for rid in finish:  # a long-lived session (a server's) forgets requests that are over
            self._computed.pop(rid, None)
            self._logged.pop(rid, None)
            self._prompt_tokens.pop(rid, None)
            if rid in self._optioned:
                self._optioned.discard(rid)
                self._over.append(rid)
        self._steps += 1
        # the landed copies are the event's: the engine writes the next forward's rows into new ones
        event = StepEvent(self._steps - 1, tuple(steps), started, owns_rows=True, blocks=blocks)
        self._fold(event)
        return event

    def _note_computed(self, rid: str, rows: dict[str, Rows]) -> None:
        """The position after the request's last row; its hooks mostly share one positions array."""
        ends = {id(r[0]): r[0] for r in rows.values()}
        if ends:
            self._computed[rid] = max(self._computed[rid], *(int(p[-1]) + 1 for p in ends.values()))

    def _text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = token_text(self._tokenizer, token_id)
        return text

    def _run_metadata(self) -> dict:
        import torch
        import vllm

        return {
            "app_version": __version__,
            "vllm_version": str(vllm.__version__),
            "torch_version": str(torch.__version__),  # a str subclass
            "model": self.options.model,
            "model_path": str(self.model_path),
            "model_config": model_config(self.model_path),
            "dtype": self.options.dtype,
            "engine_mode": self.options.mode,
            "block_family": self.block_family,  # the blocks' structure, as read from the model's forward at boot
            "refused_kinds": self.refused_kinds,  # kind -> why no point of it is offered
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "saes": self._sae_metadata(),
        }

