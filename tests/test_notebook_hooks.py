"""TransformerLens hook functions in the notebook API: ``run_with_hooks`` and ``hooks(fwd_hooks=...)`` on
the eager tiny Llama (one engine for the module, chunked prefill at 32 tokens a forward so that a long
prompt comes in pieces) against transformers with the same edit; errors from a function, a closed
engine, backward hooks. The compiled engine's refusal is in test_notebook.py."""

import numpy as np
import pytest
import torch

import hf_reference
from engines import PARITY_TOL, rel_l2

PROMPT = "def fibonacci(n):\n    if n < 2:"
LONG = " ".join(f"x{i} = {i} * y" for i in range(9))  # several forwards' worth at 32 tokens a forward
CHUNK = 32


@pytest.fixture(scope="module")
def eager(tiny_models):
    from inspector import Inspector

    inspector = Inspector(str(tiny_models["llama"]), mode="eager", max_model_len=256, max_num_batched_tokens=CHUNK)
    yield inspector
    inspector.close()


def edited_logits(model_dir, token_ids, layer: int, kind: str, edit) -> np.ndarray:
    """transformers' logits with ``edit`` on block ``layer``'s ``kind`` ([1, tokens, width] in, the
    replacement out), a forward hook on the module that gives it."""
    model = hf_reference.load(str(model_dir))
    handle = hf_reference._hook(*hf_reference._site(hf_reference._blocks(model)[layer], "llama", kind), edit)
    try:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].numpy()
    finally:
        handle.remove()


def test_a_function_ablating_a_head_in_place_is_transformers_with_that_head_zeroed(eager, tiny_models):
    ids = eager.to_tokens(PROMPT)[0].tolist()
    shapes = []

    def ablate(z, hook):
        shapes.append((tuple(z.shape), hook.name, hook.layer()))
        z[:, 1] = 0.0

    logits = eager.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.attn.hook_z", ablate)])
    head = eager.geometries[0].head_size
    expected = edited_logits(tiny_models["llama"], ids, 0, "z",
                             lambda x: torch.cat([x[..., :head], torch.zeros_like(x[..., head:2 * head]),
                                                  x[..., 2 * head:]], -1))
    assert rel_l2(logits[0].numpy(), expected).max() < PARITY_TOL
    assert shapes == [((len(ids), eager.geometries[0].heads, head), "blocks.0.attn.hook_z", 0)]
    plain, _ = eager.run_with_cache(PROMPT)
    assert rel_l2(plain[0].numpy(), expected).max() > 1e-3  # the ablation changed the logits; it is over


def test_a_returned_steering_edit_equals_transformers_and_the_steer_edit(eager, tiny_models):
    ids = eager.to_tokens(PROMPT)[0].tolist()
    vector = torch.from_numpy(np.random.default_rng(0).standard_normal(128).astype(np.float32))
    logits = eager.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x + vector)])
    expected = hf_reference.steered(tiny_models["llama"], ids, 0, vector.numpy())["logits"]
    assert rel_l2(logits[0].numpy(), expected).max() < PARITY_TOL
    with eager.hooks(steer={"blocks.0.hook_resid_post": vector}):
        steered, cache = eager.run_with_cache(PROMPT, names_filter="blocks.0.hook_resid_post")
    assert rel_l2(steered[0].numpy(), logits[0].numpy()).max() < PARITY_TOL
    with eager.hooks(fwd_hooks=[(lambda name: name == "blocks.0.hook_resid_post", lambda x, hook: x + vector)]):
        _, by_function = eager.run_with_cache(PROMPT, names_filter="blocks.0.hook_resid_post")
    np.testing.assert_allclose(by_function["resid_post", 0].numpy(), cache["resid_post", 0].numpy(), atol=1e-5)


def test_each_prompt_comes_as_its_own_rows_in_chunks_with_its_positions(eager, tiny_models):
    calls = []

    def record(x, hook):
        calls.append((hook.request, hook.positions.clone(), x.clone()))

    prompts = [LONG, PROMPT]
    _, cache = eager.run_with_cache(prompts, names_filter="blocks.1.hook_resid_pre")
    eager.run_with_hooks(prompts, fwd_hooks=[("blocks.1.hook_resid_pre", record)])
    lengths = cache.attention_mask.sum(1).tolist()
    assert lengths[0] > 2 * CHUNK
    for request, n in enumerate(lengths):
        pieces = [(p, x) for r, p, x in calls if r == request]
        assert all(len(p) <= CHUNK for p, _ in pieces) and len(pieces) >= -(-n // CHUNK)
        positions = torch.cat([p for p, _ in pieces])
        assert torch.equal(positions, torch.arange(n))  # in order, each once
        rows = torch.cat([x for _, x in pieces])
        np.testing.assert_allclose(rows.numpy(), cache["resid_pre", 1][request, :n].numpy(), atol=1e-5)


def test_a_long_prompt_edited_in_pieces_is_transformers_edited_whole(eager, tiny_models):
    ids = eager.to_tokens(LONG)[0].tolist()

    def keep_first_half(x, hook):  # mlp_post [pos, d_mlp]: the second half of the neurons silenced
        x[:, x.shape[1] // 2:] = 0.0

    logits = eager.run_with_hooks(LONG, fwd_hooks=[("blocks.1.mlp.hook_post", keep_first_half)])
    expected = edited_logits(tiny_models["llama"], ids, 1, "mlp_post",
                             lambda x: torch.cat([x[..., :x.shape[-1] // 2], torch.zeros_like(x[..., x.shape[-1] // 2:])], -1))
    assert rel_l2(logits[0].numpy(), expected).max() < PARITY_TOL


def test_a_failing_or_misshapen_function_is_one_clear_error_and_the_engine_goes_on(eager):
    with pytest.raises(ValueError, match=r"returned \(3,\); it was given \(\d+, 128\)"):
        eager.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_post", lambda x, hook: x[0, :3])])

    def broken(x, hook):
        raise KeyError("the user's own bug")

    with pytest.raises(KeyError, match="the user's own bug"):
        eager.run_with_hooks(PROMPT, fwd_hooks=[("hook_embed", broken)])
    with pytest.raises(ValueError, match="did you mean"):
        eager.run_with_hooks(PROMPT, fwd_hooks=[("blocks.0.hook_resid_pots", broken)])
    with pytest.raises(ValueError, match="without gradients.*patching sweep"):
        eager.run_with_hooks(PROMPT, bwd_hooks=[("blocks.0.hook_resid_post", broken)])
    with pytest.raises(ValueError, match="has 300 tokens; the engine takes 1 to 255"):
        eager.run_with_cache([[1] * 300])
    logits, _ = eager.run_with_cache(PROMPT, names_filter=[])
    again = eager.run_with_hooks(PROMPT)
    assert torch.equal(logits, again)  # nothing left behind by the failures


def test_generation_runs_the_functions_on_every_forward(eager):
    seen = []
    steered = eager.generate_with_cache(PROMPT, max_new_tokens=4, names_filter=[])
    with eager.hooks(fwd_hooks=[("blocks.1.hook_resid_post", lambda x, hook: seen.append(hook.positions.tolist()))]):
        watched = eager.generate_with_cache(PROMPT, max_new_tokens=4, names_filter=[])
    n = len(eager.to_tokens(PROMPT)[0])
    assert watched.text == steered.text and [p for p in seen if len(p) == 1] == [[n], [n + 1], [n + 2]]


def test_a_closed_inspector_says_so(tiny_models, eager):
    eager.close()
    eager.close()  # twice is fine
    with pytest.raises(RuntimeError, match="this Inspector is closed"):
        eager.run_with_cache(PROMPT)
