"""The papercuts of issue 38, on the real window over the fake engine: every tab title shows in full at
1440×900 and 1920×1080; columns and dialog titles are not cut; the cell-grid tabs' colour scales carry
numbers; the Lens keeps the selected token in view; the status bar says "Ready" only when idle; the
request list marks twins and patched runs; "clamp to" is greyed out with the reason where the engine
would refuse it; a new interventions row is inactive until edited; file dialogs start in one remembered
folder; Compare's difference follows the intervened hook point and is tall enough to read; Help has a
First Steps page and the docs."""

from pathlib import Path

import numpy as np
import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QFileDialog

from fake_session import FakeSession
from inspector.viewer.lens import NEXT_RANK
from sae_files import write_sae
from test_ui_patching_view import patching_window, run_sweep
from ui_fixtures import fail_on_qt_warnings, make_window, ui_settings, wait_state  # noqa: F401
from ui_fixtures import run_prompts as generate

L0, L1 = "model.layers.0.resid_post", "model.layers.1.resid_post"


def steer(w, hook=L0):
    row = w.interventions.add_row(hook, scale="0.5")
    assert w.interventions.edit(row, "Bias", "0.25")


@pytest.mark.parametrize("size", [(1440, 900), (1920, 1080)])
def test_every_tab_title_shows_in_full(qtbot, ui_settings, size):
    w = make_window(qtbot)
    w.resize(*size)
    qtbot.waitUntil(lambda: w.width() == size[0])
    bar = w.tabs.tabBar()
    assert bar.elideMode() == Qt.TextElideMode.ElideNone
    for i in range(bar.count()):
        rect = bar.tabRect(i)
        assert rect.left() >= 0 and rect.right() < bar.width(), bar.tabText(i)
        assert rect.width() >= bar.fontMetrics().horizontalAdvance(bar.tabText(i)), bar.tabText(i)
        assert bar.tabToolTip(i)


def test_columns_fit_their_content_and_dialog_titles_are_short(qtbot, ui_settings, monkeypatch):
    w = make_window(qtbot)
    steer(w)
    table, tree = w.interventions.table, w.tree.tree
    for col in range(w.interventions.model.columnCount() - 1):  # the last one takes the rest of the room
        header = table.horizontalHeader()
        assert header.sectionSize(col) >= max(header.sectionSizeHint(col), table.sizeHintForColumn(col))
    for col in range(w.tree.model.columnCount()):
        assert tree.columnWidth(col) >= tree.sizeHintForColumn(col), col
    titles = []
    for name in ("getOpenFileName", "getSaveFileName"):
        monkeypatch.setattr(QFileDialog, name, lambda parent, title, *a: titles.append(title) or ("", ""))
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda parent, title, *a: titles.append(title) or "")
    m = w.menus
    for dialog in (m.open_model_dialog, m.attach_sae_dialog, m.open_capture_dialog, m.open_scan_dialog,
                   m.export_dialog, w.patching_view.save_dialog):
        dialog()
    w.interventions.load_vector_dialog("bias")
    assert len(titles) == 7 and all(len(t) <= 40 for t in titles), titles
    w.tabs.setCurrentWidget(w.heatmap)
    generate(qtbot, w)
    steering = w.interventions.open_steering_dialog()
    assert len(steering.windowTitle()) <= 40
    steering.reject()


def test_the_colour_scales_of_the_grid_tabs_show_their_numbers(qtbot, ui_settings):
    w = make_window(qtbot)
    generate(qtbot, w)
    w.tabs.setCurrentWidget(w.lens_view)
    w.refresh()
    lens = w.lens_view
    assert lens.scale.numbers() == ("0%", "50%", "100%") and "probability" in lens.scale.toolTip()
    lens.mode_box.setCurrentText(NEXT_RANK)
    assert lens.scale.numbers() == ("#∞", "#2", "#1")
    assert w.patching_view.scale.numbers() == ("−1", "0", "1")
    for tab in (lens, w.patching_view):
        image = tab.scale.grab().toImage()
        assert image.width() >= 100 and image.pixelColor(2, 2) != image.pixelColor(image.width() - 3, 2)


def test_the_lens_scrolls_to_the_selected_token(qtbot, ui_settings):
    w = make_window(qtbot)
    generate(qtbot, w, "the cat sat on the mat and then it ran off to the barn", max_tokens=30)
    w.tabs.setCurrentWidget(w.lens_view)
    cells = w.lens_view.cells
    qtbot.waitUntil(lambda: (w.refresh(), cells.grid is not None and cells.horizontalScrollBar().maximum() > 0)[1])
    for position in (0, cells.grid.shape[1] - 1, 3):
        w.select_position(position)
        w.refresh()
        rect, viewport = cells.cell_rect(0, position), cells.viewport().rect()
        assert rect.left() >= cells.label_w and rect.right() <= viewport.right(), position


def test_the_status_bar_says_ready_only_when_idle(qtbot, ui_settings, monkeypatch):
    monkeypatch.setattr(FakeSession, "step_delay", 0.02)
    w = make_window(qtbot)
    assert w.stage_label.text().startswith("Ready")
    generate(qtbot, w, max_tokens=60, wait=False)
    seen = set()
    while w.state.value == "generating":
        w.painter.refresh()
        seen.add(w.stage_label.text())
        qtbot.wait(20)
    assert seen and not any("Ready" in text for text in seen), seen
    assert any(text.startswith("Generating · ") and text.endswith(" of 60 tokens") for text in seen), seen
    w.refresh()
    assert w.stage_label.text().startswith("Ready")


def test_the_request_list_marks_twins_and_patched_runs(qtbot, ui_settings):
    w = make_window(qtbot)
    steer(w)
    generate(qtbot, w, "the cat sat\nhello", compare=True)
    box = w.request_box
    labels = [box.itemText(i) for i in range(box.count())]
    assert [label.endswith("[clean twin]") for label in labels] == [True, False, True, False]
    assert all(label.endswith("[intervened twin]") for label in labels[1::2])
    assert box.itemData(1, Qt.ItemDataRole.ToolTipRole).startswith("Intervened twin of req0")

    w = patching_window(qtbot)
    run_sweep(qtbot, w)
    w.patching_view.click_cell(0, 1)
    wait_state(qtbot, w, "ready")
    box, rid = w.request_box, w.shown.selection.request
    i = box.findData(rid)
    assert box.itemText(i).endswith("[patched]")
    assert box.itemData(i, Qt.ItemDataRole.ToolTipRole).startswith("Patched run: ") and "position 1" in box.toolTip()


def features_tab_with_an_sae(qtbot, path, room: int):
    """The Features tab after a run, with the SAE at ``path`` attached to an engine booted with ``room``
    feature clamps a hook."""
    w = make_window(qtbot, boot=False)
    w.settings.feature_clamps = room
    w.open_model("demo", mode="compiled", retain_rows=True)
    wait_state(qtbot, w, "ready")
    assert w.attach_sae(str(path))
    qtbot.waitUntil(lambda: "sae" in w.controller.engine.info.saes, timeout=5000)
    generate(qtbot, w)
    w.tabs.setCurrentWidget(w.features_view)
    w.refresh()
    return w.features_view


@pytest.mark.parametrize("architecture, room, reason", [("topk", 2, "top-k SAE"),
                                                        ("standard", 0, "booted without room for feature clamps")])
def test_clamp_to_is_greyed_out_with_the_reason_where_the_engine_would_refuse_it(qtbot, ui_settings, tmp_path,
                                                                                  architecture, room, reason):
    view = features_tab_with_an_sae(qtbot, write_sae(tmp_path / "sae", architecture, 128, 512,
                                                     "blocks.1.hook_resid_post", k=8), room)
    clamp = view.steer_how.model().item(view.steer_how.findData("clamp"))
    assert not clamp.isEnabled() and reason in clamp.toolTip()
    assert view.clamp_note.isVisible() and reason in view.clamp_note.toolTip()
    assert view.steer_how.currentData() == "add"


def test_clamp_to_is_offered_where_the_engine_can_clamp(qtbot, ui_settings, tmp_path):
    view = features_tab_with_an_sae(qtbot, write_sae(tmp_path / "sae", "standard", 128, 512,
                                                     "blocks.1.hook_resid_post"), room=2)
    assert view.steer_how.model().item(view.steer_how.findData("clamp")).isEnabled()
    assert not view.clamp_note.isVisible()


def test_a_new_row_is_inactive_until_edited(qtbot, ui_settings):
    w = make_window(qtbot)
    panel = w.interventions
    panel.add_button.click()
    assert len(panel.model.rows) == 1 and panel.interventions() == []
    assert w.controller.engine.session.interventions == []
    assert panel.status.text().startswith("No interventions") and "no effect yet" in panel.status.text()
    assert "no effect yet" in panel.model.data(panel.model.index(0, 7))
    assert panel.edit(0, "Scale", "2")
    assert panel.status.text().startswith("1 intervention(s) active")
    assert [iv.scale for iv in w.controller.engine.session.interventions] == [2.0]


def test_file_dialogs_start_in_one_remembered_folder(qtbot, ui_settings, monkeypatch, tmp_path):
    w = make_window(qtbot)
    starts = []
    chosen = tmp_path / "captures" / "run.h5"
    chosen.parent.mkdir()

    def opened(parent, title, folder, *a):
        starts.append(folder)
        return ("", "")

    monkeypatch.setattr(QFileDialog, "getOpenFileName", opened)
    w.menus.open_capture_dialog()
    assert starts == [str(Path.home())]  # the first time: the home directory
    monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda parent, title, where, *a: (starts.append(where),
                                                                                         (str(chosen), ""))[1])
    monkeypatch.setattr(w, "export", lambda path: True)
    w.menus.export_dialog()  # chose tmp_path/captures/run.h5
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda parent, title, folder: starts.append(folder) or "")
    w.menus.open_model_dialog()
    w.menus.attach_sae_dialog()
    w.menus.open_scan_dialog()
    w.interventions.add_row(L0)
    w.interventions.load_vector_dialog("scale")
    assert starts[2:] == [str(chosen.parent)] * 4
    assert w.settings.last_dir == str(chosen.parent)


def test_compare_shows_the_intervened_hook_tall_enough(qtbot, ui_settings):
    w = make_window(qtbot)
    w.resize(1440, 900)
    steer(w, L0)
    generate(qtbot, w, "the cat sat\nhello", max_tokens=8, compare=True)
    w.select_hook(L1)  # the top hook selector on another layer
    w.tabs.setCurrentWidget(w.compare_view)
    w.refresh()
    shown, view = w.compare_view.shown, w.compare_view
    assert shown.diff_source[1] == L0 and "L0" in view.diff_title.text()
    run = w.shown.run
    clean, steered = run.requests["req0"].hooks[L0], run.requests["req1"].hooks[L0]
    n = min(len(clean), len(steered))
    np.testing.assert_allclose(shown.diff_values[:n], steered.values[:n] - clean.values[:n], atol=1e-6)
    qtbot.waitUntil(lambda: view.diff.height() > 0)
    assert view.diff.parentWidget().height() >= view.height() / 3


def test_help_has_first_steps_and_the_docs(qtbot, ui_settings, monkeypatch):
    w = make_window(qtbot, boot=False)
    help_menu = w.menus.help
    dialog = help_menu.show_first_steps()
    text = dialog.layout().itemAt(0).widget()
    page = text.toPlainText()
    for step in ("Open a model", "Tick hook points", "Generate", "Read a heatmap", "Intervene", "Export",
                 "README"):
        assert step in page, step
    dialog.close()
    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url.toLocalFile()) or True)
    help_menu.readme_action.trigger()
    docs = help_menu.docs_menu.actions()
    assert docs
    docs[0].trigger()
    assert opened[0].endswith("README.md") and Path(opened[1]).parent.name == "docs"
    assert all(Path(p).is_file() for p in opened)
