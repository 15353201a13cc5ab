"""``Inspector``, the notebook API: ``run_with_cache`` on the tiny Llama (one compiled engine for the
module) against transformers: the logits through the model's own unembedding, every block's points
in TransformerLens's names and shapes, padding, and the errors a notebook user meets."""

import html

import numpy as np
import pytest
import torch

import hf_reference
from engines import PARITY_TOL, assert_greedy_generation_caches_as_a_prefill, rel_l2
from inspector.core.labels import display_token
from inspector.io import read_run, write_run
from inspector.notebook.files import load
from test_notebook_files import assert_same_cache

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os"]
TL_NAMES = {"resid_pre": "hook_resid_pre", "resid_post": "hook_resid_post", "resid_mid": "hook_resid_mid",
            "attn_out": "hook_attn_out", "mlp_out": "hook_mlp_out", "mlp_post": "mlp.hook_post", "z": "attn.hook_z"}


@pytest.fixture(scope="module")
def ins(tiny_models):
    from inspector import Inspector

    with Inspector(str(tiny_models["llama"]), max_model_len=256) as inspector:
        yield inspector


@pytest.fixture(scope="module")
def cached(ins):
    return ins.run_with_cache(PROMPTS)


def test_the_logits_are_the_models_own_at_every_prompt_position(ins, cached, tiny_models):
    logits, cache = cached
    lengths = cache.attention_mask.sum(1).tolist()
    assert logits.shape == (2, max(lengths), 512) and logits.dtype == torch.float32 and lengths[0] > lengths[1]
    for i, prompt in enumerate(PROMPTS):
        ids = ins.to_tokens(prompt)[0].tolist()
        assert len(ids) == lengths[i]
        expected = hf_reference.logits(tiny_models["llama"], ids)
        assert rel_l2(logits[i, :len(ids)].numpy(), expected).max() < PARITY_TOL
        assert not logits[i, len(ids):].any()  # the padding


def test_every_block_point_is_transformers_in_transformerlens_names_and_shapes(ins, cached, tiny_models):
    _, cache = cached
    heads = cache["q", 0].shape[2]
    assert cache["blocks.0.attn.hook_q"] is cache["q", 0] and cache["q", 0].shape[3] * heads == 128
    assert cache["k", 1].ndim == 4 and cache["z", 1].shape == cache["q", 1].shape
    for i, prompt in enumerate(PROMPTS):
        ids = ins.to_tokens(prompt)[0].tolist()
        for (layer, kind), expected in hf_reference.block_points(tiny_models["llama"], "llama", ids).items():
            if kind not in TL_NAMES:
                continue
            got = cache[f"blocks.{layer}.{TL_NAMES[kind]}"][i, :len(ids)]
            assert rel_l2(got.reshape(len(ids), -1).numpy(), expected).max() < PARITY_TOL, (layer, kind)


def test_accumulated_resid_and_stacks_follow_transformerlens(cached):
    _, cache = cached
    stacked, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"] and stacked.shape == (3, *cache["resid_post", 1].shape)
    assert torch.equal(stacked[-1], cache["blocks.1.hook_resid_post"])
    assert cache.accumulated_resid(1, incl_mid=True, return_labels=True)[1] == ["0_pre", "0_mid"]
    assert cache.stack_activation("resid_post").shape == (2, *cache["resid_post", 0].shape)


def test_token_ids_in_one_prompt_without_its_batch_dim_and_a_filter(ins, cached):
    logits, cache = cached
    n = int(cache.attention_mask[1].sum())
    tokens = ins.to_tokens(PROMPTS[1])
    one_logits, one = ins.run_with_cache(tokens, names_filter="blocks.1.*", remove_batch_dim=True)
    assert one_logits.shape == (n, 512) and set(one) == {k for k in cache if k.startswith("blocks.1.")}
    np.testing.assert_allclose(one["resid_post", 1].numpy(), cache["resid_post", 1][1, :n].numpy(), atol=1e-5)
    assert ins.to_string(tokens[0]) == PROMPTS[1] and len(ins.to_str_tokens(PROMPTS[1])) == n
    _, none = ins.run_with_cache([tokens[0].tolist()], names_filter=lambda name: name == "hook_embed", return_type=None)
    assert list(none) == ["hook_embed"]


def test_unknown_names_and_bad_input_are_one_clear_error_each(ins, cached):
    _, cache = cached
    with pytest.raises(KeyError, match="did you mean blocks.1.hook_resid_post"):
        cache["blocks.1.hook_resid_pots"]
    with pytest.raises(ValueError, match="did you mean blocks.0.hook_resid_pre"):
        ins.run_with_cache(PROMPTS[0], names_filter=["blocks.0.hook_resid_pr"])
    with pytest.raises(ValueError, match="input must be a prompt"):
        ins.run_with_cache(3.5)
    with pytest.raises(ValueError, match="has 400 tokens; the engine takes 1 to 255"):
        ins.run_with_cache([[5] * 400])
    with pytest.raises(ValueError, match="needs a batch of one"):
        cache.remove_batch_dim()


def test_generate_with_cache_caches_every_position_the_model_ran_on(ins, tiny_models):
    """Greedy: the tokens are transformers' argmax continuation; the cache holds the prompt's and the
    generated tokens' rows (all but the last token's), equal to a prefill of the same tokens."""
    generated = ins.generate_with_cache(PROMPTS, max_new_tokens=5, ignore_eos=True)
    text, tokens, cache = generated
    assert tokens.shape[0] == 2 and len(text) == 2
    assert html.escape(text[0]) in generated._repr_html_() and "blocks.0.hook_resid_post" in generated._repr_html_()
    assert_greedy_generation_caches_as_a_prefill(ins, tiny_models["llama"], PROMPTS, generated, 5)
    resid = cache["resid_post", 0]
    resid.mul_(0)  # the cache's tensors are the user's to edit, as TransformerLens's are
    assert not resid.is_inference() and not resid.any() and cache.attention_mask.sum() > 0
    with pytest.raises(ValueError, match="unexpected keyword argument 'temprature'"):
        ins.generate_with_cache(PROMPTS[0], temprature=0.5)


def test_cfg_holds_transformerlens_config_fields_as_transformers_config_says(ins, tiny_models):
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_models["llama"])
    cfg = ins.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_key_value_heads, cfg.d_mlp, cfg.d_vocab) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size,
        hf.vocab_size)
    assert cfg.d_head == hf.hidden_size // hf.num_attention_heads and cfg.n_ctx == 256 and cfg.dtype == "float32"


def test_generate_is_transformerlens_generate_without_a_cache(ins):
    """``generate``: the prompt and its continuation as text (greedy: generate_with_cache's), its
    tokens on request, sampling as TransformerLens samples by default; text input only."""
    greedy = ins.generate_with_cache(PROMPTS, max_new_tokens=5, ignore_eos=True)
    texts = ins.generate(PROMPTS, max_new_tokens=5, do_sample=False, stop_at_eos=False)
    assert texts == [prompt + text for prompt, text in zip(PROMPTS, greedy.text)]
    assert ins.generate(PROMPTS[0], max_new_tokens=5, do_sample=False, stop_at_eos=False) == texts[0]
    tokens = ins.generate(PROMPTS, max_new_tokens=5, do_sample=False, stop_at_eos=False, return_type="tokens")
    assert torch.equal(tokens, greedy.tokens)
    sampled = [ins.generate(PROMPTS[0], max_new_tokens=8, stop_at_eos=False, seed=s) for s in range(4)]
    assert all(t.startswith(PROMPTS[0]) for t in sampled) and len(set(sampled)) > 1
    with pytest.raises(ValueError, match="as text"):
        ins.generate(ins.to_tokens(PROMPTS[0]))
    with pytest.raises(ValueError, match="return_type"):
        ins.generate(PROMPTS[0], return_type="logits")


@pytest.fixture(scope="module")
def gpt2(tiny_models):
    from inspector import Inspector

    with Inspector(str(tiny_models["gpt2"]), max_model_len=256) as inspector:
        yield inspector


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_cache_is_transformerlens_own_name_for_name(arch, ins, gpt2, tiny_models):
    """TransformerLens's HookedTransformer of the same weights (unprocessed), on the same tokens: every
    activation both caches name is the same, shape for shape, and so are the logits and the
    accumulated residual stream. Queries and keys are those the attention kernel receives: after the
    rotary embedding (TransformerLens's ``hook_rot_q``/``hook_rot_k``) where the model has one. The final
    norm's output is after its weight and bias (TransformerLens's ``hook_normalized`` is before them), so
    it is left out; the logits it gives are compared."""
    from tl_reference import hooked_transformer

    inspector = {"llama": ins, "gpt2": gpt2}[arch]
    reference = hooked_transformer(tiny_models[arch], arch)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11], [8, 64, 1, 2, 3, 4, 5, 6]])
    logits, cache = inspector.run_with_cache(tokens)
    with torch.no_grad():
        expected_logits, expected = reference.run_with_cache(tokens)
    assert rel_l2(logits.numpy().reshape(-1, 512), expected_logits.numpy().reshape(-1, 512)).max() < PARITY_TOL
    rotary = {"q": "rot_q", "k": "rot_k"} if arch == "llama" else {}
    compared = []
    for name, got in cache.items():
        kind = name.rpartition("hook_")[2]
        theirs = name.replace(f"hook_{kind}", f"hook_{rotary[kind]}") if kind in rotary else name
        if theirs in expected and kind != "normalized":
            assert got.shape == expected[theirs].shape, name
            assert rel_l2(got.reshape(-1, got.shape[-1]).numpy(),
                          expected[theirs].reshape(-1, got.shape[-1]).numpy()).max() < PARITY_TOL, name
            compared.append(kind)
    assert {"embed", "resid_pre", "resid_post", "attn_out", "mlp_out", "q", "k", "z", "post"} <= set(compared)
    for layer in range(2):  # recomputed from the captured queries and keys
        assert cache["pattern", layer].shape == expected["pattern", layer].shape == (2, 2, 8, 8)
        assert rel_l2(cache["pattern", layer].reshape(-1, 8).numpy(),
                      expected["pattern", layer].reshape(-1, 8).numpy()).max() < PARITY_TOL
    mine, labels = cache.accumulated_resid(return_labels=True)
    theirs, their_labels = expected.accumulated_resid(return_labels=True)
    assert labels == their_labels and rel_l2(mine.reshape(-1, 128).numpy(), theirs.reshape(-1, 128).numpy()).max() < PARITY_TOL


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decompose_resid_apply_ln_and_logit_attrs_are_transformerlens(arch, ins, gpt2, tiny_models):
    """TransformerLens's HookedTransformer of the same weights, on the same tokens: ``decompose_resid``
    and ``apply_ln_to_stack`` are its own unprocessed (LayerNorm centres, RMS does not) and add up to the
    last block's output; ``logit_attrs`` (the engine's direct logit attribution) is its own with the
    final norm folded into the unembedding (``fold_ln=True``), and summed over the parts, for the next
    tokens, gives the logits less the unembedding's (folded) bias."""
    from tl_reference import hooked_transformer

    inspector = {"llama": ins, "gpt2": gpt2}[arch]
    plain, folded = hooked_transformer(tiny_models[arch], arch), hooked_transformer(tiny_models[arch], arch)
    folded.process_weights_(fold_ln=True, center_writing_weights=False, center_unembed=False)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 7, 250, 11], [8, 64, 1, 2, 3, 4, 5, 6]])
    logits, cache = inspector.run_with_cache(tokens)
    with torch.no_grad():
        _, expected = plain.run_with_cache(tokens)
        _, expected_folded = folded.run_with_cache(tokens)

    def same(mine, theirs):
        assert mine.shape == theirs.shape
        assert rel_l2(mine.reshape(-1).numpy(), theirs.detach().reshape(-1).numpy()) < PARITY_TOL

    stack, labels = cache.decompose_resid(return_labels=True)
    theirs, their_labels = expected.decompose_resid(return_labels=True)
    assert labels == their_labels and labels[-2:] == ["1_attn_out", "1_mlp_out"]
    assert ("pos_embed" in labels) == (arch == "gpt2")
    same(stack, theirs)
    same(stack.sum(0), cache["resid_post", 1])
    part = dict(layer=1, mlp_input=True, mode="attn", incl_embeds=False, return_labels=True)
    (mine, part_labels), (theirs, their_part_labels) = cache.decompose_resid(**part), expected.decompose_resid(**part)
    assert part_labels == their_part_labels == ["0_attn_out", "1_attn_out"]
    same(mine, theirs)

    same(cache["ln_final.hook_scale"], expected["ln_final.hook_scale"])
    for pos in (None, -1, (0, -1)):
        same(cache.apply_ln_to_stack(cache.decompose_resid(pos_slice=pos), pos_slice=pos, batch_slice=[1, 0]),
             expected.apply_ln_to_stack(expected.decompose_resid(pos_slice=pos), pos_slice=pos, batch_slice=[1, 0]))
    same(cache.decompose_resid(apply_ln=True, pos_slice=-1), expected.decompose_resid(apply_ln=True, pos_slice=-1))

    following = tokens[:, 1:]
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=(0, -1)), following, pos_slice=(0, -1))
    same(attrs, expected_folded.logit_attrs(expected_folded.decompose_resid(pos_slice=(0, -1)), following,
                                            pos_slice=(0, -1)))
    same(attrs.sum(0) + folded.b_U.detach()[following], logits[:, :-1].gather(-1, following[..., None])[..., 0])
    last = cache.decompose_resid(pos_slice=-1)
    diff = cache.logit_attrs(last, tokens[:, 0], incorrect_tokens=tokens[:, 1], pos_slice=-1)
    assert diff.shape == (len(labels), 2)
    same(diff, expected_folded.logit_attrs(expected_folded.decompose_resid(pos_slice=-1), tokens[:, 0],
                                           incorrect_tokens=tokens[:, 1], pos_slice=-1))
    same(diff, cache.logit_attrs(last, tokens[:, 0], pos_slice=-1)
         - cache.logit_attrs(last, tokens[:, 1], pos_slice=-1))
    same(cache.logit_attrs(last, 7, pos_slice=-1, batch_slice=1),
         expected_folded.logit_attrs(expected_folded.decompose_resid(pos_slice=-1), 7, pos_slice=-1, batch_slice=1))


def test_logit_attrs_take_a_one_token_string_and_a_cache_without_its_batch_dim(ins, cached):
    """A string is its one token; a prompt's cache without its batch dimension (the model carried over)
    attributes as its row of the batch's does."""
    _, cache = cached
    n = int(cache.attention_mask[1].sum())
    stack = cache.decompose_resid()
    assert ins.to_single_token("def") == 446  # the tiny tokenizer's
    assert torch.equal(cache.logit_attrs(stack, "def"), cache.logit_attrs(stack, 446))
    with pytest.raises(ValueError, match="'import' is 3 tokens, not one"):
        cache.logit_attrs(stack, "import")
    following = ins.to_tokens(PROMPTS[1])[0, 1:]
    _, one = ins.run_with_cache(PROMPTS[1], remove_batch_dim=True)
    attrs = one.logit_attrs(one.decompose_resid(pos_slice=(0, -1)), following, pos_slice=(0, -1), has_batch_dim=False)
    batched = cache.logit_attrs(cache.decompose_resid(pos_slice=(0, n - 1)), following, pos_slice=(0, n - 1),
                                batch_slice=1)
    assert attrs.shape == batched.shape == (len(stack), n - 1)
    np.testing.assert_allclose(attrs.numpy(), batched.numpy(), rtol=1e-5, atol=1e-6)


def test_the_blocks_norms_and_a_cache_without_its_model_are_refused_clearly(cached):
    from inspector.notebook.cache import ActivationCache

    _, cache = cached
    stack = cache.decompose_resid()
    with pytest.raises(ValueError, match="only the final norm's scale is known .* not that of block 1's norm"):
        cache.apply_ln_to_stack(stack, layer=1)
    with pytest.raises(ValueError, match="only the final norm's scale is known"):
        cache.decompose_resid(1, apply_ln=True)
    bare = ActivationCache(dict(cache.items()), cache.attention_mask, cache.n_layers)
    assert "ln_final.hook_scale" in cache and "ln_final.hook_scale" not in bare
    assert "ln_final.hook_scale" not in cache.keys()  # derived, not captured: a saved cache leaves it out
    for call in (lambda: bare.logit_attrs(stack, 5), lambda: bare.apply_ln_to_stack(stack)):
        with pytest.raises(ValueError, match="this cache holds no model"):
            call()


def test_edits_in_a_hooks_block_apply_to_its_runs_only(ins, cached):
    """Compiled: a steering vector added at every row, a scale of zero, a row patched at one position;
    out of the block the runs are plain again."""
    _, plain = cached
    push, row = torch.linspace(-1, 1, 128), torch.full((128,), 0.5)
    with ins.hooks(steer={"blocks.0.hook_resid_post": push}, scale={"blocks.1.hook_mlp_out": 0.0},
                   patch={"blocks.1.hook_resid_post": (2, row)}):
        _, edited = ins.run_with_cache(PROMPTS, names_filter="blocks.*", return_type=None)
    mask = plain.attention_mask.bool()
    np.testing.assert_allclose(edited["resid_post", 0][mask].numpy(), (plain["resid_post", 0][mask] + push).numpy(),
                               atol=1e-5)
    assert not edited["mlp_out", 1].any()
    np.testing.assert_allclose(edited["resid_post", 1][:, 2].numpy(), row.expand(2, 128).numpy(), atol=1e-6)
    _, again = ins.run_with_cache(PROMPTS, names_filter="blocks.*", return_type=None)
    assert torch.equal(again["resid_post", 1], plain["resid_post", 1]) and not ins.session.interventions
    with pytest.raises(ValueError, match="did you mean blocks.0.hook_resid_post"):
        with ins.hooks(steer={"blocks.0.hook_resid_pots": push}):
            pass


def test_a_hook_function_on_the_compiled_engine_is_refused_naming_the_compiled_edits(ins):
    with pytest.raises(ValueError, match=r"eager engine \(mode='eager'\).*steer=, scale=, patch="):
        ins.run_with_hooks(PROMPTS[0], fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x)])
    logits, _ = ins.run_with_cache(PROMPTS[0], names_filter=[])  # nothing left in force
    assert torch.equal(logits, ins.run_with_hooks(PROMPTS[0]))


def test_the_pattern_of_a_padded_prompt_covers_its_tokens_only(cached):
    _, cache = cached
    n = int(cache.attention_mask[1].sum())
    pattern = cache["blocks.1.attn.hook_pattern"]
    assert "blocks.1.attn.hook_pattern" in cache and pattern.shape[:2] == (2, 2)
    np.testing.assert_allclose(pattern[1, :, :n, :n].sum(-1).numpy(), 1.0, rtol=1e-5)
    assert not pattern[1, :, n:].any() and not pattern[1, :, :, n:].any()
    assert torch.equal(pattern[1, :, :n, :n].triu(1), torch.zeros(2, n, n))  # causal


@pytest.mark.parametrize("normalize", ["none", "constant_norm_rescale"])
def test_a_saelens_sae_encodes_a_cache_entry_directly(cached, tmp_path, normalize):
    """SAELens's own SAE, loaded from disk, takes ``cache[hook]`` as it is ([batch, pos, d_model]), and its
    features are those of the same rows one by one (its input normalisation its own)."""
    sae_lens = pytest.importorskip("sae_lens")
    from sae_files import write_sae

    _, cache = cached
    directory = write_sae(tmp_path / "sae", "standard", 128, 32, "blocks.1.hook_resid_post", normalize=normalize)
    sae = sae_lens.SAE.load_from_disk(str(directory), device="cpu")
    with torch.no_grad():
        features = sae.encode(cache["blocks.1.hook_resid_post"])
        rows = sae.encode(cache["blocks.1.hook_resid_post"].reshape(-1, 128))
    assert features.shape == (*cache["resid_post", 1].shape[:2], 32) and features.any()
    np.testing.assert_allclose(features.reshape(-1, 32).numpy(), rows.numpy(), atol=1e-5)


def test_the_cache_draws_itself_in_the_apps_colours(ins, cached):
    """A cache entry, a pattern, a twin comparison and the logit lens display themselves in Jupyter
    (``_repr_html_`` with the prompt's tokens, ``_repr_png_``); the lens is the engine's own."""
    _, cache = cached
    n = int(cache.attention_mask[1].sum())
    entry = cache.show("blocks.1.hook_resid_post", prompt=1)
    first = html.escape(display_token(ins.to_str_tokens(PROMPTS[1])[0]))
    assert entry._repr_png_().startswith(b"\x89PNG") and first in entry._repr_html_()
    assert cache.show(("q", 0)).panels and cache.show_pattern(1, prompt=1)._repr_png_().startswith(b"\x89PNG")
    with ins.hooks(steer={"blocks.0.hook_resid_post": torch.ones(128)}):
        _, steered = ins.run_with_cache(PROMPTS)
    twin = cache.compare(steered, ("resid_post", 1), prompt=1)
    assert twin.relative_change.shape == (n,) and (twin.relative_change > 0).all()
    lens = cache.logit_lens(prompt=1)
    top = ins.session.lens(cache["resid_post", 1][1, :n].numpy(), k=1)
    assert ins.session.token_texts(top.top_ids[:, 0])[0] in lens._repr_html_()


# --- capture files of the engine's runs (files.py) ---

@pytest.mark.slow
def test_run_with_cache_saved_and_loaded_is_the_same_cache(ins, tmp_path):
    _, cache = ins.run_with_cache(PROMPTS)
    tokens = ins.to_tokens(PROMPTS)
    path = ins.save(cache, tmp_path / "prefill.h5", tokens=tokens)
    run = read_run(path)
    assert set(run.hooks) == set(ins.points) and run.metadata["model_path"] == ins.session.run.metadata["model_path"]
    text, loaded_tokens, loaded = load(path)
    assert text == ["", ""] and torch.equal(loaded_tokens, tokens)
    assert_same_cache(loaded, cache)


@pytest.mark.slow
def test_a_generation_saved_reads_back_with_its_token_texts(ins, tmp_path):
    generated = ins.generate_with_cache(PROMPTS, max_new_tokens=4)
    path = ins.save(generated, tmp_path / "generated.h5")
    for i, request in enumerate(read_run(path).requests.values()):
        assert request.prompt_token_ids == ins.to_tokens(PROMPTS[i])[0].tolist()
        assert request.token_ids == generated.tokens[i, :len(request.token_ids)].tolist()
        assert request.token_texts == ins.session.token_texts(request.token_ids)
        assert "".join(request.token_texts[len(request.prompt_token_ids):]) == generated.text[i]
    text, tokens, cache = load(path)
    assert text == generated.text and torch.equal(tokens, generated.tokens)
    assert_same_cache(cache, generated.cache)


@pytest.mark.slow
def test_the_engines_own_capture_loads_as_generate_with_cache_caches_it(ins, tmp_path):
    from inspector.core.protocol import Sampling

    ins.session.new_run()
    for _ in ins.session.generate(PROMPTS, Sampling(max_tokens=4, logprobs=0)):
        pass
    path = write_run(ins.session.run, tmp_path / "captured.h5")
    generated = ins.generate_with_cache(PROMPTS, max_new_tokens=4)
    text, tokens, cache = load(path)
    assert text == generated.text and torch.equal(tokens, generated.tokens)
    assert_same_cache(cache, generated.cache)
