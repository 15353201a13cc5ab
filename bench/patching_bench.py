"""Activation-patching sweeps: every cell a request of one batched engine call, against the same cells
as one request at a time on the same engine, a transformers loop (a forward hook per cell), and on a
GPU vanilla vLLM's prefill of the same prompts (the physical limit of one batched pass).

    packaging/dev bench patching_bench                     # CPU: 8 layers x 16 positions of resid_pre
    python3 bench/patching_bench.py --preset llama3-8b     # GPU: 32 layers x 32 positions, 64-token prompt

Each engine boots once in its own process; the runs alternate between them (noise hits all alike).
The sequential and transformers loops run a sample of the cells and are scaled to the whole grid.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plugin_bench import PRESETS, model_dir, receive, use_caches  # noqa: E402

GRIDS = {"cpu": (16, 16), "llama3-8b": (64, 32)}  # (prompt tokens, positions patched), every layer
CANDIDATES = [("def f(a, b):\n    return a + b\n\nprint(f(1, 2))\n", "def g(a, b):\n    return a + b\n\nprint(g(1, 2))\n"),
              ("import os\nimport sys\n\nx = os.path.join(a, b)\n", "import re\nimport sys\n\nx = re.path.join(a, b)\n")]


def prompts(preset: str, tokenize) -> tuple[str, str]:
    """A clean/corrupted pair as many tokens long, at least the grid's positions."""
    length, positions = GRIDS[preset]
    if preset != "cpu":  # the word tokenizer: one token per word
        words = [f"w{i + 20}" for i in range(length)]  # w10…w19 split in two under the saved word tokenizer
        return " ".join(words), " ".join(words[:5] + ["w999"] + words[6:])
    for clean, corrupted in CANDIDATES:
        if len(tokenize(clean)) == len(tokenize(corrupted)) >= positions:
            return clean, corrupted
    raise SystemExit("no candidate prompt pair of equal length for this tokenizer")


def spec_for(preset: str, session):
    from inspector.experiments.patching import Metric, PatchSpec

    clean, corrupted = prompts(preset, session.tokenize)
    hooks = tuple(p.name for p in sorted(session.installed.values(), key=lambda p: p.layer))
    return PatchSpec(clean, corrupted, hooks, Metric(10, 20), positions=tuple(range(GRIDS[preset][1])))


def engine_setup(preset: str, extra: dict, gpu_util: float, cache_root: str) -> tuple[dict, str, int]:
    """A worker's environment for an engine: (engine arguments, dtype, max_num_batched_tokens)."""
    from inspector.engine.environment import prepare_environment

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # idle engines must not spin on the shared cores
    use_caches(cache_root)
    prepare_environment()
    import torch

    _, dtype, max_batched, _, _ = PRESETS[preset]
    return dict(extra, **({"gpu_memory_utilization": gpu_util} if torch.cuda.is_available() else {})), dtype, max_batched


def ours(conn, preset: str, path: str, extra: dict, gpu_util: float, cache_root: str) -> None:
    """The inspector's engine: ("sweep",) runs the whole grid batched, ("sequential", n) the first n
    cells one request at a time."""
    engine_args, dtype, max_batched = engine_setup(preset, extra, gpu_util, cache_root)
    from inspector.core.protocol import Sampling, SessionOptions
    from inspector.engine.session import Session
    from inspector.experiments.patching import patch

    t0 = time.perf_counter()
    session = Session.open(SessionOptions(model=path, hooks=("blocks.*.hook_resid_pre",), dtype=dtype,
                                          max_num_batched_tokens=max_batched, max_model_len=1024,
                                          engine_args=engine_args))
    spec = spec_for(preset, session)
    conn.send({"boot_s": time.perf_counter() - t0, "cells": len(spec.hooks) * len(spec.positions),
               "prompt_tokens": len(session.tokenize(spec.clean)), "hooks": len(spec.hooks)})
    while True:
        msg = conn.recv()
        if msg[0] == "sweep":
            marks = {}

            def progress(result, message, marks=marks):
                marks.setdefault("cells" if message.startswith("engine call") else "baselines", time.perf_counter())

            t0 = time.perf_counter()
            result = patch(session, spec, progress)
            t1 = time.perf_counter()
            conn.send({"sweep_s": t1 - t0, "cells_s": t1 - marks["cells"], "calls": result.engine_calls,
                       "baselines_s": marks["baselines"] - t0, "setup_s": marks["cells"] - marks["baselines"],
                       "complete": result.complete})
        elif msg[0] == "sequential":
            result = patch(session, spec)  # the vectors to patch in (timed above)
            cells = [(row, column) for column in range(len(spec.positions)) for row in range(len(spec.hooks))][:msg[1]]
            sampling = Sampling(max_tokens=1, logprobs=0, capture=False, score_token_ids=spec.metric.token_ids)
            last, differences = len(result.token_ids["clean"]) - 1, []
            t0 = time.perf_counter()
            for row, column in cells:
                rid = session.upcoming_request_ids(1)[0]
                session.set_interventions([replace(result.cell_intervention(row, column), request_id=rid)])
                for event in session.generate([spec.corrupted], sampling):
                    for step in event.requests:
                        if step.scores is not None and last in step.scores[0]:
                            metric = spec.metric.of(step.scores[1][list(step.scores[0]).index(last)])
                            differences.append(abs(metric - result.raw[row, column]))
            per_cell = (time.perf_counter() - t0) / len(cells)
            session.set_interventions([])
            conn.send({"per_cell_s": per_cell, "max_difference": max(differences)})
        else:
            break
    session.close()


def vanilla(conn, preset: str, path: str, extra: dict, gpu_util: float, cache_root: str) -> None:
    """vLLM alone: ("prefill", prompt, n) generates one token for n copies of the prompt."""
    args, dtype, max_batched = engine_setup(preset, extra, gpu_util, cache_root)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, dtype=dtype, max_num_batched_tokens=max_batched, max_model_len=1024,
              enable_prefix_caching=False, **args)
    conn.send({"boot_s": time.perf_counter() - t0})
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=None)
    while True:
        msg = conn.recv()
        if msg[0] != "prefill":
            break
        t0 = time.perf_counter()
        llm.generate([msg[1]] * msg[2], params, use_tqdm=False)
        conn.send({"prefill_s": time.perf_counter() - t0})


def transformers_loop(conn, preset: str, path: str) -> None:
    """("loop", clean, corrupted, n): the first n cells, each a forward of the corrupted prompt with a
    forward pre-hook putting the clean resid_pre row in place, and the metric's logprobs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cuda = torch.cuda.is_available()
    dtype = getattr(torch, PRESETS[preset][1])
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    if cuda:  # dummy weights, as the engines have
        with device:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), torch_dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    blocks = model.model.layers
    conn.send({"boot_s": time.perf_counter() - t0})
    while True:
        msg = conn.recv()
        if msg[0] != "loop":
            break
        _, clean, corrupted, positions, n = msg
        clean_ids = torch.tensor([tokenizer(clean, add_special_tokens=False).input_ids], device=device)
        ids = torch.tensor([tokenizer(corrupted, add_special_tokens=False).input_ids], device=device)
        with torch.no_grad():
            source = model(clean_ids, output_hidden_states=True).hidden_states  # [layer] = resid_pre of layer
            cells = [(layer, p) for p in positions for layer in range(len(blocks))][:n]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for layer, p in cells:
                def put(module, args, kwargs, layer=layer, p=p):
                    x = (args[0] if args else kwargs["hidden_states"]).clone()
                    x[0, p] = source[layer][0, p]
                    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

                handle = blocks[layer].register_forward_pre_hook(put, with_kwargs=True)
                logits = model(ids).logits[0, -1].float()
                torch.log_softmax(logits, -1)[[10, 20]].tolist()  # the metric, as the sweep reads it
                handle.remove()
            conn.send({"per_cell_s": (time.perf_counter() - t0) / len(cells)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sample", type=int, default=None, help="cells the loops run (default: all on CPU, 64 on GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.38, help="per engine (two share the GPU)")
    args = parser.parse_args()
    path, extra = model_dir(args.preset)
    extra.pop("skip_tokenizer_init", None)  # sessions tokenize prompts (the word tokenizer is in the model's folder)
    ctx = mp.get_context("spawn")
    gpu = args.preset != "cpu"

    def start(target, *more):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, args.preset, path, *more), daemon=True)
        proc.start()
        return proc, parent, receive(parent, proc)

    root = tempfile.mkdtemp(prefix="bench-cache-")
    workers = {"ours": start(ours, extra, args.gpu_memory_utilization, root + "/ours")}
    info = workers["ours"][2]
    if gpu:
        workers["vanilla"] = start(vanilla, extra, args.gpu_memory_utilization, root + "/vanilla")
    workers["transformers"] = start(transformers_loop)
    for name, (_, _, boot) in workers.items():
        print(f"booted {name} in {boot['boot_s']:.1f} s", flush=True)
    cells, tokens = info["cells"], info["prompt_tokens"]
    sample = min(args.sample or (64 if gpu else cells), cells)
    positions = list(range(GRIDS[args.preset][1]))
    # the prompts, as the engine process chose them (the same function, the same tokenizer)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    clean, corrupted = prompts(args.preset, lambda text: tokenizer(text, add_special_tokens=False).input_ids)

    def ask(name, *msg):
        proc, conn, _ = workers[name]
        conn.send(msg)
        return receive(conn, proc)

    runs = {key: [] for key in ("sweep", "sequential", "transformers", "vanilla")}
    for rep in range(args.reps):
        runs["sweep"].append(ask("ours", "sweep"))
        runs["sequential"].append(ask("ours", "sequential", sample))
        runs["transformers"].append(ask("transformers", "loop", clean, corrupted, positions, sample))
        if gpu:
            runs["vanilla"].append(ask("vanilla", "prefill", corrupted, cells))
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    for name in workers:
        ask_stop = workers[name]
        ask_stop[1].send(("stop",))
        ask_stop[0].join(timeout=120)

    def med(key, field):
        return statistics.median(r[field] for r in runs[key])

    sweep_s, cells_s = med("sweep", "sweep_s"), med("sweep", "cells_s")
    sequential_s = med("sequential", "per_cell_s") * cells
    hf_s = med("transformers", "per_cell_s") * cells
    print(f"\npreset {args.preset}: {info['hooks']} layers x {len(positions)} positions of resid_pre = {cells} cells on a "
          f"{tokens}-token prompt ({cells * tokens} prompt tokens), {PRESETS[args.preset][1]}, "
          f"max_num_batched_tokens {PRESETS[args.preset][2]}; medians of {args.reps} alternated reps; loops ran "
          f"{sample} cells, scaled to {cells}")
    print(f"batched sweep: {sweep_s:.3f} s in all ({runs['sweep'][-1]['calls']} engine call(s)): baselines "
          f"{med('sweep', 'baselines_s'):.3f} s, the cells' interventions set {med('sweep', 'setup_s'):.3f} s, cells "
          f"{cells_s:.3f} s = {cells * tokens / cells_s:,.0f} prompt tok/s")
    print(f"sequential on the same engine: {sequential_s:.3f} s -> batched is {sequential_s / sweep_s:.1f}x faster; "
          f"the same cells' metrics differ by at most {max(r['max_difference'] for r in runs['sequential']):.2g}")
    print(f"transformers loop: {hf_s:.3f} s -> batched is {hf_s / sweep_s:.1f}x faster")
    if gpu:
        vanilla_s = med("vanilla", "prefill_s")
        print(f"vanilla vLLM prefill of the same {cells} prompts: {vanilla_s:.3f} s = {cells * tokens / vanilla_s:,.0f} "
              f"tok/s -> sweep cells / vanilla = {vanilla_s / cells_s:.3f} (whole sweep {vanilla_s / sweep_s:.3f})")


if __name__ == "__main__":
    main()
