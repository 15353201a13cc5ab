"""The boot probe withdraws a hook point whose description is wrong, naming the identity it broke."""

import dataclasses

import pytest
import torch

import hf_reference
from engines import PARITY_TOL, assert_greedy_matches, booted, generate, rel_l2, rpc
from inspector.plugin import families
from inspector.plugin.families import FAMILIES, Point


def test_a_wrongly_described_point_is_withdrawn_with_the_identity_it_broke(tiny_models, monkeypatch):
    llama = FAMILIES[0]
    wrong = tuple(Point("resid_mid", "mlp", "input") if p.kind == "resid_mid" else p for p in llama.points)
    monkeypatch.setattr(families, "FAMILIES", (dataclasses.replace(llama, points=wrong), *FAMILIES[1:]))
    with booted(tiny_models["llama"], mode="eager", hook_patterns=("blocks.*.hook_resid_*",)) as llm:
        info = rpc(llm, "inspector_describe")
        withdrawn = {p["alias"]: p["withdrawn"] for p in info["hook_points"] if p["withdrawn"]}
        assert set(withdrawn) >= {"blocks.0.hook_resid_mid", "blocks.1.hook_resid_mid"}
        assert "blocks.1: resid_pre + attn_out = resid_mid does not hold" in withdrawn["blocks.1.hook_resid_mid"]
        # what other identities vouch for stays: the stream between blocks, and into the final norm
        assert not {"blocks.0.hook_resid_post", "blocks.1.hook_resid_pre", "blocks.1.hook_resid_post"} & set(withdrawn)
        installed = {info["hook_points"][i]["alias"] for i in range(len(info["hook_points"]))
                     if info["hook_points"][i]["name"] in info["installed"].values()}
        assert not installed & set(withdrawn)  # the glob skipped them
        with pytest.raises(Exception, match="is withdrawn: blocks.0: resid_pre"):
            rpc(llm, "inspector_add_hooks", {"blocks.0.hook_resid_mid": ("model.layers.0.mlp", 128)})


def test_a_block_that_scales_its_branches_keeps_only_the_points_it_does_not_scale(tiny_models):
    """Granite's blocks are built like Llama's (so its family is inferred) but add each branch times a
    multiplier: what its attention and MLP modules give is not what the stream gets. The probe's
    attention carries random values, so this shows at the attention branch too."""
    with booted(tiny_models["granite"], mode="eager", hook_patterns=("blocks.*.hook_resid_post",)) as llm:
        points = rpc(llm, "inspector_describe")["hook_points"]
        tokens, caps = generate(llm, ["def fibonacci(n):"], max_tokens=4)
    withdrawn = {p["alias"]: p["withdrawn"] for p in points if p["withdrawn"]}
    # what it keeps means what transformers' Granite computes there
    ((prompt_ids, gen_ids),), (rows,) = tokens.values(), caps.values()
    seq = (prompt_ids + gen_ids)[:-1]
    expected = hf_reference.block_points(tiny_models["granite"], "granite", seq)
    for i in (0, 1):
        got = rows[f"model.layers.{i}.resid_post"]["values"]
        assert rel_l2(got, expected[i, "resid_post"]).max() < PARITY_TOL
    assert_greedy_matches(hf_reference.logits(tiny_models["granite"], seq), len(prompt_ids), gen_ids)
    for i in (0, 1):
        assert "resid_pre + attn_out = resid_mid does not hold" in withdrawn[f"blocks.{i}.hook_attn_out"]
        assert "resid_mid + mlp_out = resid_post does not hold" in withdrawn[f"blocks.{i}.hook_mlp_out"]
        assert f"blocks.{i}.hook_resid_mid" in withdrawn and f"blocks.{i}.hook_resid_post" not in withdrawn
    assert "blocks.1.hook_resid_pre" not in withdrawn  # block 0's output vouches for it


def test_a_point_where_the_identity_intervention_would_change_values_is_withdrawn(tiny_models, monkeypatch):
    """Every forward of a compiled engine applies value * 1 + 0 at each installed point: the probe checks
    that this gives back the very tensors (shape, dtype, bits). Here a broken replacement at output
    sites (it upcasts a plain tensor output) must withdraw those points, and only those."""
    from inspector.plugin import hookpoints

    original = hookpoints.replace_output

    def upcasting(site, output, scale, bias):
        new, flowing = original(site, output, scale, bias)
        return (new.double() if isinstance(new, torch.Tensor) else new), flowing

    monkeypatch.setattr(hookpoints, "replace_output", upcasting)
    with booted(tiny_models["llama"], mode="eager", hook_patterns=("blocks.*.hook_resid_pre",)) as llm:
        points = rpc(llm, "inspector_describe")["hook_points"]
    withdrawn = {p["kind"] for p in points if p["withdrawn"]}
    assert withdrawn == {"embed", "attn_out", "mlp_out"}  # the plain-tensor outputs (the final norm returns a pair)
    assert all("identity intervention" in p["withdrawn"] for p in points if p["withdrawn"])
