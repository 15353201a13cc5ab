"""Attention patterns recomputed from captured queries and keys equal transformers' eager attention.

Gemma 2 (compiled): grouped-query heads, a query scale that is not 1/sqrt(head size), soft-capped
scores, sliding-window layers alternating with global ones, tied embeddings. Mistral (eager): a sliding
window on every layer. Both tiny models draw their weights wide, so their attention is peaked and a
wrong scale, cap or window shows. Qwen2 and GPT-2 are checked in test_plugin_architectures.py.
"""

import numpy as np
import pytest

import torch

import hf_reference
from engines import (PARITY_TOL, QK, assert_lens_matches, assert_patterns_match_transformers, booted, captured_patterns,
                     generate, rel_l2, rpc)
from inspector.core import attention
from inspector.core.attention import AttentionGeometry, attention_weights
from inspector.core.hooks import HookPoint

PROMPTS = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)", "import os\nimport sys"]


@pytest.fixture(scope="module", params=[("gemma2", "compiled"), ("mistral", "eager")], ids=lambda p: "-".join(p))
def engine(request, tiny_models):
    arch, mode = request.param
    with booted(tiny_models[arch], mode=mode, hook_patterns=(*QK, "blocks.*.hook_resid_post")) as llm:
        yield arch, llm


def test_patterns_equal_transformers_eager_attention_for_every_head_of_every_layer(engine, tiny_models):
    arch, llm = engine
    patterns, points = captured_patterns(llm, PROMPTS)
    assert_patterns_match_transformers(tiny_models[arch], patterns)
    geometries = [p.attention for p in points.values() if p.kind == "q"]
    peaks = [w.max(axis=-1).mean() for _, per_layer in patterns.values() for w in per_layer]
    assert min(peaks) > 0.3  # peaked, not near-uniform: a wrong scale, cap or window would show
    if arch == "gemma2":  # read from the model: 1/sqrt(query_pre_attn_scalar), the cap, alternating windows
        assert [g.sliding_window for g in geometries] == [6, 0]
        assert {(g.heads, g.kv_heads, g.soft_cap) for g in geometries} == {(2, 1, 3.0)}
        assert [g.scale for g in geometries] == pytest.approx([24 ** -0.5] * 2)
    else:
        assert {g.sliding_window for g in geometries} == {8}
    assert all(not g.unsupported for g in geometries)


def test_queries_and_keys_are_captured_at_the_kernels_widths(engine):
    _, llm = engine
    points = [HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]]
    for p in points:
        if p.kind in ("q", "k"):
            heads = p.attention.heads if p.kind == "q" else p.attention.kv_heads
            assert p.width == heads * p.attention.head_size
            assert p.alias == f"blocks.{p.layer}.attn.hook_{p.kind}"


def test_the_stream_and_the_lens_match_transformers_with_gemma2s_final_soft_cap(engine, tiny_models):
    """The lens calls the model's own head: Gemma 2's final soft cap (and tied embeddings) included."""
    arch, llm = engine
    aliases = {p["name"]: p["alias"] for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS[:1], max_tokens=4)
    (rid, (prompt_ids, gen_ids)), = tokens.items()
    seq = prompt_ids + gen_ids
    rows = {aliases[name]: r for name, r in caps[rid].items()}
    ref = hf_reference.run(tiny_models[arch], seq[:-1])
    model = hf_reference.load(str(tiny_models[arch]))
    cap = getattr(model.config, "final_logit_softcapping", None)
    for layer in range(ref["resid_post"].shape[0]):
        got = rows[f"blocks.{layer}.hook_resid_post"]["values"]
        assert rel_l2(got, ref["resid_post"][layer]).max() < PARITY_TOL
        lens = rpc(llm, "inspector_lens", got, 5, np.array(seq[1:len(got) + 1]))
        with torch.no_grad():
            logits = model.lm_head(model.model.norm(torch.from_numpy(ref["resid_post"][layer])))
            expected = torch.log_softmax(torch.tanh(logits / cap) * cap if cap else logits, -1).numpy()
        assert_lens_matches(lens["top_ids"], lens["top_logprobs"], expected)
    last = np.take_along_axis(expected, np.array(seq[1:len(got) + 1])[:, None], 1)[:, 0]
    np.testing.assert_allclose(lens["chosen_logprobs"], last, atol=1e-4)  # the model's own next-token logprobs
    assert (lens["chosen_ranks"][len(prompt_ids) - 1:] == 0).all()  # greedy: generated tokens are the top


# --- the recomputation itself, against a plain loop ---

def loop_reference(q, k, positions, g: AttentionGeometry) -> np.ndarray:
    out = np.zeros((g.heads, len(q), len(k)))
    for h in range(g.heads):
        kv = h // (g.heads // g.kv_heads)
        for i, pi in enumerate(positions):
            allowed = [j for j, pj in enumerate(positions)
                       if pj <= pi and (not g.sliding_window or pi - pj < g.sliding_window)]
            s = np.array([q[i, h * g.head_size:(h + 1) * g.head_size] @ k[j, kv * g.head_size:(kv + 1) * g.head_size]
                          for j in allowed], np.float64) * g.scale
            if g.soft_cap:
                s = g.soft_cap * np.tanh(s / g.soft_cap)
            e = np.exp(s - s.max())
            out[h, i, allowed] = e / e.sum()
    return out


@pytest.mark.parametrize("block", [3, 256], ids=["blocks-of-3", "one-block"])
@pytest.mark.parametrize("geometry", [AttentionGeometry(4, 2, 8, 0.3), AttentionGeometry(2, 1, 8, 0.5, 3, 1.5),
                                      AttentionGeometry(3, 3, 4, 1.0, 1)], ids=["gqa", "window-cap", "window-1"])
def test_weights_follow_the_geometry(geometry, block, monkeypatch):
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    rng = np.random.default_rng(0)
    positions = np.arange(9)
    q = rng.normal(size=(9, geometry.q_width)).astype(np.float32) * 2  # peaked enough that mistakes show
    k = rng.normal(size=(9, geometry.k_width)).astype(np.float32)
    got = attention_weights(q, positions, k, positions, geometry)
    np.testing.assert_allclose(got, loop_reference(q, k, positions, geometry), atol=1e-6)
    np.testing.assert_allclose(got.sum(axis=-1), 1, atol=1e-6)
    one = attention_weights(q[5:6], positions[5:6], k, positions, geometry, heads=[1])
    np.testing.assert_allclose(one[0, 0], got[1, 5], atol=1e-7)


def test_missing_keys_or_an_unsupported_attention_are_refused_not_guessed():
    g = AttentionGeometry(1, 1, 4, 0.5)
    q, k = np.ones((2, 4)), np.ones((6, 4))
    with pytest.raises(ValueError, match=r"positions 0-1, 4 were not captured"):
        attention_weights(q, [5, 6], k[:4], [2, 3, 5, 6], g)
    windowed = AttentionGeometry(1, 1, 4, 0.5, sliding_window=3)  # positions before the window are not needed
    assert attention_weights(q, [5, 6], k[:4], [3, 4, 5, 6], windowed).shape == (1, 2, 4)
    with pytest.raises(ValueError, match="ALiBi"):
        attention_weights(q, [0, 1], k[:2], [0, 1], AttentionGeometry(1, 1, 4, 0.5, unsupported="ALiBi position biases"))
    with pytest.raises(ValueError, match="queries"):
        attention_weights(np.ones((2, 3)), [0, 1], k[:2], [0, 1], g)
