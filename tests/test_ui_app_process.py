"""The app as a user starts it: ``inspector`` with its own server in a child process. The app's process
never imports torch or vLLM, and an engine that dies is said so, with the captures kept."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, os, signal, sys, time
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

report = {}

def drive():
    from inspector.ui.main_window import MainWindow
    windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
    if not windows or windows[0].state.value != "ready":
        return QTimer.singleShot(50, drive)
    w = windows[0]
    if "generated" not in report:
        w.prompt.prompts.setPlainText("def f(x):")
        w.prompt.max_tokens.setValue(6)
        w.generate()
        report["generated"] = True
        return QTimer.singleShot(50, drive)
    live = w.controller.runs.live
    req = live.request(live.request_ids()[0])
    report.update(tokens=len(req.generated_token_ids), rows=sum(len(r) for r in req.hooks.values()),
                  modules=sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules),
                  title=w.windowTitle())
    os.kill(w.controller.engine.session.process.pid, signal.SIGKILL)  # the engine dies while the app is idle
    def dead():
        if w.state.value != "dead":
            return QTimer.singleShot(50, dead)
        report.update(dialog=w.last_dialog.text(), kept=len(live.request_ids()))
        w.last_dialog.close()
        w.close()
    dead()

QTimer.singleShot(0, drive)
from inspector.cli import main
code = main(sys.argv[1:])
print("REPORT", json.dumps(report), flush=True)
sys.exit(code)
"""


def test_the_app_runs_its_engine_in_a_child_and_survives_losing_it(tiny_models, tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "INSPECTOR_SETTINGS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, "--model", str(tiny_models["llama"]), "--mode", "eager"],
                            capture_output=True, text=True, timeout=600, env=env)
    line = next((x for x in result.stdout.splitlines() if x.startswith("REPORT ")), None)
    assert result.returncode == 0 and line, result.stderr[-3000:]
    report = json.loads(line[len("REPORT "):])
    assert report["modules"] == [], "the app's own process imported the engine"
    assert report["tokens"] == 6 and report["rows"] > 0 and report["title"].endswith("(eager)")
    assert "The engine is gone" in report["dialog"] and "exited with code -9" in report["dialog"]
    assert report["kept"] == 1
