"""Tiny offline models: reproducible, loadable by transformers, shaped for vLLM's CPU attention."""

import json

import pytest
from safetensors.numpy import load_file

from inspector.testing.tinymodels import TinySpec, build_tiny_model, tiny_model, train_tokenizer, stdlib_corpus


def test_all_architectures_build_with_head_size_64(tiny_models):
    from transformers import AutoConfig, AutoTokenizer

    for arch, path in tiny_models.items():
        config = AutoConfig.from_pretrained(path)
        assert config.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        assert hidden // heads == 64
        tok = AutoTokenizer.from_pretrained(path)
        text = "def main():\n    return 42"
        assert tok.decode(tok(text)["input_ids"]) == text


def test_builds_are_reproducible(tmp_path, tiny_models):
    tok = train_tokenizer(512, stdlib_corpus())
    a = build_tiny_model(TinySpec("qwen2"), tmp_path / "a", tokenizer=tok)
    b = build_tiny_model(TinySpec("qwen2"), tmp_path / "b", tokenizer=tok)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    assert json.loads((a / "tokenizer.json").read_text()) == json.loads(
        (tiny_models["qwen2"] / "tokenizer.json").read_text())


def test_cache_returns_the_same_directory(tiny_models):
    assert tiny_model("llama") == tiny_models["llama"]


def test_bad_specs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="head size 16"):
        build_tiny_model(TinySpec(hidden=32, heads=2), tmp_path)
    with pytest.raises(ValueError, match="unknown architecture"):
        build_tiny_model(TinySpec(arch="bert"), tmp_path)
