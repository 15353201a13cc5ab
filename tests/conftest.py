"""Test-wide set-up: environment for an in-process CPU engine, and the tiny models."""

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from inspector.engine.environment import prepare_environment  # noqa: E402

prepare_environment()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models():
    """Every test architecture's tiny model, built once (and cached across runs)."""
    from inspector.tinymodels import ARCHITECTURES, tiny_model

    return {arch: tiny_model(arch) for arch in ARCHITECTURES}
