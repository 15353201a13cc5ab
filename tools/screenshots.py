"""Regenerate the screenshots in docs/screenshots/ with the real engine (offscreen).

    packaging/dev run python tools/screenshots.py [--model demo|tiny|PATH] [--out docs/screenshots]
                                                  [--only main remote lens attention compare patching
                                                          experts features dashboard]

Shots: booting.png (staged boot progress), generating.png (a batch mid-generation, heatmap
growing), interventions.png (a steering vector and a scaled hook, their marks on the heatmap),
summary.png (layers x tokens), reopened-capture.png (an exported .h5 reopened without the engine):
the "main" group; remote.png (the app on an ``inspector serve`` in another process, shared with a
second client): "remote"; lens.png (the logit lens of every residual-stream point): "lens";
attention.png (a head's pattern and one token's row of every head, from captured q and k): "attention";
compare.png (a prompt run clean and steered, side by side, with their divergence): "compare";
patching.png (an activation-patching sweep over layers × positions, a cell's patched run below): "patching";
experts.png (a mixture-of-experts model's routing, tokens × experts, on the tiny OLMoE the tests build, since
the demo model has no experts): "experts"; features.png (the demo SAE's features of a Python prompt, a
feature selected and plotted across the tokens): "features"; dashboard.png (the demo SAE's shipped scan
as a dashboard, a feature's top examples and histogram): "dashboard".
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

GROUPS = ["main", "remote", "lens", "attention", "compare", "patching", "experts", "features", "dashboard", "windows"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--out", default="docs/screenshots")
    p.add_argument("--size", default="1440x900", help="the window's size (default: the app's own default window)")
    p.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS, help="make only these groups of shots")
    args = p.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("INSPECTOR_SETTINGS_DIR", tempfile.mkdtemp(prefix="inspector-shots-"))
    from inspector.ui.app import create_app, gui_environment
    from inspector.ui.settings import configure_storage

    gui_environment()
    configure_storage()
    app = create_app()
    import pyqtgraph as pg

    pg.setConfigOptions(antialias=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "tiny":
        from inspector.testing.tinymodels import tiny_model

        model = str(tiny_model("llama"))
    w, h = (int(x) for x in args.size.split("x"))

    def pump(pred, timeout=600.0):
        t = time.perf_counter()
        while not pred() and time.perf_counter() - t < timeout:
            app.processEvents()
            time.sleep(0.005)
        app.processEvents()

    if "main" in args.only and shoot_main(model, out, w, h, pump, app):
        return 1
    if "remote" in args.only:
        shoot_remote(model, out, w, h, pump, app)
    if "lens" in args.only:
        shoot_lens(model, out, w, h, pump, app)
    if "attention" in args.only:
        shoot_attention(model, out, w, h, pump, app)
    if "compare" in args.only:
        shoot_compare(model, out, w, h, pump, app)
    if "patching" in args.only:
        shoot_patching(model, out, w, h, pump, app)
    if "experts" in args.only:
        shoot_experts(out, w, h, pump, app)
    if "features" in args.only:
        shoot_features(model, out, w, h, pump, app)
    if "dashboard" in args.only:
        shoot_dashboard(out, w, h, app)
    if "windows" in args.only:
        shoot_windows(model, out, w, h, pump, app)
    return 0


def shoot_main(model: str, out: Path, w: int, h: int, pump, app) -> int:
    """Boot, generate, intervene, the summary, and a capture reopened without the engine; 1 if the boot failed."""
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()

    def shot(name):
        save(win, app, out / name)

    hooks = ["blocks.*.hook_resid_post", "blocks.*.hook_mlp_out"]
    win.open_model(model, mode="compiled", hooks=hooks)
    pump(lambda: win.controller.engine.boot_stage == "compiling" or win.state.value != "booting", 300)
    pump(lambda: False, 1.5)
    shot("booting.png")
    pump(lambda: win.state.value != "booting")
    if win.state.value != "ready":
        print("boot failed:", win.last_dialog.text() if win.last_dialog else win.state, file=sys.stderr)
        return 1
    win.prompt.prompts.setPlainText("def fibonacci(n):\nclass Stack:\nimport os\nfor i in range(")
    win.prompt.max_tokens.setValue(160)
    win.prompt.ignore_eos.setChecked(True)
    win.generate()
    pump(lambda: win.controller.generating.progress.tokens >= 150 or win.state.value != "generating")
    win.lower_tabs.setCurrentWidget(win.strip)
    shot("generating.png")
    pump(lambda: win.state.value != "generating")
    live = win.controller.runs.live
    rid = live.request_ids()[0]
    win.select_request(rid)
    hook = next(h.name for h in win.controller.engine.info.catalogue if h.alias == "blocks.1.hook_resid_post")
    win.select_hook(hook)
    n = len(live.request(rid).prompt_token_ids)
    vec, _, _ = live.steering_vector(hook, [(rid, tuple(range(n, n + 8)))], [(rid, tuple(range(0, n)))])
    panel = win.interventions
    row = panel.add_row(hook)
    panel.set_vector(row, "bias", 4 * vec, f"steer 4×(mean {rid}[{n}-{n + 7}] − mean {rid}[0-{n - 1}])")
    mlp = next(h.name for h in win.controller.engine.info.catalogue if h.alias == "blocks.0.hook_mlp_out")
    row2 = panel.add_row(mlp, scale="0.5")
    panel.edit(row2, "Positions", "12-40")
    panel.edit(row2, "Scope", "positions")
    panel.table.selectRow(row)
    win.prompt.prompts.setPlainText("def fibonacci(n):")
    win.prompt.max_tokens.setValue(10)
    win.generate()
    pump(lambda: win.controller.generating.progress.tokens >= 4)
    panel.edit(row2, "Scale", "0.25")  # an edit mid-generation: applies from the next forward
    pump(lambda: win.state.value != "generating")
    win.prompt.max_tokens.setValue(60)
    win.generate()
    pump(lambda: win.state.value != "generating")
    win.select_request(live.request_ids()[-1])
    win.select_hook(hook)
    win.strip.select_range(n, n + 3)
    win.select_position(n + 2)
    shot("interventions.png")
    win.tabs.setCurrentWidget(win.summary)
    shot("summary.png")
    win.tabs.setCurrentWidget(win.heatmap)
    path = Path(tempfile.mkdtemp()) / "capture.h5"
    win.export(str(path))
    pump(lambda: not win.controller.runs.exporting, 120)
    win.close()

    win = MainWindow(start_local_server)  # a fresh window with no engine: File > Open Capture
    win.resize(w, h)
    win.show()
    win.open_capture(str(path))
    win.select_request(win.shown.request_ids()[1])
    win.select_hook(next(h.name for h in win.shown.hooks_for(None) if h.kind == "mlp_out"))
    win.strip.select_position(5)
    win.select_position(5)
    shot("reopened-capture.png")
    win.close()
    return 0


def shoot_remote(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The app connected to a server that another client uses at the same time."""
    import subprocess
    import threading

    from inspector.core.protocol import Sampling
    from inspector.client import connect
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    url = "tcp://127.0.0.1:5557"
    server = subprocess.Popen([sys.executable, "-m", "inspector.cli", "serve", "--model", model, "--mode", "eager",
                               "--hooks", "blocks.*.hook_resid_post", "--listen", url],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        win = MainWindow(start_local_server)
        win.resize(w, h)
        win.show()
        win.connect(url)
        pump(lambda: win.state.value != "booting", 300)
        other = connect(url)
        thread = threading.Thread(target=lambda: list(other.generate(["import os\n"] * 2, Sampling(max_tokens=200))))
        thread.start()  # a second client, generating at the same time
        win.prompt.prompts.setPlainText("def fibonacci(n):\nclass Stack:")
        win.prompt.max_tokens.setValue(96)
        win.generate()
        pump(lambda: win.state.value != "generating")
        thread.join()
        other.close()
        win.lower_tabs.setCurrentWidget(win.strip)
        save(win, app, out / "remote.png")
        win.close()
    finally:
        server.terminate()
        server.wait(60)


def shoot_lens(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The Lens tab on every residual-stream point of a short Python prompt, with a cell clicked where
    the token that came next climbs to the top over the layers."""
    import numpy as np

    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow
    from inspector.viewer.lens import ALL_RESIDUAL

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    win.interventions_dock.hide()  # room for more tokens
    generate_on(win, pump, model, ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_mid", "blocks.*.hook_resid_post"],
                win.lens_view, 12)
    win.lens_view.kind_box.setCurrentText(ALL_RESIDUAL)
    cells = win.lens_view.cells

    def lensed():
        win.refresh()
        return cells.grid is not None and cells.grid.shape[1] and (cells.grid.top_ids[:, :, 0] >= 0).all()

    pump(lensed, 120)
    ranks = cells.grid.chosen_ranks
    last = len(ranks) - 1
    climb = np.where(ranks[last] == 0, ranks[0] - ranks[last], -1)  # the next token: far down at first, the top at last
    cells.horizontalScrollBar().setValue(0)
    win.lens_view.click_cell(last, int(np.argmax(climb)))
    save(win, app, out / "lens.png")
    win.interventions_dock.show()  # the settings keep the window's layout
    win.close()


def save(win, app, path: Path, refresh: bool = True) -> None:
    """The window as it is now (repainted first unless ``refresh`` is False) as ``path``."""
    if refresh:
        win.refresh()
    app.processEvents()
    win.grab().save(str(path))
    print("wrote", path)


def generate_on(win, pump, model: str, hooks: list[str], tab, max_tokens: int) -> None:
    """Open ``model`` capturing ``hooks``, show ``tab`` and generate from the shots' Python prompt."""
    win.open_model(model, mode="compiled", hooks=hooks)
    pump(lambda: win.state.value != "booting", 300)
    win.tabs.setCurrentWidget(tab)
    win.prompt.prompts.setPlainText("for i in range(")
    win.prompt.max_tokens.setValue(max_tokens)
    win.prompt.ignore_eos.setChecked(True)
    win.generate()
    pump(lambda: win.state.value != "generating")


def shoot_windows(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """Capture windows: block 1's residual stream every 4th position, block 2's only where tokens are
    generated; the heatmap shows the rows kept at their positions."""
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    win.open_model(model, mode="compiled", hooks=["blocks.*.hook_resid_post"])
    pump(lambda: win.state.value != "booting", 300)
    names = {h.alias: h.name for h in win.controller.engine.info.catalogue}
    win.tree.set_window(names["blocks.1.hook_resid_post"], "every:4")
    win.tree.set_window(names["blocks.2.hook_resid_post"], "generated")
    win.tree.filter_box.setText("resid_post")
    win.prompt.prompts.setPlainText("def fibonacci(n):")
    win.prompt.max_tokens.setValue(40)
    win.prompt.ignore_eos.setChecked(True)
    win.generate()
    pump(lambda: win.state.value != "generating")
    win.select_hook(names["blocks.1.hook_resid_post"])
    save(win, app, out / "windows.png")
    win.close()


def shoot_attention(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The Attention tab on a Python prompt. On the demo model, layer 2's head 2 sends most of each
    token's attention to the newline that starts its line (found by printing, per head, where each
    token's largest weight falls): a staircase under the diagonal, one step per line."""
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    for dock in (win.interventions_dock, win.prompt_dock):  # room for the tokens: rows tall enough for their text
        dock.hide()
    win.tabs.parentWidget().setSizes([800, 90])
    generate_on(win, pump, model, ["blocks.*.attn.hook_q", "blocks.*.attn.hook_k"], win.attention_view, 32)
    view = win.attention_view
    view.layer_box.setCurrentIndex(view.layer_box.findData(2))
    view.select_head(2)
    texts = win.shown.token_texts(win.shown.selection.request)
    query = max(i for i, text in enumerate(texts[:-1]) if "close" in text)  # the last token has no row
    win.select_position(query)
    win.refresh()
    shown = view.shown
    key = max(range(query + 1), key=lambda k: shown.weight(shown.head, query, k))
    view.hover(view.pattern_plot, key, query)
    save(win, app, out / "attention.png", refresh=False)  # the hover read-out stays
    for dock in (win.interventions_dock, win.prompt_dock):
        dock.show()  # the settings keep the window's layout
    win.close()


def shoot_experts(out: Path, w: int, h: int, pump, app) -> None:
    """The Experts tab on a tiny random-weight OLMoE (4 experts, 2 per token): which experts each token
    of a Python prompt went to in block 1, with a chosen cell hovered."""
    from inspector.client.local import start_local_server
    from inspector.testing.tinymodels import tiny_model
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    generate_on(win, pump, str(tiny_model("olmoe")), ["blocks.*.mlp.hook_router"], win.experts_view, 24)
    view = win.experts_view
    view.layer_box.setCurrentText("L1")
    win.refresh()
    view.cells.horizontalScrollBar().setValue(0)  # from the first token (a live grid follows the newest)
    view.cells.cellHovered.emit(int(view.cells.grid.ids[3, 0]), 3)  # the top expert of the fourth token
    save(win, app, out / "experts.png", refresh=False)  # the hover read-out stays
    win.close()


def shoot_features(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The Features tab: the demo SAE attached to the demo model, a Python prompt generated, and the
    feature that fires on most of its tokens selected (its row outlined, its activation plotted), with
    the labels from the SAE's shipped scan."""
    import numpy as np

    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    win.interventions_dock.hide()  # room for the tokens
    win.tabs.parentWidget().setSizes([800, 90])
    win.open_model(model, mode="compiled", hooks=["blocks.*.hook_resid_post"])
    pump(lambda: win.state.value != "booting", 300)
    win.attach_demo_sae()
    pump(lambda: bool(win.controller.engine.info.saes), 120)
    win.tabs.setCurrentWidget(win.features_view)
    win.prompt.prompts.setPlainText("def read_config(path):\n    with open(path) as f:\n        return")
    win.prompt.max_tokens.setValue(16)
    win.prompt.ignore_eos.setChecked(True)
    win.generate()
    pump(lambda: win.state.value != "generating")
    win.refresh()
    view = win.features_view
    grid = view.cells.grid
    view.cells.horizontalScrollBar().setValue(0)
    row = int(np.argmax([(grid.trace(int(f)) > 0).sum() for f in grid.features[:12]]))
    view.cells.cellClicked.emit(row, int(np.argmax(grid.trace(int(grid.features[row])))))
    save(win, app, out / "features.png")
    win.interventions_dock.show()  # the settings keep the window's layout
    win.close()


def shoot_dashboard(out: Path, w: int, h: int, app) -> None:
    """The Dashboard tab on the demo SAE's shipped scan (no engine needed): feature 565, which fires on
    "may", "must" and "not" in docstrings (found by listing the strongest features whose top tokens are
    a few words), its examples with the token highlighted and its histogram."""
    from inspector.core.resources import demo_sae_path
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    docks = (win.tree_dock, win.interventions_dock, win.prompt_dock)
    for dock in docks:  # room for the examples
        dock.hide()
    win.tabs.parentWidget().setSizes([800, 90])
    assert win.open_scan(str(demo_sae_path() / "scan.h5"))
    app.processEvents()
    win.dashboard_view.select_unit(565)
    save(win, app, out / "dashboard.png")
    for dock in docks:
        dock.show()  # the settings keep the window's layout
    win.close()


def shoot_compare(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The Compare tab: Python prompts run clean and steered toward comments (a bias at block 2's
    residual stream along mean('# a comment') − mean('x = 1'), from a first run's captures). On the
    demo model the steered twin of "def fibonacci(n):" turns its body into a docstring two tokens in."""
    from PySide6.QtWidgets import QMessageBox

    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    win.tree_dock.hide()  # room for the twins' texts side by side, and for the tab's three parts
    win.tabs.parentWidget().setSizes([800, 90])
    win.open_model(model, mode="compiled", hooks=["blocks.*.hook_resid_post"])
    pump(lambda: win.state.value != "booting", 300)
    win.prompt.prompts.setPlainText("# a comment\nx = 1")
    win.prompt.max_tokens.setValue(1)
    win.generate()
    pump(lambda: win.state.value != "generating")
    live = win.controller.runs.live
    comment, code = live.request_ids()
    alias = {p.alias: p.name for p in win.controller.engine.info.catalogue}
    hook = alias["blocks.2.hook_resid_post"]
    vec, _, _ = live.steering_vector(hook, [(comment, tuple(range(len(live.request(comment).prompt_token_ids))))],
                                     [(code, tuple(range(len(live.request(code).prompt_token_ids))))])
    win.controller.runs.new_run()  # File > New Run: the comparison alone in the run
    win.last_dialog.button(QMessageBox.StandardButton.Yes).click()
    panel = win.interventions
    row = panel.add_row(hook)
    panel.set_vector(row, "bias", 0.75 * vec, "steer 0.75×(mean '# a comment' − mean 'x = 1')")
    win.prompt.compare.setChecked(True)
    win.prompt.prompts.setPlainText("def fibonacci(n):\nclass Stack:")
    win.prompt.max_tokens.setValue(40)
    win.prompt.ignore_eos.setChecked(True)
    win.tabs.setCurrentWidget(win.compare_view)
    win.generate()
    pump(lambda: win.state.value != "generating")
    win.select_hook(alias["blocks.3.hook_resid_post"])
    pump(lambda: False, 0.5)  # the strip ranges over its bars
    save(win, app, out / "compare.png")
    win.tree_dock.show()  # the settings keep the window's layout
    win.close()


def shoot_patching(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The Patching tab on its default pair, where the demo model copies an argument's name after
    ``return``: denoising each layer's resid_pre, the name's own position carries the answer at layer
    0 and the last position from layer 1 on. The last position's layer-3 cell is clicked: its patched
    run (the corrupted prompt, that cell from the clean one) generates below."""
    from inspector.client.local import start_local_server
    from inspector.ui.main_window import MainWindow

    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()
    win.interventions_dock.hide()  # room for the grid and its details
    win.open_model(model, mode="compiled", hooks=["blocks.*.hook_resid_pre"])
    pump(lambda: win.state.value != "booting", 300)
    view = win.patching_view
    win.tabs.setCurrentWidget(view)
    win.lower_tabs.setCurrentWidget(win.text_view)
    win.prompt.max_tokens.setValue(12)
    view.run_button.click()
    pump(lambda: win.state.value != "patching")
    view.repaint_sweep()
    rows, columns = view.cells.grid.shape
    view.click_cell(rows - 1, columns - 1)
    pump(lambda: win.state.value != "generating")
    view.repaint_sweep()
    save(win, app, out / "patching.png")
    win.interventions_dock.show()  # the settings keep the window's layout
    win.close()


if __name__ == "__main__":
    sys.exit(main())
