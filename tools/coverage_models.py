"""The transformers side of the coverage table: which architectures, their tiny models, the reference.

The tiny-model rule (one rule for every architecture, so that no structural feature is lost):

1. Start from the defaults of transformers' config class of the architecture (its text config).
2. Shrink the widths: hidden 128; 2 attention heads of 64 (head_dim 64 where the config has one);
   key/value heads 2, or 1 where the defaults group or share them; intermediate sizes (dense, expert,
   shared expert) keep their default ratio to the hidden size, rounded to a multiple of 64 (at least
   64: vLLM's Falcon, for one, assumes 4 × hidden); 4 experts, min(default, 2) of them per token,
   shared experts kept (at most 1), expert groups 1; MLA with the latent vLLM's CPU MLA kernel
   requires (512 + 64 rope, its only size), query/key heads of 64 nope + 64 rope, value heads of 64,
   query rank 64; state-space and linear-attention heads of 64, state size 16; sliding windows,
   attention chunks and sparse top-k of 4 tokens (shorter than the test prompts); 1,024 positions;
   the offline tokenizer's vocabulary (token ids past it become its end-of-text id); sizes tied to
   the head size (partial rotary, query scalars) scaled with it. ``SHRINK`` is the whole list.
3. Layers: the types of the layers of that model at its default depth, read from a build on the meta
   device (each layer's module classes, parameter names and flags such as ``is_sliding``) and the
   config's per-layer lists (``layer_types``, ``mlp_layer_types``, ...). Keep an irregular start (a
   dense block before mixture-of-experts ones), two periods of the repeating part and an irregular
   end, the shortest such selection (at least 2 layers; all where nothing repeats). Per-layer lists
   are cut to the layers kept, layer-index lists renumbered, layer counts scaled. The built model's
   layer types are compared with the selection; a difference is noted in the table.
4. ``AutoModelForCausalLM.from_config`` in float32 with seed 0; then every norm weight, every bias,
   every parameter that is constant after initialisation (scales, gates, a state-space D) gets
   0.1·randn added and attention sinks randn, so that nothing passes as an identity. A model with
   DeepSeek-V3's router bias (``e_score_correction_bias``) gets ``topk_method: noaux_tc`` in its
   config, as DeepSeek-V3's own checkpoints have: transformers does not write it and vLLM reads it.

Models are cached under ``cache_root()/coverage-models``, keyed by the tiny config and this file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

RECIPE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
MAX_PARAMETERS = 30_000_000  # a tiny model larger than this means the rule missed a size field
HEAD = 64
# field -> its tiny value, or how to get it from the default (d) and the default text config (c)
SHRINK = {
    **dict.fromkeys(("hidden_size", "word_embed_proj_dim", "embedding_dim", "d_model"), 128),
    **dict.fromkeys(("num_attention_heads", "attention_heads", "decoder_attention_heads", "swa_num_attention_heads",
                     "index_n_heads", "linear_num_heads", "linear_num_key_heads", "n_mamba_heads"), 2),
    "linear_num_value_heads": lambda d, c: 2 * max(1, d // (vars(c).get("linear_num_key_heads") or d)),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "num_query_groups"),
                    lambda d, c: 2 if d is None or d >= (vars(c).get("num_attention_heads") or 0) else 1),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_head", "dim_head", "swa_head_dim", "kv_channels",
                     "mamba_d_head", "mamba_head_dim", "mamba_headdim", "linear_head_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "index_head_dim", "v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"),
                    HEAD),
    "qk_head_dim": 2 * HEAD, "kv_lora_rank": 512, "o_lora_rank": 64,  # CPU MLA decodes 512 + 64 rope only
    "q_lora_rank": lambda d, c: d and 64,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "dff", "dim_ff", "d_inner", "ffn_hidden_size",
                     "decoder_ffn_dim", "intermediate_size_mlp", "dense_intermediate_size", "moe_intermediate_size",
                     "expert_ffn_hidden_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                     "shared_intermediate_size"),
                    lambda d, c: d and max(64, round(d * 128 / _default_width(c) / 64) * 64)),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                    lambda d, c: d and (d if d < 4 else 4)),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k_experts"),
                    lambda d, c: d and min(d, 2)),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), lambda d, c: d and 1),
    **dict.fromkeys(("n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups", "mamba_ngroups"), 1),
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), lambda d, c: d if isinstance(d, str) else 8),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 4),  # expand 2 × hidden 128 / heads of 64
    "num_heads": lambda d, c: 4 if "state_size" in vars(c) else 2,  # Mamba-2's are state-space heads
    "mamba_d_ssm": 256, "lru_width": 128, "attention_hidden_size": lambda d, c: d and 256,
    **dict.fromkeys(("sliding_window", "sliding_window_size", "window_size", "attention_window_size",
                     "local_attention", "attention_chunk_size", "keep_window_size", "index_topk"),
                    lambda d, c: d and 4),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length"), 1024),
    **dict.fromkeys(("rotary_dim", "query_pre_attn_scalar"),
                    lambda d, c: d and max(8, d * HEAD // (vars(c).get("head_dim") or _default_head(c)))),
    **dict.fromkeys(("hidden_size_per_layer_input", "laurel_rank", "adapter_rank"), 16),
}
DERIVED_WHEN_UNSET = ("head_dim", "num_key_value_heads")  # None there: derived from other sizes
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")


def architectures() -> dict[str, str]:
    """Every architecture to tabulate -> "native" (vLLM's text-generation registry), "backend" (a
    decoder-only causal LM of transformers that vLLM serves through its Transformers backend) or why
    it is skipped."""
    from transformers.models.auto import modeling_auto as auto
    from vllm.model_executor.models.registry import (_TEXT_GENERATION_MODELS, _TRANSFORMERS_SUPPORTED_MODELS,
                                                     ModelRegistry)

    found = dict.fromkeys(_TEXT_GENERATION_MODELS, "native")
    for model_type, names in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for arch in [names] if isinstance(names, str) else names:
            if arch in found:
                continue
            if model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or \
                    model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
                found[arch] = "skipped: an encoder-decoder type (its causal-LM class is the decoder half)"
            elif model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
                found[arch] = "skipped: an encoder-only type (a masked-LM encoder run as a decoder)"
            elif arch in ModelRegistry.models and arch not in _TRANSFORMERS_SUPPORTED_MODELS:
                found[arch] = "skipped: vLLM registers it natively as a multimodal model"
            else:
                found[arch] = "backend"
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def config_class(arch: str):
    """transformers' config class of the model type whose causal-LM class is ``arch`` (a text-only
    config where several model types share the class), or None."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = [t for t, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
             if arch in ([names] if isinstance(names, str) else names) and t in CONFIG_MAPPING]
    classes = [CONFIG_MAPPING[t] for t in types]
    return min(classes, key=lambda c: bool(getattr(c, "sub_configs", None)), default=None)


def _default_width(config) -> int:
    return vars(config)[config.attribute_map.get("hidden_size", "hidden_size")]


def _default_head(config) -> int:
    return _default_width(config) // vars(config)[config.attribute_map.get("num_attention_heads", "num_attention_heads")]


def _text(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config, lists: tuple[str, ...]) -> list:
    """Each decoder layer's type: its modules' classes, parameter names and flags (built on the meta
    device, no memory), with its entries of the config's per-layer ``lists``."""
    import torch
    from transformers import AutoModelForCausalLM

    text = _text(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = decoder_layers(model, text.num_hidden_layers)
    return [(_layer_signature(block), tuple((k, str(getattr(text, k)[i])) for k in lists))
            for i, block in enumerate(blocks)]


def _per_layer_lists(config) -> dict:
    """The config's lists with an entry per layer (and patterns spelled as strings, one letter a layer)."""
    return {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and not _is_index_list(v)
            or isinstance(v, str) and "pattern" in k}


def _is_index_list(value) -> bool:
    """A list of layer indices (``moe_layers``, ``mlp_only_layers``), not an entry per layer."""
    return all(isinstance(i, int) and not isinstance(i, bool) for i in value) and list(value) == sorted(set(value))


def _layer_signature(block) -> tuple:
    """What makes a layer the kind it is, not its index or its sizes: module classes, parameter names,
    boolean and string flags, and which optional settings are unset."""
    parts = []
    for path, module in block.named_modules():
        flags = tuple(sorted((k, v if isinstance(v, (bool, str)) else v is None) for k, v in vars(module).items()
                             if not k.startswith("_") and (v is None or isinstance(v, (bool, str, int, float)))))
        parts.append((path, type(module).__name__, flags,
                      tuple(sorted(name for name, _ in module.named_parameters(recurse=False)))))
    return tuple(parts)


def decoder_layers(model, count: int):
    """transformers' decoder-layer list: of the module lists with ``count`` entries (else of all), the
    one holding the most parameters (not a list of experts or of per-layer norms)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise ValueError(f"no list of decoder layers in {type(model).__name__}")
    return max(lists, key=lambda m: (len(m) == count, sum(p.numel() for p in m.parameters())))


def kept_layers(types: list) -> list[int]:
    """The layers a tiny model keeps: an irregular start, two periods of the repeating part, an
    irregular end (the shortest such selection; all layers where nothing repeats)."""
    n, best = len(types), list(range(len(types)))
    for tail in range(n):
        end = n - tail
        for period in range(1, end // 2 + 1):
            start = max((i + 1 for i in range(end - period) if types[i] != types[i + period]), default=0)
            if end - start >= 2 * period and start + 2 * period + tail < len(best):
                best = list(range(start + 2 * period)) + list(range(end, n))
    return best


def tiny_config(arch: str, vocab: int, eos: int):
    """The tiny config of ``arch`` by the rule in this module's docstring, the names of its per-layer
    lists, and the layer types it was chosen to keep (``layer_types`` of it should equal them)."""
    default = config_class(arch)()
    text = _text(default)
    widths = _shrunk_widths(text, vocab, eos)
    wide = _text(_with(default, text, widths))  # tiny widths at the default depth: its layers' types
    values = vars(wide)  # not getattr: per-layer configs refuse a global read of a per-layer field
    count = wide.num_hidden_layers
    lists = tuple(sorted(k for k, v in _per_layer_lists(wide).items() if len(v) == count))
    types = layer_types(_with(default, text, widths), lists)
    kept = kept_layers(types)
    changes = dict(widths)
    for key in LAYER_COUNTS:
        name = wide.attribute_map.get(key, key)
        if isinstance(values.get(name), int):
            changes[name] = max(1, round(values[name] * len(kept) / len(types)))
    for name in lists:
        changes[name] = [values[name][i] for i in kept]
        changes[name] = "".join(changes[name]) if isinstance(values[name], str) else changes[name]
    for name, value in values.items():
        if isinstance(value, (list, tuple)) and value and _is_index_list(value) and max(value) < count:
            changes[name] = [kept.index(i) for i in value if i in kept]
    return _with(default, text, changes), lists, [types[i] for i in kept]


def _shrunk_widths(text, vocab: int, eos: int) -> dict:
    """Every size ``SHRINK`` knows, the vocabulary and the token ids past it."""
    values, changes = vars(text), {"vocab_size": vocab}
    for key, rule in SHRINK.items():
        name = text.attribute_map.get(key, key)
        if name in values and (values[name] is not None or key in DERIVED_WHEN_UNSET):
            shrink = rule if callable(rule) else lambda d, c, rule=rule: rule
            value = values[name]  # a list: one per layer
            changes[name] = [shrink(v, text) for v in value] if isinstance(value, list) else shrink(value, text)
    for name, value in values.items():
        if name.endswith("token_id") and isinstance(value, int) and value >= vocab:
            changes[name] = eos
        elif name.endswith("token_id") and isinstance(value, list):
            changes[name] = [eos if v >= vocab else v for v in value]
    return changes


def _with(default, text, changes: dict):
    """The config class's defaults with ``changes`` made (in its text config, where it is composite)."""
    tiny = type(text)(**changes)
    return tiny if text is default else type(default)(text_config=tiny.to_dict())


def tokenizer():
    """The offline tokenizer, trained once and cached."""
    from transformers import PreTrainedTokenizerFast

    from inspector.core.resources import cache_root
    from inspector.testing.tinymodels import stdlib_corpus, train_tokenizer

    where = cache_root() / "coverage-models" / "tokenizer-512"
    if not (where / "tokenizer.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=_mkdir(where.parent)))
        train_tokenizer(512, stdlib_corpus()).save_pretrained(staging)
        _publish(staging, where)
    return PreTrainedTokenizerFast.from_pretrained(where)


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _publish(staging: Path, final: Path) -> None:
    try:
        staging.rename(final)
    except OSError:  # a concurrent build won the race; its result is identical
        shutil.rmtree(staging, ignore_errors=True)


def build(arch: str) -> dict:
    """``arch``'s tiny model, built now unless cached: {"model_dir", "layers", "note"} (the note says
    where the tiny model's layer types differ from the default model's), or {"why"}."""
    import torch
    from transformers import AutoModelForCausalLM

    from inspector.core.resources import cache_root

    if config_class(arch) is None:
        return {"why": f"transformers cannot build it: transformers {_version()} has no causal-LM class named {arch}"}
    tok = tokenizer()
    stage = "its config class's defaults do not build"
    try:
        config, lists, types = tiny_config(arch, len(tok), tok.eos_token_id)
        stage = "the tiny config does not build"
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return {"why": f"transformers cannot build it small: the rule leaves {size / 1e6:.0f} M parameters"}
        kept = layer_types(config, lists)
        note = "" if kept == types else (f"its layer types {_type_string(kept, types)} are not those chosen from "
                                         f"the default model, {_type_string(types)}")
        key = hashlib.sha256((config.to_json_string() + RECIPE).encode()).hexdigest()[:12]
        final = cache_root() / "coverage-models" / f"{arch}-{key}"
        if not (final / "config.json").exists():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _perturb(model)
            staging = Path(tempfile.mkdtemp(prefix=".build-", dir=_mkdir(final.parent)))
            model.save_pretrained(staging)
            tok.save_pretrained(staging)
            if any(n.endswith("e_score_correction_bias") for n in model.state_dict()):
                _add_to_config(staging, topk_method="noaux_tc")  # as DeepSeek-V3's checkpoints; vLLM reads it
            _publish(staging, final)
    except Exception as e:  # noqa: BLE001 - any failure is the row's reason
        return {"why": f"transformers cannot build it: {stage}: {one_line(e)}"}
    return {"model_dir": str(final), "layers": len(kept), "note": note}


def _add_to_config(model_dir: Path, **fields) -> None:
    """Fields that transformers' config class does not write (its save drops unknown attributes)."""
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


def _type_string(types: list, known: list | None = None) -> str:
    """Layer types as letters (A, B, ... in order of appearance in ``known``; ? for one not in it)."""
    letters = {}
    for t in known or types:
        letters.setdefault(t, chr(ord("A") + len(letters)))
    return "".join(letters.get(t, "?") for t in types)


def _version() -> str:
    import transformers

    return transformers.__version__


def _perturb(model) -> None:
    import torch

    norms = {f"{path}.{name}".lstrip(".") for path, m in model.named_modules() if "norm" in type(m).__name__.lower()
             for name, _ in m.named_parameters(recurse=False)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "sink" in name:
                p.add_(torch.randn_like(p))
            elif name in norms or name.endswith("bias") or p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(0.1 * torch.randn_like(p))


def one_line(error: BaseException) -> str:
    """The root cause of an exception, type and first line (pydantic's first line only counts the
    errors: then the first error's)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = [line.strip() for line in str(error).strip().splitlines()] or [""]
    if "validation error" in text[0] and len(text) > 1:
        text = [f"{text[0]}: {text[1]}"]
    return f"{type(error).__name__}: {text[0][:300]}".rstrip(": ")


def reference(model_dir: str, sequences: list[list[int]], bias: list[float]) -> dict:
    """transformers' answer for each token sequence, read with forward hooks on its decoder-layer
    list: resid_pre/resid_post of every layer [layers, tokens, width] and the logits, plain and with
    ``bias`` added to layer 0's output (then the last layer's output and the logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    blocks = decoder_layers(model, _text(model.config).num_hidden_layers)
    add = torch.tensor(bias, dtype=torch.float32)

    def forward(ids, steer):
        pre, post, handles = [], [], []

        def before(m, args, kwargs):
            pre.append(_rows(args[0] if args else kwargs["hidden_states"] if "hidden_states" in kwargs
                             else next(v for v in kwargs.values() if torch.is_tensor(v))))

        def after(m, args, out, i):
            hidden = out if torch.is_tensor(out) else out[0]
            if steer and i == 0:
                hidden = hidden + add
                out = hidden if torch.is_tensor(out) else (hidden, *out[1:])
            post.append(_rows(hidden))
            return out

        for i, block in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(block.register_forward_hook(lambda m, a, o, i=i: after(m, a, o, i)))
        try:
            with torch.no_grad():
                logits = model(torch.tensor([ids]), use_cache=False).logits[0]  # hybrids' caches refuse some layer mixes
        finally:
            for h in handles:
                h.remove()
        return np.stack(pre), np.stack(post), logits.numpy()

    out = []
    for ids in sequences:
        pre, post, logits = forward(ids, False)
        _, steered_post, steered_logits = forward(ids, True)
        out.append({"resid_pre": pre, "resid_post": post, "logits": logits,
                    "steered_resid_post": steered_post[-1], "steered_logits": steered_logits})
    return {"sequences": out}


def _rows(hidden) -> np.ndarray:
    return hidden.detach().reshape(-1, hidden.shape[-1]).float().numpy().copy()
