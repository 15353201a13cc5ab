"""A notebook's caches and generations in the project's capture files: saved through the project's writer
(read back by ``inspector.io``'s reader as a capture written by the app), loaded back exactly (bf16 and
padding included), any capture file loaded as a cache, and the desktop app started on one."""

import time

import numpy as np
import pytest
import torch

from inspector.core.attention import AttentionGeometry
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.io import CaptureFileError, read_run, write_run
from inspector.notebook.cache import ActivationCache, as_torch
from inspector.notebook.files import Loaded, load, load_cache, open_in_app, run_of, save
from inspector.notebook.hooked import Generated

GEOMETRY = AttentionGeometry(heads=2, kv_heads=1, head_size=4, scale=0.5)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]])


def texts_of(ids):
    return [f"<{i}>" for i in ids]


def padded(*shape, dtype=torch.float32, mask=MASK):
    """Random rows, zero where ``mask`` says there is no token (as the engine's caches are)."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    return values * mask.reshape(*mask.shape, *[1] * (len(shape) - 2)).to(dtype)


def points_of(dtype: str) -> dict[str, HookPoint]:
    """As an engine installs them: its own names, TransformerLens's as aliases."""
    kinds = (("resid_post", "blocks.0.hook_resid_post", 8), ("q", "blocks.0.attn.hook_q", 8),
             ("k", "blocks.0.attn.hook_k", 4), ("z", "blocks.0.attn.hook_z", 8))
    return {f"model.layers.0.{kind}": HookPoint(f"model.layers.0.{kind}", alias, "model.layers.0", kind, width, 0,
                                                 dtype, GEOMETRY if kind in ("q", "k") else None)
            for kind, alias, width in kinds}


def cache_of(dtype=torch.float32) -> ActivationCache:
    tensors = {"blocks.0.hook_resid_post": padded(2, 4, 8, dtype=dtype),
               "blocks.0.attn.hook_q": padded(2, 4, 2, 4, dtype=dtype),
               "blocks.0.attn.hook_k": padded(2, 4, 1, 4, dtype=dtype),
               "blocks.0.attn.hook_z": padded(2, 4, 2, 4, dtype=dtype)}
    return ActivationCache(tensors, MASK, 2, geometries={0: GEOMETRY, 1: GEOMETRY})


def assert_same_cache(got: ActivationCache, expected: ActivationCache):
    assert set(got) == set(expected) and torch.equal(got.attention_mask, expected.attention_mask)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert got.n_layers == expected.n_layers and got.geometries == expected.geometries


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_is_a_capture_file_and_comes_back_exactly(tmp_path, dtype):
    cache = cache_of(dtype)
    pattern = cache["pattern", 0]  # recomputed by the cache: not a hook point, not in the file
    name = str(dtype).removeprefix("torch.")
    path = save(cache, tmp_path / "cache.h5", points_of(name), TOKENS, texts_of, {"model_path": "/m"})

    run = read_run(path)
    assert run.hooks == points_of(name) and run.metadata["model_path"] == "/m"
    first, second = run.requests.values()
    assert first.prompt_token_ids == [1, 2, 3, 4] and second.prompt_token_ids == [5, 6]
    assert not second.generated_token_ids
    assert second.token_texts == ["<5>", "<6>"] and second.prompt == "<5><6>"
    rows = second.hooks["model.layers.0.q"]
    assert rows.positions.tolist() == [0, 1] and rows.token_ids.tolist() == [5, 6]
    assert rows.values.dtype == (BFLOAT16 if dtype == torch.bfloat16 else np.float32)
    assert torch.equal(as_torch(rows.values), cache["q", 0][1, :2].reshape(2, 8))  # heads merged, bits kept

    loaded = load(path)
    assert isinstance(loaded, Loaded) and loaded.text == ["", ""] and torch.equal(loaded.tokens, TOKENS)
    assert_same_cache(loaded.cache, cache_of(dtype))
    assert torch.equal(loaded.cache["pattern", 0], pattern)


def test_a_cache_saved_on_its_own_names_its_points_after_transformerlens(tmp_path):
    """No engine's points or tokens: TransformerLens's names and kinds, ids -1, and the heads of z
    come back split by the geometry the cache held (no q or k point records it here)."""
    cache = ActivationCache({"blocks.1.attn.hook_z": padded(2, 4, 2, 4), "blocks.1.mlp.hook_post": padded(2, 4, 16),
                             "hook_embed": padded(2, 4, 8)}, MASK, 2, geometries={1: GEOMETRY})
    path = save(cache, tmp_path / "alone.h5")
    run = read_run(path)
    assert {n: (p.kind, p.layer, p.width) for n, p in run.hooks.items()} == {
        "blocks.1.attn.hook_z": ("z", 1, 8), "blocks.1.mlp.hook_post": ("mlp_post", 1, 16),
        "hook_embed": ("embed", -1, 8)}
    assert run.requests["1"].token_ids == [-1, -1] and run.requests["1"].token_texts == ["", ""]
    loaded = load(path)
    assert_same_cache(loaded.cache, cache)
    assert loaded.tokens[1].tolist() == [-1, -1, 0, 0]


def test_a_cache_without_its_batch_dimension(tmp_path):
    cache = ActivationCache({"blocks.0.hook_resid_post": padded(1, 3, 8, mask=torch.ones(1, 3))}, torch.ones(1, 3), 1)
    path = save(cache.remove_batch_dim(), tmp_path / "one.h5", tokens=torch.tensor([7, 8, 9]), token_texts=texts_of)
    assert read_run(path).requests["0"].token_ids == [7, 8, 9]
    assert_same_cache(load_cache(path), cache)


def test_a_generation_keeps_its_last_token_and_its_prompt(tmp_path):
    """Every position but the last sampled token's is cached; the prompt ends where the tokens whose
    texts join into the generated text begin (an end-of-text token without text included)."""
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 2, 0, 0]])
    generated = Generated(["<4>", "<7><2>"], tokens,
                          ActivationCache({"blocks.0.hook_resid_post": padded(2, 5, 8, mask=mask)}, mask, 1))

    def texts(ids):  # 5: the end of text
        return ["" if i == 5 else f"<{i}>" for i in ids]

    path = save(generated, tmp_path / "generated.h5", token_texts=texts)
    first, second = read_run(path).requests.values()
    assert (first.prompt_token_ids, first.generated_token_ids) == ([1, 2, 3], [4, 5])
    assert (second.prompt_token_ids, second.generated_token_ids) == ([6], [7, 2])
    assert first.hooks["blocks.0.hook_resid_post"].positions.tolist() == [0, 1, 2, 3]
    text, loaded_tokens, cache = load(path)
    assert text == generated.text and torch.equal(loaded_tokens, tokens)
    assert_same_cache(cache, generated.cache)
    explicit = run_of(generated, token_texts=texts, prompt_lengths=[4, 1])
    assert explicit.requests["0"].generated_token_ids == [5]


def test_a_capture_written_by_the_engine_loads_as_a_cache(tmp_path):
    """As ``inspector capture`` writes a run: heads split by the q/k points' geometry, a generation's
    last token without rows, a request that kept no row of a hook zero there."""
    hooks = points_of("bfloat16")
    rows = {name: np.arange(3 * p.width, dtype=np.float32).reshape(3, p.width).astype(BFLOAT16)
            for name, p in hooks.items()}
    requests = {}
    for rid, hooked in (("7-a", list(hooks)), ("8-b", ["model.layers.0.q"])):
        request = RequestCapture(rid, "x", [1, 2], {}, [3, 4], ["a", "b", "c", "d"], finish_reason="length")
        for name in hooked:
            request.hooks[name] = HookRows(hooks[name].width, dtype=BFLOAT16)
            request.hooks[name].append([0, 1, 2], [1, 2, 3], rows[name])
        requests[rid] = request
    path = write_run(Run({"model_path": "/m"}, hooks, requests), tmp_path / "captured.h5")

    text, tokens, cache = load(path)
    assert text == ["cd", "cd"] and tokens.tolist() == [[1, 2, 3, 4]] * 2
    assert cache.attention_mask.tolist() == [[1, 1, 1, 0]] * 2
    assert [cache[kind, 0].shape for kind in ("q", "k", "z")] == [(2, 4, 2, 4), (2, 4, 1, 4), (2, 4, 2, 4)]
    assert cache["z", 0].dtype == torch.bfloat16 and cache.n_layers == 1 and cache.geometries == {0: GEOMETRY}
    assert torch.equal(cache["q", 0][1, :3].reshape(3, 8), as_torch(rows["model.layers.0.q"]))
    assert not cache["z", 0][1].any() and not cache["q", 0][:, 3].any()


def test_what_cannot_be_saved_says_why(tmp_path):
    with pytest.raises(ValueError, match="do not fit the cache's positions"):
        save(cache_of(), tmp_path / "x.h5", tokens=TOKENS[:, :3])
    with pytest.raises(CaptureFileError, match="does not exist"):
        save(cache_of(), tmp_path / "missing" / "x.h5")
    with pytest.raises(CaptureFileError, match="does not exist"):
        open_in_app(cache_of(), tmp_path / "missing" / "x.h5")
    assert not list(tmp_path.rglob("*"))


def test_the_app_opens_what_the_notebook_hands_it(tmp_path, capfd):
    """The app, started offscreen with settings of its own, lists the file among its recent captures
    once it has opened it (it does so only after reading it without error) and keeps running."""
    settings = tmp_path / "settings"
    app = open_in_app(cache_of(torch.bfloat16), tmp_path / "shown.h5", ["--settings-dir", str(settings)],
                      points=points_of("bfloat16"), tokens=TOKENS, token_texts=texts_of)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and app.poll() is None:
            ini = next(settings.rglob("*.ini"), None)
            if ini is not None and str(tmp_path / "shown.h5") in ini.read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the app did not open the file (exit code {app.poll()}): {capfd.readouterr().err[-3000:]}")
        time.sleep(2)  # it shows the file: painting the heatmap of its first request
        assert app.poll() is None
    finally:
        app.terminate()
        app.wait(30)
    assert "Traceback" not in capfd.readouterr().err
