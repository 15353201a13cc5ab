"""Compare: each prompt twice in one batch, once clean and once with the interventions, side by side.

The twins share the batch, the prompt and the sampling seed, and differ only in the interventions,
which are scoped to the intervened twin (our per-request slots): the difference between them is the
interventions' effect, nothing else. The measures here are plain numpy on captured runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np

from inspector.core.dtypes import as_float32
from inspector.core.interventions import Intervention
from inspector.core.protocol import Sampling, SessionProtocol, StepEvent
from inspector.core.run import HookRows, RequestCapture, Run, TopToken

ROLES = ("clean", "intervened")


@dataclass(frozen=True)
class Twins:
    """The request ids of one prompt's two runs."""

    clean: str
    intervened: str


def upcoming_twins(session: SessionProtocol, n: int) -> list[Twins]:
    """The twins the next ``compare`` of ``n`` prompts will make."""
    ids = session.upcoming_request_ids(2 * n)
    return [Twins(ids[2 * i], ids[2 * i + 1]) for i in range(n)]


def scoped_to_intervened(interventions: list[Intervention], twins: list[Twins]) -> list[Intervention]:
    """``interventions`` as they apply in a comparison: each one for all requests becomes one per
    intervened twin; one for a given request stays only if that request is an intervened twin."""
    intervened = [t.intervened for t in twins]
    out = []
    for iv in interventions:
        if iv.request_id is None:
            out += [replace(iv, request_id=rid) for rid in intervened]
        elif iv.request_id in intervened:
            out.append(iv)
    return out


def compare(session: SessionProtocol, prompts: list[str], interventions: list[Intervention],
            sampling: Sampling = Sampling()) -> tuple[list[Twins], Iterator[StepEvent]]:
    """Start the twins of every prompt: (the twins, the generation's events). Both twins get one seed
    (``sampling.seed``, else a fresh one), so sampling differs only where the distributions do. To
    change the interventions mid-generation, set ``scoped_to_intervened(new, twins)``."""
    twins = upcoming_twins(session, len(prompts))
    session.set_interventions(scoped_to_intervened(interventions, twins))
    seed = sampling.seed if sampling.seed is not None else random.randrange(2 ** 31)
    events = session.generate([p for p in prompts for _ in ROLES], replace(sampling, seed=seed))
    return twins, _marking(session.run, twins, events)


def _marking(run: Run, twins: list[Twins], events: Iterator[StepEvent]) -> Iterator[StepEvent]:
    for event in events:
        mark_twins(run, twins)
        yield event


def mark_twins(run: Run, twins: list[Twins]) -> None:
    """Note in ``run`` which of its requests are twins (kept in capture files)."""
    for t in twins:
        for role, rid, other in (("clean", t.clean, t.intervened), ("intervened", t.intervened, t.clean)):
            if rid in run.requests:
                run.requests[rid].twin_role, run.requests[rid].twin_of = role, other


def twins_of(run: Run) -> list[Twins]:
    """The twins a run holds, in request order."""
    return [Twins(req.twin_of, rid) for rid, req in run.requests.items()
            if req.twin_role == "intervened" and req.twin_of in run.requests]


def first_divergence(clean: RequestCapture, intervened: RequestCapture) -> int | None:
    """The index of the first generated token where the twins differ; None if they agree throughout."""
    for k, (a, b) in enumerate(zip(clean.generated_token_ids, intervened.generated_token_ids)):
        if a != b:
            return k
    n, m = len(clean.generated_token_ids), len(intervened.generated_token_ids)
    return None if n == m else min(n, m)


def token_kl(clean: RequestCapture, intervened: RequestCapture) -> np.ndarray:
    """Per generated token: KL(clean ‖ intervened) between the next-token distributions, over the
    tokens both top lists name plus one bucket for all others. Merging tokens into a bucket never
    raises a KL, so this is a lower bound of the full one. NaN where a side has no top list."""
    n = min(len(clean.top_logprobs), len(intervened.top_logprobs))
    out = np.full(n, np.nan)
    for k in range(n):
        p, q = _probs(clean.top_logprobs[k]), _probs(intervened.top_logprobs[k])
        shared = sorted(p.keys() & q.keys())
        if not p or not q:
            continue
        pp = np.array([p[t] for t in shared] + [max(0.0, 1.0 - sum(p[t] for t in shared))])
        qq = np.array([q[t] for t in shared] + [max(0.0, 1.0 - sum(q[t] for t in shared))])
        keep = pp > 0
        out[k] = float(np.sum(pp[keep] * (np.log(pp[keep]) - np.log(np.maximum(qq[keep], 1e-30)))))
    return out


def logprob_change(clean: RequestCapture, intervened: RequestCapture) -> np.ndarray:
    """Per generated token of the clean twin: its logprob under the intervened twin minus under the
    clean one, at the same step (NaN where the intervened twin's top list does not name it)."""
    n = min(len(clean.logprobs), len(intervened.top_logprobs))
    out = np.full(n, np.nan)
    for k in range(n):
        token = clean.generated_token_ids[k]
        q = {t.token_id: t.logprob for t in intervened.top_logprobs[k]}
        if k < len(intervened.generated_token_ids) and intervened.generated_token_ids[k] == token:
            q.setdefault(token, intervened.logprobs[k])
        if token in q:
            out[k] = q[token] - clean.logprobs[k]
    return out


def difference(clean: HookRows, intervened: HookRows) -> tuple[np.ndarray, np.ndarray]:
    """(positions, intervened − clean) at the positions both twins have rows for, in order."""
    a = {int(p): k for k, p in enumerate(clean.positions)}
    b = {int(p): k for k, p in enumerate(intervened.positions)}
    positions = np.array(sorted(a.keys() & b.keys()), dtype=np.int64)
    if not len(positions):
        return positions, np.zeros((0, clean.width), np.float32)
    rows_a = as_float32(np.asarray(clean.values)[[a[p] for p in positions.tolist()]])
    rows_b = as_float32(np.asarray(intervened.values)[[b[p] for p in positions.tolist()]])
    return positions, rows_b - rows_a


def _probs(top: list[TopToken]) -> dict[int, float]:
    return {t.token_id: float(np.exp(t.logprob)) for t in top}
