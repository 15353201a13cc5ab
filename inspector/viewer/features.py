"""The Features tab without Qt: an attached sparse autoencoder's features of one request, as the engine
sent them (each token's ``k`` strongest, ``capture.run.FeatureRows``), laid out as the features that
are strongest anywhere in the request × its tokens, named by their labels where the SAE has any
(``feature_labels``), and in words why there is nothing to show when there is nothing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inspector.core.sae import AttachedSae
from inspector.core.sae import clamp_refusal as sae_clamp_refusal

from .feature_labels import NO_LABELS, FeatureLabels, LabelBook, feature_label
from .labels import display_token
from .run_view import RunSource, RunView

ACTIVATION = "activation"  # the grid's one mode (``cell_grid.Cells`` passes one through)
MAX_ROWS = 40  # more rows than fit on a screen only hide the strongest ones below the fold
NO_SAE = ("Attach an SAE to see its features: Engine ▸ Attach SAE…, or with the demo model "
          "Engine ▸ Attach Demo SAE")


class FeatureGrid:
    """What the Features tab draws: a row per feature (the request's strongest, by their largest
    activation), a column per token (``cell_grid.Cells``). Cell (r, c) is the activation of feature r at
    the token of column c, 0 where it is not among that token's ``k`` strongest (left blank: it is 0 there
    if the token has fewer than k active features, else only known to be no larger than the k-th's)."""

    def __init__(self, sae: str, positions, ids, activations, texts: list[str], max_rows: int = MAX_ROWS,
                 names: dict[int, str] | None = None):
        """``names``: the features' labels, where there are any."""
        self.sae, self.texts, self.names = sae, texts, names or {}
        self.positions = np.asarray(positions, np.int64)
        self.ids = np.asarray(ids, np.int32)  # [tokens, k], -1 where fewer were active
        self.activations = np.asarray(activations, np.float32)  # [tokens, k], strongest first
        self.features = strongest_features(self.ids, self.activations, max_rows)
        self.labels = [self.label_of(f) for f in self.features.tolist()]
        self.dense, self.ranks = _place(self.features, self.ids, self.activations)
        self.peak = float(self.dense.max()) if self.dense.size else 0.0

    @property
    def shape(self) -> tuple[int, int]:
        return self.dense.shape

    @property
    def k(self) -> int:
        return self.ids.shape[1]

    def label_of(self, feature: int) -> str:
        """Any feature's, shown or not."""
        return feature_label(feature, self.names)

    def row_of(self, feature: int | None) -> int | None:
        hits = np.flatnonzero(self.features == feature) if feature is not None else ()
        return int(hits[0]) if len(hits) else None

    def column_of(self, position: int | None) -> int | None:
        hits = np.flatnonzero(self.positions == position) if position is not None else ()
        return int(hits[0]) if len(hits) else None

    def colour_values(self, mode: str) -> np.ndarray:
        """0..1 of the largest activation shown; NaN (blank) where a feature is not among a token's strongest."""
        return np.where(self.ranks >= 0, self.dense / max(self.peak, 1e-12), np.nan)

    def cell_text(self, mode: str, r: int, c: int) -> str:
        return f"{self.dense[r, c]:.2f}" if self.ranks[r, c] >= 0 else ""

    def input(self, c: int) -> str:
        p = int(self.positions[c])
        return display_token(self.texts[p]) if p < len(self.texts) else f"@{p}"

    def describe(self, r: int, c: int) -> str:
        head = f"{self.input(c)!r} (position {int(self.positions[c])}): feature {self.labels[r]}"
        rank, active = int(self.ranks[r, c]), int((self.ids[c] >= 0).sum())
        if rank >= 0:
            return f"{head} = {self.dense[r, c]:.3f}, #{rank + 1} of this token's strongest"
        if active < self.k:  # all of its active features arrived: this one is 0 there
            return f"{head} is not active (this token has {active} active features)"
        return f"{head} is not among this token's {self.k} strongest"

    def token_features(self, c: int) -> list[tuple[int, float]]:
        """(feature, activation) of the token at column ``c``'s strongest features, strongest first."""
        active = self.ids[c] >= 0
        return list(zip(self.ids[c][active].tolist(), self.activations[c][active].tolist()))

    def trace(self, feature: int) -> np.ndarray:
        """``feature``'s activation at every token (0 where it is not among the token's strongest);
        any feature, not only the rows'."""
        return np.where(self.ids == feature, self.activations, 0).sum(axis=1).astype(np.float32)


def strongest_features(ids: np.ndarray, activations: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` features with the largest activation anywhere in ``ids``/``activations``, largest first
    (ties: the lower id first)."""
    active = ids >= 0
    features, where = np.unique(ids[active], return_inverse=True)
    peaks = np.zeros(len(features), np.float32)
    np.maximum.at(peaks, where, activations[active])
    return features[np.lexsort((features, -peaks))][:n].astype(np.int64)


def _place(features: np.ndarray, ids: np.ndarray, activations: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([rows, tokens] activations, 0 where absent; [rows, tokens] rank among the token's strongest, -1
    where absent) of ``features``, found by a sorted search rather than a row × token × k comparison."""
    tokens, k = ids.shape
    dense = np.zeros((len(features), tokens), np.float32)
    ranks = np.full((len(features), tokens), -1, np.int64)
    if not len(features):
        return dense, ranks
    order = np.argsort(features)
    flat = ids.ravel().astype(np.int64)
    at = np.minimum(np.searchsorted(features[order], flat), len(features) - 1)
    hit = features[order][at] == flat
    rows, cells = order[at[hit]], np.flatnonzero(hit)
    dense[rows, cells // k] = activations.ravel()[hit]
    ranks[rows, cells // k] = cells % k
    return dense, ranks


@dataclass(frozen=True)
class FeaturesShown:
    message: str  # why there is no grid ("" when there is)
    saes: tuple[str, ...] = ()  # the SAEs there is something of to show (or that are attached)
    sae: str | None = None
    grid: FeatureGrid | None = None
    about: str = ""  # what the SAE shown reads, where that is known
    path: str = ""  # the SAE's directory, where known
    labels: FeatureLabels = NO_LABELS


def show_features(view: RunView, rid: str | None, sae: str | None,
                  attached: dict[str, AttachedSae] | None = None, book: LabelBook | None = None) -> FeaturesShown:
    """The features of SAE ``sae`` (the first there is when it has none) for request ``rid``.
    ``attached``: the SAEs the engine encodes the live run's rows with now (none for any other run);
    ``book``: where the features' labels are found."""
    attached = attached or {}
    req = view.request(rid)
    captured = tuple(req.features) if req is not None else ()
    saes = tuple(dict.fromkeys((*attached, *captured)))
    if not saes:
        return FeaturesShown(_no_saes(view))
    sae = sae if sae in saes else saes[0]
    described = {**recorded_saes(view), **attached}
    path = described[sae].config.path if sae in described else ""
    labels = book.for_sae(path) if book is not None and path else NO_LABELS
    about = " · ".join(part for part in (describe_sae(described[sae], view) if sae in described else "",
                                         labels.describe()) if part)
    if req is None:
        return FeaturesShown(f"SAE {sae} is attached: generate to see its features", saes, sae, about=about, path=path,
                             labels=labels)
    rows = req.features.get(sae)
    if rows is None or not len(rows):
        why = (f"No features of SAE {sae} for request {rid} yet: they are computed for the tokens generated "
               "after it was attached, so generate to see them" if sae in attached
               else f"Request {rid} has no features of SAE {sae} (it was not attached while it ran)")
        return FeaturesShown(why, saes, sae, about=about, path=path, labels=labels)
    grid = FeatureGrid(sae, rows.positions, rows.ids, rows.activations, view.token_texts(rid), names=labels.names)
    return FeaturesShown("", saes, sae, grid, about or f"top {rows.k} per token", path, labels)


def recorded_saes(view: RunView) -> dict[str, AttachedSae]:
    """The SAEs the run's metadata lists (``saes``: what its features come from), by name; an entry
    that does not parse (a file written by something else) is left out."""
    recorded = {}
    for entry in view.run.metadata.get("saes") or ():
        try:
            sae = AttachedSae.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            continue
        recorded[sae.name] = sae
    return recorded


def describe_sae(sae: AttachedSae, view: RunView) -> str:
    """Where it reads, how wide it is, how many of each token's features arrive."""
    info = view.hook_info(sae.hook)
    return f"{info.alias if info else sae.hook} · {sae.config.d_sae} features · top {sae.k} per token"


def _no_saes(view: RunView) -> str:
    if view.source is RunSource.FILE:
        return "This capture holds no SAE features (no SAE was attached while it was captured)"
    if view.source is RunSource.EARLIER:
        return "No SAE was attached while this run was captured, so it has no features to show"
    return NO_SAE


NO_CLAMP_ROOM = ("the engine was booted without room for feature clamps: Engine ▸ Room for Feature Clamps…, "
                 "then restart it")


def clamp_refusal(attached: AttachedSae, room: int) -> str:
    """Why the engine would refuse a clamp of ``attached``'s features ("" when it would not): the SAE's
    kind, or an engine booted with no room for clamps (``room``: the clamps it holds per hook)."""
    return sae_clamp_refusal(attached.config) or ("" if room else NO_CLAMP_ROOM)
