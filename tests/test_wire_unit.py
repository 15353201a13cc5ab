"""The wire between a client and its server, on real ZeroMQ sockets (no engine): a client takes its
server's messages whatever their size, and says so when it cannot read one instead of losing it."""

import threading
import time

import numpy as np
import pytest
import zmq

from inspector.core.dtypes import BFLOAT16
from inspector.core.protocol import RequestStart, RequestStep, StepEvent
from inspector.client.connection import Connection, ServerGone
from inspector.core.blocks import RequestRowsView, RowBlocks
from inspector.net.wire import MAX_MESSAGE_BYTES, Message, WireError, decode, encode, event_from_body, \
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
    """A prefill at batch 32 of a 4,096-wide model is GiBs: the client's limits on what it sends must
    not apply to what it receives (a dropped first event lost every start)."""
    server, client = server_and_client
    call = client.start("generate", {})
    peer, message = _first_call(server)
    hooks, n_rows = 64, 4
    width = MAX_MESSAGE_BYTES // (hooks * n_rows * 4) + 1
    positions, tokens = np.arange(n_rows), np.zeros(n_rows, dtype=np.int64)
    rows = {f"h{k}": (positions, tokens, np.full((n_rows, width), k, np.float32)) for k in range(hooks)}
    event = StepEvent(0, (RequestStep("req0", rows=rows),), (RequestStart("req0", "p", (1,), ("p",), {}),))
    frames = encode(Message("event", event_to_body(event), message.id))
    assert sum(memoryview(f).nbytes for f in frames) > MAX_MESSAGE_BYTES
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


def test_a_message_of_small_arrays_is_one_frame_and_one_with_a_large_array_sends_each_array_once_as_a_frame():
    small, flags = np.arange(12, dtype="<f4").reshape(3, 4), np.array([True, False])
    frames = encode(Message("t", {"small": small, "flags": flags}, 1))
    assert len(frames) == 1
    body = decode(frames).body
    np.testing.assert_array_equal(body["small"], small)
    assert body["flags"].dtype == np.bool_
    large = np.ones((400, 200), dtype="<f4")[:, ::2]  # 160 KB, not in C order
    frames = encode(Message("t", {"a": [small, large], "b": small}, 1))
    assert len(frames) == 3  # the header, then small (sent once for both places) and large
    body = decode(frames).body
    np.testing.assert_array_equal(body["a"][0], small)
    np.testing.assert_array_equal(body["b"], small)
    np.testing.assert_array_equal(body["a"][1], large)
    assert body["a"][1].flags.c_contiguous


def test_arrays_received_lie_on_their_frames_and_keep_no_object_the_garbage_collector_scans():
    """A client keeps a run's arrays as they came: made on memoryviews, each would have kept two more
    objects alive that every collection on the GUI thread scanned (half of a live run's objects)."""
    import gc

    large = np.arange(40_000, dtype="<f4").reshape(200, 200)
    body = decode([zmq.Frame(bytes(f)) for f in encode(Message("t", {"v": large}, 1))]).body
    small = decode([zmq.Frame(bytes(f)) for f in encode(Message("t", {"w": large[0, :3]}, 1))]).body

    def owner(array):
        while isinstance(array, np.ndarray):
            array = array.base
        return array

    np.testing.assert_array_equal(body["v"], large)
    assert isinstance(owner(body["v"]), zmq.Frame)
    assert isinstance(owner(small["w"]), bytes) and not gc.is_tracked(owner(small["w"]))  # in the header


@pytest.mark.parametrize("rows", [4, 400])  # inside the header, and as a frame of its own
def test_bfloat16_rows_cross_the_wire_as_bfloat16_bit_for_bit(rows):
    values = np.random.default_rng(0).standard_normal((rows, 64)).astype(BFLOAT16)
    got = decode(encode(Message("t", {"values": values}, 1))).body["values"]
    assert got.dtype == BFLOAT16
    np.testing.assert_array_equal(got.view(np.uint16), values.view(np.uint16))


def test_a_connection_closed_at_once_ends_cleanly_even_when_the_server_refuses_its_handshake():
    """A client's socket thread pings on its first tick; a close right after connecting, to a server
    that never completes the handshake, must not leave the socket (and so the process's exit) hanging."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.curve_server = True
    server.curve_publickey, server.curve_secretkey = zmq.curve_keypair()
    server.bind("tcp://127.0.0.1:*")
    url = server.get(zmq.LAST_ENDPOINT).decode()
    try:
        for _ in range(20):
            client = Connection(url)  # no keys: the CURVE server never answers it
            closer = threading.Thread(target=client.close, kwargs={"say_bye": False}, daemon=True)
            closer.start()
            closer.join(10)
            assert not closer.is_alive(), "closing the connection hung"
            assert client.lost == "the connection was closed"
    finally:
        server.close(0)
        context.term()


@pytest.mark.parametrize("order", ["as in memory", "reversed"])
@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_a_steps_rows_join_by_hook_as_a_view_when_they_lie_in_order_and_come_back_to_their_requests(order, dtype):
    """The drain hands out consecutive slices of one block: sent as one frame, not copied; requests in
    another order than memory must still get their own rows back."""
    batch, width = 8, 4096
    block = np.random.default_rng(0).standard_normal((2, batch, width), dtype=np.float32).astype(dtype)
    positions, tokens = np.arange(batch), np.arange(batch) + 100
    indices = list(range(batch)) if order == "as in memory" else list(range(batch))[::-1]
    steps = tuple(RequestStep(f"r{i}", rows={f"h{h}": (positions[i:i + 1], tokens[i:i + 1], block[h, i:i + 1])
                                             for h in range(2)}) for i in indices)
    body = event_to_body(StepEvent(0, steps))
    assert np.shares_memory(body["rows"]["h1"][2], block) == (order == "as in memory")
    got = event_from_body(decode(encode(Message("event", body, 1)), limited=False).body)
    for step, i in zip(got.requests, indices):
        assert step.request_id == f"r{i}"
        for h in range(2):
            p, t, v = step.rows[f"h{h}"]
            assert p.tolist() == [i] and t.tolist() == [i + 100] and np.array_equal(v, block[h, i:i + 1])


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_a_step_in_bulk_crosses_the_wire_as_its_blocks_and_each_request_gets_its_own_rows(dtype):
    """An event with ``blocks`` sends each hook's array once as it is; the client's event has the blocks
    again, and each request's rows are views of them. A request without rows has none."""
    width = 4096
    values = {f"h{h}": np.random.default_rng(h).standard_normal((5, width), dtype=np.float32).astype(dtype)
              for h in range(2)}
    blocks = RowBlocks(["r0", "r1"], [0, 2, 5], np.array([7, 8, 0, 1, 2]), np.arange(5) + 100, values)
    steps = (RequestStep("r0", rows=RequestRowsView((blocks,), "r0"), new_token_ids=(3,)),
             RequestStep("r1", rows=RequestRowsView((blocks,), "r1")), RequestStep("r2", new_token_ids=(4,)))
    body = event_to_body(StepEvent(0, steps, owns_rows=True, blocks=(blocks,)))
    assert body["blocks"][0]["values"]["h1"] is values["h1"] and all(not r["rows"] for r in body["requests"])
    got = event_from_body(decode(encode(Message("event", body, 1)), limited=False).body)
    (back,) = got.blocks
    assert got.owns_rows and back.request_ids == ("r0", "r1") and back.bounds.tolist() == [0, 2, 5]
    for step, (a, b) in zip(got.requests, [(0, 2), (2, 5)]):
        for hook, v in values.items():
            p, t, rows = step.rows[hook]
            assert p.tolist() == blocks.positions[a:b].tolist() and t.tolist() == list(range(100 + a, 100 + b))
            assert rows.dtype == dtype and np.array_equal(rows.view(np.uint8), v[a:b].view(np.uint8))
    assert dict(got.requests[2].rows) == {} and got.requests[2].new_token_ids == (4,)
    body["blocks"][0]["bounds"] = [0, 2, 5]
    with pytest.raises(WireError, match="malformed"):
        event_from_body(body)


def test_an_events_arrays_come_back_wherever_the_protocol_puts_them():
    """Blocks, a request's scores, features and the vectors in its intervention log: a client looks
    for arrays only there, and finds each."""
    vector = np.arange(4096, dtype=np.float32)  # large: it travels as a frame
    rows = {"h": np.ones((2, 8), np.float32)}
    blocks = RowBlocks(["r0"], [0, 2], np.arange(2), np.arange(2), rows)
    step = RequestStep("r0", new_token_ids=(3,), rows=RequestRowsView((blocks,), "r0"),
                       intervention_log=((1, ({"hook": "h", "bias": vector},)),),
                       scores=(np.array([1]), np.array([[-0.5]], np.float32)),
                       features={"sae": (np.array([1]), np.array([[7]], np.int32), np.array([[2.5]], np.float32))})
    body = event_to_body(StepEvent(0, (step,), owns_rows=True, blocks=(blocks,)))
    got = event_from_body(decode(encode(Message("event", body, 1)), limited=False).body).requests[0]
    assert np.array_equal(got.intervention_log[0][1][0]["bias"], vector)
    assert got.scores[1].tolist() == [[-0.5]] and got.features["sae"][1].tolist() == [[7]]
    assert np.array_equal(got.rows["h"][2], rows["h"])
