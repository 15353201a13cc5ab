"""Files the app ships (the demo model and the icons, in a source checkout or an installed wheel) and
where it keeps its own (the cache)."""

from __future__ import annotations

import os
from pathlib import Path

DEMO_DIRNAME = "demo-model"
DEMO_SAE_DIRNAME = "demo-sae"  # an SAE on the demo model's blocks.2.hook_resid_post, with a scan (tools/demo_sae.py)


def resources_dir() -> Path:
    """``inspector/resources`` in a wheel (a link to ``<repo>/resources`` in a checkout)."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "resources", package.parent / "resources"):
        if (candidate / DEMO_DIRNAME).is_dir() or (candidate / "icons").is_dir():
            return candidate.resolve()
    raise FileNotFoundError(f"no resources directory (with {DEMO_DIRNAME}/ or icons/) next to {package} "
                            "(is the package installed from a wheel built with resources/?)")


def demo_model_path() -> Path:
    """The shipped demo model (a Hugging Face directory vLLM can load); $INSPECTOR_DEMO_MODEL overrides."""
    override = os.environ.get("INSPECTOR_DEMO_MODEL")
    return Path(override) if override else resources_dir() / DEMO_DIRNAME


def demo_sae_path() -> Path:
    """The shipped demo SAE (SAELens's format, with its scan.h5 and training.json)."""
    return resources_dir() / DEMO_SAE_DIRNAME


def icon_path(size: int = 256) -> Path:
    """The app icon: the SVG for size 0, else the PNG of that size."""
    icons = resources_dir() / "icons"
    return icons / ("activation-inspector.svg" if size == 0 else f"activation-inspector-{size}.png")


def cache_root() -> Path:
    """Built test models, write-through runs' scratch files; $INSPECTOR_CACHE overrides."""
    return Path(os.environ.get("INSPECTOR_CACHE", Path.home() / ".cache" / "activation-inspector"))
