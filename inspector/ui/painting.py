"""Painting the window's views from the run on show, decoupled from the token rate: step events only
grow the run; a timer repaints the views from it if anything changed, the upper (the tab on show) and
lower (tokens or text) views on alternate ticks, each about 30 times a second, so painting never keeps
pace with tokens one by one and no turn of the event loop paints everything at once. The upper tab on
show draws what its presenter (``inspector.viewer.tabs``) decides.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QSignalBlocker, Qt, QTimer
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QWidget

from inspector.viewer.app_state import EMPTY_TEXT, AppState, stage_text
from inspector.viewer.tabs import (AttentionPresenter, ComparePresenter, ExpertsPresenter, FeaturesPresenter,
                                   HeatmapPresenter, LensPresenter, Presenter, SummaryPresenter, TabRequest)

from .view_kit import clear_readout

PAINT_INTERVAL_MS = 16  # alternately the upper and the lower views: each ~30 times a second
UPPER, LOWER = "upper", "lower"  # the tab on show above; the token strip or text below
PROGRESS_INTERVAL_S = 0.1  # QProgressBar.setValue repaints synchronously (~1 ms): ten times a second is enough


class Painter(QObject):
    """A QObject child of the window: the signals it is connected to never outlive it."""

    def __init__(self, window):
        super().__init__(window)
        self.window = window
        w, c = window, window.controller
        # the tabs that draw the run on show, each with its presenter: the tab on show is repainted from it
        self.tab_presenters: list[tuple[QWidget, Presenter]] = [
            (w.heatmap, HeatmapPresenter()), (w.summary, SummaryPresenter()), (w.lens_view, LensPresenter(c)),
            (w.attention_view, AttentionPresenter(c)), (w.experts_view, ExpertsPresenter()),
            (w.features_view, FeaturesPresenter(c)), (w.compare_view, ComparePresenter())]
        self._half = UPPER
        self._text_shown: tuple = (None, 0)
        self._strip_key = None
        self._progress_shown = 0.0
        self._subject = self._current_subject()
        self.longest_tick_s = 0.0  # the slowest repaint so far (the bench reads it)
        self.invalidate()
        self.timer = QTimer(self, interval=PAINT_INTERVAL_MS)
        self.timer.timeout.connect(self.tick)
        self.timer.start()

    def invalidate(self, *_) -> None:
        self._painted = {UPPER: None, LOWER: None}

    def tick(self) -> None:
        """Repaint from accumulated data, the upper and the lower views on alternate ticks: each view
        ~30 times a second whatever the token rate, and no event-loop turn paints both."""
        t0 = time.perf_counter()
        self._half = LOWER if self._half == UPPER else UPPER
        try:
            self._repaint_views((self._half,))
        finally:
            self.longest_tick_s = max(self.longest_tick_s, time.perf_counter() - t0)

    def refresh(self) -> None:
        """Bring every view up to date now (a selection changed; tests and tools)."""
        self._repaint_views((UPPER, LOWER))

    def _repaint_views(self, halves) -> None:
        w = self.window
        c, view = w.controller, w.shown
        generating = c.engine.state is AppState.GENERATING
        live = generating and view is c.runs.live
        if live != w.heatmap.live:
            w.heatmap.live = live
            self.invalidate()
        if LOWER in halves:
            now = time.perf_counter()
            progress = c.generating.progress
            if generating and progress is not None and now - self._progress_shown >= PROGRESS_INTERVAL_S:
                self._progress_shown = now
                w.prompt.progress.setValue(min(progress.tokens, progress.total))
                w.tokens_label.setText(f"{progress.tokens} tokens · {progress.rate:.0f} tok/s")
                w.stage_label.setText(stage_text(c.engine.state, c.engine.info, progress=progress))
        keys = {UPPER: (id(view), view.revision, view.lens.revision, c.experiments.lens_problem, w.tabs.currentIndex(),
                        view.selection.position),
                LOWER: (id(view), view.revision, w.lower_tabs.currentIndex())}
        halves = [h for h in halves if keys[h] != self._painted[h]]
        if not halves:
            return
        self._painted.update({h: keys[h] for h in halves})
        self._refresh_selectors()
        self.forget_stale()
        sel = view.selection
        rid, hook = sel.request, sel.hook
        texts = view.token_texts(rid)
        marks = view.intervention_marks(rid, hook, len(texts))
        req = view.request(rid)
        if UPPER in halves:
            self._refresh_upper(view, texts, marks)
        if LOWER in halves:
            self._refresh_lower(view, req, texts, marks)

    def _current_subject(self) -> tuple:
        """What read-outs and messages are about: the run on show, its request and hook, the engine session."""
        w = self.window
        return w.shown, w.shown.selection.request, w.shown.selection.hook, w.controller.engine.info

    def forget_stale(self) -> None:
        """Hover read-outs go when the run, request, hook or session they described changes; red messages
        when the run, request or session does (a message about the new one comes after this)."""
        w = self.window
        (view, rid, hook, info), (old_view, old_rid, old_hook, old_info) = self._current_subject(), self._subject
        self._subject = view, rid, hook, info
        same_session, same_request = info is old_info, view is old_view and rid == old_rid
        if same_session and same_request and hook == old_hook:
            return
        for tab, _ in self.tab_presenters:
            clear_readout(tab)
        if not (same_session and same_request):
            w.interventions.clear_message()
        if not same_session:
            w.controller.experiments.sweep.forget_problem()

    def _refresh_upper(self, view, texts: list[str], marks) -> None:
        w = self.window
        c, sel = w.controller, view.selection
        empty = EMPTY_TEXT[c.engine.state] if view is c.runs.live and not view.request_ids() else None
        # while the live run generates, the plots' message stays until rows come (one that changed with
        # the requests' start was laid out again in the first frame of rows)
        awaiting = EMPTY_TEXT[c.engine.state] if view is c.runs.live and c.engine.state is AppState.GENERATING else None
        w.heatmap.set_placeholder(empty or awaiting or "No rows captured at this hook point for this request")
        w.summary.empty_text.want(empty or awaiting or "No residual-stream hook points captured")
        for tab, presenter in self.tab_presenters:
            if tab is w.tabs.currentWidget():
                tab.draw(presenter.show(view, TabRequest(tab, texts, marks, empty, w.heatmap.live)))
        w.heatmap.select_position(sel.position)  # None: no column highlighted

    def _refresh_lower(self, view, req, texts: list[str], marks) -> None:
        """Only the lower tab on show is kept current (a hidden one catches up when it is chosen)."""
        w = self.window
        if w.lower_tabs.currentWidget() is not w.strip:
            self._refresh_text(req)
            return
        strip_key = (id(view), view.selection.request)
        if req is None:
            w.strip.set_tokens([], [], 0, reset=True)
        else:
            w.strip.set_tokens(texts, req.token_ids, len(req.prompt_token_ids), req.logprobs,
                               req.top_logprobs, marks, reset=strip_key != self._strip_key)
        self._strip_key = strip_key

    def _refresh_selectors(self) -> None:
        w = self.window
        view = w.shown
        view.settle_selection()
        sel = view.selection
        ids = view.request_ids()
        current = [w.request_box.itemData(i) for i in range(w.request_box.count())]
        if ids != current or (ids and w.request_box.currentData() != sel.request):
            with QSignalBlocker(w.request_box):
                w.request_box.clear()
                for i, rid in enumerate(ids):
                    label, tip = view.request_choice(rid)
                    w.request_box.addItem(label, rid)
                    w.request_box.setItemData(i, tip, Qt.ItemDataRole.ToolTipRole)
                w.request_box.setToolTip(view.request_choice(sel.request)[1] if sel.request in ids else
                                         "Request (prompt) shown")
                w.request_box.setCurrentIndex(max(w.request_box.findData(sel.request), 0))
            w.interventions.set_requests(ids)
        hooks = view.hooks_for(sel.request)
        names = [h.name for h in hooks]
        current = [w.hook_box.itemData(i) for i in range(w.hook_box.count())]
        if names != current or w.hook_box.currentData() != sel.hook:
            with QSignalBlocker(w.hook_box):
                w.hook_box.clear()
                for h in hooks:
                    w.hook_box.addItem(f"{h.alias}  ·  {h.kind} [{h.width}]", h.name)
                w.hook_box.setCurrentIndex(max(w.hook_box.findData(sel.hook), 0))

    def _refresh_text(self, req) -> None:
        w = self.window
        if req is None:
            if self._text_shown[0] is not None:
                w.text_view.clear()
                self._text_shown = (None, 0)
            return
        n_prompt = len(req.prompt_token_ids)
        generated = "".join(req.token_texts[n_prompt:])
        key = (id(w.shown), req.request_id)
        shown_key, shown_len = self._text_shown
        cursor = QTextCursor(w.text_view.document())
        if shown_key != key or len(generated) < shown_len:
            w.text_view.clear()
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(120, 120, 120))
            cursor.insertText(req.prompt or "".join(req.token_texts[:n_prompt]), fmt)
            shown_len = 0
        if len(generated) > shown_len:
            cursor.movePosition(QTextCursor.MoveOperation.End)
            fmt = QTextCharFormat()
            fmt.setForeground(QColor(10, 10, 10))
            cursor.insertText(generated[shown_len:], fmt)
            w.text_view.ensureCursorVisible()
        self._text_shown = (key, len(generated))
