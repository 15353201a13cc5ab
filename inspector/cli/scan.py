"""``inspector scan``: a corpus through the engine prefill-only; per SAE feature (or neuron) its strongest
contexts, saved as it goes and resumed where it stopped."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from inspector.core.sae import read_sae
from inspector.harvesting.corpus import Corpus

from .engine_options import add_engine_options, add_server_options, open_session
from .progress import TerminalProgress


def add_parser(sub) -> None:
    sc = sub.add_parser("scan", help="max-activating contexts of every SAE feature (or neuron) over a corpus",
                        description="Run a corpus through the engine prefill-only, in batches, keeping per SAE "
                                    "feature (or, without --sae, per neuron of the hook) its --top strongest "
                                    "activations with the tokens around them, and a histogram of all it saw "
                                    "(docs/scan-format.md). Saved as it goes; Ctrl-C stops after the current batch, "
                                    "and the same command resumes where it stopped.")
    add_engine_options(sc)
    add_server_options(sc)
    sc.add_argument("--corpus", required=True, help="a text file (one document per line), JSONL (a \"text\" field) "
                    "or a datasets directory (save_to_disk)")
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


def run(args) -> int:
    """A corpus through the engine prefill-only; per feature (or neuron) its strongest contexts."""
    import signal
    import time

    from inspector.experiments.scan import ScanSpec, ScanState, scan as run_scan
    from inspector.io.scan import read_scan, write_scan
    from inspector.io.atomic_file import check_target

    corpus = Corpus.open(args.corpus)  # text lines, JSONL or a datasets directory, as a harvest reads them
    documents = list(corpus.texts())
    out = Path(args.out)
    check_target(out)
    sae = read_sae(args.sae) if args.sae else None
    hook = args.hook or (sae.hook if sae else None)
    if not hook:
        raise ValueError("say which hook to scan (--hook), or give an SAE whose config names one (--sae)")
    if not args.server:  # a server's hooks are its own: the hook must be one it captures
        args.hooks = [hook]
    settings = {"model": args.model, "corpus": str(corpus.path.resolve()), "documents": len(documents),
                "corpus_sha256": corpus.sha256, "hook": hook,
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

