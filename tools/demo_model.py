"""The built-in demo model: a small Llama the project trains itself, offline, on Python's stdlib.

Random weights show noise; a trained model shows structure. The corpus is text every Python
installation has: the standard library's top-level modules (sources and docstrings), split by file
into a training set (9 files in 10) and a held-out set (every 10th file, in sorted order).

    packaging/dev run python tools/demo_model.py train [--out resources/demo-model] [--threads N] [--steps N]
    packaging/dev run python tools/demo_model.py eval  [--model resources/demo-model]  # writes EVAL.md + eval.json

Training is seeded and runs on one CPU thread by default (``--threads`` raises it; results then differ
in the last bits). A development tool: the installed package ships the trained model, not this.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from inspector.core.resources import DEMO_DIRNAME
from inspector.testing import tinymodels

EVAL_PROMPTS = ("def ", "import ", "class ", "for i in ", "return ")
EVAL_MAX_NEW_TOKENS = 24


@dataclass(frozen=True)
class Recipe:
    """Everything that shapes the demo model. Head size = hidden / heads = 64 (vLLM's CPU attention)."""

    vocab: int = 2048
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 768
    max_positions: int = 1024  # the engine's default max_model_len; trained on windows of `context`
    context: int = 256
    batch: int = 8
    steps: int = 800
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    heldout_every: int = 10  # file i is held out when i % heldout_every == heldout_every - 1
    seed: int = 0


# --------------------------------------------------------------------------------------------- corpus

def split_corpus(recipe: Recipe = Recipe()) -> tuple[list[str], list[str]]:
    """(train, held-out) texts: the stdlib's top-level modules, sorted, split by file."""
    texts = tinymodels.stdlib_corpus(max_bytes=sys.maxsize)
    k = recipe.heldout_every
    train = [t for i, t in enumerate(texts) if i % k != k - 1]
    heldout = [t for i, t in enumerate(texts) if i % k == k - 1]
    return train, heldout


# Words and operator runs carry ONE trailing space ("def ", "import ", "x ", "= "); newlines and indentation
# are pre-tokens of their own. GPT-2's convention (a leading space: "def", " foo") would make a prompt that
# ends in a space, like "def ", end in a lone " " token that training text almost never has there (the
# model then continues with "  # comment"); with trailing spaces, "def " is the token the corpus is full of.
PRE_TOKENIZER_PATTERN = r"[\p{L}_][\p{L}\p{N}_]* ?|\p{N}+ ?|[^\s\p{L}\p{N}_]+ ?|(?:\r?\n)+|[ \t]+|\s+"


def train_tokenizer(vocab_size: int, texts: list[str]):
    """A byte-level BPE tokenizer for code, wrapped as a transformers fast tokenizer.

    Like ``tinymodels.train_tokenizer`` but with the trailing-space pre-tokenizer above.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def encode_docs(tokenizer, texts: list[str]):
    """One 1-D token stream: each document followed by the end-of-text token."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_config(recipe: Recipe, tokenizer):
    spec = tinymodels.TinySpec(arch="llama", hidden=recipe.hidden, layers=recipe.layers, heads=recipe.heads,
                               kv_heads=recipe.heads, intermediate=recipe.intermediate, vocab=recipe.vocab,
                               max_positions=recipe.max_positions, seed=recipe.seed)
    config = tinymodels.hf_config(spec, tokenizer)
    assert config.hidden_size // config.num_attention_heads == 64
    return config


def generation_defaults(tokenizer):
    """Greedy by default: captures are reproducible and match the completions recorded in EVAL.md."""
    from transformers import GenerationConfig

    eos = tokenizer.eos_token_id
    return GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, do_sample=False,
                            max_new_tokens=64)


# ------------------------------------------------------------------------------------------- training

def lr_at(step: int, recipe: Recipe, steps: int) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, steps - recipe.warmup)
    floor = recipe.lr * recipe.min_lr_ratio
    return floor + (recipe.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train(out: Path, recipe: Recipe = Recipe(), threads: int = 1, log=print) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    started, cpu_started = time.perf_counter(), time.process_time()

    train_texts, heldout_texts = split_corpus(recipe)
    tokenizer = train_tokenizer(recipe.vocab, train_texts)  # the held-out files stay unseen
    train_ids = encode_docs(tokenizer, train_texts)
    heldout_ids = encode_docs(tokenizer, heldout_texts)
    log(f"corpus: {len(train_texts)} train files ({train_ids.numel():,} tokens), "
        f"{len(heldout_texts)} held-out files ({heldout_ids.numel():,} tokens); "
        f"tokenizer {time.perf_counter() - started:.1f}s")

    model = LlamaForCausalLM(build_config(recipe, tokenizer)).float()
    model.generation_config = generation_defaults(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(recipe.seed)
    span = recipe.context + 1
    probe = _windows(heldout_ids, recipe.context)[:32]  # a fixed held-out probe for the log

    history = []
    model.train()
    train_started = time.perf_counter()
    for step in range(recipe.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, recipe, recipe.steps)
        starts = torch.randint(0, train_ids.numel() - span, (recipe.batch,), generator=gen)
        batch = torch.stack([train_ids[s:s + span] for s in starts.tolist()])
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        if step % 50 == 0 or step == recipe.steps - 1:
            entry = {"step": step, "train_loss": round(loss.item(), 4),
                     "seconds": round(time.perf_counter() - train_started, 1)}
            if step % 200 == 0 or step == recipe.steps - 1:
                entry["heldout_probe_loss"] = round(_mean_loss(model, probe), 4)
                model.train()
            history.append(entry)
            log(json.dumps(entry))
    train_seconds = time.perf_counter() - train_started

    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out)  # safetensors, float32
    tokenizer.save_pretrained(out)
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the files are shipped
    meta = {"recipe": asdict(recipe), "threads": threads, "parameters": n_params,
            "train_files": len(train_texts), "heldout_files": len(heldout_texts),
            "train_tokens": int(train_ids.numel()), "heldout_tokens": int(heldout_ids.numel()),
            "tokens_seen": recipe.steps * recipe.batch * recipe.context,
            "train_seconds": round(train_seconds, 1), "total_seconds": round(time.perf_counter() - started, 1),
            "total_cpu_seconds": round(time.process_time() - cpu_started, 1),  # < wall on a shared machine
            "python": platform.python_version(), "torch": torch.__version__, "history": history}
    (out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"saved to {out} after {meta['total_seconds']}s")
    return meta


def _windows(ids, context: int):
    """Non-overlapping evaluation windows of context + 1 tokens (the last one is shorter)."""
    import torch

    span = context + 1
    return [ids[i:i + span] for i in range(0, ids.numel() - 1, context) if ids[i:i + span].numel() > 1] \
        or [torch.empty(0, dtype=torch.long)]


def _token_losses(model, windows, batch: int = 16):
    """Per-token cross-entropy (nats) over every predicted token of the windows, and the targets."""
    import torch

    losses, targets = [], []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            chunk = windows[i:i + batch]
            span = max(w.numel() for w in chunk)
            full = [w for w in chunk if w.numel() == span]
            for w in [w for w in chunk if w.numel() != span] + ([torch.stack(full)] if full else []):
                w = w if w.ndim == 2 else w[None]  # the short last window goes alone
                losses.append(_losses_of(model, w))
                targets.append(w[:, 1:].reshape(-1))
    return torch.cat(losses), torch.cat(targets)


def _losses_of(model, batch):
    import torch

    logits = model(input_ids=batch[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                             reduction="none")


def _mean_loss(model, windows) -> float:
    return _token_losses(model, windows)[0].mean().item()


# --------------------------------------------------------------------------------------------- eval

def greedy_completion(model, tokenizer, prompt: str, max_new_tokens: int = EVAL_MAX_NEW_TOKENS) -> list[int]:
    """Token ids greedily generated after ``prompt`` (no BOS: the demo model was trained without one)."""
    import torch

    ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


def evaluate(model_dir: Path, threads: int = 1) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(threads)
    meta = json.loads((model_dir / "training.json").read_text())
    recipe = Recipe(**meta["recipe"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_texts, heldout_texts = split_corpus(recipe)
    train_ids, heldout_ids = encode_docs(tokenizer, train_texts), encode_docs(tokenizer, heldout_texts)
    if (train_ids.numel(), heldout_ids.numel()) != (meta["train_tokens"], meta["heldout_tokens"]):
        print(f"warning: this Python's stdlib differs from the one the model was trained on "
              f"(Python {meta['python']}); the numbers below are for this one", file=sys.stderr)

    started = time.perf_counter()
    losses, targets = _token_losses(model, _windows(heldout_ids, recipe.context))
    vocab = len(tokenizer)
    counts = torch.bincount(train_ids, minlength=vocab).double()
    unigram_logp = torch.log((counts + 1) / (counts.sum() + vocab))  # add-one smoothing
    unigram = -unigram_logp[targets].mean().item()
    heldout_bytes = sum(len(t.encode("utf-8")) for t in heldout_texts)
    model_loss = losses.double().mean().item()

    completions = []
    for prompt in EVAL_PROMPTS:
        ids = greedy_completion(model, tokenizer, prompt)
        completions.append({"prompt": prompt, "ids": ids, "text": tokenizer.decode(ids)})
    return {"vocab": vocab, "heldout_loss": model_loss, "unigram_loss": unigram, "heldout_tokens_scored": int(targets.numel()),
            "heldout_bits_per_byte": model_loss * targets.numel() / heldout_bytes / math.log(2),
            "unigram_bits_per_byte": unigram * targets.numel() / heldout_bytes / math.log(2),
            "eval_seconds": round(time.perf_counter() - started, 1), "completions": completions,
            "python": platform.python_version(), "torch": torch.__version__}


def write_eval(model_dir: Path, result: dict) -> None:
    meta = json.loads((model_dir / "training.json").read_text())
    r = meta["recipe"]
    weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    lines = [
        "# Demo model: evaluation",
        "",
        "Written by `packaging/dev run python tools/demo_model.py eval`; the training run by "
        f"`packaging/dev run python tools/demo_model.py train --out resources/demo-model --threads {meta['threads']} "
        f"--steps {r['steps']}`.",
        "",
        "## Model and training",
        "",
        f"- Llama, {r['layers']} layers, hidden {r['hidden']}, {r['heads']} heads (head size "
        f"{r['hidden'] // r['heads']}), MLP {r['intermediate']}, vocab {result['vocab']} "
        f"(byte-level BPE), {meta['parameters']:,} parameters, float32 safetensors ({weights / 1e6:.1f} MB).",
        f"- Corpus: the top-level modules of Python {meta['python']}'s standard library, sorted by name; every "
        f"{r['heldout_every']}th file held out ({meta['train_files']} train files, {meta['train_tokens']:,} tokens; "
        f"{meta['heldout_files']} held-out files, {meta['heldout_tokens']:,} tokens). The tokenizer saw only the "
        "training files.",
        f"- {r['steps']} steps of AdamW (lr {r['lr']}, {r['warmup']} warm-up steps, cosine to "
        f"{r['min_lr_ratio']:g}x, weight decay {r['weight_decay']}, clip {r['grad_clip']}), batch "
        f"{r['batch']} x {r['context']} tokens ({meta['tokens_seen']:,} tokens seen), seed {r['seed']}, "
        f"{meta['threads']} CPU thread(s), torch {meta['torch']}: **{meta['train_seconds'] / 60:.1f} min** of training "
        f"({meta['total_seconds'] / 60:.1f} min wall with tokenizer and corpus"
        + (f"; {meta['total_cpu_seconds'] / 60:.1f} min of CPU time: the machine was shared, a quiet one "
           "needs about that" if "total_cpu_seconds" in meta else "") + ").",
        f"- Trained on windows of {r['context']} tokens; `max_position_embeddings` is {r['max_positions']} so the "
        f"engine's default `max_model_len` works, but text past {r['context']} tokens is out of distribution.",
        "- Generation defaults (`generation_config.json`): greedy (`do_sample: false`), end-of-text as EOS/pad.",
        "",
        "## Held-out loss",
        "",
        f"Cross-entropy per token on all {result['heldout_tokens_scored']:,} predicted held-out tokens "
        f"(non-overlapping windows of {r['context']}), against a unigram model of the training tokens with "
        "add-one smoothing scored on the same tokens:",
        "",
        "| model | loss (nats/token) | bits/byte |",
        "|---|---|---|",
        f"| demo model | {result['heldout_loss']:.4f} | {result['heldout_bits_per_byte']:.3f} |",
        f"| unigram baseline | {result['unigram_loss']:.4f} | {result['unigram_bits_per_byte']:.3f} |",
        "",
        f"Held-out loss: {result['heldout_loss']:.4f}",
        f"Unigram baseline loss: {result['unigram_loss']:.4f}",
        "",
        "## Greedy completions",
        "",
        f"transformers `generate`, greedy, {EVAL_MAX_NEW_TOKENS} new tokens, no BOS "
        "(prompt, then the completion; exact ids in `eval.json`):",
        "",
    ]
    for c in result["completions"]:
        lines += [f"Prompt `{c['prompt']}`:", "", "```python", c["prompt"] + c["text"], "```", ""]
    lines += ["## Training curve", "", "| step | train loss | held-out probe loss | seconds |", "|---|---|---|---|"]
    for h in meta["history"]:
        lines.append(f"| {h['step']} | {h['train_loss']} | {h.get('heldout_probe_loss', '')} | {h['seconds']} |")
    (model_dir / "EVAL.md").write_text("\n".join(lines) + "\n")
    (model_dir / "eval.json").write_text(json.dumps(result, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    default_dir = Path(__file__).resolve().parent.parent / "resources" / DEMO_DIRNAME
    parser = argparse.ArgumentParser(prog="tools/demo_model.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train the demo model (seeded; ~10 min on one CPU thread)")
    p_train.add_argument("--out", type=Path, default=default_dir)
    p_train.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p_train.add_argument("--steps", type=int, default=Recipe.steps)
    p_train.add_argument("--batch", type=int, default=Recipe.batch)
    p_train.add_argument("--seed", type=int, default=Recipe.seed)
    p_train.add_argument("--no-eval", action="store_true", help="skip writing EVAL.md after training")
    p_eval = sub.add_parser("eval", help="evaluate a trained model and write EVAL.md + eval.json next to it")
    p_eval.add_argument("--model", type=Path, default=default_dir)
    p_eval.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "train":
        recipe = Recipe(steps=args.steps, batch=args.batch, seed=args.seed)
        train(args.out, recipe, threads=args.threads)
        model_dir = args.out
        if args.no_eval:
            return 0
    else:
        model_dir = args.model
    result = evaluate(model_dir, threads=args.threads)
    write_eval(model_dir, result)
    print(f"held-out loss {result['heldout_loss']:.4f} vs unigram {result['unigram_loss']:.4f} nats/token; "
          f"wrote {model_dir / 'EVAL.md'}")
    for c in result["completions"]:
        print(repr(c["prompt"] + c["text"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
