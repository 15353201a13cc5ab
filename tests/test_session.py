"""The session boundary. One scenario runs against the in-process engine session (a compiled tiny
Llama), against the same engine on a server (``inspector serve`` in another process, through
``inspector.client.connect``) and against the fake the app's tests drive, so they cannot drift apart
(a failure, which needs an engine of its own, is in test_session_lifecycle.py); then what only a real
engine can show: the stream equals vLLM's own generate and the plugin, files round-trip, and each
compiled hook set captures what transformers computes."""

import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

import hf_reference
from engines import (PARITY_TOL, assert_attribution_matches, assert_lens_matches, assert_windows_keep_exactly_their_rows,
                     rel_l2, rpc)
from session_kinds import GREEDY, KINDS, collect
from inspector.core.interventions import Intervention
from inspector.core.protocol import BOOT_STAGES, Sampling, fold_event
from inspector.core.run import Run
from inspector.core.windows import CaptureWindow
from inspector.client import connect
from inspector.io import read_run, write_run
from inspector.io.spool import RowSpool, SpooledHookRows

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Parser(object):"]


# ------------------------------------------------------------------------------ the contract, both kinds

@pytest.mark.parametrize("kind", KINDS)
def test_boot_reports_stages_and_the_plugins_catalogue(sessions, kind):
    session, stages = sessions[kind]
    assert [p.stage for p in stages] == list(BOOT_STAGES)
    assert set(session.installed) == {"model.layers.0.resid_post", "model.layers.1.resid_post",
                                      "model.embed_tokens.embed"}
    real = [h.as_dict() for h in sessions["real"][0].catalogue]
    assert [h.as_dict() for h in session.catalogue] == real  # the fake offers what the plugin finds
    assert {"model": session.options.model, "engine_mode": "compiled",
            "block_family": "fused (LlamaDecoderLayer), read from its forward",
            "refused_kinds": {}}.items() <= session.run.metadata.items()  # what the points follow


@pytest.mark.parametrize("kind", KINDS)
def test_events_alone_rebuild_the_run(sessions, kind):
    session, _ = sessions[kind]
    expected_ids = session.upcoming_request_ids(3)
    events = collect(session, PROMPTS)
    rebuilt = Run(metadata={})
    for event in events:
        fold_event(rebuilt, event)
    assert [s.request_id for s in events[0].started] == expected_ids == list(session.run.requests)
    assert all(re.fullmatch(r"req\d+", rid) for rid in expected_ids)
    assert not any(event.started for event in events[1:])
    assert {s.request_id for s in events[-1].requests if s.finished} <= set(expected_ids)
    assert session.upcoming_request_ids(1)[0] not in expected_ids  # ids never repeat
    for rid, req in session.run.requests.items():
        got = rebuilt.requests[rid]
        assert (got.prompt, got.token_ids, got.token_texts, got.logprobs) == \
               (req.prompt, req.token_ids, req.token_texts, req.logprobs)
        assert got.finish_reason == "length" and len(req.generated_token_ids) == 8
        assert got.intervention_log == req.intervention_log == [(0, [])]
        assert all(top and top[0].text for top in got.top_logprobs)
        for hook in session.installed:
            assert got.hooks[hook].positions.tolist() == list(range(len(req.token_ids) - 1))


@pytest.mark.parametrize("kind", KINDS)
def test_a_written_through_run_reads_back_the_rows_its_events_carried(sessions, kind, tmp_path):
    session, _ = sessions[kind]
    session.new_run()
    spool = RowSpool(tmp_path, session.run.metadata)
    session.write_through(spool.rows)
    sent = {}
    for event in session.generate(PROMPTS, GREEDY):
        for step in event.requests:
            for hook, (positions, _, values) in step.rows.items():
                sent.setdefault((step.request_id, hook), []).append((positions.copy(), values.copy()))
    assert sent
    for (rid, hook), parts in sent.items():
        rows = session.run.requests[rid].hooks[hook]
        assert isinstance(rows, SpooledHookRows)
        np.testing.assert_array_equal(rows.positions, np.concatenate([p for p, _ in parts]))
        np.testing.assert_array_equal(np.asarray(rows.values), np.concatenate([v for _, v in parts]))
    session.new_run()  # rows in memory again
    spool.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_stop_ends_every_request_in_a_final_event(sessions, kind):
    session, _ = sessions[kind]
    events = collect(session, PROMPTS[:2], Sampling(max_tokens=50, ignore_eos=True),
                     on_step=lambda ev: ev.step == 2 and session.stop())
    final = events[-1].requests
    assert {s.request_id for s in final} == set(session.run.requests)
    assert all(s.finished and s.finish_reason == "stopped" for s in final)
    for req in session.run.requests.values():
        assert req.finish_reason == "stopped" and 1 <= len(req.generated_token_ids) < 50
        rows = req.hooks["model.layers.1.resid_post"]
        assert rows.positions.tolist() == list(range(len(rows))) and len(rows) >= len(req.token_ids) - 1
    again = collect(session, PROMPTS[:1], Sampling(max_tokens=3))  # the stop does not stick
    assert again[-1].requests[-1].finish_reason == "length"


@pytest.mark.parametrize("kind", KINDS)
def test_interventions_log_from_where_they_apply(sessions, kind):
    session, _ = sessions[kind]

    def steer(event):
        if event.step == 3:
            target = event.requests[0].request_id
            session.set_interventions([Intervention("blocks.0.hook_resid_post", scale=0.0, request_id=target)])

    try:
        collect(session, PROMPTS[:2], on_step=steer)
    finally:
        session.set_interventions([])
    target, other = session.run.requests.values()
    (start, active) = target.intervention_log[-1]
    assert target.intervention_log[0] == (0, []) and other.intervention_log == [(0, [])]
    assert active == [{"hook": "model.layers.0.resid_post", "scale": 0.0, "bias": 0.0,
                       "request_id": target.request_id, "positions": None}]
    # set after step 3 (prefill, 3 decodes); a server may have stepped on before the change reached it
    n_prompt = len(target.prompt_token_ids)
    assert start == n_prompt + 3 if kind != "remote" else n_prompt + 3 <= start < len(target.token_ids) - 1
    rows = target.hooks["model.layers.0.resid_post"]
    assert not np.any(rows.values[rows.positions >= start]) and np.all(np.any(rows.values[:start], axis=1))


@pytest.mark.parametrize("kind", KINDS)
def test_bad_interventions_are_refused_at_once(sessions, kind):
    session, _ = sessions[kind]
    for bad, message in [(Intervention("blocks.7.hook_resid_post"), "not an installed hook point"),
                         (Intervention("blocks.0.hook_resid_post", scale=(1.0, 2.0)), "128 wide"),
                         (Intervention("blocks.0.hook_resid_post", bias=float("nan")), "NaN"),
                         (Intervention("blocks.0.hook_resid_post", bias=1e39), "beyond float32's range"),
                         (Intervention("blocks.0.hook_resid_post", positions=(999,)), "out of range")]:
        with pytest.raises(ValueError, match=message):
            session.set_interventions([bad])
    with pytest.raises(ValueError, match="no prompts"):
        next(session.generate([]))


@pytest.mark.parametrize("kind", KINDS)
def test_prompts_and_sampling_no_request_can_run_with_are_refused_and_the_session_goes_on(sessions, kind, monkeypatch):
    session, _ = sessions[kind]
    if kind == "remote":  # the server must refuse it too (a client of another make may not check)
        monkeypatch.setattr("inspector.client.remote.check_request", lambda prompts, sampling: None)
    for bad, message in [(dict(top_p=5.0), "top_p"), (dict(top_p=0.0), "top_p"), (dict(temperature=-1.0), "temperature"),
                         (dict(temperature=float("nan")), "temperature"), (dict(max_tokens=0), "max_tokens"),
                         (dict(top_k=-2), "top_k"), (dict(logprobs=-1), "logprobs"), (dict(seed=-5), "seed")]:
        with pytest.raises(ValueError, match=message):
            next(session.generate(["import os"], Sampling(**bad)))
        assert session.alive
    monkeypatch.undo()  # text the wire cannot carry is the client's to refuse
    with pytest.raises(ValueError, match="prompt 1 is not valid Unicode text"):
        next(session.generate(["import os", "a lone \ud800 surrogate"]))
    events = collect(session, ["import os"], Sampling(max_tokens=2, top_p=0.5, temperature=0.7, top_k=3, seed=1))
    assert events[-1].requests[0].finished


@pytest.mark.parametrize("kind", KINDS)
def test_the_lens_gives_top_tokens_and_the_chosen_tokens_rank_and_refuses_rows_that_do_not_fit(sessions, kind):
    session, _ = sessions[kind]
    collect(session, PROMPTS[:1], Sampling(max_tokens=3))
    rows = list(session.run.requests.values())[-1].hooks["model.layers.1.resid_post"].values
    lens = session.lens(rows, k=4)
    assert lens.top_ids.shape == lens.top_logprobs.shape == (len(rows), 4) and lens.chosen_ranks is None
    assert (np.diff(lens.top_logprobs, axis=1) <= 0).all() and (lens.top_logprobs <= 0).all()
    second = session.lens(rows, k=2, chosen=lens.top_ids[:, 1])
    assert second.chosen_ranks.tolist() == [1] * len(rows)
    np.testing.assert_allclose(second.chosen_logprobs, lens.top_logprobs[:, 1], rtol=1e-6)
    for bad, message in [(dict(values=rows[:, :5]), "residual-stream rows"), (dict(values=rows, k=0), "k must"),
                         (dict(values=rows * np.nan), "finite"),
                         (dict(values=rows, chosen=[10 ** 9] * len(rows)), "token ids must lie"),
                         (dict(values=rows, chosen=[1]), "one token id per row")]:
        with pytest.raises(ValueError, match=message):
            session.lens(**bad)
    assert session.lens(rows[:1], k=1).top_ids.shape == (1, 1)  # still serving
    req = list(session.run.requests.values())[-1]  # the lens names tokens by id: their texts, as events give them
    assert session.token_texts(req.generated_token_ids) == req.token_texts[len(req.prompt_token_ids):]
    with pytest.raises(ValueError, match="token ids must lie"):
        session.token_texts([10 ** 9])


@pytest.mark.parametrize("kind", KINDS)
def test_attribution_gives_each_components_top_tokens_and_refuses_rows_that_do_not_pair(sessions, kind):
    session, _ = sessions[kind]
    collect(session, PROMPTS[:1], Sampling(max_tokens=3))
    req = list(session.run.requests.values())[-1]
    embed, final = req.hooks["model.embed_tokens.embed"].values, req.hooks["model.layers.1.resid_post"].values
    first = session.attribution(embed, final, k=3)
    assert first.top_ids.shape == first.top_logits.shape == (len(embed), 3) and first.chosen_ranks is None
    assert (np.diff(first.top_logits, axis=1) <= 0).all()
    second = session.attribution(embed, final, k=1, chosen=first.top_ids[:, 2])
    assert second.chosen_ranks.tolist() == [2] * len(embed)
    np.testing.assert_allclose(second.chosen_logits, first.top_logits[:, 2], rtol=1e-6)
    for bad, message in [(dict(final_residual=final[:1]), "must pair"), (dict(values=embed[:, :5]), r"\[rows, 128\]"),
                         (dict(chosen=[-1] * len(embed)), "token ids must lie")]:
        with pytest.raises(ValueError, match=message):
            session.attribution(**{"values": embed, "final_residual": final, **bad})


@pytest.mark.parametrize("kind", ["real", "remote"])
def test_attribution_follows_transformer_lens_convention_and_the_stream_adds_up_to_the_logits(tiny_models, sessions,
                                                                                              kind):
    """The embedding, block 0's contribution and block 1's (differences of the captured stream: sums
    of components are components too) add up to the model's own logits."""
    session, _ = sessions[kind]
    collect(session, PROMPTS[1:2], Sampling(max_tokens=4, ignore_eos=True))
    req = list(session.run.requests.values())[-1]
    embed = req.hooks["model.embed_tokens.embed"].values
    resid = [req.hooks[f"model.layers.{i}.resid_post"].values for i in (0, 1)]
    chosen = np.array(req.token_ids[1:len(embed) + 1])
    total = 0
    for part in (embed, resid[0] - embed, resid[1] - resid[0]):
        got = session.attribution(part, resid[1], k=5, chosen=chosen)
        assert_attribution_matches(got.top_ids, got.top_logits,
                                   hf_reference.direct_logit_attribution(tiny_models["llama"], part, resid[1]))
        total = total + got.chosen_logits
    model = hf_reference.load(str(tiny_models["llama"]))
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(torch.from_numpy(resid[1]))).numpy()
    np.testing.assert_allclose(total, logits[np.arange(len(chosen)), chosen], atol=PARITY_TOL * np.abs(logits).max())


@pytest.mark.parametrize("kind", ["real", "remote"])
def test_the_lens_of_every_layer_is_transformers_final_norm_and_head_and_the_last_is_the_models_own(
        tiny_models, sessions, kind):
    session, _ = sessions[kind]
    collect(session, PROMPTS[:1], Sampling(max_tokens=6, ignore_eos=True, logprobs=1))
    req = list(session.run.requests.values())[-1]
    prompt_len, positions = len(req.prompt_token_ids), req.hooks["model.layers.1.resid_post"].positions
    model = hf_reference.load(str(tiny_models["llama"]))
    hidden = hf_reference.run(tiny_models["llama"], req.token_ids[:-1])["resid_post"]
    for layer in (0, 1):
        rows = req.hooks[f"model.layers.{layer}.resid_post"].values
        lens = session.lens(rows, k=5, chosen=np.array(req.token_ids[1:len(rows) + 1]))
        with torch.no_grad():
            ref = torch.log_softmax(model.lm_head(model.model.norm(torch.from_numpy(hidden[layer]))), -1).numpy()
        assert_lens_matches(lens.top_ids, lens.top_logprobs, ref)
    # the last layer's lens at the position before each generated token is that token's logprob
    own = np.array(req.logprobs)
    at = [list(positions).index(p) for p in range(prompt_len - 1, prompt_len - 1 + len(own))]
    np.testing.assert_allclose(lens.chosen_logprobs[at], own, atol=10 * PARITY_TOL)
    assert (lens.chosen_ranks[at] == 0).all()  # greedy


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_hook_change_restarts_and_keeps_the_run(sessions, kind):
    session, _ = sessions[kind]
    collect(session, PROMPTS[:1], Sampling(max_tokens=2))
    kept, first = dict(session.run.requests), list(session.options.hooks)
    session.set_interventions([Intervention("blocks.1.hook_resid_post", scale=0.5)])
    session.set_interventions([])  # not applied yet when the hooks change: it must not be lost
    try:
        assert session.set_hooks(["blocks.1.mlp.hook_post"]) is True
        assert session.interventions == []
        assert list(session.installed) == ["model.layers.1.mlp.down_proj.mlp_post"]
        assert session.run.requests.keys() == kept.keys()
        with pytest.raises(ValueError, match="matches no hook point"):
            session.set_hooks(["blocks.9.*"])
        assert session.alive
    finally:
        session.set_hooks(first)


@pytest.mark.parametrize("kind", KINDS)
def test_capture_windows_keep_exactly_their_rows_and_bad_ones_change_nothing(sessions, kind):
    session, _ = sessions[kind]
    assert session.windows == {}
    with pytest.raises(ValueError, match="not an installed hook"):
        session.set_windows({"blocks.0.hook_resid_post": CaptureWindow("generated"), "blocks.0.mlp.hook_post": "all"})
    with pytest.raises(ValueError, match="window"):
        session.set_windows({"blocks.0.hook_resid_post": "every:0"})
    assert session.windows == {}
    assert_windows_keep_exactly_their_rows(session, [PROMPTS[0], "import "], ["blocks.0.hook_resid_post", "hook_embed"])


def test_a_clients_windows_are_its_own(sessions, compiled_server):
    """Two clients of one server: one's windows never touch the other's rows."""
    windowed, _ = sessions["remote"]
    other = connect(compiled_server[0])
    try:
        windowed.set_windows({"hook_embed": CaptureWindow("generated")})
        collect(other, PROMPTS[:1], Sampling(max_tokens=3, ignore_eos=True))
        collect(windowed, PROMPTS[:1], Sampling(max_tokens=3, ignore_eos=True))
        mine, theirs = (next(iter(s.run.requests.values())) for s in (windowed, other))
        assert other.windows == {} and theirs.windows == {} and mine.windows == {"model.embed_tokens.embed": "generated"}
        n = len(theirs.prompt_token_ids)
        assert theirs.hooks["model.embed_tokens.embed"].positions.tolist() == list(range(n + 2))
        assert mine.hooks["model.embed_tokens.embed"].positions.tolist() == [n - 1, n, n + 1]
    finally:
        windowed.set_windows({})
        other.close()


# ------------------------------------------------------------------------------ what only a real engine shows

def test_stream_matches_plain_generate_and_the_plugin(sessions):
    from vllm import SamplingParams

    session, _ = sessions["real"]
    events = collect(session, PROMPTS)
    plain = session._llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    plugin_rows = rpc(session._llm, "inspector_drain")
    for req, out in zip(session.run.requests.values(), plain):
        streamed = [t for ev in events for step in ev.requests if step.request_id == req.request_id
                    for t in step.new_token_ids]
        assert streamed == req.generated_token_ids == list(out.outputs[0].token_ids)
        assert req.prompt_token_ids == list(out.prompt_token_ids)  # tokenized as vLLM does
        assert np.all(np.array(req.logprobs) <= 0)
        for hook, rows in req.hooks.items():
            np.testing.assert_array_equal(rows.values, plugin_rows[out.request_id].rows[hook]["values"])


def test_hdf5_round_trip_is_bit_for_bit(sessions, tmp_path):
    session, _ = sessions["real"]
    collect(session, PROMPTS)
    path = write_run(session.run, tmp_path / "run.h5")
    back = read_run(path)
    assert back.metadata["engine_mode"] == "compiled" and back.metadata["model_path"] == str(session.model_path)
    assert back.hooks == session.run.hooks
    for rid, req in session.run.requests.items():
        got = back.requests[rid]
        assert (got.prompt, got.token_ids, got.token_texts) == (req.prompt, req.token_ids, req.token_texts)
        assert got.logprobs == req.logprobs and got.top_logprobs == req.top_logprobs
        assert got.finish_reason == req.finish_reason
        for hook, rows in req.hooks.items():
            np.testing.assert_array_equal(np.asarray(got.hooks[hook].values), rows.values)
            np.testing.assert_array_equal(got.hooks[hook].positions, rows.positions)
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True)
        assert out.returncode == 0 and "resid_post" in out.stdout


def test_each_compiled_hook_set_captures_what_transformers_computes(tiny_models, sessions):
    """Each hook set boots its own compiled graph, and vLLM's compile cache keeps them apart: the
    switch back to the first set boots with that set's cache entry already there."""
    session, _ = sessions["real"]
    first = list(session.options.hooks)
    try:
        session.set_hooks(["blocks.1.mlp.hook_post"])
        _assert_matches_transformers(tiny_models["llama"], session, "model.layers.1.mlp.down_proj.mlp_post",
                                     lambda ref: ref["mlp_post"][1])
    finally:
        session.set_hooks(first)
    _assert_matches_transformers(tiny_models["llama"], session, "model.layers.1.resid_post",
                                 lambda ref: ref["resid_post"][1])


def _assert_matches_transformers(model_dir, session, hook, expected):
    collect(session, PROMPTS[:1], Sampling(max_tokens=3))
    req = list(session.run.requests.values())[-1]
    assert set(req.hooks) == set(session.installed)
    rows = req.hooks[hook]
    ref = expected(hf_reference.run(model_dir, req.token_ids[:-1]))
    assert rows.positions.tolist() == list(range(len(ref)))
    assert rel_l2(rows.values, ref).max() < 3 * PARITY_TOL
