"""The hook-point catalogue: where in a vLLM model an activation can be read and replaced.

A hook point is a module plus a *site*, the rule that turns that module's call into one
``[tokens, width]`` tensor and back:

- ``output``: the module's output tensor (or the first element of a tuple: linears return
  ``(out, bias)``, norms called with a residual return ``(normed, residual)``).
- ``output_pair_sum``: fused decoder layers return ``(hidden, residual)``; the residual stream is
  their sum, and replacing it with R means returning ``(R - residual, residual)``.
- ``input_pair_sum``: a forward pre-hook on ``(hidden, residual)`` arguments starting at
  ``arg_index`` (a fused layer's input is resid_pre; the post-attention norm's is resid_mid).
- ``input``: a pre-hook on the argument at ``arg_index`` (GPT-2 blocks take the plain residual stream;
  MLP neuron activations are the down projection's input, since activation modules can be shared
  between layers: vLLM caches one ``gelu_new`` instance for all of them; queries and keys are the
  first two arguments of vLLM's attention layer, after rotary embedding and any q/k norm, flattened
  to ``[tokens, heads × head_size]`` where a model passes them per head).

Replacement is written as a delta, ``h' = h * S + (r * (S - 1) + B)``, so that the residual stream
becomes ``(h + r) * S + B`` while an identity (S = 1, B = 0) leaves every value bit-identical. Feature
clamps (``capture.interventions.FeatureClamp``) then add ``(value - a(x)) * decoder`` to the value
that flows on, zero for rows whose slot clamps nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from inspector.core.hooks import ROUTER_KIND, HookPoint

from . import families, vllm_compat
from .vllm_compat import TensorParallel


@dataclass(frozen=True)
class Site:
    """How a hook point reads and replaces the value at its module (see the module docstring), and on
    this rank: a point whose columns are split over tensor-parallel ranks (MLP neurons, attention
    heads) holds slice ``shard`` of ``shards`` here; ``copies``: this rank sends the point's rows to the
    host (one rank per slice; a replicated point's rows leave from the first rank only)."""

    how: str  # output | output_pair_sum | input_pair_sum | input
    arg_index: int = 0  # of the call's arguments: positional ones, then keyword ones in the call's order
    batched: bool = False  # tensors lead with a batch of one (transformers' modules in vLLM's backend)
    shards: int = 1
    shard: int = 0
    copies: bool = True
    factor: float = 1.0  # the point's value is the tensor's times this (a branch its block scales)
    pair_offset: int = 1  # input_pair_sum: the residual is the argument this far after the hidden states

    @property
    def is_pre_hook(self) -> bool:
        return self.how.startswith("input")

    def local_width(self, point: HookPoint) -> int:
        """The columns of ``point`` this rank holds."""
        return point.width // self.shards

    def local_columns(self, point: HookPoint) -> slice:
        width = self.local_width(point)
        return slice(self.shard * width, (self.shard + 1) * width)


def catalogue(model: nn.Module, hidden: int, dtype: str, read: Callable[..., families.Reading],
              tp: TensorParallel = TensorParallel()
              ) -> tuple[families.Family, list[tuple[HookPoint, Site]], dict[str, str]]:
    """The family of a model's decoder blocks and its hook points, in model order: embeddings, each
    block's points with its queries and keys, the final norm's output; and why each kind the blocks
    lack is not offered; under pipeline parallelism, of this stage's blocks and of the embeddings or final
    norm where it holds them. ``read(blocks path, blocks, first block's index, embeddings, final norm)``
    reads the blocks from a forward (``reader.read``). Widths are the model's (all ranks' columns); each site says which of
    them this rank holds."""
    blocks_path, blocks = families.find_blocks(model, vllm_compat.is_attention, vllm_compat.is_pipeline_placeholder)
    held = [i for i, b in enumerate(blocks) if not vllm_compat.is_pipeline_placeholder(b)]  # this pipeline stage's
    reading = read(blocks_path, blocks[held[0]:held[-1] + 1], held[0],
                   *families.beside_blocks(model, blocks_path, vllm_compat.is_vocabulary_embedding))
    family, refused = reading.family, dict(reading.refused)
    if vllm_compat.is_multimodal(model):
        towers = families.encoders(model, blocks_path, vllm_compat.is_vocabulary_embedding)
        refused["encoders"] = (f"{' and '.join(towers)} are not read: only the language model's decoder blocks are "
                               "(a text prompt runs them alone)")
    stem, _, last = blocks_path.rpartition(".")
    modules = dict(model.named_modules())
    replicated = (1, 0, tp.rank == 0)

    def path(*parts: str) -> str:
        return ".".join(p for p in (stem, *parts) if p)

    def point(module_path: str, kind: str, alias: str, how: str = "output", width: int = hidden, arg_index: int = 0,
              layer: int = -1, attention=None, sharding: tuple[int, int, bool] = replicated,
              spec: families.Point | None = None) -> tuple[HookPoint, Site]:
        # vLLM's own attention layer takes [tokens, ...] whatever the family's layout
        batched = (family.batched or (spec is not None and spec.batched)) and attention is None
        # a router point carries the routing rule of the mixture-of-experts layer its gate belongs to
        routing = vllm_compat.moe_routing(modules[module_path.rpartition(".")[0]], width) if kind == ROUTER_KIND else None
        return (HookPoint(f"{module_path}.{kind}", alias, module_path, kind, width * sharding[0], layer, dtype,
                          attention, routing=routing, shards=sharding[0]),
                Site(how, arg_index, batched, *sharding, factor=spec.factor if spec else 1.0,
                     pair_offset=spec.pair_offset if spec else 1))

    def attention_points(block: str, b: str, i: int) -> list[tuple[HookPoint, Site]]:
        layers = vllm_compat.attention_layers(modules[block])
        if len(layers) != 1:
            return []
        rel, layer = layers[0]
        local = vllm_compat.attention_geometry(layer)  # this rank's heads
        q_sharding, k_sharding = (tp.size, tp.rank, True), _kv_sharding(tp)
        geometry = replace(local, heads=local.heads * q_sharding[0], kv_heads=local.kv_heads * k_sharding[0])
        if tp.size > 1 and (local.alibi_slopes or local.sinks):  # each rank holds its own heads' slopes or sinks
            geometry = replace(geometry, alibi_slopes=(), sinks=(), unsupported="; ".join(filter(None, (
                geometry.unsupported, "ALiBi slopes or attention sinks split over tensor-parallel ranks"))))
        found = [point(f"{block}.{rel}", "q", f"{b}.attn.hook_q", "input", local.q_width, 0, i, geometry, q_sharding)]
        if getattr(layer, "kv_sharing_target_layer_name", None) is None:  # else the layer gets no keys
            found.append(point(f"{block}.{rel}", "k", f"{b}.attn.hook_k", "input", local.k_width, 1, i, geometry,
                               k_sharding))
        return found

    points = [point(module, kind, f"hook_{kind}") for kind, module in family.embeds]
    for i, specs in zip(held, family.points):
        block, b = path(last, str(i)), f"blocks.{i}"
        for spec in specs:
            module_path = ".".join(p for p in (block, spec.module) if p)
            module = modules[module_path]
            width = {"in": _input_width, "out": _output_width}.get(spec.width, lambda _: hidden)(module)
            sharded = spec.width == "in" and tp.size > 1 and _input_width(module) < int(getattr(module, "input_size", 0))
            points.append(point(module_path, spec.kind, f"{b}.{families.ALIASES[spec.kind]}", spec.how, width,
                                spec.arg_index, i, sharding=(tp.size, tp.rank, True) if sharded else replicated,
                                spec=spec))
            if spec.kind == "resid_pre":
                points += attention_points(block, b, i)
    if family.final_norm:
        points.append(point(family.final_norm, "normalized", "ln_final.hook_normalized"))
    return family, [(p, site) for p, site in points if p.module_path in modules], refused


def _kv_sharding(tp: TensorParallel) -> tuple[int, int, bool]:
    """(slices, this rank's, whether it sends them) of the keys: one per rank, or, with fewer key/value
    heads than ranks, one per head, replicated on consecutive ranks (the first of them sends it)."""
    if not tp.kv_heads or tp.kv_heads >= tp.size:
        return tp.size, tp.rank, True
    per_head = tp.size // tp.kv_heads
    return tp.kv_heads, tp.rank // per_head, tp.rank % per_head == 0


def _input_width(module: nn.Module) -> int:
    """Features a linear layer takes on this rank (vLLM's parallel linears, or torch's)."""
    return int(next(getattr(module, a) for a in ("input_size_per_partition", "input_size", "in_features")
                    if getattr(module, a, None)))


def _output_width(module: nn.Module) -> int:
    """Features a linear layer gives on this rank (vLLM's parallel and replicated linears, or torch's)."""
    return int(next(getattr(module, a) for a in ("output_size_per_partition", "output_size", "out_features")
                    if getattr(module, a, None)))


# --- reading and replacing at a site (traced into the compiled graph: no value-dependent Python) ---

def _affine_delta(h, r, scale, bias):
    if r is None:
        return h * scale + bias
    return h * scale + (r * (scale - 1) + bias)


def clamp_delta(flowing, rows, encoder, decoder, offset, floor, value, on):
    """What a hook's feature clamps add to each row: ``encoder``/``decoder`` [clamps, width] and
    ``offset``/``floor`` [clamps] say the features; ``value``/``on`` [slots, clamps] say which each slot
    clamps and to what; ``rows`` [rows]: each row's slot."""
    p = flowing @ encoder.t() + offset
    wanted = (value.index_select(0, rows) - p * (p > floor)) * on.index_select(0, rows)
    return wanted @ decoder


def row_count(site: Site, tensor) -> int:
    """Tokens in a tensor at ``site``: its first dimension, the second where a batch of one leads."""
    return tensor.shape[1] if site.batched else tensor.shape[0]


def read_output(site: Site, output):
    if site.how == "output_pair_sum":
        return output[0] + output[1]
    v = output[0] if isinstance(output, tuple) else output
    v = v[0] if site.batched else v
    return v if site.factor == 1.0 else v * site.factor


def replace_output(site: Site, output, scale, bias, clamp=None):
    """Apply the affine (then ``clamp``: ``clamp_delta``'s arguments after the first, or None) at an
    output site; returns (new output, the value that now flows on). A leading batch of one broadcasts
    against the per-row scale and bias."""
    if site.how == "output_pair_sum":
        h, r = output[0], output[1]
        h2 = _affine_delta(h, r, scale, bias)
        flowing = h2 + r
        if clamp is not None:
            delta = clamp_delta(flowing, *clamp)
            h2, flowing = h2 + delta, flowing + delta
        return (h2, r, *output[2:]), flowing
    if site.factor != 1.0:  # the point is factor·v: (factor·v)·S + B = factor·(v·S + B / factor)
        bias = bias / site.factor
    v = (output[0] if isinstance(output, tuple) else output) * scale + bias
    if clamp is not None:
        delta = clamp_delta((v[0] if site.batched else v) * site.factor, *clamp)
        v = v + (delta if site.factor == 1.0 else delta / site.factor)
    new = (v, *output[1:]) if isinstance(output, tuple) else v
    flowing = v[0] if site.batched else v
    return new, (flowing if site.factor == 1.0 else flowing * site.factor)


def call_arguments(args: tuple, kwargs: dict) -> tuple:
    """A call's arguments as input sites index them: the positional ones, then the keyword ones in the
    order of the call (vLLM calls some blocks by keyword only: Mamba 2's ``layer(hidden_states=...)``)."""
    return (*args, *kwargs.values()) if kwargs else args


def split_arguments(arguments: tuple, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``call_arguments``' tuple back into ``(args, kwargs)``: what a pre-hook with keywords returns."""
    if not kwargs:
        return arguments, kwargs
    return tuple(arguments[:len(args)]), dict(zip(kwargs, arguments[len(args):]))


def _pair_args(site: Site, args):
    h = args[site.arg_index]
    j = site.arg_index + site.pair_offset
    r = args[j] if site.how == "input_pair_sum" and len(args) > j else None
    return h, r


def _rows(site: Site, h):
    return h[0] if site.batched else h.flatten(1)


def read_input(site: Site, args):
    h, r = _pair_args(site, args)
    return _rows(site, h) if r is None else h + r


def replace_input(site: Site, args, scale, bias, clamp=None):
    """Apply the affine (then ``clamp``, as at an output site) at an input site; returns (new args, the
    value that now flows on)."""
    h, r = _pair_args(site, args)
    if r is None:
        flowing = _affine_delta(_rows(site, h), None, scale, bias)
        if clamp is not None:
            flowing = flowing + clamp_delta(flowing, *clamp)
        h2 = flowing.view(h.shape)
    else:
        h2 = _affine_delta(h, r, scale, bias)
        flowing = h2 + r
        if clamp is not None:
            delta = clamp_delta(flowing, *clamp)
            h2, flowing = h2 + delta, flowing + delta
    i = site.arg_index
    return (*args[:i], h2, *args[i + 1:]), flowing


def row_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest relative L2 error of a row of two tensors of one shape; inf where rows are not finite
    on one side only, or on none at all. Rows not finite on both sides are the same rows of one model's
    values (a state-space layer's dummy forward reads uninitialised state): they say nothing either way."""
    finite = torch.isfinite(expected).all(-1)
    if not torch.equal(finite, torch.isfinite(got).all(-1)) or not bool(finite.any()):
        return float("inf")
    got, expected = got[finite], expected[finite]
    return float(((got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp_min(1e-30)).max())
