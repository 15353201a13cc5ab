"""HDF5 capture files: exact round trip, streaming, other tools, clear errors, atomicity, lazy reads."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from inspector.core.blocks import RowBlocks
from inspector.core.hooks import HookPoint
from inspector.core.run import HookRows, LensRows, RequestCapture, Run, TopToken
from inspector.core.dtypes import BFLOAT16, ROW_DTYPES
from inspector.io import (FORMAT_NAME, FORMAT_VERSION, CaptureFileError, CaptureWriter, H5Array, LazyHookRows,
                          open_run, read_run, write_run)
from inspector.io.background import BackgroundWriter
from inspector.io.format import EXPORT_CHUNK_BYTES, chunk_cols_for, chunk_rows_for, escape_name, unescape_name

H5DUMP = shutil.which("h5dump") or ("/usr/bin/h5dump" if os.path.exists("/usr/bin/h5dump") else None)
REPO = Path(__file__).resolve().parents[1]

HOOK_SPECS = [  # name, width, layer
    ("model.layers.0.resid_post", 48, 0),
    ("model.layers.1.mlp.down_proj", 1100, 1),
    ("odd/name%with.slash", 5, -1),
    ("...", 3, -1),
]
TEXTS = ["The", " caf\u00e9", " \U0001F600", "", "\x00", "\ud800", " \u65e5\u672c", "a/b", "\n", "\u00e9\u0301"]


def special_values(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    v = rng.standard_normal((n, width), dtype=np.float32)
    flat = v.reshape(-1)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45, np.float32(3.4e38)], dtype=np.float32)
    flat[: min(len(flat), len(specials))] = specials[: len(flat)]
    # a NaN with a payload: bit-for-bit means bits, not just "is NaN"
    if len(flat) > 7:
        flat.view(np.uint32)[7] = 0x7FC0_1234
    return v


def make_run(seed: int = 0, rows=(300, 1, 0), generated=(40, 0, 3), dtype=np.float32) -> Run:
    rng = np.random.default_rng(seed)
    hooks = {name: HookPoint(name, f"L{layer}.{name[-8:]}", f"model.{name}", "resid", width, layer, "bfloat16")
             for name, width, layer in HOOK_SPECS}
    run = Run(metadata={"app_version": "0.1.0", "vllm_version": "0.32.0", "model_path": "/models/tiny \u00e9",
                        "model_config": {"hidden_size": 48, "layers": [0, 1], "name": "t\u00efny \U0001F600"},
                        "dtype": "bfloat16", "engine_mode": "compiled", "created": "2025-01-02T03:04:05+00:00",
                        "extra": {"nested": [1, 2.5, None, True]}},
              hooks=hooks)
    for r, (n_rows, n_gen) in enumerate(zip(rows, generated)):
        n_prompt = 5 + r
        prompt_ids = rng.integers(0, 50_000, n_prompt).tolist()
        gen_ids = rng.integers(0, 50_000, n_gen).tolist()
        texts = [TEXTS[i % len(TEXTS)] for i in range(n_prompt + n_gen)]
        top = [[TopToken(int(t), float(lp), TEXTS[(j + k) % len(TEXTS)])
                for j, (t, lp) in enumerate(zip(rng.integers(0, 50_000, k), -rng.random(k) * 10))]
               for k in rng.integers(0, 4, n_gen)]  # ragged, k may be 0; texts HDF5 cannot hold too
        req = RequestCapture(
            request_id=f"req-{r}-\u00e9", prompt=f"Hello w\u00f6rld \U0001F600 #{r}\x00end" if r == 1 else f"prompt {r}",
            prompt_token_ids=prompt_ids, sampling={"temperature": 0.7, "max_tokens": n_gen, "stop": ["\n"]},
            generated_token_ids=gen_ids, token_texts=texts,
            logprobs=[float(x) for x in -rng.random(n_gen) * 5], top_logprobs=top,
            intervention_log=[(0, []), (n_prompt, [{"hook": HOOK_SPECS[0][0], "scale": 2.0, "bias": [0.5, -1.0],
                                                     "request_id": None, "positions": None}])],
            finish_reason=None if r == 2 else "length")
        for name, width, _ in HOOK_SPECS:
            hr = HookRows(width, dtype=dtype)
            n = n_rows if name != "..." else min(n_rows, 2)
            if n:
                with np.errstate(over="ignore"):  # float16: 3.4e38 becomes inf, a special value too
                    values = special_values(rng, n, width).astype(dtype)
                hr.append(np.arange(n, dtype=np.int64), rng.integers(0, 50_000, n), values)
            req.hooks[name] = hr
            if n and name in ("model.layers.0.resid_post", "odd/name%with.slash"):  # a lens, escaped name too
                lens = req.lens[name] = LensRows(3)
                chosen = rng.integers(-1, 50_000, n)  # -1: the next token is unknown (the last row)
                lens.append(np.arange(n), rng.integers(0, 50_000, (n, 3)), -rng.random((n, 3)).astype(np.float32),
                            chosen, np.where(chosen >= 0, -rng.random(n), np.nan), np.where(chosen >= 0, 2, -1))
        run.requests[req.request_id] = req
    run.vocabulary = {int(i): TEXTS[j % len(TEXTS)] for j, i in enumerate(rng.integers(0, 50_000, 20))}
    return run


def bits(a) -> np.ndarray:
    a = np.asarray(a)
    assert a.dtype in ROW_DTYPES.values(), a.dtype
    return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


def assert_runs_equal(a: Run, b: Run) -> None:
    assert a.metadata == b.metadata and a.vocabulary == b.vocabulary
    assert list(a.hooks.items()) == list(b.hooks.items())
    assert list(a.requests) == list(b.requests)
    for rid, ra in a.requests.items():
        rb = b.requests[rid]
        for field in ("request_id", "prompt", "prompt_token_ids", "sampling", "generated_token_ids", "token_texts",
                      "logprobs", "top_logprobs", "intervention_log", "finish_reason", "windows"):
            assert getattr(ra, field) == getattr(rb, field), (rid, field)
        assert list(ra.hooks) == list(rb.hooks)
        for name, ha in ra.hooks.items():
            hb = rb.hooks[name]
            assert ha.width == hb.width and len(ha) == len(hb) and ha.dtype == hb.dtype
            assert np.array_equal(ha.positions, hb.positions) and np.array_equal(ha.token_ids, hb.token_ids)
            assert np.array_equal(bits(ha.values), bits(hb.values)), (rid, name)
        assert list(ra.lens) == list(rb.lens)
        for name, la in ra.lens.items():
            for column in LensRows.COLUMNS:
                x, y = la.column(column), rb.lens[name].column(column)
                assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)), (rid, name, column)


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d))


# ------------------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("dtype", ROW_DTYPES.values(), ids=ROW_DTYPES)
def test_round_trip_bit_for_bit(tmp_path, dtype):
    run = make_run(dtype=dtype)
    path = tmp_path / "run.h5"
    seen = []
    assert write_run(run, path, progress=seen.append) == path
    assert listing(tmp_path) == ["run.h5"]  # no temp file left
    assert seen[0] == 0.0 and seen[-1] == 1.0 and seen == sorted(seen)
    assert_runs_equal(run, read_run(path))
    with open_run(path) as rf:
        assert_runs_equal(run, rf.run)
        rows = rf.run.requests["req-0-\u00e9"].hooks["model.layers.1.mlp.down_proj"]
        assert isinstance(rows, LazyHookRows) and isinstance(rows.values, H5Array)
    with h5py.File(path, "r") as f:  # plain h5py, no inspector code: the documented layout
        assert f.attrs["format"] == FORMAT_NAME and f.attrs["format_version"] == FORMAT_VERSION
        assert json.loads(f.attrs["model_config"])["hidden_size"] == 48
        assert f.attrs["created"] == "2025-01-02T03:04:05+00:00" and f.attrs["engine_mode"] == "compiled"
        assert f["hooks/model.layers.0.resid_post"].attrs["source_dtype"] == "bfloat16"
        assert f["hooks/odd%2Fname%25with.slash"].attrs["name"] == "odd/name%with.slash"
        g = f["requests/0"]
        assert g.attrs["request_id"] == "req-0-\u00e9"
        v = g["hooks/model.layers.1.mlp.down_proj/values"]
        # chunks of whole rows; written whole, a request's 300 rows fit in one chunk of up to 4 MiB
        assert v.dtype == (np.uint16 if dtype == BFLOAT16 else dtype) and v.maxshape == (None, 1100)
        assert v.chunks == (300, 1100) and v.attrs.get("dtype") == ("bfloat16" if dtype == BFLOAT16 else None)
        if dtype == BFLOAT16:  # the documented way to read it without our code
            expected = np.asarray(run.requests["req-0-\u00e9"].hooks["model.layers.1.mlp.down_proj"].values, np.float32)
            np.testing.assert_array_equal((v[...].astype(np.uint32) << 16).view(np.float32), expected)
        assert v.compression is None
        assert g["token_texts"].asstr()[1] == " caf\u00e9"
        assert g["top_logprob_ids"].shape[0] == 40 and g["is_prompt"][:5].all()
        assert json.loads(g.attrs["intervention_log"])[1][1][0]["scale"] == 2.0
        assert f["requests/1/hooks/model.layers.0.resid_post/values"].chunks == (1, 48)  # 1 row: no padding
        assert f["vocabulary/ids"].shape == f["vocabulary/texts"].shape == (len(run.vocabulary),)


def test_escape_names():
    for name in ["model.layers.0.resid_post", "a/b", "%2F", "...", ".", "x%y/z", "\u00e9/\U0001F600"]:
        e = escape_name(name)
        assert "/" not in e and e not in (".", "..") and unescape_name(e) == name
    assert escape_name("model.layers.0.resid_post") == "model.layers.0.resid_post"
    with pytest.raises(ValueError):
        escape_name("")


# ------------------------------------------------------------------------------------------ streaming

def stream(run: Run, path: Path, seed: int, **options) -> None:
    """Feed a run as the engine would: a prefill chunk, then one row per decode step, updates along the way."""
    rng = np.random.default_rng(seed)
    with CaptureWriter(path, run.metadata, run.hooks, **options) as w:
        for req in run.requests.values():
            w.add_request(RequestCapture(req.request_id, req.prompt, list(req.prompt_token_ids), req.sampling))
        for req in run.requests.values():
            for name, lens in req.lens.items():
                for a in range(len(lens)):  # a row per step
                    w.append_lens(req.request_id, name, {c: lens.column(c)[a:a + 1] for c in LensRows.COLUMNS})
            for name, rows in req.hooks.items():
                n = len(rows)
                cuts = [0, min(n, int(rng.integers(0, 40)))]  # prefill
                while cuts[-1] < n:
                    cuts.append(min(n, cuts[-1] + int(rng.choice([1, 1, 1, 3, 300]))))
                if n == 0:
                    w.append_rows(req.request_id, name, [], [], np.zeros((0, rows.width), np.float32))
                for a, b in zip(cuts, cuts[1:]):
                    w.append_rows(req.request_id, name, rows.positions[a:b], rows.token_ids[a:b],
                                  rows.values[a:b].copy())
                partial = RequestCapture(req.request_id, "stale", [1], {"stale": True}, [2], ["x"], [0.0],
                                         [[TopToken(1, 0.0, "y")]], [], finish_reason=None)
                w.update_request(partial)  # later calls win
        for req in run.requests.values():
            w.update_request(req)
        w.add_vocabulary(dict(list(run.vocabulary.items())[:5]))  # in pieces, as the lens names them
        w.add_vocabulary(run.vocabulary)


def test_streaming_equals_one_shot(tmp_path):
    run = make_run(seed=1, rows=(700, 2, 0))
    write_run(run, tmp_path / "one.h5")
    stream(run, tmp_path / "stream.h5", seed=2)
    stream(run, tmp_path / "tiny_buffer.h5", seed=3, buffer_bytes=10_000)  # forces partial, unaligned flushes
    one = read_run(tmp_path / "one.h5")
    assert_runs_equal(run, one)
    for name in ("stream.h5", "tiny_buffer.h5"):
        assert_runs_equal(one, read_run(tmp_path / name))
    with h5py.File(tmp_path / "stream.h5", "r") as streamed, h5py.File(tmp_path / "one.h5", "r") as whole:
        values = "requests/0/hooks/model.layers.1.mlp.down_proj/values"
        assert streamed[values].chunks == (59, 1100) and whole[values].chunks == (700, 1100)  # 256 KiB of rows; all
    assert listing(tmp_path) == ["one.h5", "stream.h5", "tiny_buffer.h5"]


class InProcessWriter(CaptureWriter):
    """A CaptureWriter called as a BackgroundWriter is."""

    def call(self, method: str, *args) -> None:
        getattr(self, method)(*args)


def stream_in_bulk(run: Run, path: Path, seed: int, in_process: bool = False, backlog_bytes: int = 1 << 16,
                   **options) -> None:
    """Feed a run as a session in bulk does, through a writer in a process of its own (a small ring of
    shared memory, so its room is reused many times) or in this one (steps staged as deep as the
    buffer lets them): each step one
    ``RowBlocks`` of the requests with rows left, of every hook that has them for all those requests;
    a hook with fewer rows gets its rows one (request, hook) at a time, between bulk steps."""
    rng = np.random.default_rng(seed)
    done = {rid: 0 for rid in run.requests}
    file = (InProcessWriter(path, run.metadata, run.hooks, **options) if in_process
            else BackgroundWriter(path, run.metadata, run.hooks, backlog_bytes=backlog_bytes, **options))
    late = list(run.requests)[-1]  # starts once another has finished: it may take the place that one had

    def start(req):
        file.call("add_request", RequestCapture(req.request_id, req.prompt, list(req.prompt_token_ids), req.sampling))
        started.append(req.request_id)

    with file:
        started = []
        for req in run.requests.values():
            if req.request_id != late:
                start(req)
        while True:
            left = {rid: max(len(rows) for rows in run.requests[rid].hooks.values()) - done[rid] for rid in started}
            if late not in started and any(n == 0 for n in left.values()):
                start(run.requests[late])
                left[late] = max(len(rows) for rows in run.requests[late].hooks.values())
            taking = {rid: min(n, int(rng.choice([1, 1, 2, 50]))) for rid, n in left.items() if n > 0}
            if not taking:
                break
            whole = [name for name in run.hooks if all(len(run.requests[rid].hooks[name]) >= done[rid] + n
                                                       for rid, n in taking.items())]
            cut = {rid: slice(done[rid], done[rid] + n) for rid, n in taking.items()}
            pick = lambda column: np.concatenate([getattr(run.requests[rid].hooks[whole[0]], column)[w]  # noqa: E731
                                                  for rid, w in cut.items()])
            blocks = RowBlocks(list(taking), np.concatenate([[0], np.cumsum(list(taking.values()))]), pick("positions"),
                               pick("token_ids"), {name: np.concatenate([run.requests[rid].hooks[name].values[w]
                                                                           for rid, w in cut.items()])
                                                   for name in whole})
            file.call("append_blocks", blocks)
            if in_process and not file.holding_blocks:  # let go of: reused, as the ring reuses its room
                for values in blocks.values.values():
                    values[...] = 0
            for rid, w in cut.items():
                for name, rows in run.requests[rid].hooks.items():
                    if name not in whole and w.start < len(rows):
                        file.call("append_rows", rid, name, rows.positions[w], rows.token_ids[w], rows.values[w])
                done[rid] = w.stop
            for rid in taking:
                if left[rid] == taking[rid] and (late not in started or rng.random() < 0.5):
                    file.call("update_request", run.requests[rid])  # finishing, rows maybe still staged
        for name in run.hooks:  # a (request, hook) with no rows at all still gets its (empty) datasets
            for req in run.requests.values():
                if not len(req.hooks[name]):
                    file.call("append_rows", req.request_id, name, [], [], np.zeros((0, run.hooks[name].width), np.float32))
        for req in run.requests.values():
            file.call("update_request", req)
        file.call("add_vocabulary", run.vocabulary)
        for req in run.requests.values():
            for name, lens in req.lens.items():
                file.call("append_lens", req.request_id, name, {c: lens.column(c) for c in LensRows.COLUMNS})


def engine_like_run(seed: int) -> Run:
    """A run whose requests finish at different steps and whose hooks see the same tokens at a position,
    as an engine's do."""
    run = make_run(seed=seed, rows=(700, 300, 650))
    for req in run.requests.values():
        ids = max(req.hooks.values(), key=len).token_ids
        for name, rows in req.hooks.items():
            req.hooks[name] = HookRows(rows.width, dtype=rows.dtype)
            req.hooks[name].append(rows.positions, ids[:len(rows)], rows.values)
    return run


@pytest.mark.parametrize("in_process, buffer_bytes", [(False, 128 << 20), (False, 10_000), (True, 128 << 20),
                                                    (True, 2 << 20)],
                         ids=["staged", "tiny buffer", "in process, staged to the end", "in process, staged deep"])
def test_steps_in_bulk_equal_one_shot(tmp_path, in_process, buffer_bytes):
    """``append_blocks`` (staged, written a hook at a time) mixed with single (request, hook) rows, in
    the writer's own process or in this one with many steps staged (requests finishing among them):
    the file holds the same run, bit for bit."""
    run = engine_like_run(seed=4)
    write_run(run, tmp_path / "one.h5")
    stream_in_bulk(run, tmp_path / "bulk.h5", seed=5, in_process=in_process, buffer_bytes=buffer_bytes)
    assert_runs_equal(read_run(tmp_path / "one.h5"), read_run(tmp_path / "bulk.h5"))


@pytest.mark.timeout(120)  # a buffer filled past its chunk boundary has made the writer loop
@pytest.mark.parametrize("memory", ["ample", "tight"])
def test_bulk_steps_of_requests_coming_and_going_and_hooks_skipping_rows(tmp_path, monkeypatch, memory):
    """Bulk steps as a busy engine makes them: requests start while others finish (and take the places
    they had), rows come one or several a request, a hook sits out some steps and comes back; chunks
    of a few rows, and with tight memory partial chunks written early. Every (request, hook) reads
    back exactly its rows, positions and token ids."""
    import inspector.io.writer as writer_module

    monkeypatch.setattr(writer_module, "chunk_rows_for", lambda *args, **kwargs: 4)
    if memory == "tight":
        monkeypatch.setattr(writer_module, "MEMORY_BYTES", 1 << 15)  # written out every few steps
    rng = np.random.default_rng(11)
    hooks = {name: HookPoint(name, name, f"model.{name}", "resid", width, k, "bfloat16")
             for k, (name, width) in enumerate([("a", 64), ("b", 64), ("c", 24)])}
    expected: dict[tuple[str, str], list] = {}
    next_position: dict[str, int] = {}
    active: list[str] = []
    peak = 0
    with CaptureWriter(tmp_path / "f.h5", {}, hooks, buffer_bytes=1 << 10) as writer:
        for step in range(300):
            if len(next_position) < 40 and (not active or rng.random() < 0.5):
                rid = f"r{len(next_position)}"
                writer.add_request(RequestCapture(rid, "p", [1, 2], {}))
                next_position[rid] = 0
                active.append(rid)
            peak = max(peak, len(active))
            taking = {rid: int(rng.choice([1, 1, 1, 1, 1, 3, 9])) for rid in active if rng.random() < 0.9}
            if not taking:
                continue
            present = [h for h in hooks if rng.random() < 0.97] or ["a"]
            positions = np.concatenate([np.arange(next_position[rid], next_position[rid] + n) for rid, n in taking.items()])
            token_ids = rng.integers(0, 1000, len(positions))
            values = {h: rng.standard_normal((len(positions), hooks[h].width), dtype=np.float32).astype(BFLOAT16)
                      for h in present}
            writer.append_blocks(RowBlocks(list(taking), np.concatenate([[0], np.cumsum(list(taking.values()))]),
                                           positions, token_ids, values))
            at = 0
            for rid, n in taking.items():
                next_position[rid] += n
                for h in present:
                    expected.setdefault((rid, h), []).append((positions[at:at + n], token_ids[at:at + n],
                                                              values[h][at:at + n]))
                at += n
            for rid in list(active):
                if rng.random() < 0.02:
                    active.remove(rid)
                    writer.update_request(RequestCapture(rid, "p", [1, 2], {}, finish_reason="length"))
    assert writer._slots.made <= peak + 2  # the slabs' memory follows the requests in flight, not all requests
    run = read_run(tmp_path / "f.h5")
    assert len(run.requests) == len(next_position) > peak + 2
    for (rid, h), parts in expected.items():
        got = run.requests[rid].hooks[h]
        want = [np.concatenate(column) for column in zip(*parts)]
        np.testing.assert_array_equal(got.positions, want[0])
        np.testing.assert_array_equal(got.token_ids, want[1])
        np.testing.assert_array_equal(np.asarray(got.values).view(np.uint16), want[2].view(np.uint16))
    with h5py.File(tmp_path / "f.h5") as f:  # a last chunk's rows past the data are zero, not another's rows
        for request in f["requests"].values():
            for hook in request["hooks"].values():
                values = hook["values"]
                rows, chunk = len(values), values.chunks[0]
                if rows % chunk and not values.compression:
                    _, raw = values.id.read_direct_chunk((rows - rows % chunk, 0))
                    tail = np.frombuffer(raw, np.uint16).reshape(chunk, -1)[rows % chunk:]
                    assert not tail.any()


@pytest.mark.parametrize("streamed", ["in bulk", "a (request, hook) at a time", "through the ring"])
def test_rows_written_from_where_they_lie_are_not_overwritten_before_the_disk_has_them(tmp_path, monkeypatch, request,
                                                                                       streamed):
    """Whole chunks go to the file's write-behind thread as views of where they lie (a slab's full
    chunk, the staged steps, the writer process's ring), not copies: with that thread slowed down and
    chunks of a few rows, every buffer must still wait for its writes before it is filled again (the
    file equals the one-shot write, bit for bit). The writer's process runs here in a thread, so that
    its writes are slowed too."""
    import inspector.io.latching_file as latching_file
    import inspector.io.writer as writer_module

    run = engine_like_run(seed=6)
    wide = "model.layers.1.mlp.down_proj"
    twins = {f"{wide}.twin{k}": k for k in (1, 2)}  # three hooks of one width in a row
    run.hooks = {name: run.hooks[wide] if name in twins else info for base, info in run.hooks.items()
                 for name in ((base, *twins) if base == wide else (base,))}
    for name, k in twins.items():
        run.hooks[name] = dataclasses.replace(run.hooks[wide], name=name)
        for req in run.requests.values():
            rows = req.hooks[wide]
            req.hooks[name] = HookRows(rows.width, dtype=rows.dtype)
            req.hooks[name].append(rows.positions, rows.token_ids, np.roll(rows.values, k, axis=1))
    write_run(run, tmp_path / "one.h5")

    pwrite = latching_file.write_pieces

    def slow_pwrite(fd, pieces, pos, direct=None):
        if max(len(piece) for piece in pieces) >= latching_file.LatchingFile.LEND_FROM:
            time.sleep(0.002)
        return pwrite(fd, pieces, pos, direct)

    monkeypatch.setattr(latching_file, "write_pieces", slow_pwrite)
    monkeypatch.setattr(latching_file.LatchingFile, "LEND_FROM", 64)
    monkeypatch.setattr(writer_module, "chunk_rows_for", lambda *args, **kwargs: 8)
    if streamed == "in bulk":
        stream_in_bulk(run, tmp_path / "streamed.h5", seed=7, in_process=True, buffer_bytes=2 << 20)
    elif streamed == "through the ring":
        request.getfixturevalue("writer_in_a_thread")
        stream_in_bulk(run, tmp_path / "streamed.h5", seed=7, backlog_bytes=1 << 20)  # pieces of whole chunks
    else:
        stream(run, tmp_path / "streamed.h5", seed=7)
    assert_runs_equal(read_run(tmp_path / "one.h5"), read_run(tmp_path / "streamed.h5"))


def test_writes_that_continue_each_other_leave_in_one_call_in_order(tmp_path, monkeypatch):
    """The write-behind thread joins queued writes that continue each other on the file into one call,
    and keeps a write elsewhere (HDF5's metadata) in its place: the file is what the writes in order make."""
    import inspector.io.latching_file as latching_file

    calls, held = [], threading.Event()
    pwrite = latching_file.write_pieces

    def counted(fd, pieces, pos, direct=None):
        held.wait(10)  # the writes queue up behind the first
        calls.append(len(pieces))
        return pwrite(fd, pieces, pos, direct)

    monkeypatch.setattr(latching_file, "write_pieces", counted)
    file = latching_file.LatchingFile(tmp_path / "f")
    rng = np.random.default_rng(0)
    expected = bytearray(500_000)
    writes = [(k * 1000, rng.bytes(1000)) for k in range(300)] + [(10, b"meta"), *((300_000 + k * 999, rng.bytes(999))
                                                                                   for k in range(200))]
    for pos, data in writes:
        file.seek(pos)
        file.write(data)
        expected[pos:pos + len(data)] = data
    held.set()
    file.finish(fsync=False)
    written = (tmp_path / "f").read_bytes()
    assert len(written) == 300_000 + 200 * 999 and written == bytes(expected[:len(written)])
    assert sum(calls) == len(writes) and len(calls) <= 6  # the first alone, then runs of up to 512


def test_a_captures_metadata_leaves_in_pages_so_its_chunks_lie_end_to_end(tmp_path, monkeypatch):
    """HDF5 keeps the file's metadata in pages: no write smaller than a page reaches the file (thousands
    of small metadata writes between the chunks kept them from being joined into one call), and the file
    reads back as it was written."""
    import inspector.io.latching_file as latching_file
    from inspector.io.atomic_file import PAGE_BYTES

    sizes = []
    write = latching_file.LatchingFile.write
    monkeypatch.setattr(latching_file.LatchingFile, "write",
                        lambda self, data: (sizes.append(memoryview(data).nbytes), write(self, data))[1])
    run = engine_like_run(seed=8)
    stream(run, tmp_path / "paged.h5", seed=9)
    assert sizes and min(sizes) >= PAGE_BYTES
    assert_runs_equal(read_run(tmp_path / "paged.h5"), run)


def test_a_background_writers_failure_is_raised_on_the_callers_thread_and_leaves_no_file(tmp_path):
    file = BackgroundWriter(tmp_path / "x.h5", {}, {"h": HookPoint("h", "h", "", "resid", 4)})
    file.call("append_blocks", RowBlocks(["nobody"], [0, 1], np.zeros(1, np.int64), np.zeros(1, np.int64),
                                         {"h": np.zeros((1, 4), np.float32)}))
    with pytest.raises(ValueError, match="unknown request 'nobody'"):
        for _ in range(1000):  # the next call after the thread met it
            file.call("add_vocabulary", {1: "a"})
            time.sleep(0.01)
    with pytest.raises(ValueError, match="unknown request"):
        file.close()
    assert listing(tmp_path) == []


def test_a_file_the_writers_process_cannot_open_is_raised_by_a_later_call_and_nothing_is_written(tmp_path):
    """The writer's process starts while the engine runs: the constructor does not wait for it."""
    (tmp_path / "taken").write_text("a file where the capture's folder would be")
    hooks = {"h": HookPoint("h", "h", "", "resid", 4)}
    file = BackgroundWriter(tmp_path / "taken" / "x.h5", {}, hooks)
    with pytest.raises(Exception) as raised:
        for _ in range(1000):
            file.call("add_request", RequestCapture("a", "p", [1], {}))
            time.sleep(0.01)
        file.close()
    assert "taken" in str(raised.value)
    assert listing(tmp_path) == ["taken"]


def test_the_next_files_writer_process_is_started_ahead_and_taken_if_its_ring_fits(tmp_path, monkeypatch):
    """``prepare`` starts the next file's process ahead (``inspector capture`` does while its engine
    boots; a caller may wait until it has started): the next writer starts none of its own; one
    prepared with another ring size is stopped and a fitting one started. Either way the file is the
    one-shot write, bit for bit."""
    from inspector.io import background

    run = engine_like_run(seed=8)
    write_run(run, tmp_path / "one.h5")
    start = background._start
    started = []
    monkeypatch.setattr(background, "_start", lambda size, **options: started.append(size) or start(size, **options))
    for prepared_size, name in ((1 << 16, "fits.h5"), (1 << 20, "other.h5")):  # stream_in_bulk's ring: 1 << 16
        background.prepare(prepared_size)
        background.prepare(prepared_size, wait=True)  # one is enough: a second call starts none, and waits for it
        _, thread, made = background._spare[0]
        assert made["ready"] and not thread.is_alive()
        background.prepare(prepared_size, wait=True)  # started: at once
        process = made["worker"].process
        stream_in_bulk(run, tmp_path / name, seed=9)
        process.join(timeout=30)
        assert process.exitcode == 0 and not background._spare
        assert_runs_equal(read_run(tmp_path / "one.h5"), read_run(tmp_path / name))
    assert started == [1 << 16, 1 << 20, 1 << 16]


def test_a_whole_run_is_written_in_chunks_of_up_to_4_mib_that_split_its_rows_evenly(tmp_path):
    run = make_run(rows=(3 * 953 + 1, 953, 0))  # 953 rows of 1,100 float32: the most a 4 MiB chunk holds
    write_run(run, tmp_path / "whole.h5", fsync=False)
    write_run(run, tmp_path / "lzf.h5", compression="lzf", fsync=False)
    assert_runs_equal(run, read_run(tmp_path / "whole.h5"))
    with h5py.File(tmp_path / "whole.h5", "r") as f, h5py.File(tmp_path / "lzf.h5", "r") as compressed:
        values = "hooks/model.layers.1.mlp.down_proj/values"
        assert f[f"requests/0/{values}"].chunks == (715, 1100)  # 4 chunk rows for 2,860 rows: no padding
        assert f[f"requests/1/{values}"].chunks == (953, 1100)
        assert compressed[f"requests/0/{values}"].chunks == (59, 1100)  # a compressed chunk is read whole: small


@pytest.mark.parametrize("compression, filters", [("lzf", {"shuffle", "lzf"}), (("gzip", 4), {"shuffle", "gzip"})])
def test_compressed_files_read_back_bit_for_bit(tmp_path, compression, filters):
    run = make_run(rows=(300, 1, 0))
    write_run(run, tmp_path / "whole.h5", compression=compression, fsync=False)
    stream(run, tmp_path / "streamed.h5", seed=4, compression=compression, fsync=False)
    for name in ("whole.h5", "streamed.h5"):
        assert_runs_equal(run, read_run(tmp_path / name))
        with h5py.File(tmp_path / name, "r") as f:
            for dataset in ("values", "positions", "token_ids"):
                d = f[f"requests/0/hooks/model.layers.1.mlp.down_proj/{dataset}"]
                assert set(d._filters) == filters and (d.compression_opts == 4) == (compression != "lzf")
    with pytest.raises(ValueError, match="compression must be"):
        CaptureWriter(tmp_path / "bad.h5", run.metadata, run.hooks, compression="zstd")
    assert listing(tmp_path) == ["streamed.h5", "whole.h5"]


def test_writer_argument_errors_keep_writer_usable(tmp_path):
    run = make_run(rows=(3, 0, 0))
    req = run.requests["req-0-\u00e9"]
    with CaptureWriter(tmp_path / "r.h5", run.metadata, run.hooks, fsync=False) as w:
        w.add_request(req)
        with pytest.raises(ValueError, match="already added"):
            w.add_request(req)
        with pytest.raises(ValueError, match="unknown request"):
            w.append_rows("nope", "...", [0], [0], np.zeros((1, 3), np.float32))
        with pytest.raises(ValueError, match="unknown hook"):
            w.append_rows(req.request_id, "nope", [0], [0], np.zeros((1, 3), np.float32))
        with pytest.raises(ValueError, match="width 3"):
            w.append_rows(req.request_id, "...", [0], [0], np.zeros((1, 4), np.float32))
        w.append_rows(req.request_id, "...", [0], [7], np.ones((1, 3), np.float64))  # converted to float32
        w.update_request(req)
    got = read_run(tmp_path / "r.h5").requests[req.request_id]
    assert list(got.hooks) == ["..."] and got.hooks["..."].values.dtype == np.float32
    with pytest.raises(CaptureFileError, match="closed"):
        w.add_request(req)


def test_update_request_last_call_wins(tmp_path):
    hooks = {"h": HookPoint("h", "h", "m.h", "resid", 2)}
    w = CaptureWriter(tmp_path / "r.h5", {}, hooks, fsync=False)
    w.add_request(RequestCapture("a", "with\x00nul", [1, 2], {"t": 1}))
    w.append_rows("a", "h", [0, 1], [1, 2], np.ones((2, 2), np.float32))
    w.update_request(RequestCapture("a", "with\x00nul", [1, 2], {"t": 1}, [3], ["x", "y", "z"], [-0.5],
                                    [[TopToken(3, -0.5, "c")]], [(0, [])], finish_reason="stop"))  # writes rows now
    w.append_rows("a", "h", [2], [3], np.full((1, 2), 2, np.float32))  # rows after "finished" still count
    final = RequestCapture("a", "plain", [1, 2], {"t": 2}, [3, 4], ["x", "y", "z", "w"], [-0.5, -1.0],
                           [[TopToken(3, -0.5, "c")], []], [(0, []), (3, [{"hook": "h", "scale": 0.0}])], finish_reason=None)
    w.update_request(final)
    w.close()
    got = read_run(tmp_path / "r.h5").requests["a"]
    for field in ("prompt", "sampling", "generated_token_ids", "token_texts", "logprobs", "top_logprobs",
                  "intervention_log", "finish_reason"):
        assert getattr(got, field) == getattr(final, field), field
    assert np.array_equal(got.hooks["h"].values, [[1, 1], [1, 1], [2, 2]])
    assert got.hooks["h"].positions.tolist() == [0, 1, 2] and got.hooks["h"].token_ids.tolist() == [1, 2, 3]
    with h5py.File(tmp_path / "r.h5", "r") as f:
        assert "finish_reason" not in f["requests/0"].attrs and "json_escaped_attrs" not in f["requests/0"].attrs


def test_hooks_keeping_the_same_rows_share_one_index_that_a_later_row_of_one_hook_never_changes(tmp_path):
    """A request's hooks with equal positions and token ids link to one pair of datasets (written once);
    a row that comes to one of them after the request finished gives that hook an index of its own."""
    hooks = {name: HookPoint(name, name, f"m.{name}", "resid", 2) for name in ("a", "b", "c")}
    w = CaptureWriter(tmp_path / "r.h5", {}, hooks, fsync=False)
    w.add_request(RequestCapture("r", "p", [7, 8], {}))
    for name in ("a", "b"):
        w.append_rows("r", name, [0, 1], [7, 8], np.ones((2, 2), np.float32))
    w.append_rows("r", "c", [1], [8], np.ones((1, 2), np.float32))  # a window: other rows
    w.release("r")
    w.append_rows("r", "b", [2], [9], np.full((1, 2), 2, np.float32))
    w.close()
    with h5py.File(tmp_path / "r.h5") as f:
        group = f["requests/0/hooks"]
        objects = {name: {column: h5py.h5o.get_info(group[name][column].id).addr for column in ("positions", "token_ids")}
                   for name in hooks}
    assert objects["a"]["positions"] != objects["a"]["token_ids"]
    assert objects["c"] != objects["a"] and objects["b"] != objects["a"]
    got = read_run(tmp_path / "r.h5").requests["r"].hooks
    assert got["a"].positions.tolist() == [0, 1] and got["a"].token_ids.tolist() == [7, 8]
    assert got["b"].positions.tolist() == [0, 1, 2] and got["b"].token_ids.tolist() == [7, 8, 9]
    assert got["c"].positions.tolist() == [1] and np.array_equal(got["b"].values, [[1, 1], [1, 1], [2, 2]])
    w = CaptureWriter(tmp_path / "s.h5", {}, hooks, fsync=False)
    w.add_request(RequestCapture("r", "p", [7, 8], {}))
    for name in hooks:
        w.append_rows("r", name, [0, 1], [7, 8], np.ones((2, 2), np.float32))
    w.close()
    with h5py.File(tmp_path / "s.h5") as f:
        group = f["requests/0/hooks"]
        assert len({h5py.h5o.get_info(group[name]["positions"].id).addr for name in hooks}) == 1


# ------------------------------------------------------------------------------------------ other tools

@pytest.fixture(scope="module")
def small_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cap") / "run.h5"
    write_run(make_run(rows=(20, 1, 0)), path)
    return path


@pytest.mark.skipif(H5DUMP is None, reason="h5dump not installed (Debian package hdf5-tools)")
def test_h5dump_reads_file(small_file):
    head = subprocess.run([H5DUMP, "-H", str(small_file)], capture_output=True, text=True, timeout=30)
    assert head.returncode == 0, head.stderr
    assert 'ATTRIBUTE "format"' in head.stdout and 'GROUP "model.layers.0.resid_post"' in head.stdout
    assert "H5S_UNLIMITED" in head.stdout and 'GROUP "odd%2Fname%25with.slash"' in head.stdout
    attr = subprocess.run([H5DUMP, "-a", "/format", str(small_file)], capture_output=True, text=True, timeout=30)
    assert attr.returncode == 0 and f'"{FORMAT_NAME}"' in attr.stdout
    ds = "/requests/0/hooks/model.layers.0.resid_post/values"
    out = subprocess.run([H5DUMP, "-d", ds, str(small_file)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "( 20, 48 )" in out.stdout and "H5T_IEEE_F32LE" in out.stdout
    texts = subprocess.run([H5DUMP, "-d", "/requests/0/token_texts", str(small_file)], capture_output=True,
                           timeout=30)
    # h5dump 1.10 prints non-ASCII UTF-8 bytes as octal escapes; NUL/lone surrogates are JSON-escaped by us
    assert texts.returncode == 0 and b'"a/b"' in texts.stdout and b'""\\u0000""' in texts.stdout


# ------------------------------------------------------------------------------------------ read errors

def test_foreign_hdf5_file(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(CaptureFileError, match="HDF5 file but not an Activation Inspector capture") as e:
        read_run(path)
    assert str(path) in str(e.value) and isinstance(e.value, OSError)
    with h5py.File(path, "a") as f:
        f.attrs["format"] = "something-else"
    with pytest.raises(CaptureFileError, match="another kind"):
        open_run(path)


@pytest.mark.parametrize("content", [b"hello, this is text\n", b""])
def test_not_hdf5(tmp_path, content):
    path = tmp_path / "notes.h5"
    path.write_bytes(content)
    with pytest.raises(CaptureFileError, match="not an HDF5 file") as e:
        read_run(path)
    assert str(path) in str(e.value)
    with pytest.raises(CaptureFileError, match="no such file"):
        read_run(tmp_path / "missing.h5")


def test_truncated_file(tmp_path, small_file):
    path = tmp_path / "cut.h5"
    data = small_file.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CaptureFileError, match="truncated") as e:
        open_run(path)
    assert str(path) in str(e.value)


def test_a_version_1_file_opens(tmp_path, small_file):
    """Version 1 differed only in storing every value as float32, as a float32 engine's file still does."""
    path = tmp_path / "v1.h5"
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = np.int64(1)
    assert_runs_equal(read_run(small_file), read_run(path))


def test_bfloat16_bits_without_their_dtype_attribute_are_damage(tmp_path, small_file):
    path = tmp_path / "bits.h5"
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        group = f["requests/0/hooks/model.layers.0.resid_post"]
        values = group["values"][...]
        del group["values"]
        group["values"] = values.view(np.uint32).astype(np.uint16)
    with open_run(path) as rf, pytest.raises(CaptureFileError, match="not float32, float16 or bfloat16"):
        rf.run.requests[next(iter(rf.run.requests))].hooks["model.layers.0.resid_post"].values


def test_newer_version(tmp_path, small_file):
    path = tmp_path / "future.h5"
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        f.attrs["format_version"] = np.int64(FORMAT_VERSION + 1)
    with pytest.raises(CaptureFileError, match=rf"format version {FORMAT_VERSION + 1}, newer .*update Activation Inspector"):
        read_run(path)


def test_missing_datasets(tmp_path, small_file):
    path = tmp_path / "damaged.h5"
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        del f["requests/1/token_ids"]
    with pytest.raises(CaptureFileError, match=r"damaged .*'token_ids' dataset of /requests/1 is missing"):
        read_run(path)
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        del f["requests/0/hooks/model.layers.0.resid_post/values"]
    with pytest.raises(CaptureFileError, match=r"resid_post has no \['values'\]"):
        open_run(path)


def test_files_without_top_logprob_texts_still_open(tmp_path, small_file):
    """Files written before the most likely tokens' texts were stored show their ids only."""
    path = tmp_path / "older.h5"
    shutil.copy(small_file, path)
    with h5py.File(path, "a") as f:
        for g in f["requests"].values():
            del g["top_logprob_texts"]
    for req in read_run(path).requests.values():
        assert all(top.text == "" for tops in req.top_logprobs for top in tops)
    with h5py.File(path, "a") as f:
        f["requests/0"].create_dataset("top_logprob_texts", data=np.array([["x"]], dtype=object),
                                       dtype=h5py.string_dtype())
    with pytest.raises(CaptureFileError, match="top-logprob texts of /requests/0 have shape"):
        read_run(path)


# ------------------------------------------------------------------------------------------ write errors, atomicity

def test_unwritable_destination_fails_at_open(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run = make_run(rows=(2, 0, 0))
    for target, why in ((blocker / "run.h5", "is not a directory"), (tmp_path / "nodir" / "run.h5", "does not exist")):
        with pytest.raises(CaptureFileError, match=why) as e:
            CaptureWriter(target, run.metadata, run.hooks)
        assert str(target) in str(e.value)
        with pytest.raises(CaptureFileError):
            write_run(run, target)
    assert listing(tmp_path) == ["a_file"]


DISK_FULL = textwrap.dedent("""
    import json, os, resource, signal, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.test_io_hdf5 import engine_like_run, make_run, stream_in_bulk
    from inspector.io import CaptureFileError, write_run
    if __name__ == "__main__":  # the writer's process is spawned: it imports this as a module
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # the writer's process inherits it
        path = os.path.join(sys.argv[1], "run.h5")
        try:
            if sys.argv[3] == "whole":
                write_run(make_run(rows=(1500, 1500, 1)), path)  # about 7 MB of rows
            else:
                stream_in_bulk(engine_like_run(seed=3), path, seed=5, backlog_bytes=1 << 20)
            print(json.dumps({"error": None}))
        except CaptureFileError as e:
            print(json.dumps({"error": str(e), "reason": e.reason, "files": os.listdir(sys.argv[1])}))
""")


@pytest.mark.parametrize("how", ["whole", "streamed through the writer's process"])
def test_disk_full_leaves_no_file(tmp_path, how):
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL)
    (tmp_path / "out").mkdir()
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "out"), str(REPO), how.split()[0]],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None
    assert "file too large" in result["error"] and str(tmp_path / "out" / "run.h5") in result["error"], result
    assert "nothing was saved" in result["error"]
    assert result["files"] == [] and listing(tmp_path / "out") == []


def test_exception_inside_with_leaves_no_file(tmp_path):
    run = make_run(rows=(400, 0, 0))
    req = run.requests["req-0-\u00e9"]
    with pytest.raises(RuntimeError, match="boom"):
        with CaptureWriter(tmp_path / "run.h5", run.metadata, run.hooks) as w:
            w.add_request(req)
            rows = req.hooks["model.layers.0.resid_post"]
            w.append_rows(req.request_id, "model.layers.0.resid_post", rows.positions, rows.token_ids, rows.values)
            assert any(n.endswith(".partial") for n in listing(tmp_path))
            raise RuntimeError("boom")
    assert listing(tmp_path) == []
    w.abort()  # idempotent

    def cancel(fraction):
        if fraction > 0.3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_run(run, tmp_path / "run.h5", progress=cancel)
    assert listing(tmp_path) == []


HARD_KILL = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from inspector.core.hooks import HookPoint
    from inspector.core.run import RequestCapture
    from inspector.io import CaptureWriter
    w = CaptureWriter(os.path.join(sys.argv[1], "run.h5"), {}, {"h": HookPoint("h", "h", "m", "resid", 256)})
    w.add_request(RequestCapture("a", "p", [1], {}))
    for i in range(64):
        w.append_rows("a", "h", np.arange(100), np.arange(100), np.ones((100, 256), np.float32))
    print("ready", flush=True)
    time.sleep(60)
""")


def test_hard_kill_leaves_no_file_under_final_name(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", HARD_KILL, str(tmp_path), str(REPO)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.kill()
        proc.wait(timeout=30)
    names = listing(tmp_path)
    assert "run.h5" not in names and len(names) == 1 and names[0].startswith(".run.h5.") and names[0].endswith(
        ".partial"), names


def test_close_replaces_existing_file_atomically(tmp_path):
    path = tmp_path / "run.h5"
    path.write_text("old")
    w = CaptureWriter(path, {}, {})
    assert path.read_text() == "old"  # untouched until close
    assert w.close() == path and w.close() == path
    assert read_run(path).requests == {} and listing(tmp_path) == ["run.h5"]


# ------------------------------------------------------------------------------------------ lazy reads

def test_lazy_open_of_big_file(tmp_path):
    width, rows, n_hooks = 1024, 2048, 25  # 25 x 8 MiB = 200 MiB
    rng = np.random.default_rng(5)
    block = rng.random((rows, width), dtype=np.float32)
    hooks = {f"model.layers.{i}.resid_post": HookPoint(f"model.layers.{i}.resid_post", f"L{i}", f"model.layers.{i}",
                                                       "resid", width, i) for i in range(n_hooks)}
    req = RequestCapture("big", "p", [1, 2], {})
    path = tmp_path / "big.h5"
    with CaptureWriter(path, {"model_path": "synthetic"}, hooks, fsync=False) as w:
        w.add_request(req)
        for i, name in enumerate(hooks):
            w.append_rows("big", name, np.arange(rows), np.full(rows, i), block + i)
    assert path.stat().st_size > 200e6
    t0 = time.perf_counter()
    rf = open_run(path)
    rows13 = rf.run.requests["big"].hooks["model.layers.13.resid_post"]
    got = rows13.values[100:356, 512:600]
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, elapsed  # target < 1 s; slack for a shared CI machine
    assert np.array_equal(got, block[100:356, 512:600] + 13)
    assert rows13.values.shape == (rows, width) and len(rows13) == rows and rows13.width == width
    assert np.array_equal(rows13.token_ids, np.full(rows, 13)) and np.array_equal(rows13.positions, np.arange(rows))
    assert np.asarray(rows13.values[[3, 1]]).shape == (2, width)  # unsorted index: numpy semantics
    with pytest.raises(TypeError, match="read-only"):
        rows13.append(np.arange(1), np.arange(1), np.zeros((1, width), np.float32))
    rf.close()
    with pytest.raises(CaptureFileError, match="has been closed"):
        rows13.values[0]


def test_chunk_shapes():
    """Whole rows, unless 64 of them pass 4 MiB (a logits-wide hook): then equal parts that do not."""
    assert [chunk_cols_for(w) for w in (1, 64, 1100, 4096, 14336, 16384, 16385)] == [1, 64, 1100, 4096, 14336,
                                                                                        16384, 8193]
    assert chunk_cols_for(128256, 2) == 32064 and chunk_cols_for(128256, 4) == 16032
    assert chunk_rows_for(4096) == 32 and chunk_rows_for(4096, 2) == 32 and chunk_rows_for(1024) == 64
    assert chunk_rows_for(64) == 1024 and chunk_rows_for(1) == 4096
    assert chunk_rows_for(1100, 4, EXPORT_CHUNK_BYTES) == 953 and chunk_rows_for(4096, 2, EXPORT_CHUNK_BYTES) == 512


def test_a_hook_too_wide_for_whole_row_chunks_streams_and_reads_back_bit_for_bit(tmp_path):
    """16,385 float32 columns: two column chunks, the second sticking out past the width."""
    hook = HookPoint("logits", "logits", "", "logits", 16_385)
    values = np.random.default_rng(0).standard_normal((70, 16_385), dtype=np.float32)
    with CaptureWriter(tmp_path / "wide.h5", {}, {"logits": hook}, fsync=False) as writer:
        writer.add_request(RequestCapture("a", "p", [1], {}))
        for start in (0, 1, 65):  # a row, two chunks' worth, the rest
            stop = {0: 1, 1: 65, 65: 70}[start]
            writer.append_rows("a", "logits", np.arange(start, stop), np.arange(start, stop), values[start:stop])
    with h5py.File(tmp_path / "wide.h5", "r") as f:
        assert f["requests/0/hooks/logits/values"].chunks == (32, 8193)
    assert np.array_equal(bits(read_run(tmp_path / "wide.h5").requests["a"].hooks["logits"].values), bits(values))


def test_a_router_hook_stores_its_rule_and_the_chosen_experts_beside_its_logits(tmp_path):
    """Written whole or streamed (the choice rewritten as rows arrive), the file holds each row's chosen
    experts and weights, and its reader gets the routing rule back; a rule that cannot be recomputed
    leaves the logits alone."""
    from moe_runs import moe_run

    from inspector.core.routing import Routing, route

    rule = Routing(4, 2, renormalize=True)
    run = moe_run({1: rule, 3: Routing(4, 2, unsupported="a custom routing function")}, n_tokens=30)
    write_run(run, tmp_path / "whole.h5")
    stream(run, tmp_path / "streamed.h5", seed=4)
    for name in ("whole.h5", "streamed.h5"):
        back = read_run(tmp_path / name)
        assert {h.layer: h.routing for h in back.hooks.values() if h.kind == "router"} == {
            1: rule, 3: Routing(4, 2, unsupported="a custom routing function")}
        with h5py.File(tmp_path / name) as f:
            hooks = f["requests/0/hooks"]
            routed, unrouted = hooks["model.layers.1.mlp.gate.router"], hooks["model.layers.3.mlp.gate.router"]
            ids, weights = route(routed["values"][:], rule)
            assert routed["expert_ids"].dtype == np.int32 and routed["expert_ids"].shape == (29, 2)
            np.testing.assert_array_equal(routed["expert_ids"][:], ids)
            np.testing.assert_array_equal(routed["expert_weights"][:], weights)
            assert "expert_ids" not in unrouted and "expert_weights" not in unrouted


def test_sae_features_round_trip_written_whole_or_streamed(tmp_path):
    from inspector.core.run import FeatureRows

    run = make_run(seed=5, rows=(30, 7, 0))
    rng = np.random.default_rng(5)
    for req in run.requests.values():
        n = 11
        ids = rng.integers(-1, 4096, (n, 6)).astype(np.int32)
        req.features["res/1"] = FeatureRows(6)  # a name that needs escaping
        req.features["res/1"].append(np.arange(n), ids, rng.random((n, 6)).astype(np.float32))
    run.metadata["saes"] = [{"config": {"path": "/saes/res/1"}, "hook": HOOK_SPECS[0][0], "k": 6}]
    write_run(run, tmp_path / "whole.h5")
    with CaptureWriter(tmp_path / "streamed.h5", run.metadata, run.hooks) as w:
        for req in run.requests.values():
            w.add_request(req)
            f = req.features["res/1"]
            for a in range(0, len(f), 4):  # a step's rows at a time
                w.append_features(req.request_id, "res/1", f.positions[a:a + 4], f.ids[a:a + 4], f.activations[a:a + 4])
            w.update_request(req)
        with pytest.raises(ValueError, match=r"ids and activations \[n, k\] expected"):
            w.append_features(req.request_id, "res/1", [0], [[1, 2]], [[0.5]])
    for name in ("whole.h5", "streamed.h5"):
        back = read_run(tmp_path / name)
        assert back.metadata["saes"] == run.metadata["saes"]
        for rid, req in run.requests.items():
            got, want = back.requests[rid].features["res/1"], req.features["res/1"]
            for column in ("positions", "ids", "activations"):
                np.testing.assert_array_equal(getattr(got, column), getattr(want, column))


def test_capture_windows_round_trip_with_their_positions(tmp_path):
    """A windowed hook's group says its window; its positions are the rows kept, sparse as they are."""
    run = make_run(rows=(12, 6, 0), generated=(4, 2, 3))
    first, second = list(run.requests.values())[:2]
    windowed = HOOK_SPECS[0][0]
    rows = first.hooks[windowed]
    kept = rows.positions % 3 == 0
    first.hooks[windowed] = HookRows(rows.width)
    first.hooks[windowed].append(rows.positions[kept], rows.token_ids[kept], rows.values[kept])
    first.windows = {windowed: "every:3"}
    second.windows = {windowed: "generated"}
    path = write_run(run, tmp_path / "windows.h5")
    back = read_run(path)
    assert_runs_equal(run, back)
    assert back.requests[first.request_id].windows == {windowed: "every:3"}
    assert back.requests[second.request_id].windows == {windowed: "generated"}
    assert back.requests[first.request_id].hooks[windowed].positions.tolist() == rows.positions[kept].tolist()
    with h5py.File(path) as f:
        assert f[f"requests/0/hooks/{windowed}"].attrs["window"] == "every:3"
        assert "window" not in f[f"requests/0/hooks/{HOOK_SPECS[1][0]}"].attrs  # all: no attribute


def test_hooks_side_by_side_in_one_landed_copy_cross_to_the_writer_in_one_piece_and_read_back(tmp_path, monkeypatch):
    """A forward's hooks are slices of one [hooks, rows, width] copy: they go into the writer's shared
    memory as one array (copied there by several threads, a piece each, slowly: the writer's process
    is told where they lie only once they are there) and come back as each hook's rows, bit for bit."""
    from inspector.core import shared_ring

    monkeypatch.setattr(shared_ring, "COPIERS", 3)
    monkeypatch.setattr(shared_ring, "COPY_PIECE", 256)
    copy = np.copyto
    slow = lambda dest, source: (source.nbytes >= 256 and time.sleep(0.05)) or copy(dest, source)  # noqa: E731
    monkeypatch.setattr(np, "copyto", slow)  # the copiers' pieces: slow
    hooks = {f"h{k}": HookPoint(f"h{k}", f"h{k}", "", "resid", 64) for k in range(3)}
    stack = np.random.default_rng(0).standard_normal((3, 10, 64), dtype=np.float32).astype(BFLOAT16)
    with BackgroundWriter(tmp_path / "s.h5", {}, hooks, backlog_bytes=1 << 14) as file:  # pieces of a few rows
        for rid in ("a", "b"):
            file.call("add_request", RequestCapture(rid, "p", [1], {}))
        file.call("append_blocks", RowBlocks(["a", "b"], [0, 4, 10], np.arange(10), np.arange(10) + 5,
                                             {h: stack[k] for k, h in enumerate(hooks)}))
        file.call("append_rows", "a", "h0", [4], [9], stack[1, :1])  # after the step, also in the file
    run = read_run(tmp_path / "s.h5")
    a_h0 = np.concatenate([stack[0, :4], stack[1, :1]])
    assert np.array_equal(bits(run.requests["a"].hooks["h0"].values), bits(a_h0))
    for k, h in enumerate(hooks):
        if h != "h0":
            assert np.array_equal(bits(run.requests["a"].hooks[h].values), bits(stack[k, :4]))
        assert np.array_equal(bits(run.requests["b"].hooks[h].values), bits(stack[k, 4:]))
        assert run.requests["b"].hooks[h].token_ids.tolist() == list(range(9, 15))
        assert run.requests["b"].hooks[h].positions.tolist() == list(range(4, 10))
