"""The OpenAI server's captures: rows of the requests that asked (``inspector_capture``), drained from the
engine while they run and written, as each answer ends, to one capture file per response, which
``GET /inspector/v1/captures/{response id}`` returns. Kept under a size cap, oldest first out.

Ids and ownership: a response fans out to an engine request per prompt and sample (``n``). Its file
holds one request per choice, in choice order, with request id ``<response id>/<choice index>``, its
tokens from the answer and its rows from that choice's engine request. On a served engine this store is
the only reader of rows: it drains them all (requests that did not ask keep none on the device), and
others read them from it: ``GET /inspector/v1/captures`` lists the captures running and kept, and a
running one's file is a snapshot of its rows so far (its tokens are those the rows were computed for,
all counted as prompt until the answer ends). The desktop app watches a server that way.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from inspector.core.drained import ROW_KEYS
from inspector.core.run import RequestCapture
from inspector.io.writer import CaptureWriter

from .steering import CaptureAsk, HookTable

POLL_S = 0.25  # while captures run, rows are drained this often (the worker holds them until then)
ENGINE_ID = re.compile(r"^(?:(\d+)_)?[A-Za-z]+-(c[0-9a-f]{32})(?:-(\d+))?$")  # [sample_]kind-key[-prompt]
SAMPLING_KEYS = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop")


@dataclass
class _Pending:
    ask: CaptureAsk
    request: dict  # the body vLLM got
    rows: dict[int, dict[str, list[tuple]]] = field(default_factory=dict)  # choice -> hook -> (positions, ids, values)
    response_id: str = ""  # as the answer will give it, once the engine's first rows name it
    started: float = field(default_factory=time.time)


@dataclass
class _Choice:
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None


class CaptureStore:
    def __init__(self, directory: Path, limit_bytes: int, hooks: HookTable, metadata: dict, drain, token_texts):
        """``drain(wait)``: an awaitable of the engine's drained requests since the last (``wait``: for rows
        still copying too; the polls take only what has landed, so as not to hold the engine's loop
        while a forward computes); ``token_texts(ids)``: their texts."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit_bytes = limit_bytes
        self.hooks, self.metadata = hooks, metadata
        self._drain, self._token_texts = drain, token_texts
        self._pending: dict[str, _Pending] = {}
        self._ids: dict[str, str] = {}  # key -> response id, of the files written
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None

    def begin(self, key: str, ask: CaptureAsk, request: dict) -> None:
        self._pending[key] = _Pending(ask, request)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def discard(self, key: str) -> None:
        self._pending.pop(key, None)

    async def finish(self, key: str, answer: bytes) -> Path:
        """Write the capture of ``key`` once its answer (the whole body, JSON or a stream) has been made."""
        await self._collect(wait=True)  # the last step's rows
        pending = self._pending.pop(key)
        choices = _choices(answer)
        path = self.directory / f"{key}.h5"
        self._ids[key] = _response_id(answer) or key
        await asyncio.to_thread(self._write, path, pending, choices, self._ids[key])
        (self.directory / f"running-{key}.h5").unlink(missing_ok=True)
        self._evict(keep=path)
        return path

    def path(self, capture_id: str) -> Path | None:
        """The file of a response id (``cmpl-…``, ``chatcmpl-…``) or key; None if unknown or evicted."""
        key = capture_id.rpartition("-")[2]
        found = self.directory / f"{key}.h5"
        return found if re.fullmatch(r"c[0-9a-f]{32}", key) and found.is_file() else None

    def running(self, capture_id: str) -> bool:
        return capture_id.rpartition("-")[2] in self._pending

    def listing(self) -> list[dict]:
        """Captures running (from their first rows, which name their response; rows so far: of the first
        hook, over the choices) and kept, oldest first."""
        running = [{"id": p.response_id, "state": "running", "started": p.started,
                    "rows": sum(len(part[0]) for rows in p.rows.values() for part in rows.get(p.ask.hooks[0], []))}
                   for p in self._pending.values() if p.response_id]
        kept = [{"id": self._ids.get(f.stem, f.stem), "state": "done", "started": f.stat().st_mtime,
                 "bytes": f.stat().st_size} for f in self.directory.glob("c*.h5")]
        return sorted(running + kept, key=lambda c: c["started"])

    async def snapshot(self, capture_id: str) -> Path | None:
        """A running capture's file as far as its rows go (rewritten at each call); if it ended
        meanwhile, its file (None until written)."""
        key = capture_id.rpartition("-")[2]
        running = self._pending[key]  # copied here: the poller appends to its lists while the file is written
        pending = replace(running, rows={i: {hook: list(parts) for hook, parts in rows.items()}
                                         for i, rows in running.rows.items()})
        choices = {index: _Choice(prompt=_tokens_of(rows)) for index, rows in pending.rows.items()}
        path = self.directory / f"running-{key}.h5"
        await asyncio.to_thread(self._write, path, pending, choices, pending.response_id, None)
        if key not in self._pending:  # it ended meanwhile: its own file is the capture
            path.unlink(missing_ok=True)
            return self.path(key)
        return path

    async def _poll(self) -> None:
        while self._pending:
            await asyncio.sleep(POLL_S)
            await self._collect(wait=False)

    async def _collect(self, wait: bool) -> None:
        async with self._lock:
            drained = await self._drain(wait)
        for rid, request in drained.items():
            match = ENGINE_ID.match(rid)
            pending = self._pending.get(match.group(2)) if match else None
            if pending is None:
                continue  # a request that ended without its answer (a disconnect)
            pending.response_id = pending.response_id or re.sub(r"^\d+_", "", rid[:match.end(2)])
            sample, prompt = int(match.group(1) or 0), int(match.group(3) or 0)
            choice = prompt * int(pending.request.get("n") or 1) + sample
            rows = pending.rows.setdefault(choice, {})
            for hook in pending.ask.hooks:
                if hook in request.rows:
                    rows.setdefault(hook, []).append(tuple(request.rows[hook][key] for key in ROW_KEYS))

    def _write(self, path: Path, pending: _Pending, choices: dict[int, _Choice], response_id: str,
               finish: str | None = "stop") -> None:
        """The capture file of ``pending``; ``finish``: the reason of a choice whose answer names none
        (None: the choices still run)."""
        metadata = {**self.metadata, "response_id": response_id, "capture_window": pending.ask.window,
                    "request": {k: v for k, v in pending.request.items() if k in ("model", "prompt", "messages")}}
        sampling = {k: pending.request[k] for k in SAMPLING_KEYS if k in pending.request}
        prompts = pending.request.get("prompt")
        prompts = prompts if isinstance(prompts, list) and all(isinstance(p, str) for p in prompts) else [prompts]
        n = int(pending.request.get("n") or 1)
        with CaptureWriter(path, metadata, {h: self.hooks.points[h] for h in pending.ask.hooks}, fsync=False) as writer:
            for index, choice in sorted(choices.items()):
                rid = f"{response_id}/{index}"
                prompt = prompts[index // n] if index // n < len(prompts) else None
                request = RequestCapture(rid, prompt if isinstance(prompt, str) else "", choice.prompt, sampling,
                                         choice.tokens, self._token_texts(choice.prompt + choice.tokens),
                                         windows={h: pending.ask.window for h in pending.ask.hooks})
                writer.add_request(request)
                for hook, parts in pending.rows.get(index, {}).items():
                    for positions, token_ids, values in parts:
                        writer.append_rows(rid, hook, positions, token_ids, values)
                request.finish_reason = choice.finish or finish
                writer.update_request(request)

    def _evict(self, keep: Path) -> None:
        files = sorted(self.directory.glob("c*.h5"), key=lambda f: f.stat().st_mtime)
        total = sum(f.stat().st_size for f in files)
        for old in files:
            if total <= self.limit_bytes:
                break
            if old != keep:
                total -= old.stat().st_size
                old.unlink(missing_ok=True)


def _tokens_of(rows: dict[str, list[tuple]]) -> list[int]:
    """The tokens a choice's rows so far were computed for, by position (a window's gaps: 0)."""
    found: dict[int, int] = {}
    for parts in rows.values():
        for positions, token_ids, _ in parts:
            found.update(zip(positions.tolist(), token_ids.tolist()))
    tokens = [0] * (max(found) + 1 if found else 0)
    for position, token in found.items():
        tokens[position] = token
    return tokens


def _objects(answer: bytes) -> list[dict]:
    """The JSON objects of an answer: itself, or a stream's chunks (``data: {...}`` lines)."""
    text = answer.decode("utf-8", errors="replace")
    if not text.lstrip().startswith("data:"):
        return [json.loads(text)]
    return [json.loads(line[5:]) for line in text.splitlines()
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]


def _choices(answer: bytes) -> dict[int, _Choice]:
    choices: dict[int, _Choice] = {}
    for obj in _objects(answer):
        prompt = obj.get("prompt_token_ids")  # a chat answer's, for all its choices
        for found in obj.get("choices") or []:
            choice = choices.setdefault(int(found.get("index", 0)), _Choice())
            ids = found.get("prompt_token_ids") or prompt
            if ids and not choice.prompt:
                choice.prompt = list(ids)
            choice.tokens += found.get("token_ids") or []
            choice.finish = found.get("finish_reason") or choice.finish
    return choices


def _response_id(answer: bytes) -> str | None:
    objects = _objects(answer)
    return objects[0].get("id") if objects else None


def server_metadata(vllm_config, mode: str) -> dict:
    """What a capture file says about the engine that made it."""
    import vllm

    model = vllm_config.model_config
    return {"model_path": str(model.model), "dtype": str(model.dtype).removeprefix("torch."), "engine_mode": mode,
            "vllm_version": vllm.__version__, "source": "OpenAI server"}
