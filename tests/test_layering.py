"""Layers point one way (ui → engine → plugin; capture/io are plain data): checked by importing each
package in a fresh interpreter where the forbidden modules cannot be imported."""

import subprocess
import sys
from pathlib import Path

import pytest

import inspector

PACKAGE = Path(inspector.__file__).parent
BLOCKER = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('layering: ' + name + ' imported from a layer that must not use it')
sys.meta_path.insert(0, Block())
import pkgutil, importlib
for mod in pkgutil.walk_packages([{path!r}], prefix={prefix!r}):
    if mod.name.rsplit('.', 1)[-1] != '__main__':
        importlib.import_module(mod.name)
"""

QT = ["PySide6", "pyqtgraph", "shiboken6"]
RULES = {
    "plugin": QT + ["h5py", "inspector.engine", "inspector.ui", "inspector.io"],
    "engine": QT + ["inspector.ui"],
    "capture": QT + ["torch", "vllm", "h5py", "inspector.engine", "inspector.plugin"],
    "io": QT + ["torch", "vllm", "inspector.engine", "inspector.plugin", "inspector.ui"],
}


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layer_imports_only_what_it_may(layer):
    blocked = {name.split(".")[0] for name in RULES[layer] if not name.startswith("inspector.")}
    inner = [name for name in RULES[layer] if name.startswith("inspector.")]
    code = BLOCKER.format(blocked=blocked, path=str(PACKAGE / layer), prefix=f"inspector.{layer}.")
    code += f"\nbad = [m for m in {inner!r} if m in sys.modules]\nassert not bad, bad\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_qt_outside_ui():
    offenders = [str(p) for p in PACKAGE.rglob("*.py")
                 if "ui" not in p.relative_to(PACKAGE).parts[:1]
                 and any(f"import {qt}" in p.read_text() or f"from {qt}" in p.read_text() for qt in QT)]
    assert not offenders
