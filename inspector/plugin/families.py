"""Decoder block families: which module of a block is what, in TransformerLens's terms.

For block i, ``resid_pre`` enters the block; ``attn_out`` and ``mlp_out`` are exactly what the
attention and MLP branches add to the residual stream (after any post-branch norm); for sequential
blocks ``resid_mid = resid_pre + attn_out`` and ``resid_post = resid_mid + mlp_out``; for parallel ones
``resid_post = resid_pre + attn_out + mlp_out`` and there is no ``resid_mid``; ``mlp_post`` is the input
of the MLP's output projection. Where a module's own output means something else (Gemma's branch
output before its post-norm) it is a point of its own (``attn_raw``, ``mlp_raw``).

A family is matched by its block class's exact name (and, where a class has variants, by attribute
values). A block class no description names is described as Llama-style only when it is built like
one (``inferred_family``), and the boot probe then checks every identity on it; any other block is
refused rather than described wrongly. Adding a family is adding a description here and a tiny model
to the tests.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

from torch import nn

from inspector.capture.hooks import INFERRED_FAMILY

ALIASES = {"resid_pre": "hook_resid_pre", "attn_raw": "hook_attn_raw", "attn_out": "hook_attn_out",
           "resid_mid": "hook_resid_mid", "mlp_post": "mlp.hook_post", "mlp_raw": "hook_mlp_raw",
           "mlp_out": "hook_mlp_out", "resid_post": "hook_resid_post", "router": "mlp.hook_router"}


@dataclass(frozen=True)
class Point:
    """A block's hook point: ``kind`` at ``module`` (a path within the block, "" = the block), read at
    ``how``/``arg_index`` (see ``hookpoints.Site``); its ``width`` is the residual stream's ("stream"),
    the module's input features ("in": the MLP's neurons) or its output features ("out": a router's
    experts)."""

    kind: str
    module: str = ""
    how: str = "output"
    arg_index: int = 0
    width: str = "stream"


@dataclass(frozen=True)
class Family:
    name: str
    examples: str
    layer_classes: tuple[str, ...]
    residual: str  # fused (vLLM's (hidden, residual) pairs), sequential or parallel
    points: tuple[Point, ...]
    embeds: tuple[tuple[str, str], ...]  # (kind, module path beside the block list)
    final_norm: str  # module path beside the block list
    requires: tuple[tuple[str, object], ...] = ()  # (block attribute, the value it must have; None = absent)
    batched: bool = False  # transformers' own modules (vLLM's Transformers backend): [1, tokens, width]

    def describes(self, block: nn.Module) -> bool:
        return type(block).__name__ in self.layer_classes and all(
            getattr(block, name, None) == value for name, value in self.requires)


def fused(mlp: str) -> tuple[Point, ...]:
    """vLLM's Llama-style blocks, their MLP at ``mlp``: (positions, hidden, residual) in, (hidden, residual)
    out, the stream their sum. A mixture-of-experts layer's MLP has a gate (its router logits, which
    vLLM's fused experts choose from) and no down projection of its own."""
    return (Point("resid_pre", how="input_pair_sum", arg_index=1), Point("attn_out", "self_attn"),
            Point("resid_mid", "post_attention_layernorm", "input_pair_sum"), Point("router", f"{mlp}.gate", width="out"),
            Point("mlp_post", f"{mlp}.down_proj", "input", width="in"), Point("mlp_out", mlp),
            Point("resid_post", how="output_pair_sum"))


FAMILIES = (
    Family("Llama-style", "Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3; Qwen2-MoE, Qwen3-MoE, OLMoE",
           ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen2MoeDecoderLayer",
            "Qwen3MoeDecoderLayer", "OlmoeDecoderLayer"), "fused", fused("mlp"), (("embed", "embed_tokens"),), "norm",
           requires=(("ada_rms_norm_t_cond", None),)),  # Mistral's time-conditioned norm variant
    Family("Mixtral", "Mixtral 8x7B, 8x22B", ("MixtralDecoderLayer",), "fused", fused("block_sparse_moe"),
           (("embed", "embed_tokens"),), "norm"),
    Family("Gemma 2/3 (sandwich norms)", "Gemma 2, Gemma 3 (text)", ("Gemma2DecoderLayer", "Gemma3DecoderLayer"),
           "fused", (Point("resid_pre", how="input_pair_sum", arg_index=1), Point("attn_raw", "self_attn"),
                     Point("attn_out", "post_attention_layernorm"),
                     Point("resid_mid", "pre_feedforward_layernorm", "input_pair_sum"),
                     Point("mlp_post", "mlp.down_proj", "input", width="in"), Point("mlp_raw", "mlp"),
                     Point("mlp_out", "post_feedforward_layernorm"), Point("resid_post", how="output_pair_sum")),
           (("embed", "embed_tokens"),), "norm"),
    Family("GPT-2", "GPT-2", ("GPT2Block",), "sequential",
           (Point("resid_pre", how="input"), Point("attn_out", "attn"), Point("resid_mid", "ln_2", "input"),
            Point("mlp_post", "mlp.c_proj", "input", width="in"), Point("mlp_out", "mlp"), Point("resid_post")),
           (("embed", "wte"), ("pos_embed", "wpe")), "ln_f"),
    Family("GPT-J (parallel)", "GPT-J", ("GPTJBlock",), "parallel",
           (Point("resid_pre", how="input", arg_index=1), Point("attn_out", "attn"),
            Point("mlp_post", "mlp.fc_out", "input", width="in"), Point("mlp_out", "mlp"), Point("resid_post")),
           (("embed", "wte"),), "ln_f"),
    Family("GPT-NeoX (parallel)", "Pythia, GPT-NeoX-20B (vLLM's Transformers backend)", ("GPTNeoXLayer",),
           "parallel", (Point("resid_pre", how="input"), Point("attn_out", "attention"),
                        Point("mlp_post", "mlp.dense_4h_to_h", "input", width="in"), Point("mlp_out", "mlp"),
                        Point("resid_post")),
           (("embed", "embed_in"),), "final_layer_norm", requires=(("use_parallel_residual", True),), batched=True),
    Family("OLMo 2 (post-norms)", "OLMo 2 (vLLM's Transformers backend)", ("Olmo2DecoderLayer",), "sequential",
           (Point("resid_pre", how="input"), Point("attn_raw", "self_attn"), Point("attn_out", "post_attention_layernorm"),
            Point("resid_mid", "mlp", "input"), Point("mlp_post", "mlp.down_proj", "input", width="in"),
            Point("mlp_raw", "mlp"), Point("mlp_out", "post_feedforward_layernorm"), Point("resid_post")),
           (("embed", "embed_tokens"),), "norm", batched=True),
    Family("Phi-2 (parallel)", "Phi-1.5, Phi-2 (vLLM's Transformers backend)", ("PhiDecoderLayer",), "parallel",
           (Point("resid_pre", how="input"), Point("attn_out", "self_attn"),
            Point("mlp_post", "mlp.fc2", "input", width="in"), Point("mlp_out", "mlp"), Point("resid_post")),
           (("embed", "embed_tokens"),), "final_layernorm", batched=True),
    Family("OPT (pre-norm)", "OPT 125m, 1.3b and up", ("OPTDecoderLayer",), "sequential",
           (Point("resid_pre", how="input"), Point("attn_out", "self_attn"),
            Point("resid_mid", "final_layer_norm", "input"), Point("mlp_post", "fc2", "input", width="in"),
            Point("mlp_out", "fc2"), Point("resid_post")),
           (("embed", "embed_tokens"), ("pos_embed", "embed_positions")), "final_layer_norm",
           requires=(("do_layer_norm_before", True),)),
)


LLAMA_STYLE_MODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
OUTPUT_PROJECTIONS = ("down_proj", "c_proj", "fc2", "dense_4h_to_h", "fc_out")  # an MLP's, by the names in use


def family_of(block: nn.Module) -> Family | None:
    return next((f for f in FAMILIES if f.describes(block)), None) or inferred_family(block)


def inferred_family(block: nn.Module) -> Family | None:
    """A block class no description names, built as vLLM builds its Llama-style blocks (these four
    modules, in sequence): described as one, fused if its forward passes the residual stream on beside
    the hidden states, else sequential (its output the stream). Its points are then vouched for by the
    boot probe's identities (``probe.py``), not by a tiny model in the tests: a point whose identity
    fails is withdrawn, saying why (a block that scales its branches, say). A class a description names
    but refuses (a variant) stays refused."""
    name = type(block).__name__
    if any(name in f.layer_classes for f in FAMILIES):
        return None
    if not all(isinstance(getattr(block, m, None), nn.Module) for m in LLAMA_STYLE_MODULES):
        return None
    parameters = inspect.signature(block.forward).parameters
    if "hidden_states" not in parameters:
        return None
    out = next((f"mlp.{p}" for p in OUTPUT_PROJECTIONS if isinstance(getattr(block.mlp, p, None), nn.Module)),
               "mlp.down_proj")
    if "residual" in parameters:
        residual = "fused"
        points = tuple(replace(p, module=out) if p.kind == "mlp_post" else p for p in fused("mlp"))
    else:
        residual = "sequential"
        points = (Point("resid_pre", how="input", arg_index=list(parameters).index("hidden_states")),
                  Point("attn_out", "self_attn"), Point("resid_mid", "post_attention_layernorm", "input"),
                  Point("mlp_post", out, "input", width="in"), Point("mlp_out", "mlp"), Point("resid_post"))
    return Family(f"Llama-style ({residual}), {INFERRED_FAMILY} {name}", f"{name} (found by its structure)", (name,),
                  residual, points, (("embed", "embed_tokens"),), "norm")


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList, Family]:
    """The decoder block list and its family; ValueError naming the model, its top modules and the
    block classes it has when no family describes them."""
    candidates = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            family = family_of(module[0])
            if family is not None and all(family.describes(b) for b in module):
                return path, module, family
            candidates.append(f"{path} ({type(module[0]).__name__})")
    top = ", ".join(f"{name} ({type(m).__name__})" for name, m in model.named_children())
    known = "; ".join(f"{f.name}: {', '.join(f.layer_classes)}" for f in FAMILIES)
    raise ValueError(f"{type(model).__name__}: no block family describes its decoder blocks "
                     f"(module lists: {', '.join(candidates) or 'none'}; top modules: {top}). "
                     f"Known families: {known}. Hook a module by path instead (inspector hooks lists them)")
