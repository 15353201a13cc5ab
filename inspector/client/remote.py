"""A session on a server: ``connect(url)`` returns an object with the same protocol as the in-process
``Session`` (``inspector.core.protocol.SessionProtocol``), so the app and scripts cannot tell them
apart. Step events arrive as the server makes them and are folded into ``run`` here.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import zmq

from inspector.core.hooks import HookPoint
from inspector.core.interventions import Intervention
from inspector.core.lens import Attribution, Lens
from inspector.core.protocol import (BootProgress, Prefilled, Sampling, SessionError, SessionOptions, StepEvent,
                                        check_request, checked_interventions)
from inspector.core.sae import AttachedSae, SaeConfig
from inspector.core.session_base import SessionBase
from inspector.core.windows import CaptureWindow, checked_windows
from inspector.experiments.methods import Experiments
from inspector.net.keys import ClientKeys
from inspector.net.wire import (Message, WireError, convert, event_from_body, hooks_from_body, progress_from_body,
                                to_builtins)

from .connection import Connection, ServerGone
from .rows_ahead import RowsAhead

CONNECT_TIMEOUT_S = 10.0  # for a first answer; once the server answers, a boot may take as long as it takes


GONE_WAIT_S = 1.0  # see RemoteSession._gone_reason
LOGITS_CALL_BYTES = 16 << 20  # final-norm rows sent per ``logits`` call: well under what a client may send


def connect(url: str, progress: Callable[[BootProgress], None] | None = None, keys: ClientKeys | None = None,
            retain_rows: bool = True, timeout_s: float | None = CONNECT_TIMEOUT_S,
            why_gone: Callable[[], str | None] = lambda: None, on_close: Callable[[], None] = lambda: None,
            shared_rows: bool = True) -> "RemoteSession":
    """A session on the server at ``url`` (boot progress arrives through ``progress`` while it starts).
    ``why_gone()``: why the server can no longer answer (a child process that exited), or None;
    ``on_close()``: called once the session is closed; ``timeout_s``: how long a server that never answers
    is waited for, None for as long as ``why_gone()`` has nothing to say (a child process that still
    starts); ``shared_rows``: offer shared memory for rows, which a server on this machine copies them
    into (several times faster than its socket), else they come through the socket. SessionError if
    there is no server, it refuses us, or it cannot boot."""
    report = progress or (lambda p: None)
    failed_boot: list[str] = []  # the server's reason, sent to every client just before it goes

    def on_message(message: Message) -> None:
        if message.type == "progress":
            try:
                report(progress_from_body(message.body))
            except WireError:
                pass
        elif message.type == "error" and message.body.get("kind") == "boot-failed":
            failed_boot.append(str(message.body.get("message", "the server's engine could not start")))

    try:
        connection = Connection(url, keys, on_message, _rows_ahead() if shared_rows else None)
    except zmq.ZMQError as e:
        raise SessionError(f"cannot connect to {url!r}: a server's address is tcp://HOST:PORT or ipc://PATH "
                           f"({e})") from None
    try:
        welcome = _hello(connection, timeout_s, lambda: failed_boot[0] if failed_boot else why_gone())
    except BaseException:
        connection.close(say_bye=False)
        raise
    return RemoteSession(connection, welcome, retain_rows, why_gone, on_close)


def _hello(connection: Connection, timeout_s: float | None, why_gone: Callable[[], str | None]) -> Message:
    """The server's welcome, once its engine is up. ``why_gone`` may learn the reason a moment after
    the connection closes (the boot's failure message is read after the close is noticed)."""
    started = time.monotonic()
    hello = {"client": "inspector"}
    if connection.rows_ahead is not None:
        hello["shared_rows"] = connection.rows_ahead.offer()
    with connection.start("hello", hello) as call:
        while True:  # wait in short slices: a child server that died, or no server at all, is said at once
            try:
                reply = call.next(0.25)
                break
            except TimeoutError:
                why = why_gone()
                if why is not None:
                    raise SessionError(why) from None
                if timeout_s is not None and not connection.heard_from and time.monotonic() - started > timeout_s:
                    raise SessionError(
                        f"no answer from {connection.url} in {timeout_s:.0f} s: no server is listening there, or "
                        "it only accepts clients with keys (a wrong server key, or a client key not in its "
                        "allow-list, gets no answer at all)") from None
            except ServerGone as e:
                raise SessionError(_reason(why_gone, GONE_WAIT_S) or str(e)) from None
    if reply.type == "error":
        raise SessionError(reply.body.get("message", "the server refused the connection"))
    if not reply.body.get("shared_rows"):  # another machine (or a server that does not map it)
        connection.drop_rows_ahead()
    return reply


def _rows_ahead() -> RowsAhead | None:
    try:
        return RowsAhead()
    except (OSError, AttributeError):  # no memfd on this system: rows come through the socket
        return None


def _reason(why_gone: Callable[[], str | None], wait_s: float) -> str | None:
    """``why_gone()``, waited for up to ``wait_s``: a child process closes its socket a moment before the
    system reports it dead."""
    deadline = time.monotonic() + wait_s
    while (why := why_gone()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return why


class RemoteSession(SessionBase, Experiments):
    """See ``SessionProtocol``; ``stop`` and ``set_interventions`` may be called from any thread."""

    def __init__(self, connection: Connection, welcome: Message, retain_rows: bool,
                 why_gone: Callable[[], str | None] = lambda: None, on_close: Callable[[], None] = lambda: None):
        self._conn = connection
        self._why_gone, self._on_close = why_gone, on_close
        self.shared_rows = connection.rows_ahead is not None  # rows come through shared memory, not the socket
        self._learn(welcome.body)
        self.options = convert({**welcome.body["options"], "retain_rows": retain_rows}, SessionOptions,
                               "the server's options")
        self._active_call: int | None = None
        self._failed = False  # the server's engine failed
        self._gone_waited = False  # _gone_reason waited for a child process once
        self.process = None  # the server's process, when it is our child (inspector.client.local)
        self._interventions: list[Intervention] = []
        self.new_run()

    def _learn(self, body: dict) -> None:
        self.catalogue: list[HookPoint] = hooks_from_body(body["catalogue"])
        self.installed: dict[str, HookPoint] = {h.name: h for h in hooks_from_body(list(body["installed"].values()))}
        self.metadata: dict = dict(body["metadata"])
        self.saes: dict[str, AttachedSae] = {sae.name: sae for sae in map(_attached, body.get("saes", []))}
        self.windows: dict[str, CaptureWindow] = checked_windows(body.get("windows", {}), self.installed)

    @property
    def alive(self) -> bool:
        """False once closed, or once the server stops answering (while idle, too)."""
        return self._conn is not None and self._conn.lost is None and not self._failed

    @property
    def lost(self) -> str | None:
        """Why the server is gone, or None while it answers."""
        if self._conn is not None and self._conn.lost is not None:
            return self._gone_reason() or self._conn.lost
        return None

    def generate(self, prompts: list[str], sampling: Sampling = Sampling()) -> Iterator[StepEvent]:
        self._require_alive()
        check_request(prompts, sampling)
        ids = self._take_request_ids(len(prompts))
        body = {"prompts": list(prompts), "sampling": to_builtins(sampling), "request_ids": ids}
        try:
            with self._conn.start("generate", body) as call:
                self._active_call = call.id
                while (message := call.next()).type != "done":
                    if message.type == "error":
                        # the engine failed, or the server forgot us; an internal error failed this call alone
                        self._failed = message.body.get("kind") in ("engine-failed", "no-session")
                        self._raise(message)
                    event = event_from_body(message.body)
                    self._fold(event)
                    yield event
        except (ServerGone, WireError) as e:
            raise SessionError(f"{self._gone_reason() or e}. Everything received so far is kept; connect again (or "
                               "restart the engine) to go on.") from None
        finally:
            self._active_call = None

    def stop(self) -> None:
        call = self._active_call
        if call is not None:
            self._conn.send(Message("stop", {"call": call}))

    @property
    def interventions(self) -> list[Intervention]:
        return list(self._interventions)

    def set_interventions(self, interventions: list[Intervention]) -> None:
        """Checked here at once (ValueError), and again by the server."""
        self._require_alive()
        self._interventions = checked_interventions(interventions, self.installed, self.options)
        self._conn.send(Message("set_interventions", {"interventions": [iv.as_dict() for iv in interventions]}))

    def set_windows(self, windows: dict[str, CaptureWindow]) -> None:
        """Checked here at once (ValueError), and again by the server; this client's own: they apply to
        its requests only."""
        self._require_alive()
        self.windows = checked_windows(windows, self.installed)
        self._conn.send(Message("set_windows", {"windows": {name: str(w) for name, w in self.windows.items()}}))

    def set_hooks(self, patterns: list[str]) -> bool:
        self._require_alive()
        reply = self._call("set_hooks", {"patterns": list(patterns)})
        self._learn(reply.body)
        self.options = convert({**reply.body["options"], "retain_rows": self.options.retain_rows}, SessionOptions,
                               "the server's options")
        self.run.hooks.update(self.installed)
        return bool(reply.body["restarted"])

    def lens(self, values, k: int = 5, chosen=None) -> Lens:
        """Checked by the server (ValueError with its reason)."""
        self._require_alive()
        body = {"values": np.asarray(values), "k": k, **({} if chosen is None else {"chosen": np.asarray(chosen)})}
        return Lens.from_arrays(self._call("lens", body).body)

    def attribution(self, values, final_residual, k: int = 5, chosen=None) -> Attribution:
        """Checked by the server (ValueError with its reason)."""
        self._require_alive()
        body = {"values": np.asarray(values), "final_residual": np.asarray(final_residual), "k": k,
                **({} if chosen is None else {"chosen": np.asarray(chosen)})}
        return Attribution.from_arrays(self._call("attribution", body).body)

    def token_texts(self, ids) -> list[str]:
        """Checked by the server (ValueError with its reason)."""
        self._require_alive()
        return list(self._call("token_texts", {"ids": np.asarray(ids, dtype=np.int64)}).body["texts"])

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: as the engine tokenizes a prompt (a BOS where the model's tokenizer adds one)."""
        self._require_alive()
        body = {"text": str(text), "add_special_tokens": bool(add_special_tokens)}
        return [int(i) for i in self._call("tokenize", body).body["ids"]]

    def prefill(self, contexts: Iterable[Sequence[int]]) -> Iterator[Prefilled]:
        """Each context of token ids run prefill-only on the server, its rows coming back as it finishes
        (one message a context, in finishing order), as ``Session.prefill``. The server refuses while
        requests generate (ValueError); closing the iterator early stops the prefill there."""
        self._require_alive()
        contexts = [np.asarray(c, dtype=np.int64).reshape(-1) for c in contexts]
        body = {"tokens": np.concatenate([np.zeros(0, np.int64), *contexts]),
                "lengths": np.array([len(c) for c in contexts], dtype=np.int64)}
        try:
            with self._conn.start("prefill", body) as call:
                over = False
                try:
                    while (message := call.next()).type != "done":
                        if message.type == "error":
                            over = True
                            self._failed = message.body.get("kind") in ("engine-failed", "no-session")
                            self._raise(message)
                        yield Prefilled(int(message.body["index"]), int(message.body["tokens"]),
                                        tuple(message.body["parts"]))
                    over = True
                finally:
                    if not over and self._conn.lost is None:  # the caller stopped reading
                        self._conn.send(Message("stop", {"call": call.id}))
        except (ServerGone, WireError) as e:
            raise SessionError(f"{self._gone_reason() or e}; connect again to go on") from None

    def logits(self, values) -> np.ndarray:
        """The model's logits of final-norm output rows (``normalized``), float32 [rows, vocab], asked in
        slices of rows (a client's message is limited); checked by the server (ValueError with its reason)."""
        self._require_alive()
        values = np.asarray(values)
        if values.ndim != 2:
            raise ValueError(f"final-norm rows must be [rows, width], got an array of shape {values.shape}")
        rows = max(1, LOGITS_CALL_BYTES // max(1, values.itemsize * values.shape[1]))
        return np.concatenate([self._call("logits", {"values": values[start:start + rows]}).body["logits"]
                               for start in range(0, max(len(values), 1), rows)])

    def final_norm_kind(self) -> tuple[bool, float]:
        """(centres like LayerNorm, epsilon) of the model's final norm (see ``Session.final_norm_kind``)."""
        self._require_alive()
        body = self._call("final_norm_kind", {}).body
        return bool(body["centred"]), float(body["eps"])

    def attach_sae(self, path, hook: str | None = None, k: int = 32) -> AttachedSae:
        """``path`` is a directory on the server's machine; checked there (ValueError with the reason)."""
        self._require_alive()
        sae = _attached(self._call("attach_sae", {"path": str(path), "hook": hook, "k": int(k)}).body)
        self.saes[sae.name] = sae
        self._note_saes()
        return sae

    def detach_sae(self, name: str) -> None:
        self._require_alive()
        self._call("detach_sae", {"name": name})
        self.saes.pop(name, None)
        self._note_saes()

    def close(self) -> None:
        if self._conn is not None:
            connection, self._conn = self._conn, None
            connection.close()
            self._on_close()

    # ------------------------------------------------------------------ internals
    def _run_metadata(self) -> dict:
        return {**self.metadata, "saes": self._sae_metadata()}

    def _require_alive(self) -> None:
        if self._conn is None:
            raise SessionError("this session is closed; connect again")
        if self._conn.lost is not None or self._failed:
            raise SessionError(f"the server is gone or its engine failed ({self.lost or 'engine failed'}); "
                               "connect again")

    def _call(self, type_: str, body: dict) -> Message:
        try:
            reply = self._conn.call(type_, body)
        except ServerGone as e:
            raise SessionError(self._gone_reason() or str(e)) from None
        if reply.type == "error":
            self._raise(reply)
        return reply

    def _gone_reason(self) -> str | None:
        """Why the server went, once the connection is gone (see ``_reason``)."""
        wait_s = GONE_WAIT_S if self.process is not None and not self._gone_waited else 0.0
        self._gone_waited = True  # once: a child that lingers must not stall every later question
        return _reason(self._why_gone, wait_s)

    @staticmethod
    def _raise(message: Message):
        kind, text = message.body.get("kind", "error"), message.body.get("message", "the server refused")
        if kind in ("invalid", "refused", "unknown-type", "bad-message", "too-large"):
            raise ValueError(text)
        raise SessionError(text)


def _attached(body: dict) -> AttachedSae:
    return AttachedSae(convert(body["config"], SaeConfig, "an SAE's config"), str(body["hook"]), int(body["k"]))
