"""Block families are matched by what a block is; one no description names only by how it is built,
and then the boot probe checks it (no engine needed)."""

import pytest
from torch import nn

from inspector.plugin.families import FAMILIES, find_blocks


class LlamaDecoderLayer(nn.Module):  # the name of vLLM's Llama block, with Llama's modules
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.self_attn = nn.LayerNorm(4), nn.Linear(4, 4)
        self.post_attention_layernorm, self.mlp = nn.LayerNorm(4), nn.Linear(4, 4)


class LookAlikeLayer(LlamaDecoderLayer):  # the same modules under another class: its forward may differ
    pass


class BuiltAlikeLayer(LlamaDecoderLayer):  # the same modules and vLLM's fused forward: (hidden, residual) on
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


class SequentialAlikeLayer(LlamaDecoderLayer):  # the same modules, the stream in and out
    def forward(self, positions, hidden_states):
        return hidden_states


def model_of(layer_class, **attributes):
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([layer_class() for _ in range(2)])
    for layer in model.model.layers:
        for name, value in attributes.items():
            setattr(layer, name, value)
    return model


def test_a_known_block_class_is_described():
    path, blocks, family = find_blocks(model_of(LlamaDecoderLayer))
    assert path == "model.layers" and len(blocks) == 2 and family.residual == "fused"


def test_a_block_no_description_names_but_built_like_llamas_is_described_as_inferred():
    _, _, family = find_blocks(model_of(BuiltAlikeLayer))
    assert family.name == "Llama-style (fused), inferred from BuiltAlikeLayer" and family.residual == "fused"
    assert family.layer_classes == ("BuiltAlikeLayer",)
    _, _, family = find_blocks(model_of(SequentialAlikeLayer))
    assert family.name == "Llama-style (sequential), inferred from SequentialAlikeLayer"
    resid_pre = next(p for p in family.points if p.kind == "resid_pre")
    assert family.residual == "sequential" and (resid_pre.how, resid_pre.arg_index) == ("input", 1)


@pytest.mark.parametrize("layer_class, attributes", [(LookAlikeLayer, {}),
                                                     (LlamaDecoderLayer, {"ada_rms_norm_t_cond": True})])
def test_a_look_alike_or_a_variant_is_refused_naming_the_model_and_its_modules(layer_class, attributes):
    with pytest.raises(ValueError) as refused:
        find_blocks(model_of(layer_class, **attributes))
    message = str(refused.value)
    assert "Module: no block family describes its decoder blocks" in message
    assert f"model.layers ({layer_class.__name__})" in message and "top modules: model (Module)" in message
    assert "Hook a module by path" in message


def test_every_family_names_its_points_with_transformer_lens_kinds():
    for family in FAMILIES:
        kinds = [p.kind for p in family.points]
        assert kinds[0] == "resid_pre" and kinds[-1] == "resid_post" and "attn_out" in kinds and "mlp_out" in kinds
        assert ("resid_mid" in kinds) == (family.residual != "parallel")


# --- the boot probe's judgement, on a toy model (the real boot probe runs in every engine test) ---

class Block(nn.Module):
    """A sequential block: resid_mid = x + attn(x), resid_post = resid_mid + mlp(ln_2(resid_mid))."""

    def __init__(self):
        super().__init__()
        self.attn, self.ln_2, self.mlp = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)
        self.batched, self.bypassed = nn.Identity(), nn.Identity()

    def forward(self, x):
        self.batched(x[None])  # a module that sees [1, tokens, width], as transformers' layers do
        self.bypassed.forward(x)  # called around its hooks, as vLLM's Transformers backend calls attention
        mid = x + self.attn(x)
        return mid + self.mlp(self.ln_2(mid))


def toy_points(resid_mid_at=("ln_2", "input")):
    from inspector.capture.hooks import HookPoint
    from inspector.plugin.hookpoints import Site

    def point(i, kind, module, how):
        path = f"blocks.{i}" + (f".{module}" if module else "")
        return HookPoint(f"{path}.{kind}", f"blocks.{i}.hook_{kind}", path, kind, 4, i), Site(how)

    return [p for i in range(2) for p in (point(i, "resid_pre", "", "input"), point(i, "attn_out", "attn", "output"),
                                          point(i, "resid_mid", *resid_mid_at), point(i, "mlp_out", "mlp", "output"),
                                          point(i, "resid_post", "", "output"), point(i, "odd", "batched", "output"),
                                          point(i, "unseen", "bypassed", "output"))]


def probe(points):
    import torch

    from inspector.plugin.probe import verify

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.Sequential(Block(), Block())
    return verify(model, points, "sequential", "float32", lambda: model.blocks(torch.randn(8, 4))).withdrawn


def test_the_probe_passes_true_identities_and_withdraws_rows_of_the_wrong_shape():
    withdrawn = probe(toy_points())
    assert set(withdrawn) == {f"blocks.{i}.{p}" for i in (0, 1) for p in ("batched.odd", "bypassed.unseen")}
    assert withdrawn["blocks.0.batched.odd"] == "it reads a [1, 8, 4] tensor where [tokens, 4] rows belong"
    assert withdrawn["blocks.1.bypassed.unseen"].startswith("the boot probe's forward never reached its hook")


def test_the_probe_blames_the_point_no_held_identity_vouches_for():
    withdrawn = probe(toy_points(resid_mid_at=("mlp", "output")))  # "resid_mid" read where mlp_out is
    withdrawn = {name: why for name, why in withdrawn.items() if not name.endswith((".odd", ".unseen"))}
    assert "blocks.0.mlp.resid_mid" in withdrawn
    assert withdrawn["blocks.1.mlp.resid_mid"].startswith("blocks.1: resid_pre + attn_out = resid_mid does not hold")
    # the stream between blocks vouches for block 0's output and block 1's input: they stay
    assert "blocks.0.resid_post" not in withdrawn and "blocks.1.resid_pre" not in withdrawn
