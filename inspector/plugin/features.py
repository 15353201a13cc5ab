"""SAE features where the activations are: an attached SAE encodes its hook's rows on the engine's
device right after each forward, and only each row's strongest features (ids and activations) join
the forward's copy to the host (``capture.sae`` is the reference it is checked against)."""

from __future__ import annotations

import torch

from inspector.core.sae import AttachedSae, load_weights

CHUNK_ROWS = 1024  # rows encoded at once: a 65,536-feature SAE's pre-activations of 1,024 rows are 256 MiB


class DeviceSae:
    def __init__(self, attached: AttachedSae, device: torch.device, dtype: torch.dtype):
        self.attached, self.config = attached, attached.config
        self.k = min(attached.k, self.config.d_sae)
        # the decoder stays on disk: steering reads the rows it needs (capture.sae.decoder_row)
        self.weights = {name: torch.from_numpy(a).to(device=device, dtype=dtype)
                        for name, a in load_weights(self.config).items() if name != "W_dec"}

    @torch.inference_mode()
    def strongest(self, rows: torch.Tensor) -> torch.Tensor:
        """[2, rows, k] float32: each row's k strongest active features' activations, then their ids
        (-1 and 0 where fewer are active), strongest first."""
        pieces = [self._strongest(rows[start:start + CHUNK_ROWS]) for start in range(0, rows.shape[0], CHUNK_ROWS)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def _strongest(self, rows: torch.Tensor) -> torch.Tensor:
        """The ReLU commutes with the top-k (it keeps the order of what it keeps), so it is applied to the
        k found rather than to every feature; a top-k SAE's own top-k already holds the strongest."""
        c = self.config
        pre = self._pre_activations(rows)
        if c.architecture == "jumprelu":
            pre = pre * (pre > self.weights["threshold"])
        k = min(self.k, c.k) if c.architecture == "topk" else self.k
        values, ids = pre.topk(k, dim=1)
        values = values.float().clamp_min(0)
        if k < self.k:  # the SAE keeps fewer features active than asked for: the rest are inactive
            values = torch.nn.functional.pad(values, (0, self.k - k))
            ids = torch.nn.functional.pad(ids, (0, self.k - k))
        return torch.stack([values, torch.where(values > 0, ids.float(), -1.0)])

    def _pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        w, c = self.weights, self.config
        x = x.to(w["W_enc"].dtype)
        if c.normalize_activations == "constant_norm_rescale":
            x = x * (c.d_in ** 0.5 / x.norm(dim=1, keepdim=True))
        elif c.normalize_activations == "layer_norm":
            x = x - x.mean(dim=1, keepdim=True)
            x = x / (x.std(dim=1, keepdim=True) + 1e-5)
        if c.apply_b_dec_to_input:
            x = x - w["b_dec"]
        return torch.addmm(w["b_enc"], x, w["W_enc"])
