"""The decoder blocks of a model as the hook points see them: the block list, what lies beside it,
and each block's points in TransformerLens's terms.

For block i, ``resid_pre`` enters the block; ``attn_out`` and ``mlp_out`` are exactly what the
attention and MLP branches add to the residual stream (after any post-branch norm, times any
constant the block scales them by); for sequential blocks ``resid_mid = resid_pre + attn_out`` and
``resid_post = resid_mid + mlp_out``; for parallel ones ``resid_post = resid_pre + attn_out + mlp_out``
and there is no ``resid_mid``; ``mlp_post`` is the input of the MLP's output projection and ``z`` the
heads' outputs before the attention's. Where a branch's own output differs from what it adds (a
post-branch norm follows it) it is a point of its own (``attn_raw``, ``mlp_raw``).

No description names any model's modules: ``reader.py`` reads every block from a forward of the
model vLLM built, and the boot probe (``probe.py``) verifies what it read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

ALIASES = {"resid_pre": "hook_resid_pre", "attn_raw": "hook_attn_raw", "attn_out": "hook_attn_out",
           "resid_mid": "hook_resid_mid", "mlp_post": "mlp.hook_post", "mlp_raw": "hook_mlp_raw",
           "mlp_out": "hook_mlp_out", "resid_post": "hook_resid_post", "router": "mlp.hook_router",
           "z": "attn.hook_z"}


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
    factor: float = 1.0  # the value is the module's times this (a branch the block scales as it adds it)
    batched: bool = False  # its tensors lead with a batch of one (transformers' modules)
    pair_offset: int = 1  # input_pair_sum: the residual is the argument this far after the hidden states


@dataclass(frozen=True)
class Family:
    """How a model's blocks are built, as read: ``points[i]`` are block i's (blocks may differ: a
    dense block before mixture-of-experts ones, attention beside state-space layers); ``embeds``
    (kind, module path) and ``final_norm`` lie beside the block list."""

    name: str
    points: tuple[tuple[Point, ...], ...]
    embeds: tuple[tuple[str, str], ...]
    final_norm: str
    batched: bool = False  # transformers' own modules (vLLM's Transformers backend): [1, tokens, width]


@dataclass
class Reading:
    """The blocks as read (``reader.read``): their family (its points per block) and, per kind not
    offered, why."""

    family: Family
    refused: dict[str, str] = field(default_factory=dict)


def find_blocks(model: nn.Module, is_attention=lambda m: False,
                is_placeholder=lambda m: False) -> tuple[str, nn.ModuleList]:
    """The decoder block list: of the module lists (each module with parameters, or a placeholder for a
    block another pipeline stage holds, ``is_placeholder``), the one holding the most attention layers
    (``is_attention``), else the longest; one block is a list too (a one-layer model, or an engine cut
    after block 0 for a harvest). ValueError naming the model and its top modules when it has none."""
    lists = [(path, m) for path, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0
             and all(is_placeholder(b) or any(True for _ in b.parameters()) for b in m)
             and not all(is_placeholder(b) for b in m)]
    if not lists:
        top = ", ".join(f"{name} ({type(m).__name__})" for name, m in model.named_children())
        raise ValueError(f"{type(model).__name__}: no list of decoder blocks found (top modules: {top}); hook a "
                         "module by path instead (inspector hooks lists them)")
    return max(lists, key=lambda pm: (sum(1 for m in pm[1].modules() if is_attention(m)), len(pm[1])))


def encoders(model: nn.Module, blocks_path: str, is_vocabulary=lambda m: False) -> list[str]:
    """A multimodal model's top modules with weights that hold no decoder block and are not the
    vocabulary's (its encoders and projectors)."""
    top = blocks_path.split(".")[0]
    return [name for name, m in model.named_children()
            if name != top and not is_vocabulary(m) and any(True for _ in m.parameters())]


def beside_blocks(model: nn.Module, blocks_path: str, is_vocabulary=lambda m: False
                  ) -> tuple[tuple[tuple[str, str], ...], str]:
    """(embeddings as (kind, path), final norm path): the modules beside the block list, the token
    embedding the vocabulary's (``is_vocabulary``; a second one the positions'), the
    final norm the last norm registered after the list (or before it, where none is after)."""
    stem, _, last = blocks_path.rpartition(".")
    parent = model.get_submodule(stem) if stem else model
    children = list(parent.named_children())
    join = lambda name: f"{stem}.{name}" if stem else name  # noqa: E731
    embeddings = sorted(((name, m) for name, m in children if hasattr(m, "num_embeddings")),
                        key=lambda nm: (not is_vocabulary(nm[1]), -int(nm[1].num_embeddings)))
    embeds = tuple((kind, join(name)) for kind, (name, _) in zip(("embed", "pos_embed"), embeddings[:2]))
    names = [name for name, _ in children]
    norms = [name for name in names if "norm" in type(parent.get_submodule(name)).__name__.lower()]
    after = [name for name in norms if names.index(name) > names.index(last)]  # OPT registers its norm first
    return embeds, join((after or norms)[-1]) if norms else ""
