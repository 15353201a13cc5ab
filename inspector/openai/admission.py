"""What the server decides about each generation request before vLLM sees it: its steering fields
become the edit its workers apply, its prefix-cache salt is set from that edit's contents, and the
engine's slots bound how many distinct edits run at once (one more waits for a 429's retry). A request
that captures gets a key of its own (its vLLM request id, so its engine requests are known by it).

Salts: a steered request's is a digest of its edit and of the client's own salt; an unsteered request
that brought a salt gets it in a namespace of its own. No client salt can equal a steered one, so an
unsteered request never reads KV computed under an edit, and requests steered alike share theirs. A
capturing request's salt is its key: it reads no cached block, so every prompt row is computed.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import NamedTuple

from inspector.core.request_edits import CAPTURE_KEY, EDIT_KEY, encode_edit, fingerprint

from .steering import PREFIX, CaptureAsk, HookTable, Refused, capture_ask, resolve, steering_fields
from .vectors import VectorRegistry

SALT_LIMIT = 128  # vLLM's longest cache_salt
SALT_FORBIDDEN = "@/\\\0"  # characters vLLM refuses in a cache_salt


class Ticket(NamedTuple):
    """An admitted request: the body vLLM gets, its edit's fingerprint (None: unsteered), and for a
    capturing request its key and what it keeps."""

    body: bytes
    fingerprint: str | None = None
    key: str | None = None
    capture: CaptureAsk | None = None


class Admission:
    def __init__(self):
        self.hooks: HookTable | None = None  # None: the engine has no inspector runtime
        self.vectors = VectorRegistry()
        self._running: dict[str, int] = {}  # edit fingerprint -> its requests under way
        self._clamped: dict[str, dict[str, set]] = {}  # edit fingerprint -> hook -> the directions it clamps

    def admit(self, body: bytes) -> Ticket:
        """What vLLM gets of this request; Refused with the reason. A body that is not a JSON object
        passes as it is (vLLM answers it)."""
        try:
            data = json.loads(body)
        except ValueError:
            return Ticket(body)
        if not isinstance(data, dict):
            return Ticket(body)
        xargs = data.get("vllm_xargs")
        fields = steering_fields(xargs) if isinstance(xargs, dict) else {}
        salt = data.get("cache_salt")
        if not fields:
            if not _valid_salt(salt):
                return Ticket(body)  # none, or one vLLM refuses with its own reason
            data["cache_salt"] = _client_salt(salt)
            return Ticket(json.dumps(data).encode())
        if self.hooks is None:
            raise Refused("this server steers nothing: it was started without the inspector's section in "
                          "--additional-config (inspector serve --openai sets it)", next(iter(fields)))
        if salt is not None and not _valid_salt(salt):
            raise Refused(f"cache_salt must be a non-empty string of at most {SALT_LIMIT} characters without "
                          "'@', '/', '\\' or NUL", "cache_salt")
        interventions = resolve(fields, self.vectors, self.hooks)
        ask = capture_ask(fields, self.hooks)
        xargs = {k: v for k, v in xargs.items() if not k.startswith(PREFIX)}
        found = key = None
        if interventions:
            xargs[EDIT_KEY] = edit = encode_edit(interventions)
            found = fingerprint(edit)
            data["cache_salt"] = "i-" + hashlib.sha256(f"{found}\n{salt or ''}".encode()).hexdigest()
        if ask is not None:
            key = "c" + uuid.uuid4().hex
            xargs[CAPTURE_KEY] = ask.window
            data["cache_salt"] = "x-" + key
            data["return_token_ids"] = True  # the capture file's tokens come from the answer
        if found is not None:
            self._claim(found, interventions)
        data["vllm_xargs"] = xargs
        return Ticket(json.dumps(data).encode(), found, key, ask)

    def release(self, found: str | None) -> None:
        """The request of this edit fingerprint is over (answered, failed or disconnected)."""
        if found is None:
            return
        self._running[found] -= 1
        if not self._running[found]:
            del self._running[found]
            del self._clamped[found]

    def _claim(self, found: str, interventions) -> None:
        """Room for one more request of this edit: a slot per hook (shared by requests edited alike), and
        the hook's clamp tables for the directions it clamps (shared by all running edits)."""
        if found not in self._running:
            limit = self.hooks.max_slots - 1
            if len(self._running) >= limit:
                raise Refused(f"{len(self._running)} distinct edits are running, as many as the engine has room for "
                              f"(max_slots {self.hooks.max_slots}, one of which is the unedited); retry when one "
                              "ends, or start the server with a larger --max-slots", status=429)
            clamped: dict[str, set] = {}
            for iv in interventions:
                if iv.clamp is not None:
                    clamped.setdefault(iv.hook, set()).add(iv.clamp.direction)
            for hook, directions in clamped.items():
                taken = set().union(*(other.get(hook, set()) for other in self._clamped.values())) | directions
                if len(taken) > self.hooks.feature_clamps:
                    alone = len(directions) > self.hooks.feature_clamps
                    raise Refused(f"{len(directions if alone else taken)} directions clamped or ablated at {hook}"
                                  f"{'' if alone else ' by the running edits and this one'}, more than the "
                                  f"{self.hooks.feature_clamps} the server has room for (--feature-clamps)"
                                  + ("" if alone else "; retry when one ends"), "inspector_clamp",
                                  status=400 if alone else 429)
            self._clamped[found] = clamped
        self._running[found] = self._running.get(found, 0) + 1


def _valid_salt(salt) -> bool:
    return isinstance(salt, str) and 0 < len(salt) <= SALT_LIMIT and not any(c in SALT_FORBIDDEN for c in salt)


def _client_salt(salt: str) -> str:
    """A client's salt in the clients' namespace ("c-", or "h-" and a digest where the prefix would make it
    too long): never equal to a steered request's ("i-")."""
    if len(salt) + 2 <= SALT_LIMIT:
        return "c-" + salt
    return "h-" + hashlib.sha256(salt.encode()).hexdigest()
