"""The coverage table: what the inspector offers on every text-generation architecture vLLM serves.

    packaging/dev run python tools/coverage.py [--only ARCH ...] [--jobs 1] [--timeout 600]

For each architecture of vLLM's registry of text-generation models, and each decoder-only causal-LM
type of transformers that vLLM serves through its Transformers backend, it builds a tiny random model
(below), boots it in a child process with every hook point (eager), and checks against transformers
in float32: resid_pre and resid_post of every block (relative L2 per row < 1e-5), greedy tokens, and
a steering bias at blocks.0.hook_resid_post against the same edit by a forward hook on transformers'
block 0 (the last block's resid_post and the greedy tokens). It records the kinds offered (each
verified by the boot probe, read only where its steering round trip failed), those withdrawn or
refused with the reason, or why the architecture could not be tried. Results are cached per
architecture (``tools/.coverage-cache``, keyed by the plugin's sources); ``docs/coverage.md`` is
written from the cache.

The tiny-model rule: transformers' config class with its defaults, then hidden size 128 in 2 heads of
64 (head_dim 64 where the config has one), 2 key/value heads (1 where the defaults share one),
intermediate sizes 256 (64 per expert), 4 experts with 2 per token, a sliding window of 4 tokens
(shorter than the test prompt), MLA latent and head sizes of 64 (rope 32 + nope 32), the vocabulary
of the tests' offline tokenizer, 1,024 positions, and as many layers as two periods of any layer-type
pattern (at least 2); every norm weight, bias and sink is then moved off its default by random noise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).resolve().parent / ".coverage-cache"
PROMPT = "def fibonacci(n):\n    return n"
TOLERANCE = 1e-5
SHRINK = {"hidden_size": 128, "n_embd": 128, "d_model": 128, "num_attention_heads": 2, "n_head": 2,
          "head_dim": 64, "intermediate_size": 256, "ffn_dim": 256, "n_inner": 256, "moe_intermediate_size": 64,
          "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
          "num_experts_per_tok": 2, "max_position_embeddings": 1024, "n_positions": 1024, "kv_lora_rank": 64,
          "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_group": 1, "topk_group": 1}


def architectures() -> dict[str, str]:
    """Architecture -> "native" (vLLM's own implementation) or "backend" (its Transformers backend)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    found = {arch: "native" for arch in _TEXT_GENERATION_MODELS}
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        for arch in (name if isinstance(name, (list, tuple)) else (name,)):
            found.setdefault(arch, "backend")
    return dict(sorted(found.items()))


def config_class(arch: str):
    """transformers' config class of an architecture (by its causal-LM class), or None."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if arch in (names if isinstance(names, (list, tuple)) else (names,)) and model_type in CONFIG_MAPPING:
            return CONFIG_MAPPING[model_type]
    return None


def tiny_config(cls, vocab: int):
    """The config class's defaults, shrunk by the rule in this module's docstring."""
    config = cls()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shared_kv = getattr(text, "num_key_value_heads", 2) == 1 or getattr(text, "multi_query", False)
    for key, value in SHRINK.items():
        if getattr(text, key, None) is not None and not isinstance(getattr(type(text), key, None), property):
            setattr(text, key, value)
    if hasattr(text, "num_key_value_heads"):
        text.num_key_value_heads = 1 if shared_kv else 2
    if getattr(text, "sliding_window", None):
        text.sliding_window = 4
    if getattr(text, "q_lora_rank", None):
        text.q_lora_rank = 64
    period = _pattern_period(text)
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if getattr(text, key, None) is not None:
            setattr(text, key, max(2, 2 * period))
    layers = max(2, 2 * period)
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        pattern = getattr(text, key, None)
        if isinstance(pattern, (list, tuple)) and pattern:
            setattr(text, key, [pattern[i % period] for i in range(layers)])
    for key in ("vocab_size",):
        setattr(text, key, vocab)
    text.bos_token_id = text.eos_token_id = 0
    if hasattr(text, "pad_token_id"):
        text.pad_token_id = 0
    return config


def _pattern_period(text) -> int:
    """The length of the smallest repeating unit of the config's layer-type pattern (1 without one)."""
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        pattern = getattr(text, key, None)
        if isinstance(pattern, (list, tuple)) and len(set(pattern)) > 1:
            for period in range(1, len(pattern) + 1):
                if all(pattern[i] == pattern[i % period] for i in range(len(pattern))):
                    return min(period, 8)
    interval = getattr(text, "sliding_window_pattern", None) or getattr(text, "attn_layer_period", None)
    return int(interval) if isinstance(interval, int) and 1 < interval <= 8 else 1


def build(arch: str, out: Path) -> str:
    """Write the tiny model of ``arch`` into ``out``; "" or why it cannot be built."""
    import torch
    from transformers import AutoModelForCausalLM

    from inspector.testing.tinymodels import stdlib_corpus, train_tokenizer

    cls = config_class(arch)
    if cls is None:
        return "transformers cannot build it: no transformers class of that name"
    tokenizer = train_tokenizer(512, stdlib_corpus())
    try:
        config = tiny_config(cls, len(tokenizer))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - any failure is a reason in the table
        return f"transformers cannot build it from its config alone: {type(e).__name__}: {str(e)[:200]}"
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and ("norm" in name or "ln" in name or name.endswith(("bias", "sinks"))):
                parameter.add_(0.1 * torch.randn_like(parameter))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return ""


def reference(model_dir: Path, ids: list[int], bias) -> dict:
    """transformers' resid_pre/resid_post per block and logits, plain and with ``bias`` added to block
    0's output (before vLLM is imported: its Transformers backend rewrites transformers' classes)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    layers = model.config.get_text_config().num_hidden_layers
    blocks = max((m for m in model.modules() if isinstance(m, torch.nn.ModuleList)),
                 key=lambda m: (len(m) == layers, len(m)))  # not a list of experts
    found: dict = {}

    def run(steer):
        rows, handles = {}, []
        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(
                lambda m, args, kwargs, i=i: rows.__setitem__(("resid_pre", i), (args[0] if args else
                                                                                 kwargs["hidden_states"])[0].clone()),
                with_kwargs=True))

            def post(m, args, out, i=i):
                hidden = out[0] if isinstance(out, tuple) else out
                if steer is not None and i == 0:
                    hidden = hidden + torch.from_numpy(steer)
                    out = (hidden, *out[1:]) if isinstance(out, tuple) else hidden
                rows[("resid_post", i)] = hidden[0].clone()
                return out
            handles.append(block.register_forward_hook(post))
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
        finally:
            for h in handles:
                h.remove()
        return {f"{kind}.{i}": v.numpy() for (kind, i), v in rows.items()}, logits.numpy()

    found["rows"], found["logits"] = run(None)
    found["steered_rows"], found["steered_logits"] = run(np.asarray(bias, np.float32))
    return found


def check(arch: str) -> dict:
    """One architecture end to end (in this process): the row of the table, as a dict."""
    import numpy as np

    model_dir = Path(os.environ.get("INSPECTOR_CACHE", Path.home() / ".cache/activation-inspector")) / "coverage-models" / arch
    if not (model_dir / "config.json").exists():
        why = build(arch, model_dir)
        if why:
            return {"status": "not built", "why": why}
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", VLLM_DISABLE_COMPILE_CACHE="1")
    from inspector.engine.boot import boot_llm, shutdown_llm

    try:
        llm = boot_llm(str(model_dir), hook_patterns=("*",), mode="eager", max_num_batched_tokens=64,
                       max_model_len=256)
    except Exception as e:  # noqa: BLE001 - any failure is a reason in the table
        return {"status": "not served", "why": _boot_failure(model_dir, e)}
    try:
        return _compare(llm, prompt_ids, model_dir, np)
    finally:
        shutdown_llm(llm)


def _boot_failure(model_dir: Path, error: BaseException) -> str:
    """Why a boot failed: vLLM's own failure (the same without the plugin) or the inspector's."""
    first = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    probe = subprocess.run([sys.executable, "-c", "import sys, os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'; "
                            "from vllm import LLM; LLM(sys.argv[1], enforce_eager=True, max_model_len=256, "
                            "max_num_batched_tokens=64, dtype='float32')", str(model_dir)],
                           capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_PLUGINS": ""})
    if probe.returncode != 0:
        last = [line for line in probe.stderr.splitlines() if "Error" in line or "error" in line]
        return f"vLLM cannot serve it on CPU: {(last[-1] if last else first)[:240]}"
    return f"the inspector refused it: {first}"


def _compare(llm, prompt_ids, model_dir, np) -> dict:
    from vllm import SamplingParams

    info = llm.collective_rpc("inspector_describe")[0]
    points = {p["name"]: p for p in info["hook_points"]}
    by_key = {(p["kind"], p["layer"]): p for p in points.values()}

    def generate(interventions):
        llm.collective_rpc("inspector_set_interventions", args=(interventions,))
        llm.collective_rpc("inspector_drain")
        out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=4, temperature=0.0,
                                                                             ignore_eos=True), use_tqdm=False)
        rows = llm.collective_rpc("inspector_drain")[0]
        return list(out[0].outputs[0].token_ids), next(iter(rows.values()))

    layers = 1 + max(p["layer"] for p in points.values())
    width = by_key[("resid_post", 0)]["width"]
    bias = np.random.default_rng(0).standard_normal(width).astype(np.float32)
    plain_ids, plain_rows = generate([])
    steered_ids, steered_rows = generate([{"hook": by_key[("resid_post", 0)]["name"], "bias": bias.tolist()}])
    llm.collective_rpc("inspector_clear_interventions")
    verified, errors = [], {}
    for seq_ids, rows, key in ((plain_ids, plain_rows, "rows"), (steered_ids, steered_rows, "steered_rows")):
        ref = _in_child("reference", model_dir, prompt_ids + seq_ids[:-1], bias.tolist())
        logits = ref["logits" if key == "rows" else "steered_logits"]
        prefix = "" if key == "rows" else "steered "
        for kind in ("resid_pre", "resid_post") if key == "rows" else ("resid_post",):
            for i in range(layers) if key == "rows" else [layers - 1]:
                got = rows[by_key[(kind, i)]["name"]]["values"]
                want = ref[key][f"{kind}.{i}"]
                error = float((np.linalg.norm(got - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-30)).max())
                errors[prefix + kind] = max(errors.get(prefix + kind, 0.0), error)
        errors[prefix + "greedy"] = float(any(_off_greedy(logits[len(prompt_ids) - 1 + k], token, np)
                                              for k, token in enumerate(seq_ids)))
    for name in ("resid_pre", "resid_post", "steering"):
        keys = {"steering": ("steered resid_post", "steered greedy")}.get(name, (name, "greedy"))
        if all(errors.get(k, 1.0) < TOLERANCE for k in keys):
            verified.append(name)
    offered = sorted({p["kind"] for p in points.values() if not p["withdrawn"] and not p.get("unsteerable")})
    read_only = sorted({p["kind"] for p in points.values() if p.get("unsteerable") and not p["withdrawn"]})
    withdrawn = {p["kind"]: p["withdrawn"] for p in points.values() if p["withdrawn"]}
    return {"status": "verified" if len(verified) == 3 else "mismatch", "family": info["family"],
            "verified": verified, "errors": errors, "offered": offered, "read_only": read_only,
            "withdrawn": withdrawn, "refused": info.get("refused", {})}


def _off_greedy(row, token: int, np) -> bool:
    """A generated token that is not the reference's argmax (a near-tie within the tolerance is not)."""
    best = int(np.argmax(row))
    return token != best and row[best] - row[token] > TOLERANCE * np.abs(row).max()


def _in_child(function: str, *args):
    """``function(*args)`` of this module in a fresh Python (vLLM's backend has rewritten transformers here)."""
    import pickle

    code = ("import pickle, sys; sys.path.insert(0, sys.argv[1]); import coverage as c; "
            "a = pickle.loads(sys.stdin.buffer.read()); sys.stdout.buffer.write(pickle.dumps(getattr(c, a[0])(*a[1:])))")
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], capture_output=True,
                          input=pickle.dumps((function, *args)), timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode()[-500:])
    return pickle.loads(done.stdout)


def sources_key() -> str:
    plugin = sorted((ROOT / "inspector" / "plugin").glob("*.py")) + [Path(__file__)]
    return hashlib.sha256(b"".join(p.read_bytes() for p in plugin)).hexdigest()[:16]


def run_one(arch: str, timeout: int) -> dict:
    """``arch`` in a child process (a crash or a hang is a reason, not the end of the table)."""
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", arch], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())})
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        result = (json.loads(lines[-1][7:]) if lines else
                  {"status": "failed", "why": f"the check crashed: {(done.stderr.strip().splitlines() or ['?'])[-1][:240]}"})
    except subprocess.TimeoutExpired:
        result = {"status": "failed", "why": f"no answer within {timeout} s"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def write_table(results: dict[str, dict], sources: dict[str, str]) -> str:
    import torch
    import transformers
    import vllm

    native = [a for a in sources if sources[a] == "native"]
    tried = [a for a in sources if a in results]
    verified = [a for a in tried if results[a]["status"] == "verified"]
    served = [a for a in tried if results[a]["status"] in ("verified", "mismatch")]
    counts = {s: sum(results[a]["status"] == s for a in tried) for s in ("verified", "mismatch", "not served",
                                                                          "not built", "failed")}
    lines = [
        "# Coverage: what the inspector offers on each architecture vLLM serves",
        "",
        f"Generated by `tools/coverage.py` on {time.strftime('%Y-%m-%d')} with vLLM {vllm.__version__} (CPU), "
        f"transformers {transformers.__version__}, torch {torch.__version__}; eager engines, float32. The rule "
        "for the tiny random models and what is checked are in the script's docstring.",
        "",
        f"- **resid_pre, resid_post and steering verified against transformers: {len(verified)} of the "
        f"{len(served)} architectures vLLM served here ({100 * len(verified) / max(len(served), 1):.0f}%)**; "
        f"{len(verified)} of the {len(native)} text-generation architectures in vLLM's registry plus "
        f"{len(sources) - len(native)} served through its Transformers backend ({len(sources)} in all, "
        f"{100 * len(verified) / len(sources):.0f}%).",
        f"- Tried {len(tried)} of {len(sources)}: verified {counts['verified']}, served but not equal to "
        f"transformers {counts['mismatch']}, vLLM cannot serve on CPU {counts['not served']}, transformers cannot "
        f"build {counts['not built']}, the check failed {counts['failed']}; not tried yet {len(sources) - len(tried)}.",
        "- Kinds: those offered are verified by the boot probe on every boot (its identities and a steering round "
        "trip); *read only* kinds read right but an edit there would not act on the stream; refused kinds say why.",
        "",
        "| architecture | served as | outcome | blocks | kinds offered | read only | withdrawn or refused, and why |",
        "|---|---|---|---|---|---|---|",
    ]
    for arch, source in sources.items():
        r = results.get(arch)
        if r is None:
            lines.append(f"| {arch} | {source} | not tried yet | | | | |")
            continue
        if r["status"] in ("not served", "not built", "failed"):
            lines.append(f"| {arch} | {source} | {r['status']} | | | | {_cell(r['why'])} |")
            continue
        outcome = "verified" if r["status"] == "verified" else (
            f"verified: {', '.join(r['verified']) or 'none'}; errors " +
            ", ".join(f"{k} {v:.2g}" for k, v in r["errors"].items()))
        why = "; ".join([f"{k}: {v}" for k, v in r["withdrawn"].items()] + list(r["refused"].values()))
        lines.append(f"| {arch} | {source} | {outcome} | {_cell(r['family'])} | {', '.join(r['offered'])} | "
                     f"{', '.join(r['read_only'])} | {_cell(why)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--table-only", action="store_true", help="rewrite docs/coverage.md from the cache")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(check(args.child)), flush=True)
        return 0
    sources = architectures()
    key = sources_key()
    CACHE.mkdir(exist_ok=True)
    results = {}
    for arch in sorted(sources, key=lambda a: sources[a] != "native"):  # vLLM's own first
        cached = CACHE / f"{arch}.json"
        if cached.exists() and json.loads(cached.read_text()).get("key") == key:
            results[arch] = json.loads(cached.read_text())
        elif not args.table_only and (args.only is None or arch in args.only):
            results[arch] = {**run_one(arch, args.timeout), "key": key}
            cached.write_text(json.dumps(results[arch]))
            print(f"{arch}: {results[arch]['status']} ({results[arch]['seconds']} s) "
                  f"{results[arch].get('why', '')[:120]}", flush=True)
        (ROOT / "docs" / "coverage.md").write_text(write_table(results, sources))
    return 0


if __name__ == "__main__":
    sys.exit(main())
