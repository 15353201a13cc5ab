"""The boot probe withdraws a hook point that was read wrongly, naming the identity it broke."""

import dataclasses

import pytest
import torch

from engines import booted, rpc
from inspector.plugin import reader
from inspector.plugin.families import Point


def test_a_wrongly_read_point_is_withdrawn_with_the_identity_it_broke(tiny_models, monkeypatch):
    original = reader.read

    def misread(*args, **kwargs):  # resid_mid read at the MLP's input, where it is the norm's output
        reading = original(*args, **kwargs)
        wrong = tuple(tuple(Point("resid_mid", "mlp", "input") if p.kind == "resid_mid" else p for p in block)
                      for block in reading.family.points)
        return dataclasses.replace(reading, family=dataclasses.replace(reading.family, points=wrong))

    monkeypatch.setattr(reader, "read", misread)
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


def test_nan_where_the_other_tensor_has_nan_is_bit_identical_and_nothing_else_is():
    """A state-space layer's dummy forward reads uninitialised state: rows of NaN on both sides of the
    identity check. An identity keeps them NaN; any other difference still counts."""
    from inspector.plugin.probe import _identical

    a = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    assert _identical(a, a.clone()) and _identical((a, None), (a * 1 + 0, None))
    assert not _identical(a, torch.tensor([[1.0, 0.0], [2.0, 3.0]]))
    assert not _identical(a, torch.tensor([[1.0, float("nan")], [2.0, 3.0000002]]))
    assert not _identical(a, a.double()) and not _identical(a, a[:1])
