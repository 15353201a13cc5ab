"""The three kinds of session the session-boundary tests run against: the in-process engine session
(a compiled tiny Llama), the same engine on a server (``inspector serve`` in another process, through
``inspector.client.connect``) and the fake the app's tests drive. Opened once per test module (the
``sessions`` fixture in conftest.py)."""

from fake_session import FakeSession
from engines import ENGINE_ARGS
from servers import FEATURE_CLAMPS, HOOKS  # the server fixture boots with the same
from inspector.core.protocol import Sampling, SessionOptions
from inspector.client import connect
from inspector.engine.session import Session

GREEDY = Sampling(max_tokens=8, ignore_eos=True)
KINDS = ("real", "fake", "remote")


def options(model_dir, mode="compiled", **kw):
    return SessionOptions(model=str(model_dir), mode=mode, max_model_len=256, max_num_batched_tokens=64,
                          hooks=HOOKS, engine_args=ENGINE_ARGS, feature_clamps=FEATURE_CLAMPS, **kw)


def open_session(kind, model_dir, server_url=None):
    stages = []
    if kind == "remote":  # the same options, on a server in another process
        return connect(server_url, stages.append), stages
    opener = Session.open if kind == "real" else FakeSession.open
    return opener(options(model_dir), stages.append), stages


def collect(session, prompts, sampling=GREEDY, on_step=None):
    session.new_run()
    events = []
    for event in session.generate(prompts, sampling):
        events.append(event)
        if on_step:
            on_step(event)
    return events
