"""Where a bench's time went: sums a ``py-spy record --format raw`` file by the runs' labelled frames.

    python3 bench/stacks.py STACKS [--label-pattern REGEX] [--top N]

The benches run each measured call through a frame named for it (``session_bench``: ``memory_b32``,
``vanilla_b256``, ...). For each label: its samples, and the functions under it by inclusive share
(all frames, then only the project's) and by self share (the leaf frame).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict


def frame_function(frame: str) -> str:
    """``name (path:line)`` → ``name (file)``: lines of one function are summed."""
    match = re.match(r"(.*?) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    name, path = match.groups()
    parts = path.split("/")
    for root in ("inspector", "vllm", "torch", "transformers", "h5py", "numpy"):
        if root in parts:
            return f"{name} ({'/'.join(parts[parts.index(root):])})"
    return f"{name} ({parts[-1]})"


def by_label(lines, label_pattern: str) -> dict[str, list[tuple[list[str], int]]]:
    """Each label's stacks below its frame, with their sample counts."""
    label = re.compile(label_pattern)
    runs = defaultdict(list)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        for k, frame in enumerate(frames):
            name = frame.split(" (", 1)[0]
            if label.fullmatch(name):
                runs[name].append(([frame_function(f) for f in frames[k + 1:]], int(count)))
                break
    return runs


def summary(stacks: list[tuple[list[str], int]], top: int) -> str:
    total = sum(count for _, count in stacks)
    inclusive, own, leaf = Counter(), Counter(), Counter()
    for frames, count in stacks:
        for name in set(frames):
            inclusive[name] += count
            if "(inspector/" in name:
                own[name] += count
        leaf[frames[-1] if frames else "(the label itself)"] += count
    out = [f"  {total} samples"]
    for title, counter in (("inclusive", inclusive), ("inclusive, the project's", own), ("self", leaf)):
        out.append(f"  {title}:")
        out += [f"    {100 * n / total:5.1f}%  {name}" for name, n in counter.most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stacks")
    p.add_argument("--label-pattern", default=r"[a-z]+_b\d+")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    with open(args.stacks) as f:
        runs = by_label(f, args.label_pattern)
    if not runs:
        print("no labelled frames in", args.stacks, file=sys.stderr)
        return 1
    for name in sorted(runs):
        print(f"{name}:\n{summary(runs[name], args.top)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
