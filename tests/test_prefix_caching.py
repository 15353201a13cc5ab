"""A session with vLLM's prefix caching on (engine_args enable_prefix_caching): capturing requests still
get every row, and no request reads blocks computed under edits other than its own, even when the edits
change while a request runs."""

from dataclasses import replace

import numpy as np
import pytest

from engines import ENGINE_ARGS
from session_kinds import options
from inspector.core.hooks import installed_name
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling
from inspector.engine.session import Session

pytestmark = pytest.mark.slow
HOOK = "blocks.0.hook_resid_post"  # the next block's keys and values are computed from it
PROMPT = " ".join(f"item {i} of the list," for i in range(28))  # a full 128-token block (the CPU's) and more


@pytest.fixture(scope="module")
def session(tiny_models):
    opened = Session.open(replace(options(tiny_models["llama"]), max_model_len=512,
                                  engine_args={**ENGINE_ARGS, "enable_prefix_caching": True}))
    yield opened
    opened.close()


def generate(session, prompt, capture=True, max_tokens=6, on_step=None):
    session.new_run()
    for event in session.generate([prompt], Sampling(max_tokens=max_tokens, ignore_eos=True, capture=capture)):
        if on_step:
            on_step(event)
    [request] = session.run.requests.values()
    return request


def steering(session):
    push = np.random.default_rng(5).normal(size=128) * 8
    return [Intervention(installed_name(HOOK, session.installed), bias=push)]


def test_a_repeated_capture_gets_every_row_again(session):
    first, again = generate(session, PROMPT), generate(session, PROMPT)
    assert again.token_ids == first.token_ids
    for hook, rows in again.hooks.items():
        assert rows.positions.tolist() == list(range(len(again.token_ids) - 1))  # none skipped for a cache hit
        np.testing.assert_array_equal(np.asarray(rows.values), np.asarray(first.hooks[hook].values))


def test_steered_and_clean_requests_never_read_each_others_blocks(session):
    clean = generate(session, PROMPT, capture=False).generated_token_ids
    session.set_interventions(steering(session))
    steered = generate(session, PROMPT, capture=False).generated_token_ids
    assert steered != clean
    session.set_interventions([])
    assert generate(session, PROMPT, capture=False).generated_token_ids == clean


def test_blocks_computed_while_the_edits_changed_are_read_by_no_later_request(session):
    """A clean request's long prompt is steered from its third prefill chunk on (64 tokens a step), so its
    second block holds steered K/V under a clean request's key; a later clean request of the same prompt
    computes what a request that reads no cached block computes."""
    prompt = " ".join(f"entry {i} in the table," for i in range(40))  # two full blocks, its own
    assert len(session.tokenize(prompt)) > 256
    session.set_interventions([])
    steps = []

    def steer_midway(event):
        steps.append(event)
        if len(steps) == 2:
            session.set_interventions(steering(session))

    generate(session, prompt, capture=False, on_step=steer_midway)
    assert len(steps) > 4  # the prefill took several steps: the change came inside it
    session.set_interventions([])
    later = generate(session, prompt, capture=False).generated_token_ids
    assert later == generate(session, prompt, capture=True).generated_token_ids  # the latter reads nothing
