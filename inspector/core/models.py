"""Where a model name leads: the built-in demo, a local directory, or a hub id already cached.

Never downloads: a hub id that is not in the local cache is an error that says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from .resources import demo_model_path

DEMO = "demo"


class ModelNotFound(ValueError):
    pass


def looks_like_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def model_path_problem(name: str) -> str | None:
    """Why ``name`` cannot be a model, as far as can be told without the hub cache; None if it may be."""
    if name == DEMO or looks_like_hub_id(name):
        return None
    path = Path(name).expanduser()
    if not path.exists():
        return f"no model directory at {name}"
    if not path.is_dir():
        return f"{name} is a file; a model is a Hugging Face model directory (with config.json)"
    if not (path / "config.json").is_file():
        return f"{path} has no config.json: it is not a Hugging Face model directory"
    return None


def resolve_model(name: str) -> Path:
    """The model's directory; ModelNotFound with the reason."""
    if name == DEMO:
        return demo_model_path()
    problem = model_path_problem(name)
    if problem:
        raise ModelNotFound(problem)
    if looks_like_hub_id(name):
        return _cached_hub_model(name)
    return Path(name).expanduser().resolve()


def _cached_hub_model(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise ModelNotFound(
            f"{repo_id!r} is not a local directory and is not in the Hugging Face cache ({HF_HUB_CACHE}). "
            "Activation Inspector never downloads models: fetch it first (e.g. `huggingface-cli download "
            f"{repo_id}`) or pass the path of a model directory.") from None


def model_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
