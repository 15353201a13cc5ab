"""Where a model name leads: the built-in demo, a local directory, or a hub id already cached.

Never downloads: a hub id that is not in the local cache is an error that says so.
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO = "demo"


class ModelNotFound(ValueError):
    pass


def resolve_model(name: str) -> Path:
    if name == DEMO:
        from inspector.demo import demo_model_path

        return demo_model_path()
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFound(f"{name} is a file; a model is a Hugging Face model directory (with config.json)")
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: it is not a Hugging Face model directory")
        return path.resolve()
    if name.count("/") == 1 and not name.startswith((".", "/", "~")):
        return _cached_hub_model(name)
    raise ModelNotFound(f"no model directory at {name}")


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
