"""The model's own head on rows a caller hands in: the logit lens, direct logit attribution, logits,
and what the final norm is. Each is one call to the workers, answered by the rank that holds the head;
none of it touches the step loop, so it lives beside the session (mixed into ``Session``), not in it."""

from __future__ import annotations

import numpy as np
import torch

from inspector.core.lens import Attribution, Lens, checked_attribution_request, checked_lens_request


def from_head(per_rank: list[dict]) -> dict:
    """The answer of the rank that holds the model's head (the first tensor-parallel rank of the last
    pipeline stage); the others answer nothing."""
    return next((answer for answer in per_rank if answer), per_rank[0])


class ModelHead:
    """Mixed into ``Session``: needs its ``_llm``, ``catalogue``, ``in_process`` and ``_require_alive``."""

    def lens(self, values, k: int = 5, chosen=None) -> Lens:
        self._require_alive()
        width = next(h.width for h in self.catalogue if h.kind == "normalized")
        vocab = self._llm.llm_engine.model_config.get_vocab_size()
        values, chosen = checked_lens_request(values, k, chosen, width, vocab)
        return Lens.from_arrays(from_head(self._llm.collective_rpc("inspector_lens", args=(values, k, chosen))))

    def attribution(self, values, final_residual, k: int = 5, chosen=None) -> Attribution:
        self._require_alive()
        width = next(h.width for h in self.catalogue if h.kind == "normalized")
        vocab = self._llm.llm_engine.model_config.get_vocab_size()
        values, final_residual, chosen = checked_attribution_request(values, final_residual, k, chosen, width, vocab)
        return Attribution.from_arrays(from_head(self._llm.collective_rpc("inspector_attribution",
                                                                          args=(values, final_residual, k, chosen))))

    def final_norm_kind(self) -> tuple[bool, float]:
        """(centres like LayerNorm, epsilon) of the model's final norm: what its scale of the final
        residual stream (TransformerLens's ``ln_final.hook_scale``) is made of."""
        self._require_alive()
        found = from_head(self._llm.collective_rpc("inspector_final_norm_kind"))
        return found["centred"], found["eps"]

    def logits(self, values) -> np.ndarray:
        """The model's logits of final-norm output rows (``normalized``), float32 [rows, vocab]: its own
        unembedding (tied embeddings, logit scale and soft cap as the model has them)."""
        self._require_alive()
        width = next(h.width for h in self.catalogue if h.kind == "normalized")
        if isinstance(values, torch.Tensor) and self.in_process:  # on the engine's device: they stay there
            if values.ndim != 2 or values.shape[1] != width:
                raise ValueError(f"final-norm rows must be [rows, {width}], got {list(values.shape)}")
        else:
            values, _ = checked_lens_request(values, 1, None, width, self._llm.llm_engine.model_config.get_vocab_size())
        return from_head(self._llm.collective_rpc("inspector_logits", args=(values,)))["logits"]
