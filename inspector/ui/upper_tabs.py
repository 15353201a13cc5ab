"""The window's upper tabs: titles short enough that all nine show in full at the default window size
(1440 × 900, docks open), each with a tooltip that says what the tab shows."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTabWidget

# (the window's attribute holding the tab, its title, its tooltip)
UPPER_TABS = (
    ("heatmap", "Heatmap", "Tokens × features: the selected hook point's activations, token by token"),
    ("summary", "Layers", "Layers × tokens: one measure of every residual-stream hook point per token"),
    ("lens_view", "Lens", "The logit lens: what each layer predicts comes next"),
    ("attention_view", "Attention", "Attention patterns of a layer's heads"),
    ("experts_view", "Experts", "Which experts of a mixture-of-experts layer each token was routed to"),
    ("features_view", "Features", "What an attached sparse autoencoder reads in each token"),
    ("dashboard_view", "Dashboard", "A corpus scan's features and their top examples"),
    ("patching_view", "Patching", "Activation patching: layers × positions"),
    ("compare_view", "Compare", "A prompt's clean and intervened twins side by side"),
)


def upper_tabs(window) -> QTabWidget:
    """The tab widget of the window's views (each an attribute of ``window`` named in ``UPPER_TABS``).
    Titles are never elided: a cut title ("Co…") behind scroll arrows reads as nothing."""
    tabs = QTabWidget()
    tabs.tabBar().setElideMode(Qt.TextElideMode.ElideNone)
    for name, title, tip in UPPER_TABS:
        tabs.setTabToolTip(tabs.addTab(getattr(window, name), title), tip)
    return tabs
