"""Activation Inspector: look inside an LLM while vLLM serves it."""

__version__ = "0.1.0"


def harvest(*args, **kwargs):
    """Activations of a corpus in memory, as shuffled training batches: see ``inspector.harvesting.harvest``
    (imported when called: this package is imported inside vLLM's workers too)."""
    from inspector.harvesting import harvest as start

    return start(*args, **kwargs)


def __getattr__(name: str):
    """``from inspector import Inspector``: the notebook API, imported when asked for (not in the engine's
    workers, which import this package too)."""
    if name in ("Inspector", "ActivationCache"):
        import inspector.notebook

        return getattr(inspector.notebook, name)
    raise AttributeError(f"module 'inspector' has no attribute {name!r}")
