"""Rows through a client's shared memory (no engine): a real server socket thread copies a step's rows
into the ring a client offered, piece by piece, and a real client connection copies them out; the
ring's regions, and what a client does with rows messages it cannot take."""

import queue
import time

import numpy as np
import pytest
import zmq

from inspector.client.connection import Connection, ServerGone
from inspector.client.rows_ahead import RowsAhead
from inspector.core.blocks import RowBlocks
from inspector.core.dtypes import BFLOAT16
from inspector.core.protocol import RequestStep, StepEvent
from inspector.core.shared_ring import Copiers, Regions, SharedRing, joined
from inspector.net.endpoint import Endpoint
from inspector.net.wire import Message, decode, encode, event_from_body, event_to_body
from inspector.server import shared_rows
from inspector.server.shared_rows import SharedRows


def test_regions_are_taken_in_order_and_wrap_once_the_oldest_are_let_go():
    regions = Regions(100)
    assert [regions.take(40), regions.take(40)] == [0, 40]
    assert regions.take(30) is None  # 20 left at the end, and the start is the oldest's
    regions.release_oldest()
    assert regions.take(30) == 0  # wrapped
    assert regions.take(20) is None  # 10 left before the oldest (40:80)
    regions.release_oldest()
    assert regions.take(60) == 30 and len(regions) == 2


def test_copies_land_whole_in_groups_or_pair_by_pair():
    """Pairs of every kind (large ones split, small ones grouped, bfloat16, a read-only or strided
    source, a cast) land whole."""
    copiers = Copiers("test-copy")
    rng = np.random.default_rng(0)
    sources = [rng.standard_normal((n, 64)).astype(np.float32) for n in (1, 3000, 50_000, 7)]
    sources.append(rng.integers(0, 1 << 16, (20_000, 64), dtype=np.uint16).view(BFLOAT16))
    read_only = sources[2].copy()
    read_only.flags.writeable = False
    odd = [(np.empty_like(read_only), read_only), (np.empty((500, 64), np.float32), sources[2][::100]),
           (np.empty((7, 64), np.float64), sources[3])]
    try:
        for pairs in ([(np.empty_like(a), a) for a in sources], odd):
            copiers.copy(pairs)
            for dest, source in pairs:  # as bytes where the types agree (random bfloat16 holds NaNs)
                same = dest.dtype == source.dtype
                np.testing.assert_array_equal(*((dest.view(np.uint8), source.view(np.uint8)) if same else (dest, source)))
    finally:
        copiers.shutdown()


def test_a_stacks_hooks_into_neighbouring_regions_are_one_copy_and_only_exact_neighbours_join():
    """A forward's stack [hooks, rows, width] sent hook by hook into regions laid end to end is one copy
    (each copy takes the GIL back as it ends); a gap on either side, a cast or a strided source keeps
    pairs apart; every byte lands, and none past them."""
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((4, 300, 64)).astype(np.float32)
    size = stack[0].nbytes
    ring = np.zeros(6 * size, np.uint8)
    region = [ring[k * size:(k + 1) * size].view(np.float32).reshape(300, 64) for k in range(4)]
    apart = [ring[k * (size + 64):k * (size + 64) + size].view(np.float32).reshape(300, 64) for k in range(4)]
    assert [p[0].nbytes for p in joined(list(zip(region, stack)))] == [4 * size]
    assert len(joined(list(zip(apart, stack)))) == 4  # destinations 64 bytes apart
    assert len(joined(list(zip(region, [stack[0], stack[2], stack[1], stack[3]])))) == 4  # sources out of order
    assert len(joined([(region[0], stack[0]), (region[1].view(np.int32), stack[1].view(np.int32)),
                       (region[2], stack[2][::-1])])) == 2  # bytes as they are join; a strided source does not
    assert len(joined([(region[0], stack[0]), (region[1], stack[1]), (np.empty((300, 64)), stack[2])])) == 2
    copiers = Copiers("test-copy")
    try:
        pairs = list(zip(region[:3], stack[:3])) + [(np.empty((300, 64)), stack[3])]  # and a cast after them
        copiers.copy(pairs)
        np.testing.assert_array_equal(ring[:3 * size].view(np.float32).reshape(3, 300, 64), stack[:3])
        np.testing.assert_array_equal(pairs[3][0], stack[3])
        assert not ring[3 * size:].any()  # nothing past the pairs written
    finally:
        copiers.shutdown()


class Server:
    """A ROUTER socket on its endpoint's thread, a client's offer mapped, rows sent ahead of events."""

    def __init__(self, url: str, client: Connection):
        self.context = zmq.Context()
        socket = self.context.socket(zmq.ROUTER)
        socket.bind(url)
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.shared: SharedRows | None = None
        self.endpoint = Endpoint(socket, self._received, lambda: None, routed=True).start()
        self.client = client

    def _received(self, frames):
        message = decode(frames[1:])
        if message.type == "rows_read":
            self.shared.read(message.body["message"])
        elif message.type == "generate":
            self.calls.put((frames[0].bytes, message.id))

    def accept(self) -> tuple[bytes, int]:
        peer, call = self.calls.get(timeout=10)
        self.copiers = Copiers("test-rows-copy")
        offer = self.client.rows_ahead.offer()
        self.shared = SharedRows(SharedRing.opened(offer), lambda m: self.endpoint.send(encode(m), peer), self.copiers)
        return peer, call

    def close(self):
        self.shared.close()
        self.copiers.shutdown()
        self.endpoint.stop()
        self.context.term()


@pytest.fixture
def client_and_server(tmp_path, request):
    url = f"ipc://{tmp_path / 's.sock'}"
    client = Connection(url, rows_ahead=RowsAhead(request.param))
    server = Server(url, client)
    yield client, server
    client.close(say_bye=False)
    server.close()


def bulk_event(rng, widths=(4096, 4096, 1000), rows=37) -> tuple[StepEvent, dict]:
    values = {f"h{k}": rng.standard_normal((rows, w), dtype=np.float32).astype(BFLOAT16) for k, w in enumerate(widths)}
    blocks = RowBlocks(["r0", "r1"], [0, 5, rows], np.arange(rows), np.arange(rows) + 100, values)
    return StepEvent(0, (RequestStep("r0"), RequestStep("r1")), blocks=(blocks,)), values


@pytest.mark.parametrize("client_and_server", [64 << 10], indirect=True)
def test_steps_many_times_the_rings_size_cross_it_in_pieces_bit_for_bit(client_and_server):
    """Five steps of 700 KiB through a 64 KiB ring: the server waits for each piece's room to come back
    (none goes through the socket), and the client's arrays hold every row as sent, in bfloat16."""
    client, server = client_and_server
    call = client.start("generate", {})
    peer, call_id = server.accept()
    rng = np.random.default_rng(0)
    sent = []
    for _ in range(5):
        event, values = bulk_event(rng)
        sent.append(values)
        server.endpoint.send(encode(Message("event", server.shared.send_ahead(event_to_body(event)), call_id)), peer)
    for values in sent:
        got = event_from_body(call.next(timeout_s=30).body)
        for hook, v in values.items():
            back = got.blocks[0].values[hook]
            assert back.dtype == BFLOAT16 and np.array_equal(back.view(np.uint16), v.view(np.uint16))
    total = sum(v.nbytes for values in sent for v in values.values())
    assert client.rows_ahead.bytes_shared == total and client.rows_ahead.bytes_by_socket == 0
    assert total > 10 * client.rows_ahead.ring.size and not client.rows_ahead.arrays  # every array taken


@pytest.mark.parametrize("client_and_server", [4096], indirect=True)
def test_rows_wider_than_a_tiny_ring_go_through_the_socket(client_and_server):
    client, server = client_and_server
    call = client.start("generate", {})
    peer, call_id = server.accept()
    event, values = bulk_event(np.random.default_rng(2), widths=(4096,), rows=40)  # 8 KiB rows
    server.endpoint.send(encode(Message("event", server.shared.send_ahead(event_to_body(event)), call_id)), peer)
    got = event_from_body(call.next(timeout_s=30).body)
    assert np.array_equal(got.blocks[0].values["h0"].view(np.uint16), values["h0"].view(np.uint16))
    assert client.rows_ahead.bytes_shared == 0 and client.rows_ahead.bytes_by_socket == values["h0"].nbytes


@pytest.mark.parametrize("client_and_server", [64 << 10], indirect=True)
def test_a_server_that_finds_no_room_in_time_sends_the_rest_through_the_socket(client_and_server, monkeypatch):
    client, server = client_and_server
    monkeypatch.setattr(shared_rows, "ROOM_WAIT_S", 0.2)
    call = client.start("generate", {})
    peer, call_id = server.accept()
    server.shared.read = lambda message: None  # room never comes back
    event, values = bulk_event(np.random.default_rng(1))
    t0 = time.monotonic()
    body = server.shared.send_ahead(event_to_body(event))
    assert time.monotonic() - t0 < 2  # it waited once, then no more
    server.endpoint.send(encode(Message("event", body, call_id)), peer)
    got = event_from_body(call.next(timeout_s=30).body)
    for hook, v in values.items():
        assert np.array_equal(got.blocks[0].values[hook].view(np.uint16), v.view(np.uint16))
    assert 0 < client.rows_ahead.bytes_shared <= client.rows_ahead.ring.size
    assert client.rows_ahead.bytes_by_socket > 0


@pytest.mark.parametrize("client_and_server", [64 << 10], indirect=True)
@pytest.mark.parametrize("rows", [{"message": 1, "arrays": {1: ["bfloat16", [4, 8]]}, "slices": [[1, 0, 4, 1 << 20]]},
                                  {"arrays": {1: ["<f4", [4, 8]]}, "slices": [[1, 2, 9, 0]]},
                                  {"arrays": {1: ["object", [4]]}, "slices": []},
                                  {"slices": [[7, 0, 1, 0]]}])
def test_a_rows_message_that_does_not_fit_ends_the_connection_with_the_reason(client_and_server, rows):
    client, server = client_and_server
    call = client.start("generate", {})
    peer, call_id = server.accept()
    server.endpoint.send(encode(Message("rows", rows)), peer)
    with pytest.raises(ServerGone, match="cannot read"):
        call.next(timeout_s=10)


def test_rows_sent_ahead_to_a_client_that_offered_no_shared_memory_end_its_connection(tmp_path):
    url = f"ipc://{tmp_path / 'n.sock'}"
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(url)
    client = Connection(url)
    try:
        call = client.start("generate", {})
        while True:
            peer, *frames = socket.recv_multipart()
            if decode(frames).type == "generate":
                break
        socket.send_multipart([peer, *encode(Message("rows", {"arrays": {}, "slices": []}))])
        with pytest.raises(ServerGone, match="offered no shared memory"):
            call.next(timeout_s=10)
    finally:
        client.close(say_bye=False)
        socket.close(0)
        context.term()


@pytest.mark.parametrize("client_and_server", [1 << 20], indirect=True)
def test_messages_posted_after_a_step_being_copied_wait_for_it_and_the_engine_is_told_to(client_and_server,
                                                                                        monkeypatch):
    """The engine's thread posts a large step and goes on; the sender copies it into the ring (slowly
    here). What the engine posts meanwhile (small steps, ``done``) reaches the client after it, in
    order, and while more rows than the ring holds wait, the server is ``behind``."""
    client, server = client_and_server
    monkeypatch.setattr(shared_rows, "SENDER_BYTES", 1 << 20)  # a step of 1.8 MiB is large here
    call = client.start("generate", {})
    peer, call_id = server.accept()
    copy = server.copiers.copy
    monkeypatch.setattr(server.copiers, "copy", lambda pairs: time.sleep(0.01) or copy(pairs))
    rng = np.random.default_rng(3)
    events = [bulk_event(rng, rows=200) for _ in range(4)]  # 1.8 MiB each
    small = StepEvent(9, (RequestStep("r0", new_token_ids=(5,)),))
    for event, _ in events:
        server.shared.post(Message("event", event_to_body(event), call_id))
    assert server.shared.behind
    server.shared.post(Message("event", event_to_body(small), call_id))
    server.shared.post(Message("done", {"steps": 5}, call_id))
    for _, values in events:
        got = event_from_body(call.next(timeout_s=30).body)
        assert all(np.array_equal(got.blocks[0].values[h].view(np.uint16), v.view(np.uint16)) for h, v in values.items())
    assert event_from_body(call.next(timeout_s=30).body).step == 9
    assert call.next(timeout_s=30).type == "done" and not server.shared.behind
    assert client.rows_ahead.bytes_shared == sum(v.nbytes for _, values in events for v in values.values())
