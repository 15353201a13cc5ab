"""The ASGI middleware that puts ``Admission`` in front of vLLM's generation routes: it reads the body,
answers a refused request itself (OpenAI's error shape), and hands vLLM the rewritten body."""

from __future__ import annotations

import json

from .admission import Admission
from .steering import Refused

EDIT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class SteeringMiddleware:
    def __init__(self, app, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].endswith(EDIT_PATHS):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            body, found = self.admission.admit(body)
        except Refused as e:
            await send_error(send, e.status, str(e), e.field)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.admission.release(found)


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
