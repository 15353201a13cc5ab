"""The Dashboard tab and feature labels in the real window on the fake engine: File ▸ Open Scan… shows a
scan's active units strongest first, filtered by id or label, a unit's examples as text with the
activating token marked and its histogram as the file counts it; a file that is not a scan is an error
dialog with the reason; the Features tab names features by the scan.h5 in the SAE's directory, by a scan
of that SAE the user opened, or by its labels.json, and a feature clicked there is selected on the
Dashboard; Engine ▸ Attach Demo SAE attaches the shipped SAE when the demo model runs."""

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QFont, QFontMetrics
from PySide6.QtWidgets import QFileDialog

from inspector.core import resources
from inspector.core.sae import read_sae
from inspector.experiments.scan import BEFORE, ScanState
from inspector.io.scan import read_scan, write_scan
from inspector.ui.cell_grid import CELL_W, LABEL_W
from inspector.ui.dashboard_view import NO_SCAN
from inspector.viewer.dashboard import open_dashboard, running_text
from inspector.viewer.feature_labels import scan_labels
from inspector.viewer.labels import display_token
from sae_files import write_sae
from scan_files import DORMANT, write_synthetic_scan
from test_ui_features_view import attach, generate, show_tab
from ui_fixtures import fail_on_qt_warnings, make_window, ui_settings, wait_state  # noqa: F401

HOOK = "blocks.1.hook_resid_post"


@pytest.fixture
def sae_dir(tmp_path):
    return write_sae(tmp_path / "resid_sae", "topk", 128, 512, HOOK, k=8)


def sae_scan(sae_dir: Path, path: Path | None = None, **kw) -> Path:
    """A scan of the SAE in ``sae_dir`` (its scan.h5 unless ``path``) whose features 0..DORMANT-1 fire."""
    path = path or sae_dir / "scan.h5"
    write_synthetic_scan(path, read_sae(sae_dir).as_dict(), units=512, **kw)
    return path


def open_scan_from_menu(w, monkeypatch, path) -> None:
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a, **kw: (str(path), ""))
    action = next(a for a in w.menuBar().actions()[0].menu().actions() if a.text() == "Open S&can…")
    action.trigger()


def test_open_scan_lists_the_active_units_strongest_first_and_filters_them(qtbot, ui_settings, tmp_path, monkeypatch):
    w = make_window(qtbot, boot=False)
    view = w.dashboard_view
    assert w.tabs.tabText(w.tabs.indexOf(view)) == "Dashboard"
    assert w.tabs.indexOf(view) == w.tabs.indexOf(w.features_view) + 1
    assert view.header.text() == NO_SCAN and not view.body.isVisible()
    path = tmp_path / "python.h5"
    write_synthetic_scan(path, {"path": "/saes/python_sae", "d_sae": 64})
    open_scan_from_menu(w, monkeypatch, path)
    expected = open_dashboard(path)
    assert w.tabs.currentWidget() is view and view.body.isVisible() and w.controller.runs.scan.path == str(path)
    assert view.header.text() == expected.header() and not view.unfinished.isVisible()
    assert view.listed_units() == expected.units.tolist() and len(view.listed_units()) == DORMANT
    first = expected.units[0]
    assert view.units.item(0).text() == f"{expected.peak(first):8.3f}  {expected.label(first)}"
    assert view.unit == first and view.units.currentRow() == 0  # the strongest is shown at once
    assert view.count.text() == f"{DORMANT} of {DORMANT} active units"

    qtbot.keyClicks(view.filter, "f12")
    assert view.listed_units()[0] == 12 and all("12" in expected.label(u) for u in view.listed_units())
    assert view.unit == 12  # the one shown was filtered out: the first listed is shown
    view.filter.clear()
    word = expected.names[7].split(" · ")[0]
    qtbot.keyClicks(view.filter, word)
    assert 7 in view.listed_units() and all(word in expected.label(u) for u in view.listed_units())
    view.filter.setText("no such label")
    assert view.listed_units() == [] and view.count.text() == "No unit matches"
    assert w.settings.last_dir == str(tmp_path)


def table_rows(view) -> list[list[str]]:
    """The examples' table as text: a row per example (the header left out), four cells each."""
    cells = view.examples.toPlainText().strip("\n").split("\n")
    assert cells[:4] == ["activation", "document", "position", "context"]
    return [cells[i:i + 4] for i in range(4, len(cells), 4)]


def highlighted(view) -> list[str]:
    """The text of each marked token in the examples, in order."""
    return [html.unescape(t) for t in re.findall(r"background-color:#ffd08a;\">(.*?)</span>", view.examples.toHtml())]


def test_a_units_examples_are_text_with_the_activating_token_marked_and_its_histogram_the_files(
        qtbot, ui_settings, tmp_path):
    w = make_window(qtbot, boot=False)
    path = tmp_path / "scan.h5"
    write_synthetic_scan(path, {"path": "/saes/python_sae", "d_sae": 64}, done=20)
    assert w.open_scan(str(path))
    view = w.dashboard_view
    assert view.unfinished.isVisible() and view.unfinished.text().startswith("Unfinished: 20 of 30 documents")
    state, _, vocabulary = read_scan(path)
    unit = view.listed_units()[4]
    view.units.setCurrentRow(4)
    assert view.unit == unit and view.title.text() == w.controller.runs.scan.describe_unit(unit)
    rows, marked = table_rows(view), highlighted(view)
    assert len(rows) == len(marked) == state.top
    for i, (row, token) in enumerate(zip(rows, marked)):
        window = [vocabulary[t] if t >= 0 else "" for t in state.top_windows[unit, i].tolist()]
        assert row[:3] == [f"{state.top_activations[unit, i]:.3f}", str(state.top_documents[unit, i]),
                           str(state.top_positions[unit, i])]
        assert token == display_token(window[BEFORE])
        assert row[3] == (running_text("".join(window[:BEFORE])) + token + running_text("".join(window[BEFORE + 1:])))
    np.testing.assert_array_equal(view.bar_heights(), state.histogram[unit, 1:-1])
    np.testing.assert_array_equal(view.bars.opts["x0"], state.edges[:-1])
    np.testing.assert_array_equal(view.bars.opts["x1"], state.edges[1:])
    below, above = state.histogram[unit, 0], state.histogram[unit, -1]
    assert view.overflow.text().startswith(f"{below} below {state.edges[0]:.3g} and {above} above "
                                           f"{state.edges[-1]:.3g} (outside the bars)")


def test_token_text_is_escaped_and_the_activating_token_highlighted(qtbot, ui_settings, tmp_path):
    """A window of HTML-like tokens shows as text: nothing of it is markup."""
    state = ScanState(2, 2)
    state.add(np.array([1]), np.array([2.5]), 3, np.array([BEFORE]), np.arange(12))
    state.flush()
    vocabulary = {i: f"<b{i}>" for i in range(12)}
    vocabulary[BEFORE] = " <i>&amp;"
    write_scan(state, {"hook": HOOK, "sae": None, "documents": 4}, vocabulary, tmp_path / "tags.h5")
    w = make_window(qtbot, boot=False)
    assert w.open_scan(str(tmp_path / "tags.h5"))
    view = w.dashboard_view
    assert view.listed_units() == [1] and view.unit == 1
    assert table_rows(view) == [["2.500", "3", str(BEFORE), "".join(vocabulary[i] for i in range(12))]]
    assert highlighted(view) == [" <i>&amp;"]
    assert "<b0>" not in view.examples.toHtml()


def test_a_file_that_is_not_a_scan_is_an_error_dialog_with_the_reason(qtbot, ui_settings, tmp_path, monkeypatch):
    w = make_window(qtbot, boot=False)
    bad = tmp_path / "notes.h5"
    bad.write_text("just text")
    open_scan_from_menu(w, monkeypatch, bad)
    qtbot.waitUntil(lambda: w.last_dialog is not None and w.last_dialog.isVisible(), timeout=3000)
    assert w.last_dialog.windowTitle() == "Open Scan"
    assert w.last_dialog.text().startswith(f"Cannot open the scan.\n\n{bad} is not a scan file this reads")
    assert w.controller.runs.scan is None and w.dashboard_view.header.text() == NO_SCAN


def test_the_features_tab_names_features_by_the_scan_in_the_saes_directory(qtbot, ui_settings, sae_dir):
    scan = sae_scan(sae_dir)
    names = scan_labels(*read_scan(scan)[::2])
    w = make_window(qtbot)
    attach(qtbot, w, sae_dir)
    generate(qtbot, w)
    view = show_tab(w)
    grid = view.cells.grid
    assert grid.labels == [f"f{f} {names[f]}" if f in names else f"f{f}" for f in grid.features.tolist()]
    labelled = [r for r, f in enumerate(grid.features.tolist()) if f in names]
    assert labelled, "some of the request's features fire in the scan"
    assert view.about.text().endswith(" · labels: scan.h5")
    bold = QFont(view.cells.font())
    bold.setBold(True)
    assert all(QFontMetrics(bold).horizontalAdvance(label) <= view.cells.label_w - 8 for label in grid.labels)
    r = labelled[0]
    c = int(np.flatnonzero(grid.ranks[r] >= 0)[0])
    cells = view.cells
    cells.horizontalScrollBar().setValue(c * CELL_W)
    cells.verticalScrollBar().setValue(r * cells.row_h)  # the cell in view
    qtbot.mouseMove(cells.viewport(), cells.cell_rect(r, c).center())
    qtbot.waitUntil(lambda: view.last_readout == grid.describe(r, c), timeout=2000)
    assert f"feature {grid.labels[r]} = " in view.readout.text()
    listed = view.listed_features()
    texts = [view.token_list.item(i).text() for i in range(view.token_list.count())]
    assert all(t.endswith(grid.label_of(f)) for t, f in zip(texts, listed))
    qtbot.mouseClick(cells.viewport(), Qt.MouseButton.LeftButton, pos=QPoint(8, cells.cell_rect(r, 0).center().y()))
    assert view.trace_title.text().startswith(f"{grid.labels[r]} across the tokens")
    assert cells.viewport().grab().width() > 0


def test_labels_json_names_features_over_the_scan_and_a_bad_one_says_why(qtbot, ui_settings, sae_dir):
    sae_scan(sae_dir)
    w = make_window(qtbot)
    attach(qtbot, w, sae_dir)
    generate(qtbot, w)
    feature = int(show_tab(w).cells.grid.features[0])
    (sae_dir / "labels.json").write_text(json.dumps({str(feature): "hand-written name"}))
    w.tabs.setCurrentIndex(0)
    view = show_tab(w)  # drawn again: the edited file is read
    assert view.cells.grid.labels[0] == f"f{feature} hand-written name"
    assert view.about.text().endswith(" · labels: labels.json, scan.h5")
    assert view.cells.label_w > LABEL_W  # widened for the long label
    (sae_dir / "labels.json").write_text("[1, 2]")
    w.tabs.setCurrentIndex(0)
    show_tab(w)
    assert view.cells.grid.labels[0] != f"f{feature} hand-written name"
    assert f"{sae_dir / 'labels.json'}: a JSON object of feature id -> label expected" in view.about.text()


def test_an_opened_scan_of_the_sae_labels_its_features_and_follows_a_click(qtbot, ui_settings, sae_dir, tmp_path):
    w = make_window(qtbot)
    attach(qtbot, w, sae_dir)
    generate(qtbot, w)
    view = show_tab(w)
    assert view.cells.grid.labels == [f"f{f}" for f in view.cells.grid.features]  # no scan yet: bare ids
    scan = sae_scan(sae_dir, tmp_path / "elsewhere.h5", seed=4)
    assert w.open_scan(str(scan))
    assert w.tabs.currentWidget() is w.dashboard_view
    names = w.controller.runs.scan.names
    view = show_tab(w)
    grid = view.cells.grid
    assert grid.labels == [f"f{f} {names[f]}" if f in names else f"f{f}" for f in grid.features.tolist()]
    assert view.about.text().endswith(" · labels: elsewhere.h5")
    r = next(r for r, f in enumerate(grid.features.tolist()) if f in names)
    view.cells.horizontalScrollBar().setValue(0)
    qtbot.mouseClick(view.cells.viewport(), Qt.MouseButton.LeftButton,
                     pos=QPoint(8, view.cells.cell_rect(r, 0).center().y()))
    assert w.dashboard_view.unit == grid.features[r]  # the Dashboard follows
    dormant = next(f for f in grid.features.tolist() if f not in names)
    w.dashboard_view.filter.setText("no such label")
    view.select_feature(dormant)
    view.featureSelected.emit(dormant)
    assert w.dashboard_view.unit == dormant and "not active anywhere" in w.dashboard_view.title.text()
    assert w.dashboard_view.filter.text() == ""


def test_attach_demo_sae_attaches_the_shipped_sae_and_its_scan_labels_it(qtbot, ui_settings, tmp_path, monkeypatch):
    demo = write_sae(tmp_path / "demo-sae", "topk", 128, 512, HOOK, k=8)
    sae_scan(demo)
    monkeypatch.setattr(resources, "demo_sae_path", lambda: demo)
    w = make_window(qtbot, boot=False)
    assert not w.menus.act_attach_demo_sae.isEnabled()
    w.open_model("demo", retain_rows=True)
    wait_state(qtbot, w, "ready")
    assert w.menus.act_attach_demo_sae.isEnabled()
    assert "Engine ▸ Attach Demo SAE" in show_tab(w).cells.message
    w.menus.act_attach_demo_sae.trigger()
    qtbot.waitUntil(lambda: "demo-sae" in w.controller.engine.info.saes, timeout=5000)
    assert w.controller.engine.info.saes["demo-sae"].config.path == str(demo.resolve())
    assert not w.menus.act_attach_demo_sae.isEnabled()  # attached already
    generate(qtbot, w)
    view = show_tab(w)
    names = scan_labels(*read_scan(demo / "scan.h5")[::2])
    assert view.cells.grid.labels == [f"f{f} {names[f]}" if f in names else f"f{f}"
                                      for f in view.cells.grid.features.tolist()]
    view.detach_button.click()
    qtbot.waitUntil(lambda: not w.controller.engine.info.saes, timeout=5000)
    assert w.menus.act_attach_demo_sae.isEnabled()


def test_attach_demo_sae_needs_the_demo_model(qtbot, ui_settings, tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "demo_sae_path", lambda: tmp_path / "demo-sae")
    model = tmp_path / "other-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    w = make_window(qtbot, model=str(model))
    assert w.state.value == "ready" and not w.menus.act_attach_demo_sae.isEnabled()
    assert not w.attach_demo_sae() and "the demo model must be running here" in w.statusBar().currentMessage()

