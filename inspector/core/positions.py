"""Token positions as people type them, one syntax for the app and the command line.

``3-7, 10`` and ``3-5;8`` both work: items are separated by commas, semicolons or spaces (the CLI's
``--intervene`` uses commas between its keys, so there positions take semicolons), and a range is
``a-b``, ``a..b`` or ``a:b``, both ends included.
"""

from __future__ import annotations

import re

MAX_RANGE = 1_000_000


def parse_positions(text: str) -> tuple[int, ...]:
    """Sorted, distinct positions; ValueError with the reason."""
    out: set[int] = set()
    for part in re.split(r"[,;\s]+", text.strip()):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:(?:-|\.\.|:)(\d+))?", part)
        if not m:
            raise ValueError(f"{part!r} is not a position or range (write e.g. 3-7, 10)")
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a:
            raise ValueError(f"range {part!r} runs backwards")
        if b - a > MAX_RANGE:
            raise ValueError(f"range {part!r} is too long")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("no positions given")
    return tuple(sorted(out))


def format_positions(positions) -> str:
    """The inverse of ``parse_positions``, with runs collapsed into ranges."""
    runs: list[list[int]] = []
    for p in sorted({int(p) for p in positions}):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
