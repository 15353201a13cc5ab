"""How often threads take turns holding the GIL."""

from __future__ import annotations

import os
import sys


def prompt_thread_switches() -> None:
    """A thread taking the GIL back (after a copy, a socket's wait, a repaint's call into Qt) beside a
    thread busy in Python (the engine's between forwards) waits up to the interpreter's switch interval
    each time: 5 ms by default. Beside a spinning thread, copies of 2 MiB moved 0.36 GB/s at 5 ms and
    1.5 GB/s at 1 ms on the project's CPU (figures: docs/performance-notes.md)."""
    sys.setswitchinterval(float(os.environ.get("INSPECTOR_SWITCH_INTERVAL", "0.001")))
