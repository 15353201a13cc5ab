"""A ``SessionProtocol`` without vLLM, for driving the app quickly and deterministically.

It keeps the real session's contract (``tests/test_session.py`` runs the same scenario against both):
boot stages in order, request ids ``req<N>`` unique across sessions, every request announced in
``started`` of its first event, an intervention log that starts with ``(0, [])``, a final event that
ends every request when stopped, compiled hook changes that restart, failures as ``SessionError``
that leave the session dead and its run intact, and the catalogue the plugin gives a Llama of the
same shape. Activations are synthetic: ``fake_value(...) * scale + bias``; the tokens follow the
prompt's length, one word on while an intervention applies to the request. Attached SAEs are refused
as the real session refuses them, and their features are the reference encoding (``capture.sae``) of
the fake's rows, so a test may compare what the app shows with the encoding itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import numpy as np

from inspector.core.attention import AttentionGeometry
from inspector.core.hooks import HookPoint
from inspector.core.lens import (Attribution, Lens, checked_attribution_request, checked_lens_request,
                                    checked_token_ids)
from inspector.core.protocol import (BOOT_STAGES, BootProgress, RequestStart, RequestStep, Sampling, SessionError, check_request,
                                        SessionOptions, StepEvent)
from inspector.core.run import TopToken
from inspector.core.sae import AttachedSae, checked_attachment, encode, load_weights, strongest
from inspector.core.session_base import HeldInterventions, SessionBase
from inspector.core.windows import ALL, CaptureWindow, checked_windows, windows_from_patterns
from inspector.experiments.methods import Experiments

FAKE_VOCAB_SIZE = 1024  # the fake's token ids stay below it
VOCAB = [" the", " cat", " sat", " on", " a", " mat", ".", "\n", " and", " then", " it", " ran"]


def llama_catalogue(layers: int = 2, hidden: int = 128, intermediate: int = 256,
                    dtype: str = "float32") -> list[HookPoint]:
    """The hook points ``inspector.plugin.hookpoints`` finds in vLLM's Llama, in model order."""
    def point(path, kind, alias, width=hidden, layer=-1, attention=None):
        return HookPoint(f"{path}.{kind}", alias, path, kind, width, layer, dtype, attention)

    geometry = AttentionGeometry(heads=hidden // 64, kv_heads=hidden // 64, head_size=64, scale=64 ** -0.5)
    cat = [point("model.embed_tokens", "embed", "hook_embed")]
    for i in range(layers):
        b, blk = f"model.layers.{i}", f"blocks.{i}"
        cat += [point(b, "resid_pre", f"{blk}.hook_resid_pre", layer=i),
                point(f"{b}.self_attn.attn", "q", f"{blk}.attn.hook_q", layer=i, attention=geometry),
                point(f"{b}.self_attn.attn", "k", f"{blk}.attn.hook_k", layer=i, attention=geometry),
                point(f"{b}.self_attn.o_proj", "z", f"{blk}.attn.hook_z", layer=i),
                point(f"{b}.self_attn", "attn_out", f"{blk}.hook_attn_out", layer=i),
                point(f"{b}.post_attention_layernorm", "resid_mid", f"{blk}.hook_resid_mid", layer=i),
                point(f"{b}.mlp.down_proj", "mlp_post", f"{blk}.mlp.hook_post", intermediate, i),
                point(f"{b}.mlp", "mlp_out", f"{blk}.hook_mlp_out", layer=i),
                point(b, "resid_post", f"{blk}.hook_resid_post", layer=i)]
    return cat + [point("model.norm", "normalized", "ln_final.hook_normalized")]


def fake_unembedding(rows: np.ndarray) -> np.ndarray:
    """Logits of rows under a fixed random unembedding."""
    return rows @ np.random.default_rng(7).standard_normal((rows.shape[1], FAKE_VOCAB_SIZE)).astype(np.float32)


def top_scores(scores: np.ndarray, k: int, chosen) -> tuple:
    """(top ids, their scores, the chosen tokens' scores, their ranks) as the engine returns them."""
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    top = np.take_along_axis(scores, order, 1).astype(np.float32)
    if chosen is None:
        return order, top, None, None
    picked = scores[np.arange(len(chosen)), chosen]
    return order, top, picked.astype(np.float32), (scores > picked[:, None]).sum(1).astype(np.int64)


def fake_value(hook_index: int, positions: np.ndarray, width: int) -> np.ndarray:
    """Deterministic activations: distinct per hook, position and feature."""
    p = np.asarray(positions, dtype=np.float32)[:, None]
    f = np.arange(width, dtype=np.float32)[None, :]
    return (np.sin(0.37 * p + 0.11 * f + hook_index) * (1 + 0.05 * f) + 0.01 * p).astype(np.float32)


class FakeSession(SessionBase, HeldInterventions, Experiments):
    """Class attributes steer a test: delays, a failing boot, a crash at a given step."""

    boot_delay = 0.0
    step_delay = 0.0
    fail_open: str | None = None
    fail_at_step: int | None = None
    block_family = "fused (LlamaDecoderLayer), read from its forward"  # as the plugin's block reader names it
    refused_kinds: dict[str, str] = {}  # kind -> why the model offers no point of it

    def __init__(self, options: SessionOptions, layers: int = 2, hidden: int = 128, intermediate: int = 256):
        self.options = options
        self.catalogue = llama_catalogue(layers, hidden, intermediate, options.dtype)
        self._index = {h.name: i for i, h in enumerate(self.catalogue)}
        self.installed = self._resolve(options.hooks)
        self.alive = True
        self.threads: set[int] = {threading.get_ident()}  # threads that called in (tests check)
        self._stop = threading.Event()
        self._hold_interventions()
        self.saes: dict[str, AttachedSae] = {}
        self._sae_weights: dict[str, dict[str, np.ndarray]] = {}  # by SAE name, read once when attached
        self.windows: dict[str, CaptureWindow] = windows_from_patterns(options.windows, self.installed)
        self._windows_changed = False  # since the last step: the open requests take them at the next
        self.new_run()

    @classmethod
    def open(cls, options: SessionOptions, progress=None) -> "FakeSession":
        report = progress or (lambda p: None)
        for stage in BOOT_STAGES[:-1]:
            report(BootProgress(stage, f"{stage} {options.model}"))
            time.sleep(cls.boot_delay / (len(BOOT_STAGES) - 1))
            if cls.fail_open and stage == "loading":
                raise SessionError(cls.fail_open)
        session = cls(options)
        report(BootProgress("ready", "ready"))
        return session

    # ---- the protocol ----
    def new_run(self) -> None:
        self.threads.add(threading.get_ident())
        super().new_run()

    def stop(self) -> None:
        self._stop.set()

    def set_windows(self, windows: dict[str, CaptureWindow]) -> None:
        checked = checked_windows(windows, self.installed)
        with self._lock:
            self.windows, self._windows_changed = checked, True

    def set_hooks(self, patterns: list[str]) -> bool:
        self._require_alive()
        self.threads.add(threading.get_ident())
        self.installed = self._resolve(patterns)
        self.windows = {name: w for name, w in self.windows.items() if name in self.installed}
        self.options = replace(self.options, hooks=tuple(patterns))
        self.run.hooks.update(self.installed)
        self._keep_installed_interventions()
        self.saes = {name: sae for name, sae in self.saes.items() if sae.hook in self.installed}
        self._sae_weights = {name: self._sae_weights[name] for name in self.saes}
        if self.options.mode == "compiled":
            time.sleep(self.boot_delay)
            return True
        return False

    def lens(self, values, k: int = 5, chosen=None) -> Lens:
        """A fixed random unembedding of unit-normalised rows (the real one is tested against transformers)."""
        self._require_alive()
        self.threads.add(threading.get_ident())
        width = next(h.width for h in self.catalogue if h.kind == "normalized")
        values, chosen = checked_lens_request(values, k, chosen, width, FAKE_VOCAB_SIZE)
        logits = fake_unembedding(values / np.maximum(np.linalg.norm(values, axis=1, keepdims=True), 1e-6))
        shifted = logits - logits.max(1, keepdims=True)
        arrays = top_scores(shifted - np.log(np.exp(shifted).sum(1, keepdims=True)), k, chosen)
        return Lens(*arrays)

    def attribution(self, values, final_residual, k: int = 5, chosen=None) -> Attribution:
        """The fake unembedding of rows scaled by their final residual's norm (the real one is tested
        against transformers)."""
        self._require_alive()
        self.threads.add(threading.get_ident())
        width = next(h.width for h in self.catalogue if h.kind == "normalized")
        values, residual, chosen = checked_attribution_request(values, final_residual, k, chosen, width, FAKE_VOCAB_SIZE)
        scale = np.maximum(np.linalg.norm(residual, axis=1, keepdims=True), 1e-6)
        return Attribution(*top_scores(fake_unembedding(values / scale), k, chosen))

    def token_texts(self, ids) -> list[str]:
        """Generated tokens as they were given (``VOCAB``); any other id as ``<id>``."""
        self._require_alive()
        self.threads.add(threading.get_ident())
        ids = checked_token_ids(ids, FAKE_VOCAB_SIZE)
        return [VOCAB[i - 500] if 0 <= i - 500 < len(VOCAB) else f"<{i}>" for i in ids.tolist()]

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """As prompts are tokenized (``_start``), without the empty prompt's placeholder (no special tokens
        either way)."""
        self._require_alive()
        return [sum(map(ord, text[i:i + 3])) % 1000 for i in range(0, len(text), 3)]

    def attach_sae(self, path, hook: str | None = None, k: int = 32) -> AttachedSae:
        """As the real session: the same checks (``checked_attachment``)."""
        self._require_alive()
        self.threads.add(threading.get_ident())
        sae = checked_attachment(path, hook, k, self.installed, self.saes)
        self._sae_weights[sae.name] = load_weights(sae.config)
        self.saes[sae.name] = sae
        self._note_saes()
        return sae

    def detach_sae(self, name: str) -> None:
        self._require_alive()
        self.threads.add(threading.get_ident())
        self.saes.pop(name, None)
        self._sae_weights.pop(name, None)
        self._note_saes()

    def close(self) -> None:
        self.threads.add(threading.get_ident())
        self.alive = False

    def generate(self, prompts: list[str], sampling: Sampling = Sampling()):
        self._require_alive()
        check_request(prompts, sampling)
        self.threads.add(threading.get_ident())
        self._stop.clear()
        ids = self._take_request_ids(len(prompts))
        with self._lock:
            windows = {rid: dict(self.windows) for rid in ids}
        started = tuple(self._start(rid, prompt, sampling, windows[rid]) for rid, prompt in zip(ids, prompts))
        # per open request: positions of its next forward, its tokens, the interventions its log last noted
        todo = {s.request_id: list(range(len(s.prompt_token_ids))) for s in started}
        tokens = {s.request_id: list(s.prompt_token_ids) for s in started}
        prompt_lens = {rid: len(t) for rid, t in tokens.items()}
        noted: dict[str, tuple | None] = {rid: None for rid in todo}
        for step in range(10 ** 9):
            if self._stop.is_set():
                yield self._event(step, started, [RequestStep(rid, finished=True, finish_reason="stopped")
                                                  for rid in todo])
                return
            if self.fail_at_step is not None and step == self.fail_at_step:
                self.alive = False
                raise SessionError("the engine failed while generating: RuntimeError: engine core died (simulated "
                                   "crash). Everything captured so far is kept; open a new session to go on.")
            time.sleep(self.step_delay)
            pending = self._take_pending()
            if pending is not None:
                self._interventions = pending
            with self._lock:
                changed, self._windows_changed = self._windows_changed, False
                if changed:
                    windows = {rid: dict(self.windows) for rid in windows}
            steps = [self._step(rid, todo, tokens[rid], prompt_lens[rid], noted, sampling, windows[rid], changed)
                     for rid in list(todo)]
            yield self._event(step, started, steps)
            started = ()
            if not todo:
                return

    # ---- internals ----
    def _run_metadata(self) -> dict:
        return {"model": self.options.model, "model_path": f"/fake/{self.options.model}",
                "engine_mode": self.options.mode, "dtype": self.options.dtype, "block_family": self.block_family,
                "refused_kinds": dict(self.refused_kinds), "saes": self._sae_metadata()}

    def _require_alive(self) -> None:
        if not self.alive:
            raise SessionError("this session is closed or its engine failed; open a new session")

    def _resolve(self, patterns) -> dict[str, HookPoint]:
        out = {}
        for pattern in patterns:
            hits = [h for h in self.catalogue if h.matches(pattern)]
            if not hits:
                raise ValueError(f"hook pattern {pattern!r} matches no hook point of this model")
            out.update({h.name: h for h in hits})
        return out

    def _start(self, rid: str, prompt: str, sampling: Sampling, windows: dict[str, CaptureWindow]) -> RequestStart:
        texts = tuple(prompt[i:i + 3] for i in range(0, len(prompt), 3)) or (" ",)
        return RequestStart(rid, prompt, tuple(sum(map(ord, t)) % 1000 for t in texts), texts, sampling.as_dict(),
                            {name: str(w) for name, w in windows.items()})

    def _step(self, rid: str, todo: dict, tokens: list[int], prompt_len: int, noted: dict,
              sampling: Sampling, windows: dict[str, CaptureWindow], windows_changed: bool) -> RequestStep:
        positions = np.array(todo[rid], dtype=np.int64)
        token_ids = np.array([tokens[p] for p in positions], dtype=np.int64)
        mine = tuple(iv for iv in self._interventions if iv.applies_to(rid))
        log = ()
        if noted[rid] is None or noted[rid] != mine:
            noted[rid] = mine
            log = ((int(positions[0]), tuple(iv.as_dict() for iv in mine)),)
        rows = {}
        for name, info in self.installed.items():
            values = fake_value(self._index[name], positions, info.width)
            for iv in mine:
                if iv.hook == name:
                    mask = np.ones(len(positions), bool) if iv.positions is None else np.isin(positions, iv.positions)
                    values[mask] = values[mask] * iv.vector("scale", info.width) + iv.vector("bias", info.width)
                    if iv.clamp is not None:  # as the engine clamps (hookpoints.clamp_delta)
                        pre = values[mask] @ iv.clamp.encoder + iv.clamp.offset
                        wanted = iv.clamp.value - pre * (pre > iv.clamp.floor)
                        values[mask] += (wanted[:, None] * iv.clamp.decoder).astype(values.dtype)
            rows[name] = (positions, token_ids, values)
        scores = None
        if sampling.score_token_ids:
            scores = (positions[-1:], self._scores(rows, tokens, sampling.score_token_ids)[None])
        features = {name: self._features(sae, *rows[sae.hook]) for name, sae in self.saes.items() if sae.hook in rows}
        if not sampling.capture:
            rows, features = {}, {}
        for name in windows.keys() & rows.keys():  # as the engine keeps them, after the forward
            keep = windows.get(name, ALL).keeps(positions, prompt_len)
            rows[name] = tuple(a[keep] for a in rows[name])
        rows = {name: r for name, r in rows.items() if len(r[0])}
        n_generated = len(tokens) - prompt_len
        # an intervention in effect moves the choice one word on: a comparison's twins part where it starts
        choice = (n_generated + prompt_len + bool(mine)) % len(VOCAB)
        text, runner_up = VOCAB[choice], (choice - 1) % len(VOCAB)
        token, logprob = 500 + choice, -0.1 - 0.05 * n_generated
        top = (TopToken(token, logprob, text), TopToken(500 + runner_up, logprob - 1.0, VOCAB[runner_up]))
        finished = n_generated + 1 >= sampling.max_tokens
        tokens.append(token)
        todo[rid] = [len(tokens) - 1]
        if finished:
            del todo[rid]
        return RequestStep(rid, (token,), (text,), (logprob,), (top,), rows, log, finished,
                           "length" if finished else None, scores, features,
                           {name: str(w) for name, w in windows.items()} if windows_changed else None)

    def _features(self, sae: AttachedSae, positions: np.ndarray, token_ids: np.ndarray, values: np.ndarray) -> tuple:
        """(positions, ids, activations) of each row's ``sae.k`` strongest features, as the engine sends them."""
        return (positions, *strongest(encode(sae.config, self._sae_weights[sae.name], values), sae.k))

    def _scores(self, rows: dict, tokens: list[int], ids) -> np.ndarray:
        """Logprobs of ``ids`` next: the fake unembedding of the installed hooks' rows of this step,
        averaged, plus a pull towards the tokens so far (so that prompts differ)."""
        mean = np.mean([values.mean(0) for _, _, values in rows.values()], axis=0)[:128]
        logits = fake_unembedding(np.pad(mean, (0, 128 - len(mean)))[None])[0]
        logits += np.sin(0.1 * sum(tokens) + np.arange(FAKE_VOCAB_SIZE)).astype(np.float32)
        shifted = logits - logits.max()
        return (shifted - np.log(np.exp(shifted).sum()))[list(ids)].astype(np.float32)

    def _event(self, step: int, started: tuple, steps: list[RequestStep]) -> StepEvent:
        event = StepEvent(step, tuple(steps), started, owns_rows=True)  # each step's arrays are new
        self._fold(event)
        return event
