"""The notebook's inline views (no engine): colour tables equal to pyqtgraph's, colours equal to what the app's own
widgets draw for the same data, PNGs that decode, HTML that escapes tokens, and clear errors for wrong shapes."""

import struct
import zlib

import numpy as np
import pytest
import torch

from inspector.core.colormaps import DEFAULT_COLORMAP, DIFF_COLORMAP, lookup_table
from inspector.core.hooks import HookPoint
from inspector.core.labels import default_hook
from inspector.core.run import HookRows, RequestCapture, Run
from inspector.notebook.views import activation_view, compare_view, lens_view, pattern_view, run_view
from ui_fixtures import fail_on_qt_warnings, keep, ui_settings  # noqa: F401

TOKENS = ["<s>", " The", " cat", "\n", " <script>alert(1)</script>", "  "]


def decode_png(data: bytes) -> np.ndarray:
    """[height, width, 3] of an 8-bit RGB PNG, checked chunk by chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, idat, header = 8, b"", None
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        idat += body if kind == b"IDAT" else b""
        at += 12 + length
    width, height, depth, colour_type, *_ = header
    assert (depth, colour_type) == (8, 2)
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + 3 * width)
    assert not raw[:, 0].any()
    return raw[:, 1:].reshape(height, width, 3)


def at_cell(picture, panel, column, row):
    width, height = panel.cell
    return tuple(int(v) for v in picture[row * height + height // 2, column * width + width // 2])


def unpack(argb) -> np.ndarray:
    argb = np.asarray(argb, np.uint32)
    return np.stack([argb >> 16 & 255, argb >> 8 & 255, argb & 255], axis=-1).astype(np.uint8)


@pytest.mark.parametrize("name", ["cividis", "viridis", "CET-CBD1", "CET-CBL2", "inferno", "plasma", "magma",
                                  "turbo"])
def test_colour_tables_are_pyqtgraphs(name):
    pg = pytest.importorskip("pyqtgraph")
    from inspector.ui.view_kit import COLORMAPS

    assert name in COLORMAPS
    np.testing.assert_array_equal(lookup_table(name), pg.colormap.get(name).getLookupTable(nPts=256, alpha=False))


def test_default_and_diverging_maps_are_the_apps():
    from inspector.ui.compare_view import DIFF_COLORMAP as APP_DIFF
    from inspector.ui.settings import DEFAULT_COLORMAP as APP_DEFAULT

    assert (DEFAULT_COLORMAP, DIFF_COLORMAP) == (APP_DEFAULT, APP_DIFF)


def test_an_unknown_colour_map_says_which_are_known():
    with pytest.raises(ValueError, match="unknown colour map 'nope'.*cividis"):
        lookup_table("nope")
    with pytest.raises(ValueError, match="unknown colour map"):
        lookup_table("../maps/cividis")


def test_a_small_heatmap_is_upscaled_and_its_extremes_take_the_ends_of_the_table():
    values = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(2, 12)  # 2 positions of 12 features
    view = activation_view(values, ["a", "b"], title="two tokens")
    panel, picture = view.panels[0], decode_png(view._repr_png_())
    width, height = panel.cell
    assert width >= 8 and height >= 8 and picture.shape == (12 * height, 2 * width, 3)
    lut = lookup_table(DEFAULT_COLORMAP)
    assert at_cell(picture, panel, 0, 0) == tuple(lut[0])  # the minimum: position 0, feature 0 (at the top)
    assert at_cell(picture, panel, 1, 11) == tuple(lut[255])  # the maximum
    lo, hi = view.levels
    assert -1.0 < lo < hi < 1.0  # robust levels: the 0.5th and 99.5th percentiles


def test_the_png_decodes_with_qt_too(qtbot, tmp_path):
    from PySide6.QtGui import QImage

    view = activation_view(np.arange(60, dtype=np.float32).reshape(5, 12), TOKENS[:5])
    path = view.save(tmp_path / "view.png")
    image = QImage.fromData(path.read_bytes())
    picture = decode_png(path.read_bytes())
    assert not image.isNull() and (image.height(), image.width()) == picture.shape[:2]
    y, x = picture.shape[0] - 1, picture.shape[1] - 1
    assert tuple(unpack(image.pixel(x, y))) == tuple(picture[y, x])


def test_activation_colours_are_the_app_heatmaps(heatmap):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(37, 24)).astype(np.float32)
    heatmap.set_data(np.arange(37), values, [f"t{i}" for i in range(38)], "s")
    view = activation_view(values)
    assert view.levels == pytest.approx(heatmap.levels())
    np.testing.assert_array_equal(view.panels[0].rgb, unpack(heatmap.img.rgb()))


def test_pattern_colours_are_the_attention_tabs_image_item(qtbot):
    pg = pytest.importorskip("pyqtgraph")
    rng = np.random.default_rng(1)
    weights = np.tril(rng.uniform(size=(9, 9))).astype(np.float32)
    weights[3, :3] = (0.0, 1.0, 0.5)
    weights[4, :3] = (1 / 256, 255 / 256, 128 / 256)
    view = pattern_view(weights, head=None)
    item = pg.ImageItem(axisOrder="row-major")
    item.setColorMap(pg.colormap.get(DEFAULT_COLORMAP))
    item.setImage(np.where(np.triu(np.ones((9, 9)), 1) > 0, np.nan, weights), autoLevels=False, levels=(0.0, 1.0))
    item.render()
    drawn = np.array([[item.qimage.pixel(k, q) & 0xFFFFFF for k in range(9)] for q in range(9)])
    below = np.tril(np.ones((9, 9), bool))
    np.testing.assert_array_equal(view.panels[0].rgb[below], unpack(drawn)[below])
    assert (view.panels[0].rgb[~below] == 255).all()  # later keys: blank
    assert view.levels == (0.0, 1.0)


def test_lens_colours_are_the_lens_tabs_cell_grid(qtbot):
    from inspector.ui.cell_grid import CellGrid

    rng = np.random.default_rng(2)
    probabilities = rng.uniform(size=(4, 6)).astype(np.float32)
    probabilities[1, 2] = np.nan
    probabilities[2, :2] = (0.0, 1.0)

    class Cells:
        labels = [f"L{i}" for i in range(4)]
        shape = (4, 6)

        def colour_values(self, mode):
            return probabilities

    grid = CellGrid("input →", "…")
    keep(qtbot, grid)
    grid.set_grid(Cells(), "top token")
    tops = [[f"t{r}{c}" for c in range(6)] for r in range(4)]
    view = lens_view(tops, probabilities, TOKENS, [f"L{i}" for i in range(4)])
    known = np.isfinite(probabilities)
    np.testing.assert_array_equal(view.panels[0].rgb[known], unpack(grid._colours)[known])
    assert tuple(view.panels[0].rgb[1, 2]) == (242, 242, 242)  # an empty cell
    page = view._repr_html_()
    assert "t03" in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script>" not in page


def test_html_escapes_tokens_and_shows_whitespace():
    view = activation_view(np.ones((6, 4), np.float32), TOKENS, title="<b>title</b>")
    page = view._repr_html_()
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;alert" in page and "&lt;b&gt;title" in page
    assert "↵" in page and "␣␣" in page  # a newline and a bare-space token, made visible
    assert page.count("data:image/png;base64,") == 2  # the heatmap and the legend: nothing outside the page


def test_torch_bfloat16_input_is_taken_as_float():
    values = torch.randn(1, 5, 8, dtype=torch.bfloat16)
    view = activation_view(values, TOKENS[:5])
    np.testing.assert_array_equal(view.panels[0].values, values[0].float().numpy().T)


def test_a_batch_is_drawn_a_prompt_a_panel_cut_to_its_tokens_on_one_scale():
    values = np.random.default_rng(3).normal(size=(2, 6, 8)).astype(np.float32)
    view = activation_view(values, [TOKENS, TOKENS[:4]])
    assert [p.values.shape for p in view.panels] == [(8, 6), (8, 4)]  # the second prompt's padding left out
    assert view.panels[0].cell == view.panels[1].cell
    assert [t for _, t in view.panels[1].columns] == ["<s>", " The", " cat", "↵"]


def test_heads_are_flattened_as_the_apps_rows_hold_them():
    values = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # [pos, head, d_head]
    view = activation_view(values, heads=True)
    np.testing.assert_array_equal(view.panels[0].values, values.reshape(2, 12).T)


def test_wide_layers_are_pooled_max_abs():
    values = np.zeros((3, 4096), np.float32)
    values[1, 100] = -5.0
    view = activation_view(values)
    image = view.panels[0].values
    assert image.shape == (256, 3) and image[100 // 16, 1] == -5.0 and "16 features a row" in view.note


@pytest.mark.parametrize("call, message", [
    (lambda: activation_view(np.zeros(5)), "expected \\[pos, d\\]"),
    (lambda: activation_view(np.zeros((1, 2, 3, 4))), "heads=True"),
    (lambda: activation_view(np.zeros((2, 3)), TOKENS), "tokens a prompt for 2 positions"),
    (lambda: activation_view(np.zeros((2, 3, 4)), [["a"], ["b"], ["c"]]), "for each of the 2 prompts"),
    (lambda: pattern_view(np.zeros((2, 1, 3, 3))), "pass one of them"),
    (lambda: pattern_view(np.zeros((2, 3, 3)), head=2), "head 2 of a pattern of 2 heads"),
    (lambda: pattern_view(np.zeros((4, 3))), "more queries than keys"),
    (lambda: compare_view(np.zeros((3, 4)), np.zeros((3, 5))), "4 features a position, b 5"),
    (lambda: compare_view(np.zeros((2, 3, 4)), np.zeros((2, 3, 4))), "one prompt at a time"),
    (lambda: lens_view([["a", "b"]], np.zeros((2, 2))), "must match"),
    (lambda: lens_view([["a"]], np.zeros((1, 1)), layer_labels=["x", "y"]), "2 layer labels for 1 layers"),
])
def test_wrong_shapes_are_refused_clearly(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_pattern_panels_per_head_or_one_head():
    pattern = torch.softmax(torch.randn(1, 3, 4, 4).masked_fill(torch.ones(4, 4).triu(1).bool(), -torch.inf), -1)
    every = pattern_view(pattern, TOKENS[:4])
    one = pattern_view(pattern, TOKENS[:4], head=1)
    assert [p.title for p in every.panels] == ["head 0", "head 1", "head 2"]
    assert [p.title for p in one.panels] == ["head 1"]
    np.testing.assert_array_equal(np.nan_to_num(one.panels[0].values), pattern[0, 1].numpy())
    picture = decode_png(one._repr_png_())
    assert at_cell(picture, one.panels[0], 0, 0) == tuple(lookup_table(DEFAULT_COLORMAP)[255])  # weight 1: the top
    assert at_cell(picture, one.panels[0], 3, 0) == (255, 255, 255)


def test_compare_uses_the_diverging_map_on_symmetric_levels_and_the_relative_change():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(6, 16)).astype(np.float32)
    b = a.copy()
    b[3:] += rng.normal(size=(3, 16)).astype(np.float32)
    view = compare_view(a, b, TOKENS)
    lo, hi = view.levels
    assert lo == -hi and view.colormap == DIFF_COLORMAP
    np.testing.assert_allclose(view.relative_change, np.linalg.norm(b - a, axis=1) / np.linalg.norm(a, axis=1),
                               rtol=1e-6)
    picture = decode_png(view._repr_png_())
    assert at_cell(picture, view.panels[0], 0, 0) == tuple(lookup_table(DIFF_COLORMAP)[127])  # 0: the middle
    assert picture.shape[0] > 16 * view.panels[0].cell[1]  # the relative-change bars under the heatmap


def make_run() -> Run:
    hooks = {name: HookPoint(name, alias, "m", kind, 4, layer=layer) for name, alias, kind, layer in [
        ("l0.mlp", "blocks.0.hook_mlp_out", "mlp_out", 0), ("l1.post", "blocks.1.hook_resid_post", "resid_post", 1),
        ("l0.post", "blocks.0.hook_resid_post", "resid_post", 0)]}
    run = Run(metadata={}, hooks=hooks)
    for rid, positions in (("r0", [0, 1, 2]), ("r1", [1, 3])):  # r1: a capture window kept two rows
        req = RequestCapture(rid, "Hi", [0, 1], {}, token_texts=["Hi", " <x>", "!", "\n"])
        for name in hooks:
            rows = HookRows(4)
            rows.append(positions, positions, np.full((len(positions), 4), float(len(name)), np.float32))
            req.hooks[name] = rows
        run.requests[rid] = req
    return run


def test_run_view_shows_the_hook_the_app_shows_first_a_request_a_panel():
    run = make_run()
    assert default_hook(run.hooks.values()).name == "l0.post"
    view = run_view(run)
    assert view.title == "L0 resid_post · blocks.0.hook_resid_post"
    assert [p.columns for p in view.panels] == [[(0, "Hi"), (1, " <x>"), (2, "!")], [(1, " <x>"), (3, "↵")]]
    assert run_view(run, "blocks.0.hook_mlp_out").title.startswith("L0 mlp_out")
    assert "&lt;x&gt;" in view._repr_html_()
    with pytest.raises(ValueError, match="not an installed hook point"):
        run_view(run, "blocks.9.hook_resid_post")
    with pytest.raises(ValueError, match="no captured rows"):
        run_view(Run(metadata={}))


@pytest.fixture
def heatmap(qtbot, ui_settings):  # noqa: F811
    from inspector.ui.heatmap import HeatmapWidget

    widget = HeatmapWidget()
    keep(qtbot, widget)
    widget.resize(900, 600)
    widget.show()
    qtbot.waitExposed(widget)
    return widget
