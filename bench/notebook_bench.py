"""The notebook API against TransformerLens and vanilla vLLM, on one model, in one process, one after another.

    packaging/dev bench notebook_bench                       # CPU: the demo model, float32
    python3 bench/notebook_bench.py --preset llama3-8b       # GPU: Llama-3-8B shape, dummy bf16 weights

Three engines on the same model shape and tokens: TransformerLens's ``HookedTransformer`` (CPU: the demo
model's weights through its own converter, unprocessed; GPU: random weights of the shape, made on the
GPU), ``Inspector`` (the compiled engine, every block's residual stream cached, the cache's tensors on
the benchmark's device) and vanilla vLLM (no hooks). Each measures ``--reps`` times, median kept:
  - prefill: ``run_with_cache`` of ``--batch`` contexts of ``--tokens`` tokens (vLLM: a prefill-only
    ``generate``, one token each);
  - generation: ``--new-tokens`` greedy tokens from ``--batch`` short prompts, every resid_post cached
    (TransformerLens: ``generate`` under hooks that keep them; vLLM: plain ``generate``).
Printed: tokens/s of each, and the ratios the issue targets (Inspector / vanilla >= 0.8, Inspector /
TransformerLens ahead for prefill, >= 3x for generation on the H200).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from attention_bench import timed as median_ms  # noqa: E402
from inspector.core.models import resolve_model  # noqa: E402
from inspector.engine.environment import prepare_environment  # noqa: E402

RESID = "*hook_resid_post"


class Setup(NamedTuple):
    model_dir: Path
    dtype: str
    device: str  # where the tensors of every engine's results live
    engine_args: dict  # both vLLM engines'
    transformerlens: Callable[[], torch.nn.Module]


def setup(preset: str, model: str) -> Setup:
    if preset == "cpu":
        from tl_reference import hooked_transformer

        path = resolve_model(model)
        return Setup(path, "float32", "cpu", {"max_num_batched_tokens": 512}, lambda: hooked_transformer(path, "llama"))
    from plugin_bench import PRESETS, word_tokenizer
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    spec = PRESETS[preset][0]
    path = Path(tempfile.mkdtemp(prefix="notebook-bench-model-"))
    (path / "config.json").write_text(json.dumps(spec))
    word_tokenizer(spec["vocab_size"]).save_pretrained(path)
    head = spec["hidden_size"] // spec["num_attention_heads"]
    cfg = HookedTransformerConfig(
        d_model=spec["hidden_size"], n_layers=spec["num_hidden_layers"], n_heads=spec["num_attention_heads"],
        d_head=head, d_mlp=spec["intermediate_size"], n_ctx=2048, act_fn="silu", normalization_type="RMS",
        positional_embedding_type="rotary", rotary_dim=head, rotary_base=spec["rope_theta"], gated_mlp=True,
        final_rms=True, eps=spec["rms_norm_eps"], n_key_value_heads=spec["num_key_value_heads"],
        d_vocab=spec["vocab_size"], default_prepend_bos=False, original_architecture="LlamaForCausalLM",
        dtype=torch.bfloat16, device="cuda")

    def transformerlens():
        with torch.device("cuda"):  # made where it runs: no 8B model in host memory first
            return HookedTransformer(cfg).eval()

    return Setup(path, "bfloat16", "cuda", {"load_format": "dummy", "gpu_memory_utilization": 0.35,
                                            "max_num_batched_tokens": 8192}, transformerlens)


def timed(function, reps: int) -> float:
    """Median seconds of ``reps`` calls, after one warm-up call."""
    return median_ms(function, reps) / 1000


def transformerlens(s: Setup, contexts: torch.Tensor, prompts: torch.Tensor, new: int, reps: int) -> dict:
    model = s.transformerlens()
    contexts, prompts = contexts.to(s.device), prompts.to(s.device)
    kept = []

    def keep(activation, hook):
        kept.append(activation.detach().clone())

    def generate():
        kept.clear()
        with torch.no_grad(), model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_resid_post"), keep)]):
            model.generate(prompts, max_new_tokens=new, do_sample=False, use_past_kv_cache=True, verbose=False,
                           stop_at_eos=False)
        synchronize(s)

    def prefill():
        with torch.no_grad():
            model.run_with_cache(contexts, names_filter=lambda n: n.endswith("hook_resid_post"))
        synchronize(s)

    return {"prefill": timed(prefill, reps), "generate": timed(generate, reps)}


def inspector(s: Setup, contexts: torch.Tensor, prompts: list[str], new: int, reps: int,
              breakdown: bool = False) -> dict:
    from inspector import Inspector

    with Inspector(str(s.model_dir), hooks=["blocks.*.hook_resid_post", "ln_final.hook_normalized"], dtype=s.dtype,
                   device=s.device, max_model_len=1024, **s.engine_args) as ins:
        prefill = timed(lambda: ins.run_with_cache(contexts, names_filter=RESID, return_type=None), reps)
        generate = timed(lambda: ins.generate_with_cache(prompts, max_new_tokens=new, ignore_eos=True,
                                                         names_filter=RESID), reps)
        if breakdown:
            generation_breakdown(ins, prompts, new, reps)
    return {"prefill": prefill, "generate": generate}


def generation_breakdown(ins, prompts: list[str], new: int, reps: int) -> None:
    """Where ``generate_with_cache``'s time goes, on the hooked engine itself: its bare ``LLM.generate``
    with the rows dropped where they are made (the compiled hooks alone), the session's step loop with
    the rows dropped (+ its per-step events), the step loop with the rows scattered into the cache's
    tensors (+ the row sink), and the whole call (+ the cache's assembly); then the heaviest operations
    of the whole call on the host and on the device."""
    from vllm import SamplingParams

    from inspector.core.protocol import Sampling

    session, llm = ins.session, ins.session._llm
    config = llm.llm_engine.vllm_config
    print(f"  hooked engine: async scheduling {config.scheduler_config.async_scheduling}, "
          f"cudagraph mode {getattr(config.compilation_config, 'cudagraph_mode', None)}")
    many = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    sampling = Sampling(max_tokens=new, logprobs=0, ignore_eos=True)

    def session_steps():
        for _ in session.generate(prompts, sampling):
            pass
        session.new_run()

    session.set_row_sink(lambda *rows: None)
    try:
        times = {"hooked LLM.generate, rows dropped": timed(lambda: llm.generate(prompts, many, use_tqdm=False), reps),
                 "Session.generate, rows dropped": timed(session_steps, reps)}
    finally:
        session.set_row_sink(None)
    resid = {name for name, point in ins.points.items() if point.alias.endswith("hook_resid_post")}
    times["Session.generate, rows to the sink"] = timed(
        lambda: ins._generated_rows(prompts, sampling, resid, new), reps)
    times["generate_with_cache"] = timed(lambda: ins.generate_with_cache(
        prompts, max_new_tokens=new, ignore_eos=True, names_filter=RESID), reps)
    for what, seconds in times.items():
        print(f"  {what:36} {1000 * seconds / new:7.2f} ms a step")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if torch.cuda.is_available() else [])
    with torch.profiler.profile(activities=activities) as profile:
        ins.generate_with_cache(prompts, max_new_tokens=new, ignore_eos=True, names_filter=RESID)
        synchronize_all()
    table = profile.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    if torch.cuda.is_available():
        print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


def synchronize_all() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def vanilla(s: Setup, contexts: torch.Tensor, prompts: list[str], new: int, reps: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(s.model_dir), dtype=s.dtype, max_model_len=1024,
              enable_prefix_caching=False, **s.engine_args)  # as the inspector's prefill: every row computed
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": row.tolist()} for row in contexts]
    prefill = timed(lambda: llm.generate(ids, one, use_tqdm=False), reps)
    generate = timed(lambda: llm.generate(prompts, many, use_tqdm=False), reps)
    config = llm.llm_engine.vllm_config
    print(f"  vanilla engine: async scheduling {config.scheduler_config.async_scheduling}, "
          f"cudagraph mode {getattr(config.compilation_config, 'cudagraph_mode', None)}, "
          f"{1000 * generate / new:.2f} ms a step")
    return {"prefill": prefill, "generate": generate}


def synchronize(s: Setup) -> None:
    if s.device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=["cpu", "llama3-8b"], default="cpu")
    parser.add_argument("--model", default="demo", help="the cpu preset's model")
    parser.add_argument("--batch", type=int, default=None, help="default: 8 on the CPU, 32 on the GPU")
    parser.add_argument("--tokens", type=int, default=None, help="default: 128 on the CPU, 512 on the GPU")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32 on the CPU, 128 on the GPU")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the hooked engine's generation in parts, and profile it")
    parser.add_argument("--only", choices=["TransformerLens", "Inspector", "vanilla vLLM"], nargs="*", default=None)
    args = parser.parse_args()
    gpu = args.preset != "cpu"
    batch, tokens, new = (args.batch or (32 if gpu else 8), args.tokens or (512 if gpu else 128),
                          args.new_tokens or (128 if gpu else 32))
    prepare_environment()
    s = setup(args.preset, args.model)
    generator = torch.Generator().manual_seed(0)
    contexts = torch.randint(2, 1000, (batch, tokens), generator=generator)
    prompts = [" ".join(f"w{100 + i + j}" for j in range(16)) if gpu else f"def function_{i}(a, b):"
               for i in range(batch)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(s.model_dir)
    prompt_ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])  # of one length: no padding
    runs = {"TransformerLens": lambda: transformerlens(s, contexts, prompt_ids, new, args.reps),
            "Inspector": lambda: inspector(s, contexts, prompts, new, args.reps, args.breakdown),
            "vanilla vLLM": lambda: vanilla(s, contexts, prompts, new, args.reps)}
    results = {}
    for name, run in runs.items():
        if args.only is None or name in args.only:
            results[name] = run()
            gc.collect()  # the model measured goes before the next one boots
            torch.cuda.empty_cache() if s.device == "cuda" else None
    prefill_tokens, new_tokens = batch * tokens, batch * new
    print(f"{args.preset} ({s.dtype}, {s.device}): prefill {batch} x {tokens} tokens, generation {batch} x {new} "
          f"new tokens, median of {args.reps}")
    for name, found in results.items():
        print(f"  {name:16} prefill {prefill_tokens / found['prefill']:9.0f} tok/s   "
              f"generate {new_tokens / found['generate']:8.0f} tok/s")
    ours, theirs, plain = (results.get(name) for name in ("Inspector", "TransformerLens", "vanilla vLLM"))
    for what in ("prefill", "generate"):
        if ours and plain:
            print(f"  {what}: Inspector / vanilla vLLM {plain[what] / ours[what]:.2f}x")
        if ours and theirs:
            print(f"  {what}: Inspector / TransformerLens {theirs[what] / ours[what]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
