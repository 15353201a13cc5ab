"""A TransformerLens-style activation cache over the rows the engine captured: the same names
(``blocks.3.hook_resid_post``, or ``cache["resid_post", 3]``) and the same shapes ([batch, pos, d_model];
queries, keys and head outputs [batch, pos, head, d_head]), so a notebook written for TransformerLens
reads it as it is."""

from __future__ import annotations

import difflib
import re

import numpy as np
import torch

from inspector.capture.attention import AttentionGeometry, attention_weights
from inspector.capture.dtypes import BFLOAT16
from inspector.capture.hooks import HookPoint

ATTENTION_KINDS = ("q", "k", "v", "z", "pattern", "attn_scores")
MLP_KINDS = ("pre", "post", "pre_linear")


def act_name(kind: str, layer: int | None = None) -> str:
    """TransformerLens's name of an activation (its ``utils.get_act_name``): ``("resid_post", 3)`` →
    ``blocks.3.hook_resid_post``, ``("q", 0)`` → ``blocks.0.attn.hook_q``, ``"embed"`` → ``hook_embed``."""
    if layer is None:
        return {"normalized": "ln_final.hook_normalized", "embed": "hook_embed",
                "pos_embed": "hook_pos_embed"}.get(kind, kind)
    inner = "attn." if kind in ATTENTION_KINDS else "mlp." if kind in MLP_KINDS else ""
    return f"blocks.{layer}.{inner}hook_{kind}"


class ActivationCache:
    """Activations by TransformerLens name, as torch tensors with a batch dimension first (until
    ``remove_batch_dim``); ``attention_mask`` [batch, pos] says which positions hold a token (prompts
    of different lengths are padded on the right, with zeros)."""

    def __init__(self, tensors: dict[str, torch.Tensor], attention_mask: torch.Tensor, n_layers: int,
                 has_batch_dim: bool = True, geometries: dict[int, AttentionGeometry] | None = None):
        self._tensors, self.attention_mask, self.n_layers = dict(tensors), attention_mask, n_layers
        self.has_batch_dim = has_batch_dim
        self.geometries = dict(geometries or {})  # layer -> how its attention turns q and k into a pattern

    def __getitem__(self, key) -> torch.Tensor:
        name = act_name(*key) if isinstance(key, tuple) else key
        if name not in self._tensors and self._pattern_layer(name) is not None:
            self._tensors[name] = self._pattern(self._pattern_layer(name))
        if name not in self._tensors:
            close = difflib.get_close_matches(name, self._tensors, n=3)
            raise KeyError(f"{name!r} is not in the cache" + (f"; did you mean {', '.join(close)}?" if close else
                                                                 f" (it holds {len(self._tensors)} activations)"))
        return self._tensors[name]

    def __contains__(self, key) -> bool:
        name = act_name(*key) if isinstance(key, tuple) else key
        return name in self._tensors or self._pattern_layer(name) is not None

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
                               self.n_layers, self.has_batch_dim, self.geometries)

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
                               has_batch_dim=False, geometries=self.geometries)

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


def tensors_of(points: dict[str, HookPoint], rows: dict[str, list], lengths: list[int],
               geometries: dict[int, AttentionGeometry]) -> dict[str, torch.Tensor]:
    """Per TransformerLens name, the prompts' rows ([tokens, width] numpy arrays, in prompt order) as
    one tensor [batch, pos, ...] padded with zeros on the right; heads split out of queries, keys and
    head outputs."""
    batch, longest = len(lengths), max(lengths)
    out = {}
    for name, per_prompt in rows.items():
        point = points[name]
        first = as_torch(per_prompt[0])
        padded = first.new_zeros((batch, longest, first.shape[-1]))
        for i, values in enumerate(per_prompt):
            padded[i, :len(values)] = as_torch(values)
        kind = re.sub(r"^.*hook_", "", point.alias)
        if kind in ("q", "k", "z") and point.layer in geometries:
            padded = padded.reshape(batch, longest, -1, geometries[point.layer].head_size)
        out[point.alias] = padded
    return out


def as_torch(values: np.ndarray) -> torch.Tensor:
    """A copy of captured rows as a tensor of their dtype (numpy's bfloat16 is ``ml_dtypes``')."""
    values = np.ascontiguousarray(values)
    if values.dtype == BFLOAT16:
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(values.copy())
