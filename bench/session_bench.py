"""Rows delivered end to end: a session's tokens/s against vanilla ``LLM.generate``, side by side.

    packaging/dev bench session_bench                        # CPU: the plugin bench's small Llama
    python3 bench/session_bench.py --preset llama3-8b        # GPU: Llama-3-8B shape, dummy bf16 weights

Up to three engines of the same model stay up at once (booted one after another), and the runs alternate
between them (noise hits all alike): vanilla vLLM in a process of its own (``LLM.generate``, its defaults); a hooked engine in
this process (booted where one of its consumers is measured), whose ``Session`` delivers the rows of every block's residual stream to

- memory: the session's run keeps every row;
- file: every row written to an HDF5 capture file as ``inspector capture`` writes it (``cli.record``,
  closed and synced before the clock stops; its writer's process started, and its ring's memory
  made, before the clock starts, as the command has them while its engine boots);

and a server of its own (``start_local_server``) whose client in this process keeps every row: through
the shared memory it offers (server), or, a second client of the same server, through the socket
(socket). The file's bound is the disk: its write speed is measured here too (``disk_seconds`` of
``--disk-gib``), and the target is 0.9x the lesser of vanilla and what that speed allows for the rows (a
request's prompt rows as well as its generated ones: about two rows a generated token with the default
lengths). Prompts are ``--prompt-tokens`` long, ``--new-tokens`` are generated, greedy, ``ignore_eos``,
with ``--logprobs`` top logprobs a token on both sides (none by default: the rows' cost is measured, not
the logprobs').
Each engine's first run of a size is printed apart: it allocates the host memory that later runs reuse.
On a GPU every engine gets the same KV cache, enough for the largest batch's requests at once
(``--kv-cache-gib`` to choose it): sized from a share of the memory, a hooked engine's was smaller than
vanilla's and ran fewer requests at once.

Where the time goes: ``--time-parts`` prints, for each run, the seconds spent in vLLM's step (vanilla's
and the in-process session's) and, for the session, in the plugin's copies queued in it, the drain,
the event, and a capture file's calls (rows into its writer's ring) and close. On a small machine,
``py-spy record --format raw --subprocesses --idle --threads -o F -- python3 bench/session_bench.py``
works too (on the H200 it fell minutes behind): each run's stacks pass through a frame named
``<consumer>_b<batch>`` (``<consumer>first_b<batch>`` for the first), and ``bench/stacks.py F`` sums them.
``--profile DIR`` runs each in-process consumer once more at each batch under torch's profiler (the CUDA
calls that wait: ``cudaStreamSynchronize``, ``cudaEventSynchronize``, ``cudaHostAlloc``) and once under
``cProfile`` (the Python of a step, the engine's included), and writes their tables to DIR.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture_file_bench import disk_mb_s  # noqa: E402
from plugin_bench import PRESETS, model_dir, receive, timed  # noqa: E402

HOOKS = ("blocks.*.hook_resid_post",)


def labelled(fn, label: str):
    """``fn`` under the name ``label``, so that a sampling profiler's stacks (``py-spy record --format
    raw``) tell the runs apart by consumer and batch."""
    code = fn.__code__.replace(co_name=label, co_qualname=label)
    return types.FunctionType(code, fn.__globals__, label, fn.__defaults__, fn.__closure__)


def prompts(preset: str, batch: int, length: int) -> list[str]:
    """Distinct prompts of ``length`` tokens (no prefix shared: the engines do not cache prefixes)."""
    if preset == "cpu":  # the tiny model's byte-level tokenizer: a character a token, about
        return [("".join(chr(97 + (i * 7 + k * 3) % 26) for k in range(length))) for i in range(batch)]
    return [" ".join(f"w{2 + (i * 131 + k * 17) % 100000}" for k in range(length)) for i in range(batch)]


PARTS: dict[str, float] = {}  # seconds a run spent in the parts counted (--time-parts)


def count_seconds(owner, name: str, part: str) -> None:
    """Add the seconds spent in ``owner.name`` to ``PARTS[part]``."""
    setattr(owner, name, timed(getattr(owner, name), part, PARTS))


def report_parts(what: str, batch: int, new_tokens: int, seconds: float) -> None:
    if PARTS:
        print(f"  {what} {batch} x {new_tokens}: {seconds:.3f} s, of which " +
              ", ".join(f"{part} {spent:.3f}" for part, spent in PARTS.items()), flush=True)


def kv_cache_bytes(path: str, dtype: str, tokens: int) -> int:
    """What ``tokens`` tokens' keys and values take in the model at ``path``, a tenth more for the blocks'
    rounding."""
    import torch

    config = json.loads((Path(path) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim
    return int(per_token * torch.finfo(getattr(torch, dtype)).bits // 8 * tokens * 1.1)


def vanilla(conn, preset: str, path: str, engine_args: dict, parts: bool, logprobs: int) -> None:
    """Vanilla vLLM: answers ("run", batch, prompt_tokens, new_tokens) with generated tokens/s."""
    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from vllm import LLM, SamplingParams

    llm = LLM(model=path, enable_prefix_caching=False, **engine_args)
    if parts:
        count_seconds(type(llm.llm_engine), "step", "vLLM step")
    conn.send("ready")

    def run(batch, prompt_tokens, new_tokens):
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs or None)
        PARTS.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompts(preset, batch, prompt_tokens), params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        report_parts("vanilla", batch, new_tokens, seconds)
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds

    while (msg := conn.recv())[0] == "run":
        _, batch, prompt_tokens, new_tokens = msg
        conn.send(labelled(run, f"vanilla_b{batch}")(batch, prompt_tokens, new_tokens))


def time_parts(session) -> None:
    """Count the seconds spent in the session's parts: vLLM's step (the plugin's copies queued inside
    it counted apart too), the drain of the worker's rows, the event made and folded into the run, and
    a capture file's calls (its rows copied into the writer's ring) and close (the last rows written,
    the file synced)."""
    from inspector.io.background import BackgroundWriter
    from inspector.plugin.copyout import CopyOut

    count_seconds(type(session._llm.llm_engine), "step", "vLLM step")
    count_seconds(CopyOut, "queue", "copies queued (in the step)")
    count_seconds(type(session), "_drain", "drain")
    count_seconds(type(session), "_event", "event and fold")
    count_seconds(BackgroundWriter, "call", "file calls")
    count_seconds(BackgroundWriter, "close", "file close")


def profiled(run, texts: list[str], new_tokens: int, out: Path, name: str) -> None:
    """``run`` once under torch's profiler and once under cProfile; their tables go to ``out``, the top of
    each to the terminal."""
    import cProfile
    import io
    import pstats

    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as profile:
        run(texts, new_tokens)
    table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    (out / f"torch-{name}.txt").write_text(table)
    print(f"torch profiler, {name} (self CPU time):\n" + "\n".join(table.splitlines()[:18]), flush=True)
    profiler = cProfile.Profile()
    profiler.runcall(run, texts, new_tokens)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    (out / f"cprofile-{name}.txt").write_text(text.getvalue())
    top = io.StringIO()
    pstats.Stats(profiler, stream=top).sort_stats("tottime").print_stats(25)
    print(f"cProfile, {name} (own time):\n" + top.getvalue().split("\n\n", 2)[-1], flush=True)


def tokens_per_s(session, texts: list[str], new_tokens: int, logprobs: int, consume=None, what: str = "",
                 capture: bool = True) -> float:
    from inspector.core.protocol import Sampling

    session.new_run()
    PARTS.clear()
    events = session.generate(texts, Sampling(max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs,
                                                   capture=capture))
    t0 = time.perf_counter()
    if consume is None:
        tokens = sum(len(step.new_token_ids) for event in events for step in event.requests)
    else:
        tokens = consume(events)
    seconds = time.perf_counter() - t0
    session.new_run()  # the rows are let go before the next run
    report_parts(what, len(texts), new_tokens, seconds)
    return tokens / seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, nargs="+", help="default: 1 8 on CPU, 1 32 256 on a GPU")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--logprobs", type=int, default=0,
                   help="top logprobs a token, vanilla's and the session's alike (the session's own default is 5)")
    p.add_argument("--consumers", nargs="+", default=["memory", "file", "server"],
                   choices=["memory", "file", "server", "socket", "dropped", "uncaptured"],
                   help="also, to tell the costs apart: dropped (rows reach the host, and each step's are let "
                        "go), uncaptured (the same session, no row leaving the device)")
    p.add_argument("--out-dir", default=None, help="where the capture files go (default: a temporary folder)")
    p.add_argument("--disk-gib", type=float, default=4.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.28, help="per engine (three share the GPU)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="every engine's KV cache on a GPU, the same for all (default: what the largest batch's "
                        "tokens need). Sized from the memory share, a hooked engine's was smaller (its capture "
                        "buffers take some), and at batch 256 on an H100 it ran fewer requests at once than "
                        "vanilla. Three 8B engines with batch 256's cache do not fit an H100: measure the "
                        "consumers in two runs")
    p.add_argument("--time-parts", action="store_true",
                   help="print, for each run of vanilla and the in-process session, the seconds spent in its parts")
    p.add_argument("--profile", type=Path, default=None,
                   help="after the reps, profile one run of each in-process consumer at each batch; tables go here")
    args = p.parse_args(argv)

    from inspector.core.protocol import SessionOptions
    from inspector.cli.capture import record
    from inspector.io.background import prepare
    from inspector.engine.environment import prepare_environment

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # idle engines must not spin on the shared cores
    prepare_environment()
    import torch

    cuda = torch.cuda.is_available()
    _, dtype, max_batched, _, _ = PRESETS[args.preset]
    batches = args.batches or ([1, 32, 256] if cuda else [1, 8])
    path, extra = model_dir(args.preset)
    engine_args = {k: v for k, v in extra.items() if k != "skip_tokenizer_init"}
    engine_args.update(dtype=dtype, max_num_batched_tokens=max_batched, max_model_len=1024,
                       max_num_seqs=max(256, max(batches)))
    if cuda:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
        tokens = max(batches) * (args.prompt_tokens + args.new_tokens)
        engine_args["kv_cache_memory_bytes"] = (int(args.kv_cache_gib * 2**30) if args.kv_cache_gib
                                                else kv_cache_bytes(path, dtype, tokens))
        print(f"every engine's KV cache: {engine_args['kv_cache_memory_bytes'] / 2**30:.1f} GiB "
              f"({tokens:,} tokens at once need it)", flush=True)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="session-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=vanilla, args=(child, args.preset, path, engine_args, args.time_parts, args.logprobs),
                       daemon=True)
    proc.start()
    options = SessionOptions(model=path, hooks=HOOKS, dtype=dtype, max_model_len=1024, max_num_batched_tokens=max_batched,
                             engine_args={k: v for k, v in engine_args.items()
                                          if k not in ("dtype", "max_num_batched_tokens", "max_model_len")})
    from inspector.client import connect
    from inspector.client.local import start_local_server
    from inspector.engine.session import Session

    receive(parent, proc)  # one boot at a time: vLLM sizes its KV cache from the memory free meanwhile
    in_process = set(args.consumers) - {"server", "socket"}  # an engine in this process only for these
    session = Session.open(replace(options, retain_rows=True)) if in_process else None
    if args.time_parts and session is not None:
        time_parts(session)
    server = start_local_server(options) if {"server", "socket"} & set(args.consumers) else None
    by_socket = connect(server._conn.url, shared_rows=False) if "socket" in args.consumers else None
    installed = (session or server).installed
    bytes_per_token = sum(h.width for h in installed.values()) * torch.finfo(getattr(torch, dtype)).bits // 8
    disk = disk_mb_s(out_dir, args.disk_gib)
    print(f"engines up; {len(installed)} hooks, {bytes_per_token / 1024:.0f} KiB of rows a token; "
          f"disk {disk:,.0f} MB/s", flush=True)

    def in_memory(texts, new):
        session.options = replace(session.options, retain_rows=True)
        return tokens_per_s(session, texts, new, args.logprobs, what="memory")

    def to_file(texts, new):
        session.options = replace(session.options, retain_rows=False)
        target = out_dir / "bench.h5"
        written = []

        def consume(events):
            record(session, events, target, progress=written.append)
            return written[-1]
        # the file's writer process started ahead (as ``inspector capture`` starts it while its engine boots)
        prepare(wait=True)
        rate = tokens_per_s(session, texts, new, args.logprobs, consume, "file")
        target.unlink()
        return rate

    def dropped(texts, new):
        session.options = replace(session.options, retain_rows=False)
        return tokens_per_s(session, texts, new, args.logprobs, what="dropped")

    def uncaptured(texts, new):
        session.options = replace(session.options, retain_rows=False)
        return tokens_per_s(session, texts, new, args.logprobs, what="uncaptured", capture=False)

    def via_server(texts, new):
        return tokens_per_s(server, texts, new, args.logprobs)

    def via_socket(texts, new):
        return tokens_per_s(by_socket, texts, new, args.logprobs)

    def vanilla_run(texts, new):
        parent.send(("run", len(texts), args.prompt_tokens, new))
        return receive(parent, proc)

    runners = {"vanilla": vanilla_run, "memory": in_memory, "file": to_file, "server": via_server, "socket": via_socket,
               "dropped": dropped, "uncaptured": uncaptured}
    chosen = ["vanilla", *args.consumers]
    rates = {(name, b): [] for name in chosen for b in batches}
    first = {}  # each engine's first run of a size, not counted: it allocates the host memory later runs reuse
    try:
        for b in batches:
            for name in chosen:
                run = labelled(runners[name], f"{name}first_b{b}")
                first[(name, b)] = run(prompts(args.preset, b, args.prompt_tokens), args.new_tokens)
        for rep in range(args.reps):
            for b in batches:
                texts = prompts(args.preset, b, args.prompt_tokens)
                for name in chosen[rep % len(chosen):] + chosen[:rep % len(chosen)]:
                    run = labelled(runners[name], f"{name}_b{b}")
                    rates[(name, b)].append(run(texts, args.new_tokens))
            print(f"rep {rep + 1}/{args.reps} done", flush=True)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
            for b in batches:
                for name in ("memory", "file"):
                    if name in args.consumers:
                        profiled(runners[name], prompts(args.preset, b, args.prompt_tokens), args.new_tokens,
                                 args.profile, f"{name}-b{b}")
    finally:
        parent.send(("stop",))
        if session is not None:
            session.close()
        if by_socket is not None:
            by_socket.close()
        if server is not None:
            server.close()
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)

    print(f"\n{'measure':58s} {'value':>14s}  target  met")
    for b in batches:
        med = {name: statistics.median(rates[(name, b)]) for name in chosen}
        spread = {name: f"{min(rates[(name, b)]):,.0f}-{max(rates[(name, b)]):,.0f}" for name in chosen}
        for name in chosen:
            print(f"batch {b}, {name:52s} {med[name]:>10,.1f} tok/s  ({spread[name]}; "
                  f"first run {first[(name, b)]:,.0f})")
        # a request's rows: its prompt's and every generated token's but the last (never fed back)
        rows_per_token = (args.prompt_tokens + args.new_tokens - 1) / args.new_tokens
        disk_bound = disk * 1e6 / (bytes_per_token * rows_per_token)
        for name in args.consumers:
            bound = min(med["vanilla"], disk_bound) if name == "file" else med["vanilla"]
            ratio = med[name] / bound
            what = "min(vanilla, disk bound)" if name == "file" else "vanilla"
            print(f"batch {b}, {name} / {what:40s} {ratio:>14.3f}  >= 0.9  {'yes' if ratio >= 0.9 else 'NO'}")
        print(f"batch {b}, disk bound {disk_bound:,.0f} tok/s ({rows_per_token:.2f} rows written a generated token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
