"""Qwen2 and GPT-2 in both flavours: residual stream, greedy tokens, the logit lens and attention patterns
match transformers."""

import numpy as np
import pytest
import torch

import hf_reference
from engines import (PARITY_TOL, QK, assert_attribution_matches, assert_greedy_matches, assert_lens_matches, assert_patterns_match_transformers,
                     booted, captured_patterns, generate, rel_l2, rpc)

PROMPTS = ["def fibonacci(n):", "for key, value in items.items():"]


@pytest.fixture(scope="module", params=[("qwen2", "compiled"), ("qwen2", "eager"), ("gpt2", "compiled"),
                                        ("gpt2", "eager")], ids=lambda p: "-".join(p))
def engine(request, tiny_models):
    arch, mode = request.param
    with booted(tiny_models[arch], mode=mode, hook_patterns=("blocks.*.hook_resid_post", "blocks.*.mlp.hook_post",
                                                             "ln_final.hook_normalized", *QK, "hook_*embed",
                                                             "blocks.*.hook_attn_out", "blocks.*.hook_mlp_out")) as llm:
        yield arch, llm


def test_parity_with_transformers(engine, tiny_models):
    arch, llm = engine
    aliases = {p["name"]: p["alias"] for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS, max_tokens=8)
    for rid, (prompt_ids, gen_ids) in tokens.items():
        seq = prompt_ids + gen_ids
        ref = hf_reference.run(tiny_models[arch], seq[:-1])
        assert_greedy_matches(ref["logits"], len(prompt_ids), gen_ids)
        by_alias = {aliases[name]: rows for name, rows in caps[rid].items()}
        for layer in range(ref["resid_post"].shape[0]):
            rows = by_alias[f"blocks.{layer}.hook_resid_post"]
            assert rows["positions"].tolist() == list(range(len(seq) - 1))
            assert rel_l2(rows["values"], ref["resid_post"][layer]).max() < PARITY_TOL
            # neuron activations multiply two projections: their relative error is larger than the stream's
            assert rel_l2(by_alias[f"blocks.{layer}.mlp.hook_post"]["values"], ref["mlp_post"][layer]).max() < 3 * PARITY_TOL
        assert rel_l2(by_alias["ln_final.hook_normalized"]["values"], ref["final"]).max() < PARITY_TOL


def test_the_lens_is_the_models_own_final_norm_and_head_and_a_capture_there_sees_nothing_of_it(engine, tiny_models):
    """An RMSNorm (Qwen2) or a LayerNorm with tied embeddings (GPT-2): the lens is what transformers'
    final norm and head make of its own hidden states, at every layer."""
    arch, llm = engine
    aliases = {p["name"]: p["alias"] for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS[:1], max_tokens=4)
    (rid, (prompt_ids, gen_ids)), = tokens.items()
    ref = hf_reference.run(tiny_models[arch], (prompt_ids + gen_ids)[:-1])
    model = hf_reference.load(str(tiny_models[arch]))
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    by_alias = {aliases[name]: rows for name, rows in caps[rid].items()}
    for layer in range(ref["resid_post"].shape[0]):
        got = rpc(llm, "inspector_lens", by_alias[f"blocks.{layer}.hook_resid_post"]["values"], 5, None)
        with torch.no_grad():
            expected = torch.log_softmax(model.lm_head(norm(torch.from_numpy(ref["resid_post"][layer]))), -1).numpy()
        assert_lens_matches(got["top_ids"], got["top_logprobs"], expected)
    assert rpc(llm, "inspector_drain") == {}  # the final norm's capture did not run for the lens


def test_attention_patterns_equal_transformers_eager_attention(engine, tiny_models):
    arch, llm = engine
    patterns, _ = captured_patterns(llm, PROMPTS, max_tokens=4)
    assert_patterns_match_transformers(tiny_models[arch], patterns)


def test_direct_logit_attribution_is_transformer_lens_convention_and_the_parts_add_up_to_the_logits(engine, tiny_models):
    """RMSNorm (Qwen2) and a centring LayerNorm with tied embeddings and a bias-free head (GPT-2): each
    component through the final norm frozen at the final residual and the unembedding; over all the
    components of the residual stream (embeddings, every attn_out and mlp_out) they sum to the logits
    of the final norm's output less its constant part (the norm's bias)."""
    arch, llm = engine
    aliases = {p["name"]: p["alias"] for p in rpc(llm, "inspector_describe")["hook_points"]}
    tokens, caps = generate(llm, PROMPTS[:1], max_tokens=4)
    (rid, (prompt_ids, gen_ids)), = tokens.items()
    rows = {aliases[name]: r["values"] for name, r in caps[rid].items()}
    layers = sum(a.endswith("hook_resid_post") for a in rows)
    final = rows[f"blocks.{layers - 1}.hook_resid_post"]
    parts = [a for a in rows if a.endswith(("embed", "attn_out", "mlp_out"))]
    assert len(parts) == 2 * layers + (2 if arch == "gpt2" else 1)
    chosen = np.array((prompt_ids + gen_ids)[1:len(final) + 1])
    total = 0
    for part in parts:
        got = rpc(llm, "inspector_attribution", rows[part], final, 5, chosen)
        assert_attribution_matches(got["top_ids"], got["top_logits"],
                                   hf_reference.direct_logit_attribution(tiny_models[arch], rows[part], final))
        total = total + got["chosen_logits"]
    model = hf_reference.load(str(tiny_models[arch]))
    norm = model.model.norm if hasattr(model, "model") else model.transformer.ln_f
    with torch.no_grad():
        f = torch.from_numpy(final)
        logits = model.lm_head(norm(f) - norm(torch.zeros_like(f[:1]))).numpy()
    np.testing.assert_allclose(total, logits[np.arange(len(chosen)), chosen], atol=PARITY_TOL * np.abs(logits).max())
