"""``Inspector.connect(url)``: the notebook API driving a running server (the tests' shared compiled server
on the tiny Llama, capturing ``blocks.*.hook_resid_post`` and ``hook_embed``) against transformers: its
prefill's rows, the model's logits of them, generation, edits, and what happens around the connection."""

import numpy as np
import pytest
import torch

import hf_reference
from engines import PARITY_TOL, assert_greedy_generation_caches_as_a_prefill, rel_l2
from inspector.core.protocol import Sampling, SessionError
from inspector.client import connect

PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os"]
H1 = "model.layers.1.resid_post"  # the engine's name of blocks.1.hook_resid_post


@pytest.fixture(scope="module")
def ins(compiled_server):
    from inspector import Inspector

    with Inspector.connect(compiled_server[0]) as inspector:
        yield inspector


@pytest.fixture(scope="module")
def cached(ins):
    return ins.run_with_cache(PROMPTS, return_type=None)


def test_the_cache_and_the_logits_of_its_rows_are_transformers_own(ins, cached, tiny_models):
    """The server's final norm is not captured, so the logits come from the last block's rows through
    the final norm (its kind asked of the server, its weight transformers') and the server's unembedding."""
    from transformers import AutoTokenizer

    model = tiny_models["llama"]
    _, cache = cached
    lengths = cache.attention_mask.sum(1).tolist()
    assert set(cache) == {"hook_embed", "blocks.0.hook_resid_post", "blocks.1.hook_resid_post"}
    weight = hf_reference.load(str(model)).model.norm.weight.detach()
    normed = cache.apply_ln_to_stack(cache["resid_post", 1][None])[0] * weight
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    for i, prompt in enumerate(PROMPTS):
        ids = ins.to_tokens(prompt)[0, :lengths[i]].tolist()
        assert ids == tokenizer(prompt).input_ids  # with the BOS the engine adds to a prompt
        expected = hf_reference.run(model, ids)
        assert rel_l2(cache["hook_embed"][i, :len(ids)].numpy(), expected["embed_resid"]).max() < PARITY_TOL
        for layer in range(2):
            got = cache["resid_post", layer][i, :len(ids)].numpy()
            assert rel_l2(got, expected["resid_post"][layer]).max() < PARITY_TOL
        assert not cache["resid_post", 1][i, len(ids):].any()  # the padding
        logits = ins.session.logits(normed[i, :len(ids)].numpy())
        assert logits.shape == (len(ids), 512) and rel_l2(logits, expected["logits"]).max() < PARITY_TOL
    assert ins.to_string(ins.to_tokens(PROMPTS[1])[0]) == PROMPTS[1]
    assert len(ins.to_str_tokens(PROMPTS[1])) == lengths[1]
    with pytest.raises(ValueError, match="include ln_final.hook_normalized in hooks"):
        ins.run_with_cache(PROMPTS)
    with pytest.raises(ValueError, match="has 400 tokens; the engine takes 1 to 255"):
        ins.run_with_cache([[5] * 400], return_type=None)


def test_generate_with_cache_is_transformers_greedy_continuation_and_caches_as_a_prefill(ins, tiny_models):
    from transformers import AutoConfig

    generated = ins.generate_with_cache(PROMPTS, max_new_tokens=5, ignore_eos=True)
    assert_greedy_generation_caches_as_a_prefill(ins, tiny_models["llama"], PROMPTS, generated, 5)
    greedy = ins.generate(PROMPTS, max_new_tokens=5, do_sample=False, stop_at_eos=False)
    assert greedy == [prompt + text for prompt, text in zip(PROMPTS, generated.text)]  # TransformerLens's generate
    hf = AutoConfig.from_pretrained(tiny_models["llama"])  # the server's model's config, read there
    assert (ins.cfg.n_layers, ins.cfg.d_model, ins.cfg.d_head, ins.cfg.d_vocab) == (
        hf.num_hidden_layers, hf.hidden_size, hf.hidden_size // hf.num_attention_heads, hf.vocab_size)


def test_a_steering_vector_in_a_hooks_block_is_transformers_steering_and_ends_with_it(ins, cached, tiny_models):
    _, plain = cached
    push = torch.linspace(-1, 1, 128)
    with ins.hooks(steer={"blocks.0.hook_resid_post": push}):
        _, steered = ins.run_with_cache(PROMPTS, return_type=None)
    mask = plain.attention_mask.bool()
    np.testing.assert_allclose(steered["resid_post", 0][mask].numpy(), (plain["resid_post", 0][mask] + push).numpy(),
                               atol=1e-5)
    n = int(mask[0].sum())
    expected = hf_reference.steered(tiny_models["llama"], ins.to_tokens(PROMPTS[0])[0, :n].tolist(), 0, push.numpy())
    assert rel_l2(steered["resid_post", 1][0, :n].numpy(), expected["resid_post"][1]).max() < PARITY_TOL
    _, again = ins.run_with_cache(PROMPTS, return_type=None)
    assert torch.equal(again["resid_post", 1], plain["resid_post", 1]) and not ins.session.interventions


def test_a_prefill_is_refused_while_requests_generate_and_a_generation_waits_for_a_prefill(ins, compiled_server):
    with connect(compiled_server[0]) as other:
        events = other.generate(["import os"], Sampling(max_tokens=200, ignore_eos=True))
        next(events)  # its request is open on the server now
        with pytest.raises(ValueError, match="a prefill needs the engine to itself"):
            ins.run_with_cache(PROMPTS, return_type=None)
        other.stop()
        list(events)

        early = ins.session.prefill([[5, 6, 7]] * 8)
        next(early)
        early.close()  # the rest of it is stopped on the server
        contexts = [[int(t) for t in np.random.default_rng(k).integers(3, 500, 120)] for k in range(48)]
        prefilled = ins.session.prefill(contexts)
        first = next(prefilled)  # the prefill runs on the server: the generation below waits for its end
        other.new_run()
        list(other.generate(["import os"], Sampling(max_tokens=6)))
        (clean,) = other.run.requests.values()
        done = [first, *prefilled]
    assert sorted(d.index for d in done) == list(range(48))
    for d in done:
        positions = np.concatenate([part[H1]["positions"] for part in d.parts])
        assert d.tokens == 120 and positions.tolist() == list(range(120))
    _, solo = ins.run_with_cache([clean.token_ids[:-1]], return_type=None)
    assert rel_l2(clean.hooks[H1].values, solo["resid_post", 1][0].numpy()).max() < PARITY_TOL


def test_a_bad_url_is_one_clear_error_and_closing_leaves_the_server_serving(compiled_server):
    from inspector import Inspector

    with pytest.raises(SessionError, match="a server's address is tcp://HOST:PORT or ipc://PATH"):
        Inspector.connect("localhost:5557")
    with pytest.raises(SessionError, match="no answer from ipc://.* no server is listening there"):
        Inspector.connect("ipc:///nonexistent/inspector/engine.sock")
    url, process = compiled_server
    ins = Inspector.connect(url)
    ins.close()
    ins.close()
    with pytest.raises(RuntimeError, match="this Inspector is closed"):
        ins.run_with_cache(PROMPTS[0], return_type=None)
    with Inspector.connect(url) as again:
        _, cache = again.run_with_cache(PROMPTS[0], return_type=None)
        assert cache["resid_post", 1].shape[1] == len(again.to_str_tokens(PROMPTS[0]))
    assert process.poll() is None
