"""``Inspector``: the engine as a notebook user drives TransformerLens's ``HookedTransformer``:
``logits, cache = ins.run_with_cache(prompts)``, tokens in and out as torch tensors. Prefill only, at
full batch through the compiled (or eager) engine; the logits are the model's own unembedding of the
captured final-norm rows (vLLM computes logits only where it samples). No gradients: the engine runs
inference only (for attribution, the patching sweep: ``Session.sweep``)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import html
import itertools
import logging
import os
import re
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from inspector.core.hooks import installed_name
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionOptions
from inspector.engine.session import Session

from . import files
from .cache import HEADED_KINDS, ActivationCache, by_alias
from .config import model_config_of
from .rows import DeviceRows, drained_generation, drained_prefill
from .hook_functions import HookFunction, row_function

NamesFilter = str | Sequence[str] | Callable[[str], bool] | None
_RUNS = itertools.count()  # numbers the notebook's prefill requests


class Generated(NamedTuple):
    text: list[str]  # each prompt's generated text
    tokens: torch.Tensor  # [batch, pos]: prompt and generated token ids, 0 after each one's end
    cache: ActivationCache

    def _repr_html_(self) -> str:
        """In Jupyter, as the app first shows a run: each prompt's generated text, and the first block's
        residual stream (the first cached point where it has none)."""
        residual = sorted((k for k in self.cache.keys() if re.fullmatch(r"blocks\.\d+\.hook_resid_post", k)),
                          key=lambda k: int(k.split(".")[1]))
        shown = residual[0] if residual else next(iter(self.cache.keys()), None)
        texts = "".join(f"<pre style='margin:2px 0'>{html.escape(text)}</pre>" for text in self.text)
        return texts + (self.cache.show(shown)._repr_html_() if shown else "")


class Inspector:
    """``Inspector(model, hooks=PATTERNS, mode=…, dtype=…, device=…, **engine_args)``: boots the engine
    with the hook points matching ``hooks`` (names, TransformerLens names or globs; all by default);
    ``close()`` (or ``with``) frees it. ``log_level``: of vLLM's logger (None: leave it as it is)."""

    def __init__(self, model: str = "demo", hooks: Sequence[str] = ("*",), mode: str = "compiled",
                 dtype: str = "float32", device: str | torch.device = "cpu", max_model_len: int = 1024,
                 log_level: str | None = "ERROR", **engine_args):
        if log_level is not None:  # vLLM's info lines would fill the cell's output
            os.environ.setdefault("VLLM_LOGGING_LEVEL", log_level)  # read when vLLM is first imported
            logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
        ours = {f.name for f in dataclasses.fields(SessionOptions)}  # e.g. max_num_batched_tokens: the session's
        options = {k: engine_args.pop(k) for k in list(engine_args) if k in ours}
        self._attach(Session.open(SessionOptions(model=model, mode=mode, hooks=tuple(hooks), dtype=dtype,
                                                 max_model_len=max_model_len, engine_args=engine_args, **options)),
                     device)

    def _attach(self, session, device: str | torch.device) -> None:
        """Drive ``session`` (an engine in this process, or a server's), tensors out on ``device``."""
        self.device = torch.device(device)
        self._session = session
        self._fwd_hooks: list[tuple[str, HookFunction]] = []  # (installed name, function), in force now
        self._request_index: dict[str, int] = {}  # engine request id -> the prompt's index, for hook functions
        self.points = {name: point for name, point in self.session.installed.items()}
        self.cfg = model_config_of(self.session)  # TransformerLens's most read config fields
        self.geometries = {p.layer: p.attention for p in self.session.catalogue if p.kind == "q" and p.attention}

    @classmethod
    def connect(cls, url: str, key=None, device: str | torch.device = "cpu") -> "Inspector":
        """Drive the engine of a running ``inspector serve`` at ``url`` with its hook points: the same
        calls, its model and GPU elsewhere. ``key``: for a server with CurveZMQ keys, the pair (your
        ``NAME.key_secret``, the server's ``server.key``) or ``ClientKeys``. ``close()`` (or ``with``)
        closes the connection; the server goes on. Python hook functions (``fwd_hooks``) need an
        engine in this process; ``steer=``, ``scale=`` and ``patch=`` edits work."""
        from inspector.client.remote import connect
        from inspector.net.keys import client_keys

        inspector = cls.__new__(cls)
        inspector._attach(connect(url, keys=client_keys(*key) if isinstance(key, tuple) else key), device)
        return inspector

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    @property
    def session(self):
        if self._session is None:
            raise RuntimeError("this Inspector is closed: create a new one (Inspector(...)) to run the model again")
        return self._session

    def close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close()

    def __enter__(self) -> "Inspector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- tokens ---

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor:
        """Token ids [batch, pos] as the engine tokenizes a prompt (a BOS where the tokenizer adds one),
        prompts of different lengths padded with 0 on the right (see ``run_with_cache``'s mask)."""
        ids = [self.session.tokenize(t, add_special_tokens=True) for t in ([text] if isinstance(text, str) else text)]
        out = torch.zeros((len(ids), max(map(len, ids))), dtype=torch.long)
        for i, row in enumerate(ids):
            out[i, :len(row)] = torch.tensor(row)
        return out.to(self.device)

    def to_str_tokens(self, tokens: str | torch.Tensor | Sequence[int]) -> list[str]:
        ids = self.to_tokens(tokens)[0] if isinstance(tokens, str) else tokens
        return self.session.token_texts(np.asarray(torch.as_tensor(ids).cpu()).reshape(-1))

    def to_string(self, tokens: torch.Tensor | Sequence[int]) -> str:
        return "".join(self.to_str_tokens(tokens))

    # --- edits ---

    @contextlib.contextmanager
    def hooks(self, fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFunction]] = (),
              steer: dict | None = None, scale: dict | None = None, patch: dict | None = None, bwd_hooks=()):
        """Edits for the runs inside the block, by hook name (TransformerLens's or ours). ``steer`` {hook:
        vector} adds the vector to every row, ``scale`` {hook: factor or vector} multiplies, ``patch``
        {hook: (position, vector)} puts the vector in place of the row at that position: the compiled
        engine takes these without recompiling. ``fwd_hooks`` [(name or a filter of names, fn)]:
        TransformerLens hook functions ``fn(activation, hook)`` (``hook_functions``), run on every
        forward by the eager engine only. No gradients flow (``bwd_hooks`` are refused): for
        attribution, the patching sweep (``Session.sweep``). The edits in force before come back after."""
        if bwd_hooks:
            raise ValueError("the engine runs inference only, without gradients, so backward hooks never run; for "
                             "attribution patching use the activation-patching sweep (Session.sweep)")

        def name(hook: str) -> str:
            return installed_name(hook, self.session.installed)

        edits = [*(Intervention(name(h), bias=_vector(v)) for h, v in (steer or {}).items()),
                 *(Intervention(name(h), scale=_vector(v)) for h, v in (scale or {}).items()),
                 *(Intervention(name(h), scale=0.0, bias=_vector(v), positions=(int(p),))
                   for h, (p, v) in (patch or {}).items())]
        functions = [(installed, fn) for hook, fn in fwd_hooks for installed in self._hooked(hook)]
        before, before_functions = self.session.interventions, self._fwd_hooks
        self._set_functions([*before_functions, *functions])
        try:
            self.session.set_interventions([*before, *edits])
            yield self
        finally:
            self.session.set_interventions(before)
            self._set_functions(before_functions)

    def _hooked(self, hook: str | Callable[[str], bool]) -> list[str]:
        """The installed points a ``fwd_hooks`` entry names: one name, or every alias a filter accepts."""
        if callable(hook):
            found = [name for name, point in self.points.items() if hook(point.alias)]
            if not found:
                raise ValueError("the hook filter function accepts none of this engine's hook points")
            return found
        return [installed_name(hook, self.session.installed)]

    def _set_functions(self, functions: list[tuple[str, HookFunction]]) -> None:
        if not functions and not self._fwd_hooks:
            return
        if not hasattr(self.session, "set_python_hooks"):
            raise ValueError("hook functions run only in an engine in this process (Inspector(model, mode='eager')); "
                             "a server takes steer=, scale= and patch= edits")
        by_point: dict[str, list[HookFunction]] = {}
        for name, fn in functions:
            by_point.setdefault(name, []).append(fn)
        self.session.set_python_hooks({name: row_function(self.points[name], fns, self._request_index,
                                                          self._head_size(self.points[name]))
                                       for name, fns in by_point.items()})
        self._fwd_hooks = functions

    def _head_size(self, point) -> int | None:
        kind = point.alias.rsplit("hook_", 1)[-1]
        geometry = self.geometries.get(point.layer)
        return geometry.head_size if kind in HEADED_KINDS and geometry is not None else None

    def _index_requests(self, request_ids: list[str]) -> None:
        """Tell the hook functions in force (which hold this very dict) whose rows each request's are."""
        self._request_index.clear()
        self._request_index.update({rid: i for i, rid in enumerate(request_ids)})

    def _raise_hook_error(self) -> None:
        """A hook function's exception, raised after the run it failed in (the engine went on without
        that function's edit, since an exception inside a forward would fail the engine)."""
        if self._fwd_hooks and (error := self.session.python_hook_error()) is not None:
            raise error

    def run_with_hooks(self, input, fwd_hooks: Sequence[tuple] = (), bwd_hooks=(), return_type: str | None = "logits",
                       **edits) -> torch.Tensor | None:
        """TransformerLens's ``run_with_hooks``: the logits of ``input`` (as ``run_with_cache`` takes it)
        with the hook functions and edits of ``hooks(...)`` in force for this run only."""
        with self.hooks(fwd_hooks, bwd_hooks=bwd_hooks, **edits):
            return self.run_with_cache(input, names_filter=(), return_type=return_type)[0]

    # --- runs ---

    def run_with_cache(self, input, names_filter: NamesFilter = None, return_type: str | None = "logits",
                       remove_batch_dim: bool = False) -> tuple[torch.Tensor | None, ActivationCache]:
        """``(logits [batch, pos, vocab] or None, cache)`` of a prefill of ``input``: a prompt, prompts,
        or token ids ([pos] or [batch, pos]; a list of lists for different lengths). Prompts of
        different lengths are padded on the right; ``cache.attention_mask`` marks their tokens.
        ``names_filter``: a glob, names, or a function of the name, choosing the cached activations."""
        if return_type not in ("logits", None):
            raise ValueError(f"return_type must be 'logits' or None, got {return_type!r}")
        contexts = self._contexts(input)
        self._check_filter(names_filter)
        chosen = {name: point for name, point in self.points.items() if _wanted(point.alias, names_filter)}
        normalized = next((name for name, p in self.points.items() if p.kind == "normalized"), None)
        if return_type == "logits" and normalized is None:
            raise ValueError("logits are computed from the final norm's output, which this engine does not capture: "
                             "include ln_final.hook_normalized in hooks, or pass return_type=None")
        lengths = [len(c) for c in contexts]
        wanted = {*chosen, *([normalized] if return_type else [])}
        ids = [f"notebook{next(_RUNS)}" for _ in contexts]  # told to hook functions, as their prompt's index
        self._index_requests(ids)
        if self._in_process():
            sink = DeviceRows(wanted, self._request_index, len(contexts), max(lengths))
            with self._sinking(sink):
                for _ in self.session.prefill(contexts, ids):
                    pass
            rows = sink.tensors
        else:
            rows = drained_prefill(self.session, contexts, wanted, ids if self._fwd_hooks else None)
        self._raise_hook_error()
        mask = torch.zeros((len(contexts), max(lengths)), dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        logits = self._logits(rows[normalized], mask) if return_type else None
        cache = self._cache({name: rows[name] for name in chosen}, mask,
                            [self.session.token_texts(c) for c in contexts])
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
            logits = None if logits is None else logits[0]
        return logits, cache

    def generate_with_cache(self, prompts: str | Sequence[str], max_new_tokens: int = 32, names_filter: NamesFilter = None,
                            **sampling) -> Generated:
        """Generate from ``prompts`` (``sampling``: temperature, top_p, top_k, seed, ignore_eos; greedy by
        default) and cache every position the model ran on: the prompt's and each generated token's but
        the last (no forward reads it). ``tokens`` [batch, pos] (prompt and generated, 0 after the end),
        ``cache.attention_mask`` marking the positions cached."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        try:
            params = Sampling(max_tokens=max_new_tokens, logprobs=0, **sampling)
        except TypeError as e:
            raise ValueError(f"generate_with_cache: {e} (known: temperature, top_p, top_k, seed, ignore_eos)") from None
        self._check_filter(names_filter)
        wanted = {name for name, point in self.points.items() if _wanted(point.alias, names_filter)}
        requests, sink = self._generated_rows(prompts, params, wanted, max_new_tokens)
        tokens = _padded_tokens(requests)
        longest = tokens.shape[1]
        if sink is None:
            rows, written = drained_generation(requests, wanted, longest)
        else:
            rows = {name: t[:, :longest] for name, t in sink.tensors.items()}
            written = sink.written[:, :longest]
        texts = ["".join(self.session.token_texts(r.generated_token_ids)) if r.generated_token_ids else ""
                 for r in requests]
        cache = self._cache(rows, written.long(), [self.session.token_texts(r.token_ids) for r in requests])
        return Generated(texts, tokens.to(self.device), cache)

    def generate(self, input: str | Sequence[str] = "", max_new_tokens: int = 10, stop_at_eos: bool = True,
                 do_sample: bool = True, top_k: int | None = None, top_p: float | None = None,
                 temperature: float = 1.0, seed: int | None = None, return_type: str = "input",
                 verbose: bool = False) -> str | list[str] | torch.Tensor:
        """TransformerLens's ``generate``, sampling by default as it does (``do_sample=False``: greedy): a
        prompt and its continuation as one text (a list of them for several prompts), or with
        ``return_type="tokens"`` their token ids [batch, pos], 0 after each one's end. No rows are
        captured (``generate_with_cache`` keeps them); ``verbose`` (a progress bar there) shows nothing."""
        texts_given = isinstance(input, Sequence) and input and all(isinstance(p, str) for p in input)
        if not (isinstance(input, str) or texts_given):
            raise ValueError("generate takes a prompt or a list of prompts as text (to_string turns token ids into "
                             f"one), not {type(input).__name__}")
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type must be 'input', 'str' or 'tokens', not {return_type!r}")
        prompts = [input] if isinstance(input, str) else list(input)
        params = Sampling(max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                          top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, seed=seed, logprobs=0,
                          ignore_eos=not stop_at_eos, capture=False)
        requests = self._generated(prompts, params)
        if return_type == "tokens":
            return _padded_tokens(requests).to(self.device)
        texts = [prompt + "".join(self.session.token_texts(r.generated_token_ids)) if r.generated_token_ids else prompt
                 for prompt, r in zip(prompts, requests)]
        return texts[0] if isinstance(input, str) else texts

    def _generated(self, prompts: list[str], params: Sampling) -> list:
        """The run's requests of a generation of ``prompts`` (``Run`` requests, in prompt order)."""
        self.session.new_run()
        ids = self.session.upcoming_request_ids(len(prompts))
        for _ in self.session.generate(prompts, params):
            pass
        self._raise_hook_error()
        requests = [self.session.run.requests[rid] for rid in ids]
        self.session.new_run()  # what is kept lives in the caller's objects from here on
        return requests

    def _generated_rows(self, prompts: list[str], params: Sampling, wanted: set[str], max_new_tokens: int
                        ) -> tuple[list, DeviceRows | None]:
        """The engine's part of ``generate_with_cache``: the run's requests (``Run`` requests, in prompt
        order) and, with the engine in this process, the row sink that holds their ``wanted`` rows
        (else the requests hold them)."""
        self._index_requests(self.session.upcoming_request_ids(len(prompts)))
        sink = None
        if self._in_process():
            capacity = max(len(self.session.tokenize(p, add_special_tokens=True)) for p in prompts) + max_new_tokens
            sink = DeviceRows(wanted, self._request_index, len(prompts), capacity)
        with self._sinking(sink):
            return self._generated(prompts, params), sink

    # --- files and the app ---

    def save(self, target, path, tokens: torch.Tensor | None = None, prompt_lengths: Sequence[int] | None = None):
        """A cache (``tokens``: its token ids, e.g. ``to_tokens(prompts)``), a generation or a ``Run`` as a
        capture file of the project's format (``files.save``): the app opens it, ``files.load`` reads it
        back into an ``ActivationCache``. Returns the path."""
        return files.save(target, path, tokens=tokens, prompt_lengths=prompt_lengths, **self._file_args())

    def open_in_app(self, target, path=None, tokens: torch.Tensor | None = None):
        """Show a cache, a generation, a ``Run`` or a capture file in the desktop app, a process of its own
        (returned); the file goes to ``path`` or the temporary directory."""
        return files.open_in_app(target, path, tokens=tokens, **self._file_args())

    def _file_args(self) -> dict:
        return {"points": self.points, "token_texts": self.session.token_texts, "metadata": self.session.run.metadata}

    def _check_filter(self, names_filter: NamesFilter) -> None:
        """ValueError for a name in a list filter that no installed point has, with the closest ones."""
        if isinstance(names_filter, (list, tuple, set)):
            aliases = [p.alias for p in self.points.values()]
            unknown = [n for n in names_filter if n not in aliases]
            if unknown:
                close = difflib.get_close_matches(unknown[0], aliases, n=3)
                raise ValueError(f"{unknown[0]!r} is not a hook point this engine captures"
                                 + (f"; did you mean {', '.join(close)}?" if close else ""))

    def _contexts(self, input) -> list[list[int]]:
        if isinstance(input, str) or (isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input)):
            return [self.session.tokenize(t, add_special_tokens=True) for t in ([input] if isinstance(input, str) else input)]
        if isinstance(input, torch.Tensor):
            ids = input.detach().cpu()
            return [row.tolist() for row in (ids[None] if ids.ndim == 1 else ids)]
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, int) for t in input):
            return [list(input)]
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, (list, tuple)) for t in input):
            return [list(map(int, row)) for row in input]
        raise ValueError("input must be a prompt, a list of prompts, or token ids ([pos], [batch, pos], or a list of "
                         f"lists); got {type(input).__name__}")

    def _logits(self, normalized: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[batch, pos, vocab] float32: the model's unembedding of the final norm's rows, 0 at padding."""
        held = mask.to(normalized.device).bool()
        flat = self.session.logits(normalized[held] if self._in_process() else normalized[held].float().numpy())
        flat = torch.as_tensor(flat, device=normalized.device)
        out = torch.zeros((*mask.shape, flat.shape[1]), dtype=torch.float32, device=normalized.device)
        out[held] = flat
        return out.to(self.device)

    def _cache(self, rows: dict[str, torch.Tensor], mask: torch.Tensor, str_tokens: list[list[str]]) -> ActivationCache:
        tensors = by_alias(self.points, rows, self.geometries)
        return ActivationCache({k: t.to(self.device) for k, t in tensors.items()}, mask.to(self.device), self.n_layers,
                               geometries=self.geometries, model=self, str_tokens=str_tokens)

    def _in_process(self) -> bool:
        """Whether the engine runs here, so that rows can go from its device into the cache directly."""
        return getattr(self.session, "in_process", False)

    @contextlib.contextmanager
    def _sinking(self, sink: DeviceRows | None):
        if sink is None:
            yield
            return
        self.session.set_row_sink(sink)
        try:
            yield
        finally:
            self.session.set_row_sink(None)

    def to_single_token(self, string: str) -> int:
        """The id of ``string``'s one token (as TransformerLens's); ValueError if it is not one token."""
        ids = self.session.tokenize(string)
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens, not one")
        return ids[0]


def _padded_tokens(requests) -> torch.Tensor:
    """The requests' prompt and generated token ids [batch, pos], 0 after each one's end."""
    tokens = torch.zeros((len(requests), max(len(r.token_ids) for r in requests)), dtype=torch.long)
    for i, request in enumerate(requests):
        tokens[i, :len(request.token_ids)] = torch.tensor(request.token_ids)
    return tokens


def _wanted(alias: str, names_filter: NamesFilter) -> bool:
    if names_filter is None:
        return True
    if callable(names_filter):
        return bool(names_filter(alias))
    if isinstance(names_filter, str):
        return fnmatch.fnmatchcase(alias, names_filter)
    return alias in names_filter


def _vector(value):
    """A factor, or a vector (a tensor anywhere, an array, a list) as numpy."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy()
    return value
