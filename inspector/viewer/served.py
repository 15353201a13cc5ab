"""Watching an OpenAI server's captures (``inspector serve --openai``): the requests that asked for rows
(``inspector_capture``) are listed as they arrive, and each is read while it runs as far as its rows go
(the server's snapshot: its tokens so far all count as prompt), then whole once its answer ends. The
server's capture store drains the engine; the app only reads what the store keeps."""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inspector.core.run import Run

POLL_S = 1.0  # between two looks at the server's list


@dataclass
class ServedCapture:
    id: str  # the response id
    state: str  # "running" or "done"
    run: Run  # its requests (one per choice: "<response id>/<choice>"), rows so far


@dataclass
class ServedRun:
    """The captures of one server, as one run: a capture read again replaces its requests."""

    url: str
    run: Run = field(default_factory=lambda: Run(metadata={}))
    seen: dict[str, tuple] = field(default_factory=dict)  # capture id -> (state, size) when last read
    running: set[str] = field(default_factory=set)

    def add(self, capture: ServedCapture) -> None:
        run = self.run
        if not run.metadata:
            run.metadata = {**capture.run.metadata, "source": f"OpenAI server {self.url}"}
        run.hooks.update(capture.run.hooks)
        run.vocabulary.update(capture.run.vocabulary)
        for rid in [r for r in run.requests if r.startswith(capture.id + "/")]:
            del run.requests[rid]
        run.requests.update(capture.run.requests)
        (self.running.add if capture.state == "running" else self.running.discard)(capture.id)


def fetch(url: str, route: str, timeout: float) -> bytes:
    """``GET url/route``, with the key in ``OPENAI_API_KEY`` if set (a server started with vLLM's
    ``--api-key`` asks for it, as the ``openai`` client sends it)."""
    key = os.environ.get("OPENAI_API_KEY")
    request = urllib.request.Request(f"{url.rstrip('/')}/{route}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return answer.read()


def listing(url: str, timeout: float = 10) -> list[dict]:
    """The server's captures, running and kept (``GET /inspector/v1/captures``); OSError naming the
    server where it does not answer as an inspector's OpenAI server does."""
    try:
        return list(json.loads(fetch(url, "inspector/v1/captures", timeout))["captures"])
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise OSError(f"{url} wants its API key: set OPENAI_API_KEY to the server's --api-key") from None
        raise OSError(f"{url} answered {e.code} to /inspector/v1/captures: is it `inspector serve --openai` "
                      "(vLLM's OpenAI server with the inspector's plugins)?") from None
    except (ValueError, KeyError, TypeError):
        raise OSError(f"{url}: /inspector/v1/captures is not the inspector's list of captures") from None


def read_changed(url: str, seen: dict[str, tuple], scratch: Path, timeout: float = 30) -> list[ServedCapture]:
    """The captures listed whose state or size changed since ``seen`` (updated), each read whole."""
    from inspector.io import read_run

    changed = []
    for entry in listing(url, timeout):
        key = (entry["state"], entry.get("rows", entry.get("bytes")))
        if seen.get(entry["id"]) == key:
            continue
        path = scratch / "capture.h5"
        try:
            path.write_bytes(fetch(url, f"inspector/v1/captures/{entry['id']}", timeout))
        except urllib.error.HTTPError as e:
            if e.code == 404:  # evicted, or ended between the list and the read: the next look sees it
                continue
            raise
        seen[entry["id"]] = key
        changed.append(ServedCapture(entry["id"], entry["state"], read_run(path)))
    return changed


def look(url: str, seen: dict[str, tuple], state) -> list[ServedCapture]:
    """A job (``jobs.TaskState``): wait ``POLL_S`` (unless cancelled), then read what changed."""
    deadline = time.monotonic() + POLL_S
    while time.monotonic() < deadline:
        if state.cancelled:
            return []
        time.sleep(0.05)
    with tempfile.TemporaryDirectory(prefix="inspector-served-") as scratch:
        return read_changed(url, seen, Path(scratch))
