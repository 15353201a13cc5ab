"""Qwen2 and GPT-2 in both flavours: residual stream and greedy tokens match transformers."""

import pytest

import hf_reference
from engines import PARITY_TOL, assert_greedy_matches, booted, generate, rel_l2, rpc

PROMPTS = ["def fibonacci(n):", "for key, value in items.items():"]


@pytest.fixture(scope="module", params=[("qwen2", "compiled"), ("qwen2", "eager"), ("gpt2", "compiled"),
                                        ("gpt2", "eager")], ids=lambda p: "-".join(p))
def engine(request, tiny_models):
    arch, mode = request.param
    with booted(tiny_models[arch], mode=mode, hook_patterns=("blocks.*.hook_resid_post", "blocks.*.mlp.hook_post",
                                                             "ln_final.hook_normalized")) as llm:
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
