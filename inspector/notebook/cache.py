"""A TransformerLens-style activation cache over the rows the engine captured: the same names
(``blocks.3.hook_resid_post``, or ``cache["resid_post", 3]``) and the same shapes ([batch, pos, d_model];
queries, keys and head outputs [batch, pos, head, d_head]), so a notebook written for TransformerLens
reads it as it is."""

from __future__ import annotations

import difflib
import functools
import re
from typing import Protocol

import numpy as np
import torch

from inspector.core.attention import AttentionGeometry, attention_weights
from inspector.core.dtypes import BFLOAT16
from inspector.core.hooks import HookPoint
from inspector.core.lens import Attribution, Lens

from . import views

ATTENTION_KINDS = ("q", "k", "v", "z", "pattern", "attn_scores")
HEADED_KINDS = ("q", "k", "v", "z")  # TransformerLens splits their heads out
MLP_KINDS = ("pre", "post", "pre_linear")
FINAL_SCALE = "ln_final.hook_scale"
ATTRIBUTION_ROWS = 8192  # rows per engine call of logit_attrs: 128 MiB of float32 each way at a width of 4096

SliceInput = int | tuple | slice | list | np.ndarray | torch.Tensor | None


class _Engine(Protocol):
    def final_norm_kind(self) -> tuple[bool, float]: ...

    def lens(self, values, k: int = 5, chosen=None) -> Lens: ...

    def token_texts(self, ids) -> list[str]: ...

    def attribution(self, values, final_residual, k: int = 5, chosen=None) -> Attribution: ...


class CacheModel(Protocol):
    """What a cache asks of the model it came from (an ``Inspector``) to apply the final norm and
    attribute logits: the engine's own norm and unembedding, so no weights are copied out."""

    @property
    def session(self) -> _Engine: ...

    def to_single_token(self, string: str) -> int: ...


def act_name(kind: str, layer: int | None = None) -> str:
    """TransformerLens's name of an activation (its ``utils.get_act_name``): ``("resid_post", 3)`` →
    ``blocks.3.hook_resid_post``, ``("q", 0)`` → ``blocks.0.attn.hook_q``, ``"embed"`` → ``hook_embed``."""
    if layer is None:
        return {"normalized": "ln_final.hook_normalized", "scale": FINAL_SCALE, "embed": "hook_embed",
                "pos_embed": "hook_pos_embed"}.get(kind, kind)
    inner = "attn." if kind in ATTENTION_KINDS else "mlp." if kind in MLP_KINDS else ""
    return f"blocks.{layer}.{inner}hook_{kind}"


class ActivationCache:
    """Activations by TransformerLens name, as torch tensors with a batch dimension first (until
    ``remove_batch_dim``); ``attention_mask`` [batch, pos] says which positions hold a token (prompts
    of different lengths are padded on the right, with zeros). ``model``: the ``Inspector`` the cache
    came from, which ``apply_ln_to_stack`` and ``logit_attrs`` ask for the final norm and unembedding.
    ``str_tokens``: each prompt's token texts (one list without the batch dimension), for the views."""

    def __init__(self, tensors: dict[str, torch.Tensor], attention_mask: torch.Tensor, n_layers: int,
                 has_batch_dim: bool = True, geometries: dict[int, AttentionGeometry] | None = None,
                 model: CacheModel | None = None, str_tokens: list | None = None):
        self._tensors, self.attention_mask, self.n_layers = dict(tensors), attention_mask, n_layers
        self.has_batch_dim = has_batch_dim
        self.geometries = dict(geometries or {})  # layer -> how its attention turns q and k into a pattern
        self.model = model
        self.str_tokens = str_tokens

    def __getitem__(self, key) -> torch.Tensor:
        name = act_name(*key) if isinstance(key, tuple) else key
        if name == FINAL_SCALE and name not in self._tensors and self._scale_derivable():
            return self._final_scale  # derived, so not kept among the captured activations (nor saved with them)
        if name not in self._tensors and self._pattern_layer(name) is not None:
            self._tensors[name] = self._pattern(self._pattern_layer(name))
        if name not in self._tensors:
            close = difflib.get_close_matches(name, self._tensors, n=3)
            raise KeyError(f"{name!r} is not in the cache" + (f"; did you mean {', '.join(close)}?" if close else
                                                                 f" (it holds {len(self._tensors)} activations)"))
        return self._tensors[name]

    def __contains__(self, key) -> bool:
        name = act_name(*key) if isinstance(key, tuple) else key
        return (name in self._tensors or self._pattern_layer(name) is not None
                or (name == FINAL_SCALE and self._scale_derivable()))

    def _pattern_layer(self, name: str) -> int | None:
        """The layer of ``blocks.L.attn.hook_pattern`` where its queries and keys are cached, else None."""
        found = re.fullmatch(r"blocks\.(\d+)\.attn\.hook_pattern", name)
        layer = int(found.group(1)) if found else None
        ready = layer in self.geometries and all(f"blocks.{layer}.attn.hook_{kind}" in self._tensors for kind in "qk")
        return layer if ready else None

    def _pattern(self, layer: int) -> torch.Tensor:
        """The attention pattern [batch, head, query, key] recomputed from the captured queries and keys
        (``attention_weights``: causal, windowed, soft-capped as the model is); 0 at padding."""
        q, k = self[f"blocks.{layer}.attn.hook_q"], self[f"blocks.{layer}.attn.hook_k"]
        mask = self.attention_mask
        if not self.has_batch_dim:
            q, k, mask = q[None], k[None], mask[None]
        geometry = self.geometries[layer]
        out = torch.zeros((q.shape[0], geometry.heads, q.shape[1], q.shape[1]), dtype=torch.float32)
        for i in range(q.shape[0]):
            positions = torch.nonzero(mask[i]).flatten().cpu().numpy()
            rows = (q[i, positions].reshape(len(positions), -1).float().cpu().numpy(),
                    k[i, positions].reshape(len(positions), -1).float().cpu().numpy())
            weights = attention_weights(rows[0], positions, rows[1], positions, geometry)
            out[i][:, positions[:, None], positions[None, :]] = torch.from_numpy(weights)
        out = out.to(q.device)
        return out if self.has_batch_dim else out[0]

    def _scale_derivable(self) -> bool:
        return self.model is not None and act_name("resid_post", self.n_layers - 1) in self._tensors

    @functools.cached_property
    def _final_scale(self) -> torch.Tensor:
        """The final norm's scale at each position, [batch, pos, 1] (``ln_final.hook_scale``, which the
        engine does not capture): sqrt(mean(x²) + eps) of its input, the last block's output, centred
        first where the norm centres (LayerNorm)."""
        centred, eps = self._final_norm
        resid = self["resid_post", self.n_layers - 1]
        x = resid.float()
        x = x - x.mean(-1, keepdim=True) if centred else x
        return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps).to(resid.dtype)

    @functools.cached_property
    def _final_norm(self) -> tuple[bool, float]:
        """(centres like LayerNorm, epsilon) of the model's final norm, asked of the engine once."""
        return self._engine().final_norm_kind()

    def _engine(self) -> _Engine:
        if self.model is None:
            raise ValueError("this cache holds no model (ActivationCache(..., model=inspector); Inspector."
                             "run_with_cache gives one): the final norm and unembedding are the engine's")
        return self.model.session

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def keys(self):
        return self._tensors.keys()

    def values(self):
        return self._tensors.values()

    def items(self):
        return self._tensors.items()

    def __repr__(self) -> str:
        return f"ActivationCache with keys {list(self._tensors)}"

    def to(self, device) -> "ActivationCache":
        return ActivationCache({k: t.to(device) for k, t in self._tensors.items()}, self.attention_mask.to(device),
                               self.n_layers, self.has_batch_dim, self.geometries, self.model, self.str_tokens)

    def cpu(self) -> "ActivationCache":
        return self.to("cpu")

    def remove_batch_dim(self) -> "ActivationCache":
        """The cache of a batch of one without its batch dimension (as TransformerLens's)."""
        if not self.has_batch_dim:
            return self
        batch = self.attention_mask.shape[0]
        if batch != 1:
            raise ValueError(f"remove_batch_dim needs a batch of one; this cache holds {batch} prompts")
        return ActivationCache({k: t[0] for k, t in self._tensors.items()}, self.attention_mask[0], self.n_layers,
                               has_batch_dim=False, geometries=self.geometries, model=self.model,
                               str_tokens=self.str_tokens[0] if self.str_tokens else None)

    # --- inline views (``views``: the app's colour scales; in Jupyter they draw themselves) ---

    def show(self, key, prompt: int | None = None) -> views.Figure:
        """A cache entry as the app's heatmap draws a hook: every prompt, or ``prompt``'s."""
        name = act_name(*key) if isinstance(key, tuple) else key
        values, tokens = self[key], self.str_tokens
        if self.has_batch_dim and prompt is not None:
            values, tokens = values[prompt], self._tokens(prompt)
        return views.activation_view(values, tokens, title=name, heads=name.rsplit("hook_", 1)[-1] in HEADED_KINDS)

    def show_pattern(self, layer: int, prompt: int = 0, head: int | None = None) -> views.Figure:
        """Block ``layer``'s attention pattern of a prompt (every head, or ``head``), as the Attention tab."""
        n = self._length(prompt)
        pattern = self["pattern", layer]
        pattern = pattern[prompt] if self.has_batch_dim else pattern
        return views.pattern_view(pattern[:, :n, :n], self._tokens(prompt), head=head,
                                  title=f"blocks.{layer}.attn.hook_pattern")

    def compare(self, other: "ActivationCache", key, prompt: int = 0) -> views.CompareView:
        """A twin comparison: ``other``'s entry (an edited run, say) less this one's, for one prompt."""
        name = act_name(*key) if isinstance(key, tuple) else key
        mine, theirs = self[key], other[key]
        if self.has_batch_dim:
            mine, theirs = mine[prompt], theirs[prompt]
        return views.compare_view(mine, theirs, self._tokens(prompt), title=name,
                                  heads=name.rsplit("hook_", 1)[-1] in HEADED_KINDS)

    def logit_lens(self, prompt: int = 0) -> views.LensView:
        """The logit lens of a prompt, as the Lens tab: each block's residual stream (``accumulated_resid``)
        through the model's own final norm and unembedding, the top next token and its probability."""
        n = self._length(prompt)
        stack, labels = self.accumulated_resid(return_labels=True)
        rows = (stack[:, prompt, :n] if self.has_batch_dim else stack[:, :n]).float().cpu()
        found = self._engine().lens(rows.reshape(-1, rows.shape[-1]).numpy(), k=1)
        texts = self._engine().token_texts(found.top_ids[:, 0])
        grid = [texts[i * n:(i + 1) * n] for i in range(len(labels))]
        probabilities = np.exp(found.top_logprobs[:, 0]).reshape(len(labels), n)
        return views.lens_view(grid, probabilities, self._tokens(prompt), layer_labels=labels)

    def _length(self, prompt: int) -> int:
        return int((self.attention_mask[prompt] if self.has_batch_dim else self.attention_mask).sum())

    def _tokens(self, prompt: int) -> list[str] | None:
        if not self.str_tokens:
            return None
        return self.str_tokens[prompt] if self.has_batch_dim else self.str_tokens

    def accumulated_resid(self, layer: int | None = None, incl_mid: bool = False,
                          return_labels: bool = False):
        """The residual stream before each block up to ``layer`` (all, and the final block's output,
        when None or the number of blocks), its middle too with ``incl_mid``: [components, (batch,) pos,
        d_model], and with ``return_labels`` their labels ("0_pre", "0_mid", …, "final_post")."""
        layer = self.n_layers if layer is None else layer
        if not 0 <= layer <= self.n_layers:
            raise ValueError(f"layer must lie in 0..{self.n_layers}, got {layer}")
        parts, labels = [], []
        for block in range(layer):
            parts.append(self[f"blocks.{block}.hook_resid_pre"])
            labels.append(f"{block}_pre")
            if incl_mid:
                parts.append(self[f"blocks.{block}.hook_resid_mid"])
                labels.append(f"{block}_mid")
        if layer == self.n_layers:
            parts.append(self[f"blocks.{self.n_layers - 1}.hook_resid_post"])
            labels.append("final_post")
        stacked = torch.stack(parts)
        return (stacked, labels) if return_labels else stacked

    def stack_activation(self, kind: str) -> torch.Tensor:
        """One kind of activation of every block, stacked: [layers, (batch,) pos, ...]."""
        return torch.stack([self[kind, layer] for layer in range(self.n_layers)])

    def decompose_resid(self, layer: int | None = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: SliceInput = None, incl_embeds: bool = True,
                        return_labels: bool = False):
        """The residual stream before block ``layer`` (after the last block when None or the number of
        blocks) as the outputs that add up to it: the embeddings ("embed", "pos_embed" where cached), then
        each block's "{L}_attn_out" and "{L}_mlp_out" (``mode`` "attn" or "mlp": those only), and with
        ``mlp_input`` block ``layer``'s attention too: [components, (batch,) pos, d_model], ``pos_slice``
        applied (TransformerLens's ``Slice``). ``apply_ln``: through ``apply_ln_to_stack`` (final norm
        only)."""
        layer = self.n_layers if layer in (None, -1) else layer
        if not 0 <= layer <= self.n_layers:
            raise ValueError(f"layer must lie in 0..{self.n_layers}, got {layer}")
        kinds = {"all": ("attn_out", "mlp_out"), "attn": ("attn_out",), "mlp": ("mlp_out",)}.get(mode)
        if kinds is None:
            raise ValueError(f"mode must be 'all', 'attn' or 'mlp', got {mode!r}")
        names = [(kind, None) for kind in ("embed", "pos_embed") if incl_embeds and f"hook_{kind}" in self._tensors]
        names += [(kind, block) for block in range(layer) for kind in kinds]
        if mlp_input and "attn_out" in kinds:
            names.append(("attn_out", layer))
        stacked = torch.stack([apply_slice(pos_slice, self[name], -2) for name in names])
        if apply_ln:
            stacked = self.apply_ln_to_stack(stacked, layer, mlp_input, pos_slice=pos_slice)
        labels = [kind if block is None else f"{block}_{kind}" for kind, block in names]
        return (stacked, labels) if return_labels else stacked

    def apply_ln_to_stack(self, residual_stack: torch.Tensor, layer: int | None = None, mlp_input: bool = False,
                          pos_slice: SliceInput = None, batch_slice: SliceInput = None,
                          has_batch_dim: bool = True) -> torch.Tensor:
        """Residual-stream parts as the final norm sees them in this run (TransformerLens's): centred
        where the norm centres (LayerNorm) and divided by its scale of the final residual stream at their
        position (``ln_final.hook_scale``), without its weight and bias. ``pos_slice`` is applied to the
        scale only (the stack has it already); ``batch_slice`` to both (the stack's dimension 1 when
        ``has_batch_dim``). The final norm only (``layer`` None or the number of blocks, where
        ``mlp_input`` means nothing): the blocks' norms' scales are not captured."""
        if layer not in (None, -1, self.n_layers):
            raise ValueError(f"only the final norm's scale is known (layer None or {self.n_layers}), not that of "
                             f"block {layer}'s norm: the engine captures no block norm's scale")
        if has_batch_dim:
            residual_stack = apply_slice(batch_slice, residual_stack, 1)
        if self._final_norm[0]:
            residual_stack = residual_stack - residual_stack.mean(-1, keepdim=True)
        return residual_stack / self._at_slices(self[FINAL_SCALE], pos_slice, batch_slice)

    def logit_attrs(self, residual_stack: torch.Tensor, tokens, incorrect_tokens=None, pos_slice: SliceInput = None,
                    batch_slice: SliceInput = None, has_batch_dim: bool = True) -> torch.Tensor:
        """What each part of the residual stream adds directly to the logit of ``tokens`` (an id, a
        one-token string, or ids broadcast against the stack: [batch], [batch, pos]), less what it adds
        to ``incorrect_tokens``'s where given: through the model's own final norm, its weight included and
        its scale frozen at the final residual stream (``pos_slice``, ``batch_slice`` as
        ``apply_ln_to_stack``), and its unembedding without bias. The engine's direct logit attribution
        (``Session.attribution``): TransformerLens's ``logit_attrs`` of a model loaded with
        ``fold_ln=True`` (unprocessed, TransformerLens leaves the norm's weight out). Summed over
        ``decompose_resid``'s parts: the logits less the unembedding's bias and the norm's bias through
        it. Float32 [components, *batch_and_pos]."""
        engine = self._engine()
        if has_batch_dim:
            residual_stack = apply_slice(batch_slice, residual_stack, 1)
        final = self._at_slices(self["resid_post", self.n_layers - 1], pos_slice, batch_slice)
        ids = self._token_ids(tokens)
        wrong = None if incorrect_tokens is None else self._token_ids(incorrect_tokens)
        if wrong is not None and wrong.shape != ids.shape:
            raise ValueError(f"tokens and incorrect_tokens must have the same shape, got {tuple(ids.shape)} and "
                             f"{tuple(wrong.shape)}")
        shape = torch.broadcast_shapes(residual_stack.shape[:-1], final.shape[:-1], ids.shape)
        width = residual_stack.shape[-1]

        def rows(t: torch.Tensor) -> np.ndarray:
            return t.expand(*shape, width).reshape(-1, width).float().cpu().numpy()

        values, residual = rows(residual_stack), rows(final)
        attrs = _chosen_logits(engine, values, residual, ids.expand(shape).reshape(-1).cpu().numpy())
        if wrong is not None:
            attrs = attrs - _chosen_logits(engine, values, residual, wrong.expand(shape).reshape(-1).cpu().numpy())
        return torch.from_numpy(attrs).reshape(shape).to(residual_stack.device)

    def _at_slices(self, t: torch.Tensor, pos_slice: SliceInput, batch_slice: SliceInput) -> torch.Tensor:
        """A [(batch,) pos, ...] activation at the positions and prompts a sliced stack holds."""
        t = apply_slice(pos_slice, t, -2)
        return apply_slice(batch_slice, t, 0) if self.has_batch_dim else t

    def _token_ids(self, tokens) -> torch.Tensor:
        """Token ids as a long tensor; a string must be one token, and one id is a scalar (TransformerLens's
        ``tokens_to_residual_directions``)."""
        ids = self.model.to_single_token(tokens) if isinstance(tokens, str) else tokens
        ids = torch.as_tensor(ids, dtype=torch.long)
        return ids.reshape(()) if ids.numel() == 1 else ids


def _chosen_logits(engine: _Engine, values: np.ndarray, residual: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The engine's direct logit attribution of each row to its token, ``ATTRIBUTION_ROWS`` rows a call."""
    return np.concatenate([engine.attribution(values[start:start + ATTRIBUTION_ROWS],
                                              residual[start:start + ATTRIBUTION_ROWS], 1,
                                              ids[start:start + ATTRIBUTION_ROWS]).chosen_logits
                           for start in range(0, len(values), ATTRIBUTION_ROWS)])


def apply_slice(value: SliceInput, tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """TransformerLens's ``Slice`` of ``tensor`` along ``dim``: None keeps it whole, an int takes one index
    (dropping the dimension), a tuple is ``slice(*tuple)``, a list, array or tensor takes those indices
    (a TransformerLens ``Slice`` applies itself)."""
    if value is None:
        return tensor
    if hasattr(value, "apply"):
        return value.apply(tensor, dim)
    if isinstance(value, tuple):
        value = slice(*value)
    index = value if isinstance(value, (int, slice)) else torch.as_tensor(value)
    return tensor[(slice(None),) * (dim % tensor.ndim) + (index,)]


def by_alias(points: dict[str, HookPoint], tensors: dict[str, torch.Tensor],
             geometries: dict[int, AttentionGeometry]) -> dict[str, torch.Tensor]:
    """Per TransformerLens name, a hook's rows [batch, pos, width] (keyed by installed name); heads split
    out of queries, keys and head outputs: [batch, pos, head, d_head]."""
    out = {}
    for name, tensor in tensors.items():
        point = points[name]
        if point.alias.rsplit("hook_", 1)[-1] in HEADED_KINDS and point.layer in geometries:
            tensor = tensor.reshape(*tensor.shape[:2], -1, geometries[point.layer].head_size)
        out[point.alias] = tensor
    return out


def as_torch(values: np.ndarray) -> torch.Tensor:
    """A copy of captured rows as a tensor of their dtype (numpy's bfloat16 is ``ml_dtypes``')."""
    values = np.ascontiguousarray(values)
    if values.dtype == BFLOAT16:
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(values.copy())
