"""The coverage table (docs/coverage.md): what the inspector offers on every architecture vLLM serves.

    .venv/bin/python tools/coverage.py [--only ARCH ...] [--flavours eager,compiled] [--jobs 1]
                                       [--timeout 600] [--limit N] [--table]

Rows: every architecture of vLLM's text-generation registry, and every decoder-only causal LM of
transformers that vLLM serves through its Transformers backend (encoder and encoder-decoder types are
listed as skipped). Each gets a tiny random model (the rule: ``coverage_models.py``), then, in child
processes (a crash or a hang is a reason in the table, not the end of the run):

1. vLLM boots it with the plugin and every hook point (``hook_patterns=("*",)``), per flavour
   (eager, then compiled): the block family, the hook points and the refusals come from
   ``inspector_describe``; two prompts generate 4 greedy tokens each, plain and with a seeded random
   bias at ``blocks.0.hook_resid_post``. A boot that fails is retried without the plugin, which tells
   vLLM's own failures from the inspector's.
2. transformers loads the same directory (float32, eager attention) and runs the same token
   sequences with forward hooks on its decoder-layer list: resid_pre(i) is layer i's input,
   resid_post(i) its output, and the steered run adds the same bias to layer 0's output.
3. resid_pre and resid_post of every layer must agree within a relative L2 of 1e-5 per row, the greedy
   tokens must be transformers' (an exact near-tie may go either way), and the steered run's last
   resid_post and tokens must agree likewise.

Results are cached per architecture in tools/.coverage-cache, keyed by the plugin's sources and the
tiny-model rule. A run checks what has no result yet and flavours not yet run; ``--stale`` also reruns
the results of other sources (the table counts and marks them); ``--table`` only rewrites
docs/coverage.md from the cache.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
CACHE = TOOLS / ".coverage-cache"
TABLE = ROOT / "docs" / "coverage.md"
PROMPTS = ("def fibonacci(n):\n    if n < 2:", "import os\nimport sys\n\nclass")
MAX_TOKENS = 4
TOLERANCE = 1e-5  # relative L2 per row; float32 on CPU reaches ~5e-7
LOGPROB_TOLERANCE = 1e-4  # vLLM's own logprobs against transformers' (float32; softmax of the logits)
CHECKED = ("resid_pre", "resid_post", "steering")
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1",
              "OMP_NUM_THREADS": str(os.cpu_count())}
# a kernel vLLM's CPU build lacks: a custom op missing from torch.ops._C, or an error that says CPU lacks it
NO_CPU_KERNEL = re.compile(r"_OpNamespace|'CPU' backend|NotImplementedError|"
                           r"\bcpu\b.*(not (yet )?(supported|implemented)|unsupported)|"
                           r"(not (yet )?(supported|implemented)|unsupported).*\bcpu\b", re.I)

sys.path.insert(0, str(TOOLS))
import coverage_models  # noqa: E402 - beside this script, not a package


# --- in the engine's child process ---

def engine_run(model_dir: str, flavours: list[str], engine_args: dict) -> dict:
    """Per flavour, what the plugin offers and the rows it captured, or why it did not boot or run;
    ``bias``: the steering vector all flavours used."""
    from inspector.engine.boot import boot_llm, shutdown_llm

    found, bias = {}, None
    for flavour in flavours:
        started = time.perf_counter()
        try:
            llm = boot_llm(model_dir, hook_patterns=("*",), mode=flavour, max_num_batched_tokens=64,
                           max_model_len=256, enable_position_interventions=True, **engine_args)
        except Exception as e:  # noqa: BLE001 - any failure is the row's reason
            found[flavour] = {"boot_error": _why(e)}
            break  # the next flavour would fail the same way, slower
        try:
            found[flavour], bias = _exercise(llm, bias)
        except Exception as e:  # noqa: BLE001
            found[flavour] = {"run_error": _why(e)}
        finally:
            shutdown_llm(llm)
        found[flavour]["seconds"] = round(time.perf_counter() - started, 1)
    return {"flavours": found, "bias": bias}


def _exercise(llm, bias):
    describe = _rpc(llm, "inspector_describe")
    points = [{k: p.get(k) for k in ("name", "alias", "kind", "layer", "width", "withdrawn", "unsteerable")}
              for p in describe["hook_points"]]
    found = {"family": describe.get("family", ""), "points": points, "refused": describe.get("refused", {}),
             "plain": _generate(llm, points)}
    target = next((p for p in points if p["kind"] == "resid_post" and p["layer"] == 0), None)
    why_not = ("no blocks.0.hook_resid_post" if target is None else
               f"withdrawn: {target['withdrawn']}" if target["withdrawn"] else
               f"read only: {target['unsteerable']}" if target["unsteerable"] else "")
    if why_not:
        found["steering_refused"] = why_not
        return found, bias
    if bias is None:
        bias = np.random.default_rng(0).standard_normal(target["width"]).astype(np.float32).tolist()
    _rpc(llm, "inspector_set_interventions", [{"hook": target["name"], "bias": bias}])
    try:
        found["steered"] = _generate(llm, points)
    finally:
        _rpc(llm, "inspector_clear_interventions")
    return found, bias


def _rpc(llm, method, *args):
    return llm.collective_rpc(method, args=args)[0]


def _generate(llm, points: list[dict]) -> dict:
    """Per request: prompt ids, generated ids, vLLM's logprob of each, and the resid_pre/resid_post rows
    ({alias: [tokens, width]}, in position order), driven step by step as the engine session does."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    _rpc(llm, "inspector_drain")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated = list(out.outputs[0].token_ids)
                logprobs = [step[token].logprob for step, token in zip(out.outputs[0].logprobs, generated)]
                tokens[out.request_id] = (list(out.prompt_token_ids), generated, logprobs)
    rows = {rid: drained.rows for rid, drained in _rpc(llm, "inspector_drain").items()}
    aliases = {p["name"]: p["alias"] for p in points if p["kind"] in ("resid_pre", "resid_post")}
    return {rid: {"prompt": prompt, "generated": generated, "logprobs": logprobs,
                  "rows": {aliases[name]: np.asarray(r["values"], np.float32)[np.argsort(r["positions"])]
                           for name, r in rows.get(rid, {}).items() if name in aliases}}
            for rid, (prompt, generated, logprobs) in tokens.items()}


def plain_boot(model_dir: str, engine_args: dict) -> str:
    """vLLM alone (the plugin not loaded): "" if it boots and generates, else why not."""
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256, max_num_batched_tokens=64,
                  enable_prefix_caching=False, **engine_args)
        llm.generate(list(PROMPTS), SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    except Exception as e:  # noqa: BLE001
        return _why(e)
    return ""


def _why(error: BaseException) -> str:
    """An exception in one line; where it says nothing (a bare assert), where it was raised."""
    from inspector.engine.opening import where_raised

    text = coverage_models.one_line(error)
    while error.__cause__ is not None:
        error = error.__cause__
    return text + where_raised(error)


# --- in the driver ---

def check(arch: str, source: str, flavours: list[str], timeout: int, earlier: dict | None) -> dict:
    """One architecture end to end; ``earlier``: its cached result, whose flavours are kept. A model
    for the Transformers backend is booted with ``model_impl="transformers"``: vLLM would choose the
    backend by itself for an architecture it does not register, but where transformers' class is not
    compatible with it, only the forced choice says so (instead of "not supported")."""
    started = time.perf_counter()
    engine_args = {"model_impl": "transformers"} if source == "backend" else {}
    result = dict(earlier or {})
    built = _in_child("coverage_models.build", (arch,), timeout)
    if "why" in built:
        return {"outcome": "not built", "why": built["why"], "seconds": _since(started)}
    result.update(layers=built["layers"], note=built["note"])
    todo = [f for f in flavours if f not in result.get("flavours", {})]
    ran = _in_child("engine_run", (built["model_dir"], todo, engine_args), timeout)
    runs = ran.get("flavours") or {todo[0]: {"boot_error": ran.get("why", "?")}}
    if any("boot_error" in r or "run_error" in r for r in runs.values()):
        alone = _in_child("plain_boot", (built["model_dir"], engine_args), timeout, {"VLLM_PLUGINS": ""})
        alone = alone if isinstance(alone, str) else alone["why"]
        if alone:
            kind = "no CPU kernel" if NO_CPU_KERNEL.search(alone) else "vLLM cannot serve it on CPU"
            return {"outcome": "not served", "why": f"{kind}: {alone}", "seconds": _since(started)}
    sequences = sorted({tuple(r["prompt"] + r["generated"][:-1]) for run in runs.values()
                        for side in ("plain", "steered") for r in run.get(side, {}).values()})
    reference = {}
    if sequences:
        answer = _in_child("coverage_models.reference", (built["model_dir"], [list(s) for s in sequences],
                                                         ran["bias"] or [0.0]), timeout)
        if "why" in answer:
            return {**result, "outcome": "check failed", "why": f"transformers' reference: {answer['why']}",
                    "seconds": _since(started)}
        reference = dict(zip(sequences, answer["sequences"]))
    result["flavours"] = {**result.get("flavours", {}),
                          **{flavour: verdict(run, reference) for flavour, run in runs.items()}}
    result.update(outcome=_outcome(result["flavours"]), seconds=_since(started) + (earlier or {}).get("seconds", 0))
    return result


def verdict(run: dict, reference: dict) -> dict:
    """What one flavour's run shows against transformers' reference."""
    if "boot_error" in run or "run_error" in run:
        return {"error": f"the inspector could not {'boot' if 'boot_error' in run else 'run'} it: "
                         f"{run.get('boot_error') or run.get('run_error')}", "seconds": run.get("seconds")}
    points = run["points"]
    plain, steered = run["plain"].values(), run.get("steered", {}).values()
    greedy = all(_greedy(reference[_sequence(r)]["logits"], r) for r in plain)
    errors, why = {}, {}
    withdrawn = {kind: sorted(p["alias"] for p in points if p["kind"] == kind and p["withdrawn"])
                 for kind in ("resid_pre", "resid_post")}
    if any(withdrawn.values()):
        why.update({kind: f"withdrawn at {', '.join(aliases)}" for kind, aliases in withdrawn.items() if aliases})
    else:
        errors.update(_stream_errors(plain, reference, why))
    if steered:
        last = max(p["layer"] for p in points if p["kind"] == "resid_post")
        errors["steering"] = max(_rel_l2(r["rows"].get(f"blocks.{last}.hook_resid_post"),
                                         reference[_sequence(r)]["steered_resid_post"]) for r in steered)
        steered_greedy = all(_greedy(reference[_sequence(r)]["steered_logits"], r) for r in steered)
    else:
        why["steering"], steered_greedy = run["steering_refused"], False
    for kind in CHECKED:
        tokens_agree = steered_greedy if kind == "steering" else greedy
        if kind in errors and (errors[kind] >= TOLERANCE or not tokens_agree):
            why[kind] = f"relative L2 {errors[kind]:.1e}{why.get(kind, '')}" + (
                "" if tokens_agree else ", greedy tokens differ")
    return {"family": run["family"], "verified": [k for k in CHECKED if k in errors and k not in why],
            "errors": errors, "not_verified": why, "logprob_error": max(_logprob_error(r, reference) for r in plain),
            "offered": sorted({p["kind"] for p in points if not p["withdrawn"]}),
            "read_only": _by_kind([p for p in points if not p["withdrawn"]], "unsteerable"),
            "withdrawn": _by_kind(points, "withdrawn"),
            "refused": run["refused"], "layers": 1 + max((p["layer"] for p in points), default=-1),
            "seconds": run.get("seconds")}


def _stream_errors(requests, reference: dict, why: dict) -> dict[str, float]:
    """The largest relative L2 of resid_pre and resid_post over every block and row; where it is above
    the tolerance, ``why`` gets the first point (in stream order) that is."""
    errors, first = {}, None
    for request in requests:
        expected, rows = reference[_sequence(request)], request["rows"]
        layers = len(expected["resid_pre"])
        if {f"blocks.{i}.hook_{k}" for i in range(layers) for k in ("resid_pre", "resid_post")} != set(rows):
            engine_layers = len(rows) // 2
            why.update(dict.fromkeys(("resid_pre", "resid_post"),
                                     f" (vLLM's blocks: {engine_layers}, transformers' layers: {layers})"))
            return {"resid_pre": float("inf"), "resid_post": float("inf")}
        for i in range(layers):
            for kind in ("resid_pre", "resid_post"):
                error = _rel_l2(rows[f"blocks.{i}.hook_{kind}"], expected[kind][i])
                errors[kind] = max(errors.get(kind, 0.0), error)
                if error >= TOLERANCE and (first is None or (i, kind == "resid_post") < first[:2]):
                    first = (i, kind == "resid_post", kind)
    for kind, error in errors.items():
        if error >= TOLERANCE:
            why[kind] = f" (first above the tolerance: blocks.{first[0]}.hook_{first[2]})"
    return errors


def _by_kind(points: list[dict], field: str) -> dict[str, str]:
    """{kind: why} for the points whose ``field`` says why, with the blocks that say it."""
    reasons: dict[str, dict[str, list]] = {}
    for p in points:
        if p[field]:
            reasons.setdefault(p["kind"], {}).setdefault(p[field], []).append(p["layer"])
    return {kind: "; ".join(f"{why} (blocks {', '.join(map(str, layers))})" if layers != [-1] else why
                            for why, layers in found.items())
            for kind, found in reasons.items()}


def _sequence(request: dict) -> tuple:
    return tuple(request["prompt"] + request["generated"][:-1])


def _rel_l2(got, expected) -> float:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    if got.shape != expected.shape:
        return float("inf")
    return float((np.linalg.norm(got - expected, axis=-1) / np.maximum(np.linalg.norm(expected, axis=-1), 1e-30)).max())


def _logprob_error(request: dict, reference: dict) -> float:
    """How far vLLM's own logprobs of its tokens are from transformers' (no hook involved): where the
    stream differs and these do too, the model computes differently, not only the capture."""
    logits = np.asarray(reference[_sequence(request)]["logits"], np.float64)
    start = len(request["prompt"]) - 1
    rows = logits[start:start + len(request["generated"])]
    expected = rows[np.arange(len(rows)), request["generated"]] - np.log(np.exp(rows - rows.max(-1, keepdims=True))
                                                                          .sum(-1)) - rows.max(-1)
    return float(np.abs(np.asarray(request["logprobs"]) - expected).max())


def _greedy(logits: np.ndarray, request: dict) -> bool:
    """Each generated token is transformers' argmax, or tied with it within the tolerance."""
    start = len(request["prompt"]) - 1
    for k, token in enumerate(request["generated"]):
        row = np.asarray(logits[start + k], np.float64)
        if row[row.argmax()] - row[token] > TOLERANCE * np.abs(row).max():
            return False
    return True


def _outcome(flavours: dict) -> str:
    if all("error" in v for v in flavours.values()):
        return "inspector failed"
    return "verified" if all(set(CHECKED) <= set(v.get("verified", ())) for v in flavours.values()) else "not verified"


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 1)


def _in_child(function: str, args: tuple, timeout: int, env: dict | None = None):
    """``function(*args)`` in a fresh Python (this module's or ``module.function``); {"why": ...} when
    it raises, crashes or outlives ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="coverage-") as tmp:
        call = Path(tmp) / "call.pickle"
        call.write_bytes(pickle.dumps((function, args)))
        try:
            done = subprocess.run([sys.executable, __file__, "--child", str(call)], capture_output=True, text=True,
                                  timeout=timeout, env={**os.environ, **ENGINE_ENV, **(env or {})}, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"why": f"no answer within {timeout} s"}
        answer = call.with_suffix(".answer")
        if answer.exists():
            return pickle.loads(answer.read_bytes())
        return {"why": f"crashed (exit {done.returncode}): {_last_error(done.stderr)}"}


def _last_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"Error|error:|Aborted|Killed|Segmentation", line)]
    return ((errors or lines or ["no output"])[-1])[:300]


def _child(call: Path) -> None:
    function, args = pickle.loads(call.read_bytes())
    module, _, name = function.rpartition(".")
    target = getattr(importlib.import_module(module) if module else sys.modules[__name__], name)
    try:
        answer = target(*args)
    except Exception as e:  # noqa: BLE001 - the driver reports it as the row's reason
        answer = {"why": coverage_models.one_line(e)}
    call.with_suffix(".answer").write_bytes(pickle.dumps(answer))


def sources_key() -> str:
    """What a cached result depends on: the code of the plugin and of the tiny-model rule.

    Hashed as syntax trees, so that a comment or a line break does not make every row stale."""
    sources = sorted((ROOT / "inspector" / "plugin").glob("*.py")) + [TOOLS / "coverage_models.py"]
    trees = (ast.dump(ast.parse(p.read_text())) for p in sources)
    return hashlib.sha256("".join(trees).encode()).hexdigest()[:12]


def cached(arch: str) -> dict | None:
    """The architecture's result, whichever sources' (its ``key``)."""
    path = next(CACHE.glob(f"{arch}-*.json"), None)
    return {**json.loads(path.read_text()), "key": path.stem.rsplit("-", 1)[1]} if path else None


def store(arch: str, key: str, result: dict) -> None:
    CACHE.mkdir(exist_ok=True)
    for old in CACHE.glob(f"{arch}-*.json"):
        old.unlink()
    (CACHE / f"{arch}-{key}.json").write_text(json.dumps({k: v for k, v in result.items() if k != "key"}, indent=1))
    result["key"] = key


# --- the table ---

def write_table(sources: dict[str, str], results: dict[str, dict], key: str) -> None:
    import torch
    import transformers
    import vllm

    tried = {a: r for a, r in results.items() if a in sources}
    native = [a for a, s in sources.items() if s == "native"]
    by = {o: [a for a, r in tried.items() if r["outcome"] == o] for o in
          ("verified", "not verified", "inspector failed", "check failed", "not served", "not built")}
    served = len(by["verified"]) + len(by["not verified"]) + len(by["inspector failed"]) + len(by["check failed"])
    flavours = sorted({f for r in tried.values() for f in r.get("flavours", {})})
    stale = sum(r["key"] != key for r in tried.values())
    differ = [a for a in by["not verified"] if any(v.get("logprob_error", 0) > LOGPROB_TOLERANCE
                                                   for v in tried[a]["flavours"].values())]
    lines = [
        "# Coverage: the inspector on every architecture vLLM serves",
        "",
        f"Generated by `tools/coverage.py` on {time.strftime('%Y-%m-%d')}: vLLM {vllm.__version__} (CPU), "
        f"transformers {transformers.__version__}, torch {torch.__version__}; flavours: {', '.join(flavours) or 'none'}; "
        "float32. Each architecture is a tiny random model built by one rule (`tools/coverage_models.py`): "
        "transformers' config defaults shrunk to hidden 128, heads of 64, 4 experts (2 a token), windows of 4 "
        "tokens, and as many layers as two periods of its layer-type pattern (with any irregular start and end); "
        "norms, biases and sinks randomised.",
        "",
        f"- **resid_pre, resid_post and steering verified against transformers: {len(by['verified'])} of the "
        f"{served} architectures vLLM serves on CPU and transformers can build** ({len(by['verified'])} of the "
        f"{served - len(differ)} whose vLLM implementation computes what transformers' does: on {len(differ)}, vLLM's "
        "own logprobs differ from transformers' with no edit made, so no reading can match); "
        f"{sum(a in native for a in by['verified'])} of the {len(native)} text-generation architectures of vLLM's "
        "registry.",
        f"- Of {len(sources)} rows: verified {len(by['verified'])}, served but not all verified "
        f"{len(by['not verified'])}, the inspector could not boot or run {len(by['inspector failed'])}, the check "
        f"itself failed {len(by['check failed'])}, vLLM cannot serve on CPU {len(by['not served'])}, transformers "
        f"cannot build {len(by['not built'])}, skipped {sum(s.startswith('skipped') for s in sources.values())}, "
        f"not tried yet {len(sources) - len(tried) - sum(s.startswith('skipped') for s in sources.values())}.",
        f"- Checked with the plugin sources and tiny-model rule of this table ({key}): "
        f"{len(tried) - stale} rows; with earlier ones: {stale} (marked *earlier*; `--stale` reruns them).",
        "",
        "Legend. *verified*: resid_pre and resid_post of every block within a relative L2 of 1e-5 per row of "
        "transformers' decoder-layer inputs and outputs, with its greedy tokens; *steering*: a random bias at "
        "blocks.0.hook_resid_post equals the same bias added to transformers' layer 0 output (last block's "
        "resid_post and greedy tokens). The other kinds offered (attn_out, mlp_out, resid_mid, z, mlp_post, q, k, "
        "router, ...) are *probe-verified*: the plugin's boot probe checks on every boot that they tie together "
        "with the stream as TransformerLens defines them (and round-trips a steering edit); there is no generic "
        "transformers definition of them to check against here (tests/test_families.py checks them per family). "
        "*read only*: reads right, but an edit there would not act on the stream. Source: *native* = vLLM's own "
        "implementation, *backend* = vLLM's Transformers backend.",
        "",
        "| architecture | source | outcome | blocks | verified | offered (probe-verified) | read only, withdrawn, "
        "refused or why not | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for arch, source in sources.items():
        lines.append(_row(arch, source, tried.get(arch), key))
    TABLE.write_text("\n".join(lines) + "\n")


def _row(arch: str, source: str, r: dict | None, key: str) -> str:
    if source.startswith("skipped"):
        return f"| {arch} | | skipped | | | | {source.removeprefix('skipped: ')} | |"
    if r is None:
        return f"| {arch} | {source} | not tried yet | | | | | |"
    outcome = r["outcome"] + (f" (*earlier*: {r['key']})" if r["key"] != key else "")
    if "why" in r:
        return f"| {arch} | {source} | {outcome} | | | | {_cell(r['why'])} | {r['seconds']:.0f} |"
    families, verified, offered, why = set(), [], set(), []
    for flavour, v in r["flavours"].items():
        if "error" in v:
            why.append(f"{flavour}: {v['error']}")
            continue
        families.add(v["family"])
        verified.append(f"{flavour}: {', '.join(v['verified']) or 'none'}")
        offered |= set(v["offered"]) - set(v["read_only"])
        why += [f"{flavour} {kind} not verified: {text}" for kind, text in v["not_verified"].items()]
        if v["not_verified"] and v["logprob_error"] > LOGPROB_TOLERANCE:
            why.append(f"{flavour}: vLLM's own logprobs differ from transformers' by {v['logprob_error']:.1e} "
                       "(its model computes differently, hooks aside)")
        why += [f"read only {k}: {t}" for k, t in v["read_only"].items()]
        why += [f"withdrawn {k}: {t}" for k, t in v["withdrawn"].items()]
        why += [f"refused: {t}" for t in v["refused"].values()]
    if r.get("note"):
        why.append(f"tiny model: {r['note']}")
    return (f"| {arch} | {source} | {outcome} | {_cell('; '.join(sorted(families)))} | {'; '.join(verified)} | "
            f"{', '.join(sorted(offered))} | {_cell('; '.join(dict.fromkeys(why)))} | {r['seconds']:.0f} |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="ARCH", help="these architectures only")
    parser.add_argument("--flavours", default="eager,compiled", help="engine flavours, in boot order")
    parser.add_argument("--jobs", type=int, default=1, help="architectures at once (each engine uses every core)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a child process may take")
    parser.add_argument("--limit", type=int, help="at most this many architectures not cached yet")
    parser.add_argument("--stale", action="store_true", help="also rerun results of other plugin sources or rules")
    parser.add_argument("--table", action="store_true", help="only rewrite docs/coverage.md from the cache")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return 0
    sources = coverage_models.architectures()
    unknown = set(args.only or ()) - set(sources)
    if unknown:
        parser.error(f"unknown architecture(s): {', '.join(sorted(unknown))}")
    key, flavours = sources_key(), args.flavours.split(",")
    results = {a: r for a in sources if (r := cached(a))}

    def due(arch: str) -> bool:
        r = results.get(arch)
        return (r is None or args.stale and r["key"] != key
                or "flavours" in r and bool(set(flavours) - set(r["flavours"])))

    todo = [a for a, s in sources.items() if not s.startswith("skipped") and (not args.only or a in args.only) and due(a)]
    todo = [] if args.table else todo[:args.limit]
    lock = threading.Lock()

    def one(arch: str) -> None:
        earlier = results.get(arch)
        result = check(arch, sources[arch], flavours, args.timeout, earlier if earlier and earlier["key"] == key else None)
        with lock:
            results[arch] = result
            store(arch, key, result)
            write_table(sources, results, key)
            print(f"{arch}: {result['outcome']} in {result['seconds']:.0f} s {result.get('why', '')[:150]}", flush=True)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, todo))
    write_table(sources, results, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
