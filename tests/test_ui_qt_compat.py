"""The binding's reference-count defects are guarded: constants it drops references to cannot run out."""

import json
import subprocess
import sys

CODE = """
import sys
import inspector.ui  # applies the guard
from PySide6.QtCore import QObject, Signal
from inspector.ui.qt_compat import guard_refcounts

class Carrier(QObject):
    carried = Signal(object)

carrier = Carrier()
carrier.carried.connect(lambda value: None)
before = {name: sys.getrefcount(obj) for name, obj in (("None", None), ("True", True), ("False", False))}
for _ in range(100_000):  # far more than True's own reference count
    carrier.carried.emit(True)
    carrier.carried.emit(False)
    carrier.setObjectName("x")
import json
print(json.dumps({"guarded": sorted(guard_refcounts()),
                  "intact": all(sys.getrefcount(o) > 2**40 or sys.getrefcount(o) >= before[n] - 10
                                for n, o in (("None", None), ("True", True), ("False", False)))}))
"""


def test_guarded_constants_survive_a_flood_of_leaky_calls():
    result = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                            env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]  # no "bool_dealloc"/"none_dealloc" abort at exit
    report = json.loads(result.stdout)
    assert report["intact"], report
