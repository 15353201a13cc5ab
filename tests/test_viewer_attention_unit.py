"""The Attention tab's logic without Qt: patterns grown query by query equal one computation of them,
a repaint with no new rows computes nothing, and every reason for showing no pattern is put in words
that say what to do."""

from dataclasses import replace

import numpy as np
import pytest

import inspector.viewer.attention as attention
from fake_session import llama_catalogue
from inspector.core.attention import AttentionGeometry, attention_weights
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.viewer.attention import AttentionPatterns, HeadPattern, attention_layers
from inspector.viewer.run_view import RunSource, RunView

CATALOGUE = llama_catalogue(layers=2, hidden=128)
QK = {h.name: h for h in CATALOGUE if h.kind in ("q", "k")}
GEOMETRY = next(iter(QK.values())).attention


def live_view(kinds=("q", "k"), tokens=10, catalogue=CATALOGUE) -> RunView:
    """A live run of one request whose rows of ``kinds`` hold ``tokens`` random rows."""
    hooks = {h.name: h for h in catalogue if h.kind in kinds}
    view = RunView(Run(metadata={}, hooks=dict(hooks)), RunSource.LIVE, catalogue=catalogue)
    req = RequestCapture("r", "p", list(range(4)), {"max_tokens": 12}, token_texts=[f"t{i}" for i in range(16)])
    for name, h in hooks.items():
        req.hooks[name] = HookRows(h.width)
    view.run.requests["r"] = req
    add_rows(view, 0, tokens)
    return view


def add_rows(view, first, last):
    rng = np.random.default_rng(first)
    for name, rows in view.run.requests["r"].hooks.items():
        positions = np.arange(first, last)
        rows.append(positions, positions, rng.normal(size=(len(positions), rows.width)).astype(np.float32))


@pytest.mark.parametrize("geometry", [AttentionGeometry(4, 2, 16, 0.25), AttentionGeometry(4, 1, 16, 0.25, 3, 5.0)],
                         ids=["grouped", "windowed, soft-capped"])
def test_a_pattern_grown_query_by_query_equals_one_computation(geometry):
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(30, geometry.q_width)), rng.normal(size=(30, geometry.k_width))
    positions = np.arange(30)
    pattern = HeadPattern(8)  # grows past its room twice
    for n in (1, 2, 7, 8, 20, 30):
        grown = pattern.grow(positions[:n], q[:n], positions[:n], k[:n], geometry, head=3)
    np.testing.assert_allclose(grown, attention_weights(q, positions, k, positions, geometry, [3])[0], atol=1e-6)


def test_a_repaint_computes_only_the_new_queries(monkeypatch):
    calls = []

    def counted(q, *args, **kwargs):
        calls.append(len(q))
        return attention_weights(q, *args, **kwargs)

    monkeypatch.setattr(attention, "attention_weights", counted)
    view, patterns = live_view(), AttentionPatterns()
    first = patterns.show(view, "r", 1, 1, None)
    before = first.pattern.copy()
    assert calls == [10, 1] and first.query == 9  # the pattern, then the newest token's row of every head
    assert patterns.show(view, "r", 1, 1, None).pattern.shape == (10, 10) and calls == [10, 1]
    add_rows(view, 10, 11)
    grown = patterns.show(view, "r", 1, 1, None)
    assert calls == [10, 1, 1, 1] and grown.pattern.shape == (11, 11) and grown.query == 10
    np.testing.assert_array_equal(grown.pattern[:10], np.pad(before, ((0, 0), (0, 1))))  # earlier rows: as they were
    patterns.show(view, "r", 1, 1, 4)  # another token: its row of every head, nothing else
    assert calls[4:] == [1]


def test_the_selected_tokens_weights_cover_the_tokens_up_to_it():
    view = live_view()
    shown = AttentionPatterns().show(view, "r", 0, 0, 3)
    req, geometry = view.run.requests["r"], GEOMETRY
    q, k = req.hooks["model.layers.0.self_attn.attn.q"], req.hooks["model.layers.0.self_attn.attn.k"]
    expected = attention_weights(q.values[3:4], [3], k.values[:4], np.arange(4), geometry)[:, 0]
    np.testing.assert_array_equal(shown.query_weights, expected)
    assert shown.describe(1, 3, 2) == f"head 1 · token 3 't3' → 2 't2': weight {expected[1, 2]:.4f}"
    assert shown.describe(0, 2, 5).endswith("a later token, never attended to")


def test_layers_offered_are_those_with_queries_or_keys():
    assert attention_layers(CATALOGUE) == [0, 1]
    assert attention_layers([h for h in CATALOGUE if h.kind == "resid_post"]) == []


def test_without_queries_and_keys_the_message_says_what_to_tick():
    view = live_view(kinds=("resid_post",))
    shown = AttentionPatterns().show(view, "r", None, 0, None)
    assert "tick blocks.N.attn.hook_q and blocks.N.attn.hook_k" in shown.message
    assert {h.name for h in shown.to_capture} == set(QK)
    again = AttentionPatterns().show(view, "r", None, 0, None, capturing=set(QK))
    assert "captured from now on: generate again" in again.message and not again.to_capture


def test_a_layer_missing_its_keys_names_the_hook_to_tick():
    view = live_view(kinds=("q",))
    shown = AttentionPatterns().show(view, "r", 1, 0, None)
    assert shown.message == ("Layer 1 has its queries captured but not its keys: tick blocks.1.attn.hook_k in the "
                             "model tree")
    assert [h.alias for h in shown.to_capture] == ["blocks.1.attn.hook_k"]


def test_a_model_without_query_and_key_points_is_said_to_have_none():
    catalogue = [h for h in CATALOGUE if h.kind not in ("q", "k")]
    shown = AttentionPatterns().show(live_view(kinds=("resid_post",), catalogue=catalogue), "r", None, 0, None)
    assert "This model offers no attention query and key hook points" in shown.message and not shown.to_capture


@pytest.mark.parametrize("geometry, reason", [
    (None, "says nothing of its attention's geometry"),
    (replace(GEOMETRY, unsupported="attention sinks"), "cannot be recomputed: attention sinks")])
def test_a_layer_without_a_faithful_pattern_says_why(geometry, reason):
    catalogue = [replace(h, attention=geometry) if h.kind in ("q", "k") else h for h in CATALOGUE]
    shown = AttentionPatterns().show(live_view(catalogue=catalogue), "r", 0, 0, None)
    assert reason in shown.message and not len(shown.pattern)


def test_withdrawn_queries_and_keys_are_not_offered_and_the_reason_is_given():
    from dataclasses import replace

    reason = "the boot probe's forward never reached its hook"
    catalogue = [replace(h, withdrawn=reason) if h.kind in ("q", "k") else h for h in CATALOGUE]
    shown = AttentionPatterns().show(live_view(kinds=("resid_post",), catalogue=catalogue), "r", None, 0, None)
    assert f"withdrawn at boot: {reason}" in shown.message and not shown.to_capture


@pytest.mark.parametrize("windows, shown", [({"k": "generated"}, False), ({"q": "every:2"}, False),
                                            ({"q": "generated"}, True), ({"q": "last:3", "k": "all"}, True)])
def test_capture_windows_that_leave_out_rows_a_pattern_needs_say_so(windows, shown):
    view = live_view()
    req = view.run.requests["r"]
    layer0 = {h.kind: h for h in QK.values() if h.layer == 0}
    req.windows = {layer0[kind].name: text for kind, text in windows.items()}
    if "q" in windows and windows["q"] != "all":  # the rows the window kept
        from inspector.core.windows import CaptureWindow

        rows = req.hooks[layer0["q"].name]
        keep = CaptureWindow.parse(windows["q"]).keeps(rows.positions, len(req.prompt_token_ids))
        req.hooks[layer0["q"].name] = kept = HookRows(rows.width)
        kept.append(rows.positions[keep], rows.token_ids[keep], rows.values[keep])
    result = AttentionPatterns().show(view, "r", 0, 0, None)
    if shown:
        assert not result.message and len(result.pattern) == len(req.hooks[layer0["q"].name])
        assert result.query_positions[0] == req.hooks[layer0["q"].name].positions[0]
    else:
        assert "capture window" in result.message and "with the window 'all'" in result.message
