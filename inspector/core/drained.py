"""What a drain of the engine's workers gives the driver for one request: its rows by hook, the
strongest features of its attached SAEs and its token scores, each a field of its own (no hook name
stands for a feature or a score)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import NamedTuple

import numpy as np

from .portable import from_portable

ROW_KEYS = ("positions", "token_ids", "values")
DrainedRows = MutableMapping[str, dict[str, np.ndarray]]  # hook -> positions [n], token_ids [n], values [n, width]
Features = tuple[np.ndarray, np.ndarray, np.ndarray]  # positions [n], ids [n, k] int32, activations [n, k] float32
Scores = tuple[np.ndarray, np.ndarray]  # positions [n], logprobs [n, score tokens]


class DrainedRequest(NamedTuple):
    """One request's captures since the last drain."""

    rows: DrainedRows  # the plugin's rows are made when read (``plugin.gather.RequestRows``)
    features: dict[str, Features]  # by attached SAE
    scores: Scores | None  # a scored request's (``Sampling.score_token_ids``)


def drain_from_portable(reply: dict[str, dict[str, dict[str, list]]]) -> dict[str, DrainedRequest]:
    """A worker's portable drain (vLLM's own RPC, which carries rows alone, each array a
    ``capture.portable`` value) as drained requests; the arrays are views of the reply's bytes."""
    return {rid: DrainedRequest({hook: {key: from_portable(found[key]) for key in ROW_KEYS}
                                 for hook, found in hooks.items()}, {}, None)
            for rid, hooks in reply.items()}
