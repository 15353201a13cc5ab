"""Short, readable text for hook points and tokens: kept in ``inspector.core.labels``, which the notebook's
views share; named here for the app's modules."""

from inspector.core.labels import display_token, hook_sort_key, short_hook_label

__all__ = ["display_token", "hook_sort_key", "short_hook_label"]
