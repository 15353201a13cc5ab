"""The wire between a client and its server, on real ZeroMQ sockets (no engine): a client takes its
server's messages whatever their size, and says so when it cannot read one instead of losing it."""

import time

import numpy as np
import pytest
import zmq

from inspector.capture.protocol import RequestStart, RequestStep, StepEvent
from inspector.client.connection import Connection, ServerGone
from inspector.net.wire import MAX_FRAMES, MAX_MESSAGE_BYTES, Message, WireError, decode, encode, event_from_body, \
    event_to_body


@pytest.fixture
def server_and_client(tmp_path):
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    url = f"ipc://{tmp_path / 'w.sock'}"
    server.bind(url)
    client = Connection(url)
    yield server, client
    client.close(say_bye=False)
    server.close(0)
    context.term()


def _first_call(server) -> tuple[bytes, Message]:
    while True:
        peer, *frames = server.recv_multipart()
        message = decode(frames)
        if message.type != "ping":
            return peer, message


def test_a_step_larger_than_what_a_client_may_send_reaches_the_client(server_and_client):
    """A prefill at batch 32 of a 4,096-wide model is GiBs in thousands of frames: the client's limits
    on what it sends must not apply to what it receives (a dropped first event lost every start)."""
    server, client = server_and_client
    call = client.start("generate", {})
    peer, message = _first_call(server)
    hooks, n_rows = MAX_FRAMES // 3 + 1, 4  # three arrays per hook
    width = MAX_MESSAGE_BYTES // (hooks * n_rows * 4) + 1
    positions, tokens = np.arange(n_rows), np.zeros(n_rows, dtype=np.int64)
    rows = {f"h{k}": (positions, tokens, np.full((n_rows, width), k, np.float32)) for k in range(hooks)}
    event = StepEvent(0, (RequestStep("req0", rows=rows),), (RequestStart("req0", "p", (1,), ("p",), {}),))
    frames = encode(Message("event", event_to_body(event), message.id))
    assert len(frames) > MAX_FRAMES and sum(memoryview(f).nbytes for f in frames) > MAX_MESSAGE_BYTES
    with pytest.raises(WireError, match="at most"):
        decode(frames)  # what a server would say to a client sending this
    server.send_multipart([peer, *frames])
    got = event_from_body(call.next(timeout_s=30).body)
    assert got.started[0].request_id == "req0" and len(got.requests[0].rows) == hooks
    assert np.array_equal(got.requests[0].rows[f"h{hooks - 1}"][2], rows[f"h{hooks - 1}"][2])
    call.close()


def test_a_message_the_client_cannot_read_ends_the_connection_with_the_reason(server_and_client):
    server, client = server_and_client
    call = client.start("generate", {})
    peer, _ = _first_call(server)
    server.send_multipart([peer, b"\x93not a header"])
    with pytest.raises(ServerGone, match="cannot read"):
        call.next(timeout_s=10)
    deadline = time.monotonic() + 5
    while client.lost is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "cannot read" in client.lost
