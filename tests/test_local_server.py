"""The app's own engine server (``inspector.client.local``) while it starts: a child that is alive is
starting, however long it takes; a child that dies is said at once, in its own words. The children
here are stand-ins on the fake engine, slow or failing on purpose."""

import re
import shutil
import sys
import time
from pathlib import Path

import pytest

import fake_server
from inspector.core.protocol import SessionError, SessionOptions
from inspector.client import local, remote


def child_command(script):
    """A ``serve_command`` stand-in: a Python child running ``script(listen)``."""
    return lambda options, listen: [sys.executable, "-c", script(listen)]


def test_a_child_slower_than_the_connect_deadline_is_waited_for(monkeypatch):
    """A busy machine: the child binds its socket only after a remote server would have been given up."""
    monkeypatch.setattr(local, "serve_command", child_command(
        lambda listen: fake_server.script(listen, "slow-model", delay_s=remote.CONNECT_TIMEOUT_S + 2)))
    stages = []
    session = local.start_local_server(SessionOptions(model="slow-model"), stages.append)
    try:
        assert session.alive and session.options.model == "slow-model"
        assert [p.stage for p in stages] == ["starting", "resolving", "loading", "probing", "compiling", "ready"]
    finally:
        session.close()


def test_a_child_that_dies_while_starting_is_said_at_once_in_its_own_words(monkeypatch):
    monkeypatch.setattr(local, "serve_command", child_command(lambda listen: (
        "import sys, time\ntime.sleep(1)\nprint(\"ImportError: no module named 'vllm_broken'\", flush=True)\n"
        "sys.exit(3)")))
    started = time.monotonic()
    with pytest.raises(SessionError) as failure:
        local.start_local_server(SessionOptions(model="broken-model"))
    assert time.monotonic() - started < remote.CONNECT_TIMEOUT_S
    message = str(failure.value)
    assert "exited with code 3" in message and "vllm_broken" in message
    assert "key" not in message and "allow-list" not in message  # a remote server's wording
    log = Path(re.search(r"log: (\S+engine\.log)", message).group(1))
    assert "vllm_broken" in log.read_text(), "the log the message names must be there to read"
    shutil.rmtree(log.parent)


def test_boot_times_say_how_long_each_stage_took(monkeypatch):
    from inspector.core import protocol

    clock = iter([0.0, 1.5, 1.52, 29.0, 29.2, 43.0])
    monkeypatch.setattr(protocol.time, "monotonic", lambda: next(clock))
    times = protocol.BootTimes()
    said = [times.lap(stage) for stage in ("resolving", "loading", "probing", "compiling", "ready")]
    assert said == ["starting took 1.5 s", "", "loading took 27.5 s", "probing took 0.2 s", "compiling took 13.8 s"]
    assert times.summary() == "starting 1.5 s · loading 27 s · probing 0.2 s · compiling 14 s"
