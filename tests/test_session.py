"""The engine session on a real compiled engine (tiny Llama): the step stream, stop, interventions
between steps, HDF5 round trip, and a compiled-mode hook change (which restarts the engine)."""

import shutil
import subprocess

import numpy as np
import pytest

import hf_reference
from engines import ENGINE_ARGS, PARITY_TOL, rel_l2, rpc
from inspector.engine import Intervention
from inspector.engine.session import Sampling, Session, SessionError, SessionOptions
from inspector.io.hdf5 import read_run, write_run

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Parser(object):"]
GREEDY = Sampling(max_tokens=8, ignore_eos=True)
stages = []


@pytest.fixture(scope="module")
def session(tiny_models):
    s = Session.open(SessionOptions(model=str(tiny_models["llama"]), max_model_len=256, max_num_batched_tokens=64,
                                    hooks=("blocks.*.hook_resid_post", "hook_embed"), engine_args=ENGINE_ARGS),
                     stages.append)
    yield s
    s.close()


def collect(session, prompts, sampling=GREEDY, on_step=None):
    session.new_run()
    events = []
    for event in session.generate(prompts, sampling):
        events.append(event)
        if on_step:
            on_step(event)
    return events


def test_boot_reports_stages_in_order(session):
    assert [p.stage for p in stages] == ["resolving", "loading", "compiling", "ready"]
    assert set(session.installed) == {"model.layers.0.resid_post", "model.layers.1.resid_post", "model.embed_tokens.embed"}
    assert {h.alias for h in session.catalogue} >= {"blocks.1.hook_resid_mid", "ln_final.hook_normalized"}


def test_catalogue_tree_mirrors_the_module_tree(session):
    tree = session.catalogue_tree()
    layer = tree["model"]["layers"]["1"]
    assert [h.kind for h in layer["hooks"]] == ["resid_pre", "resid_post"]
    assert [h.kind for h in layer["self_attn"]["hooks"]] == ["attn_out"]
    assert [h.kind for h in layer["mlp"]["down_proj"]["hooks"]] == ["mlp_post"]
    assert sum(1 for _ in _walk(tree)) == len(session.catalogue)


def _walk(node):
    for key, child in node.items():
        yield from (child if key == "hooks" else _walk(child))


def test_stream_matches_plain_generate_and_the_plugin(session):
    from vllm import SamplingParams

    events = collect(session, PROMPTS)
    plain = session._llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    plugin_rows = rpc(session._llm, "inspector_drain")
    run = session.run
    assert len(run.requests) == 3
    for req, out in zip(run.requests.values(), plain):
        streamed = [t for ev in events for step in ev.requests if step.request_id == req.request_id
                    for t in step.new_token_ids]
        assert streamed == req.generated_token_ids == list(out.outputs[0].token_ids)
        assert req.prompt_token_ids == list(out.prompt_token_ids)
        assert len(req.token_texts) == len(req.token_ids) and len(req.logprobs) == 8
        assert all(len(top) >= 1 for top in req.top_logprobs) and np.all(np.array(req.logprobs) <= 0)
        assert req.finish_reason == "length"
        plain_rows = next(v for k, v in plugin_rows.items() if k == out.request_id)
        for hook, rows in req.hooks.items():
            assert rows.positions.tolist() == list(range(len(req.token_ids) - 1))
            np.testing.assert_array_equal(rows.values, plain_rows[hook]["values"])
            streamed_rows = np.concatenate([step.rows[hook][2] for ev in events for step in ev.requests
                                            if step.request_id == req.request_id and hook in step.rows])
            np.testing.assert_array_equal(streamed_rows, rows.values)


def test_stop_mid_generation_keeps_what_was_captured(session):
    events = collect(session, PROMPTS[:2], Sampling(max_tokens=50, ignore_eos=True),
                     on_step=lambda ev: ev.step == 2 and session.stop())
    assert events[-1].requests and all(s.finished and s.finish_reason == "stopped" for s in events[-1].requests)
    for req in session.run.requests.values():
        assert req.finish_reason == "stopped"
        assert 1 <= len(req.generated_token_ids) < 50
        rows = req.hooks["model.layers.1.resid_post"]
        assert rows.positions.tolist() == list(range(len(rows)))
        assert len(rows) >= len(req.token_ids) - 1
        streamed = [pos for ev in events for step in ev.requests if step.request_id == req.request_id
                    for pos in step.rows.get("model.layers.1.resid_post", ((), (), ()))[0]]
        assert streamed == rows.positions.tolist()  # the events alone carry every row, the last ones too
    again = collect(session, PROMPTS[:1], Sampling(max_tokens=3))  # the stop does not stick
    assert again[-1].requests[0].finished and session.run.requests[again[0].requests[0].request_id].finish_reason


def test_interventions_between_steps_change_only_later_tokens(session):
    collect(session, PROMPTS[:2])
    clean = {r.prompt: r for r in session.run.requests.values()}
    hook = "blocks.0.hook_resid_post"

    def steer(event):
        if event.step == 3:
            session.set_interventions([Intervention(hook, scale=0.0, request_id=event.requests[0].request_id)])

    collect(session, PROMPTS[:2], on_step=steer)
    session.set_interventions([])
    steered = {r.prompt: r for r in session.run.requests.values()}
    target, other = steered[PROMPTS[0]], steered[PROMPTS[1]]
    start, active = target.intervention_log[-1]
    assert active and active[0]["scale"] == 0.0 and target.intervention_log[0] == (0, [])
    n_prompt = len(target.prompt_token_ids)
    assert start == n_prompt + 3  # set after step 3 (prefill, 3 decodes): applies from the 4th decode
    name = session.hook_name(hook)
    got, ref = target.hooks[name].values, clean[PROMPTS[0]].hooks[name].values
    np.testing.assert_array_equal(got[:start], ref[:start])
    assert not np.any(got[start:])
    assert target.generated_token_ids[:start - n_prompt + 1] == clean[PROMPTS[0]].generated_token_ids[:start - n_prompt + 1]
    assert other.generated_token_ids == clean[PROMPTS[1]].generated_token_ids
    np.testing.assert_array_equal(other.hooks[name].values, clean[PROMPTS[1]].hooks[name].values)
    assert other.intervention_log == [(0, [])]


def test_bad_interventions_are_refused_at_once(session):
    for bad, message in [(Intervention("blocks.7.hook_resid_post"), "not an installed hook point"),
                         (Intervention("blocks.0.hook_resid_post", scale=(1.0, 2.0)), "128 wide"),
                         (Intervention("blocks.0.hook_resid_post", bias=float("nan")), "NaN"),
                         (Intervention("blocks.0.hook_resid_post", positions=(999,)), "out of range")]:
        with pytest.raises(ValueError, match=message):
            session.set_interventions([bad])
    assert session.interventions == []


def test_hdf5_round_trip_is_bit_for_bit(session, tmp_path):
    collect(session, PROMPTS)
    path = write_run(session.run, tmp_path / "run.h5")
    back = read_run(path)
    assert back.metadata["engine_mode"] == "compiled" and back.metadata["model_path"] == str(session.model_path)
    assert back.hooks.keys() == session.run.hooks.keys()
    for rid, req in session.run.requests.items():
        got = back.requests[rid]
        assert (got.prompt, got.token_ids, got.token_texts) == (req.prompt, req.token_ids, req.token_texts)
        assert got.logprobs == req.logprobs and got.finish_reason == req.finish_reason
        for hook, rows in req.hooks.items():
            np.testing.assert_array_equal(np.asarray(got.hooks[hook].values), rows.values)
            np.testing.assert_array_equal(got.hooks[hook].positions, rows.positions)
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-H", str(path)], capture_output=True, text=True)
        assert out.returncode == 0 and "resid_post" in out.stdout


def test_compiled_hook_change_restarts_the_engine(tiny_models, session):
    """Each hook set boots its own compiled graph, and vLLM's compile cache keeps them apart: the
    switch back to the first set boots with that set's cache entry already there, and both sets
    capture what transformers computes."""
    collect(session, PROMPTS[:1], Sampling(max_tokens=2))
    kept = dict(session.run.requests)
    first_hooks = tuple(session.options.hooks)
    assert session.set_hooks(["blocks.1.mlp.hook_post"]) is True
    assert list(session.installed) == ["model.layers.1.mlp.down_proj.mlp_post"]
    assert session.run.requests.keys() == kept.keys()  # the run survives the restart
    _assert_matches_transformers(tiny_models["llama"], session, "model.layers.1.mlp.down_proj.mlp_post",
                                 lambda ref: ref["mlp_post"][1])
    assert session.set_hooks(list(first_hooks)) is True
    _assert_matches_transformers(tiny_models["llama"], session, "model.layers.1.resid_post",
                                 lambda ref: ref["resid_post"][1])
    with pytest.raises(ValueError, match="matches no hook point"):
        session.set_hooks(["blocks.9.*"])
    assert session.alive


def _assert_matches_transformers(model_dir, session, hook, expected):
    collect(session, PROMPTS[:1], Sampling(max_tokens=3))
    req = list(session.run.requests.values())[-1]
    assert set(req.hooks) == set(session.installed)
    rows = req.hooks[hook]
    ref = expected(hf_reference.run(model_dir, req.token_ids[:-1]))
    assert rows.positions.tolist() == list(range(len(ref)))
    assert rel_l2(rows.values, ref).max() < 3 * PARITY_TOL


def test_closed_session_refuses_work(tiny_models, session):
    session.close()
    with pytest.raises(SessionError, match="closed"):
        next(session.generate(["x"]))
