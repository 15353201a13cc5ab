"""The Compare tab without Qt: a run's twin pairs (``inspector.experiments.compare``), the pair on
show, and its measures: the first diverging token, per generated token the KL divergence and the
logprob change, and per position the intervened − clean difference of one hook's rows.

A live comparison grows a step at a time, and a token's or a row's measure never changes once both
twins have it: each pair's measures grow by the new tokens and rows alone (``PairMeasures``), so a
repaint with nothing new computes nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from inspector.core.arrays import GrowableArray
from inspector.core.run import HookRows, RequestCapture
from inspector.experiments.compare import Twins, difference, first_divergence, logprob_change, token_kl, twins_of

from .labels import display_token, short_hook_label
from .run_view import RunView

NO_TWINS = ("No comparison in this run. Tick Compare next to Generate, set an intervention in the Interventions "
            "dock, and generate: each prompt then runs twice in one batch, once clean and once with the "
            "interventions, and the two runs are compared here.")
KL_TIP = ("KL(clean ‖ intervened) between the twins' next-token distributions, over the tokens both top-k lists "
          "name plus one bucket for all others: a lower bound of the full KL divergence")
CHANGE_TIP = ("Δ logprob: the clean twin's token, its logprob under the intervened twin minus under the clean "
              "one (none where the intervened twin's top-k list does not name it)")


def _empty(*shape: int, dtype=np.float64):
    return field(default_factory=lambda: np.zeros(shape, dtype))


@dataclass(frozen=True)
class ComparisonShown:
    """What the Compare tab draws for one twin pair, or (``message``) why there is none."""

    message: str = ""
    pairs: tuple[Twins, ...] = ()
    labels: tuple[str, ...] = ()  # one per pair, for the pair selector
    twins: Twins | None = None
    note: str = ""  # in words: where the twins part, or why they do not
    prompt_length: int = 0
    clean_texts: list[str] = field(default_factory=list)  # token texts, prompt then generated
    intervened_texts: list[str] = field(default_factory=list)
    divergence: int | None = None  # the first generated token where the twins differ
    kl: np.ndarray = _empty(0)  # per generated token (NaN: a side has no top-k list)
    logprob_change: np.ndarray = _empty(0)  # per generated token (NaN: the intervened top-k list lacks it)
    hook_label: str = ""
    diff_source: tuple = ()  # names the growing difference below (the heatmap pools it incrementally)
    diff_positions: np.ndarray = _empty(0, dtype=np.int64)
    diff_values: np.ndarray = _empty(0, 0, dtype=np.float32)  # [positions, width]: intervened − clean
    marks: np.ndarray = _empty(0, dtype=np.int8)  # the intervened twin's intervention marks (RunView's)

    def token_positions(self) -> np.ndarray:
        """The position of each generated token (the strip's x)."""
        return self.prompt_length + np.arange(len(self.kl))

    def describe(self, k: int) -> str:
        """The strip's read-out of generated token ``k``: both twins' tokens and the two measures."""
        if not 0 <= k < len(self.kl):
            return ""

        def token(texts):
            i = self.prompt_length + k
            return repr(display_token(texts[i])) if i < len(texts) else "(ended)"

        kl, change = self.kl[k], self.logprob_change[k]
        return (f"token {k} (position {self.prompt_length + k}): {token(self.clean_texts)} clean, "
                f"{token(self.intervened_texts)} intervened · KL ≥ {'n/a' if np.isnan(kl) else f'{kl:.4g}'}"
                f" · Δ logprob {'n/a' if np.isnan(change) else f'{change:+.4g}'}")


class PairMeasures:
    """One twin pair's per-token measures and per-hook differences, grown by what is new."""

    _serials = itertools.count()

    def __init__(self):
        self.serial = next(self._serials)  # tells one pair's growing difference from another's
        self._kl = GrowableArray(np.float64)
        self._change = GrowableArray(np.float64)
        self._diffs: dict[str, tuple[GrowableArray, GrowableArray]] = {}

    def tokens(self, clean: RequestCapture, intervened: RequestCapture) -> tuple[np.ndarray, np.ndarray]:
        """(KL, logprob change) per generated token both twins have."""
        for measure, out in ((token_kl, self._kl), (logprob_change, self._change)):
            done = len(out)
            out.append(measure(_generated_from(clean, done), _generated_from(intervened, done)))
        return self._kl.view(), self._change.view()

    def difference(self, hook: str, clean: HookRows, intervened: HookRows) -> tuple[np.ndarray, np.ndarray]:
        """(positions, intervened − clean) of ``hook`` at the positions both twins have rows for."""
        if hook not in self._diffs:
            self._diffs[hook] = GrowableArray(np.int64), GrowableArray(np.float32, (clean.width,))
        positions, values = self._diffs[hook]
        after = int(positions.view()[-1]) + 1 if len(positions) else 0
        a, b = (int(np.searchsorted(rows.positions, after)) for rows in (clean, intervened))
        if a < len(clean) and b < len(intervened):
            new_positions, new_values = difference(_rows_from(clean, a), _rows_from(intervened, b))
            positions.append(new_positions)
            values.append(new_values)
        return positions.view(), values.view()


class Comparisons:
    """The comparisons of the run on show, kept between repaints: a repaint computes only what is new."""

    def __init__(self):
        self._view: RunView | None = None
        self._measures: dict[Twins, PairMeasures] = {}

    def show(self, view: RunView, hook: str | None) -> ComparisonShown:
        """The pair holding the selected request (else the run's first pair), with the difference at the
        hook point its intervention is on (``hook``, the one selected in the window, where none of those
        was captured)."""
        if view is not self._view:
            self._view, self._measures = view, {}
        pairs = tuple(twins_of(view.run))
        if not pairs:
            return ComparisonShown(NO_TWINS)
        chosen = view.selection.request
        twins = next((t for t in pairs if chosen in (t.clean, t.intervened)), pairs[0])
        clean, intervened = view.request(twins.clean), view.request(twins.intervened)
        measures = self._measures.setdefault(twins, PairMeasures())
        kl, change = measures.tokens(clean, intervened)
        divergence = first_divergence(clean, intervened)
        hook = intervened_hook(clean, intervened) or hook
        if hook in clean.hooks and hook in intervened.hooks:
            diff_positions, diff_values = measures.difference(hook, clean.hooks[hook], intervened.hooks[hook])
        else:
            diff_positions, diff_values = np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        info = view.hook_info(hook)
        return ComparisonShown(
            pairs=pairs, labels=tuple(_label(view, t) for t in pairs), twins=twins,
            note=_note(clean, intervened, divergence), prompt_length=len(clean.prompt_token_ids),
            clean_texts=list(clean.token_texts), intervened_texts=list(intervened.token_texts),
            divergence=divergence, kl=kl, logprob_change=change, hook_label=short_hook_label(info) if info else "",
            diff_source=(measures.serial, hook), diff_positions=diff_positions, diff_values=diff_values,
            marks=view.intervention_marks(twins.intervened, hook, len(intervened.token_texts)))


def intervened_hook(clean: RequestCapture, intervened: RequestCapture) -> str | None:
    """The first hook point an intervention on the intervened twin acted at that both twins captured
    (None: no such hook point)."""
    for _, interventions in intervened.intervention_log:
        for iv in interventions:
            if iv["hook"] in clean.hooks and iv["hook"] in intervened.hooks:
                return iv["hook"]
    return None


def _label(view: RunView, twins: Twins) -> str:
    prompt = (view.request(twins.clean).prompt or "").replace("\n", "↵")
    return f"{twins.clean} ↔ {twins.intervened} · {prompt[:40]}{'…' if len(prompt) > 40 else ''}"


def _note(clean: RequestCapture, intervened: RequestCapture, divergence: int | None) -> str:
    if not any(active for _, active in intervened.intervention_log):
        return ("No intervention reached the intervened twin, so the twins agree: set one in the Interventions "
                "dock and generate again.")
    if divergence is None:
        return f"The twins agree on all {len(clean.generated_token_ids)} generated tokens."
    texts = [repr(display_token(req.token_texts[len(req.prompt_token_ids) + divergence]))
             if divergence < len(req.generated_token_ids) else "nothing (it ended)" for req in (clean, intervened)]
    return (f"The twins part at generated token {divergence} (position {len(clean.prompt_token_ids) + divergence}):"
            f" {texts[0]} clean, {texts[1]} intervened.")


def _generated_from(req: RequestCapture, start: int) -> RequestCapture:
    """``req`` from its generated token ``start`` on: what the per-token measures read of it."""
    return replace(req, generated_token_ids=req.generated_token_ids[start:], logprobs=req.logprobs[start:],
                   top_logprobs=req.top_logprobs[start:])


def _rows_from(rows: HookRows, start: int) -> HookRows:
    """A copy of ``rows`` from row ``start`` on (a reopened capture's are read from the file here)."""
    tail = HookRows(rows.width, max(len(rows) - start, 1))
    tail.append(rows.positions[start:], rows.token_ids[start:], np.asarray(rows.values[start:], np.float32))
    return tail
