"""Block families are matched by what a block is, never by what it looks like (no engine needed)."""

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
