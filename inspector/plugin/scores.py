"""Token scores on the worker: the logprobs of the tokens a request asked to score (its
``score_token_ids``), read from the model's logits of every forward at the request's last row and kept
until the driver drains them. Host-side bookkeeping beside the runtime's hooks: logits are no hook
point's rows."""

from __future__ import annotations

import numpy as np
import torch

from inspector.core.drained import Scores

from .vllm_compat import StepInfo


class TokenScores:
    """Per scored request, the token ids it wants scored and the scores not drained yet."""

    def __init__(self):
        self.wanted: dict[str, np.ndarray] = {}  # request -> tokens whose logprobs it wants
        self._found: dict[str, list[tuple[int, np.ndarray]]] = {}  # undrained: request -> (position, logprobs)

    def forget(self, rid: str) -> None:
        self.wanted.pop(rid, None)

    def set(self, rid: str, token_ids) -> None:
        """The tokens ``rid`` wants scored (none: it stops being scored)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if len(ids):
            self.wanted[rid] = ids
        else:
            self.wanted.pop(rid, None)

    def read(self, step: StepInfo, logits: torch.Tensor) -> None:
        """A forward's logits, one row per request (its last row): keep the logprobs of the tokens each
        scored request asked for. Rows that are not one per request (prompt logprobs) are left alone."""
        if not self.wanted or logits.shape[0] != len(step.req_ids):
            return
        wanted = [i for i, rid in enumerate(step.req_ids) if rid in self.wanted]
        if not wanted:
            return
        ids = [self.wanted[step.req_ids[i]] for i in wanted]
        index = np.zeros((len(ids), max(len(a) for a in ids)), dtype=np.int64)
        for j, a in enumerate(ids):
            index[j, :len(a)] = a
        with torch.inference_mode():
            rows = torch.as_tensor(wanted, device=logits.device)
            logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
            picked = logprobs.gather(1, torch.from_numpy(index).to(logits.device)).cpu().numpy()
        ends = step.query_start_loc[1:] - 1
        for j, i in enumerate(wanted):
            self._found.setdefault(step.req_ids[i], []).append((int(step.positions[ends[i]]), picked[j, :len(ids[j])]))

    def take(self) -> dict[str, Scores]:
        """The scores since the last call: request -> (positions, values [positions, its tokens])."""
        found, self._found = self._found, {}
        return {rid: (np.array([p for p, _ in rows], dtype=np.int64), np.stack([v for _, v in rows]))
                for rid, rows in found.items()}
