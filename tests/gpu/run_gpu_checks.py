"""Run the engine tests that need no display on a CUDA machine, then print a summary table.

    python3 tests/gpu/run_gpu_checks.py [pytest args]

Parity tolerance is 1e-5 there (a float32 engine computes in IEEE float32 on CUDA too), engines get a
modest GPU memory share, and vLLM runs its defaults: compiled, CUDA graphs, its compile cache on (whatever the environment says;
the tests give it a directory of the run's own), its GPU model runner (V2 unless
VLLM_USE_V2_MODEL_RUNNER=0 is set).
"""

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/test_plugin_compiled.py", "tests/test_plugin_architectures.py", "tests/test_plugin_bf16.py",
         "tests/test_session.py", "tests/test_session_lifecycle.py", "tests/test_multimodal.py"]


def main() -> int:
    env = dict(os.environ)
    env.setdefault("INSPECTOR_PARITY_TOL", "1e-5")
    env.setdefault("INSPECTOR_TEST_ENGINE_ARGS", json.dumps({"gpu_memory_utilization": 0.15}))
    env["VLLM_DISABLE_COMPILE_CACHE"] = "0"  # as users run it; the GPU kit's environment turns it off
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    report = Path(os.environ.get("OUT", "/tmp")) / "gpu-junit.xml"
    t0 = time.time()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            "-o", "junit_family=xunit1",  # keeps the recorded figures (record_property)
                            f"--junitxml={report}", *FILES, *sys.argv[1:]], cwd=ROOT, env=env)
    rows, figures = [], []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            figures += [f"{p.get('name')} {p.get('value')}" for p in case.iter("property")]
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                if case.find(tag) is not None:
                    outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
            rows.append((case.get("classname").rsplit(".", 1)[-1], case.get("name"), outcome, float(case.get("time", 0))))
    import torch
    import vllm

    runner = "V1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "default (V2)"
    print(f"\nGPU checks: {torch.cuda.get_device_name(0)}, vLLM {vllm.__version__}, torch {torch.__version__}, "
          f"model runner {runner}, parity tolerance {env['INSPECTOR_PARITY_TOL']}, {time.time() - t0:.0f} s")
    print(f"{'module':28s} {'test':70s} {'outcome':8s} {'s':>6s}")
    for module, name, outcome, seconds in rows:
        print(f"{module:28s} {name[:70]:70s} {outcome:8s} {seconds:6.1f}")
    counts = {o: sum(1 for r in rows if r[2] == o) for o in ("passed", "FAILED", "ERROR", "skipped")}
    if figures:
        print("recorded figures: " + ", ".join(figures))
    print(f"{counts['passed']} passed, {counts['FAILED'] + counts['ERROR']} failed, {counts['skipped']} skipped")
    return code


if __name__ == "__main__":
    sys.exit(main())
