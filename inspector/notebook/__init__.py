"""The engine in a notebook, in TransformerLens's terms: ``Inspector`` and its ``ActivationCache``."""

from .cache import ActivationCache, act_name
from .hooked import Inspector

__all__ = ["ActivationCache", "Inspector", "act_name"]
