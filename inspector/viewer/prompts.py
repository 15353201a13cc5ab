"""How the prompt box's text becomes prompts: one per line (a batch typed quickly), the whole text as one
prompt (a code snippet keeps its newlines), or prompts between separator lines (several multi-line
prompts in one batch). The rule is the user's choice, on show beside the box with what it gives.
"""

from __future__ import annotations

LINES, WHOLE, SEPARATED = "lines", "whole", "separated"
SEPARATOR = "---"
RULES = {LINES: "One prompt per line", WHOLE: "One prompt (newlines kept)",
         SEPARATED: f"Prompts between {SEPARATOR} lines"}
PLACEHOLDERS = {
    LINES: "One prompt per line; several lines run as one batch. Ctrl+Enter generates.",
    WHOLE: "The whole text is one prompt, newlines kept (a code snippet). Ctrl+Enter generates.",
    SEPARATED: f"Prompts may span lines; a line of {SEPARATOR} alone separates them, and they run as one batch. "
               "Ctrl+Enter generates."}


def split_prompts(text: str, rule: str) -> list[str]:
    """The prompts ``text`` holds under ``rule``; blank ones are dropped. Between separators, the blank
    lines around a prompt are layout and go; its own lines and indentation stay."""
    if rule == WHOLE:
        return [text] if text.strip() else []
    if rule == LINES:
        return [line for line in text.splitlines() if line.strip()]
    prompts, block = [], []
    for line in [*text.splitlines(), SEPARATOR]:
        if line.strip() != SEPARATOR:
            block.append(line)
            continue
        while block and not block[-1].strip():
            block.pop()
        while block and not block[0].strip():
            block.pop(0)
        if block:
            prompts.append("\n".join(block))
        block = []
    return prompts


def describe_split(prompts: list[str], rule: str) -> str:
    """What the rule gives now, said beside the box: how many prompts, and how they run."""
    n = len(prompts)
    if not n:
        return "No prompt yet"
    count = f"{n} prompt{'s' * (n != 1)}"
    if n == 1:
        lines = len(prompts[0].splitlines())
        return f"{count} of {lines} lines" if lines > 1 else count
    return f"{count}, run as one batch"
