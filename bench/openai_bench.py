"""vLLM's OpenAI server with the inspector's plugins against stock vLLM, under concurrent load.

    python3 bench/openai_bench.py                          # CPU: the demo model
    python3 bench/openai_bench.py --preset llama3-8b --requests 512 --max-tokens 128   # GPU: 8B shape, dummy bf16

Stock vLLM and ``inspector serve --openai`` are served side by side (on a GPU each takes 0.42 of its
memory unless ``--engine-args`` says otherwise), so that a drift of the machine's speed falls on both,
and each round loads them in turn: stock (A), then ours unsteered (the plugin idle), four named vectors
(requests cycle through them), the same four sent inline, a distinct inline vector per request (each
salts its own prefix-cache blocks, so it gives up the shared prompt's hits), unsteered again, and stock
again (B: with A, the pair that says how noisy the machine is). Every request shares one system prompt
(a prefix-cache hit for all but the first; ``--no-shared-prefix``: none) and adds a line of its own.
Printed: completion tokens/s of each load (``--rounds N``: N rounds, medians compared), the prefix-cache
hit rate over it, the CPU time a request took in the API server's process and in the engine's processes
(where a load's cost lies), and the ratios the issue targets: plugin idle / stock (>= 0.98), steered /
plugin idle (>= 0.95).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inspector.core.models import resolve_model  # noqa: E402
from inspector.core.request_edits import encode_vector  # noqa: E402
from inspector.engine.environment import prepare_environment  # noqa: E402
from inspector.openai.cli import OPENAI_SERVER_MODULE, vllm_flags  # noqa: E402
from plugin_bench import PRESETS, model_dir  # noqa: E402

HOOK = "blocks.1.hook_resid_post"
SYSTEM = "You are a careful assistant who answers in short sentences about lists, numbers and words. " * 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(command: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                               env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return process, url
        except OSError:
            time.sleep(0.5)


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()


def prefix_counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()

    def counter(name):
        return float(re.search(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M).group(1))

    return counter("prefix_cache_hits"), counter("prefix_cache_queries")


def word_prompts(shared_prefix: bool):
    """Prompts for a word-level tokenizer (one id per word ``wN``, the dummy-weight presets'): a shared
    system prompt of 96 words, then 16 words of each request's own."""
    system = " ".join(f"w{k + 2}" for k in range(96)) if shared_prefix else ""
    return lambda i: f"{system} " + " ".join(f"w{1000 + (i * 16 + k) % 100_000}" for k in range(16))


def text_prompts(shared_prefix: bool):
    system = SYSTEM if shared_prefix else ""
    return lambda i: f"{system}\nQuestion {i}: count to {i % 9}."


async def load(url: str, model: str, requests: int, concurrency: int, max_tokens: int, xargs, prompt) -> float:
    """Completion tokens per second of ``requests`` requests, ``concurrency`` at a time; ``xargs(i)``:
    request i's vllm_xargs (None: unsteered), ``prompt(i)`` its prompt."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        extra = {"ignore_eos": True, **({"vllm_xargs": xargs(i)} if xargs(i) else {})}
        async with gate:
            answer = await client.completions.create(model=model, prompt=prompt(i),
                                                     max_tokens=max_tokens, temperature=0, extra_body=extra)
        tokens += answer.usage.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.perf_counter() - started
    await client.close()
    return tokens / seconds


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the API server's process, and of its children (the engine's processes)."""
    import psutil

    server = psutil.Process(pid)
    engine = 0.0
    for child in server.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        engine += times.user + times.system
    times = server.cpu_times()
    return times.user + times.system, engine


def measure(url: str, pid: int, model: str, args, xargs, first: int = 0) -> dict:
    """One load; request i carries ``xargs(first + i)`` (each round its own distinct vectors)."""
    prompt = (word_prompts if args.preset != "cpu" else text_prompts)(args.shared_prefix)
    # warm: compile sizes, the shared prefix; edits of requests past the measured ones (a distinct edit's
    # blocks stay unread)
    asyncio.run(load(url, model, args.concurrency, args.concurrency, 4, lambda i: xargs(first + args.requests + i), prompt))
    hits, queries = prefix_counters(url)
    cpu = cpu_seconds(pid)
    rate = asyncio.run(load(url, model, args.requests, args.concurrency, args.max_tokens,
                            lambda i: xargs(first + i), prompt))
    cpu2 = cpu_seconds(pid)
    hits2, queries2 = prefix_counters(url)
    return {"tokens_per_s": rate, "prefix_hit_rate": (hits2 - hits) / max(queries2 - queries, 1),
            "server_ms": 1000 * (cpu2[0] - cpu[0]) / args.requests, "engine_ms": 1000 * (cpu2[1] - cpu[1]) / args.requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                        help="cpu: the demo model (or --model); llama3-8b: Llama-3-8B's shape, dummy bf16 weights")
    parser.add_argument("--model", default="demo", help="with --preset cpu: the model served")
    parser.add_argument("--dtype", default="float32", help="with --preset cpu: the dtype served")
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--engine-args", default="{}", help="more vLLM arguments, as JSON (both servers)")
    parser.add_argument("--hooks", nargs="+", default=["blocks.*.hook_resid_post"],
                        help=f"the hooks our server compiles (the vectors steer {HOOK})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of every load, stock and ours in turn (each load's median is compared)")
    parser.add_argument("--no-shared-prefix", dest="shared_prefix", action="store_false",
                        help="no system prompt: each request's prompt is its own line (what steering costs, without "
                             "the prefix-cache hits a distinct edit gives up)")
    args = parser.parse_args()
    prepare_environment()  # both servers inherit it: stock vLLM runs with what ours sets (threads, tokenizers)
    if args.preset == "cpu":
        model = str(resolve_model(args.model))
        engine_args = json.loads(args.engine_args)
    else:
        model, _ = model_dir(args.preset)  # the word-level tokenizer is kept: the server tokenises prompts
        engine_args = {"load_format": "dummy", "gpu_memory_utilization": 0.42, **json.loads(args.engine_args)}
        args.dtype, args.max_num_batched_tokens = PRESETS[args.preset][1:3]
    home = Path(tempfile.mkdtemp(prefix="openai-bench-"))
    width = json.loads((Path(model) / "config.json").read_text())["hidden_size"]
    rng = np.random.default_rng(0)
    named = [rng.normal(size=width).astype(np.float32) for _ in range(4)]
    for k, vector in enumerate(named):
        np.save(home / f"v{k}.npy", vector)
    named_inline = [f"{HOOK}:{encode_vector(vector)}" for vector in named]

    def distinct(i: int) -> str:
        return f"{HOOK}:{encode_vector(np.random.default_rng(1 + i).normal(size=width).astype(np.float32))}"

    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    stock = [sys.executable, "-m", OPENAI_SERVER_MODULE, "--model", model, *common,
             *vllm_flags(engine_args)]
    ours = [sys.executable, "-m", "inspector.cli", "serve", "--openai", "--model", model, *common,
            "--hooks", *args.hooks, "--engine-args", json.dumps(engine_args),
            "--vectors", *(f"v{k}={home / f'v{k}.npy'}@{HOOK}" for k in range(4))]
    results: dict[str, list[dict]] = {}
    loads = [("stock", "stock A", lambda i: None),
             ("ours", "plugin idle", lambda i: None),
             ("ours", "4 named vectors", lambda i: {"inspector_steer": f"v{i % 4}"}),
             ("ours", "4 inline vectors", lambda i: {"inspector_vector": named_inline[i % 4]}),
             ("ours", "inline vectors", lambda i: {"inspector_vector": distinct(i)}),
             ("ours", "plugin idle 2", lambda i: None),
             ("stock", "stock B", lambda i: None)]
    stride = 4 * (args.requests + args.concurrency)  # keeps i % 4, and no distinct vector comes again
    print(f"{args.requests} requests, {args.concurrency} at a time, {args.max_tokens} tokens each; model {model}")
    print(f"logs in {home}")
    servers = {}
    try:
        servers["stock"] = start(stock, {"VLLM_PLUGINS": ""}, home / "stock.log")
        servers["ours"] = start(ours, {}, home / "inspector.log")
        for first, (server, label, xargs) in [(k * stride, load) for k in range(args.rounds) for load in loads]:
            process, url = servers[server]
            r = measure(url, process.pid, model, args, xargs, first)
            results.setdefault(label, []).append(r)
            print(f"{label:>16}: {r['tokens_per_s']:8.1f} tok/s, prefix-cache hits {r['prefix_hit_rate']:.1%}, "
                  f"CPU a request: API server {r['server_ms']:.2f} ms, engine {r['engine_ms']:.2f} ms", flush=True)
    finally:
        for process, _ in servers.values():
            stop(process)
    rate = {label: float(np.median([r["tokens_per_s"] for r in runs])) for label, runs in results.items()}
    stock_rate = (rate["stock A"] + rate["stock B"]) / 2
    idle = (rate["plugin idle"] + rate["plugin idle 2"]) / 2
    print(f"A/A stock B / stock A: {rate['stock B'] / rate['stock A']:.3f}; "
          f"plugin idle 2 / plugin idle: {rate['plugin idle 2'] / rate['plugin idle']:.3f}")
    print(f"plugin idle / stock: {idle / stock_rate:.3f} (target >= 0.98)")
    for label in ("4 named vectors", "4 inline vectors", "inline vectors"):
        print(f"{label} / plugin idle: {rate[label] / idle:.3f} (target >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
