"""Activation Inspector: look inside an LLM while vLLM serves it."""

__version__ = "0.1.0"
