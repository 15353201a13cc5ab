"""``inspector capture``: generate headless and write the captures (rows, SAE features, the logit lens)
to a capture file as they come, with interventions and feature steering given on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inspector.core.hooks import RESIDUAL_KINDS
from inspector.core.interventions import Intervention
from inspector.core.lens import MAX_K
from inspector.core.positions import parse_positions
from inspector.core.protocol import Sampling, SessionProtocol, check_request
from inspector.core.sae import decoder_row, feature_clamp, read_sae
from inspector.core.vectors import load_vector
from inspector.core.windows import parse_window_option, windows_from_patterns
from inspector.experiments.compare import compare, upcoming_twins

from .engine_options import DEFAULT_HOOKS, add_engine_options, add_server_options, add_window_option, open_session
from .progress import TerminalProgress


def add_parser(sub) -> None:
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


def run(args) -> int:
    from inspector.io.atomic_file import check_target

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
    from inspector.io.background import prepare

    prepare()  # the capture file's writer process starts while the engine boots
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
