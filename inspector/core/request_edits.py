"""A request's own edits as they ride inside the request (vLLM's ``SamplingParams.extra_args``).

The OpenAI server resolves what a client asked for (named vectors, inline vectors, a scale, positions)
into interventions and writes them here as one compact JSON string; every worker reads them back when
the request is scheduled. The same edit always gives the same string, so its hash can key the prefix
cache: requests steered alike share KV blocks, and no other request reads them.
"""

from __future__ import annotations

import base64
import hashlib
import json

import numpy as np

from .interventions import FeatureClamp, Intervention

CLIENT_PREFIX = "inspector_"  # of the vllm_xargs fields a client sends: the server's middleware reads and removes them
EDIT_KEY = "inspector_edit"  # the extra_args key the server writes and the workers read
CAPTURE_KEY = "inspector_capture_window"  # the extra_args key of a request whose rows the server keeps: its window
SERVED_SECTION = "inspector"  # the section of vLLM's --additional-config that configures a served engine


def encode_vector(values: np.ndarray) -> str:
    """Base64 of little-endian float32: what the API takes and what the edit string carries."""
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(text: str, what: str = "vector") -> np.ndarray:
    """The float64 vector of ``encode_vector``'s text; ValueError with the reason."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise ValueError(f"{what} is not base64") from None
    if not raw or len(raw) % 4:
        raise ValueError(f"{what} holds {len(raw)} bytes, not a whole number of float32 values")
    return np.frombuffer(raw, dtype="<f4").astype(np.float64)


def encode_edit(interventions: list[Intervention]) -> str:
    """The edit string of per-request interventions (their ``request_id`` is not part of it)."""
    def value(v):
        return v if isinstance(v, float) else {"f32": encode_vector(v)}

    items = []
    for iv in interventions:
        item = {"hook": iv.hook, "scale": value(iv.scale), "bias": value(iv.bias),
                "positions": None if iv.positions is None else list(iv.positions)}
        if iv.clamp is not None:
            c = iv.clamp
            item["clamp"] = {"encoder": encode_vector(c.encoder), "offset": c.offset, "floor": c.floor,
                             "decoder": encode_vector(c.decoder), "value": c.value, "label": c.label}
        items.append(item)
    return json.dumps(items, separators=(",", ":"), sort_keys=True)


def decode_edit(text: str, request_id: str) -> list[Intervention]:
    """The interventions of an edit string, scoped to ``request_id``; ValueError with the reason."""
    def value(v):
        return decode_vector(v["f32"]) if isinstance(v, dict) else float(v)

    try:
        items = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the edit is not JSON: {e}") from None
    if not isinstance(items, list):
        raise ValueError("the edit must be a list of interventions")
    out = []
    for item in items:
        clamp = item.get("clamp")
        if clamp is not None:
            clamp = FeatureClamp(decode_vector(clamp["encoder"]), clamp["offset"], clamp["floor"],
                                 decode_vector(clamp["decoder"]), clamp["value"], clamp.get("label", ""))
        out.append(Intervention(str(item["hook"]), value(item["scale"]), value(item["bias"]), request_id,
                                None if item["positions"] is None else tuple(item["positions"]), clamp))
    return out


def fingerprint(edit: str) -> str:
    """What the edit does, as a short hex digest of its contents (not of any name it was asked by)."""
    return hashlib.sha256(edit.encode()).hexdigest()
