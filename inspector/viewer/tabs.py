"""What each tab of the window's upper area draws, decided without Qt: one presenter per tab.

The window keeps one list of (tab, presenter) (``inspector.ui.painting``) and repaints only the tab on
show: it asks that tab's presenter to ``show(view, request)`` and hands what comes back to the tab's
``draw``. The Dashboard and Patching tabs draw a scan and a sweep instead of the run on show, so they
have none. A presenter reads the tab's own choices (a layer, an SAE, a measure) through the few methods
its protocol below names, and offers the tab the choices the run has (``set_layers``, ``set_kinds``),
so a tab keeps the one chosen while it is still there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .app_state import Action, AppState
from .attention import AttentionPatterns, AttentionShown, attention_layers
from .compare import ComparisonShown, Comparisons
from .features import FeaturesShown, clamp_refusal, show_features
from .labels import short_hook_label
from .lens import LensGrid, lens_hooks, lens_kinds
from .routing import ExpertsShown, router_layers, show_experts
from .run_view import RunView

if TYPE_CHECKING:
    from .controller import Controller


class Presenter(Protocol):
    def show(self, view: RunView, request: TabRequest) -> object:
        """What the tab draws (the argument of its ``draw``)."""


@dataclass(frozen=True)
class TabRequest:
    """What a presenter is asked with besides the run on show."""

    tab: object  # the tab's widget: its choices, read through the presenter's protocol
    texts: list[str]  # the selected request's token texts
    marks: np.ndarray | None  # where interventions were active, per position (heatmap track)
    empty: str | None  # why the live run has nothing to show yet (None: it has requests)
    live: bool  # the live run generates: rows are arriving


# ---------------------------------------------------------------- Tokens × features
@dataclass(frozen=True)
class HeatmapDrawing:
    label: str  # the hook's short label ("" without one)
    width: int  # its feature count (0 without one)
    rows: tuple[np.ndarray, np.ndarray] | None  # (positions, values); None: no rows at this hook
    texts: list[str]
    source_id: tuple | None  # changes when the rows come from another array
    marks: np.ndarray | None


class HeatmapPresenter:
    def show(self, view: RunView, request: TabRequest) -> HeatmapDrawing:
        sel = view.selection
        rows, info = view.rows(sel.request, sel.hook), view.hook_info(sel.hook)
        source_id = None if rows is None else (id(view), sel.request, sel.hook,
                                               id(view.request(sel.request).hooks.get(sel.hook)))
        return HeatmapDrawing(short_hook_label(info) if info else "", info.width if info else 0, rows,
                              request.texts, source_id, request.marks)


# ---------------------------------------------------------------- Layers × tokens
class SummaryChoices(Protocol):
    def measure(self) -> tuple[str, int]: ...

    def kinds(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class SummaryDrawing:
    rows: list[tuple[str, np.ndarray, np.ndarray]]  # (label, positions, values) per hook, top to bottom
    texts: list[str]


class SummaryPresenter:
    def show(self, view: RunView, request: TabRequest) -> SummaryDrawing:
        tab: SummaryChoices = request.tab
        measure, feature = tab.measure()
        return SummaryDrawing(view.summary_rows(view.selection.request, tab.kinds(), measure, feature), request.texts)


# ---------------------------------------------------------------- Lens
class LensChoices(Protocol):
    def set_kinds(self, kinds: list[str]) -> str | None: ...


@dataclass(frozen=True)
class LensDrawing:
    grid: LensGrid | None
    message: str | None  # why there are no cells (instead of the grid)
    position: int | None = None  # the token selected in the window (a column: the grid's columns are positions)


class LensPresenter:
    def __init__(self, app: Controller):
        self.app = app

    def show(self, view: RunView, request: TabRequest) -> LensDrawing:
        """Asks for the lens of the rows not lensed yet (``follow_lens``), and draws what there is."""
        tab: LensChoices = request.tab
        rid, experiments = view.selection.request, self.app.experiments
        captured = view.hooks_for(rid)
        hooks = lens_hooks(captured, tab.set_kinds(lens_kinds(captured)))
        experiments.follow_lens(view, rid, hooks)
        message = request.empty or experiments.lens_message(view, rid, hooks)
        return LensDrawing(None if message else view.lens.grid(view.run, rid, hooks), message, view.selection.position)


# ---------------------------------------------------------------- Attention
class AttentionChoices(Protocol):
    def set_layers(self, layers: list[int]) -> int | None: ...

    def head(self) -> int: ...


@dataclass(frozen=True)
class AttentionDrawing:
    shown: AttentionShown
    can_capture: bool  # the engine can capture what a message says is missing
    live: bool


class AttentionPresenter:
    def __init__(self, app: Controller):
        self.app = app
        self.patterns = AttentionPatterns()  # kept between repaints: only new rows are computed

    def show(self, view: RunView, request: TabRequest) -> AttentionDrawing:
        """The chosen layer and head, and the selected token's weights (the newest token's while none is)."""
        tab: AttentionChoices = request.tab
        engine, rid, on_live = self.app.engine, view.selection.request, view is self.app.runs.live
        layer = tab.set_layers(attention_layers(view.hooks_for(rid)))
        capturing = engine.info.installed if engine.info is not None and on_live else ()
        shown = AttentionShown(request.empty) if request.empty else self.patterns.show(
            view, rid, layer, tab.head(), view.selection.position, capturing)
        return AttentionDrawing(shown, on_live and engine.enabled(Action.EDIT_HOOKS), request.live)


# ---------------------------------------------------------------- Experts
class ExpertsChoices(Protocol):
    def set_layers(self, layers: list[int]) -> int | None: ...


class ExpertsPresenter:
    def show(self, view: RunView, request: TabRequest) -> ExpertsShown:
        """The chosen layer's routing of the shown request."""
        tab: ExpertsChoices = request.tab
        rid = view.selection.request
        layer = tab.set_layers(router_layers(view.hooks_for(rid)))
        return ExpertsShown(request.empty) if request.empty else show_experts(view, rid, layer)


# ---------------------------------------------------------------- Features
class FeaturesChoices(Protocol):
    def sae(self) -> str | None: ...


@dataclass(frozen=True)
class FeaturesDrawing:
    shown: FeaturesShown
    position: int | None  # the token selected in the window
    can_detach: bool  # the SAE shown is attached now, and the engine is idle
    can_steer: bool  # the SAE shown is attached now
    clamp_refusal: str = ""  # why its features cannot be clamped now ("" when they can)


class FeaturesPresenter:
    def __init__(self, app: Controller):
        self.app = app

    def show(self, view: RunView, request: TabRequest) -> FeaturesDrawing:
        """The chosen SAE's features of the shown request."""
        tab: FeaturesChoices = request.tab
        engine = self.app.engine
        attached = engine.info.saes if engine.info is not None and view is self.app.runs.live else {}
        if request.empty and engine.state not in (AppState.READY, AppState.GENERATING, AppState.PATCHING):
            shown = FeaturesShown(request.empty)  # no engine to attach an SAE to: say how to get one
        else:
            shown = show_features(view, view.selection.request, tab.sae(), attached, self.app.runs.labels)
        is_attached = shown.sae in attached
        return FeaturesDrawing(shown, view.selection.position, is_attached and engine.enabled(Action.EDIT_SAES),
                               is_attached, clamp_refusal(attached[shown.sae], engine.info.options.feature_clamps)
                               if is_attached else "")


# ---------------------------------------------------------------- Compare
@dataclass(frozen=True)
class CompareDrawing:
    shown: ComparisonShown
    live: bool


class ComparePresenter:
    def __init__(self):
        self.comparisons = Comparisons()  # kept between repaints: only new tokens and rows are computed

    def show(self, view: RunView, request: TabRequest) -> CompareDrawing:
        return CompareDrawing(self.comparisons.show(view, view.selection.hook), request.live)
