"""Widget tests (synthetic data, no engine): heatmap, token strip, summary view."""

import numpy as np
import pytest

from inspector.core.run import HookRows, TopToken
from inspector.viewer.run_view import RunSource, RunView
from ui_fixtures import fail_on_qt_warnings, keep, make_run, ui_settings  # noqa: F401


@pytest.fixture
def heatmap(qtbot, ui_settings):
    from inspector.ui.heatmap import HeatmapWidget

    w = HeatmapWidget()
    keep(qtbot, w)
    w.resize(900, 600)
    w.show()
    qtbot.waitExposed(w)
    return w


def show(heatmap, values, texts=None, source="s", marks=None):
    positions = np.arange(len(values))
    texts = texts or [f"tok{i}" for i in range(len(values) + 1)]
    heatmap.set_data(positions, values, texts, source, marks)
    return positions


def test_heatmap_one_column_per_token_values_equal_data(heatmap):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(37, 24)).astype(np.float32)
    show(heatmap, values)
    assert heatmap.column_count() == 37
    img = heatmap.image_array()
    assert img.shape == (37, 24)  # small: no pooling, one image column per token
    np.testing.assert_array_equal(img, values)
    np.testing.assert_array_equal(heatmap.displayed_data(), values)
    # the image item spans exactly tokens x features in data coordinates
    assert tuple(heatmap.img.getLevels()) == heatmap.levels()  # from the first frame on
    rect = heatmap.img.mapRectToParent(heatmap.img.boundingRect())
    assert (rect.left(), rect.width(), rect.top(), rect.height()) == (0, 37, 0, 24)


def test_heatmap_axes_label_tokens_and_features_as_they_are(heatmap):
    """The axes once drew positions x1000: the SI prefix scale of the range they had when automatic
    prefixes were switched off (0 to 0.5) stayed frozen in."""
    from PySide6.QtGui import QImage, QPainter

    show(heatmap, np.zeros((47, 256), np.float32))
    image = QImage(400, 400, QImage.Format.Format_ARGB32)
    painter = QPainter(image)
    try:
        for side, limit in (("bottom", 47), ("left", 256)):
            texts = [float(t[2]) for t in heatmap.plot.getAxis(side).generateDrawSpecs(painter)[2]]
            assert texts and 0 <= min(texts) and max(texts) <= limit, (side, texts)
    finally:
        painter.end()


def test_heatmap_grows_incrementally(heatmap):
    rows = HookRows(8)
    rng = np.random.default_rng(1)
    full = rng.normal(size=(50, 8)).astype(np.float32)
    texts = [f"t{i}" for i in range(51)]
    for a in range(0, 50, 5):
        rows.append(np.arange(a, a + 5), np.zeros(5), full[a:a + 5])
        heatmap.set_data(rows.positions, rows.values, texts, "grow")
        assert heatmap.column_count() == a + 5
    np.testing.assert_array_equal(heatmap.image_array(), full)
    # follow mode keeps all tokens in view (the range grows in steps, so the axis is not redrawn per token)
    (x0, x1), _ = heatmap.vb.viewRange()
    assert x0 == 0 and 50 <= x1 <= 64


def test_heatmap_hover_readout(heatmap, qtbot):
    values = np.arange(20 * 6, dtype=np.float32).reshape(20, 6)
    texts = [f"w{i}" for i in range(20)] + ["last"]
    texts[7] = " hello\n"
    show(heatmap, values, texts)
    text = heatmap.readout_at(7.5, 3.5)
    assert "token ' hello↵'" in text and "position 7" in text and "feature 3" in text
    assert f"value {values[7, 3]:.6g}" in text
    assert heatmap.readout_at(25, 3) == "" and heatmap.readout_at(3, 7) == ""
    # through the real mouse path (scene coordinates)
    shown = heatmap.hover_view_point(2.5, 4.5)
    assert "position 2" in shown and "feature 4" in shown and f"value {values[2, 4]:.6g}" in shown


def test_heatmap_wide_layer_is_pooled_and_readout_is_raw(heatmap):
    values = np.zeros((2000, 4096), np.float32)
    values[1500, 4000] = 9.0
    show(heatmap, values)
    img = heatmap.image_array()
    assert img.shape[0] <= 2000 and img.shape[1] < 4096 // 2
    assert img.max() == 9.0
    assert "value 9" in heatmap.readout_at(1500.5, 4000.5)
    assert "pooled" in heatmap.readout_at(10.5, 10.5)


def test_heatmap_feature_range_zoom(heatmap):
    values = np.tile(np.arange(512, dtype=np.float32), (30, 1))
    show(heatmap, values)
    heatmap.set_feature_range(100, 164)
    heatmap.render()
    img = heatmap.image_array()
    assert img.shape == (30, 64)  # the zoomed range at full resolution
    np.testing.assert_array_equal(img[0], np.arange(100, 164, dtype=np.float32))
    assert heatmap.vb.viewRange()[1] == [100, 164]


def test_heatmap_levels_modes_and_colormap(heatmap):
    values = np.linspace(-2, 6, 40 * 10, dtype=np.float32).reshape(40, 10)
    show(heatmap, values)
    lo, hi = heatmap.levels()
    assert -2 <= lo < -1.9 and 5.9 < hi <= 6
    heatmap.set_levels_mode("auto ±")
    assert heatmap.levels()[0] == -heatmap.levels()[1]
    heatmap.set_levels_mode("fixed", -1.0, 1.0)
    show(heatmap, values * 3)
    assert heatmap.levels() == (-1.0, 1.0)
    assert tuple(heatmap.img.getLevels()) == (-1.0, 1.0)
    heatmap.set_colormap("viridis")
    assert heatmap.colormap_name() == "viridis"
    assert heatmap.cmap_box.itemData(0) == "cividis"  # colour-blind-safe default


def test_heatmap_intervention_track(heatmap):
    values = np.ones((10, 4), np.float32)
    marks = np.array([0, 0, 0, 2, 2, 2, 1, 1, 0, 0, 0], np.int8)
    show(heatmap, values, marks=marks)
    track = heatmap.track_marks
    assert list(track) == [0, 0, 0, 2, 2, 2, 1, 1, 0, 0]
    assert heatmap.track_img.image.shape == (10, 1, 4) and heatmap.track_img.isVisible()
    assert "intervention active on this hook" in heatmap.readout_at(4.5, 1.5)


def test_heatmap_repaints_a_long_wide_run_incrementally(heatmap):
    """A new token pools its own column only (the bench measures the frame time)."""
    from inspector.viewer.image_pool import pool_maxabs

    rows = HookRows(4096)
    rng = np.random.default_rng(2)
    rows.append(np.arange(1999), np.zeros(1999), rng.normal(size=(1999, 4096)).astype(np.float32))
    texts = ["x"] * 2001
    heatmap.set_data(rows.positions, rows.values, texts, "big")
    assert heatmap._pool.last_reset
    for i in range(5):
        rows.append([1999 + i], [0], rng.normal(size=(1, 4096)).astype(np.float32))
        heatmap.set_data(rows.positions, rows.values, texts, "big")
        heatmap.glw.viewport().repaint()
        assert not heatmap._pool.last_reset
    key = heatmap._pool.key
    expected = pool_maxabs(rows.values[key.t0:, key.f0:key.f1], key.tbin, key.fbin)
    np.testing.assert_array_equal(heatmap._frame.image, expected)


# ------------------------------------------------------------------ token strip


def test_token_strip_matches_texts_and_click_selects(qtbot, ui_settings):
    from inspector.ui.heatmap import HeatmapWidget
    from inspector.ui.token_strip import TokenStrip

    strip, heatmap = TokenStrip(), HeatmapWidget()
    for w in (strip, heatmap):
        keep(qtbot, w)
        w.show()
    texts = ["def", " f", "(", "x", "):", "\n", "   ", " return"]
    strip.set_tokens(texts[:5], list(range(5)), 3)
    top = [[TopToken(1, -0.1, "\n"), TopToken(9, -2.5, "")]] * 5  # an older file has no texts: the id shows
    strip.set_tokens(texts, list(range(8)), 3, logprobs=[-0.1] * 5, top=top)  # appended
    assert strip.texts() == texts
    assert "most likely: '↵' -0.10, id 9 -2.50" in strip.tooltip_text(4)
    assert strip.display_text(5) == "↵" and strip.display_text(6) == "␣␣␣"
    assert "logprob -0.100" in strip.tooltip_text(4) and "generated" in strip.tooltip_text(4)
    show(heatmap, np.ones((7, 3), np.float32), texts)
    strip.positionClicked.connect(heatmap.select_position)
    with qtbot.waitSignal(strip.positionClicked) as sig:
        qtbot.mouseClick(strip.viewport(), __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.MouseButton.LeftButton,
                         pos=strip.position_rect(4).center())
    assert sig.args == [4]
    assert heatmap.selection.isVisible() and tuple(heatmap.selection.getRegion()) == (4, 5)
    assert strip.selected_positions() == (4,)
    # shift-click selects a range (for steering selections); arrow keys walk the tokens
    with qtbot.waitSignal(strip.positionClicked):
        qtbot.mouseClick(strip.viewport(), __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.MouseButton.LeftButton,
                         __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.KeyboardModifier.ShiftModifier,
                         pos=strip.position_rect(6).center())
    assert strip.selected_positions() == (4, 5, 6)
    with qtbot.waitSignal(strip.positionClicked) as sig:
        qtbot.keyClick(strip, __import__("PySide6.QtCore", fromlist=["Qt"]).Qt.Key.Key_Right)
    assert sig.args == [7] and strip.selected_positions() == (7,)


def test_token_strip_lays_out_incrementally(qtbot, ui_settings):
    from inspector.ui.token_strip import TokenStrip

    strip = TokenStrip()
    keep(qtbot, strip)
    strip.resize(400, 200)
    strip.show()
    texts = [f"tok{i}" for i in range(3000)]
    for n in range(0, 3001, 100):
        strip.set_tokens(texts[:n], list(range(n)), 5)
    assert strip.texts() == texts
    rects = strip._rects
    assert len(rects) == 3000 and all(r.right() < 400 for r in rects)
    assert strip.verticalScrollBar().value() == strip.verticalScrollBar().maximum()  # follows the end
    strip.resize(250, 200)  # a new width lays everything out again
    qtbot.wait(10)
    assert all(r.right() < 250 for r in strip._rects)
    assert strip.position_at(strip.position_rect(2999).center()) == 2999


def test_token_strip_reused_lines_show_the_current_state(qtbot, ui_settings):
    """Lines drawn once and reused must still show new tokens, selections and marks: every state is
    compared, pixel for pixel, with a strip that draws it from scratch."""
    from PySide6.QtCore import Qt
    from inspector.ui.token_strip import TokenStrip

    def fresh(texts, marks, selected):
        strip = TokenStrip()
        keep(qtbot, strip)
        strip.resize(360, 160)
        strip.show()
        strip.set_tokens(texts, list(range(len(texts))), 4, marks=marks)
        strip.select_range(*selected) if selected else None
        return strip

    def same_picture(a, b):
        qtbot.wait(5)
        return a.viewport().grab().toImage() == b.viewport().grab().toImage()

    texts = [f"t{i}" for i in range(40)]
    live = fresh(texts[:10], None, None)
    live.viewport().grab()  # draws and keeps the lines
    live.set_tokens(texts, list(range(40)), 4)  # grows
    assert same_picture(live, fresh(texts, None, None))
    live.select_range(3, 12)
    assert same_picture(live, fresh(texts, None, (3, 12)))
    marks = np.zeros(40, np.int8)
    marks[20:25] = 2
    live.set_tokens(texts, list(range(40)), 4, marks=marks)  # same tokens, marks changed (another hook)
    assert same_picture(live, fresh(texts, marks, (3, 12)))
    qtbot.mouseClick(live.viewport(), Qt.MouseButton.LeftButton, pos=live.position_rect(30).center())
    assert same_picture(live, fresh(texts, marks, (30, 30)))
    assert not same_picture(live, fresh(texts, None, (30, 30)))  # the comparison does see marks


def test_summary_view_layers_by_tokens(qtbot, ui_settings):
    from inspector.ui.summary_view import SummaryView

    run = make_run(n_tokens=(9,), width=8)
    vm = RunView(run, RunSource.FILE, "x.h5")
    view = SummaryView()
    keep(qtbot, view)
    view.show()
    rows = vm.summary_rows("req0", view.kinds(), "L2 norm")
    view.set_rows(rows, vm.token_texts("req0"))
    m = view.matrix()
    resid = [h for h in vm.hooks_for("req0") if h.kind == "resid_post"]
    assert m.shape == (8, len(resid))
    for j, h in enumerate(resid):
        np.testing.assert_allclose(m[:, j], np.linalg.norm(run.requests["req0"].hooks[h.name].values, axis=1), rtol=1e-6)
    assert view.readout_at(2.5, 1.5).startswith("L1 resid_post") and "position 2" in view.readout_at(2.5, 1.5)
    rows = vm.summary_rows("req0", view.kinds(), "feature value", 3)
    view.measure_box.setCurrentText("feature value")
    view.set_rows(rows, vm.token_texts("req0"))
    np.testing.assert_array_equal(view.matrix()[:, 0], run.requests["req0"].hooks[resid[0].name].values[:, 3])
    view.measure_box.setCurrentText("L2 norm")
    view.relative_box.setChecked(True)
    view.set_rows(vm.summary_rows("req0", view.kinds(), "L2 norm"), vm.token_texts("req0"))
    np.testing.assert_allclose(np.median(view.matrix(), axis=0), 1.0, rtol=1e-6)


def test_color_image_colours_incrementally_like_a_full_recolour(qtbot, ui_settings):
    from PySide6.QtCore import QRectF

    from inspector.ui.color_image import ColorImageItem
    from inspector.ui.view_kit import colormap

    rng = np.random.default_rng(3)
    full = rng.normal(size=(40, 9)).astype(np.float32)
    full[5, 2] = np.nan
    a, b = ColorImageItem(), ColorImageItem()
    for item in (a, b):
        item.setColorMap(colormap("viridis"))
        item.setLevels((-1.0, 1.0))
    for n in range(1, 41, 3):
        a.set_frame(full[:n], QRectF(0, 0, n, 9), reset=False)
    a.set_frame(full, QRectF(0, 0, 40, 9), reset=False)
    b.set_frame(full, QRectF(0, 0, 40, 9), reset=True)
    np.testing.assert_array_equal(a.rgb(), b.rgb())
    lut = colormap("viridis").getLookupTable(nPts=256, alpha=False).astype(np.uint32)
    idx = np.clip((full[7, 4] + 1.0) * 127.5, 0, 255).astype(np.uint8)
    assert a.rgb()[4, 7] == (0xFF000000 | (lut[idx, 0] << 16) | (lut[idx, 1] << 8) | lut[idx, 2])
    before = a.recolour_count
    a.setLevels((-2.0, 2.0))  # a level change recolours everything, once
    assert a.recolour_count == before + 1 and not np.array_equal(a.rgb(), b.rgb())


@pytest.mark.parametrize("wide", [False, True], ids=["one bin a row", "pooled"])
def test_heatmap_of_written_through_rows_shows_what_rows_in_memory_show(qtbot, ui_settings, tmp_path, wide):
    """Rows read back from a write-through run's file are pooled and coloured off the GUI thread; the
    picture must be the one the same rows give from memory, while scrolling too."""
    from inspector.core.dtypes import BFLOAT16
    from inspector.core.hooks import HookPoint
    from inspector.core.run import RequestCapture
    from inspector.io.spool import RowSpool
    from inspector.ui.heatmap import HeatmapWidget

    n, width = (3000, 2048) if wide else (300, 40)
    full = np.random.default_rng(3).normal(size=(n, width)).astype(BFLOAT16)
    kept, spool = HookRows(width, dtype=BFLOAT16), RowSpool(tmp_path, {})
    spooled = spool.rows(RequestCapture("r", "p", [], {}), HookPoint("h", "h", "m", "resid_post", width, 0), BFLOAT16)
    for rows in (kept, spooled):
        for a in range(0, n, 700):  # some rows written, the last ones still in the writer's buffer
            rows.append(np.arange(a, min(n, a + 700)), np.zeros(min(n, a + 700) - a), full[a:a + 700])
    widgets = []
    for rows, source in ((kept, "memory"), (spooled, "disk")):
        w = HeatmapWidget()
        keep(qtbot, w)
        w.resize(900, 600)
        w.show()
        qtbot.waitExposed(w)
        w.set_data(rows.positions, rows.values, [f"t{i}" for i in range(n + 1)], source)
        widgets.append(w)
    memory, disk = widgets
    for x0 in (None, n // 3):
        if x0 is not None:  # scroll both to the same window, then let the view rest (it pools again)
            for w in widgets:
                w.vb.setXRange(x0, x0 + n // 4, padding=0)
                w.render()
        qtbot.waitUntil(lambda: disk.image_array() is not None and disk._wanted is None and not disk._pooling)
        np.testing.assert_array_equal(disk.image_array(), memory.image_array())
        assert disk.levels() == memory.levels()
        np.testing.assert_array_equal(disk.img.rgb(), memory.img.rgb())
    assert "value" in disk.readout_at(5.5, 3.5) and disk.readout_at(5.5, 3.5) == memory.readout_at(5.5, 3.5)
    spool.close()
