"""Sparse-autoencoder features (inspector/core/sae.py, inspector/plugin/features.py): SAELens's
directories read and checked, the reference encoding equal to SAELens's own equations, and in the
engine (the in-process compiled session on the tiny Llama) each token's strongest features equal
that encoding of the captured rows; a feature-steered run equals the bias intervention it stands for."""

import json

import numpy as np
import pytest

import hf_reference
from sae_files import saelens_encode, write_sae
from session_kinds import GREEDY, collect
from inspector.core.interventions import Intervention
from inspector.core.sae import SaeError, decoder_row, encode, feature_clamp, load_weights, read_sae, strongest

ARCHITECTURES = ("standard", "topk", "jumprelu")
HOOK = "blocks.1.hook_resid_post"
PROMPTS = ["def fibonacci(n):", "import os\nimport sys"]


# ------------------------------------------------------------------------------ files and the reference

@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize("normalize", ["none", "constant_norm_rescale", "layer_norm"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_reference_encoding_is_saelens(tmp_path, architecture, normalize, legacy):
    path = write_sae(tmp_path / "sae", architecture, 64, 512, HOOK, normalize=normalize, legacy=legacy,
                     apply_b_dec_to_input=not legacy)
    config = read_sae(path)
    assert (config.architecture, config.d_in, config.d_sae, config.hook) == (architecture, 64, 512, HOOK)
    x = np.random.default_rng(1).normal(0, 1, (40, 64)).astype(np.float32)
    got, expected = encode(config, load_weights(config), x), saelens_encode(path, x)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    active = (expected > 0).sum(axis=1)
    assert active.min() > 0 and active.max() < 512  # sparse, not empty: the comparison means something
    if architecture == "topk":
        assert active.max() <= config.k


def test_the_strongest_features_come_first_and_inactive_ones_are_marked():
    acts = np.array([[0.0, 3.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    ids, values = strongest(acts, 3)
    np.testing.assert_array_equal(ids, [[1, 2, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(values, [[3.0, 0.5, 0.0], [0.0, 0.0, 0.0]])


def test_a_decoder_row_is_read_alone_and_checked(tmp_path):
    config = read_sae(write_sae(tmp_path / "sae", "standard", 64, 512, HOOK))
    np.testing.assert_array_equal(decoder_row(config, 7), load_weights(config)["W_dec"][7])
    with pytest.raises(ValueError, match="feature 512 is outside 0..511"):
        decoder_row(config, 512)


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "cfg.json").unlink(), "no cfg.json"),
    (lambda d: (d / "cfg.json").write_text("{oops"), "cfg.json: not readable JSON"),
    (lambda d: _edit(d, architecture="gated"), "architecture 'gated' is not one of standard, topk, jumprelu"),
    (lambda d: _edit(d, d_sae="512"), "d_sae must be an integer"),
    (lambda d: _edit(d, d_in=65), r"W_enc is \[64, 512\], but cfg.json says d_in 65 and d_sae 512, so it must be "
                                  r"\[65, 512\]"),
    (lambda d: _edit(d, normalize_activations="whiten"), "normalize_activations 'whiten' is not one of"),
    (lambda d: _edit(d, architecture="jumprelu"), "no tensor 'threshold'"),
    (lambda d: _edit(d, architecture="topk", k=0), "k 0 is outside 1..d_sae"),
    (lambda d: (d / "sae_weights.safetensors").write_bytes(b"not safetensors"), "not a readable safetensors file"),
])
def test_a_directory_that_does_not_fit_is_refused_naming_the_file_and_field(tmp_path, damage, message):
    path = write_sae(tmp_path / "sae", "standard", 64, 512, HOOK)
    damage(path)
    with pytest.raises(SaeError, match=message):
        read_sae(path)


def _edit(directory, **fields):
    cfg = json.loads((directory / "cfg.json").read_text())
    (directory / "cfg.json").write_text(json.dumps({**cfg, **fields}))


# ------------------------------------------------------------------------------ in the engine

@pytest.fixture(scope="module")
def real(sessions):
    return sessions["real"][0]


@pytest.fixture(scope="module")
def sae_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    return {a: write_sae(root / a, a, 128, 16 * 128, HOOK, k=24, seed=i) for i, a in enumerate(ARCHITECTURES)}


def test_each_tokens_strongest_features_equal_the_reference_encoding_of_its_captured_row(real, sae_dirs):
    attached = [real.attach_sae(sae_dirs[a], k=32) for a in ARCHITECTURES]
    try:
        collect(real, PROMPTS, GREEDY)
        for req in real.run.requests.values():
            rows = req.hooks[attached[0].hook]
            for sae in attached:
                features = req.features[sae.name]
                np.testing.assert_array_equal(features.positions, rows.positions)
                want_ids, want_acts = strongest(saelens_encode(sae_dirs[sae.config.architecture], rows.values), 32)
                assert (want_ids >= 0).sum(axis=1).min() > 0, sae.name  # every token has features
                np.testing.assert_array_equal(features.ids, want_ids, err_msg=sae.name)
                np.testing.assert_allclose(features.activations, want_acts, rtol=1e-5, atol=1e-6, err_msg=sae.name)
    finally:
        for sae in attached:
            real.detach_sae(sae.name)
    collect(real, PROMPTS[:1], GREEDY)
    assert not any(req.features for req in real.run.requests.values())  # detached: no more features


def test_a_feature_steered_run_equals_the_bias_it_stands_for(real, sae_dirs):
    sae = real.attach_sae(sae_dirs["standard"], k=8)
    try:
        vector = 4.0 * load_weights(sae.config)["W_dec"][5]
        runs = []
        for steering in (sae.steering(5, 4.0), Intervention(sae.hook, bias=vector)):
            real.set_interventions([steering])
            collect(real, PROMPTS, GREEDY)
            runs.append(list(real.run.requests.values()))
        real.set_interventions([])
        for steered, biased in zip(*runs):
            assert steered.generated_token_ids == biased.generated_token_ids
            np.testing.assert_allclose(steered.hooks[sae.hook].values, biased.hooks[sae.hook].values, atol=1e-6)
            # feature 5 is added to every row: it is among the strongest features everywhere
            assert (steered.features[sae.name].ids == 5).any(axis=1).all()
    finally:
        real.detach_sae(sae.name)


@pytest.mark.parametrize("kind", ["real", "remote"])
@pytest.mark.parametrize("architecture", ["standard", "jumprelu"])
def test_a_clamped_feature_is_set_to_its_value_and_the_rest_of_the_row_kept(sessions, tiny_models, sae_dirs,
                                                                             architecture, kind):
    session = sessions[kind][0]
    sae = session.attach_sae(sae_dirs[architecture], k=8)
    config, weights = sae.config, load_weights(sae.config)
    try:
        collect(session, PROMPTS, GREEDY)
        clean = list(session.run.requests.values())
        acts = np.concatenate([encode(config, weights, req.hooks[sae.hook].values) for req in clean])
        feature = int(np.argmin(np.abs((acts > 0).mean(axis=0) - 0.5)))
        assert 0 < (acts[:, feature] > 0).mean() < 1  # active on some rows, not all: both cases are checked
        clamp = sae.clamping(feature, 3.0)
        session.set_interventions([clamp])
        collect(session, PROMPTS, GREEDY)
        clamped = list(session.run.requests.values())
    finally:
        session.set_interventions([])
        session.detach_sae(sae.name)
    layer = int(HOOK.split(".")[1])
    named = {point.alias: name for name, point in session.installed.items()}
    for before, after in zip(clean, clamped):
        # the prompt's rows at the hook: the SAE's reconstruction with the feature at 3.0, plus its error
        n = len(after.prompt_token_ids)
        rows = before.hooks[sae.hook].values[:n]
        want = rows + (3.0 - encode(config, weights, rows)[:, feature])[:, None] * weights["W_dec"][feature]
        np.testing.assert_allclose(after.hooks[sae.hook].values[:n], want, rtol=1e-5, atol=1e-5)
        assert np.abs(after.hooks[sae.hook].values[:n] - rows).max() > 0.1  # it changed them
        # transformers with the clamp written as a forward hook: every block's output, and the tokens
        tokens = after.prompt_token_ids + after.generated_token_ids
        ref = hf_reference.steered(tiny_models["llama"], tokens, layer, np.zeros(config.d_in), clamp.clamp.as_dict())
        for later in range(layer, len(ref["resid_post"])):
            got = after.hooks[named[f"blocks.{later}.hook_resid_post"]].values
            np.testing.assert_allclose(got, ref["resid_post"][later][:len(got)], rtol=1e-4, atol=1e-4)
        assert after.generated_token_ids == ref["logits"][n - 1:-1].argmax(axis=1).tolist()


def test_a_clamp_is_read_from_the_file_and_refused_where_a_feature_is_no_direction(tmp_path):
    config = read_sae(write_sae(tmp_path / "j", "jumprelu", 64, 512, HOOK))
    weights, clamp = load_weights(config), feature_clamp(read_sae(tmp_path / "j"), 9, 2.5)
    np.testing.assert_array_equal(clamp.encoder, weights["W_enc"][:, 9])
    np.testing.assert_array_equal(clamp.decoder, weights["W_dec"][9])
    assert (clamp.floor, clamp.value, clamp.label) == (pytest.approx(weights["threshold"][9]), 2.5, "j/9")
    x = np.random.default_rng(3).normal(0, 1, (64, 64)).astype(np.float32)
    pre = x @ clamp.encoder + clamp.offset
    np.testing.assert_allclose(pre * (pre > clamp.floor), encode(config, weights, x)[:, 9], atol=1e-5)
    with pytest.raises(ValueError, match="a top-k SAE's feature cannot be clamped"):
        feature_clamp(read_sae(write_sae(tmp_path / "t", "topk", 64, 512, HOOK)), 0, 1.0)
    with pytest.raises(ValueError, match="normalised \\(layer_norm\\), so a feature is not one direction"):
        feature_clamp(read_sae(write_sae(tmp_path / "n", "standard", 64, 512, HOOK, normalize="layer_norm")), 0, 1.0)
    with pytest.raises(ValueError, match="feature 512 is outside"):
        feature_clamp(config, 512, 1.0)


def test_an_sae_that_does_not_fit_the_engine_is_refused_and_nothing_attached(real, tmp_path):
    narrow = write_sae(tmp_path / "narrow", "standard", 64, 512, HOOK)
    with pytest.raises(ValueError, match="reads 64-wide rows, but blocks.1.hook_resid_post is 128 wide"):
        real.attach_sae(narrow)
    elsewhere = write_sae(tmp_path / "elsewhere", "standard", 128, 512, "blocks.0.hook_mlp_out")
    with pytest.raises(ValueError, match="'blocks.0.hook_mlp_out' is not an installed hook point"):
        real.attach_sae(elsewhere)
    first = real.attach_sae(write_sae(tmp_path / "dup", "standard", 128, 512, HOOK))
    try:
        with pytest.raises(ValueError, match="an SAE named 'dup' is attached already"):
            real.attach_sae(tmp_path / "dup")
    finally:
        real.detach_sae(first.name)
    assert not real.saes


def test_a_compiled_restart_keeps_the_saes_on_hooks_still_installed(real, sae_dirs):
    sae = real.attach_sae(sae_dirs["jumprelu"], k=4)
    try:
        assert real.set_hooks(list(real.options.hooks))  # compiled: the engine restarts
        assert set(real.saes) == {sae.name}
        collect(real, PROMPTS[:1], GREEDY)
        (req,) = real.run.requests.values()
        assert len(req.features[sae.name]) == len(req.hooks[sae.hook]) > 0
    finally:
        real.detach_sae(sae.name)
