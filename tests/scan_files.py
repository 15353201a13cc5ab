"""Corpus scans without an engine: ``synthetic_scan`` fills a ``ScanState`` through ``state.add`` as a
scan of an SAE's features would (each feature fires on a few tokens of a Python-like vocabulary, its
strength depending on the feature), and ``write_synthetic_scan`` saves it with ``write_scan``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from inspector.experiments.scan import ScanState
from inspector.io.scan import write_scan

WORDS = [" def", " class", " return", " self", " import", " from", " for", " in", " if", " else", " None", " True",
         "(", ")", ":", ",", ".", " =", " ==", "\n", "    ", " x", " y", " value", " name", " path", " open", " len",
         " range", " list", " dict", "[", "]", " 0", " 1", "_", "__", "init", "\"", " #", " with", " as", " not",
         " and", " or", " is", " lambda", " yield", " try", " except", " raise", " print", "'", " str", " int"]
VOCABULARY = dict(enumerate(WORDS))
DORMANT = 40  # features from here on never fire


def synthetic_scan(units: int = 64, top: int = 6, documents: int = 30, length: int = 48, seed: int = 0,
                   done: int | None = None) -> tuple[ScanState, dict]:
    """(the state, what it was scanned over): feature u < DORMANT fires on tokens u % V and (u * 7 + 3) % V,
    the first more often and more strongly; ``done``: documents scanned of ``documents`` (all if None)."""
    rng = np.random.default_rng(seed)
    state = ScanState(units, top)
    for document in range(documents if done is None else done):
        tokens = rng.integers(0, len(WORDS), length)
        hits_units, hits_acts, hits_positions = [], [], []
        for unit in range(min(units, DORMANT)):
            main, other = unit % len(WORDS), (unit * 7 + 3) % len(WORDS)
            for position in np.flatnonzero((tokens == main) | (tokens == other)).tolist():
                strength = (1.0 if tokens[position] == main else 0.8) * (3.0 + unit / 10)
                hits_units.append(unit)
                hits_acts.append(strength * rng.uniform(0.5, 1.0))
                hits_positions.append(position)
        state.add(np.asarray(hits_units), np.asarray(hits_acts), document, np.asarray(hits_positions), tokens)
        state.documents_done += 1
        state.tokens_done += length
    state.flush()  # as a scan does after each batch
    return state, {"model": "demo", "corpus": "/corpora/python.txt", "documents": documents,
                   "hook": "blocks.1.hook_resid_post", "sae": None, "sae_k": 16, "top": top}


def write_synthetic_scan(path: Path, sae: dict | None = None, **kw) -> tuple[ScanState, dict]:
    """The scan written to ``path``; ``sae``: the SAE's config (``SaeConfig.as_dict()``), None: neurons."""
    state, settings = synthetic_scan(**kw)
    settings["sae"] = sae
    write_scan(state, settings, VOCABULARY, path)
    return state, settings
