"""What the ranks of a parallel engine answer, as one answer: tensor-parallel ranks each hold a slice of
some points' columns, pipeline stages each hold some of the blocks."""

from __future__ import annotations

import numpy as np

from .drained import DrainedRequest


def merge_ranks(per_rank: list[dict[str, DrainedRequest]], sharded: set[str]) -> dict[str, DrainedRequest]:
    """One drain of every rank as one drain: a ``sharded`` hook's column slices side by side in rank order
    (each slice comes from one tensor-parallel rank), every other hook, SAE's features and request's
    scores as the one rank that sends them (a pipeline stage's hooks from that stage)."""
    merged = per_rank[0]
    for of_rank in per_rank[1:]:
        for rid, theirs in of_rank.items():
            mine = merged.get(rid)
            if mine is None:
                merged[rid] = theirs
                continue
            for hook, rows in theirs.rows.items():
                if hook not in mine.rows:
                    mine.rows[hook] = rows
                    continue
                if hook not in sharded or not np.array_equal(mine.rows[hook]["positions"], rows["positions"]):
                    raise RuntimeError(f"request {rid}, hook {hook}: the tensor-parallel ranks sent different rows")
                mine.rows[hook] = {**mine.rows[hook], "values": np.concatenate([mine.rows[hook]["values"],
                                                                                rows["values"]], axis=1)}
            twice = mine.features.keys() & theirs.features.keys()
            if twice or (mine.scores is not None and theirs.scores is not None):
                what = f"SAE {min(twice)}'s features" if twice else "scores"
                raise RuntimeError(f"request {rid}: two ranks sent its {what}")
            merged[rid] = mine._replace(features={**mine.features, **theirs.features},
                                        scores=theirs.scores if mine.scores is None else mine.scores)
    return merged


def merge_descriptions(per_rank: list[dict]) -> dict:
    """Every rank's ``describe()`` as one: each pipeline stage describes the points and modules it holds
    (in rank order, which is the model's order), the tensor-parallel ranks of a stage the same ones. A
    kind is refused only where no stage offers it."""
    merged = dict(per_rank[0])
    points = {}
    for described in per_rank:
        for point in described["hook_points"]:
            points.setdefault(point["name"], point)
    kinds = {point["kind"] for point in points.values()}
    modules = {}
    for described in per_rank:
        for path, kind in described["modules"]:
            modules.setdefault(path, kind)
    merged.update(hook_points=list(points.values()), modules=list(modules.items()),
                  installed={name: point for described in per_rank for name, point in described["installed"].items()},
                  refused={kind: why for described in per_rank for kind, why in described["refused"].items()
                           if kind not in kinds},
                  probe_seconds=max(described["probe_seconds"] for described in per_rank))
    return merged
