"""``inspector serve`` with several clients: one continuous batch, each client's interventions and hook
points its own, and faults: a client killed mid-generation, one that stops reading, malformed and
hostile messages, keys. Real engines in server processes; clients in this process (threads) or in
processes of their own."""

from __future__ import annotations

import itertools
import os
import random
import signal
import stat
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

import hf_reference
from engines import PARITY_TOL, rel_l2
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionError
from inspector.client import connect
from inspector.net.keys import client_keys, keygen
from inspector.net.wire import Message, encode
from servers import running_server, tail

PROMPTS = ["def fibonacci(n):", "import os\nimport sys", "class Parser(object):", "for i in range(10):"]
GREEDY = Sampling(max_tokens=8, ignore_eos=True)
H0 = "model.layers.0.resid_post"
H1 = "model.layers.1.resid_post"


def steering(client_index: int) -> list[Intervention]:
    """Client 0 runs clean; the others scale the residual stream after block 0, each its own way."""
    return [] if client_index == 0 else [Intervention(H0, scale=1.0 + 0.15 * client_index)]


def run(session, prompts, sampling=GREEDY):
    session.new_run()
    list(session.generate(prompts, sampling))
    return list(session.run.requests.values())


def assert_same(got, expected, why):
    assert got.generated_token_ids == expected.generated_token_ids, why
    for hook, rows in expected.hooks.items():
        assert got.hooks[hook].positions.tolist() == rows.positions.tolist(), why
        assert rel_l2(got.hooks[hook].values, rows.values).max() < PARITY_TOL, why


@pytest.fixture(scope="module")
def eager_server(tiny_models):
    """An eager server that lets a client fall only 1 MiB behind."""
    with running_server(tiny_models["llama"], mode="eager", extra=["--max-backlog-mib", "1"]) as server:
        yield server


def test_the_ipc_socket_is_its_owners_alone(compiled_server):
    url, _ = compiled_server
    assert stat.S_IMODE(os.stat(url.removeprefix("ipc://")).st_mode) == 0o600


def test_eight_clients_batch_together_and_steer_only_their_own_requests(compiled_server):
    """8 clients x 4 requests at once, each client steering its requests its own way: every request
    equals a solo run with the same intervention, and all rows arrive, in order."""
    url, _ = compiled_server
    clients = [connect(url) for _ in range(8)]
    try:
        results, errors, barrier = {}, [], threading.Barrier(len(clients))

        def work(i, session):
            try:
                session.set_interventions(steering(i))
                barrier.wait()
                results[i] = run(session, PROMPTS)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        solo = clients[0]
        for i, requests in results.items():
            solo.set_interventions(steering(i))
            for prompt, got in zip(PROMPTS, requests):
                assert got.prompt == prompt and got.hooks[H1].positions.tolist() == list(range(len(got.token_ids) - 1))
                assert got.intervention_log[0][1] == [iv.as_dict() for iv in steering(i)]
                (expected,) = run(solo, [prompt])
                assert_same(got, expected, f"client {i}, {prompt!r}")
        n = len(results[0][0].prompt_token_ids)  # the prompt's rows: the same input, scaled by client 3
        steered, clean = results[3][0].hooks[H0].values[:n], results[0][0].hooks[H0].values[:n]
        np.testing.assert_allclose(steered, clean * 1.45, rtol=1e-5, atol=1e-5)
    finally:
        for session in clients:
            session.close()


def test_a_compiled_hook_change_is_refused_while_others_share_the_engine(compiled_server):
    url, _ = compiled_server
    with connect(url) as mine, connect(url) as other:
        with pytest.raises(ValueError, match=r"shared with \d+ other client"):  # more if a test holds one open
            mine.set_hooks(["blocks.0.hook_mlp_out"])
        assert set(mine.installed) == set(other.installed) and len(run(other, PROMPTS[:1])) == 1


def test_an_sae_on_the_server_encodes_for_the_clients_that_attached_it(compiled_server, tmp_path):
    """Features reach only the clients that attached the SAE; a second attach of the same directory
    shares the engine's encoder, one of another hook or k is refused; the engine stops encoding when the
    last of them detaches or leaves."""
    from sae_files import saelens_encode, write_sae

    from inspector.core.sae import strongest

    url, _ = compiled_server
    path = write_sae(tmp_path / "res1", "jumprelu", 128, 1024, "blocks.1.hook_resid_post", seed=3)
    with connect(url) as mine, connect(url) as other, connect(url) as third:
        sae = mine.attach_sae(path, k=16)
        assert sae.hook == H1 and set(mine.saes) == {"res1"}
        with pytest.raises(ValueError, match="another client has an SAE named 'res1' attached"):
            other.attach_sae(path, k=8)
        for req in run(mine, PROMPTS[:2]):
            rows, features = req.hooks[H1], req.features["res1"]
            ids, acts = strongest(saelens_encode(path, rows.values), 16)
            np.testing.assert_array_equal(features.positions, rows.positions)
            np.testing.assert_array_equal(features.ids, ids)
            np.testing.assert_allclose(features.activations, acts, rtol=1e-5, atol=1e-6)
        assert not any(req.features for req in run(other, PROMPTS[:1]))  # not its SAE
        assert third.attach_sae(path, k=16) == sae  # shared
        mine.detach_sae("res1")
        assert all("res1" in req.features for req in run(third, PROMPTS[:1]))  # still attached for the third
        assert not any(req.features for req in run(mine, PROMPTS[:1]))


def test_eager_hook_changes_are_the_clients_own(eager_server):
    url, _ = eager_server
    with connect(url) as a, connect(url) as b:
        before = run(b, PROMPTS[:2])
        assert a.set_hooks(["blocks.0.hook_mlp_out", "blocks.1.hook_resid_post"]) is False
        assert set(a.installed) == {"model.layers.0.mlp.mlp_out", H1}
        assert set(b.installed) == {H0, H1, "model.embed_tokens.embed"}
        results = {}
        threads = [threading.Thread(target=lambda k, s: results.__setitem__(k, run(s, PROMPTS[:2])), args=(k, s))
                   for k, s in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(set(r.hooks) == set(a.installed) for r in results["a"])
        for got, expected in zip(results["b"], before):  # b sees what it saw before, nothing more
            assert set(got.hooks) == set(b.installed)
            assert_same(got, expected, "b's captures changed when a changed its hooks")


CLIENT = """
import sys
from inspector.client import connect
from inspector.core.protocol import Sampling
session = connect(sys.argv[1])
for k, event in enumerate(session.generate(["while True:"] * 4, Sampling(max_tokens=200, ignore_eos=True))):
    if k == 3:
        print("generating", flush=True)
"""


def test_a_client_killed_mid_generation_leaves_the_others_unchanged(compiled_server):
    url, process = compiled_server
    with connect(url) as b:
        expected = run(b, PROMPTS[:2], Sampling(max_tokens=24, ignore_eos=True))
        victim = subprocess.Popen([sys.executable, "-c", CLIENT, url], stdout=subprocess.PIPE, text=True)
        assert victim.stdout.readline().strip() == "generating"
        got = []

        def generate_b():
            got.extend(run(b, PROMPTS[:2], Sampling(max_tokens=24, ignore_eos=True)))

        thread = threading.Thread(target=generate_b)
        thread.start()
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        thread.join(120)
        for g, e in zip(got, expected):
            assert_same(g, e, "the killed client changed another client's run")
        deadline = time.monotonic() + 2  # the server notices at once (its connection closed), not after silence
        while "connection closed" not in tail(process.log_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "connection closed: its requests are cancelled" in tail(process.log_path)
        assert len(run(b, PROMPTS[:1])) == 1 and process.poll() is None


def test_a_client_that_stops_reading_is_disconnected_and_the_others_keep_their_pace(eager_server):
    url, process = eager_server
    context = zmq.Context()
    stalled = context.socket(zmq.DEALER)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.connect(url)
    try:
        stalled.send_multipart(encode(Message("hello", {}, 1)))
        stalled.send_multipart(encode(Message("generate", {
            "prompts": ["x = ["] * 8, "request_ids": [f"s{i}" for i in range(8)],
            "sampling": {"max_tokens": 240, "ignore_eos": True}}, 2)))
        with connect(url) as b:
            deadline = time.monotonic() + 120
            while "stopped reading" not in process.log_path.read_text() and time.monotonic() < deadline:
                stalled.send_multipart(encode(Message("ping")))  # alive, just not reading
                assert len(run(b, PROMPTS[:1])) == 1  # b goes on meanwhile
            assert "stopped reading" in process.log_path.read_text(), tail(process.log_path)
            t0 = time.perf_counter()
            run(b, PROMPTS[:2], Sampling(max_tokens=16, ignore_eos=True))
            assert time.perf_counter() - t0 < 30
    finally:
        stalled.close(0)
        context.term()


def test_a_client_slower_than_the_engine_sets_its_pace_and_loses_nothing(eager_server):
    """Back-pressure, not a disconnect: once ZeroMQ's 64 messages and 1 MiB more wait for a client, the
    engine waits for it; a pause shorter than the stall time loses nothing."""
    url, process = eager_server
    sampling = Sampling(max_tokens=200, ignore_eos=True)
    stalls = process.log_path.read_text().count("stopped reading")
    with connect(url) as session:
        expected = run(session, PROMPTS * 4, sampling)
        session.new_run()
        events = session.generate(PROMPTS * 4, sampling)
        first = next(events)
        time.sleep(3)  # not reading (less than the 5 s that makes a client "stopped")
        slow = [first, *events]
        assert session.alive and process.log_path.read_text().count("stopped reading") == stalls
    received = sum(v.nbytes for e in slow for s in e.requests for _, _, v in s.rows.values())
    assert len(slow) > 64 + 1 and received > 2 * 2**20  # more than ZeroMQ's queue and the backlog limit hold
    for got, want in zip(session.run.requests.values(), expected):
        assert_same(got, want, "rows lost or changed for a slow client")
        assert want.hooks and all(rows.positions.tolist() == list(range(len(got.token_ids) - 1))
                                  for rows in got.hooks.values())


def _mutations(valid: list[list[bytes]], rng: random.Random):
    """Random bytes, random MessagePack, and valid messages damaged in every way a peer could."""
    kinds = ["hello", "generate", "stop", "set_interventions", "set_hooks", "bye", "ping", "nonsense", "", "x" * 300]
    values = [None, True, -1, 2**63, 1.5, float("nan"), "", "é" * 50, [], {}, [1, "a"], {"a": {"b": [None]}}, b"\x00"]
    for n in range(10_000):
        pick = n % 5
        if pick == 0:
            yield [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
        elif pick == 1:
            body = {rng.choice(["prompts", "sampling", "request_ids", "interventions", "patterns", "call", "x"]):
                    rng.choice(values) for _ in range(rng.randint(0, 4))}
            header = {"v": rng.choice([1, 1, 1, 2, 0, "1"]), "t": rng.choice(kinds), "id": rng.choice([1, -5, 2**40]),
                      "body": body}
            yield [msgspec.msgpack.encode(header)]
        else:
            frames = [bytearray(f) for f in rng.choice(valid)]
            for _ in range(rng.randint(1, 3)):
                frame = rng.choice(frames)
                action = rng.randint(0, 3)
                if action == 0 and frame:
                    frame[rng.randrange(len(frame))] = rng.randrange(256)
                elif action == 1:
                    del frame[rng.randrange(len(frame) + 1):]
                elif action == 2:
                    frames.append(bytearray(rng.randbytes(rng.randint(0, 32))))
                else:
                    frame.extend(rng.randbytes(rng.randint(1, 16)))
            yield [bytes(f) for f in frames]


def test_ten_thousand_hostile_messages_leave_the_server_serving_faithful_captures(eager_server, tiny_models):
    url, process = eager_server
    valid = [encode(m) for m in (
        Message("hello", {"client": "fuzz"}, 1),
        Message("generate", {"prompts": ["a"], "request_ids": ["f1"], "sampling": {"max_tokens": 1}}, 2),
        Message("set_interventions", {"interventions": [{"hook": H0, "scale": 2.0, "bias": [0.5] * 128}]}, 3),
        Message("set_hooks", {"patterns": ["blocks.*.hook_resid_post"]}, 4),
        Message("stop", {"call": 2}, 5),
        Message("generate", {"prompts": ["b"], "request_ids": ["f2"], "sampling": {"max_tokens": 1},
                             "extra": np.arange(6, dtype=np.float32).reshape(2, 3)}, 6))]
    rng = random.Random(0)
    context = zmq.Context()
    fuzzer = context.socket(zmq.DEALER)
    fuzzer.connect(url)
    replies = {"error": 0}
    try:
        for n, frames in enumerate(_mutations([[bytes(f) for f in v] for v in valid], rng)):
            fuzzer.send_multipart(frames)
            while fuzzer.poll(0):
                reply = msgspec.msgpack.decode(fuzzer.recv_multipart()[0])
                replies[reply["t"]] = replies.get(reply["t"], 0) + 1
        fuzzer.send_multipart([b"\x00" * (65 << 20)])  # oversized: a clear error, not a crash
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if fuzzer.poll(1000):
                reply = msgspec.msgpack.decode(fuzzer.recv_multipart()[0])
                replies[reply["t"]] = replies.get(reply["t"], 0) + 1
                if reply["t"] == "error" and reply["body"]["kind"] == "too-large":
                    break
        else:
            pytest.fail(f"no error for an oversized message; replies {replies}; server: {tail(process.log_path)}")
        fuzzer.send_multipart(encode(Message("bye", {}, 7)))
    finally:
        fuzzer.close(0)
        context.term()
    assert replies["error"] > 5000 and process.poll() is None, replies
    with connect(url) as session:  # a normal generation still matches transformers
        (req,) = run(session, PROMPTS[:1])
        reference = hf_reference.run(tiny_models["llama"], req.token_ids[:-1])
        assert rel_l2(req.hooks[H1].values, reference["resid_post"][1]).max() < 3 * PARITY_TOL


def test_keys_guard_a_server_that_faces_a_network(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    refused = subprocess.run([sys.executable, "-m", "inspector.cli", "serve", "--model", model,
                              "--listen", "tcp://0.0.0.0:5599"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "without CurveZMQ keys" in refused.stderr and "[loading]" not in refused.stdout
    keys = tmp_path / "keys"
    keygen(keys)
    keygen(keys, "alice")
    bob = tmp_path / "bob"
    keygen(bob)
    keygen(bob, "bob")  # a pair the server does not allow
    assert stat.S_IMODE(os.stat(keys / "alice.key_secret").st_mode) == 0o600
    with running_server(model, mode="eager", listen="tcp://0.0.0.0:5598", extra=["--keys", str(keys)]) as (_, process):
        url = "tcp://127.0.0.1:5598"
        alice = client_keys(keys / "alice.key_secret", keys / "server.key")
        with connect(url, keys=alice) as session:  # waits for the boot
            assert len(run(session, PROMPTS[:1])) == 1
        for who in (None, client_keys(bob / "bob.key_secret", keys / "server.key")):
            with pytest.raises(SessionError, match="no answer"):
                connect(url, keys=who, timeout_s=3)
        with connect(url, keys=alice) as session:  # and the server is none the worse
            assert len(run(session, PROMPTS[:1])) == 1
        assert process.poll() is None


def test_sigterm_ends_what_runs_says_goodbye_and_exits_zero(tiny_models):
    with running_server(tiny_models["llama"], mode="eager") as (url, process):
        with connect(url) as session:
            events = []
            stream = session.generate(PROMPTS[:2], Sampling(max_tokens=200, ignore_eos=True))
            events += [next(stream), next(stream)]
            process.send_signal(signal.SIGTERM)
            events += list(stream)  # the server's last events, then done: no error
            assert process.wait(60) == 0
        final = {s.request_id: s.finish_reason for s in events[-1].requests if s.finished}
        assert final == {rid: "stopped" for rid in session.run.requests}
        assert "[serve] stopped" in process.log_path.read_text()


def _rows_of(requests):
    return [(r.generated_token_ids, {h: (rows.positions.tolist(), rows.values) for h, rows in r.hooks.items()})
            for r in requests]


def assert_bit_for_bit(got, expected):
    for (tokens, hooks), (want_tokens, want_hooks) in zip(_rows_of(got), _rows_of(expected), strict=True):
        assert tokens == want_tokens and hooks.keys() == want_hooks.keys()
        for hook, (positions, values) in hooks.items():
            assert positions == want_hooks[hook][0] and np.array_equal(values, want_hooks[hook][1]), hook


LONG_PROMPTS = [p * 4 for p in PROMPTS] * 2  # a prefill step's rows: past what a message holds inline


def test_a_client_on_this_machine_gets_its_rows_through_shared_memory_bit_for_bit(compiled_server, monkeypatch):
    """A client offers shared memory; the server copies large rows into it, piece by piece, and the
    client the same rows as through the socket, even through a ring a third of a step's size (the
    server waits for room it gives back mid-step)."""
    from inspector.client import rows_ahead

    url, _ = compiled_server
    with connect(url, shared_rows=False) as by_socket:
        assert not by_socket.shared_rows
        expected = run(by_socket, LONG_PROMPTS)
    for ring in (rows_ahead.RING_BYTES, 32 << 10):
        monkeypatch.setattr(rows_ahead, "RING_BYTES", ring)
        with connect(url) as shared:
            assert shared.shared_rows
            got = run(shared, LONG_PROMPTS)
            through_ring, by_socket = shared._conn.rows_ahead.bytes_shared, shared._conn.rows_ahead.bytes_by_socket
        assert through_ring > 64 << 10 and by_socket == 0, f"ring of {ring} bytes"
        assert_bit_for_bit(got, expected)


def test_shared_memory_the_server_cannot_map_leaves_rows_to_the_socket(compiled_server, monkeypatch):
    """An offer of another process's descriptor (another PID namespace): the server checks the inode,
    declines, and the rows come through the socket."""
    from inspector.client import rows_ahead

    offer = rows_ahead.RowsAhead.offer
    monkeypatch.setattr(rows_ahead.RowsAhead, "offer", lambda self: {**offer(self), "inode": offer(self)["inode"] + 1})
    url, _ = compiled_server
    with connect(url, shared_rows=False) as by_socket:
        expected = run(by_socket, LONG_PROMPTS)
    with connect(url) as declined:
        assert not declined.shared_rows and declined._conn.rows_ahead is None
        assert_bit_for_bit(run(declined, LONG_PROMPTS), expected)


def test_a_client_too_busy_to_give_room_back_loses_nothing(compiled_server, monkeypatch):
    """The server waits ``ROOM_WAIT_S`` for room in a client's shared memory, then sends the rest
    through the socket; the client gets every row in order from both."""
    from inspector.client import rows_ahead

    monkeypatch.setattr(rows_ahead, "RING_BYTES", 32 << 10)
    take, calls = rows_ahead.RowsAhead.take, itertools.count()

    def busy_once(self, body):
        if next(calls) == 1:
            time.sleep(3)  # past the server's wait for room
        return take(self, body)

    monkeypatch.setattr(rows_ahead.RowsAhead, "take", busy_once)
    url, _ = compiled_server
    with connect(url, shared_rows=False) as by_socket:
        expected = run(by_socket, LONG_PROMPTS)
    with connect(url) as busy:
        got = run(busy, LONG_PROMPTS)
        assert busy._conn.rows_ahead.bytes_shared > 0 and busy._conn.rows_ahead.bytes_by_socket > 0
    assert_bit_for_bit(got, expected)
