"""The ASGI middleware that puts ``Admission`` in front of vLLM's generation routes: it reads the body,
answers a refused request itself (OpenAI's error shape), and hands vLLM the rewritten body. A capturing
request runs under its key as vLLM's request id, and the end of its answer waits until its capture file
is written, so that the client can fetch it as soon as it has the answer."""

from __future__ import annotations

import json
import logging

from .admission import Admission
from .steering import Refused

logger = logging.getLogger(__name__)
STREAM_END = b"data: [DONE]"
EDIT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class SteeringMiddleware:
    def __init__(self, app, admission: Admission, captures):
        """``captures()``: the server's CaptureStore (None until the engine has been asked what it compiled)."""
        self.app, self.admission, self.captures = app, admission, captures

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(EDIT_PATHS):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            ticket = self.admission.admit(body)
        except Refused as e:
            await send_error(send, e.status, str(e), e.field)
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-length", b"x-request-id")]
        headers.append((b"content-length", str(len(ticket.body)).encode()))
        store = self.captures() if ticket.key else None
        if store is not None:
            headers.append((b"x-request-id", ticket.key.encode()))
            store.begin(ticket.key, ticket.capture, json.loads(ticket.body))
            send = _capturing(send, store, ticket.key)
        try:
            await self.app({**scope, "headers": headers}, _replay(ticket.body, receive), send)
        finally:
            self.admission.release(ticket.fingerprint)
            if store is not None:
                store.discard(ticket.key)


def _capturing(send, store, key: str):
    """``send`` that keeps the answer and, before its end goes out (the last part, or a stream's
    ``[DONE]``, after which a client stops reading), writes the capture. A failed answer (status not
    200) keeps nothing."""
    parts, status, finished = [], 0, False

    async def wrapped(message):
        nonlocal status, finished
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body" and status == 200 and not finished:
            parts.append(message.get("body", b""))
            if not message.get("more_body", False) or STREAM_END in parts[-1]:
                finished = True
                try:
                    await store.finish(key, b"".join(parts))
                except Exception:  # the answer still goes out; only its capture is lost
                    logger.exception("the capture of %s could not be written", key)
        await send(message)

    return wrapped


async def _read_body(receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def _replay(body: bytes, receive):
    """``receive`` for the app: the body once, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def send_error(send, status: int, message: str, field: str | None = None) -> None:
    kind = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError",
            429: "RateLimitError", 503: "ServiceUnavailableError"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": field, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 429:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
