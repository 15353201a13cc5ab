"""The wire format between ``inspector serve`` and its clients (documented in docs/protocol.md).

A message is a ZeroMQ multipart message: a header frame, MessagePack ``{"v": version, "t": type,
"id": call id, "body": {...}}``, followed by raw frames holding numpy arrays. In the body an array is
``{"__nd__": [frame index, dtype, shape]}``; it is read back without a copy. Nothing is pickled.

Decoding never trusts the peer: every failure is a ``WireError`` with a kind and a message meant for
the peer, and typed values are converted with their declared types (``msgspec.convert``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgspec
import numpy as np

from inspector.core.blocks import RequestRowsView, RowBlocks, consecutive
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.protocol import BootProgress, RequestStart, RequestStep, StepEvent
from inspector.core.run import TopToken

VERSION = 2  # 2: arrays may be bfloat16
# What a client may send a server in one message (a clear error beyond). A server's messages to its
# client carry the rows that client asked for, as many as a step has: they are not limited.
MAX_FRAMES = 4096
MAX_HEADER_BYTES = 16 << 20
MAX_MESSAGE_BYTES = 64 << 20
# A message whose arrays are all smaller than this travels as one frame (see ``encode``).
INLINE_BYTES = 64 << 10
JOIN_VIEW_BYTES = INLINE_BYTES  # a join smaller than this is copied (into the header, anyway)
# numpy's dtype strings, and "bfloat16" (ml_dtypes' numpy bfloat16, whose own string is an anonymous "<V2")
ARRAY_DTYPES = {**{name: np.dtype(name) for name in ("<f4", "<f8", "<f2", "<i8", "<i4", "|u1", "|b1")},
                "bfloat16": BFLOAT16}
_ND = "__nd__"
AHEAD = "__ahead__"  # an array sent ahead of its message, in pieces (``rows`` messages: docs/protocol.md)
_SCALARS = {int, float, str, bool, type(None), bytes}


class WireError(ValueError):
    """A message that cannot be accepted; ``kind`` is the error kind sent back to the peer."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Message:
    type: str
    body: dict = field(default_factory=dict)
    id: int = 0


# ------------------------------------------------------------------------------------ frames

def encode(message: Message) -> list:
    """Header first, then the arrays of the body as raw frames (sent without a copy). A message whose
    arrays are all small travels as the header alone, its arrays copied into it: a frame costs more than
    the copy (a decode step at batch 1 has about a hundred small arrays). A message with a large array
    sends every array as a frame: a header of tens of KiB followed by large frames halved the throughput
    over TCP. MessagePack's encoder walks the body in C and hands us only what it has no type for."""
    try:
        return _encode(message, inline=True)
    except _LargeArray:  # met at the first large array: the inlining pass stops there
        return _encode(message, inline=False)


class _LargeArray(Exception):
    pass


def _encode(message: Message, inline: bool) -> list:
    frames: list = []
    index: dict[int, int] = {}  # id(array) -> its frame: hooks share their requests' positions

    def other(value):
        if isinstance(value, np.ndarray):
            array = value if value.flags.c_contiguous else np.ascontiguousarray(value)
            raw = array.view(np.uint16) if array.dtype == BFLOAT16 else array  # the buffer protocol lacks bfloat16
            if inline:
                if array.nbytes >= INLINE_BYTES:
                    raise _LargeArray
                return {_ND: [memoryview(raw).cast("B"), dtype_name(array.dtype), list(array.shape)]}
            if id(value) not in index:
                frames.append(raw)
                index[id(value)] = len(frames)
            return {_ND: [index[id(value)], dtype_name(array.dtype), list(array.shape)]}
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, str):  # a str subclass (version objects)
            return str(value)
        if hasattr(value, "__fspath__"):
            return value.__fspath__()
        raise TypeError(f"a {type(value).__name__} cannot be sent")

    header = {"v": VERSION, "t": message.type, "id": int(message.id), "body": message.body}
    return [msgspec.msgpack.Encoder(enc_hook=other).encode(header), *frames]


def decode(frames: list, limited: bool = True, ahead: dict[int, np.ndarray] | None = None) -> Message:
    """Frames (bytes, or zmq.Frame with a ``buffer``) back into a message; WireError if they are not one.
    ``limited``: refuse messages beyond the client-to-server limits; ``ahead``: the arrays that came
    ahead of their messages, by number (taken from it as the message names them)."""
    if not frames:
        raise WireError("bad-message", "an empty message")
    if limited and len(frames) > MAX_FRAMES:
        raise WireError("too-large", f"a message may have at most {MAX_FRAMES} frames, this one has {len(frames)}")
    sizes = [memoryview(f).nbytes for f in frames]  # bytes and zmq.Frame both export their bytes
    size = sum(sizes)
    if limited and (size > MAX_MESSAGE_BYTES or sizes[0] > MAX_HEADER_BYTES):
        raise WireError("too-large", f"a message may hold at most {MAX_MESSAGE_BYTES >> 20} MiB, this one holds "
                        f"{size / 2**20:.1f} MiB")
    try:
        header = msgspec.msgpack.decode(memoryview(frames[0]))
    except msgspec.DecodeError as e:
        raise WireError("bad-message", f"the header is not MessagePack: {e}") from None
    if not isinstance(header, dict) or not {"v", "t"} <= set(header):
        raise WireError("bad-message", "the header must be a map with 'v' (version) and 't' (type)")
    version = header["v"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise WireError("bad-message", f"the version must be an integer, got {version!r}")
    if version != VERSION:
        raise WireError("bad-version", f"protocol version {version} is not spoken here (this side speaks {VERSION})")
    kind, call, body = header["t"], header.get("id", 0), header.get("body", {})
    if not isinstance(kind, str) or not isinstance(call, int) or isinstance(call, bool) or not isinstance(body, dict):
        raise WireError("bad-message", "'t' must be a string, 'id' an integer and 'body' a map")

    refs = (frames, sizes, ahead)
    return Message(kind, _event_arrays_in(body, refs) if kind == "event" else _arrays_in(body, refs), call)


# where an event's request steps hold arrays (docs/protocol.md): an intervention's vectors are in its log
_REQUEST_ARRAYS = ("scores", "features", "intervention_log")


def _event_arrays_in(body: dict, refs: tuple) -> dict:
    """An event's arrays lie in its blocks, its rows and its requests' scores, features and intervention
    logs: only those are walked (the whole body of a 256-request step took 1.0 ms on the project's CPU,
    these 0.11)."""
    out = {k: v if k in ("requests", "started") else _arrays_in(v, refs) for k, v in body.items()}
    requests = out.get("requests")
    if isinstance(requests, list):
        out["requests"] = [_request_arrays_in(r, refs) if type(r) is dict and any(map(r.get, _REQUEST_ARRAYS))
                           else r for r in requests]
    return out


def _request_arrays_in(request: dict, refs: tuple) -> dict:
    return {k: _arrays_in(v, refs) if k in _REQUEST_ARRAYS else v for k, v in request.items()}


def _arrays_in(value, frames_and_sizes: tuple[list, list[int], dict | None]):
    """``value`` with its array references made arrays. A function of its own, not a closure that calls
    itself: such a closure is a reference cycle, and it held every message's frames until the garbage
    collector ran (at 1 MiB a frame, the first GB/s over TCP halved)."""
    if isinstance(value, dict):
        if _ND in value:
            return _array(value[_ND], *frames_and_sizes[:2])
        if AHEAD in value:
            return _array_ahead(value[AHEAD], frames_and_sizes[2])
        return {k: v if type(v) in _SCALARS else _arrays_in(v, frames_and_sizes) for k, v in value.items()}
    if isinstance(value, list):
        return [v if type(v) in _SCALARS else _arrays_in(v, frames_and_sizes) for v in value]
    return value


def _array(ref, frames: list, sizes: list[int]) -> np.ndarray:
    """An array on its frame's own bytes: made on a memoryview, it would keep two more objects alive
    with it that the garbage collector scans (the GUI keeps a run's arrays: half its tracked objects)."""
    if not (isinstance(ref, list) and len(ref) == 3 and type(ref[0]) in (int, bytes) and isinstance(ref[1], str)
            and isinstance(ref[2], list) and all(isinstance(n, int) and n >= 0 for n in ref[2])):
        raise WireError("bad-message", f"an array must be [frame or bytes, dtype, shape], got {ref!r:.200}")
    data, dtype, shape = ref
    if isinstance(data, int) and not 1 <= data < len(frames):
        raise WireError("bad-message", f"an array refers to frame {data}, which the message does not have")
    array_dtype(dtype)
    buffer, nbytes = (data, len(data)) if isinstance(data, bytes) else (frames[data], sizes[data])
    where = "its bytes" if isinstance(data, bytes) else f"frame {data}"
    if math.prod(shape) * ARRAY_DTYPES[dtype].itemsize != nbytes:
        raise WireError("bad-message", f"{where} hold {nbytes} bytes, not an array {shape} of {dtype}")
    return np.frombuffer(buffer, dtype=ARRAY_DTYPES[dtype]).reshape(shape)


def _array_ahead(number, ahead: dict | None) -> np.ndarray:
    try:
        return ahead.pop(number)
    except (AttributeError, KeyError, TypeError):
        raise WireError("bad-message", f"a message names array {number!r:.50} sent ahead, which did not come") from None


def array_dtype(name) -> np.dtype:
    """The dtype a peer named; WireError if it is not one the wire carries."""
    if not isinstance(name, str) or name not in ARRAY_DTYPES:
        raise WireError("bad-message", f"arrays of dtype {name!r:.50} are not accepted")
    return ARRAY_DTYPES[name]


def dtype_name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == BFLOAT16 else dtype.str


# ------------------------------------------------------------------------------------ typed values

def to_builtins(value) -> Any:
    """Dataclasses (and tuples) as plain maps and lists; numpy arrays stay arrays (they travel as frames)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_builtins(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_builtins(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtins(v) for v in value]
    return value


def convert(value, kind: type, what: str):
    """``value`` as a ``kind`` (a dataclass): its declared types, no unknown fields; WireError otherwise."""
    if isinstance(value, dict) and dataclasses.is_dataclass(kind):
        unknown = set(value) - {f.name for f in dataclasses.fields(kind)}
        if unknown:
            raise WireError("invalid", f"{what}: unknown fields {sorted(unknown)}")
    try:
        return msgspec.convert(value, kind)
    except (msgspec.ValidationError, TypeError, ValueError) as e:
        raise WireError("invalid", f"{what}: {e}") from None


def event_to_body(event: StepEvent, names: Mapping[str, str] | None = None) -> dict:
    """Rows travel per hook, the requests' rows one after the other (a few large frames per step, not
    three per request and hook): an event in bulk as its blocks, with the requests they hold and where;
    else each request says how many rows of each hook are its own. ``names``: a request's id as the
    peer knows it, for the requests' steps (a server's client knows them by its own ids)."""
    body = {"step": event.step, "started": to_builtins(event.started)}
    if event.blocks is not None:
        return {**body, "requests": [_step_to_body(step, names, bulk=True) for step in event.requests],
                "blocks": [{"request_ids": list(b.request_ids), "bounds": b.bounds, "positions": b.positions,
                            "token_ids": b.token_ids, "values": dict(b.values)} for b in event.blocks]}
    by_hook: dict[str, list] = {}
    for step in event.requests:
        for hook, rows in step.rows.items():
            by_hook.setdefault(hook, []).append(rows)
    joined: dict[tuple, np.ndarray] = {}  # a request's hooks share its positions and token ids: join them once

    def join(arrays: list[np.ndarray]) -> np.ndarray:
        if len(arrays) == 1:
            return arrays[0]
        key = tuple(map(id, arrays))
        if key not in joined:
            joined[key] = _join(arrays)
        return joined[key]

    return {**body, "requests": [_step_to_body(step, names) for step in event.requests],
            "rows": {hook: [join([r[k] for r in parts]) for k in range(3)] for hook, parts in by_hook.items()}}


def _join(arrays: list[np.ndarray]) -> np.ndarray:
    """One array of ``arrays`` one after the other: a view when they already lie so in memory (the
    drain hands out consecutive slices of one block), else a copy."""
    first = arrays[0]
    if sum(a.nbytes for a in arrays) >= JOIN_VIEW_BYTES and consecutive(arrays):
        return np.lib.stride_tricks.as_strided(first, shape=(sum(len(a) for a in arrays), *first.shape[1:]))
    return np.concatenate(arrays)


def _step_to_body(step: RequestStep, names: Mapping[str, str] | None, bulk: bool = False) -> dict:
    return {"request_id": step.request_id if names is None else names[step.request_id],
            "new_token_ids": list(step.new_token_ids), "new_texts": list(step.new_texts),
            "logprobs": list(step.logprobs),
            "top_logprobs": [[list(t) for t in tops] for tops in step.top_logprobs],
            "intervention_log": [[position, list(ivs)] for position, ivs in step.intervention_log],
            "finished": step.finished, "finish_reason": step.finish_reason,
            "rows": {} if bulk else {hook: len(rows[0]) for hook, rows in step.rows.items()},
            "scores": None if step.scores is None else list(step.scores),
            "features": {name: list(features) for name, features in step.features.items()},
            "windows": step.windows}


def event_from_body(body: dict) -> StepEvent:
    """The peer is the server here: its events are trusted to be well formed, and still checked."""
    try:
        blocks = tuple(map(_blocks, body["blocks"])) if "blocks" in body else None
        offsets = dict.fromkeys(body.get("rows", ()), 0)
        steps = []
        for d in body["requests"]:
            rows = {}
            for hook, n in d["rows"].items():
                a = offsets[hook]
                rows[hook] = tuple(part[a:a + n] for part in body["rows"][hook])
                offsets[hook] = a + n
            if blocks is not None:
                rows = RequestRowsView(blocks, str(d["request_id"]))
            steps.append(_request_step(d, rows))
        return StepEvent(int(body["step"]), tuple(steps),
                         tuple(convert(s, RequestStart, "a request start") for s in body["started"]),
                         owns_rows=True, blocks=blocks)  # the message's own frames
    except (KeyError, TypeError, ValueError) as e:
        raise WireError("bad-message", f"a malformed step event: {e}") from None


def _blocks(d: dict) -> RowBlocks:
    arrays = [d["bounds"], d["positions"], d["token_ids"], *d["values"].values()]
    if not all(isinstance(a, np.ndarray) for a in arrays):
        raise ValueError("blocks must be arrays")
    return RowBlocks([str(rid) for rid in d["request_ids"]], d["bounds"], d["positions"], d["token_ids"],
                     {str(hook): v for hook, v in d["values"].items()})


def _request_step(d: dict, rows) -> RequestStep:
    top = tuple(tuple(TopToken(int(t), float(lp), str(text)) for t, lp, text in tops) for tops in d["top_logprobs"])
    log = tuple((int(position), tuple(ivs)) for position, ivs in d["intervention_log"])
    scores = d.get("scores")
    if scores is not None and not (len(scores) == 2 and all(isinstance(a, np.ndarray) for a in scores)):
        raise ValueError("scores must be two arrays")
    features = d.get("features") or {}
    if not all(len(f) == 3 and all(isinstance(a, np.ndarray) for a in f) for f in features.values()):
        raise ValueError("features must be three arrays per SAE")
    return RequestStep(str(d["request_id"]), tuple(d["new_token_ids"]), tuple(d["new_texts"]), tuple(d["logprobs"]),
                       top, rows, log, bool(d["finished"]), d["finish_reason"],
                       None if scores is None else (scores[0], scores[1]),
                       {str(name): (f[0], f[1], f[2]) for name, f in features.items()},
                       None if d.get("windows") is None else {str(k): str(v) for k, v in d["windows"].items()})


def hooks_from_body(points: list) -> list[HookPoint]:
    return [convert(p, HookPoint, "a hook point") for p in points]


def progress_from_body(body: dict) -> BootProgress:
    return convert(body, BootProgress, "boot progress")
