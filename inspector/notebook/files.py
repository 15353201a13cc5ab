"""Notebook results in the project's capture files (``inspector.io``): saved through the same writer as
``inspector capture`` and the app's export, so a cache saved here opens in the app; and any capture file
loads back as an ``ActivationCache`` in TransformerLens's names and shapes."""

from __future__ import annotations

import itertools
import math
import os
import re
import secrets
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from inspector.core.attention import AttentionGeometry
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.io import read_run, write_run
from inspector.plugin.families import ALIASES

from .cache import ActivationCache, as_torch, by_alias

KINDS = {alias: kind for kind, alias in ALIASES.items()}  # a block's TransformerLens name (after "blocks.L.") -> kind
RECOMPUTED = re.compile(r"blocks\.\d+\.attn\.hook_pattern")  # the cache computes these from q and k: never captured
APP = "import sys; from inspector.cli import main; sys.exit(main())"  # the `inspector` command, in this interpreter


class Loaded(NamedTuple):
    """A capture file as ``Inspector.generate_with_cache`` gives a generation (a prefill's ``text`` is "")."""

    text: list[str]  # each request's generated text
    tokens: torch.Tensor  # [batch, pos]: prompt and generated token ids, 0 after each one's end (-1: unknown)
    cache: ActivationCache


def run_of(target, points: dict[str, HookPoint] | None = None, tokens: torch.Tensor | None = None,
           token_texts: Callable[[Sequence[int]], list[str]] | None = None, metadata: dict | None = None,
           prompt_lengths: Sequence[int] | None = None) -> Run:
    """The capture ``Run`` of an ``ActivationCache`` or of a generation (``Generated``, ``Loaded``: its
    cache, with its tokens and text): a request per batch row, holding the rows at the positions
    ``attention_mask`` marks, heads merged back ([pos, width]), in the cache's dtype (bf16 included).

    ``points`` (``Inspector.points``) name the hooks as the engine installed them; a name no point
    describes gets one made from its TransformerLens name and shape. ``tokens`` [batch, pos] (a
    generation brings its own): each request's tokens run to its last cached position, and one further
    where no request has a row at the last position (a generation's last sampled token, which no
    forward read); without tokens the ids are -1 and the texts "". ``token_texts(ids)``, the engine
    tokenizer's, gives the texts. ``prompt_lengths``: each request's prompt tokens (default: all, or for
    a generation with ``token_texts``, those before the tokens whose texts join into its ``text``)."""
    cache, generated = target, None
    if not isinstance(target, ActivationCache):  # a generation
        cache, tokens, generated = target.cache, target.tokens, target.text
    mask = cache.attention_mask.cpu() if cache.has_batch_dim else cache.attention_mask.cpu()[None]
    batch, longest = mask.shape
    last = [int(row.nonzero().max()) if row.any() else -1 for row in mask]
    if tokens is None:
        ids = [[-1] * (n + 1) for n in last]
    else:
        tokens = torch.as_tensor(tokens).cpu().reshape(batch, -1)
        if tokens.shape != mask.shape:
            raise ValueError(f"tokens of shape {tuple(tokens.shape)} do not fit the cache's positions "
                             f"{tuple(mask.shape)}")
        one_more = int(not mask[:, -1].any())
        ids = [row[:n + 1 + one_more].tolist() for row, n in zip(tokens, last)]
    texts = [token_texts(row) if token_texts and tokens is not None else [""] * len(row) for row in ids]
    if prompt_lengths is None:
        prompt_lengths = ([_prompt_length(t, g) for t, g in zip(texts, generated)] if generated and token_texts
                          else [len(row) for row in ids])
    if len(prompt_lengths) != batch:
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for a batch of {batch}")
    requests = [RequestCapture(str(i), "".join(texts[i][:p]), ids[i][:p], {}, ids[i][p:], texts[i])
                for i, p in enumerate(prompt_lengths)]
    positions = [row.nonzero().flatten().numpy() for row in mask]

    by_alias = {p.alias: (name, p) for name, p in (points or {}).items()}
    hooks = {}
    for alias, tensor in cache.items():
        if alias not in by_alias and RECOMPUTED.fullmatch(alias):
            continue
        name, point = by_alias.get(alias) or (alias, _point(alias, tensor, cache))
        values = _numpy(tensor if cache.has_batch_dim else tensor[None]).reshape(batch, longest, -1)
        if values.shape[2] != point.width:
            raise ValueError(f"{alias} has rows of {values.shape[2]} values, but its hook point is {point.width} wide")
        hooks[name] = point
        for i, request in enumerate(requests):
            request.hooks[name] = rows = HookRows(point.width, len(positions[i]), values.dtype)
            rows.append(positions[i], np.asarray(ids[i])[positions[i]], values[i, positions[i]])
    metadata = {**(metadata or {}), "n_layers": cache.n_layers,  # what a load needs that hook points may not say
                "attention_geometries": {str(layer): asdict(g) for layer, g in cache.geometries.items()}}
    return Run(metadata=metadata, hooks=hooks, requests={r.request_id: r for r in requests})


def save(target, path: str | os.PathLike, points: dict[str, HookPoint] | None = None,
         tokens: torch.Tensor | None = None, token_texts: Callable[[Sequence[int]], list[str]] | None = None,
         metadata: dict | None = None, prompt_lengths: Sequence[int] | None = None) -> Path:
    """Write a capture ``Run``, or an ``ActivationCache`` or generation as ``run_of`` makes it one, to
    ``path`` with the project's writer (the file ``inspector capture`` writes); returns the path.
    ``CaptureFileError`` says why a file cannot be written, and nothing is left at ``path`` then."""
    run = target if isinstance(target, Run) else run_of(target, points, tokens, token_texts, metadata, prompt_lengths)
    return write_run(run, path)


def load(path: str | os.PathLike) -> Loaded:
    """Any capture file (``inspector capture``'s, the app's, ``save``'s) as a generation: a batch row per
    request, padded on the right (``cache.attention_mask`` marks the positions with rows), keyed by
    TransformerLens names. Queries, keys and head outputs are split into heads where the file records
    their layer's geometry (a q or k hook point's, or ``save``'s metadata); where it does not (only z
    of a layer captured by another tool), they stay [batch, pos, width]."""
    run = read_run(path)
    requests = list(run.requests.values())
    if not requests:
        raise ValueError(f"{path} holds no request to make a cache of")
    batch, longest = len(requests), max(len(r.token_ids) for r in requests)
    tokens, mask = torch.zeros((batch, longest), dtype=torch.long), torch.zeros((batch, longest), dtype=torch.long)
    rows: dict[str, list] = {}
    for i, request in enumerate(requests):
        tokens[i, :len(request.token_ids)] = torch.tensor(request.token_ids, dtype=torch.long)
        for name, found in request.hooks.items():
            mask[i, torch.as_tensor(found.positions)] = 1
            full = np.zeros((longest, found.width), found.values.dtype)
            full[found.positions] = found.values
            rows.setdefault(name, [None] * batch)[i] = full
    for per_request in rows.values():  # a request may hold no row of a hook
        template = next(v for v in per_request if v is not None)
        per_request[:] = [np.zeros_like(template) if v is None else v for v in per_request]
    geometries = {p.layer: p.attention for p in run.hooks.values() if p.attention}
    geometries.update({int(layer): AttentionGeometry(**g)
                       for layer, g in run.metadata.get("attention_geometries", {}).items()})
    n_layers = run.metadata.get("n_layers", 1 + max((p.layer for p in run.hooks.values()), default=-1))
    stacked = {name: torch.stack([as_torch(v) for v in per_request]) for name, per_request in rows.items()}
    cache = ActivationCache(by_alias(run.hooks, stacked, geometries), mask, n_layers, geometries=geometries,
                            str_tokens=[list(r.token_texts) for r in requests])
    text = ["".join(r.token_texts[len(r.prompt_token_ids):]) for r in requests]
    return Loaded(text, tokens, cache)


def load_cache(path: str | os.PathLike) -> ActivationCache:
    """The ``ActivationCache`` of any capture file (``load``'s)."""
    return load(path).cache


def open_in_app(target, path: str | os.PathLike | None = None, app_args: Sequence[str] = (),
                **save_args) -> subprocess.Popen:
    """Show ``target`` in the desktop app, started as a process of its own (no model booted), which is
    returned. ``target``: a capture file's path, or what ``save`` takes (with ``save_args``), written to
    ``path`` or else to a new file in the temporary directory, which stays: the app reads it as it
    shows it. ``app_args``: more of the app's options (``inspector app --help``)."""
    if isinstance(target, (str, os.PathLike)):
        path = Path(target)
        if not path.is_file():
            raise FileNotFoundError(f"no capture file at {path}")
    else:
        path = save(target, path or Path(tempfile.gettempdir(), f"inspector-{secrets.token_hex(6)}.h5"), **save_args)
    # in a process group of its own (setsid): interrupting the notebook's kernel does not close the app
    return subprocess.Popen([sys.executable, "-c", APP, "app", "--capture", str(path), *app_args],
                            start_new_session=True)


def _point(alias: str, tensor: torch.Tensor, cache: ActivationCache) -> HookPoint:
    """A hook point for a cached name that none describes (a cache saved on its own)."""
    found = re.fullmatch(r"blocks\.(\d+)\.(.+)", alias)
    layer, kind = (int(found.group(1)), KINDS.get(found.group(2))) if found else (-1, None)
    kind = kind or alias.rpartition("hook_")[2]
    width = math.prod(tensor.shape[2 if cache.has_batch_dim else 1:])
    attention = cache.geometries.get(layer) if kind in ("q", "k") else None
    return HookPoint(alias, alias, "", kind, width, layer, str(tensor.dtype).removeprefix("torch."), attention)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as numpy, bfloat16 as ``ml_dtypes``' (numpy has none of its own)."""
    tensor = tensor.detach().cpu().contiguous()
    return tensor.view(torch.int16).numpy().view(BFLOAT16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def _prompt_length(texts: list[str], generated: str) -> int:
    """A generation's prompt tokens: those before the longest run of final tokens whose texts join into
    its generated text (so a generated end-of-text token with no text counts as generated)."""
    whole = "".join(texts)
    if not whole.endswith(generated):
        return len(texts)
    chars = len(whole) - len(generated)
    return next((k for k, c in enumerate(itertools.accumulate(map(len, texts)), 1) if c == chars), len(texts))
