"""Experiments built on sessions: patching sweeps, clean-vs-intervened twins."""
