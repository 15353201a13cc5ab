"""Activation Inspector: look inside an LLM while vLLM serves it."""

__version__ = "0.1.0"


def harvest(*args, **kwargs):
    """Activations of a corpus in memory, as shuffled training batches: see ``inspector.harvesting.harvest``
    (imported when called: this package is imported inside vLLM's workers too)."""
    from inspector.harvesting import harvest as start

    return start(*args, **kwargs)
