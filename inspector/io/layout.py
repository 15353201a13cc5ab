"""Where a capture file keeps a run's header, hooks and per-request data (``docs/capture-format.md``):
the groups, datasets and attributes themselves, apart from how rows stream in (``writer``)."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict

import numpy as np

from inspector import __version__ as APP_VERSION
from inspector.core.hooks import HookPoint
from inspector.core.routing import Routing, route
from inspector.core.run import FeatureRows, LensRows, RequestCapture, TopToken

from .format import FORMAT_NAME, FORMAT_VERSION, create_group, escape_name, set_text, to_json, write_texts

REQUEST_DATASETS = ("token_ids", "positions", "is_prompt", "token_texts", "logprobs", "top_logprob_ids",
                    "top_logprob_values", "top_logprob_texts", "top_logprob_counts")


def header_texts(metadata: dict) -> dict[str, str]:
    """The root's text attributes for a run's ``metadata`` (ValueError for metadata JSON cannot hold)."""
    metadata = dict(metadata)
    meta_json = to_json(metadata, "the run metadata")
    model_config = metadata.get("model_config", {})
    model_config = model_config if isinstance(model_config, str) else to_json(model_config, "model_config")
    created = metadata.get("created") or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return {"app_version": metadata.get("app_version") or APP_VERSION,
            "vllm_version": metadata.get("vllm_version") or "",
            "model_path": metadata.get("model_path") or "",
            "model_config": model_config,
            "dtype": metadata.get("dtype") or "",
            "engine_mode": metadata.get("engine_mode") or "",
            "created": created.isoformat() if hasattr(created, "isoformat") else created,
            "metadata": meta_json}


def write_header(f, texts: dict[str, str], hooks: dict[str, HookPoint]) -> None:
    """The format's name and version, the run's ``header_texts``, its hooks and the (empty) requests."""
    f.attrs["format"] = FORMAT_NAME
    f.attrs["format_version"] = np.int64(FORMAT_VERSION)
    for key, value in texts.items():
        set_text(f, key, value)
    f.create_group("hooks")
    for index, (name, info) in enumerate(hooks.items()):
        write_hook(f, index, name, info)
    f.create_group("requests")


def check_hook(name: str, info: HookPoint) -> None:
    """ValueError for a hook a file cannot hold (its name is escaped to a group name: ValueError there too)."""
    escape_name(name)
    if int(info.width) < 1:
        raise ValueError(f"hook {name!r} has width {info.width}; it must be at least 1")


def write_hook(f, index: int, name: str, info: HookPoint) -> None:
    """A hook point's group under ``/hooks``: what it is, and its place among the run's hooks."""
    g = f["hooks"].create_group(escape_name(name))
    set_text(g, "name", name)
    for key in ("alias", "module_path", "kind"):
        set_text(g, key, getattr(info, key))
    g.attrs["width"] = np.int64(info.width)
    g.attrs["layer"] = np.int64(info.layer)
    set_text(g, "source_dtype", info.dtype)
    if info.attention is not None:
        set_text(g, "attention", json.dumps(asdict(info.attention)))
    if info.routing is not None:
        set_text(g, "routing", json.dumps(info.routing.as_dict()))
    g.attrs["index"] = np.int64(index)


def add_request_group(f, index: int, request_id: str, prompt: str):
    """A request's group under ``/requests``, made when the request is added; its data follow at the end."""
    g = f["requests"].create_group(str(index))
    set_text(g, "request_id", request_id)
    g.attrs["index"] = np.int64(index)
    set_text(g, "prompt", prompt)
    g.create_group("hooks")
    return g


class RequestSnapshot:
    """What a request last said of itself (copied, so later mutation does not leak in)."""

    def __init__(self, req: RequestCapture):
        self.request_id = str(req.request_id)
        self.prompt = str(req.prompt)
        self.prompt_token_ids = np.asarray(req.prompt_token_ids, dtype=np.int64).reshape(-1)
        self.generated_token_ids = np.asarray(req.generated_token_ids, dtype=np.int64).reshape(-1)
        self.token_texts = [str(t) for t in req.token_texts]
        self.logprobs = np.asarray(req.logprobs, dtype=np.float64).reshape(-1)
        self.top_logprobs = [[TopToken(int(t[0]), float(t[1]), str(t[2])) for t in top] for top in req.top_logprobs]
        self.sampling = to_json(req.sampling, f"the sampling parameters of request {req.request_id!r}")
        self.intervention_log = to_json([[int(p), list(ivs)] for p, ivs in req.intervention_log],
                                         f"the intervention log of request {req.request_id!r}")
        self.finish_reason = None if req.finish_reason is None else str(req.finish_reason)
        self.twin_role, self.twin_of = req.twin_role, req.twin_of
        self.windows = {str(hook): str(window) for hook, window in req.windows.items()}


def write_request_data(g, s: RequestSnapshot, hook_groups: dict, lens: dict[str, LensRows],
                       features: dict[str, FeatureRows]) -> None:
    """A request's tokens, texts, logprobs and attributes into its group ``g`` (replacing any written
    before), each written hook's window into its group (``hook_groups``: hook -> group), and its lens
    and features."""
    for name in REQUEST_DATASETS:
        if name in g:
            del g[name]
    tokens = np.concatenate([s.prompt_token_ids, s.generated_token_ids])
    n_prompt = len(s.prompt_token_ids)
    g.create_dataset("token_ids", data=tokens)
    g.create_dataset("positions", data=np.arange(len(tokens), dtype=np.int64))
    is_prompt = np.zeros(len(tokens), dtype=np.uint8)
    is_prompt[:n_prompt] = 1
    g.create_dataset("is_prompt", data=is_prompt)
    write_texts(g, "token_texts", s.token_texts)
    g.create_dataset("logprobs", data=s.logprobs)
    rows, k = len(s.top_logprobs), max((len(x) for x in s.top_logprobs), default=0)
    ids = np.full((rows, k), -1, dtype=np.int64)
    values = np.full((rows, k), np.nan, dtype=np.float64)
    texts = np.full((rows, k), "", dtype=object)
    counts = np.zeros(rows, dtype=np.int64)
    for r, top in enumerate(s.top_logprobs):
        counts[r] = len(top)
        for c, (tid, lp, text) in enumerate(top):
            ids[r, c], values[r, c], texts[r, c] = tid, lp, text
    g.create_dataset("top_logprob_ids", data=ids)
    g.create_dataset("top_logprob_values", data=values)
    write_texts(g, "top_logprob_texts", texts)
    g.create_dataset("top_logprob_counts", data=counts)
    set_text(g, "request_id", s.request_id)
    set_text(g, "prompt", s.prompt)
    g.attrs["num_prompt_tokens"] = np.int64(n_prompt)
    set_text(g, "sampling", s.sampling)
    set_text(g, "intervention_log", s.intervention_log)
    if s.twin_role is not None:
        set_text(g, "twin_role", s.twin_role)
        set_text(g, "twin_of", s.twin_of)
    if s.finish_reason is not None:
        set_text(g, "finish_reason", s.finish_reason)
    elif "finish_reason" in g.attrs:
        del g.attrs["finish_reason"]
    for name, group in hook_groups.items():
        if name in s.windows:
            set_text(group, "window", s.windows[name])
    if "lens" in g:
        del g["lens"]
    if lens:
        lens_group = g.create_group("lens")
        for name, rows in lens.items():
            hg = named_group(lens_group, name)
            for column in LensRows.COLUMNS:
                hg.create_dataset(column, data=rows.column(column))
    if "features" in g:
        del g["features"]
    if features:
        features_group = g.create_group("features")
        for name, rows in features.items():
            fg = named_group(features_group, name)
            for column in ("positions", "ids", "activations"):
                fg.create_dataset(column, data=getattr(rows, column))


def write_expert_choice(g, values, routing: Routing) -> None:
    """A router hook's chosen experts and their weights, recomputed from all its rows so far (a
    request's router logits are small: tokens × experts), into its group ``g``."""
    ids, weights = route(values, routing)
    for name, data in (("expert_ids", ids), ("expert_weights", weights)):
        if name in g:
            del g[name]
        g.create_dataset(name, data=data)


def named_group(parent, name: str):
    """A group for ``name`` (escaped as a link; the name itself then kept in its ``name`` attribute),
    made quickly (a capture file's writer makes one per request and hook)."""
    link = escape_name(name)
    group = create_group(parent, link)
    if link != name:
        set_text(group, "name", name, new=True)
    return group
