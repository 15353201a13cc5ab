"""What a command shows on the terminal while it works: boot stages as lines, long work as a bar."""

from __future__ import annotations

import sys

from inspector.core.protocol import BootProgress, BootTimes


class TerminalProgress:
    """Boot stages as lines, generation as one bar that rewrites itself (plain lines when piped)."""

    def __init__(self, stream=sys.stderr):
        self.stream, self.tty = stream, stream.isatty()
        self.boot_times = BootTimes()

    def stage(self, progress: BootProgress) -> None:
        took = self.boot_times.lap(progress.stage)
        print(f"[{progress.stage}] {progress.message}" + (f" ({took})" if took else ""), file=self.stream, flush=True)

    def tokens(self, done: int, total: int) -> None:
        self.bar("generating", done, total, "tokens")

    def bar(self, doing: str, done: int, total: int, unit: str) -> None:
        if self.tty:
            filled = int(30 * done / max(total, 1))
            print(f"\r[{doing}] [{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {unit}",
                  end="" if done < total else "\n", file=self.stream, flush=True)
        elif done == total or done % 16 == 0:
            print(f"[{doing}] {done}/{total} {unit}", file=self.stream, flush=True)
