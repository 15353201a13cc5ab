"""Through a server or in this process: decode with capture, and the wire's throughput.

    packaging/dev bench server_bench                      # CPU: the plugin bench's small Llama
    python3 bench/server_bench.py --preset llama3-8b      # GPU: Llama-3-8B shape, dummy bf16 weights

1. Decode: the same session options opened in this process (``Session``) and as a server of its own in
   a child process (``start_local_server``, what the app does), runs alternating; capture = the
   residual stream after every block, rows kept by the client. Target: server >= 0.95x in-process.
2. Wire: step events of rows (hooks x rows x width, float32) sent by the server's socket thread and
   decoded by a client, against a plain pyzmq send/receive of the same arrays, over loopback TCP and
   ipc://. Target: >= 0.8x. And the same rows in bulk step events through the shared memory a client
   on the server's machine offers (what the app's own server uses), against ours over ipc://.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plugin_bench import PRESETS, model_dir  # noqa: E402


def decode_bench(preset: str, reps: int) -> list[tuple]:
    from inspector.core.protocol import Sampling, SessionOptions
    from inspector.client.local import start_local_server
    from inspector.engine.environment import prepare_environment

    os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # the idle engine must not spin on the shared cores
    prepare_environment()
    from inspector.engine.session import Session

    _, dtype, max_batched, prompt_len, runs = PRESETS[preset]
    path, extra = model_dir(preset)
    engine_args = {k: v for k, v in extra.items() if k != "skip_tokenizer_init"}
    if preset != "cpu":
        engine_args["gpu_memory_utilization"] = 0.4
    options = SessionOptions(model=path, hooks=("blocks.*.hook_resid_post",), dtype=dtype, max_model_len=1024,
                             max_num_batched_tokens=max_batched, engine_args=engine_args)
    sessions = {"in-process": Session.open(options), "server": start_local_server(options)}
    prompt = ("def f(x):\n    return " * (prompt_len // 8) if preset == "cpu"
              else " ".join(f"w{2 + i}" for i in range(prompt_len)))  # the dummy model's word tokenizer
    rows = []
    try:
        for batch, new in runs:
            sampling = Sampling(max_tokens=new, ignore_eos=True, logprobs=0)
            rates = {name: [] for name in sessions}
            for name, session in sessions.items():  # warm-up
                list(session.generate([prompt] * batch, Sampling(max_tokens=4, ignore_eos=True)))
            for _ in range(reps):
                for name, session in sessions.items():
                    session.new_run()
                    t0, tokens = time.perf_counter(), 0
                    for event in session.generate([prompt] * batch, sampling):
                        tokens += sum(len(s.new_token_ids) for s in event.requests)
                    rates[name].append(tokens / (time.perf_counter() - t0))
            med = {name: statistics.median(r) for name, r in rates.items()}
            rows += [(f"decode {batch}x{new}, {name}", f"{med[name]:,.1f} tok/s", "", None) for name in sessions]
            ratio = med["server"] / med["in-process"]
            rows.append((f"decode {batch}x{new}, server / in-process", f"{ratio:.3f}", ">= 0.95", ratio >= 0.95))
    finally:
        for session in sessions.values():
            session.close()
    return rows


def wire_bench(reps: int, hooks: int = 32, n_rows: int = 64, width: int = 4096, events: int = 40) -> list[tuple]:
    import zmq

    from inspector.core.protocol import RequestStep, StepEvent
    from inspector.net.endpoint import Endpoint
    from inspector.net.wire import Message, decode, encode, event_from_body, event_to_body

    rng = np.random.default_rng(0)
    positions, tokens = np.arange(n_rows, dtype=np.int64), np.zeros(n_rows, dtype=np.int64)
    stack = rng.standard_normal((hooks, n_rows, width), dtype=np.float32)  # as a forward's host copy holds them
    rows = {f"h{k}": (positions, tokens, stack[k]) for k in range(hooks)}
    event = StepEvent(0, (RequestStep("req0", rows=rows),))
    payload = sum(v.nbytes + p.nbytes + t.nbytes for p, t, v in rows.values()) * events
    home = Path(tempfile.mkdtemp(prefix="wire-bench-"))
    out = []
    try:
        for transport, url in (("tcp", "tcp://127.0.0.1:5591"), ("ipc", f"ipc://{home / 'w.sock'}")):
            speeds = {"ours": [], "plain pyzmq": []}
            for rep in range(reps + 1):  # the first round warms the allocator up and is not counted
                for name in speeds:
                    context = zmq.Context()
                    server, client = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
                    server.bind(url)
                    client.connect(url)
                    client.send(b"hello")
                    peer = server.recv_multipart()[0]
                    t0 = time.perf_counter()
                    if name == "ours":
                        endpoint = Endpoint(server, lambda frames: None, lambda: None, routed=True).start()
                        for k in range(events):
                            endpoint.send(encode(Message("event", event_to_body(event), k)), peer)
                        for _ in range(events):
                            got = event_from_body(decode(client.recv_multipart(copy=False)).body)
                        assert got.requests[0].rows["h0"][2].shape == (n_rows, width)
                        endpoint.stop()
                    else:
                        frames = [b"header"] + [a for p, t, v in rows.values() for a in (p, t, v)]
                        sender = threading.Thread(target=lambda: [server.send_multipart([peer, *frames], copy=False)
                                                                  for _ in range(events)])
                        sender.start()
                        for _ in range(events):
                            client.recv_multipart(copy=False)
                        sender.join()
                        server.close(0)
                    if rep:
                        speeds[name].append(payload / (time.perf_counter() - t0) / 1e9)
                    client.close(0)
                    context.term()
            med = {name: statistics.median(s) for name, s in speeds.items()}
            out += [(f"rows over {transport}, {name}", f"{med[name]:.2f} GB/s", "", None) for name in speeds]
            ratio = med["ours"] / med["plain pyzmq"]
            out.append((f"rows over {transport}, ours / plain pyzmq", f"{ratio:.2f}", ">= 0.8", ratio >= 0.8))
        shared = statistics.median(shared_memory_gb_s(f"ipc://{home / 's.sock'}", rows, events, reps + 1)[1:])
        out.append(("rows through shared memory (a client on this machine)", f"{shared:.2f} GB/s", "", None))
        out.append(("rows through shared memory / over ipc, ours", f"{shared / med['ours']:.2f}", "", None))
        busy = statistics.median(shared_memory_gb_s(f"ipc://{home / 'b.sock'}", rows, events, reps + 1, True)[1:])
        out.append(("the same beside a thread running Python (an engine's)", f"{busy:.2f} GB/s", "", None))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return out


def shared_memory_gb_s(url: str, rows: dict, events: int, rounds: int, busy: bool = False) -> list[float]:
    """The same rows as bulk step events from a server's socket thread to a client that offered shared
    memory (``inspector.server.shared_rows``): each event's rows copied into the client's ring piece by
    piece, and out of it by the client. GB/s of each round of ``events`` on one connection (the first
    makes the ring's pages). ``busy``: beside a thread that runs Python all along, as a server's engine
    thread does, which each copy waits for when it takes the GIL back."""
    import queue

    import zmq

    from inspector.client.connection import Connection
    from inspector.client.rows_ahead import RowsAhead
    from inspector.core.blocks import RowBlocks
    from inspector.core.protocol import RequestStep, StepEvent
    from inspector.core.shared_ring import Copiers, SharedRing
    from inspector.net.endpoint import Endpoint
    from inspector.net.wire import Message, decode, encode, event_from_body, event_to_body
    from inspector.server.shared_rows import SharedRows

    positions, tokens, _ = next(iter(rows.values()))
    values = {hook: v for hook, (_, _, v) in rows.items()}
    event = StepEvent(0, (RequestStep("req0"),), blocks=(RowBlocks(["req0"], [0, len(positions)], positions, tokens,
                                                                    values),))
    payload = sum(v.nbytes for v in values.values()) * events
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind(url)
    calls: queue.SimpleQueue = queue.SimpleQueue()
    shared: list = []

    def received(frames):
        message = decode(frames[1:])
        if message.type == "rows_read":
            shared[0].read(message.body["message"])
        elif message.type == "go":
            calls.put((frames[0].bytes, message.id))

    endpoint = Endpoint(server, received, lambda: None, routed=True).start()
    client = Connection(url, rows_ahead=RowsAhead())
    call = client.start("go")
    peer, call_id = calls.get()
    copiers = Copiers("bench-rows-copy")
    shared.append(SharedRows(SharedRing.opened(client.rows_ahead.offer()), lambda m: endpoint.send(encode(m), peer),
                             copiers))

    def send():
        for _ in range(events):
            endpoint.send(encode(Message("event", shared[0].send_ahead(event_to_body(event)), call_id)), peer)

    stop = threading.Event()
    if busy:
        threading.Thread(target=_run_python, args=(stop,), daemon=True).start()
    speeds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        for _ in range(events):
            got = event_from_body(call.next(timeout_s=60).body)
        speeds.append(payload / (time.perf_counter() - t0) / 1e9)
        sender.join()
    stop.set()
    assert got.blocks[0].values["h0"].shape == values["h0"].shape
    assert client.rows_ahead.bytes_shared == payload * rounds
    call.close()
    client.close(say_bye=False)
    shared[0].close()
    copiers.shutdown()
    endpoint.stop()
    context.term()
    return speeds


def _run_python(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        n += 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args(argv)
    rows = wire_bench(args.reps)
    if not args.skip_decode:
        rows += decode_bench(args.preset, args.reps)
    print(f"\n{'measure':52s} {'value':>16s} {'target':>8s}  met")
    for name, value, target, ok in rows:
        print(f"{name:52s} {value:>16s} {target:>8s}  {'yes' if ok else ('—' if ok is None else 'NO')}")
    return 0 if all(ok is not False for *_, ok in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
