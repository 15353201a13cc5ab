"""The Features tab without Qt (``viewer.features``): the rows are the request's strongest features by
their largest activation, each cell the activation the engine sent for that token (blank where the
feature is not among its strongest), the read-out names the token, feature, value and rank, and where
there is nothing to show the message says why (no SAE, nothing generated yet, a capture without
features)."""

import numpy as np
import pytest

from inspector.core.hooks import HookPoint
from inspector.core.run import FeatureRows, RequestCapture, Run
from inspector.core.sae import AttachedSae, SaeConfig
from inspector.viewer.features import (ACTIVATION, NO_SAE, FeatureGrid, recorded_saes, show_features,
                                       strongest_features)
from inspector.viewer.run_view import RunSource, RunView

IDS = np.array([[5, 2, -1], [2, 9, 5], [7, -1, -1], [-1, -1, -1]], np.int32)
ACTS = np.array([[3.0, 1.0, 0], [4.0, 2.0, 0.5], [1.5, 0, 0], [0, 0, 0]], np.float32)
TEXTS = [" the", " cat", "\n", " sat", " on"]
HOOK = HookPoint("model.layers.1.resid_post", "blocks.1.hook_resid_post", "model.layers.1", "resid_post", 16, 1,
                 "float32")


def grid(**kw) -> FeatureGrid:
    return FeatureGrid("sae", [0, 1, 2, 3], IDS, ACTS, TEXTS, **kw)


def attached(name="mysae", k=8) -> AttachedSae:
    return AttachedSae(SaeConfig(f"/saes/{name}", "topk", 16, 512, HOOK.alias, 8), HOOK.name, k)


def run_with(features: dict[str, tuple] | None = None) -> Run:
    """One request, req0, with the given features (SAE name -> (ids, activations))."""
    run = Run(metadata={"model": "synthetic"}, hooks={HOOK.name: HOOK})
    req = RequestCapture("req0", "prompt", [1, 2], {"max_tokens": 3}, generated_token_ids=[3, 4, 5],
                         token_texts=list(TEXTS))
    for name, (ids, acts) in (features or {}).items():
        req.features[name] = FeatureRows(ids.shape[1])
        req.features[name].append(np.arange(len(ids)), ids, acts)
    run.requests["req0"] = req
    return run


def test_the_rows_are_the_strongest_features_by_their_largest_activation():
    g = grid()
    assert g.features.tolist() == [2, 5, 9, 7] and g.labels == ["f2", "f5", "f9", "f7"]
    assert g.shape == (4, 4) and g.k == 3 and g.peak == 4.0
    np.testing.assert_array_equal(g.dense, [[1.0, 4.0, 0, 0], [3.0, 0.5, 0, 0], [0, 2.0, 0, 0], [0, 0, 1.5, 0]])
    np.testing.assert_array_equal(g.ranks, [[1, 0, -1, -1], [0, 2, -1, -1], [-1, 1, -1, -1], [-1, -1, 0, -1]])
    assert grid(max_rows=2).features.tolist() == [2, 5]
    ties = np.array([[4, 3]], np.int32), np.array([[1.0, 1.0]], np.float32)
    assert strongest_features(*ties, 5).tolist() == [3, 4]  # equal peaks: the lower id first
    assert strongest_features(np.full((2, 3), -1, np.int32), np.zeros((2, 3), np.float32), 5).tolist() == []


def test_cells_are_blank_where_a_feature_is_not_among_a_tokens_strongest():
    g = grid()
    colours = g.colour_values(ACTIVATION)
    assert np.array_equal(np.isfinite(colours), g.ranks >= 0) and np.nanmax(colours) == 1.0 == colours[0, 1]
    assert colours[1, 0] == pytest.approx(0.75)
    assert g.cell_text(ACTIVATION, 0, 1) == "4.00" and g.cell_text(ACTIVATION, 0, 2) == ""
    assert [g.input(c) for c in range(4)] == [" the", " cat", "↵", " sat"]


def test_the_readout_names_the_token_the_feature_its_value_and_rank():
    g = grid()
    assert g.describe(0, 1) == "' cat' (position 1): feature f2 = 4.000, #1 of this token's strongest"
    assert g.describe(1, 1) == "' cat' (position 1): feature f5 = 0.500, #3 of this token's strongest"
    # fewer active than k: every active feature arrived, so one not listed is 0 there
    assert g.describe(3, 0) == "' the' (position 0): feature f7 is not active (this token has 2 active features)"
    full = FeatureGrid("sae", [1, 2], IDS[1:3], ACTS[1:3], TEXTS)  # the first token's k slots are all taken
    assert full.describe(full.row_of(7), 0) == "' cat' (position 1): feature f7 is not among this token's 3 strongest"


def test_a_tokens_strongest_features_and_a_features_trace():
    g = grid()
    assert g.token_features(1) == [(2, 4.0), (9, 2.0), (5, 0.5)] and g.token_features(3) == []
    np.testing.assert_array_equal(g.trace(5), [3.0, 0.5, 0, 0])
    np.testing.assert_array_equal(g.trace(100), [0, 0, 0, 0])  # any feature, shown or not
    assert (g.row_of(9), g.row_of(100), g.row_of(None)) == (2, None, None)
    assert (g.column_of(2), g.column_of(7), g.column_of(None)) == (2, None, None)


def test_the_placement_equals_a_plain_loop_on_a_large_random_request():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(300, 16, replace=False) for _ in range(50)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    acts = np.where(ids >= 0, rng.random(ids.shape), 0).astype(np.float32)
    g = FeatureGrid("sae", np.arange(50), ids, acts, ["t"] * 50)
    assert g.shape == (40, 50)
    for r, feature in enumerate(g.features):
        for c in range(50):
            hits = np.flatnonzero(ids[c] == feature)
            assert g.dense[r, c] == (acts[c, hits[0]] if len(hits) else 0)
            assert g.ranks[r, c] == (hits[0] if len(hits) else -1)
    peaks = {f: acts[ids == f].max() for f in np.unique(ids[ids >= 0])}
    shown = [peaks[f] for f in g.features]
    left_out = [p for f, p in peaks.items() if f not in g.features]
    assert shown == sorted(shown, reverse=True) and min(shown) >= max(left_out)


def test_the_grid_shows_the_chosen_sae_or_the_first_there_is():
    run = run_with({"a": (IDS, ACTS), "b": (IDS[:, :2], ACTS[:, :2])})
    view = RunView(run, RunSource.FILE, "x.h5")
    shown = show_features(view, "req0", "b")
    assert (shown.message, shown.saes, shown.sae, shown.grid.k, shown.about) == ("", ("a", "b"), "b", 2,
                                                                               "top 2 per token")
    assert show_features(view, "req0", "gone").sae == "a"
    live = RunView(run, RunSource.LIVE)
    shown = show_features(live, "req0", None, {"mysae": attached()})
    assert shown.saes == ("mysae", "a", "b") and shown.sae == "mysae"  # attached first
    assert shown.about == "blocks.1.hook_resid_post · 512 features · top 8 per token"


def test_the_sae_a_run_lists_in_its_metadata_describes_its_features():
    run = run_with({"a": (IDS, ACTS)})
    run.metadata["saes"] = [attached("a", k=3).as_dict(), {"broken": True}]
    view = RunView(run, RunSource.FILE, "x.h5")
    assert list(recorded_saes(view)) == ["a"]  # an entry that does not parse is left out
    assert show_features(view, "req0", None).about == "blocks.1.hook_resid_post · 512 features · top 3 per token"


def test_where_there_is_nothing_to_show_the_message_says_why():
    live = RunView(run_with(), RunSource.LIVE)
    assert show_features(live, "req0", None).message == NO_SAE
    assert show_features(live, None, None, {"mysae": attached()}).message == \
        "SAE mysae is attached: generate to see its features"
    shown = show_features(live, "req0", None, {"mysae": attached()})
    assert shown.grid is None and shown.message.startswith("No features of SAE mysae for request req0 yet")
    other = show_features(RunView(run_with({"a": (IDS, ACTS)}), RunSource.LIVE), "req0", None,
                          {"mysae": attached()})
    assert other.sae == "mysae" and other.grid is None  # the attached one, though only another has features here
    assert show_features(RunView(run_with(), RunSource.FILE, "x.h5"), "req0", None).message.startswith(
        "This capture holds no SAE features")
    assert show_features(RunView(run_with(), RunSource.EARLIER), "req0", None).message.startswith(
        "No SAE was attached while this run was captured")
    no_tokens = run_with({"a": (IDS[:0], ACTS[:0])})
    assert "has no features of SAE a" in show_features(RunView(no_tokens, RunSource.FILE), "req0", None).message
