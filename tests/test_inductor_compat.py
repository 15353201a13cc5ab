"""A compiled engine computes what its model computes wherever a hook sits (inspector/plugin/inductor_compat.py).

Inductor's CPU backend, fusing two loops of different shapes, dropped the order of a read after an
in-place write; vLLM's CPU linear layers write their output in place into ``torch.empty``. With one hook
on the output of a Glm4-MoE's expert block, the next block's router read its logits before the matmul
wrote them: prompt logprobs off by 2e-2, or NaN."""

import os

import numpy as np
import pytest
import torch

import hf_reference
from engines import booted
from inspector import plugin
from inspector.plugin import config as plugin_config, inductor_compat

PROMPT_IDS = [84, 280, 284, 275, 310, 275, 433, 478, 20, 91, 102, 17, 255, 3, 64, 300, 12, 99, 5, 140]


def test_a_hook_after_an_expert_block_leaves_the_compiled_engine_computing_what_the_model_does(tiny_models):
    from vllm import SamplingParams

    model = tiny_models["glm4_moe"]  # block 0 dense, blocks 1 and 2 experts
    with booted(model, mode="compiled", hook_patterns=("blocks.2.hook_resid_pre",)) as llm:
        answer = llm.generate([{"prompt_token_ids": PROMPT_IDS}],
                              SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    got = np.array([next(iter(d.values())).logprob for d in answer.prompt_logprobs[1:]])
    want = torch.log_softmax(torch.from_numpy(hf_reference.logits(model, PROMPT_IDS)), -1).numpy()
    want = want[np.arange(len(PROMPT_IDS) - 1), PROMPT_IDS[1:]]
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("named, kept", [(None, False), ("torch's default", False), ("/data/inductor", True)])
def test_mended_code_is_cached_apart_from_code_compiled_before_the_mend(monkeypatch, named, kept):
    """vLLM's compile cache (when on) is keyed by the mend with the hooks; Inductor's own cache directory,
    keyed by torch's sources only, gets one of its own unless the user named one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = default_cache_dir() if named == "torch's default" else named
    if given is None:
        monkeypatch.delenv(inductor_compat.CACHE_DIR_VAR, raising=False)
    else:
        monkeypatch.setenv(inductor_compat.CACHE_DIR_VAR, given)
    inductor_compat._cache_mended_graphs_apart()
    expected = given if kept else os.path.join(default_cache_dir(), inductor_compat.COMPILE_KEY)
    assert os.environ[inductor_compat.CACHE_DIR_VAR] == expected
    monkeypatch.setenv(plugin_config.ENV_VAR, "{}")
    assert plugin._compile_key() == "{}|" + inductor_compat.COMPILE_KEY
