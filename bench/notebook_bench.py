"""The notebook API against TransformerLens and vanilla vLLM, on one model, in one process, one after another.

    packaging/dev bench notebook_bench                 # CPU: the demo model, float32

Three engines on the same weights and tokens: TransformerLens's ``HookedTransformer`` (the weights
converted by its own converter, unprocessed), ``Inspector`` (the compiled engine, every block's residual
stream cached), and vanilla vLLM (no hooks). Each measures ``--reps`` times, median kept:
  - prefill: ``run_with_cache`` of ``--batch`` contexts of ``--tokens`` tokens (vLLM: a prefill-only
    ``generate``, one token each);
  - generation: ``--new-tokens`` greedy tokens from ``--batch`` short prompts, every resid_post cached
    (TransformerLens: ``generate`` under hooks that keep them; vLLM: plain ``generate``).
Printed: tokens/s of each, and the ratios the issue targets (Inspector / vanilla >= 0.8, Inspector /
TransformerLens ahead for prefill, >= 3x for generation on the H200).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from attention_bench import timed as median_ms  # noqa: E402
from inspector.capture.models import resolve_model  # noqa: E402
from inspector.engine.environment import prepare_environment  # noqa: E402

RESID = "*hook_resid_post"


def timed(function, reps: int) -> float:
    """Median seconds of ``reps`` calls, after one warm-up call."""
    return median_ms(function, reps) / 1000


def transformerlens(model_dir: Path, contexts: torch.Tensor, prompts: torch.Tensor, new: int, reps: int) -> dict:
    from tl_reference import hooked_transformer

    model = hooked_transformer(model_dir, "llama")
    kept = []

    def keep(activation, hook):
        kept.append(activation.detach().clone())

    def generate():
        kept.clear()
        with torch.no_grad(), model.hooks(fwd_hooks=[(lambda name: name.endswith("hook_resid_post"), keep)]):
            model.generate(prompts, max_new_tokens=new, do_sample=False, use_past_kv_cache=True, verbose=False,
                           stop_at_eos=False)

    with torch.no_grad():
        prefill = timed(lambda: model.run_with_cache(contexts, names_filter=lambda n: n.endswith("hook_resid_post")),
                        reps)
    return {"prefill": prefill, "generate": timed(generate, reps)}


def inspector(model_dir: Path, contexts: torch.Tensor, prompts: list[str], new: int, reps: int) -> dict:
    from inspector import Inspector

    with Inspector(str(model_dir), hooks=["blocks.*.hook_resid_post", "ln_final.hook_normalized"],
                   max_model_len=1024) as ins:
        prefill = timed(lambda: ins.run_with_cache(contexts, names_filter=RESID, return_type=None), reps)
        generate = timed(lambda: ins.generate_with_cache(prompts, max_new_tokens=new, ignore_eos=True,
                                                         names_filter=RESID), reps)
    return {"prefill": prefill, "generate": generate}


def vanilla(model_dir: Path, contexts: torch.Tensor, prompts: list[str], new: int, reps: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, max_num_batched_tokens=512,
              enable_prefix_caching=False)  # as the inspector's prefill: every row computed, every rep
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = [{"prompt_token_ids": row.tolist()} for row in contexts]
    prefill = timed(lambda: llm.generate(ids, one, use_tqdm=False), reps)
    generate = timed(lambda: llm.generate(prompts, many, use_tqdm=False), reps)
    return {"prefill": prefill, "generate": generate}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    prepare_environment()
    model_dir = resolve_model(args.model)
    generator = torch.Generator().manual_seed(0)
    contexts = torch.randint(1, 1000, (args.batch, args.tokens), generator=generator)
    prompts = [f"def function_{i}(a, b):" for i in range(args.batch)]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])  # of one length: no padding
    results = {"TransformerLens": transformerlens(model_dir, contexts, prompt_ids, args.new_tokens, args.reps),
               "Inspector": inspector(model_dir, contexts, prompts, args.new_tokens, args.reps),
               "vanilla vLLM": vanilla(model_dir, contexts, prompts, args.new_tokens, args.reps)}
    prefill_tokens, new_tokens = args.batch * args.tokens, args.batch * args.new_tokens
    print(f"{args.model}: prefill {args.batch} x {args.tokens} tokens, generation {args.batch} x {args.new_tokens} "
          f"new tokens, median of {args.reps}")
    for name, found in results.items():
        print(f"  {name:16} prefill {prefill_tokens / found['prefill']:9.0f} tok/s   "
              f"generate {new_tokens / found['generate']:8.0f} tok/s")
    ours, theirs, plain = results["Inspector"], results["TransformerLens"], results["vanilla vLLM"]
    for what in ("prefill", "generate"):
        print(f"  {what}: Inspector / vanilla vLLM {plain[what] / ours[what]:.2f}x, "
              f"Inspector / TransformerLens {theirs[what] / ours[what]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
