"""Every block family's hook points mean what TransformerLens means (inspector/plugin/reader.py).

One engine per family (a tiny model each), every hook point installed: the identities that tie the
points together hold, each kind equals transformers' modules read with forward hooks on the same
definitions, greedy tokens agree, and attention patterns recomputed from the captured queries and keys
equal transformers' eager attention. By default one family per structural variant the reader handles
(``SAMPLE``); ``INSPECTOR_TEST_EVERY_FAMILY=1`` runs every family below, compiled, both patching
directions (docs/coverage.md checks every architecture vLLM serves, with tools/coverage.py). Llama and
Qwen2 are checked in test_plugin_compiled.py and test_plugin_architectures.py.
"""

import os

import numpy as np
import pytest
import torch

import hf_reference
from engines import (PARITY_TOL, PATCH_TOL, assert_greedy_matches, assert_lens_matches,
                     assert_patterns_match_transformers,
                     assert_steering_matches_transformers,
                     assert_sweep_matches_transformers, booted, captured_patterns, generate, rel_l2, rpc,
                     same_length_prompts, session_on)
from inspector.core.hooks import ROUTER_KIND, HookPoint
from inspector.core.routing import dense_weights, route
from inspector.experiments.patching import Metric, PatchSpec, patch
from inspector.plugin.reader import READ

PROMPTS = ["def fibonacci(n):\n    return n", "import os\nimport sys"]
# each tiny model's blocks as the reader reads them (vLLM's block class; fused: (hidden, residual) pairs)
FAMILY_OF = {"gpt2": "sequential (GPT2Block)", "gemma2": "fused (Gemma2DecoderLayer)", "qwen3": "fused (Qwen3DecoderLayer)",
             "phi3": "fused (LlamaDecoderLayer)", "gptj": "parallel (GPTJBlock)", "opt": "sequential (OPTDecoderLayer)",
             "qwen3_moe": "fused (Qwen3MoeDecoderLayer)", "gemma3": "fused (Gemma3DecoderLayer)",
             "gpt_neox": "parallel (GPTNeoXLayer)", "olmo2": "sequential (Olmo2DecoderLayer)",
             "phi": "parallel (PhiDecoderLayer)", "mixtral": "fused (MixtralDecoderLayer)",
             "olmoe": "fused (OlmoeDecoderLayer)", "qwen2_moe": "fused (Qwen2MoeDecoderLayer)",
             "gemma": "fused (GemmaDecoderLayer)", "stablelm": "sequential (StablelmDecoderLayer)",
             "granite": "sequential (GraniteDecoderLayer)", "cohere": "parallel (CohereDecoderLayer)",
             "bloom": "sequential (BloomBlock)", "olmo": "sequential (OlmoDecoderLayer)",
             "gpt_bigcode": "sequential (GPTBigCodeBlock)", "gpt_oss": "fused (TransformerBlock)",
             "glm4_moe": "fused (Glm4MoeDecoderLayer)"}
BACKEND = {"gpt_neox", "olmo2", "phi", "olmo", "gpt_bigcode"}  # vLLM's Transformers backend: the reference runs in a child process
PARALLEL = {"gptj", "gpt_neox", "phi", "cohere"}  # attention and MLP both read resid_pre
MIXTURE_OF_EXPERTS = {"qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss", "glm4_moe"}
# one family per structural variant: sequential (GPT-2), post-branch norms, soft cap and sliding windows
# (Gemma 2), parallel (GPT-J), a mixture of experts (Qwen3-MoE), shared experts (Qwen2-MoE), residual
# multipliers (Granite), a residual passed on but ignored (Cohere), ALiBi (Bloom), sinks and the
# residual as a later argument (GPT-OSS), and the Transformers backend: parallel (GPT-NeoX), post-norms
# (OLMo 2), non-parametric norms (OLMo)
SAMPLE = ("gpt2", "gemma2", "gptj", "qwen3_moe", "qwen2_moe", "granite", "cohere", "bloom", "gpt_oss", "gpt_neox",
          "olmo2", "olmo")
EVERY_FAMILY = os.environ.get("INSPECTOR_TEST_EVERY_FAMILY") == "1"
# of the sample, these boot compiled (the hooks' sites with a factor, a later residual argument, shared
# experts); the others eager: compiled hooks run the same code, checked on Llama, Qwen2, GPT-2, Gemma 2
COMPILED = {"granite", "gpt_oss", "qwen2_moe"}


def reference(arch, function, *args):
    """transformers' answer; from a child process for a model vLLM served through its Transformers backend."""
    if arch in BACKEND:
        return hf_reference.in_child_process(function, *args)
    return getattr(hf_reference, function)(*args)


@pytest.fixture(scope="module", params=list(FAMILY_OF) if EVERY_FAMILY else SAMPLE)
def engine(request, tiny_models):
    mode = "compiled" if EVERY_FAMILY or request.param in COMPILED else "eager"
    with booted(tiny_models[request.param], mode=mode, hook_patterns=("*",), enable_position_interventions=True) as llm:
        yield request.param, llm


def captured(llm):
    """{rid: {(layer, kind): values}}, the catalogue, and the generated tokens."""
    points = {p["name"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS, max_tokens=4)
    rows = {rid: {(points[name].layer, points[name].kind): r["values"] for name, r in hooks.items()}
            for rid, hooks in caps.items()}
    return rows, points, tokens


def close(a, b, tol=PARITY_TOL):
    return rel_l2(a, b).max() < tol


def test_the_points_tie_together_as_transformer_lens_defines_them(engine):
    arch, llm = engine
    assert rpc(llm, "inspector_describe")["family"] == f"{FAMILY_OF[arch]}, {READ}"
    rows, points, _ = captured(llm)
    # the boot probe found every identity to hold (queries and keys too, where vLLM's Transformers backend
    # calls its attention layers through .forward, around their hooks)
    assert not {p.alias: p.withdrawn for p in points.values() if p.withdrawn}
    layers = 1 + max(p.layer for p in points.values())
    kinds = {p.kind for p in points.values()}
    assert ("resid_mid" in kinds) == (arch not in PARALLEL)
    for got in rows.values():
        for i in range(layers):
            pre, post = got[i, "resid_pre"], got[i, "resid_post"]
            if arch in PARALLEL:
                assert close(pre + got[i, "attn_out"] + got[i, "mlp_out"], post)
            else:
                assert close(pre + got[i, "attn_out"], got[i, "resid_mid"])
                assert close(got[i, "resid_mid"] + got[i, "mlp_out"], post)
            if i + 1 < layers:
                assert close(post, got[i + 1, "resid_pre"])


def test_transformers_own_model_loads_and_runs_beside_the_engine(engine, tiny_models):
    """vLLM's Transformers backend makes transformers' model class of its family compile itself, editing
    the class; the edits stay with the engine's model, so transformers' own model loads in this process
    and computes what it computes in a fresh one (a notebook comparing with transformers; the tests after
    this one check the engine against transformers again)."""
    arch, _ = engine
    ids = [5, 6, 7, 8, 9]
    here = hf_reference.logits(tiny_models[arch], ids)
    np.testing.assert_allclose(here, hf_reference.in_child_process("logits", tiny_models[arch], ids), rtol=1e-5,
                               atol=1e-6)


def test_each_kind_equals_transformers_on_the_same_definition(engine, tiny_models):
    arch, llm = engine
    rows, points, tokens = captured(llm)
    for rid, (prompt_ids, gen_ids) in tokens.items():
        seq = (prompt_ids + gen_ids)[:-1]
        compared = set()
        points_there = reference(arch, "block_points", tiny_models[arch], arch, seq)
        for key, expected in points_there.items():
            if key not in rows[rid]:
                continue
            tol = 3 * PARITY_TOL if key[1] == "mlp_post" else PARITY_TOL  # a product of two projections
            assert close(rows[rid][key], expected, tol), f"{arch} {key}: {rel_l2(rows[rid][key], expected).max():.3g}"
            compared.add(key)
        assert compared == set(points_there), f"not captured: {set(points_there) - compared}"
        assert_greedy_matches(reference(arch, "logits", tiny_models[arch], seq), len(prompt_ids), gen_ids)
        assert_expert_choice_matches(rows[rid], points, reference(arch, "expert_choice", tiny_models[arch], seq))


def test_the_lens_of_the_last_block_is_the_models_own_next_token_distribution(engine, tiny_models):
    """Whatever the family does after its last block (tied embeddings, Gemma 2's soft cap, a LayerNorm),
    the lens there is transformers' own log-softmax of the logits."""
    arch, llm = engine
    rows, points, tokens = captured(llm)
    last = max(p.layer for p in points.values())
    for rid, (prompt_ids, gen_ids) in tokens.items():
        got = rpc(llm, "inspector_lens", rows[rid][last, "resid_post"], 5, None)
        logits = reference(arch, "logits", tiny_models[arch], (prompt_ids + gen_ids)[:-1])
        assert_lens_matches(got["top_ids"], got["top_logprobs"], torch.log_softmax(torch.from_numpy(logits), -1).numpy())


def assert_expert_choice_matches(rows, points, expected):
    """The experts recomputed from the captured router logits are those transformers' routers chose,
    with the same weights, in every mixture-of-experts layer (and only there)."""
    routers = {p.layer: p for p in points.values() if p.kind == ROUTER_KIND}
    assert set(routers) == set(expected)
    for layer, (want_ids, want_weights) in expected.items():
        assert routers[layer].routing is not None and not routers[layer].routing.unsupported
        ids, weights = route(rows[layer, "router"], routers[layer].routing)
        experts = routers[layer].width
        np.testing.assert_array_equal(dense_weights(ids, weights, experts) > 0,
                                      dense_weights(want_ids, want_weights, experts) > 0)
        np.testing.assert_allclose(dense_weights(ids, weights, experts), dense_weights(want_ids, want_weights, experts),
                                   atol=1e-5)


def test_attention_patterns_equal_transformers_eager_attention(engine, tiny_models):
    arch, llm = engine
    patterns, _ = captured_patterns(llm, PROMPTS[:1], max_tokens=4)
    assert_patterns_match_transformers(tiny_models[arch], patterns, lambda function, *args: reference(arch, function,
                                                                                                      *args))


def test_steering_at_block_0_equals_the_same_edit_by_a_transformers_forward_hook(engine, tiny_models):
    arch, llm = engine
    assert_steering_matches_transformers(llm, tiny_models[arch], PROMPTS[0],
                                         lambda function, *args: reference(arch, function, *args))


def test_steering_a_router_equals_the_same_edit_of_transformers_router_logits(engine, tiny_models):
    """A bias on one expert's router logit (its first MoE layer; nothing to do for a dense model): every
    token goes to that expert, and what follows equals transformers' router given the same logits."""
    arch, llm = engine
    points = {p["alias"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
    routers = sorted((p for p in points.values() if p.kind == ROUTER_KIND), key=lambda p: p.layer)
    assert bool(routers) == (arch in MIXTURE_OF_EXPERTS)
    if not routers:
        return
    router, expert = routers[0], routers[0].width - 1
    bias = np.zeros(router.width, np.float32)
    bias[expert] = 20.0
    rpc(llm, "inspector_set_interventions", [{"hook": router.name, "bias": bias.tolist()}])
    try:
        tokens, caps = generate(llm, PROMPTS[:1], max_tokens=4)
    finally:
        rpc(llm, "inspector_clear_interventions")
    (rid, (prompt_ids, gen_ids)), = tokens.items()
    ids, _ = route(caps[rid][router.name]["values"], router.routing)
    assert (ids == expert).any(axis=1).all()  # the captured logits are the steered ones
    expected = reference(arch, "router_steered", tiny_models[arch], (prompt_ids + gen_ids)[:-1], router.layer, bias)
    last = max(p.layer for p in points.values())
    assert close(caps[rid][points[f"blocks.{last}.hook_resid_post"].name]["values"], expected["resid_post"])
    assert_greedy_matches(expected["logits"], len(prompt_ids), gen_ids)


def test_a_patching_sweep_equals_transformers_patching_one_cell_at_a_time(engine, tiny_models):
    """Every layer's resid_pre, attn_out and mlp_out at every position: each cell a request of one
    batch here, one forward with a hook there. The sample's families take the two directions in turn."""
    arch, llm = engine
    session = session_on(llm, tiny_models[arch], enable_position_interventions=True)
    points = {p.alias: p for p in session.installed.values()}
    hooks = tuple(alias for kind in ("hook_resid_pre", "hook_attn_out", "hook_mlp_out")
                  for alias in sorted(points) if alias.endswith(kind) and alias.startswith("blocks."))
    clean, corrupted = same_length_prompts(session)
    by_name = {p.name: p for p in points.values()}
    directions = ("denoise", "noise")
    for direction in directions if EVERY_FAMILY else directions[SAMPLE.index(arch) % 2:][:1]:
        result = patch(session, PatchSpec(clean, corrupted, hooks, Metric(10, 20), direction))
        assert result.complete and result.engine_calls == 1 and not session.run.requests
        assert_sweep_matches_transformers(result, by_name, tiny_models[arch], arch,
                                          lambda function, *args: reference(arch, function, *args))
        assert np.ptp(result.raw) > 10 * PATCH_TOL  # the patches matter: a wrong cell would show


def test_a_point_an_edit_would_not_act_through_is_read_only_and_refuses_interventions(engine):
    """vLLM's and transformers' sequential blocks hand resid_mid to a module (the MLP's norm, or the MLP)
    but add the MLP's output to their own copy of the stream: the probe's steering round trip marks
    resid_mid read only there, and nowhere else; an intervention on it is refused with the reason."""
    arch, llm = engine
    points = {p["alias"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
    read_only = {p.kind for p in points.values() if p.unsteerable}
    assert read_only == ({"resid_mid"} if FAMILY_OF[arch].startswith("sequential") else set())
    if read_only:
        point = points["blocks.0.hook_resid_mid"]
        with pytest.raises(Exception, match="cannot be steered: a bias there does not reach"):
            rpc(llm, "inspector_set_interventions", [{"hook": point.name, "bias": [0.0] * point.width}])
