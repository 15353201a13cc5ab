"""The shipped demo model: small, Llama with head size 64, loads offline, and is better than a unigram model."""

from __future__ import annotations

import json
import re
import struct

import pytest

from inspector.core.resources import demo_model_path
from tools.demo_model import EVAL_PROMPTS, greedy_completion

MAX_WEIGHT_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir():
    path = demo_model_path()
    assert (path / "config.json").is_file(), f"no demo model at {path}"
    return path


@pytest.fixture(scope="module")
def recorded(model_dir):
    return json.loads((model_dir / "eval.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def offline(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_weights_are_small_float32_safetensors(model_dir):
    weights = list(model_dir.glob("*.safetensors"))
    assert [w.name for w in weights] == ["model.safetensors"]
    assert weights[0].stat().st_size < MAX_WEIGHT_BYTES
    with open(weights[0], "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {"F32"}


def test_config_is_llama_with_head_size_64(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert config.get("head_dim", 64) == 64
    assert config["hidden_act"] == "silu"
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation.get("do_sample", False) is False


def test_tokenizer_loads_offline(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = "def main(argv=None):\n    return 0\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"] and tok.eos_token_id == config["eos_token_id"]


def _recorded_number(text: str, label: str) -> float:
    match = re.search(rf"^{re.escape(label)}: ([0-9]+\.[0-9]+)$", text, re.M)
    assert match, f"no '{label}: N' line in EVAL.md"
    return float(match.group(1))


def test_recorded_heldout_loss_beats_unigram(model_dir, recorded):
    text = (model_dir / "EVAL.md").read_text()
    model_loss = _recorded_number(text, "Held-out loss")
    unigram = _recorded_number(text, "Unigram baseline loss")
    assert model_loss < unigram
    assert model_loss == pytest.approx(recorded["heldout_loss"], abs=1e-4)
    assert unigram == pytest.approx(recorded["unigram_loss"], abs=1e-4)
    assert [c["prompt"] for c in recorded["completions"]] == list(EVAL_PROMPTS)
    for c in recorded["completions"]:
        assert f"```python\n{c['prompt'] + c['text']}\n```" in text


def test_greedy_completion_of_def_is_the_recorded_one(model_dir, recorded):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = next(c for c in recorded["completions"] if c["prompt"] == "def ")
    ids = greedy_completion(model, tok, "def ")
    assert ids == expected["ids"]
    assert tok.decode(ids) == expected["text"]


@pytest.mark.slow
def test_vllm_boots_the_demo_model_and_agrees(model_dir, recorded):
    """vLLM (CPU, compiled) loads the shipped directory as is and greedily writes what transformers wrote."""
    import time

    from inspector.engine.environment import prepare_environment

    prepare_environment()
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    boot_seconds = time.perf_counter() - started
    try:
        prompts = [c["prompt"] for c in recorded["completions"]]
        params = [SamplingParams(temperature=0.0, max_tokens=len(c["ids"])) for c in recorded["completions"]]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out, c in zip(outputs, recorded["completions"]):
            assert list(out.outputs[0].token_ids) == c["ids"], c["prompt"]
        assert boot_seconds < 300, f"boot took {boot_seconds:.0f} s"
    finally:
        from inspector.engine.boot import shutdown_llm
        shutdown_llm(llm)
