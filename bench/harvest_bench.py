"""Harvest throughput: the same contexts prefilled by vanilla vLLM, harvested to memory and to disk,
and run through a Hugging Face forward stopped after the hooked layer (not a test).

    packaging/dev bench harvest_bench                                  # CPU: the demo model, float32
    python3 bench/harvest_bench.py --preset llama3-8b --layers 15 31   # GPU: Llama-3-8B shape, dummy bf16

Per hooked layer L and hook count: vanilla vLLM with the model cut after block L (what the harvest's
engine runs: no work past the deepest hooked block), then the harvest's engine on the same contexts,
delivering rows to memory (chunks as torch tensors, what ``inspector.harvest`` mixes into batches; and
the shuffled training batches themselves, 4096 rows each, mixed in a buffer of 16 batches, on the CPU
and, where there is one, on the GPU, where SAELens keeps its buffer) and to disk
(safetensors shards and the manifest, what ``inspector harvest`` writes), then the disk's own bandwidth
for the same bytes (``capture_file_bench.disk_seconds``: one file, synced, the better of through the page
cache and past it), then
transformers' forward of the same model cut after block L at SAELens's default batch (32 contexts),
keeping the layer's output on the device: what SAELens's ``ActivationsStore`` does through
TransformerLens (whose own attention is slower than transformers' SDPA, so this baseline flatters
SAELens); with ``--saelens`` (the model converted to TransformerLens: the demo's weights, or random ones
for a GPU preset's dummy model, on the same device and in the same dtype), SAELens's
``ActivationsStore`` itself. The corpus is generated, its documents tokenized and packed by the harvest
itself (on its tokenizer thread) while it runs. Tokens/s are medians of ``--reps`` runs; ratios are
against vanilla's median.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture_file_bench import disk_seconds  # noqa: E402
from plugin_bench import PRESETS, word_tokenizer  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "resources" / "demo-model"


def model_dir(preset: str) -> tuple[Path, dict, str]:
    """The model's directory, its engine arguments and dtype. Dummy weights: vanilla vLLM cannot load a
    checkpoint into a model cut short (the harvest's engine filters the weights; this needs none)."""
    if preset == "cpu":
        return DEMO, {"load_format": "dummy"}, "float32"
    spec = PRESETS[preset][0]
    path = Path(tempfile.mkdtemp(prefix="harvest-bench-model-"))
    (path / "config.json").write_text(json.dumps(spec))
    word_tokenizer(spec["vocab_size"]).save_pretrained(path)
    return path, {"load_format": "dummy"}, PRESETS[preset][1]


def write_corpus(path: Path, tokens: int, vocab: int, words: bool) -> Path:
    """Documents of 50-400 tokens; ``words``: the word tokenizer's "w<i>" words, else plain letters."""
    rng = np.random.default_rng(0)
    lines, total = [], 0
    while total < tokens * 1.1:
        n = int(rng.integers(50, 400))
        ids = rng.integers(2, vocab, n)
        lines.append(" ".join(f"w{i}" for i in ids) if words else " ".join("abcdefghij"[i % 10] * (1 + i % 5) for i in ids))
        total += n
    path.write_text("\n".join(lines) + "\n")
    return path


def vanilla_rate(model: Path, engine_args: dict, dtype: str, kept: int, contexts: list[np.ndarray], reps: int,
                 batched: int, util: float) -> list[float]:
    from vllm import LLM, SamplingParams

    from inspector.engine.boot import layer_overrides
    from inspector.engine.environment import engine_precision, prepare_environment

    prepare_environment()
    engine_precision(dtype)
    llm = LLM(model=str(model), dtype=dtype, max_model_len=max(len(c) for c in contexts) + 1,
              max_num_batched_tokens=batched, enable_prefix_caching=False, gpu_memory_utilization=util,
              hf_overrides=layer_overrides(model, kept), **engine_args)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": c.tolist()} for c in contexts]
    llm.generate(prompts[:64], params, use_tqdm=False)  # warm
    rates = []
    for _ in range(reps):
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(map(len, contexts)) / (time.perf_counter() - started))
    from inspector.plugin import vllm_process

    vllm_process.shutdown_engine(llm)
    return rates


def batch_devices(cuda: bool) -> dict[str, str]:
    """Where the shuffled batches are measured: the CPU, and the GPU where there is one (SAELens's
    mixing buffer lives on its model's device, and a trainer takes its batches there)."""
    return {"batches": "cpu", **({"GPU batches": "cuda"} if cuda else {})}


def harvest_rates(engine, corpus, context_size: int, contexts: int, reps: int, out_root: Path) -> dict:
    """Tokens/s of the harvest's pipeline to memory and to disk, and the disk's bytes/s for its rows."""
    import torch

    from inspector.harvesting.shards import HarvestDirectory, NormEstimate, as_torch
    from inspector.harvesting.store import Harvest

    engine.spec = replace(engine.spec, context_size=context_size, tokens=contexts * context_size)
    rates: dict = {"memory": [], "batches": [], "disk": [], "disk MB/s": [], "raw disk MB/s": []}
    for rep in range(reps + 1):  # the first is a warm-up
        rows, row_bytes = 0, sum(engine.widths.values()) * engine.row_dtype.itemsize

        def to_memory(chunk):  # the chunks as the in-memory iterator gets them, let go of at once
            nonlocal rows
            rows += len({hook: as_torch(v) for hook, v in chunk.activations.items()}[next(iter(engine.widths))])

        started = time.perf_counter()
        engine.run(engine.contexts(corpus, 0), 0, to_memory, threading.Event())
        seconds = time.perf_counter() - started
        batch_rates = {}  # and shuffled into training batches, as inspector.harvest() delivers them
        for key, device in batch_devices(torch.cuda.is_available()).items():
            started = time.perf_counter()
            with Harvest(engine.spec, batch_size=4096, engine=engine, device=device) as harvest:
                batched = sum(len(batch[next(iter(engine.widths))]) for batch in harvest)
            if device == "cuda":
                torch.cuda.synchronize()
            batch_rates[key] = batched / (time.perf_counter() - started)
        gc.collect()
        out = out_root / f"disk-{context_size}-{rep}"
        directory = HarvestDirectory.open(out, {"layout": "safetensors"}, engine.widths, {"stored_dtype": "x"})
        norm = NormEstimate()

        def to_disk(chunk):
            norm.add(chunk)
            directory.write(chunk, norm)

        os.sync()
        started = time.perf_counter()
        engine.run(engine.contexts(corpus, 0), 0, to_disk, threading.Event(), keeps_chunks=False)
        directory.settle()  # the last shards synced and listed
        harvest_seconds = time.perf_counter() - started
        raw = disk_seconds(out_root / "raw.bin", rows * row_bytes)
        for path in out.iterdir():
            path.unlink()
        out.rmdir()
        if rep:
            rates["memory"].append(rows / seconds)
            for key, rate in batch_rates.items():
                rates.setdefault(key, []).append(rate)
            rates["disk"].append(rows / harvest_seconds)
            rates["disk MB/s"].append(rows * row_bytes / harvest_seconds / 1e6)
            rates["raw disk MB/s"].append(rows * row_bytes / raw / 1e6)
    rates["row bytes"] = row_bytes
    return rates


def hf_rate(model: Path, dtype: str, layer: int, contexts: list[np.ndarray], reps: int, batch: int = 32) -> list[float]:
    """transformers' forward cut after block ``layer``, ``batch`` contexts at a time, the layer's output
    kept on the device (SAELens's ActivationsStore, through TransformerLens, does this)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(model)
    config.num_hidden_layers = layer + 1
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
    kept = []
    hf.model.layers[layer].register_forward_hook(lambda m, a, out: kept.append((out[0] if isinstance(out, tuple) else out).detach()))
    ids = torch.from_numpy(np.stack(contexts)).to(device)
    rates = []
    with torch.inference_mode():
        hf.model(input_ids=ids[:batch])
        for _ in range(reps):
            kept.clear()
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            for start in range(0, len(ids), batch):
                hf.model(input_ids=ids[start:start + batch])
                kept.pop().clone()  # the activations copied out, as into the store's buffer
            if device == "cuda":
                torch.cuda.synchronize()
            rates.append(ids.numel() / (time.perf_counter() - started))
    del hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rates


def saelens_rate(model: Path, corpus, layer: int, context_size: int, tokens: int, reps: int,
                 dtype: str) -> list[float]:
    """Tokens/s of SAELens's ActivationsStore (its forward through TransformerLens, stopped after the
    layer, 32 contexts a batch) on the same corpus, device and dtype: the model converted to
    TransformerLens; a model without weights (a GPU preset's dummy one) gets TransformerLens's random
    ones, its blocks past the layer left out (the store's forward stops before them anyway)."""
    import datasets
    import torch
    from sae_lens.training.activations_store import ActivationsStore
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = AutoConfig.from_pretrained(model)
    weights = any(model.glob("*.safetensors"))
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers if weights else layer + 1, n_ctx=max(context_size, 1024), d_vocab=c.vocab_size,
        act_fn="silu", normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary",
        rotary_dim=c.head_dim, rotary_base=c.rope_parameters["rope_theta"], final_rms=True, gated_mlp=True,
        n_key_value_heads=c.num_key_value_heads, original_architecture="LlamaForCausalLM",
        dtype=getattr(torch, dtype), device=device)
    with torch.device(device):
        tl = HookedTransformer(cfg, tokenizer=AutoTokenizer.from_pretrained(model))
    if weights:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        tl.load_state_dict(convert_llama_weights(hf, cfg), strict=False)
    texts = datasets.Dataset.from_dict({"text": list(corpus.texts())})
    batch = 32
    rates = []
    for _ in range(reps + 1):  # the first is a warm-up
        store = ActivationsStore(tl, texts, streaming=False, hook_name=f"blocks.{layer}.hook_resid_post",
                                 hook_head_index=None, context_size=context_size, d_in=c.hidden_size,
                                 n_batches_in_buffer=4, total_training_tokens=tokens, store_batch_size_prompts=batch,
                                 train_batch_size_tokens=4096, prepend_bos=True, normalize_activations="none",
                                 device=torch.device(device), dtype=dtype)
        started = time.perf_counter()
        done = 0
        while done < tokens:
            done += len(store.get_raw_llm_batch()[0])
        if device == "cuda":
            torch.cuda.synchronize()
        rates.append(done / (time.perf_counter() - started))
    del tl
    gc.collect()
    return rates[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 3], help="hooked block(s), one engine each")
    parser.add_argument("--hook-counts", type=int, nargs="+", default=[1, 4],
                        help="resid_post hooks ending at the layer (1: the layer's; 4: it and the 3 before)")
    parser.add_argument("--context-sizes", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--tokens", type=int, default=1 << 16, help="tokens per measurement")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=None, help="where the disk runs write (default: a temporary directory)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--saelens", action="store_true",
                        help="also SAELens's ActivationsStore through TransformerLens, on the same device and dtype")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from inspector.harvesting import Corpus, HarvestSpec
    from inspector.harvesting.run import Engine

    model, engine_args, dtype = model_dir(args.preset)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    corpus = Corpus.open(write_corpus(Path(tempfile.mkdtemp()) / "corpus.txt", args.tokens, vocab,
                                      words=args.preset != "cpu"))
    out_root = Path(args.out or tempfile.mkdtemp(prefix="harvest-bench-out-"))
    out_root.mkdir(parents=True, exist_ok=True)
    batched, largest = max(8192, max(args.context_sizes)), max(args.context_sizes)
    util = args.gpu_memory_utilization
    rows = []
    print(f"preset {args.preset} ({dtype}), corpus {corpus.documents} documents, {args.tokens} tokens a measurement, "
          f"{args.reps} reps; engine steps of {batched} tokens", flush=True)
    for layer in args.layers:
        contexts_of = {}
        for count in args.hook_counts:
            hooks = tuple(f"blocks.{layer - k}.hook_resid_post" for k in range(count) if layer - k >= 0)
            spec = HarvestSpec(str(model), corpus.path, hooks, context_size=largest, dtype=dtype,
                               max_num_batched_tokens=batched,
                               engine_args={**engine_args, "gpu_memory_utilization": util})
            started = time.perf_counter()
            engine = Engine(spec)
            boot = time.perf_counter() - started
            try:
                for size in args.context_sizes:
                    engine.spec = replace(engine.spec, context_size=size, tokens=args.tokens)
                    contexts_of[size] = list(engine.contexts(corpus, 0))
                    got = harvest_rates(engine, corpus, size, len(contexts_of[size]), args.reps, out_root)
                    rows.append((layer, count, size, got))
                    print(f"layer {layer}, {len(hooks)} hook(s), context {size}: memory "
                          f"{statistics.median(got['memory']):,.0f} tok/s (shuffled batches "
                          f"{statistics.median(got['batches']):,.0f}), disk {statistics.median(got['disk']):,.0f} "
                          f"tok/s ({statistics.median(got['disk MB/s']):,.0f} MB/s; the disk alone "
                          f"{statistics.median(got['raw disk MB/s']):,.0f} MB/s) [engine booted in {boot:.0f} s]",
                          flush=True)
            finally:
                engine.close()
        for size, contexts in contexts_of.items():
            vanilla = vanilla_rate(model, engine_args, dtype, layer + 1, contexts, args.reps, batched, util)
            hf = [] if args.skip_hf else hf_rate(model, dtype, layer, contexts, args.reps)
            sl = saelens_rate(model, corpus, layer, size, args.tokens, args.reps, dtype) if args.saelens else []
            print(f"layer {layer}, context {size}: vanilla vLLM cut after the layer {statistics.median(vanilla):,.0f} "
                  f"tok/s (reps {', '.join(f'{v:,.0f}' for v in vanilla)})"
                  + (f"; transformers forward cut after it {statistics.median(hf):,.0f} tok/s" if hf else "")
                  + (f"; SAELens's ActivationsStore {statistics.median(sl):,.0f} tok/s" if sl else ""), flush=True)
            for row in rows:
                if row[0] == layer and row[2] == size:
                    row[3]["vanilla"], row[3]["hf"], row[3]["saelens"] = vanilla, hf, sl
    print()
    print("layer  hooks  context   vanilla tok/s   memory tok/s  (x)  batches tok/s (x)  GPU batches (x)   disk tok/s  "
          "(x)  of disk bound (x)   HF tok/s  memory/HF  SAELens tok/s  memory/SAELens")
    for layer, count, size, got in rows:
        v, m, b, d = (statistics.median(got[k]) for k in ("vanilla", "memory", "batches", "disk"))
        g = statistics.median(got["GPU batches"]) if "GPU batches" in got else float("nan")
        bound = min(v, statistics.median(got["raw disk MB/s"]) * 1e6 / got["row bytes"])  # what the disk allows
        hf = statistics.median(got["hf"]) if got["hf"] else float("nan")
        sl = statistics.median(got["saelens"]) if got["saelens"] else float("nan")
        print(f"{layer:5d}  {count:5d}  {size:7d}  {v:14,.0f}  {m:13,.0f} {m / v:5.2f}  {b:13,.0f} {b / v:4.2f}  "
              f"{g:11,.0f} {g / v:4.2f}  {d:11,.0f} {d / v:4.2f}  "
              f"{bound:13,.0f} {d / bound:4.2f}  {hf:9,.0f}  {m / hf:9.2f}  {sl:13,.0f}  {m / sl:14.2f}")


if __name__ == "__main__":
    main()
