"""Throughput, boot time and memory: vanilla vLLM vs compiled capture vs eager capture.

Each configuration boots once in its own process and stays up; the runs then alternate
(A B C A B C …) so that machine noise hits all three alike. Prints medians and ratios. Each engine's first
run of a size comes before the reps and is printed apart: a hooked engine pins the host memory its rows
land in then, and later runs reuse it.

    packaging/dev bench plugin_bench                     # CPU: a small Llama, float32
    python3 bench/plugin_bench.py --preset llama3-8b     # GPU: Llama-3-8B shape, dummy bf16 weights

Capture = the residual stream after every block ("sharded": also every block's MLP neurons, which
tensor parallelism splits over the ranks); the hooked engines are drained as the engine session does
it (after every step, waiting for copies in flight only when requests finish, or always where ranks
each send a slice of a hook).

    python3 bench/plugin_bench.py --preset llama3-8b --tensor-parallel-size 2 --configs vanilla compiled sharded

"clamps" has room to clamp 4 SAE features at every hook; "generated" captures with the "generated"
capture window (the last prompt position and every generated token; the prompt's other rows never
leave the device); "vanilla-again" is a second vanilla engine, the control that shows how far two
identical engines differ on this machine; "idle" compiles the hooks and keeps no row of any request, as
an OpenAI server serves requests that neither steer nor capture ("idle-one-hook": the same with one hook,
to tell a cost that grows with the hooks from one of the plugin's presence); "vanilla-ieee" is vanilla
vLLM with Triton's float32 dots in IEEE float32, as the inspector boots float32 engines (against
"vanilla", Triton's TF32 default: the cost of that precision, with ``--dtype float32`` on a GPU).

Single-request prefills (``--prefills`` a rep) are taken one configuration after another, and a hooked
engine also prefills each time with capture off for that request: capture on against off in the same
engine and moment is what capturing costs. A batch-1 prefill on the H200 is host-bound (~9 ms), and
its speed moved by up to 1.6x from one minute to the next in one process (docs/gpu-run-2026-12-02g.md),
which engine-to-engine ratios cannot tell apart from the plugin's cost.

Where a configuration's time goes, side by side with the first one's: ``--kernels STEPS`` profiles the
last run's batch (its prefill, then STEPS decode steps) kernel by kernel, ``--profile-prefills N`` single
prefills' host time, the engine core's phases (scheduling, the forward's launch, the wait for the sampled
tokens), launches, host functions, each thread's time on a CPU, waiting for one, blocked and preempted,
and the interpreter's state (trace and profile functions, sys.monitoring, Dynamo's frame callback,
torch function modes, the garbage collector) between steps and inside a forward; ``--trace-dir`` saves
the profiled prefills' timelines with their Python calls. A batch-1 prefill's host time differs from one
boot to the next; ``--boots N`` boots each configuration N times instead, one engine at a time, and
times single prefills in each boot, so that spread shows beside the configurations' difference.
Much of that spread was where the forward sat on CPython's frame stack: ``--depths STEP`` times single
prefills called from frames of every size a stack chunk spans, the worker's steps taken as vLLM takes
them and then in a fresh chunk, as the plugin takes them (``inspector.core.frame_stack``).

    python3 bench/plugin_bench.py --preset llama3-8b --configs vanilla idle --kernels 16 --profile-prefills 8
    python3 bench/plugin_bench.py --preset llama3-8b --configs vanilla idle --boots 3 --prefills 16
    python3 bench/plugin_bench.py --preset llama3-8b --configs vanilla idle --depths 16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inspector.core.interventions import DEFAULT_MAX_SLOTS  # noqa: E402
from inspector.core.labels import runs_text  # noqa: E402

RESIDUAL = ("blocks.*.hook_resid_post",)


class Config(NamedTuple):
    mode: str
    hooks: tuple[str, ...] = ()  # none: vanilla vLLM
    waits: bool = False  # every drain waits for the copies in flight
    plugin: dict = {}  # more boot_llm arguments
    env: dict = {}  # set in the engine's process before it boots
    window: str = "all"  # every request's capture window at every hook (inspector.core.windows)
    capture: bool = True  # False: the hooks run and no row leaves the device (an OpenAI server's plain traffic)


CONFIGS = {"vanilla": Config("compiled"), "vanilla-again": Config("compiled"),
           "compiled": Config("compiled", RESIDUAL), "eager": Config("eager", RESIDUAL),
           "sharded": Config("compiled", (*RESIDUAL, "blocks.*.mlp.hook_post"), True),
           "clamps": Config("compiled", RESIDUAL, plugin={"feature_clamps": 4}),
           "vanilla-ieee": Config("compiled", env={"TRITON_F32_DEFAULT": "ieee"}),
           "generated": Config("compiled", RESIDUAL, window="generated"),
           "idle": Config("compiled", RESIDUAL, capture=False),
           "idle-one-hook": Config("compiled", ("blocks.0.hook_resid_post",), capture=False)}
PRESETS = {
    # name: (model, dtype, max_num_batched_tokens, prompt tokens, runs as (batch, new tokens))
    "cpu": (dict(arch="llama", hidden=512, heads=8, kv_heads=8, layers=8, intermediate=1536, vocab=512),
            "float32", 1024, 128, [(8, 128)]),
    "llama3-8b": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, architectures=["LlamaForCausalLM"],
                       model_type="llama", hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16"),
                  "bfloat16", 8192, 128, [(1, 256), (32, 256)]),
}


def model_dir(preset: str) -> tuple[str, dict]:
    spec = PRESETS[preset][0]
    if preset == "cpu":
        from inspector.testing.tinymodels import tiny_model

        return str(tiny_model(**spec)), {}
    path = Path(tempfile.mkdtemp(prefix="bench-model-"))
    (path / "config.json").write_text(json.dumps(spec))
    word_tokenizer(spec["vocab_size"]).save_pretrained(path)
    return str(path), {"load_format": "dummy", "skip_tokenizer_init": True}


def word_tokenizer(vocab_size: int):
    """A tokenizer with one word per id of the whole vocabulary, so that a dummy-weight model's text
    prompts and its every sampled id have text (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", eos_token="w1")


def _rss_mib() -> float:
    """Resident memory now (steady state after the runs; compile-time peaks are not what users keep)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def serve(name: str, conn, preset: str, path: str, extra: dict, gpu_util: float, cache_root: str,
          boot_only: bool = False) -> None:
    """One configuration, booted once; answers ("run", batch, new_tokens) with measurements."""
    from inspector.engine.environment import prepare_environment

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # idle engines must not spin on the shared cores
    use_caches(cache_root)
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "0"  # as users run it: vLLM's cache on (cold on the first boot)
    config = CONFIGS[name]
    os.environ.update(config.env)
    prepare_environment()
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    from inspector.engine.boot import boot_llm

    plugin_s = time_plugin_hooks() if config.hooks else {}
    _, dtype, max_batched, prompt_len, _ = PRESETS[preset]
    extra = dict(extra)
    dtype = extra.pop("dtype", dtype)
    mode, hooks, waits = config.mode, config.hooks, config.waits
    cuda = torch.cuda.is_available()
    args = dict(dtype=dtype, max_num_batched_tokens=max_batched, max_model_len=1024, **extra)
    if cuda:
        args["gpu_memory_utilization"] = gpu_util
    t0 = time.perf_counter()
    if hooks:
        llm = boot_llm(path, mode=mode, hook_patterns=hooks, **config.plugin, **args)
    else:
        llm = LLM(model=path, enable_prefix_caching=False, enforce_eager=mode == "eager", **args)
    boot_s = time.perf_counter() - t0
    engine = llm.llm_engine
    phase_s: dict[str, float] | None = None  # the engine core's phase timers, installed by the first profile
    cache = engine.vllm_config.cache_config
    from torch._dynamo.utils import counters

    info = {"boot_s": boot_s, "kv_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "compile_s": engine.vllm_config.compilation_config.compilation_time,
            "fx_cache": (counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]),
            "cuda": cuda}
    conn.send(info)
    if boot_only:
        return
    rng = np.random.default_rng(0)
    vocab = engine.vllm_config.model_config.get_vocab_size()
    drain_s = 0.0

    def drain(finishing: bool) -> None:
        """As the engine session does: after every step, waiting only when requests finish."""
        nonlocal drain_s
        if hooks:
            t = time.perf_counter()
            llm.collective_rpc("inspector_drain", kwargs={"wait": finishing or waits})
            drain_s += time.perf_counter() - t

    installed = llm.collective_rpc("inspector_describe")[0]["installed"] if hooks else {}

    def add(rids: list[str], params, capture: bool = config.capture) -> None:
        if not capture:  # the hooks run, no row leaves the device
            llm.collective_rpc("inspector_request_options", kwargs={"forget": [], "options": {
                rid: {"capture": False} for rid in rids}})
        elif config.window != "all":  # as the session sends them: before the requests' first forward
            llm.collective_rpc("inspector_request_options", kwargs={"forget": [], "options": {
                rid: {"windows": dict.fromkeys(installed, config.window), "prompt_tokens": prompt_len} for rid in rids}})
        for rid in rids:
            engine.add_request(rid, {"prompt_token_ids": rng.integers(10, vocab - 10, prompt_len).tolist()}, params)

    serial = itertools.count()

    def single_prefill(capture: bool) -> float:
        """Seconds of one request to its first token (its rows may still be arriving)."""
        t0 = time.perf_counter()
        add([f"single-{next(serial)}"], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            capture=capture)
        while engine.has_unfinished_requests():
            engine.step()
            drain(finishing=False)
        seconds = time.perf_counter() - t0
        drain(finishing=True)
        return seconds

    run_no = 0
    while True:
        msg = conn.recv()
        run_no += 1
        if msg[0] == "prefill":
            conn.send(single_prefill(msg[1]))
            continue
        if msg[0] == "depths":
            conn.send(depth_sweep(*msg[1:], lambda: single_prefill(config.capture), llm, bool(hooks)))
            continue
        if msg[0] == "kernels":
            conn.send(profile_steps(*msg[1:], f"{run_no}", add, engine, drain))
            continue
        if msg[0] == "profile":
            if phase_s is None:  # the runs before took their steps without these wrappers
                phase_s = time_engine_phases(engine)
            conn.send(profile_prefills(*msg[1:3], f"{run_no}", add, engine, drain, plugin_s, phase_s, cuda, *msg[3:]))
            continue
        if msg[0] != "run":
            break
        _, batch, new_tokens = msg
        add([f"{run_no}-{i}" for i in range(batch)],
            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        drain_s = 0.0
        t0 = time.perf_counter()
        first = set()
        while len(first) < batch:  # prefill: until every request has its first token
            for out in engine.step():
                first.add(out.request_id)
            drain(finishing=False)
        t1 = time.perf_counter()
        prefill_drain_s, steps, drain_s = drain_s, 0, 0.0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
            drain(finishing=not engine.has_unfinished_requests())
        t2 = time.perf_counter()
        conn.send({"prefill_tok_s": batch * prompt_len / (t1 - t0), "decode_tok_s": batch * steps / (t2 - t1),
                   "prefill_drain_ms": 1000 * prefill_drain_s,
                   "ms_per_step": 1000 * (t2 - t1) / max(steps, 1),
                   "drain_ms_per_step": 1000 * drain_s / max(steps, 1),
                   "rss_mib": _rss_mib(),
                   "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   "gpu_used_gib": [(t - f) / 2**30 for f, t in map(torch.cuda.mem_get_info,
                                                                    range(torch.cuda.device_count()))] if cuda else None})
    conn.close()


LAUNCHES = {"cudaLaunchKernel": "kernels", "cudaLaunchKernelExC": "kernels", "cuLaunchKernel": "kernels",
            "cuLaunchKernelEx": "kernels", "cudaGraphLaunch": "graphs", "cudaMemcpyAsync": "copies"}


def timed(original, name: str, spent: dict[str, float]):
    """``original`` that adds the seconds each call takes to ``spent[name]``."""
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
    return call


def time_plugin_hooks() -> dict[str, float]:
    """Seconds spent in the plugin's host work around each forward, by method (the engine runs in this
    process: its runtime's class is patched here)."""
    from inspector.plugin.runtime import InspectorRuntime

    spent: dict[str, float] = {}
    for name in ("before_forward", "after_forward", "on_logits"):
        setattr(InspectorRuntime, name, timed(getattr(InspectorRuntime, name), name, spent))
    return spent


ENGINE_PHASES = (("scheduler", "schedule"), ("model_executor", "execute_model"), ("model_executor", "sample_tokens"),
                 ("scheduler", "update_from_output"))


def time_engine_phases(engine) -> dict[str, float]:
    """Seconds spent in the phases of the engine core's steps (it runs in this process): scheduling,
    the forward's launch (inputs prepared, graphs launched), the sampling's launch, the wait for the
    sampled tokens, and reading them into the scheduler. A step's time beyond these is the rest of
    vLLM's host work (the outputs' processing)."""
    core = engine.engine_core.engine_core
    spent: dict[str, float] = {}

    launch = timed(core.model_executor.sample_tokens, "sample_tokens", spent)

    def sampling(*args, **kwargs):
        result = launch(*args, **kwargs)
        if hasattr(result, "result"):  # the future the engine core waits on
            result.result = timed(result.result, "wait for the sampled tokens", spent)
        return result

    for owner, name in ENGINE_PHASES:
        target = getattr(core, owner)
        setattr(target, name, sampling if name == "sample_tokens" else timed(getattr(target, name), name, spent))
    return spent


def depth_sweep(sizes: list[int], reps: int, prefill, llm, hooked: bool) -> dict[str, list[tuple[int, float, int]]]:
    """Single prefills called from a frame that reserves each of ``sizes`` slots of CPython's frame
    stack, the worker's steps taken as vLLM takes them ("plain") and then each in a fresh frame-stack
    chunk, as the plugin takes them (``inspector.core.frame_stack``): where a chunk's end falls within
    a loop of small calls, each call maps and unmaps memory. mode -> [(size, median seconds, median minor
    page faults of this thread)] (the engine runs in this process)."""
    import resource

    from inspector.core import frame_stack
    from inspector.plugin.vllm_compat import WORKER_STEPS

    if not hooked:  # vanilla's steps taken as the plugin takes them
        llm.collective_rpc(frame_stack.run_methods_in_fresh_stack_chunks, args=(WORKER_STEPS,))

    def plain(fn, /, *args, **kwargs):
        return fn(*args, **kwargs)

    def pad(fn):
        return fn()

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    fresh, found = frame_stack.call_in_fresh_stack_chunk, {}
    for mode, call in (("plain", plain), ("fresh chunk", fresh)):
        frame_stack.call_in_fresh_stack_chunk = call  # what the wrapped steps call
        rows = []
        for size in sizes:
            padded = frame_stack.with_reserved_slots(pad, size)
            seconds, faulted = [], []
            for _ in range(reps):
                before = faults()
                seconds.append(padded(prefill))
                faulted.append(faults() - before)
            rows.append((size, statistics.median(seconds), statistics.median(faulted)))
        found[mode] = rows
    frame_stack.call_in_fresh_stack_chunk = fresh
    return found


def print_depth_sweep(sweeps: dict[str, dict], step: int, reps: int) -> None:
    top = max(size for rows in next(iter(sweeps.values())).values() for size, _, _ in rows)
    print(f"\nsingle prefills called from a frame of 0-{top} slots (every {step}; {reps} prefills a size): ms "
          f"a prefill over the sizes, the sizes slower than 1.2x the best, and minor page faults a prefill")
    for name, modes in sweeps.items():
        for mode, rows in modes.items():
            ms = [1000 * seconds for _, seconds, _ in rows]
            slow = [size for (size, _, _), m in zip(rows, ms) if m > 1.2 * min(ms)]
            faults = [f for _, _, f in rows]
            print(f"  {name:13s} {mode:11s} median {statistics.median(ms):6.2f}, best {min(ms):6.2f}, worst "
                  f"{max(ms):6.2f}; {len(slow)} of {len(rows)} sizes slower ({runs_text(slow, step) or 'none'}); "
                  f"faults median {statistics.median(faults):.0f}, most {max(faults):.0f}")


def profiler(cuda: bool, **options):
    """torch's profiler of the host's operators and, on a GPU, the device's kernels."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), **options)


def kernels_of(averages, cuda: bool, steps: int) -> list[tuple[str, float, float]]:
    """(kernel, count a step, microseconds a step) of a profile's averages: on a GPU the device's own
    events only (an operator launched outside a CUDA graph carries its kernels' time too, which would
    count them twice), on a CPU each operator's own time."""
    from torch.autograd import DeviceType

    if cuda:
        found = [(e.key, e.count / steps, e.self_device_time_total / steps) for e in averages
                 if e.device_type == DeviceType.CUDA]
    else:
        found = [(e.key, e.count / steps, e.self_cpu_time_total / steps) for e in averages]
    return [k for k in found if k[2] > 0]


def profile_prefills(count: int, capture: bool, tag: str, add, engine, drain, plugin_s: dict, phase_s: dict,
                     cuda: bool, trace: str | None = None) -> dict:
    """``count`` single-request prefills timed as they run (host time a step, the plugin's share of it, the
    engine core's phases), then ``count`` more under torch's profiler (GPU time a forward, launches a
    step; its timeline saved to ``trace`` when given, Python calls included), and as many under Python's
    (``host_functions``)."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefills(prefix: str) -> tuple[float, int]:
        seconds, steps = 0.0, 0
        for i in range(count):
            add([f"{tag}-{prefix}{i}"], params, capture=capture)
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                seconds, steps = seconds + time.perf_counter() - t, steps + 1
                drain(finishing=False)
            drain(finishing=True)
        return seconds, steps

    gc.collect()  # what this bench left (an earlier profile's results) is not collected on the engine's time
    plugin_s.clear()
    phase_s.clear()
    threads = thread_times()
    with collections_timed() as collected:
        seconds, steps = prefills("t")
    threads = {name: tuple(a - b for a, b in zip(now, threads.get(name, (0,) * 4)))
               for name, now in thread_times().items()}
    out = {"host_ms_per_step": 1000 * seconds / steps, "steps_per_prefill": steps / count,
           "plugin_ms_per_step": {k: 1000 * v / steps for k, v in plugin_s.items()},
           "phase_ms_per_step": {k: 1000 * v / steps for k, v in phase_s.items()},
           "threads_per_step": {k: [v / steps for v in got] for k, got in threads.items() if got[0] > 0},
           "collections_per_step": {g: (n / steps, 1000 * t / steps) for g, (n, t) in collected.items()},
           "interpreter": interpreter_state(), "interpreter in a forward": state_in_forward(lambda: prefills("s"))}
    with profiler(cuda, with_stack=bool(trace)) as prof:  # a timeline shows the Python between operators too
        _, steps = prefills("p")
        if cuda:
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    out["gpu_ms_per_forward"] = sum(us for _, _, us in kernels_of(averages, cuda, count)) / 1000 if cuda else 0.0
    for key, kind in LAUNCHES.items():
        out[kind] = out.get(kind, 0) + sum(e.count for e in averages if e.key == key) / steps
    out["host_functions"] = host_functions(lambda: prefills("c"), count)
    return out


@contextlib.contextmanager
def collections_timed():
    """The garbage collector's runs while the block runs: generation -> [runs, seconds]."""
    found: dict[int, list] = {}
    started: list[float] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            runs = found.setdefault(info["generation"], [0, 0.0])
            runs[0], runs[1] = runs[0] + 1, runs[1] + time.perf_counter() - started.pop()

    gc.callbacks.append(note)
    try:
        yield found
    finally:
        gc.callbacks.remove(note)


def thread_times() -> dict[str, tuple[float, ...]]:
    """Per thread of this process, by "name/id" (Linux): ms on a CPU, ms waiting for one, and its
    voluntary (it blocked) and involuntary (it was preempted) context switches."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu, waiting, _ = f.read().split()
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = dict(line.split(":\t") for line in f.read().splitlines() if "ctxt_switches" in line)
        except (OSError, ValueError):  # the thread ended
            continue
        found[f"{name}/{tid}"] = (int(on_cpu) / 1e6, int(waiting) / 1e6, int(switches["voluntary_ctxt_switches"]),
                                  int(switches["nonvoluntary_ctxt_switches"]))
    return found


def interpreter_state() -> dict[str, str]:
    """What can make every Python line or call of this process slower: trace and profile functions,
    sys.monitoring tools and the events they watch, Dynamo's frame callback, torch function modes,
    the garbage collector's state, Python threads."""
    import threading

    import torch

    state = {"trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
             "dynamo frame callback": repr(torch._C._dynamo.eval_frame.get_eval_frame_callback()),
             "torch function modes": str(torch._C._len_torch_function_stack()),
             "gc": f"enabled {gc.isenabled()}, thresholds {gc.get_threshold()}, counts {gc.get_count()}, "
                   f"tracked {len(gc.get_objects())}, frozen {gc.get_freeze_count()}",
             "python threads": ", ".join(t.name for t in threading.enumerate()),
             "CPUs": f"{len(os.sched_getaffinity(0))} allowed, torch threads {torch.get_num_threads()}, "
                     f"OMP_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}"}
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper

        code = CUDAGraphWrapper.__call__.__code__
        state["sys.monitoring"] = "; ".join(
            f"{i} {monitoring.get_tool(i)}: events {monitoring.get_events(i)}, on CUDAGraphWrapper.__call__ "
            f"{monitoring.get_local_events(i, code)}" for i in range(6) if monitoring.get_tool(i))
    return state


def state_in_forward(work) -> dict[str, str]:
    """``interpreter_state`` as the first CUDA graph of a forward of ``work`` is replayed."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    seen, original = [], CUDAGraphWrapper.__call__

    def call(self, *args, **kwargs):
        if not seen:
            seen.append(interpreter_state())
        return original(self, *args, **kwargs)

    CUDAGraphWrapper.__call__ = call
    try:
        work()
    finally:
        CUDAGraphWrapper.__call__ = original
    return seen[0] if seen else {"state": "no CUDA graph was replayed"}


def host_functions(work, count: int) -> dict[str, tuple[float, float, float]]:
    """Where the host's time goes while ``work`` runs ``count`` prefills, under Python's profiler (which
    slows what it watches alike in every configuration): function -> (calls, ms of its own, ms with what
    it calls), each a prefill."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(work)
    return {f"{Path(file).parent.name}/{Path(file).name}:{line} {name}": (calls / count, own / count * 1000,
                                                                         total / count * 1000)
            for (file, line, name), (_, calls, own, total, _) in pstats.Stats(profiler).stats.items()}


def print_host_functions(profiles: dict[str, dict]) -> None:
    """The functions whose own time a prefill differs most from the first configuration's."""
    first, base = next(iter(profiles.items()))
    for name, got in list(profiles.items())[1:]:
        print(f"  {name} against {first}, under Python's profiler: own ms a prefill (calls) in each, with callees")
        for function, (c0, own0, total0), (c1, own1, total1) in most_changed(base["host_functions"],
                                                                            got["host_functions"], 1, 20):
            print(f"    {own1 - own0:+7.3f}  {own0:7.3f} ({c0:6.1f}) {own1:7.3f} ({c1:6.1f})  "
                  f"[{total0:7.2f} {total1:7.2f}]  {function[:100]}")


def most_changed(before: dict[str, tuple], after: dict[str, tuple], index: int, top: int) -> list[tuple]:
    """(key, its figures before, after) of the ``top`` keys whose figure at ``index`` changed most; a key
    on one side only has zeros on the other."""
    width = len(next(iter({**before, **after}.values()), ()))

    def of(side: dict, key: str) -> tuple:
        return side.get(key, (0,) * width)

    keys = sorted(before.keys() | after.keys(), key=lambda k: -abs(of(after, k)[index] - of(before, k)[index]))
    return [(k, of(before, k), of(after, k)) for k in keys[:top]]


def profile_steps(batch: int, steps: int, tag: str, add, engine, drain) -> dict:
    """``batch`` requests under torch's profiler: their prefill (the steps to every request's first token),
    then ``steps`` decode steps. For each: the device's time a step, and each kernel's count and time a
    step (kernels a CUDA graph replays included; on a CPU, each operator's own time)."""
    import torch
    from vllm import SamplingParams

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def profiled(step) -> dict:
        """``step()`` takes a step and says whether it was the last to profile."""
        sync()
        t, count, last = time.perf_counter(), 0, False
        with profiler(cuda) as prof:
            while not last:
                last, count = step(), count + 1
                drain(finishing=False)
            sync()
        wall = time.perf_counter() - t
        kernels = kernels_of(prof.key_averages(), cuda, count)
        return {"wall_ms": 1000 * wall / count, "device_ms": sum(k[2] for k in kernels) / 1000,
                "kernels": sum(k[1] for k in kernels), "top": sorted(kernels, key=lambda k: -k[2])}

    add([f"{tag}-k{i}" for i in range(batch)], SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
    first: set[str] = set()

    def prefilled() -> bool:
        first.update(out.request_id for out in engine.step())
        return len(first) == batch

    left = iter(range(steps - 1, -1, -1))  # decode steps to take after this one

    def decoded() -> bool:
        engine.step()
        return next(left) == 0

    found = {"prefill": profiled(prefilled)}
    for _ in range(2):
        engine.step()
    found["decode"] = profiled(decoded)
    while engine.has_unfinished_requests():
        engine.step()
        drain(finishing=not engine.has_unfinished_requests())
    return found


def use_caches(root: str) -> None:
    """Compiler caches under ``root``: a fresh one per configuration, so that no boot profits from
    another's compiled kernels."""
    for var, sub in (("VLLM_CACHE_ROOT", "vllm"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"),
                     ("TRITON_CACHE_DIR", "triton")):
        os.environ[var] = str(Path(root) / sub)


def receive(conn, proc):
    """The worker's next answer; a worker that died (boot error, OOM) ends the benchmark clearly."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(f"benchmark worker exited with code {proc.exitcode}; its error is above")
    return conn.recv()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.28,
                        help="per engine; the three engines share one GPU")
    parser.add_argument("--configs", nargs="+", default=["vanilla", "compiled", "eager"], choices=list(CONFIGS))
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="instead of the preset's")
    parser.add_argument("--no-warm-boots", action="store_true", help="boot each configuration once (cold caches)")
    parser.add_argument("--prefills", type=int, default=16,
                        help="single-request prefills a rep for each configuration, taken in turn with the others")
    parser.add_argument("--profile-prefills", type=int, default=0,
                        help="after the reps: this many single-request prefills timed, and as many under torch's "
                             "profiler, per configuration (capture on and off for the hooked ones)")
    parser.add_argument("--boots", type=int, default=0, metavar="N",
                        help="instead of the runs: boot each configuration N times, one engine at a time and the "
                             "configurations in turn, and time --prefills single prefills in each boot (capture as "
                             "the configuration has it): how far boots of one configuration differ, against how "
                             "far the configurations do")
    parser.add_argument("--depths", type=int, default=0, metavar="STEP",
                        help="after the reps: single prefills called from a frame of 0 to 2,304 slots of CPython's "
                             "frame stack, every STEP, with the worker's steps taken plainly and then in a fresh "
                             "frame-stack chunk (as the plugin takes them), 3 a size, per configuration")
    parser.add_argument("--trace-dir", help="with --profile-prefills: save each configuration's profiled prefills "
                                            "there as a timeline with its Python calls (Chrome trace JSON)")
    parser.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                        help="after the reps, the last run's batch under torch's profiler per configuration, its "
                             "prefill and then STEPS decode steps: device time and kernels a step (operators on a "
                             "CPU), and those that differ")
    args = parser.parse_args()

    path, extra = model_dir(args.preset)
    if args.tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = args.tensor_parallel_size
    if args.dtype:
        extra["dtype"] = args.dtype
    spec, dtype, max_batched, prompt_len, runs = PRESETS[args.preset]
    dtype = args.dtype or dtype
    ctx = mp.get_context("spawn")
    workers, boot = {}, {}
    roots = {name: tempfile.mkdtemp(prefix=f"bench-cache-{name}-") for name in args.configs}

    def start(name: str, cache_root: str, boot_only: bool = False):
        warm = any(Path(cache_root).iterdir())  # an earlier boot of this configuration filled it
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=serve, args=(name, child, args.preset, path, extra, args.gpu_memory_utilization,
                                               cache_root, boot_only), daemon=True)
        proc.start()
        info = receive(parent, proc)
        hits, misses = info["fx_cache"]
        label = f"{name} again" if boot_only else name
        print(f"booted {label:15s} in {info['boot_s']:6.1f} s (torch.compile {info['compile_s']:.1f} s, Inductor "
              f"graph cache {hits} hits / {misses} misses; {'warm' if warm else 'cold'} caches)", flush=True)
        return proc, parent, info

    if args.boots:
        boot_spread(args.configs, args.boots, args.prefills, start, roots, prompt_len)
        return

    for name in args.configs:  # boot one at a time: boots compete for the same cores
        proc, conn, boot[name] = start(name, roots[name])
        workers[name] = (proc, conn)
        if CONFIGS[name][0] == "compiled" and not args.no_warm_boots:  # from the second boot on: warm caches
            warm_proc, _, boot[f"{name} again"] = start(name, roots[name], boot_only=True)
            warm_proc.join(timeout=120)

    results = {(name, run): [] for name in args.configs for run in runs}
    firsts = {}  # an engine's first run of a size pins the host memory its rows land in: timed apart
    for run in runs:
        for name, (proc, conn) in workers.items():
            conn.send(("run", *run))
            firsts[(name, run)] = receive(conn, proc)
    singles = {name: [] for name in args.configs}  # seconds of each single-request prefill, in turn
    uncaptured = {name: [] for name in args.configs}  # the same in a hooked engine, capture off for the request
    for rep in range(args.reps):
        for run in runs:
            for name, (proc, conn) in workers.items():
                conn.send(("run", *run))
                results[(name, run)].append(receive(conn, proc))
        names = list(workers)
        for k in range(args.prefills):  # one single-request prefill per configuration in turn, the order rotating
            for name in names[k % len(names):] + names[:k % len(names)]:
                proc, conn = workers[name]
                # a hooked engine also prefills with capture off for the request, right before or after
                for capture in ((True, False) if k % 2 else (False, True)) if CONFIGS[name].hooks else (True,):
                    conn.send(("prefill", capture))
                    (singles if capture else uncaptured)[name].append(receive(conn, proc))
        print(f"rep {rep + 1}/{args.reps} done", flush=True)
    sweeps = {}
    for name, (proc, conn) in workers.items() if args.depths else ():
        conn.send(("depths", list(range(0, 2305, args.depths)), 3))
        sweeps[name] = receive(conn, proc)
    profiles = {}
    for name, (proc, conn) in workers.items() if args.profile_prefills else ():
        for capture in (True, False) if CONFIGS[name].hooks else (True,):
            trace = (os.path.join(args.trace_dir, f"{name}{'' if capture else '-capture-off'}.json")
                     if args.trace_dir else None)
            conn.send(("profile", args.profile_prefills, capture, trace))
            profiles[name if capture else f"{name}, capture off"] = receive(conn, proc)
    kernels = {}
    for name, (proc, conn) in workers.items() if args.kernels else ():
        conn.send(("kernels", runs[-1][0], args.kernels))
        kernels[name] = receive(conn, proc)
    for proc, conn in workers.values():
        conn.send(("stop",))
        proc.join(timeout=120)
    if profiles:
        print(f"\nsingle-request prefills of {prompt_len} tokens, {args.profile_prefills} timed and "
              f"{args.profile_prefills} under torch's profiler, per configuration:")
        for name, got in profiles.items():
            plugin = ", ".join(f"{k} {v:.3f}" for k, v in got["plugin_ms_per_step"].items())
            print(f"  {name:22s} {got['steps_per_prefill']:.1f} steps a prefill, host {got['host_ms_per_step']:.2f} ms "
                  f"a step ({plugin or 'no plugin'}); GPU "
                  f"{got['gpu_ms_per_forward']:.2f} ms a forward; a step launches {got.get('kernels', 0):.0f} kernels, "
                  f"{got.get('graphs', 0):.1f} graphs, {got.get('copies', 0):.0f} copies")
            print("    engine core, ms a step: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in got["phase_ms_per_step"].items()))
            busiest = sorted(got["threads_per_step"].items(), key=lambda t: -t[1][0])[:4]
            print("    busiest threads, a step: " + "; ".join(
                f"{k} on a CPU {cpu:.2f} ms, waiting {wait:.2f} ms, blocked {blocked:.1f}x, preempted {preempted:.1f}x"
                for k, (cpu, wait, blocked, preempted) in busiest))
            print("    garbage collections, a step: " + (", ".join(
                f"generation {g} {n:.2f}x {ms:.3f} ms" for g, (n, ms) in sorted(got["collections_per_step"].items()))
                or "none"))
            for where in ("interpreter", "interpreter in a forward"):
                print(f"    {where}: " + "; ".join(f"{k}: {v}" for k, v in got[where].items()))
        print_host_functions(profiles)

    if sweeps:
        print_depth_sweep(sweeps, args.depths, 3)
    if kernels:
        for phase in ("prefill", "decode"):
            print_kernels(phase, {name: found[phase] for name, found in kernels.items()}, runs[-1][0])

    def med(name, run, key):
        return statistics.median(r[key] for r in results[(name, run)])

    print(f"\npreset {args.preset}: {dtype}, tensor parallel size {args.tensor_parallel_size}, prompts of "
          f"{prompt_len} tokens, greedy, ignore_eos, max_num_batched_tokens {max_batched}; capture = resid_post of "
          f"every block (sharded: and mlp.hook_post); {args.reps} alternated reps")
    print(f"{'config':13s} {'boot s':>7s} " + " ".join(
        f"{f'{b}x{n} prefill tok/s':>22s} {f'{b}x{n} decode tok/s':>21s} {'ms/step':>8s} {'drain':>6s}"
        for b, n in runs))
    for name in args.configs:
        cells = " ".join(f"{med(name, run, 'prefill_tok_s'):22.1f} {med(name, run, 'decode_tok_s'):21.1f} "
                         f"{med(name, run, 'ms_per_step'):8.2f} {med(name, run, 'drain_ms_per_step'):6.2f}"
                         for run in runs)
        print(f"{name:13s} {boot[name]['boot_s']:7.1f} {cells}")
    for name in args.configs:
        print(f"{name} per rep: " + "; ".join(
            f"{b}x{n} prefill tok/s " + " ".join(f"{r['prefill_tok_s']:.0f}" for r in results[(name, (b, n))])
            + " (its drains, ms: " + " ".join(f"{r['prefill_drain_ms']:.1f}" for r in results[(name, (b, n))]) + ")"
            for b, n in runs))
    print("first run of each size, before the reps (not in the medians): " + "; ".join(
        f"{name} " + " ".join(f"{b}x{n} prefill {firsts[(name, (b, n))]['prefill_tok_s']:.0f} tok/s" for b, n in runs)
        for name in args.configs))
    for name in args.configs:
        per_rep = [statistics.median(singles[name][r * args.prefills:(r + 1) * args.prefills]) for r in range(args.reps)]
        print(f"{name}: {args.prefills} single-request prefills a rep, taken in turn with the other configurations; "
              f"prefill tok/s (median a rep) " + " ".join(f"{prompt_len / s:.0f}" for s in per_rep))
    if "vanilla" in args.configs:
        print()
        for name in args.configs[1:]:
            off = f", with capture off {single_ratio(uncaptured[name], singles['vanilla'])}" if uncaptured[name] else ""
            print(f"{name}/vanilla: " + ", ".join(
                f"{b}x{n} prefill {med(name, (b, n), 'prefill_tok_s') / med('vanilla', (b, n), 'prefill_tok_s'):.3f} "
                f"decode {med(name, (b, n), 'decode_tok_s') / med('vanilla', (b, n), 'decode_tok_s'):.3f}"
                for b, n in runs) + f"; single-request prefills {single_ratio(singles[name], singles['vanilla'])}{off}")
        if boot["vanilla"]["cuda"]:
            print("GPU memory in use per device (all engines of this benchmark together): " + ", ".join(
                f"{g:.1f}" for g in med_list(results[(args.configs[-1], runs[-1])], "gpu_used_gib")) + " GiB")
    for name in (n for n in args.configs if uncaptured[n]):  # what capturing costs, without engine-to-engine noise
        print(f"{name}, capture on / off for the request in the same engine: single-request prefills "
              f"{single_ratio(singles[name], uncaptured[name])}")
    if {"vanilla", "compiled", "eager"} <= set(args.configs) and not args.no_warm_boots:
        print()
        for run in runs:
            v, c, e = (med(n, run, "decode_tok_s") for n in ("vanilla", "compiled", "eager"))
            print(f"{run[0]}x{run[1]} decode: compiled/vanilla {c / v:.3f}, compiled/eager {c / e:.2f}")
        print(f"boot: compiled/vanilla {boot['compiled']['boot_s'] / boot['vanilla']['boot_s']:.2f} with cold caches, "
              f"{boot['compiled again']['boot_s'] / boot['vanilla again']['boot_s']:.2f} with warm ones")
        layers, width, _, _ = dims(spec)
        itemsize = 4 if dtype == "float32" else 2
        buffers = layers * max_batched * width * itemsize / 2**20 * (2 if boot["vanilla"]["cuda"] else 1)  # + arenas
        tables = layers * 2 * DEFAULT_MAX_SLOTS * width * itemsize / 2**20
        print(f"capture buffers (and on a GPU their staging arenas) {buffers:.1f} MiB + intervention tables {tables:.1f} MiB")
        last = runs[-1]
        if boot["vanilla"]["cuda"]:
            # Every engine gets the same memory budget and vLLM gives what is left to the KV cache, so
            # compare what is not KV cache: the peak allocation minus the KV cache's blocks.
            block = kv_block_bytes(spec, itemsize, boot["vanilla"]["block_size"])
            used = {n: med(n, last, "gpu_peak_gib") * 2**30 - boot[n]["kv_blocks"] * block for n in args.configs}
            print("GPU peak allocated while running, less the KV cache: " + ", ".join(
                f"{n} {b / 2**30:.2f} GiB" for n, b in used.items()))
            extra_mib = (used["compiled"] - used["vanilla"]) / 2**20
            base_mib = used["vanilla"] / 2**20
        else:
            rss = {n: med(n, last, "rss_mib") for n in args.configs}
            print("resident memory after the runs: " + ", ".join(f"{n} {m:.0f} MiB" for n, m in rss.items()))
            extra_mib, base_mib = rss["compiled"] - rss["vanilla"], rss["vanilla"]
        over = extra_mib - buffers - tables
        print(f"compiled above vanilla: {extra_mib:.1f} MiB = buffers and tables + {over:.1f} MiB "
              f"({over / (buffers + tables):.1%} of buffers and tables, {over / base_mib:.1%} of vanilla)")


def boot_spread(configs: list[str], boots: int, prefills: int, start, roots: dict, prompt_len: int) -> None:
    """Each configuration booted ``boots`` times, one engine at a time and the configurations in turn:
    the median of ``prefills`` single prefills in each boot (after two not counted: a boot's first
    drains are slower), so that the spread between boots of one configuration shows beside the
    difference between configurations."""
    medians: dict[str, list[float]] = {name: [] for name in configs}
    for boot in range(boots):
        for name in configs:
            proc, conn, _ = start(name, roots[name])
            seconds = []
            for k in range(2 + prefills):
                conn.send(("prefill", CONFIGS[name].capture))
                seconds.append(receive(conn, proc))
            conn.send(("stop",))
            proc.join(timeout=120)
            medians[name].append(statistics.median(seconds[2:]))
            print(f"boot {boot + 1}/{boots} {name}: single prefills {prompt_len / medians[name][-1]:,.0f} tok/s "
                  f"(median of {prefills})", flush=True)
    first = configs[0]
    print(f"\nsingle prefills of {prompt_len} tokens, tok/s by boot (median of {prefills} each):")
    for name in configs:
        rates = [prompt_len / s for s in medians[name]]
        print(f"  {name:15s} " + " ".join(f"{r:8,.0f}" for r in rates) + f"   spread {max(rates) / min(rates):.2f}x"
              + ("" if name == first else f"; median against {first} "
                 f"{statistics.median(medians[first]) / statistics.median(medians[name]):.3f}"))


def print_kernels(phase: str, kernels: dict[str, dict], batch: int) -> None:
    """Each configuration's steps of one phase on the device, and the kernels whose time a step differs
    from the first configuration's by more than a microsecond (new ones, gone ones, slower or faster ones)."""
    print(f"\n{phase} steps of {batch} requests under torch's profiler, per configuration:")
    for name, got in kernels.items():
        print(f"  {name:15s} wall {got['wall_ms']:.2f} ms a step; device {got['device_ms']:.2f} ms in "
              f"{got['kernels']:.0f} kernels a step")
    first, base = next(iter(kernels.items()))
    before = {key: (count, us) for key, count, us in base["top"]}
    for name, got in list(kernels.items())[1:]:
        after = {key: (count, us) for key, count, us in got["top"]}
        print(f"  {name} against {first}: kernel, count and us a step in each")
        for key, (count0, us0), (count1, us1) in most_changed(before, after, 1, 25):
            if abs(us1 - us0) >= 1:
                print(f"    {us1 - us0:+8.1f} us  {count0:5.1f} {us0:8.1f}  {count1:5.1f} {us1:8.1f}  {key[:110]}")


def single_ratio(times: list[float], baseline: list[float]) -> str:
    """Prefill speed against a baseline's: the ratio of all medians, and the median and quartiles of the
    ratios of prefills taken next to each other (the k-th of each; machine noise that lasts longer than
    a few prefills hits both alike)."""
    pairs = sorted(v / t for t, v in zip(times, baseline))
    q = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
    return (f"{statistics.median(baseline) / statistics.median(times):.3f} (side by side: median "
            f"{statistics.median(pairs):.3f}, quartiles {q[0]:.3f}-{q[2]:.3f}, {len(pairs)} pairs)")


def med_list(answers: list[dict], key: str) -> list[float]:
    return [statistics.median(column) for column in zip(*(a[key] for a in answers))]


def dims(spec: dict) -> tuple[int, int, int, int]:
    """(layers, hidden, heads, KV heads) of a preset's model, named the tinymodels way or the HF way."""
    if "hidden_size" in spec:
        heads = spec["num_attention_heads"]
        return spec["num_hidden_layers"], spec["hidden_size"], heads, spec.get("num_key_value_heads", heads)
    return spec["layers"], spec["hidden"], spec["heads"], spec.get("kv_heads", spec["heads"])


def kv_block_bytes(spec: dict, itemsize: int, block_size: int) -> int:
    layers, hidden, heads, kv_heads = dims(spec)
    return 2 * layers * kv_heads * (hidden // heads) * block_size * itemsize


if __name__ == "__main__":
    main()
