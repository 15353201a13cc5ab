"""Activation harvests (inspector/harvesting, ``inspector harvest``): contexts packed as SAELens packs
them; a corpus's bad input stops the harvest before anything is written; on the real engine, the rows
equal the capture path's rows for the same tokens (exact) and transformers' (1e-5), through an engine
cut after the deepest hooked block; a harvest killed mid-way resumes to the same shards; the saelens
layout is read by SAELens's own ActivationsStore, and SAELens trains an SAE from it and from the
in-memory iterator."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from hf_reference import block_points
from inspector.core.dtypes import BFLOAT16
from inspector.core.protocol import Sampling, SessionError
from inspector.core.reused_memory import ReusedMemory
from inspector.engine.boot import layer_overrides
from inspector.harvesting import Corpus, CorpusError, HarvestSpec, harvest, harvest_to_disk, mixing, pack, shards
from inspector.harvesting.mixing import mixed_batches
from inspector.harvesting.run import Engine
from inspector.testing.tinymodels import tiny_model

DEMO_DIR = Path(__file__).parents[1] / "resources" / "demo-model"
WORDS = "the cat sat on a mat while dogs ran over hills and rivers under bright skies def return class".split()
RELATIVE = 1e-5


def write_corpus(path: Path, documents: int = 120, seed: int = 1) -> Path:
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, rng.integers(2, 40))) for _ in range(documents)]
    path.write_text("\n".join(lines) + "\n")
    return path


def shard_rows(out: Path) -> dict[str, np.ndarray]:
    """Every shard of a safetensors harvest, joined (float32 activations)."""
    from safetensors.torch import load_file

    manifest = json.loads((out / "harvest.json").read_text())
    parts = [load_file(out / s["file"]) for s in manifest["shards"]]
    joined = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    return {key: (t.float() if t.is_floating_point() else t).numpy() for key, t in joined.items()}


def assert_rows_match_transformers(model_dir, rows: dict[str, np.ndarray], context_size: int, arch: str):
    """Each context's rows of every hook against transformers' forward of that context."""
    hooks = [k for k in rows if k.startswith("blocks.")]
    contexts = rows["token_ids"].reshape(-1, context_size)
    for c, ids in enumerate(contexts[:6]):  # a few contexts: each is a full forward of the reference
        reference = block_points(model_dir, arch, ids.tolist())
        for hook in hooks:
            layer, kind = int(hook.split(".")[1]), hook.rsplit("hook_", 1)[1]
            got = rows[hook][c * context_size:(c + 1) * context_size]
            want = reference[(layer, kind)]
            # a zero row (a padding token's embedding run through its blocks) must be zero here too
            error = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-12)
            assert error.max() < RELATIVE, (hook, c, error.max())


def signalled(command: list[str], out: Path, shards: int, sig: int) -> subprocess.Popen:
    """The harvest command, sent ``sig`` once its manifest lists ``shards`` shards; ended."""
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and child.poll() is None:
        manifest = json.loads((out / "harvest.json").read_text()) if (out / "harvest.json").exists() else {}
        if len(manifest.get("shards", [])) >= shards:
            child.send_signal(sig)
            break
        time.sleep(0.05)
    child.wait(timeout=120)
    return child


# --- without an engine ---

def test_contexts_are_packed_as_saelens_packs_them():
    sae_lens = pytest.importorskip("sae_lens.tokenization_and_batching")
    rng = np.random.default_rng(0)
    for _ in range(200):
        docs = [rng.integers(0, 6, rng.integers(0, 20)).tolist() for _ in range(rng.integers(1, 12))]
        size, bos, sep = int(rng.integers(2, 9)), [None, 0, 1][rng.integers(3)], [None, 0, 2][rng.integers(3)]
        ours = [c.tolist() for c in pack(docs, size, bos, sep)]
        theirs = [c.tolist() for c in sae_lens.concat_and_batch_sequences(
            iter(torch.tensor(d, dtype=torch.long) for d in docs), size, begin_batch_token_id=bos,
            sequence_separator_token_id=sep)]
        assert ours == theirs


def test_packing_by_hand():
    # BOS first; the separator between documents; a long document runs on; the part-filled tail dropped
    assert [c.tolist() for c in pack([[5, 6], [7, 8, 9, 10, 11], [12]], 4, bos=1, separator=2)] == \
        [[1, 5, 6, 2], [1, 7, 8, 9], [1, 10, 11, 2]]
    with pytest.raises(ValueError, match="at least 2"):
        list(pack([[1]], 1, None, None))


@pytest.mark.parametrize("name, content, message", [
    ("missing.txt", None, "missing.txt: no such file"),
    ("empty.txt", "\n  \n\n", "empty.txt holds no documents"),
    ("bad.jsonl", '{"text": "a"}\n{"text": "b"}\nnot json\n', r"bad.jsonl, line 3: not JSON"),
    ("nofield.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"nofield.jsonl, line 2: a JSON object with a \"text\""),
])
def test_bad_corpus_stops_the_harvest_before_anything_is_written(tmp_path, name, content, message):
    corpus = tmp_path / name
    if content is not None:
        corpus.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(CorpusError, match=message):
        harvest_to_disk(HarvestSpec("demo", corpus, ("blocks.0.hook_resid_post",)), out)
    assert not out.exists()


@pytest.mark.parametrize("changes, message", [
    ({"context_size": 1024}, "contexts of 1024 tokens are longer than demo reads: at most 1023"),
    ({"chunk_bytes": -1 << 20}, "a shard's size cannot be negative"),
    ({}, r"c.txt: its 1 document\(s\) hold \d+ tokens, too few to fill one context of 128"),
])
def test_settings_no_engine_can_take_are_refused_before_it_boots(tmp_path, changes, message):
    """A context longer than the model reads had booted and compiled the engine, then met its refusal; a
    corpus too short for one context had booted it to harvest nothing."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("one two three\n")
    stages = []
    with pytest.raises(ValueError, match=message):
        harvest_to_disk(HarvestSpec("demo", corpus, ("blocks.0.hook_resid_post",), **changes), tmp_path / "out",
                        boot=stages.append)
    assert stages == [] and not (tmp_path / "out").exists()


def test_a_model_that_cannot_be_cut_after_the_hooked_block_is_refused_naming_the_way_round(tmp_path):
    """vLLM's Qwen3-MoE needs an experts block among those it builds, and block 0 is a dense one."""
    spec = HarvestSpec(str(tiny_model("qwen3_moe")), write_corpus(tmp_path / "c.txt"), ("blocks.0.hook_resid_post",),
                       context_size=32)
    with pytest.raises(SessionError, match=r"the engine was cut after block 0.*harvest with --full-depth"):
        harvest_to_disk(spec, tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_a_hook_past_the_models_last_block_is_refused_without_blaming_a_cut(tmp_path):
    spec = HarvestSpec("demo", write_corpus(tmp_path / "c.txt"), ("blocks.7.hook_resid_post",), context_size=32)
    with pytest.raises(SessionError, match="'blocks.7.hook_resid_post' matches no hook point of this model$"):
        harvest_to_disk(spec, tmp_path / "out")


def test_corpus_kinds(tmp_path):
    text = tmp_path / "c.txt"
    text.write_bytes(b"\xef\xbb\xbfone two\n\nthree\n")  # a byte order mark, as editors on Windows write
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"text": "one two"}\n\n{"text": "three", "id": 4}\n')
    assert list(Corpus.open(text).texts()) == list(Corpus.open(jsonl).texts()) == ["one two", "three"]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["one two", "three"]}).save_to_disk(str(tmp_path / "ds"))
    corpus = Corpus.open(tmp_path / "ds")
    assert corpus.kind == "datasets" and corpus.documents == 2 and list(corpus.texts()) == ["one two", "three"]
    datasets.Dataset.from_dict({"text": [[5, 6], [7]]}).save_to_disk(str(tmp_path / "ids"))  # token ids, say
    with pytest.raises(CorpusError, match=r"ids: the dataset's 'text' column holds List\(Value\('int64'\)\), not strings"):
        Corpus.open(tmp_path / "ids")


def test_layer_overrides_cut_the_count_and_every_per_layer_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "layer_types": ["a", "b"] * 2,
                                                      "architectures": ["X"], "hidden_size": 64}))
    assert layer_overrides(tmp_path, 3) == {"num_hidden_layers": 3, "layer_types": ["a", "b", "a"]}
    assert layer_overrides(tmp_path, 4) == {}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"n_layer": 6}, "vision_config": {}}))
    assert layer_overrides(tmp_path, 2) == {"text_config": {"n_layer": 2}}
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="no layer count"):
        layer_overrides(tmp_path, 2)


def test_the_engine_is_cut_after_the_deepest_named_block():
    spec = HarvestSpec("demo", "c.txt", ("blocks.1.hook_resid_post", "blocks.0.attn.hook_z"))
    assert spec.kept_layers() == 2
    assert HarvestSpec("demo", "c", ("hook_embed",)).kept_layers() == 1
    two_stages = {"pipeline_parallel_size": 2}  # vLLM gives each pipeline stage a block
    assert HarvestSpec("demo", "c", ("hook_embed",), engine_args=two_stages).kept_layers() == 2
    for whole in (("blocks.*.hook_resid_post",), ("blocks.1.hook_resid_post", "ln_final.hook_normalized")):
        assert HarvestSpec("demo", "c", whole).kept_layers() == 0
    assert HarvestSpec("demo", "c", ("blocks.1.hook_resid_post",), full_depth=True).kept_layers() == 0


def test_the_mixing_buffer_delivers_every_row_once_shuffled_alike_across_hooks():
    chunks = [{"a": torch.arange(i, i + 10.0)[:, None], "b": -torch.arange(i, i + 10.0)[:, None]} for i in range(0, 200, 10)]
    batches = list(mixed_batches(iter(chunks), batch_size=8, buffer_rows=40, mix_fraction=0.5))
    seen = torch.cat([b["a"] for b in batches]).flatten()
    assert len(seen) == 200 and sorted(seen.tolist()) == list(range(200))
    assert all(torch.equal(b["a"], -b["b"]) for b in batches)
    assert not torch.equal(seen, torch.arange(200.0))
    joined = torch.cat([c["a"] for c in chunks[:4]])  # the first buffer: the rows joined, in the seed's order
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat([b["a"] for b in batches[:2]]), joined[order][:16])
    with pytest.raises(ValueError, match="at least one batch"):
        list(mixed_batches(iter(chunks), batch_size=64, buffer_rows=32))
    with pytest.raises(ValueError, match="fewer than a batch"):  # it would keep every row
        list(mixed_batches(iter(chunks), batch_size=32, buffer_rows=40, mix_fraction=0.5))


@pytest.mark.parametrize("total", [203, 208, 217])  # the chunks end inside a buffer, as one ends, past it
def test_chunks_of_any_size_leave_every_row_once_but_less_than_a_batch(total):
    """Chunks split across buffers and a stream that ends anywhere: each row leaves at most once, and
    fewer than a batch stay behind."""
    sizes, at = [], 0
    while at < total:
        sizes.append(min(total - at, (7, 13, 29, 1)[len(sizes) % 4]))
        at += sizes[-1]
    starts = np.cumsum([0, *sizes])
    chunks = [{"a": torch.arange(a, b, dtype=torch.float32)[:, None]} for a, b in zip(starts, starts[1:])]
    batches = list(mixed_batches(iter(chunks), batch_size=8, buffer_rows=40, mix_fraction=0.5))
    seen = torch.cat([b["a"] for b in batches]).flatten().tolist()
    assert all(len(b["a"]) == 8 for b in batches)
    assert len(set(seen)) == len(seen) and set(seen) <= set(range(total)) and total - len(seen) < 8


@pytest.mark.parametrize("keep_batches", [True, False])
def test_buffers_reuse_memory_only_once_their_batches_are_gone(monkeypatch, keep_batches):
    """Buffers of megabytes come from memory of buffers let go of: batches a trainer keeps keep their
    rows, and one that drops them gets their memory back for the next buffers."""
    made = []
    monkeypatch.setattr(mixing, "ReusedMemory", lambda: made.append(ReusedMemory()) or made[-1])
    width, chunk = 1024, 512  # 4 KiB rows: each buffer of 2,048+ rows is a block of its own
    chunks = ({"a": torch.arange(i, i + chunk, dtype=torch.float32)[:, None].expand(chunk, width).contiguous(),
               "b": -torch.arange(i, i + chunk, dtype=torch.float32)[:, None].expand(chunk, width).contiguous()}
              for i in range(0, 40 * chunk, chunk))
    kept, seen = [], []
    for batch in mixed_batches(chunks, batch_size=256, buffer_rows=2048, mix_fraction=0.5):
        assert torch.equal(batch["a"], -batch["b"]) and torch.equal(batch["a"], batch["a"][:, :1].expand(-1, width))
        seen += batch["a"][:, 0].tolist()
        if keep_batches:
            kept.append(batch)
    assert sorted(seen) == list(range(40 * chunk))
    if keep_batches:  # every row still what it was when it left
        assert sorted(torch.cat([b["a"][:, 0] for b in kept]).tolist()) == list(range(40 * chunk))
        assert all(torch.equal(b["a"], b["a"][:, :1].expand(-1, width)) for b in kept)
    assert (made[0].reused > 0) != keep_batches


def test_a_shard_reads_back_through_safetensors_with_the_disk_asked_as_it_goes(tmp_path, monkeypatch):
    """Shards are written a piece at a time, the kernel asked to write each out (so the disk works while
    the shard is written): safetensors' own reader gets every array back, bfloat16 and empty ones too."""
    asked = []
    monkeypatch.setattr(shards.writeback, "EVERY", 1 << 12)
    monkeypatch.setattr(shards.writeback, "start_writeback", asked.append)
    rng = np.random.default_rng(0)
    arrays = {"token_ids": np.arange(7, dtype=np.int64), "a": rng.random((7, 600), dtype=np.float32),
              "b": rng.random((7, 5)).astype(np.float32).astype(BFLOAT16), "empty": np.zeros((0, 3), np.float16),
              "strided": rng.random((7, 8), dtype=np.float32)[:, ::2]}
    shards.write_safetensors(tmp_path / "s.safetensors", arrays, {"format": "f"})
    with safe_open(tmp_path / "s.safetensors", "pt") as f:
        assert f.metadata() == {"format": "f"} and set(f.keys()) == set(arrays)
        for name, want in arrays.items():
            got = f.get_tensor(name)
            if want.dtype == BFLOAT16:
                assert got.dtype == torch.bfloat16
                assert torch.equal(got.view(torch.int16), torch.from_numpy(want.view(np.int16)))
            else:
                assert np.array_equal(got.numpy(), want) and got.numpy().dtype == want.dtype
    assert len(asked) > (7 * 600 * 4) >> 12  # the float32 array alone is several pieces


def small_chunk(first: int, count: int, length: int = 4) -> shards.Chunk:
    rows = count * length
    return shards.Chunk({"a": np.full((rows, 8), first, np.float32)}, np.arange(rows),
                        np.repeat(np.arange(count), length), np.tile(np.arange(length), count), (first, count))


def test_shards_are_listed_in_order_once_synced_and_a_failed_sync_lists_none_after_it(tmp_path, monkeypatch):
    """The committer syncs, names and lists each shard while the next is written; the manifest lists a
    shard only once it is synced, and where a sync fails the shards after it are not listed either
    (nor named), and the failure comes out of the writer's next call."""
    synced, release = [], threading.Event()

    def sync(path):
        release.wait(10)
        if len(synced) == 2:
            raise OSError(5, "Input/output error")
        synced.append(path.name)

    monkeypatch.setattr(shards, "_sync", sync)
    directory = shards.HarvestDirectory.open(tmp_path / "out", {"layout": "safetensors", "tokens": None},
                                             {"a": 8}, {"stored_dtype": "float32"})
    norm = shards.NormEstimate()
    for first in range(2):
        norm.add(small_chunk(first, 1))
        directory.write(small_chunk(first, 1), norm)
    on_disk = json.loads((tmp_path / "out" / "harvest.json").read_text())
    assert on_disk["shards"] == [] and not (tmp_path / "out" / "shard-00000.safetensors").exists()
    release.set()
    directory.settle()
    on_disk = json.loads((tmp_path / "out" / "harvest.json").read_text())
    assert [s["file"] for s in on_disk["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert on_disk["contexts_done"] == 2 and on_disk["rows"] == 8 and on_disk["norm"]["rows"] == 2
    assert synced == [".shard-00000.safetensors.partial", ".shard-00001.safetensors.partial"]
    with pytest.raises(OSError, match="Input/output"):
        for first in range(2, 5):
            directory.write(small_chunk(first, 1), norm)
        directory.settle()
    on_disk = json.loads((tmp_path / "out" / "harvest.json").read_text())
    assert len(on_disk["shards"]) == 2 and on_disk["contexts_done"] == 2
    listed = [s["file"] for s in on_disk["shards"]]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["harvest.json", *listed]


def test_a_full_disk_stops_the_harvest_with_its_shards_whole_and_no_partial_shard_left(tmp_path, monkeypatch):
    """A write that fails (here the third piece of the second shard) raises one error that says what is
    left and how to go on; the shard it was writing is removed, the first stays listed."""
    directory = shards.HarvestDirectory.open(tmp_path / "out", {"layout": "safetensors", "tokens": None},
                                             {"a": 8}, {"stored_dtype": "float32"})
    norm = shards.NormEstimate()
    directory.write(small_chunk(0, 1), norm)
    pieces = []

    def full(fd, data, pos):
        pieces.append(len(data))
        if len(pieces) == 3:
            raise OSError(28, "No space left on device")
        os.pwrite(fd, data, pos)

    monkeypatch.setattr(shards.writeback, "write_all", full)
    with pytest.raises(OSError, match=r"No space left on device while writing the harvest in .*out; the shards "
                                      r"harvest.json lists are complete: .* run the same command to resume"):
        directory.write(small_chunk(1, 1), norm)
    directory.settle()
    on_disk = json.loads((tmp_path / "out" / "harvest.json").read_text())
    assert [s["file"] for s in on_disk["shards"]] == ["shard-00000.safetensors"] and on_disk["contexts_done"] == 1
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["harvest.json", "shard-00000.safetensors"]


# --- on the engine ---

@pytest.mark.slow
def test_rows_equal_the_capture_paths_rows_exactly(tmp_path):
    """The same engine, the same prompts in one step: prefill-only rows and a generation's prompt rows."""
    size = 12
    spec = HarvestSpec(str(DEMO_DIR), write_corpus(tmp_path / "c.txt"), ("blocks.0.hook_resid_post",), context_size=size)
    engine = Engine(spec)
    try:
        assert engine.session.options.kept_layers == 1
        assert max(p.layer for p in engine.session.catalogue) == 0  # the engine has one block
        tokenizer = engine.session._llm.get_tokenizer()  # the one generate() tokenizes with
        rng = np.random.default_rng(0)
        candidates = (" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(2000))
        texts = [t for t in candidates if len(tokenizer.encode(t)) == size][:5]
        assert len(texts) == 5
        contexts = [np.asarray(tokenizer.encode(t)) for t in texts]
        got = []
        engine.run(iter(contexts), 0, got.append, threading.Event())
        events = list(engine.session.generate(texts, Sampling(max_tokens=1, logprobs=0)))
        assert len(events) == 1  # one step: the same batch layout as the prefill
        hook = next(iter(engine.session.installed))
        for step in events[0].requests:
            index = [e.request_id for e in events[0].started].index(step.request_id)
            positions, _, values = step.rows[hook]
            [chunk] = got
            rows = chunk.activations["blocks.0.hook_resid_post"][chunk.sequence == index]
            assert np.array_equal(rows[positions], values)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_killed_harvest_resumes_to_rows_that_match_transformers(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt", documents=200)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "inspector.cli", "harvest", "--model", str(DEMO_DIR), "--corpus", str(corpus),
               "--hooks", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "--context-size", "32",
               "--tokens", "2400", "--out", str(out), "--shard-mb", "0", "--max-num-batched-tokens", "64"]
    # --shard-mb 0: a shard a context, so that there are shards to stop the harvest after; two contexts a
    # step, so that it is still running when stopped (in one step its shards came faster than we look)
    interrupted = signalled(command, out, 2, signal.SIGINT)  # Ctrl-C: the shard under way is dropped
    assert interrupted.returncode == 130, interrupted.stderr.read()[-2000:]
    stopped = json.loads((out / "harvest.json").read_text())
    assert not stopped["complete"] and stopped["stopped_because"] == "stopped" and len(stopped["shards"]) >= 2
    killed = signalled(command, out, len(stopped["shards"]) + 3, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.read()[-2000:]
    manifest = json.loads((out / "harvest.json").read_text())
    assert not manifest["complete"] and len(stopped["shards"]) + 3 <= len(manifest["shards"]) < 75
    assert manifest["shards"][:len(stopped["shards"])] == stopped["shards"]

    finished = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resuming {out} after {manifest['contexts_done']} contexts" in finished.stderr
    manifest = json.loads(finished.stdout)
    assert manifest["complete"] and manifest["contexts_done"] == math.ceil(2400 / 32) == len(manifest["shards"])
    assert manifest["kept_layers"] == 2 and manifest["rows"] == 2400
    rows = shard_rows(out)
    assert np.array_equal(rows["sequence"], np.repeat(np.arange(75), 32))
    assert np.array_equal(rows["position"], np.tile(np.arange(32), 75))
    assert (rows["token_ids"].reshape(75, 32)[:, 0] == 0).all()  # each context starts with BOS (id 0)
    assert_rows_match_transformers(DEMO_DIR, rows, 32, "llama")
    for hook in ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post"):
        mean_norm = np.linalg.norm(rows[hook][::8], axis=1).mean()  # a sample: every 8th row of each shard
        assert manifest["norm_scaling_factors"][hook] == pytest.approx(math.sqrt(256) / mean_norm, rel=1e-5)

    done = subprocess.run(command, capture_output=True, text=True, timeout=120)  # finished: no engine boots
    assert done.returncode == 0 and "[ready]" not in done.stderr, done.stderr[-2000:]
    longer = [*command[:command.index("--tokens") + 1], "3200", *command[command.index("--tokens") + 2:]]
    further = subprocess.run(longer + ["--json"], capture_output=True, text=True, timeout=600)
    assert further.returncode == 0, further.stderr[-2000:]
    extended = json.loads(further.stdout)
    assert extended["complete"] and extended["contexts_done"] == 100 and extended["shards"][:75] == manifest["shards"]
    assert np.array_equal(shard_rows(out)["blocks.1.hook_resid_post"][:2400], rows["blocks.1.hook_resid_post"])
    other = subprocess.run([*command, "--context-size", "16"], capture_output=True, text=True, timeout=120)
    assert other.returncode == 1 and "other settings (context_size differ)" in other.stderr


@pytest.mark.slow
def test_saelens_reads_and_trains_from_the_saelens_layout(tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    from sae_lens.training.activations_store import ActivationsStore

    model_dir = tiny_model("gemma2", layers=4)  # per-layer types and windows: cut with the layer count
    hook = "blocks.1.hook_resid_post"
    spec = HarvestSpec(str(model_dir), write_corpus(tmp_path / "c.txt", documents=300), (hook,), context_size=64,
                       tokens=64 * 64, chunk_bytes=16 * 64 * 128 * 4)
    manifest = harvest_to_disk(spec, tmp_path / "acts", layout="saelens")
    assert manifest["complete"] and manifest["kept_layers"] == 2 and len(manifest["shards"]) == 4
    import datasets

    data = datasets.load_from_disk(str(tmp_path / "acts"))
    assert len(data) == 64 and data.features[hook].shape == (64, 128)
    values = np.asarray(data[hook], np.float32)
    tokens = np.asarray(data["token_ids"])
    rows = {hook: values.reshape(-1, 128), "token_ids": tokens.reshape(-1)}
    assert_rows_match_transformers(model_dir, rows, 64, "gemma2")

    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None,
                             context_size=64, d_in=128, n_batches_in_buffer=4, total_training_tokens=64 * 64,
                             store_batch_size_prompts=4, train_batch_size_tokens=128, prepend_bos=True,
                             normalize_activations="none", device=torch.device("cpu"), dtype="float32",
                             cached_activations_path=str(tmp_path / "acts"))
    first = store.get_raw_llm_batch()[0]
    assert torch.allclose(first, torch.from_numpy(values[:4].reshape(-1, 128)))
    losses = train_sae(sae_lens, store, 128, steps=200)
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.slow
def test_an_in_memory_harvest_feeds_a_saelens_trainer(tmp_path):
    sae_lens = pytest.importorskip("sae_lens")
    hook = "blocks.2.hook_resid_post"
    with harvest("demo", write_corpus(tmp_path / "c.txt", documents=2500), hook, context_size=32, tokens=32 * 1300,
                 batch_size=128, buffer_rows=2048) as delivered:  # 300 steps of 128 rows, and 4 to estimate norms
        assert delivered.engine.session.options.kept_layers == 3
        losses = train_sae(sae_lens, delivered.for_saelens(hook), 256, steps=300)
        factor = delivered.norm_scaling_factors[hook]
    assert losses[-1] < 0.5 * losses[0]
    assert 0 < factor < math.inf


def train_sae(sae_lens, provider, width: int, steps: int) -> list[float]:
    """A standard SAE trained by SAELens's own trainer from ``provider``; its MSE losses by step."""
    from sae_lens.config import SAETrainerConfig
    from sae_lens.saes.standard_sae import StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.training.sae_trainer import SAETrainer

    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=width, d_sae=2 * width, l1_coefficient=1e-3,
                                                        dtype="float32", device="cpu"))
    losses = []
    batch = 128
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch,
                                          lr=3e-3, lr_end=3e-3, n_batches_for_norm_estimate=4), sae, provider)
    step = trainer.step

    def recorded(batch_acts):
        out = step(batch_acts)
        losses.append(float(out.losses["mse_loss"].detach()))
        return out

    trainer.step = recorded
    trainer.fit()
    return losses
