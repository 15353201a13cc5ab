"""The router point in the eager flavour, where hooks run as Python on every forward and can be added
to a running engine: on the tiny OLMoE (every block a mixture of experts, weights not renormalised),
router hooks added after boot read what transformers' routers choose from, and a bias there steers."""

import numpy as np

import hf_reference
from engines import booted, generate, rpc
from inspector.core.hooks import ROUTER_KIND, HookPoint
from inspector.core.routing import dense_weights, route

PROMPT = "class Stack:\n    def push(self, item):"


def test_router_hooks_added_to_a_running_eager_engine_read_and_steer_the_routing(tiny_models):
    with booted(tiny_models["olmoe"], mode="eager") as llm:
        assert not rpc(llm, "inspector_describe")["installed"]
        added = rpc(llm, "inspector_set_hook_patterns", ["blocks.*.mlp.hook_router"])
        points = {p["name"]: HookPoint.from_dict(p) for p in rpc(llm, "inspector_describe")["hook_points"]}
        routers = {points[name].layer: points[name] for name in added}
        assert sorted(routers) == [0, 1] and all(p.kind == ROUTER_KIND for p in routers.values())
        tokens, caps = generate(llm, [PROMPT], max_tokens=4)
        (rid, (prompt_ids, gen_ids)), = tokens.items()
        expected = hf_reference.expert_choice(tiny_models["olmoe"], (prompt_ids + gen_ids)[:-1])
        for layer, router in routers.items():
            ids, weights = route(caps[rid][router.name]["values"], router.routing)
            np.testing.assert_allclose(dense_weights(ids, weights, 4), dense_weights(*expected[layer], 4), atol=1e-5)

        bias = np.array([0, 0, 20, 0], np.float32)
        rpc(llm, "inspector_set_interventions", [{"hook": routers[1].name, "bias": bias.tolist()}])
        _, caps = generate(llm, [PROMPT], max_tokens=4)
        (rows,) = caps.values()
        assert (route(rows[routers[1].name]["values"], routers[1].routing)[0] == 2).any(axis=1).all()
        assert not (route(rows[routers[0].name]["values"], routers[0].routing)[0] == 2).any(axis=1).all()  # before it
