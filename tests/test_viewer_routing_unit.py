"""The Experts tab without Qt (``viewer.routing``): an expert per row and a token per column, each
token's chosen experts filled with the weights ``capture.routing.route`` gives them, every router
logit in logit mode, and in words why there is nothing to show when there is nothing."""

import numpy as np

from inspector.core.routing import Routing, route
from inspector.viewer.routing import LOGIT, WEIGHT, router_layers, show_experts
from inspector.viewer.run_view import RunSource, RunView
from moe_runs import moe_run, router_logits, router_point

TOP2 = Routing(experts=4, top_k=2, renormalize=True)


def file_view(run):
    return RunView(run, RunSource.FILE, "moe.h5")


def test_the_grid_is_each_tokens_chosen_experts_and_their_weights():
    run = moe_run({1: TOP2, 3: TOP2})
    shown = show_experts(file_view(run), "req0", None)
    positions, logits, hook = router_logits(run, 1)
    ids, weights = route(logits, TOP2)
    grid = shown.grid
    assert (shown.message, shown.layers, shown.layer) == ("", (1, 3), 1) and grid.hook == hook
    assert grid.shape == (4, len(positions)) and grid.labels == [f"expert {e}" for e in range(4)]
    colours = grid.colour_values(WEIGHT)
    for c in range(len(positions)):
        assert sorted(np.flatnonzero(np.isfinite(colours[:, c]))) == sorted(ids[c])
        np.testing.assert_array_equal(grid.dense[ids[c], c], weights[c])
    assert np.nanmax(colours) == 1.0 and np.isfinite(grid.colour_values(LOGIT)).all()
    np.testing.assert_array_equal(grid.logits, logits.T)
    assert grid.cell_text(LOGIT, 2, 5) == f"{logits[5, 2]:.2f}"
    assert grid.input(2) == " sat"
    assert f"chosen, weight {weights[4, 0]:.4f} (#1 of 2)" in grid.describe(int(ids[4, 0]), 4)
    other = next(e for e in range(4) if e not in ids[4])
    assert grid.describe(other, 4).endswith(f"not chosen; router logit {logits[4, other]:.4f}")


def test_another_layer_and_an_unknown_layer():
    run = moe_run({1: TOP2, 3: TOP2})
    assert show_experts(file_view(run), "req0", 3).grid.hook.layer == 3
    assert show_experts(file_view(run), "req0", 7).layer == 1  # not captured: the first layer
    assert router_layers(list(run.hooks.values())) == [1, 3]


def test_a_rule_that_cannot_be_recomputed_leaves_only_the_logits():
    run = moe_run({2: Routing(experts=4, top_k=2, unsupported="a custom routing function")})
    grid = show_experts(file_view(run), "req0", None).grid
    assert grid.why_no_choice == "a custom routing function"
    assert np.isnan(grid.colour_values(WEIGHT)).all() and grid.cell_text(WEIGHT, 0, 0) == ""
    assert np.isfinite(grid.colour_values(LOGIT)).all()
    assert "choice not recomputed (a custom routing function)" in grid.describe(0, 0)
    assert show_experts(file_view(moe_run({2: None})), "req0", None).grid.why_no_choice == \
           "the capture says nothing of the layer's routing rule"


def test_nothing_to_show_is_said_in_words():
    run = moe_run({})
    assert show_experts(file_view(run), None, None).message == "No request to show"
    assert "This capture holds no router logits" in show_experts(file_view(run), "req0", None).message
    live = RunView(run, RunSource.LIVE)
    assert "This model has no mixture-of-experts layers" in show_experts(live, "req0", None).message
    offered = RunView(run, RunSource.LIVE, catalogue=list(run.hooks.values()) + [router_point(5, TOP2)])
    assert show_experts(offered, "req0", None).message == \
           "No router logits captured for request req0: tick blocks.N.mlp.hook_router in the model tree (layers 5)"
