"""Layers point one way: ui → viewer → client → net → core (and io, experiments); server → engine → plugin →
core; harvesting and notebook → engine (the notebook also → io, for capture files, and → client, for a server's
engine); cli → all of them, but only once a command runs. Checked by importing every module of a layer in a fresh
interpreter where the modules it must not use cannot be imported, and, for the app, by what a plain import of its
window loads. And the house rules: no module longer than ``MAX_LINES``, and within the plugin no import cycle, with
``vllm_compat``, ``vllm_process`` and ``inductor_compat`` (the modules that touch vLLM's and Inductor's internals)
leaves that import none of the plugin's modules."""

import ast
import re
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
ENGINE = ["torch", "vllm", "transformers"]
NET = ["zmq", "msgspec"]
APP = ["inspector.viewer", "inspector.ui"]
RULES = {
    "core": QT + ENGINE + NET + ["h5py", "inspector.engine", "inspector.plugin", "inspector.io", "inspector.net",
                                    "inspector.client", "inspector.server", *APP],
    "experiments": QT + ENGINE + NET + ["h5py", "inspector.engine", "inspector.plugin", "inspector.io", "inspector.net",
                                        "inspector.client", "inspector.server", *APP],
    "io": QT + ENGINE + NET + ["inspector.engine", "inspector.plugin", "inspector.net", "inspector.client",
                               "inspector.server", *APP],
    "net": QT + ENGINE + ["h5py", "inspector.engine", "inspector.plugin", "inspector.io", "inspector.client",
                          "inspector.server", *APP],
    "client": QT + ENGINE + ["h5py", "inspector.engine", "inspector.plugin", "inspector.server", *APP],
    "plugin": QT + NET + ["h5py", "inspector.engine", "inspector.io", "inspector.net", "inspector.client",
                          "inspector.server", *APP],
    "engine": QT + ["inspector.io", "inspector.net", "inspector.client", "inspector.server", *APP],
    "server": QT + ["inspector.client", *APP],
    "openai": QT + NET + ["inspector.plugin", "inspector.net", "inspector.client", "inspector.server", *APP],
    "harvesting": QT + NET + ["inspector.io", "inspector.net", "inspector.client", "inspector.server", *APP],
    "viewer": QT + ENGINE + ["inspector.engine", "inspector.plugin", "inspector.server", "inspector.ui"],
    "ui": ENGINE + ["inspector.engine", "inspector.plugin", "inspector.server"],
    "notebook": QT + ["inspector.server", *APP],
    "cli": QT + ENGINE + ["inspector.plugin", "inspector.server", *APP],
}
MAX_LINES = 600  # a module a newcomer can read in one sitting; a longer one holds more than one job


def test_every_layer_has_a_rule():
    layers = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert layers - {"testing", "capture"} == set(RULES)  # capture: the core's former name, nothing of its own
    assert [p.name for p in (PACKAGE / "capture").glob("*.py")] == ["__init__.py"]


def test_the_cores_former_name_still_imports_with_a_warning():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import inspector.capture.protocol\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
            "warnings.simplefilter('ignore')\n"
            "import inspector.capture.protocol as old, inspector.core.protocol as new\n"
            "from inspector.capture import Intervention\n"
            "print(old is new, Intervention is new.__dict__.get('Intervention', Intervention))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "warned: inspector.capture is now inspector.core" in result.stdout and "True True" in result.stdout


@pytest.mark.parametrize("layer", sorted(RULES))
def test_layer_imports_only_what_it_may(layer):
    blocked = {name.split(".")[0] for name in RULES[layer] if not name.startswith("inspector.")}
    inner = [name for name in RULES[layer] if name.startswith("inspector.")]
    code = BLOCKER.format(blocked=blocked, path=str(PACKAGE / layer), prefix=f"inspector.{layer}.")
    code += f"\nbad = [m for m in {inner!r} if m in sys.modules]\nassert not bad, bad\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_app_window_loads_neither_torch_nor_vllm():
    # inspector.cli is the app's entry point: the commands it parses must not load the engine either
    code = "import inspector.ui.main_window, inspector.ui.app, inspector.cli, sys; print(sorted(m for m in " \
           "('torch', 'vllm') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


def test_no_qt_outside_ui():
    offenders = [str(p) for p in PACKAGE.rglob("*.py")
                 if "ui" not in p.relative_to(PACKAGE).parts[:1]
                 and any(f"import {qt}" in p.read_text() or f"from {qt}" in p.read_text() for qt in QT)]
    assert not offenders


def test_the_app_reaches_the_engine_only_through_its_session_factory():
    """Not even a deferred import: the window is given a factory (inspector.cli passes the app's own server's)."""
    offenders = [str(p) for layer in ("ui", "viewer", "client") for p in (PACKAGE / layer).rglob("*.py")
                 for name in ("inspector.engine", "inspector.plugin", "inspector.server") if name in p.read_text()]
    assert not offenders


def test_no_module_is_longer_than_max_lines():
    """Every module of the package, the app's included: split a long one by what its parts do."""
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    offenders = sorted(f"{path}: {n} lines" for path, n in lengths.items() if n > MAX_LINES)
    assert not offenders, f"modules over {MAX_LINES} lines: {offenders}"


def test_a_drain_names_no_pseudo_hooks():
    """A drained request's SAE features and scores are fields of ``capture.drained.DrainedRequest``; no
    module names them as made-up hooks beside the rows (the ``@scores`` and ``@features/...`` keys of old)."""
    import inspector.plugin.config

    assert not {"SCORES", "FEATURES", "feature_keys"} & set(vars(inspector.plugin.config))
    pseudo = re.compile(r"""\b(SCORES|FEATURES|feature_keys)\b|["']@(scores|features)""")
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if pseudo.search(p.read_text())]
    assert not offenders


def _plugin_imports() -> dict[str, set[str]]:
    """Per module of inspector.plugin, the plugin modules it imports: at module level, in functions and under
    ``TYPE_CHECKING`` alike (a deferred import is still a dependency)."""
    plugin = PACKAGE / "plugin"
    names = {p.stem for p in plugin.glob("*.py")}
    graph = {}
    for path in plugin.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("inspector.plugin.")}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 0 and not (module == "inspector.plugin" or module.startswith("inspector.plugin.")):
                    continue
                parts = module.split(".")[2:] if node.level == 0 else module.split(".")
                parts = [part for part in parts if part]
                found |= {parts[0]} if parts else {a.name for a in node.names}
        graph[path.stem] = found & names - {path.stem}
    return graph


def test_the_modules_touching_vllms_and_inductors_internals_import_nothing_of_the_plugin():
    graph = _plugin_imports()
    assert not graph["vllm_compat"] and not graph["vllm_process"] and not graph["inductor_compat"]


def test_no_import_cycle_within_the_plugin():
    graph = _plugin_imports()
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(" -> ".join(path[path.index(module):] + [module]))
            return
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert not cycles, cycles
