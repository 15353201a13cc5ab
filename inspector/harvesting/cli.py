"""``inspector harvest``: the command line of a harvest to disk (progress with rate and ETA; the first
Ctrl-C stops after the chunk under way is dropped, leaving complete shards and a valid manifest; the
same command resumes)."""

from __future__ import annotations

import json
import signal
import sys
import threading

from .run import SEPARATORS, HarvestSpec
from .shards import LAYOUTS
from .store import HarvestProgress, harvest_to_disk


def add_parser(sub, add_engine_options) -> None:
    hv = sub.add_parser("harvest", help="activations of a corpus to disk, for training SAEs, probes and vectors",
                        description="Tokenize a corpus, pack it into contexts (as SAELens does), run them "
                                    "prefill-only through the compiled engine at full batch and write the hooks' "
                                    "rows as safetensors shards with a manifest (harvest.json), or as a dataset "
                                    "SAELens trains from (--format saelens). The engine stops after the deepest "
                                    "hooked block. Ctrl-C stops after the shard under way; the same command "
                                    "resumes where it stopped.")
    add_engine_options(hv, hooks_required=True)
    hv.add_argument("--corpus", required=True, help="text (one document a line), JSONL (a \"text\" field), or a "
                                                    "Hugging Face datasets directory (save_to_disk; a \"text\" column)")
    hv.add_argument("--context-size", type=int, default=128, metavar="N", help="tokens per context (default 128)")
    hv.add_argument("--tokens", type=int, default=None, metavar="T",
                    help="stop after T tokens (whole contexts; default: the whole corpus)")
    hv.add_argument("--out", required=True, help="the output directory (an unfinished harvest there is resumed)")
    hv.add_argument("--format", choices=LAYOUTS, default="safetensors",
                    help="safetensors shards (default), or saelens: a dataset for SAELens's cached_activations_path")
    hv.add_argument("--no-prepend-bos", dest="prepend_bos", action="store_false",
                    help="contexts do not start with the beginning-of-sequence token")
    hv.add_argument("--separator", choices=SEPARATORS, default="bos",
                    help="the token put between documents in a context (default bos, as SAELens)")
    hv.add_argument("--exclude-special", action="store_true",
                    help="leave out the rows of special tokens (BOS, EOS, padding)")
    hv.add_argument("--full-depth", action="store_true",
                    help="run every block, even past the deepest hooked one")
    hv.add_argument("--max-num-batched-tokens", type=int, default=0, metavar="N",
                    help="tokens per engine step (default: max(context size, 8192))")
    hv.add_argument("--shard-mb", type=int, default=256, metavar="MB",
                    help="rows per shard, in MiB (default 256; 0: a context a shard)")
    hv.add_argument("--json", action="store_true", help="print the manifest on stdout")


def run(args, engine_args: dict, stage) -> int:
    spec = HarvestSpec(args.model, args.corpus, tuple(args.hooks), args.context_size, args.tokens, args.prepend_bos,
                       args.separator, args.exclude_special, args.full_depth, args.mode, args.dtype,
                       args.max_num_batched_tokens, args.shard_mb << 20, engine_args)
    stop = threading.Event()

    def interrupted(*_):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\n[harvest] stopping: the shard under way is dropped (Ctrl-C again to stop now)", file=sys.stderr,
              flush=True)

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        manifest = harvest_to_disk(spec, args.out, args.format, stage, _shown, stop)
    finally:
        signal.signal(signal.SIGINT, previous)
    if args.json:
        print(json.dumps(manifest, indent=1))
    else:
        what = "complete" if manifest["complete"] else "stopped: run the same command to resume"
        print(f"wrote {args.out}: {manifest['rows']} rows of {len(manifest['hooks'])} hook(s) in "
              f"{len(manifest['shards'])} shard(s), {manifest['stopped_because']} ({what})")
    return 0 if manifest["complete"] else 130


def _shown(p: HarvestProgress) -> None:
    rate = p.rows_this_run / max(p.seconds, 1e-9)
    eta = f", ETA {max(p.total - p.rows, 0) / max(rate, 1e-9):.0f} s" if p.total else ""
    of = f"/{p.total}" if p.total else ""
    end = "" if sys.stderr.isatty() else "\n"
    print(f"{chr(13) if end == '' else ''}[harvest] {p.rows}{of} tokens, {rate:,.0f} tokens/s{eta}", end=end,
          file=sys.stderr, flush=True)
