"""Expert choice recomputed from router logits (inspector/core/routing.py) against vLLM's own CPU
routers, for each routing rule it describes, and the boot probe's check of a rule against the router."""

import numpy as np
import pytest
import torch
from torch import nn

from inspector.core.hooks import HookPoint
from inspector.core.routing import Routing, dense_weights, route
from inspector.plugin.hookpoints import Site


def _dense(ids, weights, experts):
    return dense_weights(np.asarray(ids), np.asarray(weights, np.float32), experts)


def vllm_choice(logits: np.ndarray, routing: Routing) -> np.ndarray:
    """What vLLM's CPU router functions choose, as [tokens, experts] weights."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    x = torch.from_numpy(logits)
    if routing.groups or routing.scoring != "softmax" or routing.correction_bias:
        bias = torch.tensor(routing.correction_bias) if routing.correction_bias else None
        weights, ids = cpu_router._grouped_topk(x, routing.top_k, routing.renormalize, routing.groups or 1,
                                                routing.groups_kept or 1, routing.scoring, routing.scaling, bias)
    else:
        weights, ids = cpu_router._softmax_topk(x, routing.top_k, routing.renormalize)
    return _dense(ids.numpy(), weights.numpy(), routing.experts)


RULES = {
    "softmax top-2 (Mixtral, OLMoE)": Routing(8, 2, renormalize=False),
    "softmax top-2, renormalised (Qwen3-MoE)": Routing(8, 2, renormalize=True),
    "sigmoid, grouped, corrected, scaled (DeepSeek-V3)": Routing(
        16, 4, "sigmoid", True, groups=4, groups_kept=2, scaling=2.5,
        correction_bias=tuple(np.random.default_rng(1).normal(0, 0.1, 16).astype(np.float32).tolist())),
    "softmax, grouped (DeepSeek-V2)": Routing(16, 3, groups=8, groups_kept=3, scaling=1.0),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_the_recomputed_choice_is_vllms(rule):
    routing = RULES[rule]
    logits = np.random.default_rng(0).normal(0, 2, (64, routing.experts)).astype(np.float32)
    ids, weights = route(logits, routing)
    assert ids.shape == weights.shape == (64, routing.top_k) and ids.dtype == np.int32
    assert np.all(np.diff(weights, axis=1) <= 0)  # strongest first
    np.testing.assert_allclose(_dense(ids, weights, routing.experts), vllm_choice(logits, routing), atol=1e-6)


def test_a_rule_it_cannot_recompute_or_logits_of_the_wrong_width_are_refused():
    with pytest.raises(ValueError, match="cannot be recomputed: a custom routing function"):
        route(np.zeros((2, 4), np.float32), Routing(4, 2, unsupported="a custom routing function"))
    with pytest.raises(ValueError, match=r"router logits \[tokens, 4\] expected, got \[2, 5\]"):
        route(np.zeros((2, 5), np.float32), Routing(4, 2))


class _Router:
    """Stands for vLLM's router: chooses by ``rule`` (which may differ from what the catalogue says)."""

    def __init__(self, rule: Routing):
        self.rule, self.top_k = rule, rule.top_k

    def select_experts(self, hidden, logits):
        ids, weights = route(logits.numpy(), self.rule)
        return torch.from_numpy(weights), torch.from_numpy(ids)


class _MoeBlock(nn.Module):
    def __init__(self, rule: Routing):
        super().__init__()
        self.gate, self.experts = nn.Linear(8, rule.experts, bias=False), nn.Module()
        self.experts.router = _Router(rule)

    def forward(self, x):
        return self.gate(x)


@pytest.mark.parametrize("actual, verdict", [(Routing(4, 2, renormalize=True), ""),
                                             (Routing(4, 2, renormalize=False), "weighs the chosen experts unlike"),
                                             (Routing(4, 1, renormalize=True), "chooses other experts")])
def test_the_boot_probe_keeps_a_rule_only_where_the_router_itself_agrees(actual, verdict):
    from inspector.plugin.probe import verify

    torch.manual_seed(0)
    model = nn.Module()
    model.moe = _MoeBlock(actual)
    point = HookPoint("moe.gate.router", "blocks.0.mlp.hook_router", "moe.gate", "router", 4, 0,
                      routing=Routing(4, 2, renormalize=True))
    found = verify(model, [(point, Site("output"))], "float32", lambda: model.moe(torch.randn(6, 8)))
    assert not found.withdrawn
    if verdict:
        assert verdict in found.unrouted[point.name].unsupported
    else:
        assert not found.unrouted
