"""Regenerate the screenshots in docs/screenshots/ with the real engine (offscreen).

    packaging/dev run python tools/screenshots.py [--model demo|tiny|PATH] [--out docs/screenshots]

Shots: booting.png (staged boot progress), generating.png (a batch mid-generation, heatmap
growing), interventions.png (a steering vector and a scaled hook, their marks on the heatmap),
summary.png (layers x tokens), reopened-capture.png (an exported .h5 reopened without the engine),
remote.png (the app on an ``inspector serve`` in another process, shared with a second client).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="demo")
    p.add_argument("--out", default="docs/screenshots")
    p.add_argument("--size", default="1500x940")
    args = p.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("INSPECTOR_SETTINGS_DIR", tempfile.mkdtemp(prefix="inspector-shots-"))
    from inspector.client.local import start_local_server
    from inspector.ui.app import create_app, gui_environment
    from inspector.ui.settings import configure_storage

    gui_environment()
    configure_storage()
    app = create_app()
    import pyqtgraph as pg

    pg.setConfigOptions(antialias=False)
    from inspector.ui.main_window import MainWindow

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model == "tiny":
        from inspector.testing.tinymodels import tiny_model

        model = str(tiny_model("llama"))
    w, h = (int(x) for x in args.size.split("x"))
    win = MainWindow(start_local_server)
    win.resize(w, h)
    win.show()

    def pump(pred, timeout=600.0):
        t = time.perf_counter()
        while not pred() and time.perf_counter() - t < timeout:
            app.processEvents()
            time.sleep(0.005)
        app.processEvents()

    def shot(name):
        win.refresh()
        app.processEvents()
        path = out / name
        win.grab().save(str(path))
        print("wrote", path)

    hooks = ["blocks.*.hook_resid_post", "blocks.*.hook_mlp_out"]
    win.open_model(model, mode="compiled", hooks=hooks)
    pump(lambda: win.controller.boot_stage == "compiling" or win.state.value != "booting", 300)
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
    pump(lambda: win.controller.generation.tokens >= 150 or win.state.value != "generating")
    win.lower_tabs.setCurrentWidget(win.strip)
    shot("generating.png")
    pump(lambda: win.state.value != "generating")
    live = win.controller.live
    rid = live.request_ids()[0]
    win.select_request(rid)
    hook = next(h.name for h in win.controller.info.catalogue if h.alias == "blocks.1.hook_resid_post")
    win.select_hook(hook)
    n = len(live.request(rid).prompt_token_ids)
    vec, _, _ = live.steering_vector(hook, [(rid, tuple(range(n, n + 8)))], [(rid, tuple(range(0, n)))])
    panel = win.interventions
    row = panel.add_row(hook)
    panel.set_vector(row, "bias", 4 * vec, f"steer 4×(mean {rid}[{n}-{n + 7}] − mean {rid}[0-{n - 1}])")
    mlp = next(h.name for h in win.controller.info.catalogue if h.alias == "blocks.0.hook_mlp_out")
    row2 = panel.add_row(mlp, scale="0.5")
    panel.edit(row2, "Positions", "12-40")
    panel.edit(row2, "Scope", "positions")
    panel.table.selectRow(row)
    win.prompt.prompts.setPlainText("def fibonacci(n):")
    win.prompt.max_tokens.setValue(10)
    win.generate()
    pump(lambda: win.controller.generation.tokens >= 4)
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
    pump(lambda: not win.controller.exporting, 120)
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
    shoot_remote(model, out, w, h, pump, app)
    return 0


def shoot_remote(model: str, out: Path, w: int, h: int, pump, app) -> None:
    """The app connected to a server that another client uses at the same time."""
    import subprocess
    import threading

    from inspector.capture.protocol import Sampling
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
        win.refresh()
        app.processEvents()
        win.grab().save(str(out / "remote.png"))
        print("wrote", out / "remote.png")
        win.close()
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
