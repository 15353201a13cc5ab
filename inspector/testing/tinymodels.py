"""Small Hugging Face model directories built offline, in seconds.

Tests need real weights (vLLM's ``load_format="dummy"`` gives degenerate activations) and a real
tokenizer, but model hubs are out of reach. So: a byte-level BPE tokenizer trained on the Python
standard library's own sources, and seeded random weights saved with transformers. Built models are
cached on disk under a key of everything that shapes them, so a test run builds each at most once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from inspector.core.resources import cache_root

ARCHITECTURES = ("llama", "qwen2", "gpt2", "mistral", "gemma2", "qwen3", "phi3", "gptj", "opt", "qwen3_moe", "gemma3",
                 "gpt_neox", "olmo2", "phi", "mixtral", "olmoe", "qwen2_moe", "gemma", "stablelm",
                 "granite", "cohere", "bloom", "olmo", "gpt_bigcode", "gpt_oss", "glm4_moe")
# Shapes an architecture is built with unless asked otherwise: Gemma 2's grouped-query attention; Glm4-MoE's
# dense block and two expert blocks after it.
ARCH_DEFAULTS = {"gemma2": {"kv_heads": 1}, "gemma3": {"kv_heads": 1}, "glm4_moe": {"layers": 3}}
# Mistral's and Gemma 2's weights are drawn wider (std 0.15, not 0.02): their attention is then peaked,
# so a pattern recomputed with a wrong scale, window or soft cap is visibly wrong.
PEAKED_ATTENTION = {"mistral": 0.15, "gemma2": 0.15, "gemma3": 0.15}
RECIPE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]  # this file: an edit rebuilds the models


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. Head size = hidden / heads must be one the CPU attention accepts (64)."""

    arch: str = "llama"
    hidden: int = 128
    layers: int = 2
    heads: int = 2
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 512
    max_positions: int = 1024
    seed: int = 0

    def cache_key(self) -> str:
        blob = json.dumps({**asdict(self), "recipe": RECIPE, "python": sys.version_info[:2]}, sort_keys=True)
        return f"{self.arch}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def stdlib_corpus(max_bytes: int = 2_000_000) -> list[str]:
    """Text every Python installation has: its standard library's top-level modules, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int, texts: list[str]):
    """A byte-level BPE tokenizer (GPT-2 style) wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def hf_config(spec: TinySpec, tokenizer):
    import transformers

    eos = tokenizer.eos_token_id
    common = dict(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, torch_dtype="float32")
    if spec.arch == "gpt2":
        return transformers.GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                       n_inner=spec.intermediate, n_positions=spec.max_positions,
                                       activation_function="gelu_new", **common)
    if spec.arch == "bloom":  # ALiBi position biases (no rotary), which the recomputed pattern must include
        return transformers.BloomConfig(hidden_size=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                        initializer_range=0.15, **common)  # drawn wide: its outputs then react
    if spec.arch == "gpt_bigcode":  # multi-query attention; vLLM serves it through its Transformers backend
        return transformers.GPTBigCodeConfig(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                             n_inner=spec.intermediate, n_positions=spec.max_positions, multi_query=True,
                                             **common)
    if spec.arch == "gpt_neox":  # parallel residual (Pythia); vLLM serves it through its Transformers backend
        return transformers.GPTNeoXConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                          num_attention_heads=spec.heads, intermediate_size=spec.intermediate,
                                          max_position_embeddings=spec.max_positions, rotary_pct=0.25,
                                          use_parallel_residual=True, tie_word_embeddings=False, **common)
    if spec.arch == "phi":  # Phi-1.5/2: parallel attention and MLP from one norm, partial rotary; the Transformers backend
        return transformers.PhiConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers,
                                      num_attention_heads=spec.heads, intermediate_size=spec.intermediate,
                                      max_position_embeddings=spec.max_positions, hidden_act="gelu_new",
                                      tie_word_embeddings=False, **common)
    if spec.arch == "gptj":  # parallel attention and MLP, partial rotary
        return transformers.GPTJConfig(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                                       n_inner=spec.intermediate, n_positions=spec.max_positions, rotary_dim=32,
                                       activation_function="gelu_new", tie_word_embeddings=False, **common)
    if spec.arch == "opt":  # learned positions, pre-norm (do_layer_norm_before), fc1/fc2 without an MLP module
        return transformers.OPTConfig(hidden_size=spec.hidden, num_hidden_layers=spec.layers, ffn_dim=spec.intermediate,
                                      num_attention_heads=spec.heads, max_position_embeddings=spec.max_positions,
                                      word_embed_proj_dim=spec.hidden, do_layer_norm_before=True,
                                      pad_token_id=tokenizer.eos_token_id, **common)
    shape = dict(hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                 num_key_value_heads=spec.kv_heads, intermediate_size=spec.intermediate,
                 max_position_embeddings=spec.max_positions, **common)
    if spec.arch in PEAKED_ATTENTION:
        shape["initializer_range"] = PEAKED_ATTENTION[spec.arch]
    if spec.arch == "gemma2":  # tied embeddings, a query scale that is not 1/sqrt(head size), soft caps,
        # and sliding-window layers (every other one) alternating with global ones
        return transformers.Gemma2Config(head_dim=spec.hidden // spec.heads, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=3.0, final_logit_softcapping=8.0,
                                         sliding_window=6, hidden_activation="gelu_pytorch_tanh", **shape)
    if spec.arch == "gemma":  # its norms scale by (1 + weight)
        return transformers.GemmaConfig(head_dim=spec.hidden // spec.heads, hidden_activation="gelu_pytorch_tanh",
                                        **shape)
    if spec.arch == "stablelm":  # sequential, LayerNorms, partial rotary (its default 0.25)
        return transformers.StableLmConfig(hidden_act="silu", use_parallel_residual=False,
                                           tie_word_embeddings=False, **shape)
    if spec.arch == "granite":  # Llama's modules, but its branches and embeddings scaled: what the probe must catch
        return transformers.GraniteConfig(residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0,
                                          attention_multiplier=1 / 64, hidden_act="silu", tie_word_embeddings=False,
                                          **shape)
    if spec.arch == "qwen3":  # q/k norms
        return transformers.Qwen3Config(head_dim=spec.hidden // spec.heads, hidden_act="silu",
                                        tie_word_embeddings=False, **shape)
    if spec.arch == "phi3":  # fused qkv and gate/up projections
        return transformers.Phi3Config(hidden_act="silu", tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id,
                                       **shape)
    if spec.arch == "qwen3_moe":  # block 0 a dense MLP, the others 4 experts, 2 per token
        return transformers.Qwen3MoeConfig(head_dim=spec.hidden // spec.heads, moe_intermediate_size=64, num_experts=4,
                                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                                           norm_topk_prob=True, hidden_act="silu", tie_word_embeddings=False,
                                           **shape)
    if spec.arch == "mixtral":  # every block 4 experts, 2 per token (vLLM names the MoE block_sparse_moe)
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                          hidden_act="silu", tie_word_embeddings=False, **shape)
    if spec.arch == "olmoe":  # 4 experts, 2 per token, weights not renormalised; q/k norms
        return transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, hidden_act="silu",
                                        tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id, **shape)
    if spec.arch == "qwen2_moe":  # block 0 dense, then 4 experts (2 per token) beside a gated shared expert
        return transformers.Qwen2MoeConfig(moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4,
                                           num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                                           norm_topk_prob=False, hidden_act="silu", tie_word_embeddings=False,
                                           **shape)
    if spec.arch == "gemma3":  # Gemma 2's sandwich norms, plus q/k norms and local/global rope bases
        return transformers.Gemma3TextConfig(head_dim=spec.hidden // spec.heads, query_pre_attn_scalar=48,
                                             sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                             hidden_activation="gelu_pytorch_tanh", **shape)
    if spec.arch == "olmo2":  # post-norms on both branches, q/k norms; vLLM serves it through its Transformers backend
        return transformers.Olmo2Config(hidden_act="silu", tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id,
                                        **shape)
    if spec.arch == "cohere":  # one LayerNorm feeds parallel branches; a residual passed on and ignored; logit scale
        return transformers.CohereConfig(tie_word_embeddings=True, logit_scale=0.5, **shape)  # vLLM ties it always
    if spec.arch == "olmo":  # non-parametric LayerNorms; vLLM serves it through its Transformers backend
        return transformers.OlmoConfig(hidden_act="silu", tie_word_embeddings=False, pad_token_id=tokenizer.eos_token_id,
                                       **shape)
    if spec.arch == "gpt_oss":  # attention sinks, sliding windows every other layer, (hidden, positions, residual)
        # arguments, 4 experts (2 per token) chosen by a router named router
        return transformers.GptOssConfig(head_dim=spec.hidden // spec.heads, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                         tie_word_embeddings=False, **{**shape, "initializer_range": 0.15})
    if spec.arch == "glm4_moe":  # block 0 dense, then 4 experts (2 a token, sigmoid scores with a correction
        # bias, chosen by group) beside a shared expert; partial rotary
        return transformers.Glm4MoeConfig(head_dim=spec.hidden // spec.heads, n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=64, first_k_dense_replace=1, n_shared_experts=1,
                                          n_group=1, topk_group=1, partial_rotary_factor=0.5, tie_word_embeddings=False,
                                          **shape)
    if spec.arch == "mistral":
        return transformers.MistralConfig(sliding_window=8, hidden_act="silu", tie_word_embeddings=False, **shape)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[spec.arch]
    return cls(hidden_act="silu", tie_word_embeddings=False, **shape)


def build_tiny_model(spec: TinySpec, out_dir: Path, tokenizer=None) -> Path:
    """Write config, seeded random float32 weights and tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {spec.arch!r}; choose one of {ARCHITECTURES}")
    if spec.hidden // spec.heads not in (64, 128):
        raise ValueError(f"head size {spec.hidden // spec.heads} is not accepted by vLLM's CPU attention; use 64 or 128")
    tokenizer = tokenizer or train_tokenizer(spec.vocab, stdlib_corpus())
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec, tokenizer), torch_dtype=torch.float32)
    with torch.no_grad():  # norms' weights and biases, attention sinks off their defaults: none may pass as identity
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and ("norm" in name or "ln" in name or name.endswith(("bias", "sinks"))):
                parameter.add_(0.1 * torch.randn_like(parameter))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def tiny_model(arch: str = "llama", **overrides) -> Path:
    """Path of a cached tiny model of ``arch``, building it (atomically) on first use."""
    spec = replace(TinySpec(arch=arch), **{**ARCH_DEFAULTS.get(arch, {}), **overrides})
    return _cached(spec.cache_key(), lambda out: build_tiny_model(spec, out))


def tiny_vision_language_model() -> Path:
    """Path of a cached tiny Gemma 3 vision-language model: a SigLIP vision tower and its projector
    beside a language model that is the tiny Gemma 3 (its weights, so transformers' Gemma 3 is the
    reference for text prompts), with an image processor and Gemma 3's image tokens. vLLM's Gemma 3
    processor looks up newline tokens, which a byte-level tokenizer lacks: they are added too, beyond the
    language model's vocabulary like the image tokens, so text prompts here hold no newline."""
    return _cached(f"gemma3-vl-{TinySpec('gemma3', **ARCH_DEFAULTS['gemma3']).cache_key()}",
                   lambda out: _build_gemma3_vl(tiny_model("gemma3"), out))


def _build_gemma3_vl(language: Path, out_dir: Path) -> None:
    import torch
    import transformers

    tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(language, extra_special_tokens=tokens)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens.values())})
    tokenizer.add_tokens(["\n" * n for n in range(1, 5)])
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
    vision = transformers.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=1, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=transformers.AutoConfig.from_pretrained(language),
                                       vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
                                       eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"])
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).float()
    text = transformers.AutoModelForCausalLM.from_pretrained(language, dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    _publish_vision_tower_names(Path(out_dir))
    images = transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=4,
                                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}").save_pretrained(out_dir)


def _publish_vision_tower_names(out_dir: Path) -> None:
    """Write the vision tower's weights under the names published Gemma 3 checkpoints use
    (``vision_tower.vision_model.*``): transformers saves them without ``vision_model``, which vLLM's
    loader does not map."""
    from safetensors.torch import load_file, save_file

    saved, published = "vision_tower.", "vision_tower.vision_model."
    for shard in out_dir.glob("*.safetensors"):
        tensors = load_file(shard)
        renamed = {(published + k[len(saved):] if k.startswith(saved) and not k.startswith(published) else k): v
                   for k, v in tensors.items()}
        if renamed.keys() != tensors.keys():
            save_file(renamed, shard, metadata={"format": "pt"})


def _cached(key: str, build) -> Path:
    """``cache_root()/tiny-models/key``, written by ``build(directory)`` (atomically) on first use."""
    final = cache_root() / "tiny-models" / key
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=final.parent))
    try:
        build(staging)
        try:
            staging.rename(final)
        except OSError:  # a concurrent build won the race; its result is identical
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
