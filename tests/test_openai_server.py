"""vLLM's own OpenAI server with the inspector's plugins (``inspector serve --openai``), driven by the
real ``openai`` client: per-request steering through ``vllm_xargs``, the prefix cache kept clean, the
refusals, the named vectors' endpoints, and steering equal to the same edit through ``Session``."""

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import torch

from engines import ENGINE_ARGS, PARITY_TOL, rel_l2
from sae_files import write_sae
from ui_fixtures import fail_on_qt_warnings, keep, ui_settings  # noqa: F401
from servers import running_openai_server
from session_kinds import options
from inspector.core.hooks import installed_name
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling
from inspector.core.request_edits import encode_vector
from inspector.engine.session import Session
from inspector.io import read_run

pytestmark = pytest.mark.slow
HOOK = "blocks.1.hook_resid_post"
TOKEN = "test-admin-token"
MAX_SLOTS = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"  # the tiny model has none
LONG_PROMPT = " ".join(f"item {i} of the list," for i in range(28))  # ~240 tokens: a full 128-token block (the CPU's) and more


@pytest.fixture(scope="module")
def sae_dir(tmp_path_factory):
    """An SAE on the tiny Llama's blocks.1 residual stream, whose feature 3 the server registers."""
    return write_sae(tmp_path_factory.mktemp("openai-sae") / "sae", "standard", 128, 32, HOOK)


@pytest.fixture(scope="module")
def server(tiny_models, tmp_path_factory, sae_dir):
    """(openai client, base url, the named vector 'push', the model's directory)."""
    home = tmp_path_factory.mktemp("openai-vectors")
    push = (np.random.default_rng(7).normal(size=128) * 6).astype(np.float32)
    np.save(home / "push.npy", push)
    (home / "chat.jinja").write_text(CHAT_TEMPLATE)
    model = tiny_models["llama"]
    extra = ["--hooks", "blocks.*.hook_resid_post", "--max-model-len", "512", "--max-slots", str(MAX_SLOTS),
             "--feature-clamps", "2", "--vectors", f"push={home / 'push.npy'}@{HOOK}", f"feature={sae_dir}#3",
             f"early={home / 'push.npy'}@blocks.0.hook_resid_post"]  # block 1's keys and values read it
    with running_openai_server(model, extra, env={"INSPECTOR_ADMIN_TOKEN": TOKEN},
                               engine_args={"chat_template": str(home / "chat.jinja")}) as (url, process):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        yield client, url, push, str(model)
    assert process.returncode in (0, -15), process.returncode


def complete(server, prompt, max_tokens=8, **xargs):
    client, _, _, model = server
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       extra_body={"vllm_xargs": xargs, "return_token_ids": True} if xargs
                                       else {"return_token_ids": True})
    return answer.choices[0]


def prefix_hits(url) -> float:
    with urllib.request.urlopen(f"{url}/metrics") as answer:
        text = answer.read().decode()
    return float(re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def settled_hits(url, before=None) -> float:
    """The hit counter once the engine's last step has been counted (it is published after the answer)."""
    deadline = time.monotonic() + 5
    hits = prefix_hits(url)
    while hits == before and time.monotonic() < deadline:
        time.sleep(0.1)
        hits = prefix_hits(url)
    return hits


def test_the_server_lists_its_hooks_and_vectors(server):
    _, url, push, _ = server
    hooks = json.load(urllib.request.urlopen(f"{url}/inspector/v1/hooks"))
    assert hooks["mode"] == "compiled" and hooks["max_slots"] == MAX_SLOTS
    assert {h["alias"] for h in hooks["hooks"]} == {f"blocks.{i}.hook_resid_post" for i in range(2)}
    _, feature, vector = json.load(urllib.request.urlopen(f"{url}/inspector/v1/vectors"))["vectors"]
    assert vector["name"] == "push" and vector["width"] == 128 and not vector["clampable"]
    assert vector["norm"] == pytest.approx(float(np.linalg.norm(push)), rel=1e-6)
    assert feature["name"] == "feature" and feature["source"] == "sae#3" and feature["clampable"]
    assert feature["norm"] == pytest.approx(1.0, rel=1e-6)  # an SAE's decoder row


def test_steering_changes_the_output_and_leaves_the_prefix_cache_clean(server):
    _, url, _, _ = server
    hits = settled_hits(url)
    clean = complete(server, LONG_PROMPT)
    hits = settled_hits(url, hits)  # (the first may hit blocks of an earlier test's prompt: none here)
    steered = complete(server, LONG_PROMPT, inspector_steer="push", inspector_scale=3)
    assert steered.token_ids != clean.token_ids
    time.sleep(0.5)
    assert prefix_hits(url) == hits  # the steered request read none of the clean blocks
    again = complete(server, LONG_PROMPT)
    assert again.token_ids == clean.token_ids  # and left none of its own where a clean one reads
    hits_after_clean = settled_hits(url, hits)
    assert hits_after_clean >= hits + 128  # the clean repeat read the clean blocks
    steered_again = complete(server, LONG_PROMPT, inspector_steer="push", inspector_scale=3)
    assert steered_again.token_ids == steered.token_ids
    assert settled_hits(url, hits_after_clean) >= hits_after_clean + 128  # steered alike: shared


def test_a_steered_request_first_leaves_no_blocks_a_clean_one_reads(server):
    """Steered at block 0 (so block 1's cached keys and values are steered) before any clean request of
    the prompt: the clean one that follows computes what a request that reads no cached block does."""
    prompt = " ".join(f"entry {i} in the table," for i in range(26))
    steered = complete(server, prompt, inspector_steer="early", inspector_scale=2)
    clean = complete(server, prompt)
    fresh = complete(server, prompt, inspector_capture=HOOK)  # a capturing request reads no cached block
    assert clean.token_ids == fresh.token_ids != steered.token_ids


def test_chat_completions_steer_too(server):
    client, _, _, model = server
    messages = [{"role": "user", "content": "Say something about lists."}]
    def chat(**xargs):
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                extra_body={"vllm_xargs": xargs} if xargs else {})
        return answer.choices[0].message.content

    clean = chat()
    assert chat(inspector_steer="push", inspector_scale=3) != clean
    assert chat() == clean


def test_an_inline_vector_steers_as_the_named_one(server):
    _, _, push, _ = server
    named = complete(server, "one two three", inspector_steer="push", inspector_scale=2, inspector_positions="2-40")
    inline = complete(server, "one two three", inspector_vector=f"{HOOK}:{encode_vector(push * 2)}",
                      inspector_positions=list(range(2, 41)))
    assert inline.token_ids == named.token_ids != complete(server, "one two three").token_ids


@pytest.mark.parametrize("xargs, words", [
    ({"inspector_steer": "nope"}, "no vector named 'nope'"),
    ({"inspector_steer": "push", "inspector_scale": "big"}, "must be a number"),
    ({"inspector_steer": "push", "inspector_positions": "9-2"}, "backwards"),
    ({"inspector_vector": f"{HOOK}:" + encode_vector(np.ones(128 * 4))}, "longer than 128"),
    ({"inspector_vector": f"blocks.0.hook_resid_pre:{encode_vector(np.ones(128))}"}, "not a hook this server compiled"),
    ({"inspector_edit": "[]"}, "written by the server"),
    ({"inspector_bogus": 1}, "unknown steering field"),
])
def test_malformed_steering_is_a_400_and_the_engine_serves_on(server, xargs, words):
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        complete(server, "hello", **xargs)
    assert complete(server, "hello").text  # the engine is still there for everyone


def test_steered_equals_the_same_edit_through_a_session(server, tiny_models):
    _, _, push, _ = server
    prompt = "the list goes on and on"
    served = complete(server, prompt, max_tokens=8, inspector_steer="push", inspector_scale=2.5,
                      inspector_positions="3-30")
    session = Session.open(options(tiny_models["llama"]))
    try:
        hook = installed_name(HOOK, session.installed)
        session.set_interventions([Intervention(hook, bias=(push * 2.5).astype(np.float32), positions=tuple(range(3, 31)))])
        session.new_run()
        list(session.generate([prompt], Sampling(max_tokens=8)))
        [request] = session.run.requests.values()
    finally:
        session.close()
    assert list(request.generated_token_ids) == list(served.token_ids)


def test_vectors_are_registered_with_the_token_only(server):
    client, url, push, _ = server

    def put(name, payload, token=None):
        request = urllib.request.Request(f"{url}/inspector/v1/vectors/{name}", json.dumps(payload).encode(), method="PUT",
                                         headers={"content-type": "application/json",
                                                  **({"x-inspector-token": token} if token else {})})
        try:
            with urllib.request.urlopen(request) as answer:
                return answer.status, json.load(answer)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    flipped = {"hook": HOOK, "vector": encode_vector(-push)}
    assert put("pull", flipped)[0] == 403
    assert put("pull", flipped, "wrong")[0] == 403
    status, found = put("pull", {"hook": HOOK, "vector": encode_vector(push[:5])}, TOKEN)
    assert status == 400 and "5 values" in found["error"]["message"]
    status, found = put("pull", flipped, TOKEN)
    assert status == 200 and found["width"] == 128
    pulled = complete(server, "one two three", inspector_steer="pull")
    assert pulled.token_ids == complete(server, "one two three", inspector_vector=f"{HOOK}:{encode_vector(-push)}").token_ids
    delete = urllib.request.Request(f"{url}/inspector/v1/vectors/pull", method="DELETE",
                                    headers={"x-inspector-token": TOKEN})
    assert urllib.request.urlopen(delete).status == 204
    with pytest.raises(openai.BadRequestError, match="no vector named 'pull'"):
        complete(server, "one two three", inspector_steer="pull")


def test_more_distinct_edits_than_slots_wait_with_a_429(server):
    """Three distinct edits stream at once (max_slots 4: three and the unedited); a fourth is told to
    retry, one alike to a running one is admitted, and once they end a new one is admitted again."""
    client, _, _, model = server
    streams = [client.completions.create(model=model, prompt="count", max_tokens=200, temperature=0, stream=True,
                                         extra_body={"vllm_xargs": {"inspector_steer": "push", "inspector_scale": s},
                                                     "ignore_eos": True})
               for s in (1, 2, 3)]
    try:
        for stream in streams:
            next(iter(stream))  # each is admitted and running
        with pytest.raises(openai.RateLimitError, match="distinct edits are running"):
            complete(server, "count", inspector_steer="push", inspector_scale=4)
        assert complete(server, "count", inspector_steer="push", inspector_scale=2).text
    finally:
        threads = [threading.Thread(target=lambda s=s: [None for _ in s]) for s in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert complete(server, "count", inspector_steer="push", inspector_scale=4).text


def fetch_capture(url, response_id, path):
    with urllib.request.urlopen(f"{url}/inspector/v1/captures/{response_id}") as answer:
        assert answer.headers["content-type"] == "application/x-hdf5"
        path.write_bytes(answer.read())
    return read_run(path)


def gpu_share() -> list[str]:
    """The test machine's GPU memory share for a command's engine (the test server holds the rest)."""
    share = ENGINE_ARGS.get("gpu_memory_utilization")
    return [] if share is None else ["--gpu-memory-utilization", str(share)]


def test_a_capture_over_the_api_equals_inspector_capture(server, tiny_models, tmp_path):
    """The same prompt, greedy, steered alike: the file the server keeps for the response holds the rows
    and tokens that `inspector capture` writes."""
    client, url, push, model = server
    prompt = "the list goes on and on"
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, extra_body={
        "vllm_xargs": {"inspector_capture": "blocks.*.hook_resid_post", "inspector_steer": "push",
                       "inspector_scale": 2.0}})
    served = fetch_capture(url, answer.id, tmp_path / "served.h5")
    np.save(tmp_path / "push2.npy", push * 2)
    reference = tmp_path / "cli.h5"
    result = subprocess.run([sys.executable, "-m", "inspector.cli", "capture", "--model", model, "--prompt", prompt,
                             "--max-tokens", "6", "--hooks", "blocks.*.hook_resid_post", "--max-model-len", "512",
                             "--intervene", f"{HOOK}:bias={tmp_path / 'push2.npy'}", "--logprobs", "0",
                             "--out", str(reference), *gpu_share()], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [request] = served.requests.values()
    [expected] = read_run(reference).requests.values()
    assert request.request_id == f"{answer.id}/0" and request.prompt == prompt
    assert request.token_ids == expected.token_ids and len(request.generated_token_ids) == 6
    assert request.token_texts == expected.token_texts and request.finish_reason == "length"
    assert set(request.hooks) == set(expected.hooks) == {f"model.layers.{i}.resid_post" for i in range(2)}
    for hook, rows in request.hooks.items():
        assert rows.positions.tolist() == expected.hooks[hook].positions.tolist()
        np.testing.assert_array_equal(np.asarray(rows.values), np.asarray(expected.hooks[hook].values))
    assert served.metadata["engine_mode"] == "compiled" and served.metadata["response_id"] == answer.id


def listed(url) -> dict[str, dict]:
    with urllib.request.urlopen(f"{url}/inspector/v1/captures") as answer:
        return {c["id"]: c for c in json.loads(answer.read())["captures"]}


def long_captured_request(server, max_tokens=300):
    """Start a capturing completion of ``max_tokens`` in a thread: (thread, a list the answer goes to)."""
    client, _, _, model = server
    answers = []
    thread = threading.Thread(target=lambda: answers.append(client.completions.create(
        model=model, prompt="count the items", max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True, "vllm_xargs": {"inspector_capture": "blocks.*.hook_resid_post"}})))
    thread.start()
    return thread, answers


def test_a_running_capture_is_listed_and_read_as_far_as_its_rows_go(server, tmp_path):
    """While it runs: listed as running with its rows so far, and its file holds them (every position
    from 0, the tokens the rows were computed for); once over: listed as done, its file the whole
    capture, whose first rows are the snapshot's."""
    _, url, _, _ = server
    thread, answers = long_captured_request(server)
    deadline = time.monotonic() + 60
    while not any(c["state"] == "running" and c["rows"] > 8 for c in listed(url).values()):
        assert thread.is_alive() and time.monotonic() < deadline, "no running capture with rows was listed"
        time.sleep(0.05)
    [running] = [c for c in listed(url).values() if c["state"] == "running"]
    with urllib.request.urlopen(f"{url}/inspector/v1/captures/{running['id']}") as answer:
        assert answer.headers["X-Inspector-Capture-State"] == "running"
        (tmp_path / "snapshot.h5").write_bytes(answer.read())
    thread.join(120)
    snapshot, [answer] = read_run(tmp_path / "snapshot.h5"), answers
    assert running["id"] == answer.id and listed(url)[answer.id]["state"] == "done"
    [partial], [whole] = snapshot.requests.values(), fetch_capture(url, answer.id, tmp_path / "whole.h5").requests.values()
    assert partial.request_id == whole.request_id == f"{answer.id}/0" and partial.finish_reason is None
    rows = partial.hooks["model.layers.1.resid_post"]
    n = len(rows.positions)
    assert n >= running["rows"] and rows.positions.tolist() == list(range(n)) and n < len(whole.token_ids)
    assert partial.token_ids == whole.token_ids[:n]
    for hook, got in partial.hooks.items():
        np.testing.assert_array_equal(np.asarray(got.values), np.asarray(whole.hooks[hook].values)[:n])


@pytest.mark.skipif(importlib.util.find_spec("pytestqt") is None, reason="the app's tests need pytest-qt")
def test_the_app_watching_the_server_shows_each_capture_while_it_runs_and_when_it_ends(server, qtbot, ui_settings,
                                                                                       tmp_path, monkeypatch):
    """File ▸ Watch an OpenAI Server: a capturing request is listed while it runs, with its rows so far
    on show, and replaced by its whole capture once its answer ends (the app looks every 0.2 s here:
    the tiny model's answer takes about a second)."""
    from fake_session import FakeSession
    from inspector.ui.main_window import MainWindow
    from inspector.viewer import served

    monkeypatch.setattr(served, "POLL_S", 0.2)
    _, url, _, _ = server
    window = keep(qtbot, MainWindow(FakeSession.open))
    window.show()
    window.watch_served(url)
    watched = window.controller.runs.served
    thread, answers = long_captured_request(server, max_tokens=480)
    qtbot.waitUntil(lambda: bool(watched.running), timeout=60000)
    qtbot.waitUntil(lambda: window.shown.rows(window.shown.selection.request, window.shown.selection.hook) is not None,
                    timeout=30000)
    rid = window.shown.selection.request
    assert rid.split("/")[0] in watched.running and window.windowTitle().startswith(f"OpenAI server {url}")
    thread.join(120)
    [answer] = answers
    qtbot.waitUntil(lambda: not watched.running, timeout=30000)
    assert rid == f"{answer.id}/0" and window.shown.selection.request == rid
    [whole] = fetch_capture(url, answer.id, tmp_path / "whole.h5").requests.values()
    assert window.shown.request(rid).token_ids == whole.token_ids
    positions, values = window.shown.rows(rid, window.shown.selection.hook)
    np.testing.assert_array_equal(values, np.asarray(whole.hooks[window.shown.selection.hook].values))
    window.refresh()
    window.grab().save(str(tmp_path / "watching.png"))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two pipeline stages need two GPUs")
def test_a_pipeline_parallel_server_steers_each_stage_and_captures_every_block_once(server, tmp_path):
    """PP=2 (one block on each stage): a request steered at both stages (a vector at block 0, one at
    block 1) keeps each block's rows once, equal with its tokens to the one-stage server's; an unsteered
    request answers as there too."""
    client, url, push, model = server
    np.save(tmp_path / "push.npy", push)
    prompt, xargs = "the list goes on and on", {"inspector_capture": "blocks.*.hook_resid_post",
                                                "inspector_steer": "early,push", "inspector_scale": 0.5}

    def steered_and_plain(client, url, tag):
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0,
                                           extra_body={"vllm_xargs": xargs})
        plain = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
        return fetch_capture(url, answer.id, tmp_path / f"{tag}.h5"), answer.choices[0].text, plain.choices[0].text

    expected, expected_text, expected_plain = steered_and_plain(client, url, "one-stage")
    extra = ["--hooks", "blocks.*.hook_resid_post", "--max-model-len", "512", "--vectors",
             f"push={tmp_path / 'push.npy'}@{HOOK}", f"early={tmp_path / 'push.npy'}@blocks.0.hook_resid_post"]
    with running_openai_server(model, extra, engine_args={"pipeline_parallel_size": 2}) as (pp_url, process):
        pp_client = openai.OpenAI(base_url=f"{pp_url}/v1", api_key="none", max_retries=0, timeout=120)
        got, text, plain = steered_and_plain(pp_client, pp_url, "two-stages")
    assert (text, plain) == (expected_text, expected_plain) and text != plain
    [request], [reference] = got.requests.values(), expected.requests.values()
    assert request.token_ids == reference.token_ids
    assert set(request.hooks) == set(reference.hooks) == {f"model.layers.{i}.resid_post" for i in range(2)}
    for hook, rows in request.hooks.items():
        assert rows.positions.tolist() == reference.hooks[hook].positions.tolist()
        assert rel_l2(np.asarray(rows.values), np.asarray(reference.hooks[hook].values)).max() < PARITY_TOL, hook


def test_a_streamed_chat_with_n_choices_captures_each_choice_in_its_window(server, tmp_path):
    client, url, _, model = server
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "count to three"}], max_tokens=5, temperature=1.0, n=2,
        seed=3, stream=True, extra_body={"vllm_xargs": {"inspector_capture": HOOK, "inspector_window": "last:2"}})
    chunks = list(stream)
    tokens = {i: [t for c in chunks if c.choices and c.choices[0].index == i for t in getattr(c.choices[0], "token_ids",
                                                                                               None) or []]
              for i in range(2)}  # the stream carries them: the server asks for them when it captures
    run = fetch_capture(url, chunks[0].id, tmp_path / "chat.h5")
    assert list(run.requests) == [f"{chunks[0].id}/0", f"{chunks[0].id}/1"]
    hook = "model.layers.1.resid_post"
    for i, request in enumerate(run.requests.values()):
        prompt_len = len(request.prompt_token_ids)
        assert request.generated_token_ids == tokens[i] and len(tokens[i]) == 5
        assert request.hooks.keys() == {hook} and request.windows == {hook: "last:2"}
        # the prompt's last two positions and every generated one but the last (it is never an input)
        assert request.hooks[hook].positions.tolist() == list(range(prompt_len - 2, len(request.token_ids) - 1))


def test_captures_that_did_not_ask_or_are_unknown_are_404(server):
    client, url, _, model = server
    answer = client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0)
    for capture_id in (answer.id, "cmpl-c" + "0" * 32, "../etc"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{url}/inspector/v1/captures/{capture_id}")
        assert missing.value.code == 404


def captured_rows(server, prompt, tmp_path, **xargs):
    client, url, _, model = server
    answer = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, extra_body={
        "vllm_xargs": {"inspector_capture": HOOK, **xargs}})
    [request] = fetch_capture(url, answer.id, tmp_path / f"{answer.id}.h5").requests.values()
    return np.asarray(request.hooks["model.layers.1.resid_post"].values, dtype=np.float64)


def test_an_ablated_direction_is_gone_from_the_rows_where_asked(server, tmp_path):
    _, _, push, _ = server
    unit = push / np.linalg.norm(push)
    clean = captured_rows(server, "one two three four", tmp_path)
    ablated = captured_rows(server, "one two three four", tmp_path, inspector_ablate="push", inspector_positions="2-40")
    assert np.abs(clean[2:] @ unit).max() > 1e-2  # there was something to remove where asked
    along = ablated @ unit
    assert np.abs(along[2:]).max() < 1e-5 * np.linalg.norm(ablated[2:], axis=1).max()
    np.testing.assert_array_equal(ablated[:2], clean[:2])  # positions 0, 1 untouched
    inline = captured_rows(server, "one two three four", tmp_path, inspector_ablate=f"{HOOK}:{encode_vector(push)}",
                           inspector_positions="2-40")
    np.testing.assert_allclose(inline, ablated, rtol=1e-6, atol=1e-6)


def test_a_clamped_sae_feature_moves_the_rows_along_its_decoder_to_its_value(server, sae_dir, tmp_path):
    """A clamp is the SAE's reconstruction with the feature at the value, plus the SAE's error: each row
    moves along the feature's decoder row by (value - its activation). At the model's last block the
    prompt's rows see no other change."""
    from inspector.core.sae import feature_clamp, read_sae

    assert json.load(urllib.request.urlopen(f"{server[1]}/inspector/v1/hooks"))["feature_clamps"] == 2
    clamp = feature_clamp(read_sae(sae_dir), 3, 2.5)
    clean = captured_rows(server, "one two three four", tmp_path)[:3]
    clamped = captured_rows(server, "one two three four", tmp_path, inspector_clamp="feature=2.5")[:3]
    p = clean @ clamp.encoder + clamp.offset
    activation = p * (p > clamp.floor)
    np.testing.assert_allclose(clamped, clean + (2.5 - activation)[:, None] * clamp.decoder, rtol=1e-5, atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="cannot be clamped"):
        complete(server, "x", inspector_clamp="push=1")
