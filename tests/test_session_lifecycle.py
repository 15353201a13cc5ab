"""Session lifecycle with real (eager, quick to boot) engines: open/close cycles over different
models, live hook changes, a failure (against the fake too: part of the session contract), and how
model names resolve. One in-process engine at a time: each test closes what it opens."""

import re
import shutil
from dataclasses import replace
import signal
import time

import numpy as np
import pytest

from engines import ENGINE_ARGS
from fake_session import FakeSession
from inspector.core.models import ModelNotFound, resolve_model
from inspector.core.protocol import BOOT_STAGES, Sampling, SessionError, SessionOptions
from inspector.core.windows import CaptureWindow
from inspector.client.local import start_local_server
from inspector.engine import opening
from inspector.engine.session import Session
from inspector.plugin import vllm_compat


def options(path, **kw):
    return SessionOptions(**{"model": str(path), "mode": "eager", "max_model_len": 256, "max_num_batched_tokens": 64,
                             "engine_args": ENGINE_ARGS, **kw})


def _device_free_bytes():
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def test_open_close_open_three_models_in_one_process(tiny_models):
    free_before = _device_free_bytes()
    for arch in ("llama", "gpt2", "qwen2"):
        with Session.open(options(tiny_models[arch])) as session:
            events = list(session.generate(["def f():"], Sampling(max_tokens=3)))
            req = next(iter(session.run.requests.values()))
            assert events[-1].requests[0].finished and len(req.generated_token_ids) == 3
            assert session.run.metadata["model_config"]["model_type"] == arch
        assert not session.alive
        if free_before is not None:  # closing gave the engine's device memory back
            assert _device_free_bytes() > free_before - 2 * 2**30


def test_eager_hook_change_is_live_and_keeps_the_run(tiny_models):
    with Session.open(options(tiny_models["llama"])) as session:
        list(session.generate(["import os"], Sampling(max_tokens=2)))
        engine = session._llm
        assert session.set_hooks(["blocks.0.hook_attn_out", "blocks.1.mlp.hook_post"]) is False
        assert session._llm is engine  # no restart
        assert sorted(session.installed) == ["model.layers.0.self_attn.attn_out", "model.layers.1.mlp.down_proj.mlp_post"]
        list(session.generate(["import os"], Sampling(max_tokens=2)))
        first, second = session.run.requests.values()
        assert set(first.hooks) == {"model.layers.0.resid_post", "model.layers.1.resid_post"}
        assert set(second.hooks) == set(session.installed)
        assert second.hooks["model.layers.1.mlp.down_proj.mlp_post"].values.shape[1] == 256


def test_boot_stages_say_what_runs_and_the_hook_probe_compiles_nothing(tiny_models):
    """Issue 38: "Loading weights" stood for 80 s of a tiny model's cold boot, most of it Inductor
    compiling vLLM's ops for the plugin's probe forward. The stages name the probe, and it compiles
    nothing: the only compilation is the model's, in the stage that says so."""
    from torch._dynamo.utils import counters

    seen = []
    session = Session.open(options(tiny_models["llama"], mode="compiled"),
                           lambda p: seen.append((p.stage, counters["frames"]["total"])))
    session.close()
    assert [stage for stage, _ in seen] == list(BOOT_STAGES)
    frames = dict(seen)
    assert frames["compiling"] == frames["probing"], "the probe forward compiled something"


def test_a_model_shorter_than_the_default_context_boots_with_its_own(tiny_models, tmp_path):
    """A checkpoint whose config allows 128 positions, opened with the default 1024-token context, boots
    with 128 and says so (vLLM refuses a context longer than the model's)."""
    import json

    model = tmp_path / "short"
    shutil.copytree(tiny_models["llama"], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    said = []
    with Session.open(replace(options(model), max_model_len=1024), lambda p: said.append(p.message)) as session:
        assert session.options.max_model_len == 128
        assert session._llm.llm_engine.model_config.max_model_len == 128
        list(session.generate(["def f():"], Sampling(max_tokens=2)))
    assert any("reads at most 128 tokens: the context is 128, not 1024" in text for text in said)


def test_an_encoder_checkpoint_is_refused_as_one(tiny_models, tmp_path):
    """A BERT checkpoint (vLLM runs it as an embedding model) is refused in words a user can act on."""
    from transformers import BertConfig, BertModel

    model = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256, max_position_embeddings=256)).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_models["llama"] / name, model / name)
    with pytest.raises(SessionError, match="BertEmbeddingModel, a pooling or embedding model that predicts no tokens"):
        Session.open(options(model, max_num_batched_tokens=256))  # vLLM's pooling runner takes whole prompts


@pytest.mark.parametrize("kind", ["real", "fake", "remote"])
def test_a_failure_is_a_session_error_that_keeps_the_run(tiny_models, kind, monkeypatch):
    """A failed engine (or a killed server) is dead, its run intact, and it says to start again."""
    opener = {"real": Session.open, "fake": FakeSession.open, "remote": start_local_server}[kind]
    # long enough that a server killed after the second event is killed mid-generation, even on a GPU: a
    # server runs ahead of its client, and on an H200 the tiny model's 20, then 200 tokens came before the kill
    max_tokens = 1000 if kind == "remote" else 200
    session = opener(options(tiny_models["llama"], max_model_len=1024))
    try:
        stream = session.generate(["def f(x):"], Sampling(max_tokens=max_tokens, ignore_eos=True))
        next(stream), next(stream)
        if kind == "real":
            def break_layer(worker):  # a worker-side fault on the next forwards
                layer = vllm_compat.model_of(worker).model.layers[1]
                layer.register_forward_hook(lambda *a: (_ for _ in ()).throw(MemoryError("simulated out of memory")))

            session._llm.collective_rpc(break_layer)
        elif kind == "fake":
            monkeypatch.setattr(FakeSession, "fail_at_step", 2)
        else:
            session.process.send_signal(signal.SIGKILL)  # the server, mid-generation
        failed_at = time.monotonic()
        with pytest.raises(SessionError, match="kept") as failure:
            list(stream)
        if kind == "remote":
            assert time.monotonic() - failed_at < 2.0, "the client must say so within 2 s"
            assert "exited with code -9" in str(failure.value)
        assert not session.alive
        req = next(iter(session.run.requests.values()))
        # with async scheduling (GPU), or a server, a few more tokens may have come before the fault
        n_tokens = len(req.generated_token_ids)
        assert (1 <= n_tokens <= 2) if kind != "remote" else 2 <= n_tokens < max_tokens
        # a row for every token fed so far; the forward that fed the last token may have finished
        # before the fault, and then its rows are kept too
        assert len(req.token_ids) - 1 <= len(req.hooks["model.layers.0.resid_post"]) <= len(req.token_ids)
        with pytest.raises(SessionError, match="open a new session|gone"):
            next(session.generate(["x"]))
    finally:
        session.close()
    with pytest.raises(SessionError, match="closed"):
        next(session.generate(["x"]))


def test_the_apps_own_server_boots_with_the_slots_and_capture_windows_it_was_given(tiny_models):
    given = options(tiny_models["llama"], max_slots=8, windows=(("blocks.0.*", "generated"),))
    session = start_local_server(given)
    try:
        assert session.options == given  # as the server's engine session holds them
        assert session.windows == {"model.layers.0.resid_post": CaptureWindow.parse("generated")}
        list(session.generate(["def f(x):"], Sampling(max_tokens=3, ignore_eos=True)))
        req = next(iter(session.run.requests.values()))
        prompt = len(req.prompt_token_ids)
        assert req.hooks["model.layers.0.resid_post"].positions.tolist() == [prompt - 1, prompt, prompt + 1]
        assert len(req.hooks["model.layers.1.resid_post"]) == prompt + 2
    finally:
        session.close()


def test_bad_model_names_fail_clearly(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for name, message in [(tmp_path / "empty", "no config.json"), (tmp_path / "file.txt", "is a file"),
                          (tmp_path / "nowhere", "no model directory"),
                          ("someone/not-cached-model", "not in the Hugging Face cache.*never downloads")]:
        with pytest.raises(ModelNotFound, match=message):
            resolve_model(str(name))
    with pytest.raises(SessionError, match="no config.json"):
        Session.open(options(tmp_path / "empty"))


def test_an_engine_failing_in_a_prefill_is_a_session_error_and_the_session_is_dead(tiny_models):
    """A harvest, a scan or a notebook's run_with_cache prefills; the engine's own exception (vLLM's
    Qwen3-Next on a CPU boots in float32, then asserts bfloat16 at its first forward) came out raw, and
    the session went on as if alive."""
    with Session.open(options(tiny_models["llama"])) as session:
        first = next(session.prefill([[5, 6, 7, 8]]))
        assert first.index == 0

        def break_layer(worker):  # a worker-side fault on the next forwards
            layer = vllm_compat.model_of(worker).model.layers[1]
            layer.register_forward_hook(lambda *a: (_ for _ in ()).throw(MemoryError("simulated out of memory")))

        session._llm.collective_rpc(break_layer)
        with pytest.raises(SessionError, match="the engine failed while prefilling: MemoryError: simulated out of "
                                               "memory.*open a new session"):
            list(session.prefill([[5, 6, 7, 8], [9, 10, 11]]))
        assert not session.alive
        with pytest.raises(SessionError, match="open a new session"):
            list(session.prefill([[5, 6]]))


def test_an_engine_failure_that_says_nothing_says_where_it_was_raised():
    """vLLM refuses some configurations with a bare ``assert``: "AssertionError: " alone tells a user nothing."""
    def refuse():
        raise AssertionError  # what a bare assert raises outside pytest's rewriting

    try:
        try:
            refuse()
        except AssertionError as e:
            raise RuntimeError("the engine failed") from e
    except RuntimeError as e:
        said = opening._root_cause(e)
    assert re.fullmatch(r"AssertionError at .*test_session_lifecycle\.py:\d+ \(raise AssertionError  # .*\)", said), said
    assert opening._root_cause(ValueError("Head dimension 96 is not supported")) == \
        "ValueError: Head dimension 96 is not supported"


@pytest.mark.parametrize("kind", ["real", "remote"])
def test_a_hook_pattern_that_matches_nothing_is_named_in_the_error(tiny_models, kind):
    """The app's own server fails its boot: the client hears the server's reason, not only that it went.
    In process, the failed boot leaves none of vLLM's parallel groups behind: the next boot would find
    them made and not make its own (a mixture-of-experts model's expert-parallel group among them)."""
    opener = {"real": Session.open, "remote": start_local_server}[kind]
    with pytest.raises(SessionError, match="'blocks.9.hook_nothing' matches no hook point"):
        opener(options(tiny_models["llama"], hooks=["blocks.9.hook_nothing"]))
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    assert not model_parallel_is_initialized()


def test_a_failed_boot_beside_an_open_engine_leaves_it_running(tiny_models):
    """vLLM's parallel groups belong to the process: a boot that fails while another engine of this
    process runs must not tear them down under it."""
    with Session.open(options(tiny_models["llama"])) as session:
        list(session.generate(["def f():"], Sampling(max_tokens=4)))
        with pytest.raises(SessionError, match="matches no hook point"):
            Session.open(options(tiny_models["gpt2"], hooks=["blocks.9.hook_nothing"]))
        list(session.generate(["def f():"], Sampling(max_tokens=4)))
        first, second = session.run.requests.values()
        assert len(second.generated_token_ids) == 4 and second.generated_token_ids == first.generated_token_ids


def test_cached_hub_id_resolves_without_network(tiny_models, tmp_path, monkeypatch):
    import huggingface_hub.constants as hc

    repo = tmp_path / "hub" / "models--tiny--llama"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_models["llama"], snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub._snapshot_download as sd

    monkeypatch.setattr(sd, "HF_HUB_CACHE", str(tmp_path / "hub"), raising=False)
    assert resolve_model("tiny/llama") == snapshot


def test_demo_model_resolves():
    path = resolve_model("demo")
    assert (path / "config.json").is_file() and np.any([p.suffix == ".safetensors" for p in path.iterdir()])
