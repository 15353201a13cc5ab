"""The decoder block list is found by what it holds, and the boot probe judges what was read (no
engine needed; the block reader's own tests are in test_reader_unit.py)."""

import pytest
from torch import nn

from inspector.plugin.families import beside_blocks, encoders, find_blocks


class Mixer(nn.Module):  # stands for an attention layer
    pass


class Block(nn.Module):
    def __init__(self, attention=True):
        super().__init__()
        self.mix = Mixer() if attention else nn.Identity()
        self.mlp = nn.Linear(4, 4)


def model_of(**lists):
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens = nn.Embedding(10, 4)
    for name, blocks in lists.items():
        setattr(model.model, name, nn.ModuleList(blocks))
    model.model.norm = nn.LayerNorm(4)
    return model


def test_the_block_list_is_the_one_holding_attention_else_the_longest():
    model = model_of(experts=[Block(False) for _ in range(8)], layers=[Block() for _ in range(2)])
    path, blocks = find_blocks(model, lambda m: isinstance(m, Mixer))
    assert path == "model.layers" and len(blocks) == 2
    assert find_blocks(model)[0] == "model.experts"  # no attention anywhere (a state-space model): the longest
    assert beside_blocks(model, "model.layers") == ((("embed", "model.embed_tokens"),), "model.norm")


def test_one_block_is_a_block_list_too():
    """A one-layer model, or an engine a harvest cut after block 0."""
    model = model_of(experts=[Block(False)], layers=[Block()])
    path, blocks = find_blocks(model, lambda m: isinstance(m, Mixer))
    assert path == "model.layers" and len(blocks) == 1


class PPMissingLayer(nn.Identity):  # what vLLM puts where another pipeline stage holds a block
    pass


def test_a_pipeline_stages_block_list_holds_placeholders_for_the_blocks_of_other_stages():
    """The second of two stages: block 0 and the embeddings are another stage's; a list of nothing but
    placeholders (a stage of the experts' list, say) is no block list."""
    from inspector.plugin.vllm_compat import is_pipeline_placeholder

    model = model_of(layers=[PPMissingLayer(), Block(), Block()], spare=[PPMissingLayer(), PPMissingLayer()])
    path, blocks = find_blocks(model, lambda m: isinstance(m, Mixer), is_pipeline_placeholder)
    assert path == "model.layers" and [is_pipeline_placeholder(b) for b in blocks] == [True, False, False]
    with pytest.raises(ValueError, match="no list of decoder blocks"):  # placeholders unknown: no parameters
        find_blocks(model)


def test_a_multimodal_models_encoders_are_the_top_modules_beside_its_language_model():
    model = nn.Module()
    model.vision_tower, model.projector, model.language_model = Block(), nn.Linear(4, 4), model_of(layers=[Block()] * 2)
    model.lm_head, model.logits = nn.Embedding(10, 4), nn.Identity()
    is_vocabulary = lambda m: m is model.lm_head  # noqa: E731
    assert encoders(model, "language_model.model.layers", is_vocabulary) == ["vision_tower", "projector"]


def test_a_model_without_a_block_list_is_refused_naming_its_top_modules():
    with pytest.raises(ValueError, match=r"Module: no list of decoder blocks found \(top modules: model \(Module\)\)"):
        find_blocks(model_of())


# --- the boot probe's judgement, on a toy model (the real boot probe runs in every engine test) ---

class ToyBlock(nn.Module):
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
    from inspector.core.hooks import HookPoint
    from inspector.plugin.hookpoints import Site

    def point(i, kind, module, how):
        path = f"blocks.{i}" + (f".{module}" if module else "")
        return HookPoint(f"{path}.{kind}", f"blocks.{i}.hook_{kind}", path, kind, 4, i), Site(how)

    return [p for i in range(2) for p in (point(i, "resid_pre", "", "input"), point(i, "attn_out", "attn", "output"),
                                          point(i, "resid_mid", *resid_mid_at), point(i, "mlp_out", "mlp", "output"),
                                          point(i, "resid_post", "", "output"), point(i, "odd", "batched", "output"),
                                          point(i, "unseen", "bypassed", "output"))]


def verdict(points):
    import torch

    from inspector.plugin.probe import verify

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.Sequential(ToyBlock(), ToyBlock())
    return verify(model, points, "float32", lambda: model.blocks(torch.randn(8, 4)))


def probe(points):
    return verdict(points).withdrawn


def test_a_point_read_right_where_an_edit_misses_the_stream_is_read_only():
    """The toy's ln_2 reads resid_mid, but the block adds the MLP's output to its own copy of the
    stream: a bias at ln_2's input reaches the MLP only. The steered last block shows it; every block
    built alike is marked."""
    found = verdict(toy_points())
    assert set(found.unsteerable) == {"blocks.0.ln_2.resid_mid", "blocks.1.ln_2.resid_mid"}
    assert found.unsteerable["blocks.0.ln_2.resid_mid"].startswith("a bias there does not reach what the model")
    assert "blocks.1: resid_mid + mlp_out = resid_post holds as read" in found.unsteerable["blocks.0.ln_2.resid_mid"]


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


def test_a_point_whose_module_runs_twice_a_forward_is_read_at_its_last_call_and_read_only():
    """NanoChat norms its embeddings with its final norm before the blocks, too: the final norm of the
    last resid_post is what its hook reads at the last call, and an edit there would act on both."""
    import torch

    from inspector.core.hooks import HookPoint
    from inspector.plugin.hookpoints import Site
    from inspector.plugin.probe import verify

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks, model.norm = nn.Sequential(ToyBlock(), ToyBlock()), nn.LayerNorm(4)
    points = [(p, s) for p, s in toy_points() if p.kind not in ("odd", "unseen")]
    points.append((HookPoint("norm.normalized", "ln_final.hook_normalized", "norm", "normalized", 4, -1), Site("output")))
    found = verify(model, points, "float32", lambda: model.norm(model.blocks(model.norm(torch.randn(8, 4)))))
    assert found.unsteerable["norm.normalized"] == ("its module runs 2 times a forward: it is read at its last call, "
                                                    "and an edit there would act on every call")
    assert "norm.normalized" not in found.withdrawn


def test_a_model_run_twice_by_the_probes_forward_runs_no_module_twice():
    """vLLM's dummy run may run the whole model more than once: that marks no point read only."""
    import torch

    from inspector.plugin.probe import verify

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(ToyBlock(), ToyBlock())

        def forward(self, x):
            return self.blocks(x)

    torch.manual_seed(0)
    model, x = Toy(), torch.randn(8, 4)
    points = [(p, s) for p, s in toy_points() if p.kind not in ("odd", "unseen")]
    found = verify(model, points, "float32", lambda: (model(x), model(x)))
    assert not [why for why in found.unsteerable.values() if "times a forward" in why]


def test_rows_not_finite_on_both_sides_say_nothing_and_on_one_side_fail():
    """A state-space layer's dummy forward reads uninitialised state: some rows come out NaN, the
    same rows wherever the values are read."""
    import torch

    from inspector.plugin.hookpoints import row_error

    values = torch.randn(4, 8)
    values[1] = float("nan")
    assert row_error(values.clone(), values) == 0.0
    assert row_error(torch.randn(4, 8), values) == float("inf")
    assert row_error(torch.full((4, 8), float("nan")), torch.full((4, 8), float("nan"))) == float("inf")
