"""What the server decides about each generation request before vLLM sees it: its steering fields
become the edit its workers apply, its prefix-cache salt is set from that edit's contents, and the
engine's slots bound how many distinct edits run at once (one more waits for a 429's retry).

Salts: a steered request's is a digest of its edit and of the client's own salt; an unsteered request
that brought a salt gets it in a namespace of its own. No client salt can equal a steered one, so an
unsteered request never reads KV computed under an edit, and requests steered alike share theirs.
"""

from __future__ import annotations

import hashlib
import json

from inspector.capture.request_edits import EDIT_KEY, encode_edit, fingerprint

from .steering import PREFIX, HookTable, Refused, resolve, steering_fields
from .vectors import VectorRegistry

SALT_LIMIT = 128  # vLLM's longest cache_salt
SALT_FORBIDDEN = "@/\\\0"  # characters vLLM refuses in a cache_salt


class Admission:
    def __init__(self):
        self.hooks: HookTable | None = None  # None: the engine has no inspector runtime
        self.vectors = VectorRegistry()
        self._running: dict[str, int] = {}  # edit fingerprint -> its requests under way

    def admit(self, body: bytes) -> tuple[bytes, str | None]:
        """The request body vLLM gets, and the fingerprint of its edit (None: unsteered); Refused
        with the reason. A body that is not a JSON object passes as it is (vLLM answers it)."""
        try:
            data = json.loads(body)
        except ValueError:
            return body, None
        if not isinstance(data, dict):
            return body, None
        xargs = data.get("vllm_xargs")
        fields = steering_fields(xargs) if isinstance(xargs, dict) else {}
        salt = data.get("cache_salt")
        if not fields:
            if not _valid_salt(salt):
                return body, None  # none, or one vLLM refuses with its own reason
            data["cache_salt"] = _client_salt(salt)
            return json.dumps(data).encode(), None
        if self.hooks is None:
            raise Refused("this server steers nothing: it was started without the inspector's section in "
                          "--additional-config (inspector serve --openai sets it)", next(iter(fields)))
        if salt is not None and not _valid_salt(salt):
            raise Refused(f"cache_salt must be a non-empty string of at most {SALT_LIMIT} characters without "
                          "'@', '/', '\\' or NUL", "cache_salt")
        edit = encode_edit(resolve(fields, self.vectors, self.hooks))
        found = fingerprint(edit)
        self._claim(found)
        data["vllm_xargs"] = {**{k: v for k, v in xargs.items() if not k.startswith(PREFIX)}, EDIT_KEY: edit}
        data["cache_salt"] = "i-" + hashlib.sha256(f"{found}\n{salt or ''}".encode()).hexdigest()
        return json.dumps(data).encode(), found

    def release(self, found: str | None) -> None:
        """The request of ``admit``'s fingerprint is over (answered, failed or disconnected)."""
        if found is None:
            return
        self._running[found] -= 1
        if not self._running[found]:
            del self._running[found]

    def _claim(self, found: str) -> None:
        if found not in self._running and len(self._running) >= self.hooks.max_slots - 1:
            raise Refused(f"{len(self._running)} distinct edits are running, as many as the engine has room for "
                          f"(max_slots {self.hooks.max_slots}, one of which is the unedited); retry when one "
                          "ends, or start the server with a larger --max-slots", status=429)
        self._running[found] = self._running.get(found, 0) + 1


def _valid_salt(salt) -> bool:
    return isinstance(salt, str) and 0 < len(salt) <= SALT_LIMIT and not any(c in SALT_FORBIDDEN for c in salt)


def _client_salt(salt: str) -> str:
    """A client's salt in the clients' namespace ("c-", or "h-" and a digest where the prefix would make it
    too long): never equal to a steered request's ("i-")."""
    if len(salt) + 2 <= SALT_LIMIT:
        return "c-" + salt
    return "h-" + hashlib.sha256(salt.encode()).hexdigest()
