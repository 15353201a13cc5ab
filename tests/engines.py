"""Helpers for tests that drive a real vLLM engine through the plugin's RPC methods."""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

import hf_reference
from inspector.core.attention import attention_weights
from inspector.core.hooks import HookPoint, installed_name
from inspector.engine.boot import boot_llm, shutdown_llm


# Parity tolerance (relative L2 per token): float32 on CPU reaches ~5e-7; CUDA kernels differ more.
PARITY_TOL = float(os.environ.get("INSPECTOR_PARITY_TOL", "1e-5"))
PATTERN_TOL = 1e-5  # attention weights: max absolute difference (the bound)
QK = ("blocks.*.attn.hook_q", "blocks.*.attn.hook_k")
# Extra engine arguments for the machine the tests run on (e.g. gpu_memory_utilization on a GPU).
ENGINE_ARGS = json.loads(os.environ.get("INSPECTOR_TEST_ENGINE_ARGS", "{}"))


@contextlib.contextmanager
def booted(model_dir, **kwargs):
    llm = boot_llm(str(model_dir), **{"max_num_batched_tokens": 64, "max_model_len": 256, **ENGINE_ARGS, **kwargs})
    try:
        yield llm
    finally:
        shutdown_llm(llm)


def rpc(llm, method, *args):
    return llm.collective_rpc(method, args=args)[0]


def generate(llm, prompts, max_tokens=6, request_ids=None):
    """Greedy tokens and drained captures: ({rid: (prompt ids, generated ids)}, {rid: {hook: rows}}).

    Drives the engine step by step with explicit request ids, as the engine session does."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    rpc(llm, "inspector_drain")  # start clean
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = request_ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = (list(out.prompt_token_ids), list(out.outputs[0].token_ids))
    return tokens, {rid: drained.rows for rid, drained in rpc(llm, "inspector_drain").items()}


def rel_l2(a, b):
    """Relative L2 error per row."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.maximum(np.linalg.norm(b, axis=-1), 1e-30)


def assert_greedy_matches(ref_logits, prompt_len, gen_ids):
    """Each generated token is the reference's argmax, unless the two are tied within the parity
    tolerance (random tiny models have near-ties that different kernels may break either way)."""
    for k, token in enumerate(gen_ids):
        row = np.asarray(ref_logits[prompt_len - 1 + k], np.float64)
        best = int(row.argmax())
        assert token == best or row[best] - row[token] <= PARITY_TOL * np.abs(row).max(), (
            f"generated token {k}: {token}, reference argmax {best} (logit gap {row[best] - row[token]:.3g})")


def assert_lens_matches(top_ids, top_logprobs, ref_logprobs):
    """A lens's top tokens are the reference's (order may swap within the parity tolerance: near-ties
    of random tiny models), with the reference's logprobs."""
    ref = np.asarray(ref_logprobs, np.float64)
    np.testing.assert_allclose(top_logprobs, -np.sort(-ref, axis=1)[:, :top_ids.shape[1]], rtol=PARITY_TOL)
    np.testing.assert_allclose(np.take_along_axis(ref, top_ids, 1), top_logprobs, rtol=PARITY_TOL)


def assert_attribution_matches(top_ids, top_logits, reference):
    """An attribution's top tokens are the reference's (ties may swap), with the reference's logits."""
    ref = np.asarray(reference, np.float64)
    tol = PARITY_TOL * np.abs(ref).max()
    np.testing.assert_allclose(top_logits, -np.sort(-ref, axis=1)[:, :top_ids.shape[1]], atol=tol, rtol=0)
    np.testing.assert_allclose(np.take_along_axis(ref, top_ids, 1), top_logits, atol=tol, rtol=0)


def captured_patterns(llm, prompts, max_tokens=6):
    """Per request: (its token ids, every layer's recomputed weights [heads, T, T]) and the catalogue."""
    points = {p["name"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, prompts, max_tokens=max_tokens)
    patterns = {}
    for rid, (prompt_ids, gen_ids) in tokens.items():
        rows = {points[name].alias: r for name, r in caps[rid].items()}
        layers = sorted({p.layer for p in points.values() if p.kind == "q"})
        per_layer = []
        for layer in layers:
            q, k = rows[f"blocks.{layer}.attn.hook_q"], rows[f"blocks.{layer}.attn.hook_k"]
            geometry = next(p.attention for p in points.values() if p.kind == "q" and p.layer == layer)
            per_layer.append(attention_weights(q["values"], q["positions"], k["values"], k["positions"], geometry))
        patterns[rid] = ((prompt_ids + gen_ids)[:-1], per_layer)
    return patterns, points


def assert_patterns_match_transformers(model_dir, patterns, reference_of=None):
    """Every head of every layer against transformers' eager attention on the same tokens
    (``reference_of(function, *args)``: where hf_reference's functions run, this process by default)."""
    reference_of = reference_of or (lambda function, *args: getattr(hf_reference, function)(*args))
    for seq, per_layer in patterns.values():
        reference = reference_of("attention_patterns", model_dir, seq)
        assert len(per_layer) == len(reference)
        for got, expected in zip(per_layer, reference):
            assert got.shape == expected.shape == (expected.shape[0], len(seq), len(seq))
            np.testing.assert_allclose(got, expected, atol=PATTERN_TOL, rtol=0)


def assert_steering_matches_transformers(llm, model_dir, prompt, reference_of=None):
    """A seeded random bias at ``blocks.0.hook_resid_post``: the last block's resid_post and the greedy
    tokens equal transformers' forward with the same bias added to block 0's output by a forward hook
    (``reference_of`` as in ``assert_patterns_match_transformers``)."""
    reference_of = reference_of or (lambda function, *args: getattr(hf_reference, function)(*args))
    points = {p["alias"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
    target = points["blocks.0.hook_resid_post"]
    vector = np.random.default_rng(0).standard_normal(target.width).astype(np.float32)
    rpc(llm, "inspector_set_interventions", [{"hook": target.name, "bias": vector.tolist()}])
    try:
        tokens, caps = generate(llm, [prompt], max_tokens=4)
    finally:
        rpc(llm, "inspector_clear_interventions")
    (rid, (prompt_ids, gen_ids)), = tokens.items()
    expected = reference_of("steered", model_dir, (prompt_ids + gen_ids)[:-1], 0, vector)
    last = max(p.layer for p in points.values())
    got = caps[rid][points[f"blocks.{last}.hook_resid_post"].name]["values"]
    assert rel_l2(got, expected["resid_post"][last]).max() < PARITY_TOL
    assert_greedy_matches(expected["logits"], len(prompt_ids), gen_ids)


def session_on(llm, model_dir, **options):
    """An engine session over an engine a fixture booted (and will shut down): the session-level
    experiments on it without another boot. Do not close it."""
    from pathlib import Path

    from inspector.core.protocol import SessionOptions
    from inspector.engine.opening import describe_engine
    from inspector.engine.session import Session

    options = SessionOptions(model=str(model_dir), max_model_len=256, max_num_batched_tokens=64, **options)
    return Session(options, llm, Path(model_dir), *describe_engine(llm))


PATCH_PROMPTS = [("The cat sat on the mat", "The dog sat on the mat"), ("x = 1\ny = x", "x = 2\ny = x"),
                 ("def f(a, b):", "def g(a, b):"), ("one two three", "one two four")]
PATCH_TOL = 1e-4  # absolute difference of a patched run's metric (the bound)


def same_length_prompts(session) -> tuple[str, str]:
    """A clean/corrupted pair this model's tokenizer splits into as many tokens."""
    for clean, corrupted in PATCH_PROMPTS:
        if len(session.tokenize(clean)) == len(session.tokenize(corrupted)):
            return clean, corrupted
    raise AssertionError("no prompt pair of equal token length for this tokenizer")


def assert_sweep_matches_transformers(result, points, model_dir, arch, reference=None):
    """Every cell's metric, and both ends, against transformers patching one cell at a time with
    forward hooks, its own clean/corrupted activations patched in. ``points``: name -> HookPoint."""
    call = reference or (lambda function, *args: getattr(hf_reference, function)(*args))
    source, target = ("clean", "corrupted") if result.spec.direction == "denoise" else ("corrupted", "clean")
    acts = call("block_points", model_dir, arch, result.token_ids[source])
    cells = [(points[hook].layer, points[hook].kind) for hook in result.hooks]
    patches = [(layer, kind, int(p), acts[layer, kind][p]) for layer, kind in cells for p in result.positions]
    ids = list(result.spec.metric.token_ids)
    got = call("patched_logprobs", model_dir, arch, result.token_ids[target], patches, ids)
    expected = np.array([result.spec.metric.of(g) for g in got]).reshape(result.raw.shape)
    np.testing.assert_allclose(result.raw, expected, atol=PATCH_TOL, rtol=0)
    for name in ("clean", "corrupted"):
        plain, = call("patched_logprobs", model_dir, arch, result.token_ids[name], [None], ids)
        assert abs(getattr(result, f"{name}_metric") - result.spec.metric.of(plain)) < PATCH_TOL


def assert_windows_keep_exactly_their_rows(session, prompts, hooks, windows=("generated", "last:3", "every:2"),
                                           sampling=None):
    """Each window on ``hooks`` (the session's other hooks capture all) keeps exactly the rows of the same
    run with every window "all" at the positions ``CaptureWindow.keeps`` promises, bit for bit."""
    from inspector.core.protocol import Sampling
    from inspector.core.windows import CaptureWindow

    sampling = sampling or Sampling(max_tokens=4, ignore_eos=True)

    def run_with(given):
        session.set_windows(given)
        session.new_run()
        for _ in session.generate(prompts, sampling):
            pass
        return list(session.run.requests.values())

    names = {installed_name(h, session.installed) for h in hooks}
    base = run_with({})
    assert len({len(r.prompt_token_ids) for r in base}) > 1, "the prompts must differ in length"
    for text in windows:
        window = CaptureWindow.parse(text)
        requests = run_with({hook: window for hook in hooks})
        for got, want in zip(requests, base):
            assert got.generated_token_ids == want.generated_token_ids
            assert got.windows == dict.fromkeys(names, text)
            for hook, rows in want.hooks.items():
                keep = (window.keeps(rows.positions, len(want.prompt_token_ids)) if hook in names
                        else np.ones(len(rows), dtype=bool))
                kept = got.hooks[hook]
                np.testing.assert_array_equal(kept.positions, rows.positions[keep], err_msg=f"{text} {hook}")
                np.testing.assert_array_equal(kept.token_ids, rows.token_ids[keep], err_msg=f"{text} {hook}")
                np.testing.assert_array_equal(kept.values, rows.values[keep], err_msg=f"{text} {hook}")
    session.set_windows({})


def assert_window_change_applies_between_forwards(session, prompt, hook):
    """A window given while a request runs applies from a later forward on, and the run records it."""
    from inspector.core.protocol import Sampling
    from inspector.core.windows import CaptureWindow

    session.set_windows({})
    session.new_run()
    events = session.generate([prompt], Sampling(max_tokens=8, ignore_eos=True))
    next(events)  # the prefill
    session.set_windows({hook: CaptureWindow.parse("every:3")})
    for _ in events:
        pass
    request = next(iter(session.run.requests.values()))
    positions = request.hooks[installed_name(hook, session.installed)].positions
    prompt_len, total = len(request.prompt_token_ids), len(request.token_ids)
    assert positions[:prompt_len].tolist() == list(range(prompt_len))  # before the change: all
    late = positions[positions >= prompt_len + 2]  # a forward already queued may still capture all
    assert len(late) and (late % 3 == 0).all() and set(range(prompt_len + 2, total - 1)) - set(late.tolist())
    assert request.windows == {installed_name(hook, session.installed): "every:3"}
    session.set_windows({})


def assert_greedy_generation_caches_as_a_prefill(ins, model_dir, prompts, generated, new_tokens: int):
    """A notebook ``Inspector``'s greedy ``generate_with_cache``: each prompt's tokens then transformers'
    argmax continuation, and the cache's rows equal to a prefill of the same tokens."""
    import hf_reference

    text, tokens, cache = generated
    for i, prompt in enumerate(prompts):
        prompt_ids = ins.to_tokens(prompt)[0].tolist()
        ids = tokens[i, :len(prompt_ids) + new_tokens].tolist()
        assert ids[:len(prompt_ids)] == prompt_ids and text[i] == ins.to_string(ids[len(prompt_ids):])
        logits = hf_reference.logits(model_dir, ids[:-1])
        assert logits[len(prompt_ids) - 1:].argmax(-1).tolist() == ids[len(prompt_ids):]
        assert cache.attention_mask[i].tolist() == [1] * (len(ids) - 1) + [0] * (tokens.shape[1] - len(ids) + 1)
        _, prefilled = ins.run_with_cache([ids[:-1]], names_filter="*resid_post", return_type=None)
        assert rel_l2(cache["resid_post", 1][i, :len(ids) - 1].numpy(),
                      prefilled["resid_post", 1][0].numpy()).max() < PARITY_TOL
