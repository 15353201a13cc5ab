"""The engine's side of a server: one session, many clients, one continuous batch.

Every client's requests join the running batch at the next step. Each client has a namespace of its
own (its request ``req3`` is ``c2/req3`` in the engine), interventions of its own (its "all requests"
means all of *its* requests: the hub scopes them to each of them), and, in eager mode, hook points
of its own (the engine captures the union; a client sees only its own). The hub runs on the engine's
thread and never touches a socket: ``send(client, message)`` does. A prefill (``Session.prefill``: a
notebook's ``run_with_cache``) needs the engine to itself: it is refused while requests generate, and
generations asked for while it runs start once it ends.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from inspector.core.hooks import HookPoint, check_patterns, installed_name
from inspector.core.interventions import Intervention
from inspector.core.protocol import RequestStep, Sampling, SessionError, StepEvent, checked_interventions
from inspector.core.sae import read_sae
from inspector.core.shared_ring import Copiers, SharedRing
from inspector.core.windows import CaptureWindow, checked_windows
from inspector.net.wire import Message, WireError, convert, event_to_body, to_builtins

from .shared_rows import SharedRows

SEPARATOR = "/"
logger = logging.getLogger(__name__)


@dataclass
class Call:
    """One ``generate`` of a client: its requests (the client's ids) and how far it got."""

    id: int
    open: list[str]
    steps: int = 0
    stopped: bool = False
    tokens: int = 0


@dataclass
class Client:
    key: bytes  # the transport's name for it
    tag: str  # its engine namespace
    hooks: set[str] | None = None  # eager mode: the points it captures (None in compiled mode: all)
    interventions: list[Intervention] = field(default_factory=list)  # as it gave them, its own ids
    calls: dict[int, Call] = field(default_factory=dict)
    owner: dict[str, int] = field(default_factory=dict)  # its open request -> the call it belongs to
    saes: set[str] = field(default_factory=set)  # the engine's SAEs whose features it gets (it attached them)
    windows: dict[str, CaptureWindow] = field(default_factory=dict)  # its capture windows, by installed hook
    shared: SharedRows | None = None  # its rows go through the shared memory it offered

    def internal(self, rid: str) -> str:
        return f"{self.tag}{SEPARATOR}{rid}"


@dataclass
class Prefill:
    """A client's ``prefill`` in flight. It has the engine to itself (``Session.prefill``): the hub
    advances it one finished context at a time between messages, and holds back generations until it ends."""

    client: Client
    call: int
    request_ids: list[str]  # the client's own names of its contexts' requests
    running: Iterator  # Session.prefill's generator
    sent: int = 0


class Hub:
    def __init__(self, session, send: Callable[[bytes, Message], None]):
        self.session = session
        self._send_out = send
        self.clients: dict[bytes, Client] = {}
        self._tags = itertools.count()
        self._scoped_all: set[Intervention] = set()  # engine interventions that scope a client's "all requests"
        self._prefill: Prefill | None = None
        self._held: list[tuple[bytes, Message]] = []  # generate and prefill messages that came during a prefill
        self._copiers = Copiers("server-rows-copy")  # into the clients' shared memory

    @property
    def busy(self) -> bool:
        return bool(self.session.open_requests) or self._prefill is not None

    @property
    def behind(self) -> bool:
        """A client's rows wait to be copied into its shared memory: the engine should wait for them."""
        return any(c.shared.behind for c in list(self.clients.values()) if c.shared is not None)

    def send(self, key: bytes, message: Message) -> None:
        """To a client, in order: through its shared memory's sender where it has one."""
        client = self.clients.get(key)
        if client is not None and client.shared is not None:
            client.shared.post(message)
        else:
            self._send_out(key, message)

    # ------------------------------------------------------------------ messages
    def handle(self, key: bytes, message: Message) -> None:
        """A client's message; anything wrong with it becomes an error reply, never an exception."""
        handlers = {"hello": self._hello, "generate": self._generate, "stop": self._stop, "bye": self._bye,
                    "set_interventions": self._set_interventions, "set_hooks": self._set_hooks, "lens": self._lens,
                    "attribution": self._attribution, "attach_sae": self._attach_sae, "detach_sae": self._detach_sae,
                    "token_texts": self._token_texts, "tokenize": self._tokenize, "set_windows": self._set_windows,
                    "prefill": self._start_prefill, "logits": self._logits, "final_norm_kind": self._final_norm_kind}
        if message.type not in handlers:
            self.send(key, error(message, "unknown-type", f"unknown message type {message.type!r}"))
            return
        client = self.clients.get(key)
        if client is None and message.type != "hello":
            self.send(key, error(message, "no-session", "no session: say hello first (or again, after a "
                                 "disconnect)"))
            return
        try:
            handlers[message.type](key if message.type == "hello" else client, message)
        except WireError as e:
            self.send(key, error(message, e.kind, str(e)))
        except ValueError as e:
            self.send(key, error(message, "invalid", str(e)))
        except SessionError:
            raise  # the engine failed: the server's loop says so to everyone
        except Exception as e:  # noqa: BLE001 - a message must never take the server down
            logger.exception("while handling %s", message.type)
            self.send(key, error(message, "internal", f"{type(e).__name__}: {e}"))

    def client_gone(self, key: bytes) -> None:
        """It said bye, stopped answering, or fell too far behind: its requests end, its settings go."""
        client = self.clients.get(key)
        if client is None:
            return
        ids = [client.internal(rid) for rid in client.owner]
        for call in client.calls.values():
            call.stopped = True
        if ids:
            self._route(self.session.cancel(ids))  # its last events, and done, in case it still listens
        del self.clients[key]
        if client.shared is not None:
            client.shared.close()
        for name in client.saes:
            self._release_sae(name)
        if client.interventions:
            self._push_interventions()
        if client.hooks is not None:
            self._push_hooks()
        self._held = [(k, m) for k, m in self._held if k != key]
        if self._prefill_of(client) is not None:
            self._end_prefill(None)

    def step(self) -> None:
        """One engine step for everyone (or a prefill's steps up to its next finished context);
        SessionError if the engine failed."""
        if self._prefill is not None:
            self._step_prefill()
        else:
            self._route(self.session.step())
        if not self.busy:
            self.session.new_run()  # a long-lived server keeps no history of its own
            self._scoped_all.clear()

    def fail_everyone(self, reason: str) -> None:
        for key, client in list(self.clients.items()):
            prefill = self._prefill_of(client)
            for call in [*client.calls, *([] if prefill is None else [prefill.call])]:
                self.send(key, Message("error", {"kind": "engine-failed", "message": reason}, call))
            self.send(key, Message("goodbye", {"reason": reason}))
            if client.shared is not None:
                client.shared.close()
        self.clients.clear()

    # ------------------------------------------------------------------ handlers
    def _hello(self, key: bytes, message: Message) -> None:
        client = self.clients.get(key)
        if client is None:
            eager = self.session.options.mode == "eager"
            client = Client(key, f"c{next(self._tags)}", set(self.session.installed) if eager else None,
                            windows=dict(self.session.windows))  # the server's default (--window)
            self.clients[key] = client
        offer = message.body.get("shared_rows")
        if offer is not None and client.shared is None:
            try:
                client.shared = SharedRows(SharedRing.opened(offer), lambda m: self._send_out(key, m), self._copiers)
            except (OSError, ValueError) as e:  # another machine, user or namespace: rows go through the socket
                logger.info("a client's shared memory cannot be mapped here (%s): its rows go through the socket", e)
        self.send(key, Message("welcome", self.describe(client), message.id))

    def rows_read(self, key: bytes, message: Message) -> None:
        """A client gave back room in its shared memory (the socket's thread calls this: the engine's
        may be waiting for that room)."""
        client, read = self.clients.get(key), message.body.get("message")
        if client is not None and client.shared is not None and isinstance(read, int):
            client.shared.read(read)

    def describe(self, client: Client) -> dict:
        s = self.session
        options = dataclasses.replace(s.options, engine_args={}, retain_rows=True)
        return {"options": to_builtins(options), "catalogue": to_builtins(s.catalogue),
                "installed": to_builtins(self.installed_for(client)), "metadata": s.run.metadata,
                "clients": len(self.clients), "shared_rows": client.shared is not None,
                "windows": {name: str(w) for name, w in client.windows.items()},
                "saes": [s.saes[name].as_dict() for name in sorted(client.saes) if name in s.saes]}

    def installed_for(self, client: Client) -> dict[str, HookPoint]:
        installed = self.session.installed
        if client.hooks is None:
            return dict(installed)
        return {name: point for name, point in installed.items() if name in client.hooks}

    def _generate(self, client: Client, message: Message) -> None:
        body = message.body
        prompts, ids = body.get("prompts"), body.get("request_ids")
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
            raise WireError("invalid", "generate needs 'prompts', a non-empty list of strings")
        if not (isinstance(ids, list) and len(ids) == len(prompts) and all(isinstance(r, str) and r for r in ids)):
            raise WireError("invalid", "generate needs 'request_ids', one non-empty string per prompt")
        if len(set(ids)) != len(ids) or set(ids) & set(client.owner) or any(SEPARATOR in r for r in ids):
            raise WireError("invalid", f"request ids must be new, distinct and free of {SEPARATOR!r}: {ids}")
        if message.id in client.calls:
            raise WireError("invalid", f"call {message.id} is still running")
        if self._prefill is not None:  # it has the engine to itself, for a moment: this call starts after it
            self._held.append((client.key, message))
            return
        sampling = convert(body.get("sampling", {}), Sampling, "sampling")
        call = client.calls[message.id] = Call(message.id, list(ids))
        client.owner.update({rid: message.id for rid in ids})
        self._push_interventions()  # scoped to the new requests too, before their first forward
        try:
            self.session.submit(prompts, sampling, [client.internal(rid) for rid in ids], client.windows)
        except Exception:  # refused (or worse): the call was never running
            del client.calls[call.id]
            for rid in ids:
                del client.owner[rid]
            self._push_interventions()
            raise

    def _stop(self, client: Client, message: Message) -> None:
        call_id = message.body.get("call")
        if not isinstance(call_id, int):
            raise WireError("invalid", "stop needs 'call', the id of a generate message")
        call = client.calls.get(call_id)
        if call is not None:
            call.stopped = True
            self._route(self.session.cancel([client.internal(rid) for rid in call.open]))
        elif (prefill := self._prefill_of(client)) is not None and prefill.call == call_id:
            self._end_prefill(Message("done", {"contexts": prefill.sent, "stopped": True}, call_id))
        else:  # held back by a prefill: it never starts
            for held in [(key, m) for key, m in self._held if (key, m.id) == (client.key, call_id)]:
                self._held.remove(held)
                nothing = {"steps": 0, "tokens": 0} if held[1].type == "generate" else {"contexts": 0}
                self.send(client.key, Message("done", {**nothing, "stopped": True}, call_id))

    def _set_interventions(self, client: Client, message: Message) -> None:
        given = message.body.get("interventions")
        if not isinstance(given, list):
            raise WireError("invalid", "set_interventions needs 'interventions', a list")
        try:
            interventions = [Intervention.from_dict(d) for d in given]
        except (TypeError, ValueError, AttributeError) as e:
            raise WireError("invalid", f"an intervention: {e}") from None
        checked_interventions(interventions, self.installed_for(client), self.session.options)  # ValueError
        client.interventions = [dataclasses.replace(iv, hook=self._installed_name(client, iv.hook))
                                for iv in interventions]
        self._push_interventions()
        self.send(client.key, Message("ok", {}, message.id))

    def _set_windows(self, client: Client, message: Message) -> None:
        """The client's capture windows, for its open requests (from the next forward) and later ones."""
        given = message.body.get("windows")
        if not (isinstance(given, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in given.items())):
            raise WireError("invalid", "set_windows needs 'windows', a map of hook name or alias to window text")
        client.windows = checked_windows(given, self.installed_for(client))  # ValueError: an error reply
        self.session.set_windows(client.windows, [client.internal(rid) for rid in client.owner])
        self.send(client.key, Message("ok", {}, message.id))

    def _installed_name(self, client: Client, name_or_alias: str) -> str:
        return installed_name(name_or_alias, self.installed_for(client))

    def _set_hooks(self, client: Client, message: Message) -> None:
        patterns = message.body.get("patterns")
        if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
            raise WireError("invalid", "set_hooks needs 'patterns', a list of strings")
        if self._prefill is not None:
            raise WireError("refused", "hooks cannot change while a prefill runs; try again once it finishes")
        s = self.session
        check_patterns(patterns, s.catalogue)
        restarted = False
        if s.options.mode == "compiled":
            others = len(self.clients) - 1
            if others:
                raise WireError("refused", f"the engine is shared with {others} other client(s): a hook change in "
                                "compiled mode restarts it, which would cut them off. Use eager mode (live hook "
                                "changes per client) or a server of your own.")
            if client.owner:
                raise WireError("refused", "hooks cannot change while this client is generating")
            restarted = s.set_hooks(patterns)
        else:
            client.hooks = {h.name for h in s.catalogue if any(h.matches(p) for p in patterns)}
            self._push_hooks()
        client.interventions = [iv for iv in client.interventions if iv.hook in self.installed_for(client)]
        client.windows = {name: w for name, w in client.windows.items() if name in self.installed_for(client)}
        self._push_interventions()
        self.send(client.key, Message("ok", {"restarted": restarted, **self.describe(client)}, message.id))

    def _lens(self, client: Client, message: Message) -> None:
        values, chosen = _rows_and_chosen(message, "values", "an array of residual-stream rows")
        result = self.session.lens(values, message.body.get("k", 5), chosen)  # ValueError: an error reply
        self.send(client.key, Message("ok", result.as_arrays(), message.id))

    def _attribution(self, client: Client, message: Message) -> None:
        values, chosen = _rows_and_chosen(message, "values", "an array of component rows")
        residual, _ = _rows_and_chosen(message, "final_residual", "the rows entering the final norm")
        result = self.session.attribution(values, residual, message.body.get("k", 5), chosen)
        self.send(client.key, Message("ok", result.as_arrays(), message.id))

    def _logits(self, client: Client, message: Message) -> None:
        values = message.body.get("values")
        if not isinstance(values, np.ndarray):
            raise WireError("invalid", "logits needs 'values', an array of final-norm rows")
        self.send(client.key, Message("ok", {"logits": self.session.logits(values)}, message.id))

    def _final_norm_kind(self, client: Client, message: Message) -> None:
        centred, eps = self.session.final_norm_kind()
        self.send(client.key, Message("ok", {"centred": bool(centred), "eps": float(eps)}, message.id))

    # ------------------------------------------------------------------ prefill
    def _start_prefill(self, client: Client, message: Message) -> None:
        """Contexts of token ids run prefill-only; each finished context's rows go back as one
        ``prefilled`` message (in finishing order), then ``done``. Refused while requests generate:
        a prefill needs the engine to itself."""
        tokens, lengths = message.body.get("tokens"), message.body.get("lengths")
        if not (isinstance(tokens, np.ndarray) and isinstance(lengths, np.ndarray) and tokens.ndim == lengths.ndim == 1
                and np.issubdtype(lengths.dtype, np.integer) and (lengths >= 0).all() and lengths.sum() == len(tokens)):
            raise WireError("invalid", "prefill needs 'tokens', the contexts' token ids one after another, and "
                            "'lengths', each context's number of tokens")
        if self._prefill is not None:
            self._held.append((client.key, message))
            return
        if self.session.open_requests:
            raise WireError("refused", f"a prefill needs the engine to itself, and {len(self.session.open_requests)} "
                            "request(s) are generating (this client's or another's): try again once they finish")
        contexts = np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
        ids = [f"prefill{message.id}.{i}" for i in range(len(contexts))]
        running = self.session.prefill(contexts, [client.internal(rid) for rid in ids])
        self._prefill = Prefill(client, message.id, ids, running)
        self._push_interventions()  # the client's edits for all its requests apply to these too (before they start)

    def _step_prefill(self) -> None:
        job = self._prefill
        try:
            done = next(job.running, None)
        except ValueError as e:  # a context the engine cannot take
            self._end_prefill(Message("error", {"kind": "invalid", "message": str(e)}, job.call))
            return
        except Exception as e:
            raise SessionError(f"the engine failed during a prefill: {type(e).__name__}: {e}") from e
        if done is None:
            self._end_prefill(Message("done", {"contexts": job.sent, "stopped": False}, job.call))
            return
        installed = self.installed_for(job.client)
        parts = [{hook: rows for hook, rows in part.items() if hook in installed} for part in done.parts]
        self.send(job.client.key, Message("prefilled", {"index": done.index, "tokens": done.tokens, "parts": parts},
                                          job.call))
        job.sent += 1

    def _prefill_of(self, client: Client) -> Prefill | None:
        return self._prefill if self._prefill is not None and self._prefill.client is client else None

    def _end_prefill(self, reply: Message | None) -> None:
        """The prefill is over (``reply``: what its client hears last); the calls held for it start."""
        job, self._prefill = self._prefill, None
        job.running.close()  # contexts still in the engine are aborted
        if reply is not None:
            self.send(job.client.key, reply)
        self._push_interventions()
        held, self._held = self._held, []
        for key, message in held:
            self.handle(key, message)

    def _attach_sae(self, client: Client, message: Message) -> None:
        """An SAE on the server's machine; one another client attached already (same directory, hook and
        k) is shared, not encoded twice."""
        path, hook, k = message.body.get("path"), message.body.get("hook"), message.body.get("k", 32)
        if not isinstance(path, str) or not (hook is None or isinstance(hook, str)) or not isinstance(k, int):
            raise WireError("invalid", "attach_sae needs 'path' (a directory on the server), optional 'hook' and 'k'")
        config = read_sae(path)  # SaeError (a ValueError): an error reply
        hook_name = self._installed_name(client, hook or config.hook) if (hook or config.hook) else None
        existing = self.session.saes.get(config.name)
        if existing is not None and (existing.config, existing.hook, existing.k) != (config, hook_name, k):
            raise WireError("refused", f"another client has an SAE named {config.name!r} attached to "
                                       f"{existing.hook} (k = {existing.k}); give yours a directory of another name")
        if existing is None:
            self.session.attach_sae(path, hook_name, k)
        client.saes.add(config.name)
        self.send(client.key, Message("ok", self.session.saes[config.name].as_dict(), message.id))

    def _detach_sae(self, client: Client, message: Message) -> None:
        name = message.body.get("name")
        if not isinstance(name, str):
            raise WireError("invalid", "detach_sae needs 'name'")
        if name in client.saes:
            client.saes.discard(name)
            self._release_sae(name)
        self.send(client.key, Message("ok", {}, message.id))

    def _release_sae(self, name: str) -> None:
        """Detach an SAE from the engine once no client gets its features."""
        if name in self.session.saes and not any(name in c.saes for c in self.clients.values()):
            self.session.detach_sae(name)

    def _token_texts(self, client: Client, message: Message) -> None:
        ids = message.body.get("ids")
        if not isinstance(ids, np.ndarray):
            raise WireError("invalid", "token_texts needs 'ids', an array of token ids")
        self.send(client.key, Message("ok", {"texts": self.session.token_texts(ids)}, message.id))

    def _tokenize(self, client: Client, message: Message) -> None:
        text, special = message.body.get("text"), message.body.get("add_special_tokens", False)
        if not isinstance(text, str) or not isinstance(special, bool):
            raise WireError("invalid", "tokenize needs 'text', a string, and optional 'add_special_tokens', a bool")
        self.send(client.key, Message("ok", {"ids": self.session.tokenize(text, add_special_tokens=special)},
                                      message.id))

    def _bye(self, client: Client, message: Message) -> None:
        self.client_gone(client.key)

    # ------------------------------------------------------------------ the engine's settings
    def _push_interventions(self) -> None:
        """Every client's interventions, scoped to its requests, as one set for the engine."""
        engine = []
        for client in self.clients.values():
            prefill = self._prefill_of(client)
            every = [*client.owner, *(prefill.request_ids if prefill else ())]  # its open requests
            for iv in client.interventions:
                rids = every if iv.request_id is None else [iv.request_id]
                scoped = [dataclasses.replace(iv, request_id=client.internal(rid)) for rid in rids]
                if iv.request_id is None:
                    self._scoped_all.update(scoped)
                engine += scoped
        self.session.set_interventions(engine)

    def _push_hooks(self) -> None:
        """Eager mode: the engine captures what any client captures."""
        wanted = set().union(*(c.hooks for c in self.clients.values() if c.hooks is not None))
        if wanted and wanted != set(self.session.installed):
            self.session.set_hooks(sorted(wanted))

    # ------------------------------------------------------------------ events
    def _route(self, event: StepEvent) -> None:
        """Split a step's event by client and call, in each client's own names."""
        parts: dict[tuple[bytes, int], tuple[list, list, dict]] = {}  # started, steps, engine id -> own id
        clients = {c.tag: c for c in self.clients.values()}
        for start in event.started:
            client, rid = self._owner(clients, start.request_id)
            if client is not None and rid in client.owner:
                parts.setdefault((client.key, client.owner[rid]), ([], [], {}))[0].append(
                    dataclasses.replace(start, request_id=rid))
        for step in event.requests:
            client, rid = self._owner(clients, step.request_id)
            if client is None or rid not in client.owner:
                continue
            part = parts.setdefault((client.key, client.owner[rid]), ([], [], {}))
            part[1].append(self._for_client(client, step, bulk=event.blocks is not None))
            part[2][step.request_id] = rid
        for (key, call_id), (started, steps, names) in parts.items():
            client = self.clients[key]
            call = client.calls[call_id]
            blocks = None if event.blocks is None else tuple(
                b for b in (b.selected(names, client.hooks) for b in event.blocks) if b is not None)
            self.send(key, Message("event", event_to_body(StepEvent(call.steps, tuple(steps), tuple(started),
                                                                    blocks=blocks), names), call_id))
            call.steps += 1
            call.tokens += sum(len(s.new_token_ids) for s in steps)
            for s in steps:
                if s.finished:
                    rid = names[s.request_id]
                    call.open.remove(rid)
                    del client.owner[rid]
            if not call.open:
                del client.calls[call_id]
                self.send(key, Message("done", {"steps": call.steps, "tokens": call.tokens,
                                                "stopped": call.stopped}, call_id))

    @staticmethod
    def _owner(clients: dict[str, Client], internal: str) -> tuple[Client | None, str]:
        tag, _, rid = internal.partition(SEPARATOR)
        return clients.get(tag), rid

    def _for_client(self, client: Client, step: RequestStep, bulk: bool) -> RequestStep:
        """What the client sees of ``step`` (its request id becomes the client's on the way out, in
        ``event_to_body``; rows in bulk travel in the event's blocks, chosen there, and its rows are not
        read). The step itself where nothing is left out or renamed, as in most steps: a batch-256 step
        asks 256 times, and a step made anew for each took most of the hub's routing."""
        rows = step.rows
        if not bulk and client.hooks is not None and rows:
            rows = {h: r for h, r in rows.items() if h in client.hooks}
        if rows is step.rows and not step.intervention_log and not step.features:
            return step
        log = step.intervention_log and tuple(
            (position, tuple(self._own(client, d) for d in ivs)) for position, ivs in step.intervention_log)
        features = step.features and {name: f for name, f in step.features.items() if name in client.saes}
        return RequestStep(**{**vars(step), "rows": rows, "intervention_log": log, "features": features})

    def _own(self, client: Client, d: dict) -> dict:
        """An engine log entry's intervention as the client gave it: its own request id, or none for one
        that scoped its "all requests"."""
        if Intervention.from_dict(d) in self._scoped_all:
            return {**d, "request_id": None}
        return {**d, "request_id": d["request_id"].removeprefix(client.tag + SEPARATOR)}


def error(message: Message, kind: str, text: str) -> Message:
    return Message("error", {"kind": kind, "message": text}, message.id)


def _rows_and_chosen(message: Message, name: str, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """The array ``name`` of a lens-like request and its optional ``chosen`` token ids (WireError if not arrays)."""
    rows, chosen = message.body.get(name), message.body.get("chosen")
    if not isinstance(rows, np.ndarray):
        raise WireError("invalid", f"{message.type} needs {name!r}, {what}")
    if chosen is not None and not isinstance(chosen, np.ndarray):
        raise WireError("invalid", f"{message.type}'s 'chosen' must be an array of token ids")
    return rows, chosen
