"""The block reader finds each kind by what the values do, not by module names (no engine needed).

Toy blocks stand for the structures vLLM builds: fused (hidden, residual) pairs, a residual passed on
but ignored, branches scaled as they are added, parallel branches from one norm, post-branch norms
under odd names, a mixture of experts, transformers' [1, tokens, width] layout. Each is read from one
forward and the points found must be the ones its forward defines; where a kind is missing the
refusal says why. The boot probe then verifies the reading on every engine (tests/test_families.py).
"""

import inspect

import pytest
import torch
from torch import nn

from inspector.plugin import hookpoints as hp
from inspector.plugin import reader

WIDTH, TOKENS = 8, 6
SEEN = {}  # the attention kernel's caller: reader.read's on_attention


class Kernel(nn.Module):
    """Stands for vLLM's attention layer: its output is random, and the reader is told of each call."""

    def forward(self, q, k, v):
        out = torch.randn(q.shape[0], v.shape[-1])
        SEEN["on_attention"](self, (q, k, v), out)
        return out


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.kernel, self.dense = nn.Linear(WIDTH, 3 * WIDTH), Kernel(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        batched = x.dim() == 3
        q, k, v = self.qkv(x[0] if batched else x).chunk(3, -1)
        out = self.dense(self.kernel(q, k, v))
        return (out[None] if batched else out), None


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, WIDTH, WIDTH) * 0.3)

    def forward(self, hidden_states, router_logits):
        weights = router_logits.softmax(-1)
        return torch.einsum("te,ewd,tw->td", weights, self.w, hidden_states)


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = nn.Linear(WIDTH, 4), Experts()

    def forward(self, x):
        return self.experts(hidden_states=x, router_logits=self.router(x))


class FusedNorm(nn.Module):
    """vLLM's RMSNorm: called with a residual, it adds it first and hands the sum on."""

    def __init__(self, width=WIDTH):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return normed if residual is None else (normed, x)


class Fused(nn.Module):
    """vLLM's Llama-style block: (hidden, residual) in and out."""

    def __init__(self, mlp=Mlp):
        super().__init__()
        self.input_layernorm, self.self_attn = FusedNorm(), Attention()
        self.post_attention_layernorm, self.mlp = FusedNorm(), mlp()

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states, _ = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Scaled(nn.Module):
    """Granite's and MiniCPM's blocks: the stream in and out, each branch scaled as it is added."""

    def __init__(self):
        super().__init__()
        self.ln_a, self.attention, self.ln_b, self.ffn = nn.LayerNorm(WIDTH), Attention(), nn.LayerNorm(WIDTH), Mlp()

    def forward(self, positions, hidden_states):
        mid = hidden_states + 0.25 * self.attention(self.ln_a(hidden_states))[0]
        return mid + 0.25 * self.ffn(self.ln_b(mid))


class Parallel(nn.Module):
    """Cohere's block: one norm feeds both branches; a residual is passed on and ignored."""

    def __init__(self):
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(WIDTH), Attention(), Mlp()

    def forward(self, positions, hidden_states, residual):
        normed = self.norm(hidden_states)
        return hidden_states + self.attn(normed)[0] + self.mlp(normed), hidden_states


class Sandwich(nn.Module):
    """Gemma 2's and OLMo 2's blocks: post-branch norms (named anything) between branch and stream,
    in transformers' [1, tokens, width] layout."""

    def __init__(self):
        super().__init__()
        self.attn, self.after_attn = Attention(), nn.LayerNorm(WIDTH)
        self.mixer, self.after_mixer = Mlp(), nn.LayerNorm(WIDTH)

    def forward(self, hidden_states, position_ids=None):
        mid = hidden_states + self.after_attn(self.attn(hidden_states)[0])
        return (mid + self.after_mixer(self.mixer(mid)),)


class Model(nn.Module):
    def __init__(self, block, norm=nn.LayerNorm):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(32, WIDTH)
        self.layers = nn.ModuleList([block() for _ in range(3)])
        self.norm = norm(WIDTH)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        params = list(inspect.signature(self.layers[0].forward).parameters)
        batched = params[0] == "hidden_states"
        x, residual = (x[None] if batched else x), None
        for layer in self.layers:
            out = layer(x) if batched else (layer(None, x, residual) if "residual" in params else layer(None, x))
            x, residual = (out[0], out[1]) if isinstance(out, tuple) and len(out) == 2 else (out[0] if batched else out,
                                                                                              None)
        if isinstance(self.norm, FusedNorm) and residual is not None:
            return self.norm(x, residual)[0]
        return self.norm(x)


class KeywordModel(Model):
    """Mamba 2's model calls its blocks by keyword only."""

    def forward(self, ids):
        x, residual = self.embed_tokens(ids), None
        for layer in self.layers:
            x, residual = layer(positions=None, hidden_states=x, residual=residual)
        return self.norm(x, residual)[0]


def read(model: Model):
    def forward(on_attention):
        SEEN["on_attention"] = on_attention
        with torch.no_grad():
            model(torch.randint(0, 32, (TOKENS,)))

    return reader.read(model, "layers", model.layers, "norm", (("embed", "embed_tokens"),), WIDTH, "float32", forward)


def points(reading, block=1):
    return {p.kind: (p.module, p.how, p.arg_index, p.width, round(p.factor, 3), p.batched)
            for p in reading.family.points[block]}


def test_fused_pairs_are_summed_and_each_branch_found_inside():
    got = points(read(Model(Fused, FusedNorm)))
    assert got == {"resid_pre": ("", "input_pair_sum", 1, "stream", 1.0, False),
                   "attn_out": ("self_attn", "output", 0, "stream", 1.0, False),
                   "z": ("self_attn.dense", "input", 0, "in", 1.0, False),
                   "resid_mid": ("post_attention_layernorm", "input_pair_sum", 0, "stream", 1.0, False),
                   "mlp_post": ("mlp.down", "input", 0, "in", 1.0, False),
                   "mlp_out": ("mlp", "output", 0, "stream", 1.0, False),
                   "resid_post": ("", "output_pair_sum", 0, "stream", 1.0, False)}


def test_branches_scaled_as_they_are_added_carry_the_scale():
    got = points(read(Model(Scaled)))
    assert got["attn_out"] == ("attention", "output", 0, "stream", 0.25, False)
    assert got["mlp_out"] == ("ffn", "output", 0, "stream", 0.25, False)
    assert got["resid_mid"][:3] == ("ln_b", "input", 0) and got["resid_pre"][:3] == ("", "input", 1)


def test_a_parallel_block_has_no_resid_mid_and_an_ignored_residual_is_not_summed():
    reading = read(Model(Parallel))
    got = points(reading)
    assert got["resid_pre"][:3] == ("", "input", 1) and got["resid_post"][:2] == ("", "output")
    assert got["attn_out"][:2] == ("attn", "output") and got["mlp_out"][:2] == ("mlp", "output")
    assert "resid_mid" not in got and "parallel" in reading.refused["resid_mid"]


def test_post_branch_norms_under_any_name_give_out_and_raw_in_the_batched_layout():
    got = points(read(Model(Sandwich)))
    assert got["attn_out"] == ("after_attn", "output", 0, "stream", 1.0, True)
    assert got["attn_raw"] == ("attn", "output", 0, "stream", 1.0, True)
    assert got["mlp_out"][:2] == ("after_mixer", "output") and got["mlp_raw"][:2] == ("mixer", "output")
    assert got["resid_mid"] == ("mixer", "input", 0, "stream", 1.0, True)
    assert got["resid_pre"] == ("", "input", 0, "stream", 1.0, True)


def test_a_mixture_of_experts_gives_its_router_and_says_why_there_is_no_mlp_post():
    reading = read(Model(lambda: Fused(Moe), FusedNorm))
    got = points(reading)
    assert got["router"] == ("mlp.router", "output", 0, "out", 1.0, False)
    assert "mlp_post" not in got and "mixture of experts" in reading.refused["mlp_post"]


def test_blocks_whose_stream_does_not_chain_are_refused_by_name():
    class Broken(Scaled):
        def forward(self, positions, hidden_states):
            return super().forward(positions, hidden_states) * 0.5 + 1.0  # what leaves is not what enters next

    class Chained(Model):
        def forward(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                layer(None, x)
                x = x + 1.0
            return self.norm(x)

    with pytest.raises(ValueError, match="no reading of its decoder blocks' .* carries the stream"):
        read(Chained(Broken))


def test_blocks_called_by_keyword_only_are_read_and_steered_through_their_keyword_arguments():
    model = KeywordModel(Fused, FusedNorm)
    got = points(read(model))
    assert got["resid_pre"] == ("", "input_pair_sum", 1, "stream", 1.0, False)  # (positions, hidden_states, residual)
    site, bias, seen = hp.Site("input_pair_sum", 1), torch.randn(TOKENS, WIDTH), []

    def steer(module, args, kwargs):
        arguments, _ = hp.replace_input(site, hp.call_arguments(args, kwargs), torch.ones(TOKENS, WIDTH), bias)
        return hp.split_arguments(arguments, args, kwargs)

    def look(module, args, kwargs):
        seen.append(hp.read_input(site, hp.call_arguments(args, kwargs)).clone())

    ids = torch.randint(0, 32, (TOKENS,))
    with torch.no_grad():
        handle = model.layers[1].register_forward_pre_hook(look, with_kwargs=True)
        torch.manual_seed(1), model(ids)  # the same random attention outputs each time
        steered = model.layers[1].register_forward_pre_hook(steer, with_kwargs=True, prepend=True)
        torch.manual_seed(1), model(ids)
        handle.remove(), steered.remove()
    torch.testing.assert_close(seen[1], seen[0] + bias)


def test_a_forward_that_runs_the_model_twice_reads_the_final_norm_after_the_first_runs_blocks():
    """vLLM's dummy run may run a state-space model twice, its states changed between the runs."""
    model = Model(Fused, FusedNorm)

    def forward(on_attention):
        SEEN["on_attention"] = on_attention
        with torch.no_grad():
            model(torch.randint(0, 32, (TOKENS,)))
            model(torch.randint(0, 32, (TOKENS,)))  # other tokens: nothing of this run matches the first

    reading = reader.read(model, "layers", model.layers, "norm", (("embed", "embed_tokens"),), WIDTH, "float32", forward)
    assert points(reading)["resid_post"][:2] == ("", "output_pair_sum")


def test_constants_are_fitted_on_the_rows_finite_everywhere():
    """A state-space layer's dummy forward reads uninitialised state: NaN rows must neither stop a fit
    (LAPACK rejects them) nor decide it."""
    from inspector.plugin.reader import _fit, _fit_two

    generator = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(6, 8, generator=generator) for _ in range(3))
    target = base + 0.5 * a + 2.0 * b
    for tensor in (target, base, a, b):
        tensor[1] = float("nan")
    assert _fit_two(target, base, a, b, 1e-5) == pytest.approx((0.5, 2.0))
    assert _fit(base + 0.25 * a, base, a, 1e-5) == pytest.approx(0.25)
